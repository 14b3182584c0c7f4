"""One SQLite file shared by the embedded stores (and by several processes), in WAL mode.

Every call runs on the connection's own thread (one per :class:`SqliteDatabase`), one call at a
time. Read-modify-write steps run in ``BEGIN IMMEDIATE`` transactions so that two
processes on the file serialise on SQLite's write lock (the writers of one process first queue on
:func:`file_write_lock`); a transaction polls for a lock another process holds, and a lock still
held after the busy timeout is :class:`StorageUnavailable` (transient), and so is a write that finds
the disk full (:class:`StorageFull`: it succeeds once space returns).

The store clock is SQLite's own ``now`` evaluated in the statement that decides (``NOW_MS``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio.to_thread
import orjson
from prometheus_client import Histogram

from wowd.errors import ConfigError, StorageError, StorageFull, StorageUnavailable
from wowd.metrics import STORE_CALL_SECONDS, STORE_UNAVAILABLE
from wowd.retry import Backoff, retrying_blocking
from wowd.stores.embedded.sqlite import WAL_RESET_BUG, sqlite3, variable_limit

__all__ = [
    "NOW_MS",
    "SqliteDatabase",
    "SqliteStore",
    "WalCheckpointer",
    "checkpoint_mode",
    "checkpointed_in_background",
    "disk_full",
    "file_write_lock",
    "in_snapshot",
    "insert_rows",
    "json_rows",
    "merged_read",
    "update_rows",
]

T = TypeVar("T")


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


def _locked_or_busy(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


log = logging.getLogger(__name__)

CHECKPOINT_EVERY_S = 0.2
"""How often a :class:`WalCheckpointer` checkpoints its file's WAL."""
FULL_CHECKPOINT_WAIT_MS = 100
"""How long a ``FULL`` checkpoint (:func:`checkpoint_mode`) waits for the write lock, and then,
holding it, for readers of older snapshots, before it copies what it can and leaves the rest to
the next turn (writers wait for it meanwhile)."""
BEGIN_POLL_BACKOFF = Backoff(0.0001, 0.001)
"""How often a write transaction tries again for a write lock another process holds (doubling
from the first to the second)."""

WAL_SWITCH_BACKOFF = Backoff(0.005, 0.2)
"""Between the tries of several processes that open a new file at once to switch it to WAL."""
CACHE_KIB = 65_536
"""The page cache of each connection (SQLite's default is 2 MiB): a burst of timers due at once
is read, written to the outbox and settled in random page order (ids are hashes), and with the
default cache most of those page reads went to the file; filled only as pages are used."""

NOW_MS = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
"""SQL expression: the store clock in ms since the epoch (SQLite's ``now``)."""


SQLITE_FULL = 13
"""SQLite's primary result code for a write that found no room (``database or disk is full``)."""
SQLITE_IOERR_SHMSIZE = 10 | (19 << 8)
"""SQLite's extended result code for a shared-memory file (``-shm``) it could not grow, which on a
full file system is the write that found no room."""


def _full_reason(exc: sqlite3.Error) -> str:
    """The reason of a :func:`disk_full` error as operators read it: SQLite's message, which says
    "disk I/O error" for ``SQLITE_IOERR_SHMSIZE``, then what wowd takes it for."""
    msg = str(exc)
    if "database or disk is full" in msg:
        return msg
    return f"{msg} (the WAL index, the -shm file, could not grow: database or disk is full)"


def disk_full(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the file's disk (or quota) has no room for a write: ``SQLITE_FULL``
    (any extended code of it) or ``SQLITE_IOERR_SHMSIZE``. The store is then unable, not the
    record at fault: the same write succeeds once space returns (:class:`StorageFull`)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF == SQLITE_FULL or code == SQLITE_IOERR_SHMSIZE
    return "database or disk is full" in str(exc)


class SqliteDatabase:
    """A connection to the wowd SQLite file. Stores accept one (the caller owns it) or a path
    (the store opens and closes its own)."""

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 10_000) -> None:
        self.path = str(path)
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[_Call | None] | None = None
        self._thread: threading.Thread | None = None
        self._thread_guard = threading.Lock()
        self._file_lock: threading.RLock | None = None
        """This file's :func:`file_write_lock`, once looked up."""

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            if self.path != ":memory:":
                parent = Path(self.path).parent
                try:
                    parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ConfigError(
                        f"the directory of the embedded database {self.path!r} cannot be created: "
                        f"{exc.strerror or exc} (WOWD_EMBEDDED__PATH)"
                    ) from None
            conn = sqlite3.connect(
                self.path, timeout=self._busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False
            )
            # Switching a new file to WAL takes an exclusive lock that busy_timeout does not wait
            # for: several processes opening a fresh file at once retry it for the busy timeout.
            try:
                for attempt in retrying_blocking(
                    backoff=WAL_SWITCH_BACKOFF, within_s=self._busy_timeout_ms / 1000, retry_if=_locked
                ):
                    with attempt:
                        conn.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError:
                conn.close()
                raise
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            if WAL_RESET_BUG or checkpointed_in_background(self.path):
                # on a library with the WAL-reset bug no commit checkpoints on its own: only the
                # background checkpointer's FULL checkpoints, which hold the write lock
                conn.execute("PRAGMA wal_autocheckpoint=0")
            conn.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
            conn.execute("PRAGMA foreign_keys=ON")
            self._conn = conn
        return self._conn

    def run_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``fn(conn)`` in the calling thread, translating sqlite3 errors."""
        with self._lock:
            try:
                conn = self._connect()
            except sqlite3.Error as exc:
                raise StorageUnavailable(f"sqlite {self.path}: cannot open: {exc}") from exc
            try:
                return fn(conn)
            except sqlite3.OperationalError as exc:
                if conn.in_transaction:
                    conn.rollback()
                msg = str(exc)
                if disk_full(exc):
                    raise StorageFull(f"sqlite {self.path}: {_full_reason(exc)}") from exc
                if "locked" in msg or "busy" in msg:
                    raise StorageUnavailable(f"sqlite {self.path}: {msg}") from exc
                raise StorageError(f"sqlite {self.path}: {msg}") from exc
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.rollback()
                if disk_full(exc):
                    raise StorageFull(f"sqlite {self.path}: {_full_reason(exc)}") from exc
                raise StorageError(f"sqlite {self.path}: {exc}") from exc
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``fn(conn)`` on this connection's thread, one call at a time, in the order called.
        The caller waits for the call to end even when cancelled meanwhile (a transaction is
        never abandoned half-way), as ``anyio.to_thread.run_sync`` does; a thread of its own
        costs the event loop a fraction of a worker thread's hand-off (no limiter, no lookups
        of the thread pool)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit((fn, future, loop))
        with anyio.CancelScope(shield=True):
            result = await future
        return result

    def _submit(self, call: _Call) -> None:
        with self._thread_guard:
            if self._calls is None or self._thread is None or not self._thread.is_alive():
                self._calls = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._calls,), name="wowd-sqlite", daemon=True
                )
                self._thread.start()
            self._calls.put(call)

    def _serve(self, calls: queue.SimpleQueue[_Call | None]) -> None:
        """The connection's thread: runs the calls in order until :meth:`close`."""
        while True:
            call = calls.get()
            if call is None:
                return
            fn, future, loop = call
            try:
                result: Any = self.run_sync(fn)
            except BaseException as exc:  # handed to the caller, raised in its task
                _answer(loop, future, exc, failed=True)
            else:
                _answer(loop, future, result, failed=False)

    async def quick_check(self) -> str | None:
        """SQLite's ``PRAGMA quick_check`` of the file (every page of every table and index read,
        without comparing indexes to their tables): ``None`` when it answers ``ok``, else its first
        message. Raises :class:`StorageError` when the file cannot be read that far (a corrupted
        header or schema). Read-only; it reads the whole file."""

        def run(conn: sqlite3.Connection) -> str | None:
            rows = conn.execute("PRAGMA quick_check(1)").fetchall()
            first = str(rows[0][0]) if rows else "quick_check answered nothing"
            if first == "ok":
                return None
            # one line, without the "*** in database main ***" heading
            lines = [x.strip() for x in first.splitlines() if x.strip() and not x.startswith("***")]
            return "; ".join(lines) or first

        return await self.run(run)

    def transaction(self, fn: Callable[[sqlite3.Connection], T]) -> Callable[[sqlite3.Connection], T]:
        """Wraps ``fn`` in ``BEGIN IMMEDIATE`` ... ``COMMIT`` (rolled back on error), holding the
        file's :func:`file_write_lock` throughout."""

        lock = file_write_lock(self)

        def wrapped(conn: sqlite3.Connection) -> T:
            with lock:
                self._begin_immediate(conn)
                try:
                    result = fn(conn)
                except BaseException:
                    conn.rollback()
                    raise
                conn.execute("COMMIT")
                return result

        return wrapped

    def _begin_immediate(self, conn: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``, waiting for another process's write lock in short polls.

        SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between its tries, so a
        writer that meets another process's short transaction often waits tens of ms after the
        lock was free again (and a steady writer in the other process can keep it waiting over
        100 ms). Here the busy handler is off for this statement and the lock is tried again
        as :data:`BEGIN_POLL_BACKOFF` says, up to the busy timeout."""
        conn.execute("PRAGMA busy_timeout=0")
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if not _locked_or_busy(exc):
                    raise
                # a worker thread's poll of another process's lock
                for attempt in retrying_blocking(
                    backoff=BEGIN_POLL_BACKOFF, within_s=self._busy_timeout_ms / 1000, retry_if=_locked_or_busy
                ):
                    with attempt:
                        conn.execute("BEGIN IMMEDIATE")
        finally:
            conn.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")

    def close(self) -> None:
        """Closes the connection and ends its thread (after the calls queued before)."""
        with self._thread_guard:
            calls, self._calls, self._thread = self._calls, None, None
        if calls is not None:
            calls.put(None)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


_Call = tuple[Callable[[sqlite3.Connection], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop]
"""A call queued for a connection's thread: the function, the caller's future and event loop."""


def _answer(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any, *, failed: bool) -> None:
    """Sets ``future`` to ``value`` (an exception when ``failed``) in its event loop."""

    def settle() -> None:
        if future.done():  # cancelled by a caller outside anyio's shield
            return
        if failed:
            future.set_exception(value)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop is closed: no one waits any more
        pass


_CALL_SECONDS: dict[tuple[str, str], Histogram] = {}


def _call_seconds(store: str, operation: str) -> Histogram:
    """``wowd_store_call_seconds`` of one store and operation, looked up once: ``labels()`` costs
    about a tenth of a call, and a replica makes thousands of calls a second."""
    child = _CALL_SECONDS.get((store, operation))
    if child is None:
        child = _CALL_SECONDS[(store, operation)] = STORE_CALL_SECONDS.labels(store, operation)
    return child


def _file_key(path: str, db_id: int) -> str:
    return f":memory:{db_id}" if path == ":memory:" else os.path.realpath(path)


_CHECKPOINTERS: dict[str, int] = {}
_CHECKPOINTERS_GUARD = threading.Lock()


def checkpointed_in_background(path: str) -> bool:
    """Whether a :class:`WalCheckpointer` of this process checkpoints the file at ``path``."""
    if path == ":memory:":
        return False
    with _CHECKPOINTERS_GUARD:
        return _CHECKPOINTERS.get(os.path.realpath(path), 0) > 0


def checkpoint_mode() -> str:
    """A :class:`WalCheckpointer`'s checkpoint: ``PASSIVE``, which blocks no one; on a SQLite with
    the WAL-reset bug (:mod:`wowd.stores.embedded.sqlite`) ``FULL``, which waits for the write lock
    and holds it while it copies, so that no write resets the WAL under it."""
    return "FULL" if WAL_RESET_BUG else "PASSIVE"


class WalCheckpointer:
    """Checkpoints the WAL of one file from a thread and a connection of its own, every
    :data:`CHECKPOINT_EVERY_S`, while this process's connections to the file opened meanwhile do
    not (``wal_autocheckpoint=0``).

    SQLite otherwise checkpoints in the connection whose commit takes the WAL past 1,000 pages:
    that commit then copies megabytes into the database file and syncs it, and every writer of
    the process queued behind it (the timer loop's claim and outbox write among them) waits
    several ms. A ``PASSIVE`` checkpoint blocks neither readers nor writers (on a SQLite with the
    WAL-reset bug the checkpoint is ``FULL``: :func:`checkpoint_mode`). Writers of other processes
    keep their own setting."""

    def __init__(self, path: str | Path, *, every_s: float | None = None) -> None:
        self.path = str(path)
        self._every_s = CHECKPOINT_EVERY_S if every_s is None else every_s
        self._stop = threading.Event()
        self.checkpointed = threading.Event()
        """Set after each checkpoint (clear it to wait for the next one)."""
        self._thread: threading.Thread | None = None
        self._key = os.path.realpath(self.path)

    def start(self) -> None:
        if self.path == ":memory:" or self._thread is not None:
            return
        with _CHECKPOINTERS_GUARD:
            _CHECKPOINTERS[self._key] = _CHECKPOINTERS.get(self._key, 0) + 1
        self._thread = threading.Thread(target=self._run, name="wowd-wal-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while not self._stop.wait(self._every_s):
                try:
                    if conn is None:
                        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                        conn.execute(f"PRAGMA busy_timeout={FULL_CHECKPOINT_WAIT_MS}")
                    conn.execute(f"PRAGMA wal_checkpoint({checkpoint_mode()})").fetchall()
                    self.checkpointed.set()
                except sqlite3.Error as exc:  # another process checkpoints, or the file is gone
                    log.debug("wal checkpoint of %s not done: %s", self.path, exc)
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        """Stops the thread (after the checkpoint in progress, if any) and lets connections
        opened later checkpoint themselves again."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        with _CHECKPOINTERS_GUARD:
            left = _CHECKPOINTERS.get(self._key, 1) - 1
            if left > 0:
                _CHECKPOINTERS[self._key] = left
            else:
                _CHECKPOINTERS.pop(self._key, None)

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.stop)


def merged_read(
    statements: Sequence[tuple[str, Sequence[Any]]],
    merge: Callable[[Sequence[Iterable[Any]], int], list[Any]],
    limit: int,
) -> Callable[[sqlite3.Connection], list[Any]]:
    """A read of ``statements`` (each ordered and limited): one statement's first ``limit`` rows;
    several read in one transaction (one snapshot of the file; the caller's, when it holds one)
    and combined by ``merge(cursors, limit)``."""
    if len(statements) == 1:
        sql, params = statements[0]

        def first(conn: sqlite3.Connection) -> list[Any]:
            with closing(conn.execute(sql, params)) as cursor:
                return cursor.fetchmany(limit)

        return first

    def merged(conn: sqlite3.Connection) -> list[Any]:
        cursors = [conn.execute(sql, params) for sql, params in statements]
        try:
            return merge(cursors, limit)
        finally:
            for c in cursors:
                c.close()

    return lambda conn: in_snapshot(conn, merged)


def in_snapshot(conn: sqlite3.Connection, read: Callable[[sqlite3.Connection], T]) -> T:
    """``read(conn)`` in one read transaction, so that its statements see one snapshot of the
    file (the caller's transaction, when it holds one)."""
    began = not conn.in_transaction
    if began:
        conn.execute("BEGIN")
    try:
        return read(conn)
    finally:
        if began:
            conn.execute("COMMIT")


@lru_cache(maxsize=128)
def json_rows_sql(sql: str, columns: tuple[str, ...]) -> str:
    """``sql``'s rows (``columns``, its result columns, in its order) as one value: a JSON array
    of arrays. SQLite builds it in one call, during which the module lets other threads run
    Python; a cursor's rows come one call each, and a thread reading them waits to be let back in
    at every row while another thread runs Python."""
    return f"SELECT json_group_array(json_array({', '.join(columns)})) FROM ({sql})"


def json_rows(conn: sqlite3.Connection, sql: str, columns: tuple[str, ...], params: Sequence[Any]) -> list[Any]:
    """The rows of ``sql`` (ordered and limited), read as one value (:func:`json_rows_sql`) and
    parsed here; row by row when a row holds a value JSON cannot hold (a BLOB another program
    wrote)."""
    try:
        (text,) = conn.execute(json_rows_sql(sql, columns), params).fetchone()
        rows: list[Any] = orjson.loads(text)
        return rows
    except (sqlite3.OperationalError, ValueError):
        with closing(conn.execute(sql, params)) as cursor:
            return cursor.fetchall()


MULTI_ROW_MAX = 512
"""Rows in one statement of :func:`insert_rows` and :func:`update_rows` (fewer where the variable
limit says so)."""


@lru_cache(maxsize=128)
def multi_row_sql(sql: str, rows: int) -> str:
    """``sql``, an ``INSERT ... VALUES (...)`` of one row (an upsert clause after it or none), as
    the same statement inserting ``rows`` rows."""
    start = sql.index(" VALUES (") + len(" VALUES ")
    depth = 0
    end = start
    for end in range(start, len(sql)):
        if sql[end] == "(":
            depth += 1
        elif sql[end] == ")":
            depth -= 1
            if depth == 0:
                break
    row = sql[start : end + 1]
    return f"{sql[:start]}{', '.join([row] * rows)}{sql[end + 1 :]}"


def insert_rows(conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> int:
    """``conn.executemany(sql, rows)`` for ``sql`` an ``INSERT`` of one row (:func:`multi_row_sql`),
    as a few statements of up to :data:`MULTI_ROW_MAX` rows each; the rows it changed.

    SQLite runs a statement in one call, during which the module lets other threads run Python;
    ``executemany`` makes that call once per row, and a thread that writes rows while another runs
    Python waits to be let back in at every row. Each statement's rows are padded to a power of
    two with repeats of its last row (a few statement texts, each prepared once per connection),
    so ``sql`` must change nothing for a repeat of a row it inserted: an ``OR IGNORE``, or an
    upsert that leaves a row as it is for the same values (the rows changed count none of them)."""
    if not rows:
        return 0
    return _in_statements(conn, rows, lambda size: multi_row_sql(sql, size))


def _in_statements(conn: sqlite3.Connection, rows: Sequence[Sequence[Any]], statement: Callable[[int], str]) -> int:
    """``rows`` (at least one) in statements of up to :data:`MULTI_ROW_MAX` rows (fewer where the
    variable limit says so), ``statement(size)`` taking ``size`` rows, each statement's rows padded
    to a power of two with repeats of its last row; the rows they changed."""
    per = max(1, min(MULTI_ROW_MAX, variable_limit(conn) // len(rows[0])))
    before = conn.total_changes
    for start in range(0, len(rows), per):
        chunk = rows[start : start + per]
        size = min(per, power_of_two(len(chunk)))
        conn.execute(statement(size), [v for row in padded(chunk, size) for v in row])
    return int(conn.total_changes - before)


_PARAMETER = re.compile(r"\?(\d*)")


@lru_cache(maxsize=128)
def update_values_sql(sql: str, rows: int) -> str:
    """``sql``, an ``UPDATE <table> SET ... WHERE ...`` of one row with ``?`` or ``?N`` parameters
    (none inside a string literal), as the same update of ``rows`` rows: ``UPDATE <table> SET ...
    FROM (VALUES (...), ...) AS j WHERE ...``, each parameter read from its column of ``j``."""
    numbers: list[int] = []
    implicit = 0

    def column(match: re.Match[str]) -> str:
        nonlocal implicit
        if match.group(1):
            number = int(match.group(1))
        else:
            implicit += 1
            number = implicit
        numbers.append(number)
        return f"j.column{number}"

    body = _PARAMETER.sub(column, sql)
    width = max(numbers)
    row = f"({', '.join('?' * width)})"
    where = body.index(" WHERE ")
    return f"{body[:where]} FROM (VALUES {', '.join([row] * rows)}) AS j{body[where:]}"


def update_rows(conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> int:
    """``conn.executemany(sql, rows)`` for ``sql`` an ``UPDATE`` of the one row its ``WHERE``
    names (:func:`update_values_sql`), as a few statements of up to :data:`MULTI_ROW_MAX` rows
    each (each row searched by its key, as ``executemany`` does); the rows it changed.

    One call per statement instead of one per row (:func:`insert_rows` says why that matters). The
    rows of one call must name distinct rows of the table: SQLite updates a row its ``FROM``
    matches several times once, with one of them. Each statement's rows are padded to a power of
    two with repeats of its last row, which name the same row with the same values."""
    if len(rows) < 2:
        before = conn.total_changes
        conn.executemany(sql, rows)
        return int(conn.total_changes - before)
    return _in_statements(conn, rows, lambda size: update_values_sql(sql, size))


def power_of_two(n: int) -> int:
    """The least power of two >= ``n`` (1 for none): the sizes of statements that take a varying
    number of rows, so that a few statement texts, each prepared once per connection, serve all."""
    return 1 << max(0, n - 1).bit_length()


def padded(rows: Sequence[T], size: int) -> list[T]:
    """``rows`` (at least one) followed by repeats of its last one, ``size`` in all."""
    return [*rows, *([rows[-1]] * (size - len(rows)))]


_WRITE_LOCKS: dict[str, threading.RLock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def file_write_lock(db: SqliteDatabase) -> threading.RLock:
    """The lock this process's writers on ``db``'s file (every store, each on its own
    connection) hold around a write transaction (:meth:`SqliteDatabase.transaction` takes it).

    SQLite lets one connection write at a time; another one asking meanwhile is refused and
    retried by its busy handler, which sleeps 1, 2, 5, 10 ms ... between tries: the timer loop's
    claim meeting the feed's write would lose several ms each time. Queued on this lock, the
    second writer starts when the first commits. Writers of other processes meet the short poll
    of the transaction's ``BEGIN IMMEDIATE``. Reentrant: a caller may hold it around a
    transaction."""
    if db._file_lock is not None:
        return db._file_lock
    key = _file_key(db.path, id(db))
    with _WRITE_LOCKS_GUARD:
        lock = _WRITE_LOCKS.get(key)
        if lock is None:
            lock = _WRITE_LOCKS[key] = threading.RLock()
    db._file_lock = lock
    return lock


class SqliteStore:
    """Base of the embedded stores: the client-or-path rule and the metered call.

    A store given a :class:`SqliteDatabase` uses it and never closes it (the caller owns it);
    given a path it opens its own and closes it in :meth:`close`. Every call goes through
    :meth:`_run`, which first runs :meth:`_ensure_ready` (a store's lazy schema step), then times
    the call in ``wowd_store_call_seconds{store=STORE}`` and counts a transient failure in
    ``wowd_store_unavailable_total``.
    """

    STORE: ClassVar[str] = "sqlite"
    """The ``store`` label of this store's metrics."""

    SCHEMA: ClassVar[tuple[str, ...]] = ()
    """``CREATE ... IF NOT EXISTS`` statements run once, in one transaction, before the first call."""

    def __init__(self, db_or_path: SqliteDatabase | str | Path) -> None:
        if isinstance(db_or_path, SqliteDatabase):
            self._db, self._owns = db_or_path, False
        else:
            self._db, self._owns = SqliteDatabase(db_or_path), True
        self._schema_ready = not self.SCHEMA

    @property
    def path(self) -> str:
        """The file of the store (``:memory:`` for a database in memory)."""
        return self._db.path

    def schema(self) -> Sequence[str]:
        """The statements :meth:`_ensure_ready` runs (default: ``SCHEMA``)."""
        return self.SCHEMA

    async def _ensure_ready(self) -> None:
        """Creates or checks what the store needs before its first call (default: its ``SCHEMA``)."""
        if not self._schema_ready:
            statements = self.schema()

            def create(conn: sqlite3.Connection) -> None:
                for statement in statements:
                    conn.execute(statement)

            await self._db.run(self._db.transaction(create))
            self._schema_ready = True

    async def _run(
        self, operation: str, fn: Callable[[sqlite3.Connection], T], *, db: SqliteDatabase | None = None
    ) -> T:
        """``fn`` on this store's connection (or on ``db``, another connection of the store)."""
        started = time.perf_counter()
        try:
            await self._ensure_ready()
            return await (db or self._db).run(fn)
        except StorageUnavailable:
            STORE_UNAVAILABLE.labels(self.STORE, operation).inc()
            raise
        finally:
            _call_seconds(self.STORE, operation).observe(time.perf_counter() - started)

    async def close(self) -> None:
        if self._owns:
            await anyio.to_thread.run_sync(self._db.close)
