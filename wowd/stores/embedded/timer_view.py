"""The view of the timers the feed writes on SQLite (:class:`~wowd.stores.base.TimerView`): puts,
cancels and tombstones in the context's timers table, each statement built beside the call
that sends it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from wowd.model import (
    AggregateRef,
    OnceRule,
    Timer,
    TimerWrite,
    deterministic_timer_id,
)
from wowd.stores.embedded.db import (
    NOW_MS,
    SqliteDatabase,
    insert_rows,
)
from wowd.stores.embedded.schema import (
    TIMER_FORMAT,
    TOMBSTONES,
    timer_format_sql,
    timer_register_sql,
    timer_table,
)
from wowd.stores.embedded.sqlite import sqlite3, variable_limit
from wowd.stores.embedded.timer_rows import (
    COLUMNS,
    KEY_MATCH,
    LIVE,
    NO_CLAIM,
    SELECTED,
    TimerTable,
    due_key,
    rule_json,
    timer_from_row,
    timer_params,
)
from wowd.stores.formats import other_format


def put_sql(context: str, table: str | None = None) -> str:
    """The conditional upsert of ``put``: replaces a stored timer or tombstone of an earlier
    version (bumping its revision so that a change made against the old one is skipped); the
    same or a later version stored changes nothing. ``table``: another table than the
    context's (as the write builders below take it)."""
    t = table or timer_table(context)
    placeholders = ", ".join("?" for _ in COLUMNS)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in COLUMNS if c != "revision")
    return (
        f"INSERT INTO {t} ({SELECTED}) VALUES ({placeholders})"
        f' ON CONFLICT ("partition", aggregate, owner_tenant, owner_id, "key") DO UPDATE SET {updates},'
        f" revision = MAX({t}.revision + 1, excluded.revision)"
        f" WHERE {t}.version < excluded.version"
    )


def live_at_sql(context: str, table: str | None = None) -> str:
    """Whether the key holds a live timer at exactly a version (a put that changed nothing)."""
    return f"SELECT 1 FROM {table or timer_table(context)} WHERE {KEY_MATCH} AND version = ? AND {LIVE}"


def cancel_sql(context: str, table: str | None = None) -> str:
    """A live timer at or below the version becomes a CANCELLED tombstone at that version."""
    return (
        f"UPDATE {table or timer_table(context)} SET status = 'CANCELLED', version = ?1, due_at = {NOW_MS},"
        f" {NO_CLAIM}, revision = revision + 1"
        f' WHERE "partition" = ?2 AND aggregate = ?3 AND owner_tenant = ?4 AND owner_id = ?5 AND "key" = ?6'
        f" AND version <= ?1 AND {LIVE}"
    )


def tombstone_sql(context: str, table: str | None = None) -> str:
    """A CANCELLED tombstone for a key with no timer, or raising an earlier tombstone's version
    (parameters as ``COLUMNS``; ``due_at`` is replaced by the store's now)."""
    t = table or timer_table(context)
    placeholders = ", ".join(f"{NOW_MS}" if c == "due_at" else "?" for c in COLUMNS)
    return (
        f"INSERT INTO {t} ({SELECTED}) VALUES ({placeholders})"
        f' ON CONFLICT ("partition", aggregate, owner_tenant, owner_id, "key") DO UPDATE SET'
        f" status = 'CANCELLED', version = excluded.version, due_at = excluded.due_at,"
        f" revision = {t}.revision + 1"
        f" WHERE {t}.status IN {TOMBSTONES} AND {t}.version < excluded.version"
    )


def cancel_all_sql(context: str, table: str | None = None) -> str:
    """Every live timer of an owner at or below the version becomes a CANCELLED tombstone."""
    return (
        f"UPDATE {table or timer_table(context)} SET status = 'CANCELLED', version = ?1, due_at = {NOW_MS},"
        f" {NO_CLAIM}, revision = revision + 1"
        f' WHERE "partition" = ?2 AND aggregate = ?3 AND owner_tenant = ?4 AND owner_id = ?5'
        f" AND version <= ?1 AND {LIVE}"
    )


PARKED_TARGET = ("target_id", "target_aggregate", "target_tenant", "target_context")
"""A target's columns in the parked index's order (the parameters of one target, in order)."""


def parked_many_sql(context: str, targets: int) -> str:
    """The PARKED timers of ``targets`` targets (:data:`PARKED_TARGET` parameters each): a
    ``VALUES`` list of the targets ``CROSS JOIN``ed to the table (SQLite keeps that loop order),
    so each target is one search of the parked index (its partial filter and its four keys).
    (A row value ``IN (VALUES ...)`` is planned as a scan of the whole index instead.)"""
    rows = ", ".join(["(?, ?, ?, ?)"] * targets)
    on = " AND ".join(f"t.{c} = k.column{i}" for i, c in enumerate(PARKED_TARGET, start=1))
    cols = ", ".join(f't."{c}"' for c in COLUMNS)
    return (
        f"SELECT {cols} FROM (VALUES {rows}) AS k CROSS JOIN {timer_table(context)} AS t"
        f" ON t.status = 'PARKED' AND {on} ORDER BY t.due_at, t.timer_id"
    )


def parked_params(targets: Sequence[AggregateRef]) -> list[tuple[Any, ...]]:
    """The parameters of :func:`parked_many_sql` for ``targets`` (each once)."""
    return [(t.id, t.aggregate, t.tenant_id, t.context) for t in dict.fromkeys(targets)]


WRITE_CHUNK = 2000
"""Timer writes per transaction of :meth:`EmbeddedTimerStore.write`."""


def tombstone_params(owner: AggregateRef, part: int, key: str, version: int) -> tuple[Any, ...]:
    """A CANCELLED tombstone of a key that holds no timer: the row ``COLUMNS`` describes, less
    ``due_at`` (the store's now, see :func:`tombstone_sql`)."""
    return (
        deterministic_timer_id(owner, key, version),
        part,
        owner.aggregate,
        owner.tenant_id,
        owner.id,
        key,
        version,
        "CANCELLED",
        0,
        owner.context,
        owner.aggregate,
        owner.tenant_id,
        owner.id,
        "",
        rule_json(OnceRule()),
        0,
        0,
        None,
        None,
        None,
        None,
        0,
    )


class EmbeddedTimerView(TimerTable):
    """:class:`~wowd.stores.base.TimerView` on SQLite: the feed's writes, each batch one
    transaction per :data:`WRITE_CHUNK` writes, its puts in statements of many rows each
    (:func:`~wowd.stores.embedded.db.insert_rows`)."""

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str, partitions: int) -> None:
        super().__init__(db_or_path, context=context, partitions=partitions)
        self._write_sql = self._write_sql_for(timer_table(context))

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
                    conn.execute(timer_register_sql(), (name, self.context, aggregate))
                    (fmt,) = conn.execute(timer_format_sql(), (name,)).fetchone()
                    if fmt != TIMER_FORMAT:
                        raise other_format(f"timer collection {name}", fmt, TIMER_FORMAT)
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
                    conn.execute(sql["tombstone"], tombstone_params(owner, part, key, version))
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
        rows.sort(key=due_key)
        return rows


def put_types(writes: Iterable[TimerWrite]) -> set[str]:
    """The aggregate types of the timers ``writes`` put (their collections are recorded)."""
    return {w.owner.aggregate for w in writes if w.kind == "put"}
