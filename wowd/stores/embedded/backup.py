"""An online backup of the embedded file (:class:`~wowd.stores.base.OnlineBackup`, ``wowd backup
PATH``): a consistent copy while replicas run on it.

The copy is SQLite's online backup (``sqlite3_backup_*``) from a connection that holds one read
transaction throughout: in WAL mode that is one snapshot of the file, which the replicas' writes
(other processes) do not disturb, and which they do not wait for. The pages go over in steps,
with a progress line every few steps, into ``PATH.partial`` next to ``PATH``; the copy is then
checked with ``PRAGMA integrity_check`` and renamed to ``PATH`` only when it passes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wowd.errors import ConfigError, StorageError
from wowd.fmt import iso_ms
from wowd.stores.base import BackupDone
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["PROGRESS_EVERY_S", "BackupReport", "backup", "copy_file"]

PROGRESS_EVERY_S = 1.0
"""A progress line at most this often (and one at the end)."""


@dataclass(frozen=True, slots=True)
class BackupReport:
    """What :func:`copy_file` did."""

    pages: int
    """Pages of the copy."""
    page_size: int
    steps: int
    """Backup steps taken."""
    integrity: str
    """``ok``, or the first message of ``integrity_check``."""
    taken_at: int
    """When the copy's snapshot was taken (epoch ms): the copy holds what was committed then."""


def copy_file(
    source: str,
    target: Path,
    *,
    step_pages: int,
    progress: Callable[[str], None],
    progress_every_s: float = PROGRESS_EVERY_S,
) -> BackupReport:
    """Copies the SQLite file ``source`` into ``target`` (which must not exist) with SQLite's
    online backup, from one read transaction (one snapshot; writers of other connections go on),
    ``step_pages`` pages per step with a ``progress`` line at most every ``progress_every_s``;
    then ``PRAGMA integrity_check`` of the copy, on a connection of its own. The copy is left in
    place whatever the check says (the caller decides). Raises :class:`StorageError` when the
    source cannot be read or the copy written."""
    db = SqliteDatabase(source)
    steps = 0
    shown = [time.monotonic()]

    def step(_status: int, remaining: int, total: int) -> None:
        nonlocal steps
        steps += 1
        now = time.monotonic()
        if remaining and now - shown[0] < progress_every_s:
            return
        shown[0] = now
        done = total - remaining
        progress(f"backup: {done} of {total} pages copied ({100 * done // max(total, 1)}%)")

    def run(conn: sqlite3.Connection) -> tuple[int, int, int]:
        conn.execute("BEGIN")  # one snapshot for every step (WAL: the writers do not wait for it)
        try:
            conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()
            taken_at = int(time.time() * 1000)
            (page_size,) = conn.execute("PRAGMA page_size").fetchone()
            (pages,) = conn.execute("PRAGMA page_count").fetchone()
            progress(f"backup of {source}: {pages} pages of {page_size} bytes, {step_pages} per step")
            dest = sqlite3.connect(str(target), isolation_level=None)
            try:
                conn.backup(dest, pages=step_pages, progress=step)
            finally:
                dest.close()
        finally:
            conn.execute("COMMIT")
        return int(pages), int(page_size), taken_at

    try:
        pages, page_size, taken_at = db.run_sync(run)
    finally:
        db.close()
    check = sqlite3.connect(str(target), isolation_level=None)
    try:
        rows = check.execute("PRAGMA integrity_check(1)").fetchall()
        (pages,) = check.execute("PRAGMA page_count").fetchone()
    except sqlite3.Error as exc:
        raise StorageError(f"sqlite {target}: the copy cannot be read: {exc}") from exc
    finally:
        check.close()
    integrity = str(rows[0][0]) if rows else "integrity_check answered nothing"
    return BackupReport(pages=int(pages), page_size=page_size, steps=steps, integrity=integrity, taken_at=taken_at)


def _family(path: Path) -> list[Path]:
    """A SQLite file and the files SQLite keeps beside it (``-wal``, ``-shm``, ``-journal``)."""
    return [path, *(Path(f"{path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))]


def _remove(path: Path) -> None:
    for p in _family(path):
        p.unlink(missing_ok=True)


def _same(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: one real path, or one inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _refuse_overwrite(source: Path, target: Path, partial: Path) -> None:
    """Refuses a ``target`` whose writing (the copy, ``partial`` and its journal, the files
    removed around it) would touch the database or a file SQLite keeps beside it, whatever
    ``force`` says: replacing a live ``-wal`` destroys the database."""
    live = _family(source)
    for written in (target, *_family(partial)):
        for p in live:
            if _same(written, p):
                which = (
                    "the database file itself" if p == source else f"the database's {str(p)[len(str(source)) :]} file"
                )
                shown = "PATH" if written == target else f"{str(written)!r} (written on the way)"
                raise ConfigError(
                    f"{str(target)!r}: {shown} is {which} ({str(p)!r}): a backup never writes over the database or "
                    "the files beside it, --force or not; give another PATH"
                )


def backup(source: Path, target: Path, *, force: bool, step_pages: int, progress: Callable[[str], None]) -> BackupDone:
    """The copy of the file ``source`` at ``target`` (module docstring), run in the calling
    thread: written when it passes its ``integrity_check`` (nothing left at ``target``
    otherwise); :class:`ConfigError` for a missing source, an existing ``target`` (without
    ``force``), a directory, or a ``target`` that is the database or a file beside it."""
    if not source.exists():
        raise ConfigError(f"WOWD_EMBEDDED__PATH: the database file {str(source)!r} does not exist: nothing to back up")
    partial = Path(f"{target}.partial")
    _refuse_overwrite(source, target, partial)
    if target.is_dir():
        raise ConfigError(f"{str(target)!r} is a directory: give the path of the file to write (in it, say)")
    if target.exists() and not force:
        raise ConfigError(f"{str(target)!r} exists: give another PATH, or --force to replace it")
    if not target.parent.is_dir():
        raise ConfigError(f"the directory of {str(target)!r} does not exist")
    if partial.is_dir():
        raise ConfigError(f"{str(partial)!r}, where the copy is written before its check, is a directory")
    _remove(partial)
    try:
        report = copy_file(str(source), partial, step_pages=step_pages, progress=progress)
    except BaseException:
        _remove(partial)
        raise
    if report.integrity != "ok":
        _remove(partial)
        return BackupDone(
            written=False,
            text=f"the copy failed its integrity_check: {report.integrity} (nothing written to {target})",
        )
    try:
        os.replace(partial, target)
    except OSError as exc:
        _remove(partial)
        raise StorageError(f"the copy could not be renamed to {str(target)!r}: {exc} (nothing written there)") from exc
    _remove(partial)
    size = report.pages * report.page_size
    return BackupDone(
        written=True,
        text=f"backup written to {target}: {report.pages} pages ({size / 1048576:.1f} MiB) in {report.steps} step(s), "
        f"integrity_check ok; it holds what was committed at {iso_ms(report.taken_at)}",
    )
