"""The SQLite file's write path: the background WAL checkpoint of a backend, a write
transaction waiting for another process's write lock, and a write that finds the disk full."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from wowd.config import EmbeddedSettings, WowdSettings
from wowd.errors import StorageError, StorageFull, StorageUnavailable
from wowd.stores.embedded import open_embedded
from wowd.stores.embedded.db import SqliteDatabase, WalCheckpointer, checkpointed_in_background, disk_full
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = pytest.mark.anyio


def autocheckpoint(db: SqliteDatabase) -> int:
    return int(db.run_sync(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone()[0]))


async def test_a_backends_connections_leave_the_wal_checkpoint_to_its_own_thread(tmp_path: Path) -> None:
    path = tmp_path / "wowd.db"
    backend = await open_embedded(WowdSettings(embedded=EmbeddedSettings(path=path)))
    try:
        assert checkpointed_in_background(str(path))
        inside = SqliteDatabase(path)
        assert autocheckpoint(inside) == 0
        inside.close()
    finally:
        await backend.close()
    assert not checkpointed_in_background(str(path))
    after = SqliteDatabase(path)
    assert autocheckpoint(after) == 1000  # SQLite's default again once the backend is closed
    after.close()


def test_the_checkpointer_copies_committed_pages_into_the_database_file(tmp_path: Path) -> None:
    path = tmp_path / "wowd.db"
    checkpointer = WalCheckpointer(path, every_s=0.01)
    checkpointer.start()
    db = SqliteDatabase(path)
    try:
        db.run_sync(lambda c: c.execute("CREATE TABLE t (v BLOB)"))
        size_before = path.stat().st_size
        rows = [()] * 500
        db.run_sync(db.transaction(lambda c: c.executemany("INSERT INTO t VALUES (randomblob(4000))", rows)))
        # 2 MB committed to the WAL; the writer did not checkpoint it
        assert path.stat().st_size < size_before + 1_000_000
        for _ in range(2):  # the second checkpoint from now began after the commit
            checkpointer.checkpointed.clear()
            assert checkpointer.checkpointed.wait(10), "no checkpoint within 10 s"
        assert path.stat().st_size >= size_before + 1_000_000
    finally:
        db.close()
        checkpointer.stop()


HOLD = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.readline()
c.execute("COMMIT")
print("free", flush=True)
sys.stdin.readline()
"""


def holding(path: Path) -> subprocess.Popen[str]:
    """Another process, holding the file's write lock until told to commit."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_write_transaction_waits_for_another_processs_write_lock(tmp_path: Path) -> None:
    """Another process holds the write lock: the transaction waits for it (polling, with the
    busy handler off) and restores the connection's busy timeout for the other statements."""
    path = tmp_path / "wowd.db"
    db = SqliteDatabase(path, busy_timeout_ms=5_000)
    db.run_sync(lambda c: c.execute("CREATE TABLE t (v INTEGER)"))

    def insert(c: sqlite3.Connection) -> None:
        c.execute("INSERT INTO t VALUES (1)")

    with holding(path) as holder, ThreadPoolExecutor(1) as pool:
        assert holder.stdin is not None and holder.stdout is not None
        waiting = pool.submit(db.run_sync, db.transaction(insert))
        assert not waiting.done()
        holder.stdin.write("commit\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "free"
        waiting.result(timeout=10)
        holder.kill()
    assert db.run_sync(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0]) == 5_000
    assert db.run_sync(lambda c: c.execute("SELECT count(*) FROM t").fetchone()[0]) == 1
    db.close()


def test_a_write_lock_held_past_the_busy_timeout_is_transient(tmp_path: Path) -> None:
    path = tmp_path / "wowd.db"
    db = SqliteDatabase(path, busy_timeout_ms=200)
    db.run_sync(lambda c: c.execute("CREATE TABLE t (v INTEGER)"))
    with holding(path) as holder:
        with pytest.raises(StorageUnavailable, match="locked"):
            db.run_sync(db.transaction(lambda c: c.execute("INSERT INTO t VALUES (1)")))
        holder.kill()
    assert db.run_sync(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0]) == 200
    db.close()


def test_a_write_that_finds_the_disk_full_is_transient_and_succeeds_once_space_returns(tmp_path: Path) -> None:
    """SQLite's ``database or disk is full`` (here: the file at its ``max_page_count``) is the
    store unable to write, not the record at fault: :class:`StorageFull`, a
    :class:`StorageUnavailable`; reads answer meanwhile, and the same write succeeds later."""
    db = SqliteDatabase(tmp_path / "wowd.db")
    db.run_sync(db.transaction(lambda c: c.execute("CREATE TABLE t (v BLOB)")))
    pages = db.run_sync(lambda c: c.execute("PRAGMA page_count").fetchone()[0])
    db.run_sync(lambda c: c.execute(f"PRAGMA max_page_count={pages}"))

    def write(c: sqlite3.Connection) -> None:
        c.execute("INSERT INTO t VALUES (zeroblob(100000))")

    with pytest.raises(StorageFull, match="database or disk is full") as info:
        db.run_sync(db.transaction(write))
    assert isinstance(info.value, StorageUnavailable)
    assert db.run_sync(lambda c: c.execute("SELECT count(*) FROM t").fetchone()[0]) == 0
    db.run_sync(lambda c: c.execute(f"PRAGMA max_page_count={pages * 1000}"))  # space returns
    db.run_sync(db.transaction(write))
    assert db.run_sync(lambda c: c.execute("SELECT count(*) FROM t").fetchone()[0]) == 1
    db.close()


def test_other_write_failures_are_not_a_full_disk(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "wowd.db")
    db.run_sync(lambda c: c.execute("CREATE TABLE t (v INTEGER)"))
    db.run_sync(lambda c: c.execute("PRAGMA query_only=ON"))
    with pytest.raises(StorageError, match="readonly") as info:
        db.run_sync(lambda c: c.execute("INSERT INTO t VALUES (1)"))
    assert not isinstance(info.value, StorageUnavailable)
    db.close()


def _sqlite_error(message: str, code: int) -> sqlite3.Error:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


def test_a_full_disk_is_told_by_its_result_codes() -> None:
    assert disk_full(_sqlite_error("database or disk is full", 13))
    assert disk_full(_sqlite_error("disk I/O error", 10 | (19 << 8)))  # SQLITE_IOERR_SHMSIZE
    assert not disk_full(_sqlite_error("disk I/O error", 10 | (3 << 8)))  # SQLITE_IOERR_WRITE
    assert not disk_full(_sqlite_error("attempt to write a readonly database", 8))
    assert disk_full(sqlite3.OperationalError("database or disk is full"))  # no code: the message


@pytest.mark.parametrize(
    ("message", "code"), [("database or disk is full", 13), ("disk I/O error", 10 | (19 << 8))], ids=["FULL", "SHMSIZE"]
)
def test_a_full_disk_is_named_so_whichever_code_said_it(tmp_path: Path, message: str, code: int) -> None:
    """What ``/readyz`` and the stall's ERROR line show: a WAL index that could not grow says
    "disk I/O error" in SQLite's words, and is named a full disk as well."""
    db = SqliteDatabase(tmp_path / "wowd.db")

    def write(conn: sqlite3.Connection) -> None:
        raise _sqlite_error(message, code)

    with pytest.raises(StorageFull) as info:
        db.run_sync(write)
    db.close()
    assert str(info.value).startswith(f"sqlite {tmp_path / 'wowd.db'}: {message}")
    assert "database or disk is full" in str(info.value)


# --------------------------------------------------------------------------- rows in few statements


def _against_executemany(
    columns: str, stored: list[tuple[Any, ...]], helper: Callable[..., int], sql: str, rows: list[tuple[Any, ...]]
) -> tuple[tuple[int, list[Any], int], tuple[int, list[Any], int]]:
    """``helper(conn, sql, rows)`` and ``conn.executemany(sql, rows)``, each on a table ``kv``
    (``columns``) holding ``stored``: the rows changed, the table after, the statements run."""
    results = []
    for run in (lambda c: helper(c, sql, rows), lambda c: c.executemany(sql, rows)):
        conn = sqlite3.connect(":memory:", isolation_level=None)
        conn.execute(f"CREATE TABLE kv ({columns})")
        conn.executemany(f"INSERT INTO kv VALUES ({', '.join('?' * len(stored[0]))})", stored)
        statements: list[str] = []
        conn.set_trace_callback(statements.append)
        before = conn.total_changes
        run(conn)
        ran = len(statements)
        results.append((conn.total_changes - before, conn.execute("SELECT * FROM kv ORDER BY k").fetchall(), ran))
        conn.close()
    return results[0], results[1]


@pytest.mark.parametrize("count", [1, 3, 512, 513, 1200])
def test_rows_are_inserted_in_few_statements_as_executemany_inserts_them(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upsert that leaves a row as it is for the same values, with rows that conflict with
    stored ones and with each other: the rows and the count of rows changed are executemany's;
    the statements are ceil(rows / their limit), the last padded (a repeat changes nothing)."""
    from wowd.stores.embedded import db as db_module

    monkeypatch.setattr(db_module, "variable_limit", lambda conn: 1000)  # 500 rows of two a statement
    sql = "INSERT INTO kv (k, v) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v = excluded.v WHERE kv.v < excluded.v"
    stored: list[tuple[Any, ...]] = [(k, "m") for k in range(0, 2 * count, 7)]
    rows = [(k % (count // 2 + 1), f"v{k:05d}") for k in range(count)] + [(k, "a") for k in range(0, 2 * count, 14)]
    (changed, kv, statements), (expected_changed, expected_kv, _) = _against_executemany(
        "k INTEGER PRIMARY KEY, v TEXT NOT NULL", stored, db_module.insert_rows, sql, rows
    )
    assert (changed, kv) == (expected_changed, expected_kv)
    assert statements == -(-len(rows) // 500)


@pytest.mark.parametrize("count", [1, 2, 3, 512, 513, 1200])
@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE kv SET v = ?1 || v, revision = revision + 1 WHERE k = ?2 AND revision = ?3",
        "UPDATE kv SET v = ? || v, revision = revision + 1 WHERE k = ? AND revision = ?",
    ],
)
def test_rows_are_updated_in_few_statements_as_executemany_updates_them(
    count: int, sql: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guarded update of one row each, rows naming a stored row at its revision, at another
    revision (changes nothing) or no row: the table and the count of rows changed are
    executemany's; the statements are ceil(rows / their limit), the last padded (a repeat names
    the same row with the same values and is applied once)."""
    from wowd.stores.embedded import db as db_module

    monkeypatch.setattr(db_module, "variable_limit", lambda conn: 1500)  # 500 rows of three a statement
    stored: list[tuple[Any, ...]] = [(k, f"s{k}", k % 3) for k in range(0, 3 * count, 2)]
    rows = [(f"u{k}-", k, k % 3 if k % 5 != 3 else 9) for k in range(0, 3 * count, 3)][:count]
    (changed, table, statements), (expected_changed, expected_table, _) = _against_executemany(
        "k INTEGER PRIMARY KEY, v TEXT NOT NULL, revision INTEGER NOT NULL", stored, db_module.update_rows, sql, rows
    )
    assert changed > 0
    assert (changed, table) == (expected_changed, expected_table)
    assert statements == -(-len(rows) // 500)


def test_a_one_row_update_becomes_the_same_update_from_rows() -> None:
    from wowd.stores.embedded.db import update_values_sql

    assert update_values_sql("UPDATE t SET a = ?1, b = 'x', c = ?1 WHERE id = ?2", 2) == (
        "UPDATE t SET a = j.column1, b = 'x', c = j.column1 FROM (VALUES (?, ?), (?, ?)) AS j WHERE id = j.column2"
    )
    assert update_values_sql("UPDATE t SET a = ? WHERE id = ? AND r = ?", 1) == (
        "UPDATE t SET a = j.column1 FROM (VALUES (?, ?, ?)) AS j WHERE id = j.column2 AND r = j.column3"
    )


def test_a_one_row_insert_becomes_the_same_statement_of_many_rows() -> None:
    from wowd.stores.embedded.db import NOW_MS, multi_row_sql

    one = f"INSERT INTO t (a, b, c) VALUES (?, {NOW_MS}, ?) ON CONFLICT (a) DO NOTHING"
    assert multi_row_sql(one, 3) == (
        f"INSERT INTO t (a, b, c) VALUES (?, {NOW_MS}, ?), (?, {NOW_MS}, ?), (?, {NOW_MS}, ?)"
        " ON CONFLICT (a) DO NOTHING"
    )
    assert multi_row_sql("INSERT OR IGNORE INTO t (a) VALUES (?)", 2) == "INSERT OR IGNORE INTO t (a) VALUES (?), (?)"
