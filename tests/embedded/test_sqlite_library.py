"""The SQLite library of the embedded backend: one, free of the WAL-reset bug where wowd ships it,
and on a library with the bug, no checkpoint that a write can reset the WAL under."""

from __future__ import annotations

import ast
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import wowd
from wowd.stores.embedded import db as db_module
from wowd.stores.embedded.db import SqliteDatabase, WalCheckpointer
from wowd.stores.embedded.sqlite import WAL_RESET_BUG, has_wal_reset_bug, sqlite3, variable_limit

ROOT = Path(wowd.__file__).parent


@pytest.mark.parametrize(
    ("version", "bug"),
    [
        ((3, 6, 23), False),  # before WAL mode
        ((3, 7, 0), True),
        ((3, 40, 1), True),  # Debian 12's
        ((3, 44, 5), True),
        ((3, 44, 6), False),  # the back-port
        ((3, 45, 0), True),
        ((3, 50, 6), True),
        ((3, 50, 7), False),  # the back-port
        ((3, 51, 2), True),
        ((3, 51, 3), False),  # the fix
        ((3, 53, 4), False),
    ],
)
def test_the_versions_with_the_wal_reset_bug(version: tuple[int, int, int], bug: bool) -> None:
    assert has_wal_reset_bug(version) is bug


@pytest.mark.skipif(
    not (
        (sys.platform == "linux" and platform.machine() == "x86_64")
        or (sys.platform == "darwin" and platform.machine() == "arm64")
        or (sys.platform == "win32" and platform.machine() == "AMD64")
    ),
    reason="pysqlite3 is a dependency where it has wheels",
)
def test_where_wowd_depends_on_pysqlite3_its_sqlite_is_free_of_the_bug() -> None:
    assert sqlite3.__name__ == "pysqlite3.dbapi2"
    assert not WAL_RESET_BUG, sqlite3.sqlite_version


def test_no_module_of_wowd_opens_the_file_with_another_sqlite_module() -> None:
    # two SQLite libraries in one process must not open one file: each keeps its own POSIX locks
    # of it, and closing the file in one releases the other's
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "sqlite.py" and path.parent.name == "embedded":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n.partition(".")[0] in ("sqlite3", "pysqlite3", "_sqlite3") for n in names):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert offenders == []


def test_the_variable_limit_is_the_librarys() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        limit = variable_limit(conn)
        conn.execute(f"SELECT 1 IN ({', '.join('?' * limit)})", (1,) * limit)
        with pytest.raises(sqlite3.OperationalError, match="too many SQL variables"):
            conn.execute(f"SELECT 1 IN ({', '.join('?' * (limit + 1))})", (1,) * (limit + 1))
    finally:
        conn.close()


def _traced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement of the connections opened from now on."""
    seen: list[str] = []
    connect: Callable[..., Any] = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> Any:
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(seen.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    return seen


@pytest.mark.parametrize(("bug", "mode", "autocheckpoint"), [(False, "PASSIVE", 1000), (True, "FULL", 0)])
def test_on_a_library_with_the_bug_only_full_checkpoints_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: bool, mode: str, autocheckpoint: int
) -> None:
    """With the bug, a commit never checkpoints on its own (even with no checkpointer in the
    process) and the background checkpoint is FULL (it holds the write lock: no write resets
    the WAL under it); without it, SQLite's own setting and PASSIVE."""
    monkeypatch.setattr(db_module, "WAL_RESET_BUG", bug)
    seen = _traced(monkeypatch)
    path = tmp_path / "wowd.db"
    db = SqliteDatabase(path)
    try:
        assert db.run_sync(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone()[0]) == autocheckpoint
        db.run_sync(db.transaction(lambda c: c.execute("CREATE TABLE t (v INTEGER)")))
        checkpointer = WalCheckpointer(path, every_s=0.01)
        checkpointer.start()
        try:
            assert checkpointer.checkpointed.wait(10), "no checkpoint within 10 s"
        finally:
            checkpointer.stop()
    finally:
        db.close()
    checkpoints = {s for s in seen if s.startswith("PRAGMA wal_checkpoint")}
    assert checkpoints == {f"PRAGMA wal_checkpoint({mode})"}


@pytest.mark.anyio
async def test_an_open_embedded_backend_says_its_library_in_a_metric(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    from wowd.config import load_settings
    from wowd.stores.embedded import open_embedded

    backend = await open_embedded(load_settings(context="ctx", embedded={"path": tmp_path / "wowd.db"}))
    try:
        labels = {
            "version": sqlite3.sqlite_version,
            "module": sqlite3.__name__.partition(".")[0],
            "wal_reset_bug": str(WAL_RESET_BUG).lower(),
        }
        assert REGISTRY.get_sample_value("wowd_embedded_sqlite_info", labels) == 1
    finally:
        await backend.close()


def test_the_compound_reads_write_their_limit_into_the_statement() -> None:
    # SQLite 3.47 and later prepare a compound SELECT again at every run when its LIMIT is a
    # bound parameter (about 0.5-1 ms for 64 arms, ten times the read): the log's and the due
    # reads write it, rounded up for the due read so that a few texts serve every limit
    from wowd.stores.embedded.log import read_sql
    from wowd.stores.embedded.timer_firing import due_union_sql, statement_limit

    assert read_sql(64, 500).endswith("ORDER BY seq LIMIT 500")
    assert due_union_sql("ctx", 64, 1024).endswith("LIMIT 1024")
    assert "LIMIT ?" not in read_sql(3, 10) + due_union_sql("ctx", 3, 10, rowid=True)
    assert [statement_limit(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
