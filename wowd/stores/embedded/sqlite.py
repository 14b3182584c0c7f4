"""The SQLite library of the embedded backend, and what it does on one with the WAL-reset bug.

SQLite 3.7.0 to 3.51.2 have the WAL-reset bug (https://sqlite.org/wal.html#walresetbug): when one
connection starts a checkpoint while another one's write resets the WAL, the checkpoint can miss
the reset, and a later checkpoint then skips pages of a transaction; the file is corrupt. Fixed in
3.51.3, back-ported to 3.44.6 and 3.50.7. The embedded backend is that workload (replicas and the
application writing one file, each replica checkpointing it in the background), and Python's own
``sqlite3`` module uses the system's library (Debian 12: 3.40.1).

So wowd uses ``pysqlite3``, the standard library's module built with a SQLite of its own, where it
is installed (a dependency on the platforms it has wheels for), and the standard library's module
elsewhere. On a library with the bug (:data:`WAL_RESET_BUG`) the embedded stores avoid the race:
no connection checkpoints on its own after a commit (``wal_autocheckpoint=0``), and the background
checkpoint is ``FULL``, which holds the write lock while it runs, so no write can reset the WAL
under it (writers wait for it instead).

Every module of wowd that opens the file imports ``sqlite3`` from here: two SQLite libraries in
one process must not open the same file (each keeps its own POSIX locks, and closing a file in one
releases the other's locks).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlite3
else:
    try:
        from pysqlite3 import dbapi2 as sqlite3
    except ImportError:  # no pysqlite3 wheel for this platform: the standard library's module
        import sqlite3

__all__ = ["LIBRARY", "MODULE", "WAL_RESET_BUG", "has_wal_reset_bug", "sqlite3", "variable_limit"]

MODULE = "pysqlite3" if sqlite3.__name__.startswith("pysqlite3") else "sqlite3"
"""The module in use: ``pysqlite3`` or the standard library's ``sqlite3``."""
LIBRARY = f"SQLite {sqlite3.sqlite_version} ({MODULE})"
"""The library in use, as ``wowd check`` and the start-up log say it."""


def has_wal_reset_bug(version: tuple[int, int, int]) -> bool:
    """Whether SQLite ``version`` has the WAL-reset bug: 3.7.0 to 3.51.2, except the back-ports
    (3.44.6 and later 3.44 releases, 3.50.7 and later 3.50 releases)."""
    if not (3, 7, 0) <= version <= (3, 51, 2):
        return False
    if version[:2] == (3, 44) and version >= (3, 44, 6):
        return False
    return not (version[:2] == (3, 50) and version >= (3, 50, 7))


WAL_RESET_BUG = has_wal_reset_bug(sqlite3.sqlite_version_info)
"""Whether the library in use has the bug."""


DEFAULT_MAX_VARIABLES = 32_766
"""SQLite's own bound on a statement's parameters (since 3.32.0) when its build says none."""


def variable_limit(conn: sqlite3.Connection) -> int:
    """The most parameters one statement may have on ``conn``: its limit where the module reads
    it (``getlimit``, the standard library's), else the library's compile-time bound."""
    getlimit = getattr(conn, "getlimit", None)
    if getlimit is not None:
        return int(getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    return _compiled_max_variables()


@functools.cache
def _compiled_max_variables() -> int:
    conn = sqlite3.connect(":memory:")
    try:
        for (option,) in conn.execute("PRAGMA compile_options"):
            name, _, value = str(option).partition("=")
            if name == "MAX_VARIABLE_NUMBER" and value.isdigit():
                return int(value)
    finally:
        conn.close()
    return DEFAULT_MAX_VARIABLES
