"""A rebuild of the timer view on the embedded file: a shadow table beside the live one, swapped
in by one write transaction (``wowd timers rebuild``; the replay itself is the caller's,
:mod:`wowd.daemon.timer_rebuild`).

- **Lock.** One row per context in ``wow_timer_rebuild`` (owner, start, expiry): a second rebuild
  is refused while the row is another live owner's. The owner renews it as it goes; an owner
  of this host whose process is gone (a rebuild killed) holds nothing.
- **Shadow.** ``wow_timer__<context>__rebuild`` (:func:`~wowd.stores.embedded.timer_sql.shadow_table_name`),
  the live table's columns and unique key, no other index; dropped and created anew by
  :meth:`EmbeddedTimerRebuild.begin`. The replay writes into it with the timer store's own
  writes (:meth:`~wowd.stores.embedded.timers.EmbeddedTimerStore.write_steps`).
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

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio.to_thread

from wowd.errors import LeaseLost
from wowd.model import AggregateType, LogEntry, TimerWrite
from wowd.stores.embedded.db import NOW_MS, SqliteDatabase, SqliteStore
from wowd.stores.embedded.log import CHECKPOINT_SEQS_SQL, entries_between, entry_of
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_sql import (
    COLUMNS,
    TOMBSTONES,
    index_sql,
    shadow_table_name,
    table_name,
    table_sql,
)
from wowd.stores.embedded.timers import EmbeddedTimerStore, put_types
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
    "EXPIRED_REASON",
    "LOCK_TABLE",
    "EmbeddedTimerRebuild",
    "Expired",
    "Finished",
    "RebuildRunning",
    "replay_entries",
    "rows_between",
]

LOCK_TABLE = "wow_timer_rebuild"
"""One row per context whose timer view is being rebuilt."""

_LOCK_DDL = (
    f"CREATE TABLE IF NOT EXISTS {LOCK_TABLE} (context TEXT PRIMARY KEY, owner TEXT NOT NULL,"
    " started_at INTEGER NOT NULL, expires_at INTEGER NOT NULL)"
)
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


class EmbeddedTimerRebuild(SqliteStore):
    """The shadow table, its lock and its swap, on a connection of its own to the file."""

    STORE = "timer_rebuild"

    def __init__(
        self, db_or_path: SqliteDatabase | str, *, timers: EmbeddedTimerStore, owner: str | None = None
    ) -> None:
        super().__init__(db_or_path)
        self._timers = timers
        self.context = timers.context
        self.owner = owner or lock_owner()
        self.live = table_name(self.context)
        self.shadow = shadow_table_name(self.context)
        self._reader = SqliteDatabase(self.path)
        """A connection of its own for the replay's reads of the log: they run while the batch
        before is written on the store's connection (SQLite runs each on its own thread)."""

    # ---- the lock

    async def acquire(self, ttl_s: float) -> None:
        """Takes the lock row for ``ttl_s``; raises :class:`RebuildRunning` naming its holder when
        another live rebuild holds it."""
        ctx, me, ttl = self.context, self.owner, int(ttl_s * 1000)

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(_LOCK_DDL)
            row = conn.execute(
                f"SELECT owner, started_at, expires_at, {NOW_MS} FROM {LOCK_TABLE} WHERE context = ?", (ctx,)
            ).fetchone()
            if row is not None and row[0] != me and row[2] > row[3] and not lock_gone(row[0]):
                raise RebuildRunning(
                    f"a rebuild of the timer view of context {ctx!r} runs: lock held by {row[0]} since "
                    f"{_iso(row[1])}, until {_iso(row[2])} unless renewed (wait for it to end)"
                )
            conn.execute(
                f"INSERT INTO {LOCK_TABLE} (context, owner, started_at, expires_at)"
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
            sql = f"UPDATE {LOCK_TABLE} SET expires_at = {NOW_MS} + ? WHERE context = ? AND owner = ?"
            return int(conn.execute(sql, (ttl, ctx, me)).rowcount)

        if not await self._run("renew", self._db.transaction(work)):
            raise LeaseLost(f"the timer view rebuild's lock of context {ctx!r} was taken by another rebuild")

    async def release(self) -> None:
        """Drops the lock row if this rebuild holds it."""

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(_LOCK_DDL)
            conn.execute(f"DELETE FROM {LOCK_TABLE} WHERE context = ? AND owner = ?", (self.context, self.owner))

        await self._run("release", self._db.transaction(work))

    def _check_lock(self, conn: sqlite3.Connection) -> None:
        row = conn.execute(f"SELECT owner FROM {LOCK_TABLE} WHERE context = ?", (self.context,)).fetchone()
        if row is None or row[0] != self.owner:
            raise LeaseLost(f"the timer view rebuild's lock of context {self.context!r} was taken by another rebuild")

    # ---- the shadow

    async def begin(self) -> None:
        """A new, empty shadow table (a leftover of an interrupted rebuild is dropped)."""

        def work(conn: sqlite3.Connection) -> None:
            self._check_lock(conn)
            conn.execute(f"DROP TABLE IF EXISTS {self.shadow}")
            conn.execute(table_sql(self.shadow))

        await self._timers.prepare()
        await self._run("begin", self._db.transaction(work))

    async def read(self, after: int, limit: int) -> tuple[int, int, list[LogEntry]]:
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
        await self.write_steps(self.steps_of(writes), put_types(writes))

    async def last_seq(self) -> int:
        """The ``seq`` of the context's last commit (0 when none)."""
        ctx = self.context
        sql = "SELECT coalesce(max(seq), 0) FROM log WHERE context = ?"
        return int(await self._run("read", lambda conn: conn.execute(sql, (ctx,)).fetchone()[0], db=self._reader))

    def steps_of(self, writes: Sequence[TimerWrite]) -> list[tuple[str, tuple[Any, ...]]]:
        """The timer store's steps of ``writes`` (:meth:`~wowd.stores.embedded.timers.EmbeddedTimerStore.steps_of`)."""
        return self._timers.steps_of(writes)

    async def write_steps(self, steps: Sequence[tuple[str, tuple[Any, ...]]], types: Iterable[str]) -> None:
        """Planned writes (:meth:`steps_of`) into the shadow; ``types``: the aggregate types of
        the timers they put (their collections recorded first)."""
        await self._timers.record_types(types)
        if not steps:
            return
        timers, shadow = self._timers, self.shadow
        await self._run("write", self._db.transaction(lambda conn: timers.write_steps(steps, conn, table=shadow)))

    async def log_commits(self) -> int:
        """The commits of the context's log (the replay's total, for the progress lines)."""
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
            conn.execute(_LOCK_DDL)
            row = conn.execute(f"SELECT owner FROM {LOCK_TABLE} WHERE context = ?", (self.context,)).fetchone()
            if row is not None and row[0] != self.owner:
                return
            conn.execute(f"DROP TABLE IF EXISTS {self.shadow}")

        await self._run("abort", self._db.transaction(work))

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
        for p in await self._run("carry_over", self._partitions):
            await self._run("carry_over", self._db.transaction(functools.partial(self._carry_one, p, result)))

    async def finish(
        self,
        read: Mapping[int, int],
        *,
        consumer: str,
        project: Callable[[Sequence[LogEntry]], list[TimerWrite]],
        aggregate: str | None,
        swap: bool,
        result: Finished,
    ) -> Finished:
        """The finishing transaction (module docstring). ``read``: the ``seq`` the replay read to
        in each partition; ``consumer``: whose checkpoints the view follows; ``project``: the
        feed's projection of log entries into timer writes; ``aggregate``: only this type's
        timers were rebuilt (the old view's other rows are kept as they are); ``result``: what
        :meth:`carry_over` found, completed here. ``swap`` false (a dry run): everything is
        counted, nothing is changed (the transaction is rolled back and the shadow dropped)."""

        def work(conn: sqlite3.Connection) -> None:
            self._check_lock(conn)
            self._catch_up(conn, read, consumer, project, aggregate, result)
            self._outbox_fired(conn, result)
            if result.old_view and _exists(conn, self.live):
                for p in self._partitions(conn):
                    self._carry(conn, p, result, changed=True)
            else:
                result.old_view = False
            self._count(conn, aggregate, result)
            if not swap:
                raise _DryRun
            conn.execute(f"DROP TABLE IF EXISTS {self.live}")
            conn.execute(f"ALTER TABLE {self.shadow} RENAME TO {self.live}")
            for statement in index_sql(self.context):
                conn.execute(statement)
            result.swapped = True

        try:
            await self._run("finish", self._db.transaction(work))
        except _DryRun:
            await self.abort()
        return result

    def _catch_up(
        self,
        conn: sqlite3.Connection,
        read: Mapping[int, int],
        consumer: str,
        project: Callable[[Sequence[LogEntry]], list[TimerWrite]],
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

    def _partitions(self, conn: sqlite3.Connection) -> list[int]:
        """The partitions of the shadow and of the old view (every partition of the context when
        the old view cannot be read that far)."""
        found = {int(r[0]) for r in conn.execute(f'SELECT DISTINCT "partition" FROM {self.shadow}')}
        try:
            found |= {int(r[0]) for r in conn.execute(f'SELECT DISTINCT "partition" FROM {self.live}')}
        except sqlite3.DatabaseError:
            found |= set(range(self._timers.partitions))
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
