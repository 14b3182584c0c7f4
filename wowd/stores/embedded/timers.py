"""The timers of one context on SQLite (docs/concepts.md).

Layout (format 6):

- ``wow_timer_aggregate``: the registry, one row per aggregate type's (virtual) collection
  ``wow_timer__<context>__<aggregate>`` with its ``format``; prepare records the context's own
  row. A row of another format is refused (:class:`FormatError`): the view is then dropped and
  rebuilt from the log by the daemon.
- ``wow_timer__<context>``: one table for every aggregate type of the context (column
  ``aggregate`` for the owner's type), unique on ``(partition, aggregate, owner_tenant, owner_id,
  key)``, with a partial index ``(partition, due_at, timer_id) WHERE status IN ('PENDING',
  'FIRING')`` for ``due``, a partial index over PARKED timers by target for ``parked`` and a
  partial index ``(due_at)`` over tombstones for their sweep.
- Tombstones: a fired one-shot timer (``DONE``), a cancelled one (``CANCELLED``) keeps its row with
  that status, the version it was ended at and ``due_at`` = when; a put at or below that version
  is refused, so replaying the log re-delivers nothing. They are outside the due and parked
  indexes and invisible to every read; :meth:`EmbeddedTimerStore.sweep` deletes them after the
  retention. Format 5 (no tombstones, otherwise the same) is upgraded in place by ``prepare``.

The rule is kept as its JSON text (``{type, ...}``), the claim as flat columns. Every write is
one statement or one short ``BEGIN IMMEDIATE`` transaction (``settle``), its rows written by
statements of many rows each (:func:`~wowd.stores.embedded.db.insert_rows`,
:func:`~wowd.stores.embedded.db.update_rows`): no per-row calls on the hot path (due, claim,
fired, settle).

The hot path (docs/architecture.md, "Timer loop"): ``due`` is one compound statement per up to
:data:`DUE_ARMS` partitions (one arm per partition over the partial index; SQLite merges the arms
in ``(due_at, timer_id)`` order and stops at the limit), and :meth:`EmbeddedTimerStore.claim_due`
reads and claims a batch in one write transaction (the claim by ``rowid``), answering the
timers as claimed. ``next_due`` (the timer loop's sleep) is one compound statement of a
``MIN(due_at)`` per partition over the same partial index. Rows are decoded into
:class:`Timer` objects without re-validating what the store wrote itself.

The outbox shortcut into the outbox table of the same file (:meth:`EmbeddedTimerStore.fire_into_outbox`,
the ``outbox`` gateway's round on the embedded backend): the due read of ``claim_due``, the fire
rule's question to the log, the outbox rows and the fired settle of each timer by ``rowid`` in one
write transaction, with no claim: nothing can move between the read and the settle, and a crash
leaves all of it or none.

The SQL each method sends is built by the pure ``*_sql`` functions next to it.
"""

from __future__ import annotations

import functools
import heapq
import logging
import time
from collections.abc import Callable, Collection, Generator, Iterable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from wowd.errors import InvalidInput, LeaseLost, StorageError
from wowd.model import (
    AggregateRef,
    Claim,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
    misfire_reason,
    misfired,
    partition,
    request_id_for,
    validate_name,
)
from wowd.stores.base import OUTBOX_SHORTCUT, FiredTimer, OutboxFired, OutboxRound, TimerSearch
from wowd.stores.embedded.db import (
    SqliteDatabase,
    SqliteStore,
    insert_rows,
    json_rows,
    merged_read,
    update_rows,
)
from wowd.stores.embedded.history import attempt_row, write_records
from wowd.stores.embedded.history import schema_sql as history_schema
from wowd.stores.embedded.log import committed_after
from wowd.stores.embedded.outbox import SCHEMA as OUTBOX_SCHEMA
from wowd.stores.embedded.outbox import put_rows
from wowd.stores.embedded.sqlite import sqlite3, variable_limit
from wowd.stores.embedded.timer_sql import (
    _ONCE_JSON,
    _SETTLE_SET,
    C_AGGREGATE,
    C_DUE_AT,
    C_OWNER_ID,
    C_OWNER_TENANT,
    C_REVISION,
    C_ROWID,
    C_RULE,
    C_SCHEDULED_AT,
    C_TARGET_AGGREGATE,
    C_TARGET_CONTEXT,
    C_TIMER_ID,
    C_VERSION,
    DUE_ARMS,
    FORMAT,
    PARKED_TARGET,
    REGISTRY,
    ROWID_COLUMNS,
    WRITE_CHUNK,
    T,
    _due_key,
    _report_failed,
    _tombstone_params,
    cancel_all_sql,
    cancel_sql,
    claim_rowid_sql,
    claimed_from_row,
    ddl_sql,
    due_plan,
    due_union_sql,
    fail_rowid_sql,
    find_sql,
    fired_from_row,
    fired_rowid_sql,
    format_sql,
    live_at_sql,
    merge_due,
    next_due_sql,
    outbox_row,
    parked_many_sql,
    parked_params,
    parked_sql,
    put_sql,
    reclaim_sql,
    register_sql,
    registry_formats_sql,
    scan_sql,
    search_statements,
    settle_params,
    settle_sql,
    statement_limit,
    sweep_sql,
    table_name,
    timer_from_row,
    timer_params,
    tombstone_sql,
    upgrade_sql,
)
from wowd.stores.formats import other_format

__all__ = [
    "DUE_ARMS",
    "FORMAT",
    "REGISTRY",
    "EmbeddedTimerStore",
    "next_due_sql",
    "parked_params",
    "put_types",
]

log = logging.getLogger(__name__)


class EmbeddedTimerStore(SqliteStore):
    """:class:`~wowd.stores.base.TimerStore` on SQLite.

    ``db_or_path``: a :class:`SqliteDatabase` the caller owns, or a path this store opens (and
    closes in :meth:`close`). The tables are created on first use (or by :meth:`prepare`).
    """

    STORE = "timers"
    CAPABILITIES = (OUTBOX_SHORTCUT,)
    """The outbox table and the log are in this store's file: a round fires into the outbox in
    the transaction that settles its timers (:meth:`fire_into_outbox`)."""

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str, partitions: int) -> None:
        self.context = validate_name(context, field="context")
        if partitions < 1:
            raise InvalidInput(f"must be >= 1, got {partitions}", field="partitions")
        self.partitions = partitions
        super().__init__(db_or_path)
        self._prepared = False
        self._known: set[str] = set()
        t = context
        self._put_sql = put_sql(t)
        self._settle_sql = {k: settle_sql(t, k) for k in _SETTLE_SET}
        self._claim_sql = claim_rowid_sql(t)
        self._fired_sql = {k: fired_rowid_sql(t, k) for k in ("fired", "done")}
        self._outbox_ready = False
        self._history_ready = False
        self._write_sql = {
            "put": put_sql(t),
            "live_at": live_at_sql(t),
            "cancel": cancel_sql(t),
            "tombstone": tombstone_sql(t),
            "cancel_all": cancel_all_sql(t),
        }

    def __repr__(self) -> str:
        return f"EmbeddedTimerStore({self._db.path!r}, context={self.context!r})"

    def collection_name(self, aggregate: str) -> str:
        return f"wow_timer__{self.context}__{validate_name(aggregate, field='aggregate')}"

    # ---- DDL

    async def prepare(self) -> None:
        if not self._prepared:
            await self._run("prepare", self._db.transaction(self._prepare_sync))
            self._prepared = True

    def _prepare_sync(self, conn: sqlite3.Connection) -> None:
        for stmt in ddl_sql(self.context):
            conn.execute(stmt)
        conn.execute(upgrade_sql(), (self.context,))
        conn.execute(register_sql(), (table_name(self.context), self.context, None))
        for collection, fmt in conn.execute(registry_formats_sql(), (self.context,)):
            if fmt != FORMAT:
                raise other_format(f"timer collection {collection}", fmt, FORMAT)

    async def _register(self, aggregate: str) -> None:
        """Records an aggregate type's collection on its first use; refuses another format."""
        await self.prepare()
        if aggregate in self._known:
            return
        name = self.collection_name(aggregate)

        def work(conn: sqlite3.Connection) -> int:
            conn.execute(register_sql(), (name, self.context, aggregate))
            row = conn.execute(format_sql(), (name,)).fetchone()
            return int(row[0])

        fmt = await self._run("prepare", work)
        if fmt != FORMAT:
            raise other_format(f"timer collection {name}", fmt, FORMAT)
        self._known.add(aggregate)

    # ---- validation

    def _owner_key(self, owner: AggregateRef) -> tuple[Any, ...]:
        self._check_owner(owner)
        return (partition(owner.id, self.partitions), owner.aggregate, owner.tenant_id, owner.id)

    def _check_owner(self, owner: AggregateRef) -> None:
        if owner.context != self.context:
            raise InvalidInput(f"owner {owner} is not of this store's context {self.context!r}", field="owner.context")

    # ---- writes

    def _check_timer(self, timer: Timer) -> None:
        self._check_owner(timer.owner)
        expected = partition(timer.owner.id, self.partitions)
        if timer.partition != expected:
            raise InvalidInput(
                f"{timer.partition} is not the owner's partition {expected} of {self.partitions}",
                field="partition",
            )

    async def put(self, timer: Timer) -> bool:
        return bool((await self.write([TimerWrite.put(timer)]))[0])

    async def cancel(self, owner: AggregateRef, key: str, version: int) -> bool:
        return bool((await self.write([TimerWrite.cancel(owner, key, version)]))[0])

    async def cancel_all(self, owner: AggregateRef, version: int) -> int:
        return (await self.write([TimerWrite.cancel_all(owner, version)]))[0]

    async def write(self, writes: Sequence[TimerWrite]) -> list[int]:
        if not writes:
            return []
        steps = await self.plan_write(writes)
        # a transaction per chunk: the file's write lock is not held for a long batch (a lease
        # renewal waits for it); the writes commute, so a batch applied in parts is the same
        answers: list[int] = []
        for k in range(0, len(steps), WRITE_CHUNK):
            chunk = steps[k : k + WRITE_CHUNK]
            answers += await self._write("write", functools.partial(self.write_steps, chunk))
        return answers

    async def plan_write(self, writes: Sequence[TimerWrite]) -> list[tuple[str, tuple[Any, ...]]]:
        """``writes`` checked and made ready for :meth:`write_steps` (an aggregate type's
        collection recorded on its first use)."""
        steps = self.steps_of(writes)
        await self.record_types(put_types(writes))
        return steps

    def steps_of(self, writes: Sequence[TimerWrite]) -> list[tuple[str, tuple[Any, ...]]]:
        """``writes`` checked and made ready for :meth:`write_steps`, without recording the
        collections of their types (:meth:`plan_write` does, or :meth:`record_types`); touches
        no file (a process of its own may plan them)."""
        steps: list[tuple[str, tuple[Any, ...]]] = []
        for w in writes:
            if w.kind == "put":
                assert w.timer is not None
                self._check_timer(w.timer)
                steps.append(("put", timer_params(w.timer)))
            elif w.kind == "cancel":
                steps.append(("cancel", (w.version, *self._owner_key(w.owner), w.key)))
            else:
                steps.append(("cancel_all", (w.version, *self._owner_key(w.owner))))
        return steps

    async def record_types(self, aggregates: Iterable[str]) -> None:
        """Records the collections of the aggregate types ``aggregates`` not recorded yet (those
        whose timers :meth:`write_steps` is to put); refuses another format."""
        for aggregate in aggregates:
            if aggregate not in self._known:
                await self._register(aggregate)
        await self.prepare()

    def plan_write_in(
        self, writes: Sequence[TimerWrite], conn: sqlite3.Connection
    ) -> list[tuple[str, tuple[Any, ...]]]:
        """:meth:`plan_write` in the caller's transaction on ``conn`` (a type's collection
        recorded on its first use there; its format checked)."""
        steps: list[tuple[str, tuple[Any, ...]]] = []
        for w in writes:
            if w.kind == "put":
                assert w.timer is not None
                self._check_timer(w.timer)
                aggregate = w.owner.aggregate
                if aggregate not in self._known:
                    name = self.collection_name(aggregate)
                    conn.execute(register_sql(), (name, self.context, aggregate))
                    (fmt,) = conn.execute(format_sql(), (name,)).fetchone()
                    if fmt != FORMAT:
                        raise other_format(f"timer collection {name}", fmt, FORMAT)
                    self._known.add(aggregate)
                steps.append(("put", timer_params(w.timer)))
            elif w.kind == "cancel":
                steps.append(("cancel", (w.version, *self._owner_key(w.owner), w.key)))
            else:
                steps.append(("cancel_all", (w.version, *self._owner_key(w.owner))))
        return steps

    def _write_sql_for(self, table: str) -> dict[str, str]:
        t = self.context
        return {
            "put": put_sql(t, table),
            "live_at": live_at_sql(t, table),
            "cancel": cancel_sql(t, table),
            "tombstone": tombstone_sql(t, table),
            "cancel_all": cancel_all_sql(t, table),
        }

    def write_steps(
        self, steps: Sequence[tuple[str, tuple[Any, ...]]], conn: sqlite3.Connection, *, table: str | None = None
    ) -> list[int]:
        """The writes of :meth:`plan_write` in the caller's transaction on ``conn``, in order;
        each one's answer as :meth:`write` gives it. ``table``: written into that table (a
        rebuild's shadow of the view, :func:`~wowd.stores.embedded.timer_sql.table_sql`) instead
        of the view."""
        sql = self._write_sql if table is None else self._write_sql_for(table)
        ctx = self.context

        def one(kind: str, params: tuple[Any, ...]) -> int:
            if kind == "put":
                if conn.execute(sql["put"], params).rowcount == 1:
                    return 1
                # the same version stored live: changes nothing, admitted
                return 1 if conn.execute(sql["live_at"], (*params[1:6], params[6])).fetchone() else 0
            if kind == "cancel":
                n = int(conn.execute(sql["cancel"], params).rowcount)
                if n == 0:
                    version, part, agg, tenant, oid, key = params
                    owner = AggregateRef(context=ctx, aggregate=agg, tenant_id=tenant, id=oid)
                    conn.execute(sql["tombstone"], _tombstone_params(owner, part, key, version))
                return n
            return int(conn.execute(sql["cancel_all"], params).rowcount)

        out: list[int] = []
        i = 0
        while i < len(steps):
            kind = steps[i][0]
            j = i
            while j < len(steps) and steps[j][0] == kind:
                j += 1
            if kind == "put" and j - i > 1:
                # a run of puts in few statements (insert_rows); when one of them changed nothing (a
                # replay), the run is answered one by one (a repeat of a put is harmless)
                if insert_rows(conn, sql["put"], [p for _k, p in steps[i:j]]) == j - i:
                    out += [1] * (j - i)
                else:
                    out += [one(kind, p) for _k, p in steps[i:j]]
            else:
                out += [one(kind, p) for _k, p in steps[i:j]]
            i = j
        return out

    async def sweep(self, before: int, limit: int) -> int:
        await self.prepare()
        sql = sweep_sql(self.context)
        return await self._write("sweep", lambda conn: int(conn.execute(sql, (before, limit)).rowcount))

    async def reclaim(self, partitions: set[int] | frozenset[int], fence: int) -> int:
        if not partitions:
            return 0
        await self.prepare()
        parts = sorted(partitions)
        sql = reclaim_sql(self.context, len(parts))
        return await self._write("reclaim", lambda conn: int(conn.execute(sql, (fence, *parts)).rowcount))

    async def settle(self, changes: Sequence[TimerChange]) -> int:
        if not changes:
            return 0
        for ch in changes:
            if ch.timer.owner.context != self.context:
                self._check_owner(ch.timer.owner)
        await self.prepare()
        written: int = await self._write("settle", functools.partial(self.settle_changes, changes))
        if written < len(changes):
            log.debug("settle: %d of %d changes skipped (timer moved on)", len(changes) - written, len(changes))
        return written

    def settle_changes(self, changes: Sequence[TimerChange], conn: sqlite3.Connection) -> int:
        """``changes`` (of this store's context, each of another timer) in the caller's transaction
        on ``conn``: one :func:`~wowd.stores.embedded.db.update_rows` per change kind, kinds in the
        order they first appear; how many rows changed."""
        groups: dict[str, list[tuple[Any, ...]]] = {}
        for ch in changes:
            kind, params = settle_params(ch)
            groups.setdefault(kind, []).append(params)
        return sum(update_rows(conn, self._settle_sql[kind], rows) for kind, rows in groups.items())

    # ---- reads

    async def find(self, owner: AggregateRef, key: str) -> Timer | None:
        params = (*self._owner_key(owner), key)
        await self.prepare()
        sql = find_sql(self.context)
        row = await self._run("find", lambda conn: conn.execute(sql, params).fetchone())
        return timer_from_row(self.context, row) if row is not None else None

    async def parked(self, target: AggregateRef) -> list[Timer]:
        params = (target.id, target.aggregate, target.tenant_id, target.context)
        await self.prepare()
        return await self._select("parked", parked_sql(self.context), params)

    async def parked_many(self, targets: Sequence[AggregateRef]) -> list[Timer]:
        """One :func:`parked_many_sql` statement per as many targets as SQLite's variable limit
        allows (all of a feed batch's in one), read in one transaction."""
        params = parked_params(targets)
        if not params:
            return []
        await self.prepare()
        return await self._run("parked_many", functools.partial(self.parked_timers, params))

    def parked_timers(self, params: Sequence[tuple[Any, ...]], conn: sqlite3.Connection) -> list[Timer]:
        """The PARKED timers of the targets of :func:`parked_params`, in due order, on ``conn`` (in
        the caller's transaction, or in one of their own)."""
        return [timer_from_row(self.context, r) for r in self._parked_rows(params, conn)]

    def _parked_rows(self, params: Sequence[tuple[Any, ...]], conn: sqlite3.Connection) -> list[Sequence[Any]]:
        ctx = self.context
        per = max(1, variable_limit(conn) // len(PARKED_TARGET))
        chunks = [params[i : i + per] for i in range(0, len(params), per)]
        if len(chunks) == 1:
            return conn.execute(parked_many_sql(ctx, len(params)), [v for p in params for v in p]).fetchall()
        began = not conn.in_transaction
        if began:
            conn.execute("BEGIN")
        try:
            rows = [
                r
                for chunk in chunks
                for r in conn.execute(parked_many_sql(ctx, len(chunk)), [v for p in chunk for v in p])
            ]
        finally:
            if began:
                conn.execute("COMMIT")
        rows.sort(key=_due_key)
        return rows

    async def due(self, partitions: set[int] | frozenset[int], until: int, limit: int) -> list[Timer]:
        if not partitions or limit <= 0:
            return []
        await self.prepare()
        read = self._due_reader(partitions, until, limit, rowid=False)
        rows = await self._run("due", read)
        ctx = self.context
        return [timer_from_row(ctx, r) for r in rows]

    async def claim_due(
        self,
        partitions: set[int] | frozenset[int],
        until: int,
        limit: int,
        *,
        owner_key: str,
        fence: int,
        claim_until: int,
        exclude: Collection[str] = (),
    ) -> list[Timer]:
        """The due read and the claim of what it read in one write transaction: nothing can
        move between them, so every timer read is claimed (or, undecodable, failed)."""
        if not partitions or limit <= 0:
            return []
        await self.prepare()
        skip = frozenset(exclude)
        read = self._due_rows(partitions, until, limit + len(skip))
        claim = Claim(owner_key=owner_key, fence=fence, until=claim_until)
        claim_sql = self._claim_sql
        fail_sql = fail_rowid_sql(self.context)
        ctx = self.context
        failed: list[tuple[Sequence[Any], str]] = []

        def work(conn: sqlite3.Connection) -> list[Timer]:
            out: list[Timer] = []
            params: list[tuple[Any, ...]] = []
            undecodable: list[tuple[str, Any, Any]] = []
            with closing(read(conn)) as rows:
                for r in rows:
                    if r[C_TIMER_ID] in skip:
                        continue
                    if len(out) >= limit:
                        break
                    try:
                        t = claimed_from_row(ctx, r, claim)
                    except Exception as exc:  # a row this version cannot decode: FAILED, not a crash
                        reason = f"undecodable timer: {type(exc).__name__}: {exc}"
                        undecodable.append((reason, r[C_ROWID], r[C_REVISION]))
                        failed.append((r, reason))
                        continue
                    out.append(t)
                    params.append((claim_until, owner_key, fence, r[C_ROWID], r[C_REVISION]))
            if undecodable:
                conn.executemany(fail_sql, undecodable)
            if params:
                claimed = update_rows(conn, claim_sql, params)
                if claimed != len(params):  # cannot happen: the rows were read in this transaction
                    raise StorageError(f"claim_due: claimed {claimed} of the {len(params)} timers read")
            return out

        timers = await self._write("claim_due", work)
        _report_failed(failed)
        return timers

    async def fire_into_outbox(self, round: OutboxRound) -> OutboxFired:
        """:class:`~wowd.stores.base.OutboxShortcut` into the ``outbox`` table of this store's
        file: the due read of ``claim_due`` (a claim another holder made is due only once
        expired), the fire rule's question to the log for the timers due after ``read_to``
        (:func:`~wowd.stores.embedded.log.committed_after`, the statement of
        :meth:`EmbeddedLog.committed_after`), the outbox rows (:func:`outbox_row`,
        :func:`~wowd.stores.embedded.outbox.put_rows`: a request id in the outbox already, a
        re-fire, is recorded as a re-delivery) and the fired settle by ``rowid``, one
        :func:`~wowd.stores.embedded.db.update_rows` per kind (:func:`fired_rowid_sql`), in one
        ``BEGIN IMMEDIATE`` transaction. A one-shot timer is handled from its row alone; a
        recurring one is decoded for ``next_due``."""
        partitions, limit, at, read_to = round.partitions, round.limit, round.at, round.read_to
        fence, owner_key, deadline = round.fence, round.owner_key, round.deadline
        next_due = round.next_due
        if not partitions or limit <= 0:
            return OutboxFired([])
        await self.prepare()
        await self.prepare_outbox()
        skip = frozenset(round.exclude)
        read = self._due_rows(partitions, at, limit + len(skip))
        fail_sql = fail_rowid_sql(self.context)
        done_sql, fired_sql = self._fired_sql["done"], self._fired_sql["fired"]
        ctx = self.context
        failed: list[tuple[Sequence[Any], str]] = []
        retention_ms = round.history_retention_ms
        if retention_ms is not None:
            await self.prepare_history()

        def work(conn: sqlite3.Connection) -> OutboxFired:
            failed.clear()
            fired: list[FiredTimer] = []
            history: list[tuple[Any, ...]] = []
            rows: list[tuple[Any, ...]] = []
            done: list[tuple[Any, ...]] = []
            moved: list[tuple[Any, ...]] = []
            undecodable: list[tuple[str, Any, Any]] = []
            with closing(read(conn)) as due:
                candidates = [r for r in due if r[C_TIMER_ID] not in skip]
            # due after read_to: fired only where the log holds no commit of the owner above the
            # timer's version (a cancel, a put or a delete the feed has not applied yet)
            asked = [
                (n, (ctx, r[C_AGGREGATE], r[C_OWNER_TENANT], r[C_OWNER_ID], r[C_VERSION]))
                for n, r in enumerate(candidates)
                if r[C_DUE_AT] > read_to
            ]
            held = committed_after(conn, [q for _, q in asked]) if asked else set()
            left = {asked[i][0] for i in held}
            for n, r in enumerate(candidates):
                if n in left:
                    continue
                if len(fired) >= limit:
                    break
                nxt: int | None = None
                late = False
                timer: Timer | None = None
                if r[C_RULE] != _ONCE_JSON:
                    try:
                        timer = fired_from_row(ctx, r)
                        nxt = next_due(timer, at)
                        late = misfired(timer.rule, timer.scheduled_at, at)
                    except Exception as exc:  # a row this version cannot fire: FAILED, not a crash
                        reason = f"undecodable timer: {type(exc).__name__}: {exc}"
                        undecodable.append((reason, r[C_ROWID], r[C_REVISION]))
                        failed.append((r, reason))
                        continue
                target = f"{r[C_TARGET_CONTEXT]}.{r[C_TARGET_AGGREGATE]}"
                if late:  # past its misfire grace: settled, not delivered
                    fired.append(FiredTimer(r[C_TIMER_ID], target, r[C_SCHEDULED_AT], nxt, True, timer))
                    if retention_ms is not None:
                        assert timer is not None
                        why = misfire_reason(timer.rule, timer.scheduled_at, at)
                        rid = request_id_for(r[C_TIMER_ID], r[C_SCHEDULED_AT])
                        history.append(attempt_row(r, rid, at, at + retention_ms, "misfired", why))
                else:
                    fired.append(FiredTimer(r[C_TIMER_ID], target, r[C_SCHEDULED_AT], nxt))
                    row = outbox_row(r, fence, owner_key, at)
                    rows.append(row)
                    if retention_ms is not None:
                        history.append(attempt_row(r, row[0], at, at + retention_ms, "delivered", None))
                if nxt is None:
                    done.append((r[C_ROWID], r[C_REVISION]))
                else:
                    moved.append((nxt, nxt, r[C_ROWID], r[C_REVISION]))
            if undecodable:
                conn.executemany(fail_sql, undecodable)
            if fired:
                if rows:
                    put_rows(conn, rows)
                if history:
                    write_records(ctx, history, conn)
                settled = update_rows(conn, done_sql, done) + update_rows(conn, fired_sql, moved)
                if settled != len(fired):  # cannot happen: the rows were read in this transaction
                    raise StorageError(f"fire_into_outbox: settled {settled} of the {len(fired)} timers read")
            if deadline is not None and time.monotonic() >= deadline:
                raise LeaseLost("lease no longer valid: the fired batch is rolled back")
            return OutboxFired(fired, len(left))

        out = await self._write("fire_into_outbox", work)
        _report_failed(failed)
        return out

    async def prepare_history(self) -> None:
        """Creates the timer history table of this file when missing (once; the history store's
        DDL)."""
        if not self._history_ready:
            await self._create(history_schema(self.context))
            self._history_ready = True

    async def prepare_outbox(self) -> None:
        """Creates the outbox table of this file when missing (once; the outbox store's DDL)."""
        if not self._outbox_ready:
            await self._create(OUTBOX_SCHEMA)
            self._outbox_ready = True

    async def _create(self, statements: Iterable[str]) -> None:
        def create(conn: sqlite3.Connection) -> None:
            for statement in statements:
                conn.execute(statement)

        await self._run("prepare", self._db.transaction(create))

    async def next_due(self, partitions: set[int] | frozenset[int], after: int) -> int | None:
        if not partitions:
            return None
        await self.prepare()
        statements = [(next_due_sql(self.context, len(g)), (after, *g)) for g in due_plan(partitions)]

        def read(conn: sqlite3.Connection) -> int | None:
            found = [row[0] for sql, params in statements for row in conn.execute(sql, params)]
            return min((x for x in found if x is not None), default=None)

        return await self._run("next_due", read)

    def _due_rows(
        self, partitions: Iterable[int], until: int, limit: int
    ) -> Callable[[sqlite3.Connection], Generator[Sequence[Any], None, None]]:
        """The due rows (with their ``rowid``) as :meth:`_due_reader` reads them, in the
        transaction the caller holds: each statement's rows read as one value (at most the
        written limit, ``limit`` rounded up), merged as they are consumed (a claim that skips its
        timers in flight stops once it has its batch)."""
        written = statement_limit(limit)
        statements = [
            (due_union_sql(self.context, len(group), written, rowid=True), (until, *group))
            for group in due_plan(partitions)
        ]

        def rows(conn: sqlite3.Connection) -> Generator[Sequence[Any], None, None]:
            batches = [json_rows(conn, sql, ROWID_COLUMNS, params) for sql, params in statements]
            if len(batches) == 1:
                yield from batches[0]
            else:
                yield from heapq.merge(*batches, key=_due_key)

        return rows

    def _due_reader(
        self, partitions: Iterable[int], until: int, limit: int, *, rowid: bool
    ) -> Callable[[sqlite3.Connection], list[Sequence[Any]]]:
        """Reads the due rows: one compound statement per group of :data:`DUE_ARMS` partitions;
        several groups are merged here, read in one transaction (one snapshot)."""
        ctx = self.context
        written = statement_limit(limit)
        statements = [
            (due_union_sql(ctx, len(group), written, rowid=rowid), (until, *group)) for group in due_plan(partitions)
        ]
        return merged_read(statements, merge_due, limit)

    async def scan(
        self, *, status: TimerStatus | None = None, limit: int = 100, partitions: set[int] | None = None
    ) -> list[Timer]:
        await self.prepare()
        params: list[Any] = []
        if status is not None:
            params.append(status.value)
        if partitions is not None:
            params += sorted(partitions)
        params.append(limit)
        sql = scan_sql(
            self.context, status=status is not None, partitions=None if partitions is None else len(partitions)
        )
        return await self._select("scan", sql, params)

    async def search(self, query: TimerSearch, limit: int) -> list[Timer]:
        """The statements of :func:`search_statements` read in one transaction, merged."""
        owners = [o for o in dict.fromkeys(query.owners) if o.context == self.context]
        if limit < 1 or (query.owners and not owners):
            query.statuses()
            return []
        keys = [self._owner_key(o) for o in owners]
        statements = search_statements(self.context, query, self.partitions, keys, limit)
        await self.prepare()
        rows = await self._run("search", merged_read(statements, merge_due, limit))
        ctx = self.context
        return [timer_from_row(ctx, r) for r in rows]

    async def _select(self, operation: str, sql: str, params: Sequence[Any]) -> list[Timer]:
        rows = await self._run(operation, lambda conn: conn.execute(sql, params).fetchall())
        ctx = self.context
        return [timer_from_row(ctx, r) for r in rows]

    async def _write(self, operation: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A write: ``fn`` in one write transaction (:meth:`SqliteDatabase.transaction`, which
        holds the file's write lock)."""
        return await self._run(operation, self._db.transaction(fn))


def put_types(writes: Iterable[TimerWrite]) -> set[str]:
    """The aggregate types of the timers ``writes`` put (their collections are recorded)."""
    return {w.owner.aggregate for w in writes if w.kind == "put"}
