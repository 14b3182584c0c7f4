"""A rebuild of the timer view on the embedded file (:class:`~wowd.stores.base.TimerViewRebuild`,
driven by :mod:`wowd.daemon.timer_rebuild`): a shadow table beside the live one, swapped in by one
write transaction.

- **Lock.** One row per context in ``wow_timer_rebuild`` (owner, start, expiry): a second rebuild
  is refused while the row is another live owner's. The owner renews it as it goes; an owner
  of this host whose process is gone (a rebuild killed) holds nothing.
- **Shadow.** ``wow_timer__<context>__rebuild``
  (:func:`~wowd.stores.embedded.schema.timer_shadow_table`), the live table's columns and unique
  key, no other index; dropped and created anew by :meth:`EmbeddedTimerRebuild.begin`.
- **Replay.** The context's log from its start, in log order and in batches, through the
  projection, written with the timer view's own writes
  (:meth:`~wowd.stores.embedded.timer_view.EmbeddedTimerView.write_steps`). Commits whose text
  shows they write nothing to the view are skipped undecoded. A large log is read, decoded and
  projected in ranges by a pool of processes (:func:`pool_size`), written in log order.
- **Carry-over.** Before the finish, in short write transactions (the replicas' writes go on
  between them): one-shot timers the outbox holds an entry of become DONE tombstones; one-shot
  timers due before the tombstone retention become FAILED as "expired, state unknown" (unless
  asked to fire them); then, one partition per transaction, every row of the old view that can be
  read replaces the shadow's row of its key when its version is the same or later (tombstones,
  attempts, PARKED and FAILED and their reasons, claims, revisions, recurring timers'
  occurrences), and a shadow row of a later version (a commit the replay read before the feed
  applied it) takes a revision past the old row's: a claim of the old row, settled after the
  swap under the revision it was claimed at, finds the newer row moved on and writes nothing.
- **Finish.** One ``BEGIN IMMEDIATE`` transaction (the file's write lock: the feeds and timer
  loops of every replica wait for it): the shadow catches up to the timer view's checkpoint of
  each partition (the commits the feed applied since the replay read them), the outbox is looked
  at again for those, the old view's rows changed since the carry-over are carried (their
  revision moves with every write), the live table is dropped, the shadow renamed in its place
  and its indexes created. A rebuild killed at any point leaves the live view as it was.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from wowd.errors import LeaseLost
from wowd.model import AggregateType, LogEntry, TimerWrite
from wowd.stores.base import Projection
from wowd.stores.embedded.checkpoints import CHECKPOINT_SEQS_SQL
from wowd.stores.embedded.db import NOW_MS, SqliteDatabase, SqliteStore
from wowd.stores.embedded.log import entries_between, entry_of
from wowd.stores.embedded.schema import (
    REBUILD_LOCK_DDL,
    REBUILD_LOCK_TABLE,
    TOMBSTONES,
    timer_index_sql,
    timer_shadow_table,
    timer_table,
    timer_table_sql,
)
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_rows import COLUMNS
from wowd.stores.embedded.timer_view import EmbeddedTimerView, put_types
from wowd.stores.timer_rebuild import (
    EXPIRED_LISTED,
    EXPIRED_REASON,
    Expired,
    Finished,
    RebuildRunning,
    lock_gone,
    lock_owner,
)

__all__ = [
    "BATCH",
    "POOL_MAX",
    "POOL_MIN_COMMITS",
    "EmbeddedTimerRebuild",
    "pool_size",
    "replay_entries",
    "rows_between",
]

BATCH = 2000
"""Commits read per batch of the replay (a write transaction each)."""
READ_AHEAD = 2
"""Batches of the log read and projected ahead of the one written."""
POOL_MIN_COMMITS = 50_000
"""A replay of at least this many commits is decoded and projected by a pool of processes (one
per CPU) while this one writes: below it, starting the pool costs more than it saves."""
POOL_MAX = 4
"""The most processes of a replay's pool."""
POOL_IN_FLIGHT = 3
"""Ranges of the log given to each process of the pool ahead of the one written."""

Steps = list[tuple[str, tuple[Any, ...]]]
"""The timer view's planned writes (:meth:`EmbeddedTimerView.steps_of`)."""


_COLS = ", ".join(f'"{c}"' for c in COLUMNS)
_KEY = '"partition", aggregate, owner_tenant, owner_id, "key"'


def may_write_timers(doc: str) -> bool:
    """Whether a commit's document (its text in the log) may hold a write of the timer view: it
    names a timer event, or it is not plainly "not deleted" (every ``"deleted"`` in it followed by
    ``:false``), or it holds escapes (``\\u``: a name could be spelled with them). False only for
    a commit whose projection writes nothing: a replay skips it without decoding it."""
    if "TimerScheduled" in doc or "TimerCancelled" in doc or "\\u" in doc:
        return True
    return doc.count('"deleted"') != doc.count('"deleted":false')


_IN_SEQ_ORDER = "+context = ?"
"""The context's condition of a replay's reads, kept off the indexes (``+``): the reads walk the
log by ``seq``, its primary key, from where the last one ended; through the index of
``(context, partition, seq)`` each read would go over every commit of the context and sort what it
keeps, a cost growing with the log."""


def replay_entries(context: str, rows: Sequence[Sequence[Any]]) -> list[LogEntry]:
    """The log rows ``rows`` (``seq, aggregate, partition, doc``) of ``context`` that may hold a
    write of the timer view (:func:`may_write_timers`), decoded as the log's reads decode them;
    the others are skipped undecoded."""
    types: dict[str, AggregateType] = {}
    entries: list[LogEntry] = []
    for row in rows:
        doc = row[3]
        if isinstance(doc, str) and not may_write_timers(doc):
            continue
        type_ = types.get(row[1])
        if type_ is None:
            type_ = types[row[1]] = AggregateType(context=context, aggregate=row[1])
        entries.append(entry_of(type_, tuple(row)))
    return entries


def rows_between(conn: sqlite3.Connection, context: str, after: int, upto: int) -> list[Any]:
    """The log rows of ``context`` with ``after < seq <= upto``, in log order (``seq, aggregate,
    partition, doc``)."""
    sql = f"SELECT seq, aggregate, partition, doc FROM log WHERE {_IN_SEQ_ORDER} AND seq > ? AND seq <= ? ORDER BY seq"
    return conn.execute(sql, (context, after, upto)).fetchall()


def pool_size(commits: int) -> int:
    """The processes that decode and project a replay of ``commits`` commits: none (this process
    does) below :data:`POOL_MIN_COMMITS`, else one per CPU this process may use, at most
    :data:`POOL_MAX`."""
    if commits < POOL_MIN_COMMITS:
        return 0
    return max(
        1, min(POOL_MAX, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


class _Planner:
    """Reads ranges of the log on a connection of its own, decodes them and projects them into
    the timer view's planned writes: in a process of the replay's pool (:func:`_plan_range`)."""

    def __init__(self, path: str, context: str, partitions: int, project: Projection) -> None:
        self._db = SqliteDatabase(path)
        self._context = context
        self._timers = EmbeddedTimerView(self._db, context=context, partitions=partitions)
        self._project = project

    def plan(self, after: int, upto: int) -> tuple[int, Steps, set[str]]:
        """The commits of ``after < seq <= upto``: how many, their planned writes and the
        aggregate types whose timers those put."""
        ctx = self._context
        rows = self._db.run_sync(lambda conn: rows_between(conn, ctx, after, upto))
        writes = self._project(replay_entries(ctx, rows))
        return len(rows), self._timers.steps_of(writes), put_types(writes)


_planner: _Planner | None = None
"""A pool process's planner (:func:`_start_planner`)."""


def _start_planner(path: str, context: str, partitions: int, project: Projection) -> None:
    global _planner
    _planner = _Planner(path, context, partitions, project)


def _plan_range(after: int, upto: int) -> tuple[int, Steps, set[str]]:
    assert _planner is not None
    return _planner.plan(after, upto)


class EmbeddedTimerRebuild(SqliteStore):
    """The shadow table, its lock, its replay and its swap, on connections of its own to the file
    (module docstring). ``project``: the feed's projection (picklable: the pool's processes run
    it); ``consumer``: whose checkpoints say how far the view applied the log; ``aggregate``: only
    that type's timers rebuilt (the old view's other rows are kept as they are)."""

    STORE = "timer_rebuild"
    holds_slots = False
    pause = "the write lock held"

    def __init__(
        self,
        path: str,
        *,
        context: str,
        partitions: int,
        project: Projection,
        consumer: str,
        aggregate: str | None,
        owner: str | None = None,
    ) -> None:
        super().__init__(path)
        self._timers = EmbeddedTimerView(self._db, context=context, partitions=partitions)
        self.context = context
        self._partitions = partitions
        self._project = project
        self._consumer = consumer
        self._aggregate = aggregate
        self.owner = owner or lock_owner()
        self.live = timer_table(context)
        self.shadow = timer_shadow_table(context)
        self._reader = SqliteDatabase(self.path)
        """A connection of its own for the replay's reads of the log: they run while the batch
        before is written on the store's connection (SQLite runs each on its own thread)."""
        self._read_to = 0
        """The ``seq`` the replay read to (every partition read to the same point)."""

    # ---- the lock

    async def acquire(self, ttl_s: float) -> None:
        """Takes the lock row for ``ttl_s``; raises :class:`RebuildRunning` naming its holder when
        another live rebuild holds it."""
        ctx, me, ttl = self.context, self.owner, int(ttl_s * 1000)

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(REBUILD_LOCK_DDL)
            row = conn.execute(
                f"SELECT owner, started_at, expires_at, {NOW_MS} FROM {REBUILD_LOCK_TABLE} WHERE context = ?", (ctx,)
            ).fetchone()
            if row is not None and row[0] != me and row[2] > row[3] and not lock_gone(row[0]):
                raise RebuildRunning(
                    f"a rebuild of the timer view of context {ctx!r} runs: lock held by {row[0]} since "
                    f"{_iso(row[1])}, until {_iso(row[2])} unless renewed (wait for it to end)"
                )
            conn.execute(
                f"INSERT INTO {REBUILD_LOCK_TABLE} (context, owner, started_at, expires_at)"
                f" VALUES (?, ?, {NOW_MS}, {NOW_MS} + ?)"
                " ON CONFLICT (context) DO UPDATE SET owner = excluded.owner, started_at = excluded.started_at,"
                " expires_at = excluded.expires_at",
                (ctx, me, ttl),
            )

        await self._run("acquire", self._db.transaction(work))

    async def renew(self, ttl_s: float) -> None:
        """Extends the lock; raises :class:`LeaseLost` when another rebuild took it."""
        ctx, me, ttl = self.context, self.owner, int(ttl_s * 1000)

        def work(conn: sqlite3.Connection) -> int:
            sql = f"UPDATE {REBUILD_LOCK_TABLE} SET expires_at = {NOW_MS} + ? WHERE context = ? AND owner = ?"
            return int(conn.execute(sql, (ttl, ctx, me)).rowcount)

        if not await self._run("renew", self._db.transaction(work)):
            raise LeaseLost(f"the timer view rebuild's lock of context {ctx!r} was taken by another rebuild")

    async def release(self) -> None:
        """Drops the lock row if this rebuild holds it."""

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(REBUILD_LOCK_DDL)
            conn.execute(
                f"DELETE FROM {REBUILD_LOCK_TABLE} WHERE context = ? AND owner = ?", (self.context, self.owner)
            )

        await self._run("release", self._db.transaction(work))

    def _check_lock(self, conn: sqlite3.Connection) -> None:
        row = conn.execute(f"SELECT owner FROM {REBUILD_LOCK_TABLE} WHERE context = ?", (self.context,)).fetchone()
        if row is None or row[0] != self.owner:
            raise LeaseLost(f"the timer view rebuild's lock of context {self.context!r} was taken by another rebuild")

    # ---- the shadow

    async def begin(self) -> int:
        """A new, empty shadow table (a leftover of an interrupted rebuild is dropped); answers
        the commits of the context's log (the replay's total, for the progress lines)."""

        def work(conn: sqlite3.Connection) -> None:
            self._check_lock(conn)
            conn.execute(f"DROP TABLE IF EXISTS {self.shadow}")
            conn.execute(timer_table_sql(self.shadow))

        await self._timers.prepare()
        await self._run("begin", self._db.transaction(work))
        self._read_to = 0
        ctx = self.context
        sql = "SELECT count(*) FROM log WHERE context = ?"
        return int(await self._run("count", lambda conn: conn.execute(sql, (ctx,)).fetchone()[0]))

    async def replay(self, *, batch_size: int | None = None, workers: int | None = None) -> AsyncIterator[int]:
        """The log in its order to its end into the shadow; each batch is read and projected
        while the batch before is written (the write runs on the connection's thread). With
        ``workers`` (``None``: :func:`pool_size` of the log), the log as it was at the start is
        read, decoded and projected in ranges by a pool of that many processes (the decoding is
        Python: the processes use the other CPUs), then what was appended meanwhile by this one.
        Yields the commits read after each batch is written."""
        size = batch_size or BATCH
        if workers is None:
            workers = pool_size(await self._log_commits())
        send, receive = anyio.create_memory_object_stream[tuple[int, Steps, set[str]]](READ_AHEAD)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_ahead, size, workers, send)
            async with receive:
                async for n, steps, types in receive:
                    await self._write_steps(steps, types)
                    yield n

    async def _read_ahead(
        self, batch_size: int, workers: int, send: MemoryObjectSendStream[tuple[int, Steps, set[str]]]
    ) -> None:
        """Reads the log in its order to its end and projects each batch, handing on (commits
        read, planned writes, the aggregate types they put timers of)."""
        async with send:
            if workers and self.path != ":memory:":
                await self._pooled(batch_size, workers, send)
            while True:
                n, seq, entries = await self._read(self._read_to, batch_size)
                if not n:
                    return
                self._read_to = seq
                writes = self._project(entries)
                await send.send((n, self._timers.steps_of(writes), put_types(writes)))

    async def _pooled(
        self, batch_size: int, workers: int, send: MemoryObjectSendStream[tuple[int, Steps, set[str]]]
    ) -> None:
        """:meth:`_read_ahead` of the log to its last ``seq`` at the start, by a pool of
        ``workers`` processes, in ranges of ``batch_size`` ``seq`` handed on in log order."""
        top = await self._last_seq()
        loop = asyncio.get_running_loop()
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_planner,
            initargs=(self.path, self.context, self._partitions, self._project),
        )
        try:
            pending: deque[tuple[int, asyncio.Future[tuple[int, Steps, set[str]]]]] = deque()
            after = self._read_to
            while after < top or pending:
                while after < top and len(pending) < workers * POOL_IN_FLIGHT:
                    upto = min(after + batch_size, top)
                    pending.append((upto, loop.run_in_executor(pool, _plan_range, after, upto)))
                    after = upto
                upto, future = pending.popleft()
                n, steps, types = await future
                self._read_to = upto
                if n:
                    await send.send((n, steps, types))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _read(self, after: int, limit: int) -> tuple[int, int, list[LogEntry]]:
        """The next ``limit`` commits of the context's log after ``seq`` ``after``, in log order:
        how many were read, the last one's ``seq`` (``after`` when none) and the entries of those
        that may hold a write of the timer view, decoded (:func:`replay_entries`)."""
        ctx = self.context
        sql = (
            f"SELECT seq, aggregate, partition, doc FROM log WHERE {_IN_SEQ_ORDER} AND seq > ?"
            f" ORDER BY seq LIMIT {int(limit)}"
        )

        def work(conn: sqlite3.Connection) -> list[Any]:
            return conn.execute(sql, (ctx, after)).fetchall()

        rows = await self._run("read", work, db=self._reader)
        if not rows:
            return 0, after, []
        return len(rows), int(rows[-1][0]), replay_entries(ctx, rows)

    async def write(self, writes: Sequence[TimerWrite]) -> None:
        """The net effect of a batch of the log (the feed's projection) into the shadow."""
        await self._write_steps(self._timers.steps_of(writes), put_types(writes))

    async def _last_seq(self) -> int:
        """The ``seq`` of the context's last commit (0 when none)."""
        ctx = self.context
        sql = "SELECT coalesce(max(seq), 0) FROM log WHERE context = ?"
        return int(await self._run("read", lambda conn: conn.execute(sql, (ctx,)).fetchone()[0], db=self._reader))

    async def _write_steps(self, steps: Sequence[tuple[str, tuple[Any, ...]]], types: Iterable[str]) -> None:
        """Planned writes (:meth:`EmbeddedTimerView.steps_of`) into the shadow; ``types``: the
        aggregate types of the timers they put (their collections recorded first)."""
        await self._timers.record_types(types)
        if not steps:
            return
        timers, shadow = self._timers, self.shadow
        await self._run("write", self._db.transaction(lambda conn: timers.write_steps(steps, conn, table=shadow)))

    async def _log_commits(self) -> int:
        """The commits of the context's log."""
        ctx = self.context
        sql = "SELECT count(*) FROM log WHERE context = ?"
        return int(await self._run("count", lambda conn: conn.execute(sql, (ctx,)).fetchone()[0]))

    async def live_count(self) -> int:
        """Live timers in the shadow so far, as its writes committed them (for the progress lines;
        read on the reads' connection, beside the writes). It reads the whole shadow."""
        sql = f"SELECT count(*) FROM {self.shadow} WHERE status NOT IN {TOMBSTONES}"
        return int(await self._run("count", lambda conn: conn.execute(sql).fetchone()[0], db=self._reader))

    async def close(self) -> None:
        """Closes the reads' connection, and the store's own when it opened it."""
        await anyio.to_thread.run_sync(self._reader.close)
        await super().close()

    async def abort(self) -> None:
        """Drops the shadow (the live view is left as it is), unless another rebuild holds the
        lock now (the shadow is its own then)."""

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(REBUILD_LOCK_DDL)
            row = conn.execute(f"SELECT owner FROM {REBUILD_LOCK_TABLE} WHERE context = ?", (self.context,)).fetchone()
            if row is not None and row[0] != self.owner:
                return
            conn.execute(f"DROP TABLE IF EXISTS {self.shadow}")

        await self._run("abort", self._db.transaction(work))

    @asynccontextmanager
    async def finishing(self, *, expired_before: int | None, result: Finished) -> AsyncIterator[None]:
        """:meth:`carry_over`, before the finishing transaction (which carries what changed since:
        a row's revision moves with every write)."""
        await self.carry_over(expired_before=expired_before, result=result)
        yield

    async def carry_over(self, *, expired_before: int | None, result: Finished) -> None:
        """What can be done before the finishing transaction, in short write transactions of its
        own (the replicas' writes go on between them): one-shot timers the outbox holds become
        DONE tombstones, one-shot timers due before ``expired_before`` (epoch ms; ``None``: none)
        FAILED as expired, then the old view's rows are carried over, one partition per
        transaction (the finishing transaction carries only the rows changed since)."""

        def marks(conn: sqlite3.Connection) -> None:
            self._check_lock(conn)
            self._outbox_fired(conn, result)
            if expired_before is not None:
                self._expire(conn, expired_before)

        await self._run("carry_over", self._db.transaction(marks))
        if not await self._run("carry_over", lambda conn: _exists(conn, self.live)):
            result.old_view = False
            return
        for p in await self._run("carry_over", self._partitions_of):
            await self._run("carry_over", self._db.transaction(functools.partial(self._carry_one, p, result)))

    async def finish(self, *, swap: bool, result: Finished, tick: Callable[[], Awaitable[None]]) -> None:
        """The finishing transaction (module docstring), which pauses the replicas' writes by
        itself (``tick`` is not needed); ``result``: what :meth:`carry_over` found, completed
        here. ``swap`` false (a dry run): everything is counted, nothing is changed (the
        transaction is rolled back and the shadow dropped)."""
        read = dict.fromkeys(range(self._partitions), self._read_to)
        consumer, project, aggregate = self._consumer, self._project, self._aggregate

        def work(conn: sqlite3.Connection) -> None:
            self._check_lock(conn)
            self._catch_up(conn, read, consumer, project, aggregate, result)
            self._outbox_fired(conn, result)
            if result.old_view and _exists(conn, self.live):
                for p in self._partitions_of(conn):
                    self._carry(conn, p, result, changed=True)
            else:
                result.old_view = False
            self._count(conn, aggregate, result)
            if not swap:
                raise _DryRun
            conn.execute(f"DROP TABLE IF EXISTS {self.live}")
            conn.execute(f"ALTER TABLE {self.shadow} RENAME TO {self.live}")
            for statement in timer_index_sql(self.context):
                conn.execute(statement)
            result.swapped = True

        try:
            await self._run("finish", self._db.transaction(work))
        except _DryRun:
            await self.abort()

    def _catch_up(
        self,
        conn: sqlite3.Connection,
        read: Mapping[int, int],
        consumer: str,
        project: Projection,
        aggregate: str | None,
        result: Finished,
    ) -> None:
        checkpoints = {
            int(p): int(seq)
            for p, seq in conn.execute(CHECKPOINT_SEQS_SQL, (self.context, consumer))
            if seq is not None
        }
        result.checkpoints = checkpoints
        for p, until in sorted(checkpoints.items()):
            after = read.get(p, 0)
            if until <= after:
                continue
            entries = entries_between(conn, self.context, p, after, until)
            result.caught_up += len(entries)
            if aggregate is not None:
                entries = [e for e in entries if e.aggregate.aggregate == aggregate]
            steps = self._timers.plan_write_in(project(entries), conn)
            if steps:
                self._timers.write_steps(steps, conn, table=self.shadow)

    def _outbox_fired(self, conn: sqlite3.Connection, result: Finished) -> None:
        """One-shot timers of the shadow the outbox holds an entry of fired: DONE tombstones."""
        if not _exists(conn, "outbox"):
            return
        result.fired_in_outbox += int(
            conn.execute(
                f"UPDATE {self.shadow} SET status = 'DONE', due_at = {NOW_MS}, revision = revision + 1"
                " WHERE status = 'PENDING' AND json_extract(rule, '$.type') = 'once'"
                " AND timer_id IN (SELECT timer_id FROM outbox)"
            ).rowcount
        )

    def _expire(self, conn: sqlite3.Connection, before: int) -> None:
        conn.execute(
            f"UPDATE {self.shadow} SET status = 'FAILED', last_error = ?, revision = revision + 1"
            " WHERE status = 'PENDING' AND json_extract(rule, '$.type') = 'once' AND due_at < ?",
            (EXPIRED_REASON, before),
        )

    def _partitions_of(self, conn: sqlite3.Connection) -> list[int]:
        """The partitions of the shadow and of the old view (every partition of the context when
        the old view cannot be read that far)."""
        found = {int(r[0]) for r in conn.execute(f'SELECT DISTINCT "partition" FROM {self.shadow}')}
        try:
            found |= {int(r[0]) for r in conn.execute(f'SELECT DISTINCT "partition" FROM {self.live}')}
        except sqlite3.DatabaseError:
            found |= set(range(self._partitions))
        return sorted(found)

    def _carry_one(self, p: int, result: Finished, conn: sqlite3.Connection) -> None:
        self._check_lock(conn)
        self._carry(conn, p, result)

    def _carry(self, conn: sqlite3.Connection, p: int, result: Finished, *, changed: bool = False) -> None:
        """The old view's rows of partition ``p`` replace the shadow's rows of their keys where
        their version is the same or later; a key the shadow does not hold is copied (the rows of
        the types not rebuilt, and what the feed applied past the replay's read). ``changed``:
        only the rows that differ from the shadow's (their revision moves with every write). A
        partition that cannot be read is recorded in ``result.unreadable``."""
        updates = ", ".join(f'"{c}" = excluded."{c}"' for c in COLUMNS)
        live_cols = ", ".join(f'l."{c}"' for c in COLUMNS)
        same = " AND ".join(f's."{c}" = l."{c}"' for c in ("partition", "aggregate", "owner_tenant", "owner_id", "key"))
        unchanged = (
            f" AND NOT EXISTS (SELECT 1 FROM {self.shadow} AS s WHERE {same} AND s.revision = l.revision"
            " AND s.version = l.version AND s.status = l.status)"
            if changed
            else ""
        )
        sql = (
            f'INSERT INTO {self.shadow} ({_COLS}) SELECT {live_cols} FROM {self.live} AS l WHERE l."partition" = ?'
            f"{unchanged} ON CONFLICT ({_KEY}) DO UPDATE SET {updates} WHERE {self.shadow}.version <= excluded.version"
        )
        # a row the replay read past the old one (a commit the feed had not applied yet): its
        # revision moves past the old row's, so a claim of the old row settled after the swap
        # (guarded by the revision it was claimed at) never lands on it
        past = (
            f"UPDATE {self.shadow} AS s SET revision = l.revision + 1 FROM {self.live} AS l"
            f' WHERE l."partition" = ? AND {same} AND s.version > l.version AND s.revision <= l.revision'
        )
        conn.execute("SAVEPOINT carry")
        try:
            result.carried += int(conn.execute(sql, (p,)).rowcount)
            conn.execute(past, (p,))
        except sqlite3.DatabaseError:
            conn.execute("ROLLBACK TO carry")
            if p not in result.unreadable:
                result.unreadable.append(p)
        conn.execute("RELEASE carry")

    def _count(self, conn: sqlite3.Connection, aggregate: str | None, result: Finished) -> None:
        where, params = ("WHERE aggregate = ?", (aggregate,)) if aggregate is not None else ("", ())
        result.statuses = {
            str(s): int(n)
            for s, n in conn.execute(f"SELECT status, count(*) FROM {self.shadow} {where} GROUP BY status", params)
        }
        expired_where = f"status = 'FAILED' AND last_error = ?{' AND aggregate = ?' if aggregate else ''}"
        expired_params: tuple[Any, ...] = (EXPIRED_REASON, *params)
        result.expired = int(
            conn.execute(f"SELECT count(*) FROM {self.shadow} WHERE {expired_where}", expired_params).fetchone()[0]
        )
        result.expired_listed = [
            Expired(timer_id=r[0], owner=f"{self.context}.{r[1]}/{r[3]} (tenant {r[2]})", key=r[4], due_at=r[5])
            for r in conn.execute(
                f'SELECT timer_id, aggregate, owner_tenant, owner_id, "key", due_at FROM {self.shadow}'
                f" WHERE {expired_where} ORDER BY due_at, timer_id LIMIT {EXPIRED_LISTED}",
                expired_params,
            )
        ]


class _DryRun(Exception):
    """Rolls a dry run's finishing transaction back."""


def _exists(conn: sqlite3.Connection, table: str) -> bool:
    return (
        conn.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None
    )


def _iso(ms: int) -> str:
    from wowd.fmt import iso_ms

    return iso_ms(int(ms))
