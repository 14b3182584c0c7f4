"""The timers' history on SQLite (:class:`~wowd.stores.base.TimerHistory`), a table of the one
file beside the timers.

Table ``wow_timer_history__<context>``: one row per record (:class:`~wowd.model.HistoryRecord`),
in the order written (a rowid table: new rows go to its end, a settle group's rows to a few
pages), unique on ``(timer_id, slot)`` (its index names a timer's records, one range of it),
with a partial index by owner and key over the schedule and cancel records (which name a key's
timers: an attempt, written on the hot path, is in no index by key), an index by request id, a
partial index on ``expires_at`` over the rows that expire, for the sweep (about the order of the
rows: its pages written in order too), and a partial index of the open schedules (a recurring
timer's, kept while it lives), which a schedule or cancel ends in one search of a few rows. A
``WITHOUT ROWID`` table keyed by ``(timer_id, slot)`` would write a settle group's rows into as
many pages of the table as rows (twice the time, measured).

The rows are written by statements of many rows each
(:func:`~wowd.stores.embedded.db.insert_rows`), by the feed in the transaction of its batch and
by the timer store in the transaction that fires a round into the outbox (:func:`write_records`), or by
:meth:`EmbeddedTimerHistory.append` in a transaction of its own (the settle groups of the claim,
deliver and settle path).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wowd.model import HISTORY_ATTEMPTS, AggregateRef, HistoryKind, HistoryRecord, validate_name
from wowd.model.history import CANCELLED, SCHEDULED, check_context
from wowd.stores.base import HISTORY_READ_LIMIT
from wowd.stores.embedded.db import SqliteDatabase, SqliteStore, insert_rows, update_rows
from wowd.stores.embedded.schema import history_ddl, history_table
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_rows import (
    C_AGGREGATE,
    C_KEY,
    C_OWNER_ID,
    C_OWNER_TENANT,
    C_REVISION,
    C_SCHEDULED_AT,
    C_TIMER_ID,
    C_VERSION,
)

__all__ = ["EmbeddedTimerHistory", "attempt_row", "record_row", "write_records"]

COLUMNS = (
    "timer_id",
    "slot",
    "kind",
    "aggregate",
    "owner_tenant",
    "owner_id",
    "key",
    "at",
    "version",
    "request_id",
    "expires_at",
    "scheduled_at",
    "position",
    "outcome",
    "status",
    "latency_ms",
    "reason",
    "answer",
)
_COLS = ", ".join(f'"{c}"' for c in COLUMNS)
_KINDS = {k.value: k for k in HistoryKind}


@functools.lru_cache(maxsize=16)
def put_sql(context: str) -> str:
    """One record, replacing the one of its ``(timer_id, slot)``."""
    t = history_table(context)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in COLUMNS[2:])
    return (
        f"INSERT INTO {t} ({_COLS}) VALUES ({', '.join('?' for _ in COLUMNS)})"
        f" ON CONFLICT (timer_id, slot) DO UPDATE SET {updates}"
    )


@functools.lru_cache(maxsize=16)
def end_sql(context: str) -> str:
    """Ends the open schedules (no expiry) of a key (``?5``; ``''``: every key) of an owner at
    versions below ``?6``: they expire at ``?1``."""
    t = history_table(context)
    return (
        f"UPDATE {t} SET expires_at = ?1 WHERE owner_id = ?2 AND aggregate = ?3 AND owner_tenant = ?4"
        # over the index of the open schedules (its WHERE repeated: SQLite reads it only then),
        # a few rows (recurring timers'), whatever the history's size
        f" AND slot = {SCHEDULED} AND expires_at IS NULL AND (?5 = '' OR \"key\" = ?5) AND version < ?6"
    )


def record_row(r: HistoryRecord) -> tuple[Any, ...]:
    """A record as the row ``COLUMNS`` describes."""
    o = r.owner
    return (
        r.timer_id,
        r.slot,
        r.kind.value,
        o.aggregate,
        o.tenant_id,
        o.id,
        r.key,
        r.at,
        r.version,
        r.request_id,
        r.expires_at,
        r.scheduled_at,
        r.position,
        r.outcome,
        r.status,
        r.latency_ms,
        r.reason,
        r.answer,
    )


def attempt_row(
    r: Sequence[Any], request_id: str, at: int, expires_at: int, outcome: str, reason: str | None
) -> tuple[Any, ...]:
    """The row of an attempt of the timer of the timers' row ``r`` (their ``COLUMNS`` order, as
    read to fire), as :func:`record_row` writes :func:`~wowd.model.attempt_record` of it."""
    return (
        r[C_TIMER_ID],
        r[C_REVISION] % HISTORY_ATTEMPTS,
        "attempt",
        r[C_AGGREGATE],
        r[C_OWNER_TENANT],
        r[C_OWNER_ID],
        r[C_KEY],
        at,
        r[C_VERSION],
        request_id,
        expires_at,
        r[C_SCHEDULED_AT],
        None,
        outcome,
        None,
        None,
        reason,
        None,
    )


def record_from_row(context: str, row: Sequence[Any]) -> HistoryRecord:
    (timer_id, slot, kind, aggregate, tenant, owner_id, key, at, version, request_id, expires_at, scheduled_at,
     position, outcome, status, latency_ms, reason, answer) = row  # fmt: skip
    return HistoryRecord(
        timer_id=timer_id,
        slot=slot,
        kind=_KINDS[kind],
        owner=AggregateRef(context=context, aggregate=aggregate, tenant_id=tenant, id=owner_id),
        key=key,
        at=at,
        version=version,
        request_id=request_id,
        expires_at=expires_at,
        scheduled_at=scheduled_at,
        position=position,
        outcome=outcome,
        status=status,
        latency_ms=latency_ms,
        reason=reason,
        answer=answer,
    )


def write_records(context: str, rows: Sequence[tuple[Any, ...]], conn: sqlite3.Connection) -> None:
    """Writes the rows (:func:`record_row`) in the caller's transaction on ``conn``, as
    :meth:`~wowd.stores.base.TimerHistory.append` says (the open schedules a commit's record
    ends are ended)."""
    if not rows:
        return
    insert_rows(conn, put_sql(context), rows)
    ends = [
        (row[10], row[5], row[3], row[4], row[6], row[8])
        for row in rows
        if row[1] in (SCHEDULED, CANCELLED) and row[10] is not None
    ]
    if ends:  # a row two of them end is updated once, with one of their expiries (the same moment, near enough)
        update_rows(conn, end_sql(context), ends)


class EmbeddedTimerHistory(SqliteStore):
    """:class:`~wowd.stores.base.TimerHistory` of one context on SQLite (``db_or_path`` as the
    other embedded stores take it)."""

    STORE = "history"

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str) -> None:
        self.context = validate_name(context, field="context")
        super().__init__(db_or_path)
        self._schema_ready = False

    def __repr__(self) -> str:
        return f"EmbeddedTimerHistory({self._db.path!r}, context={self.context!r})"

    def schema(self) -> Sequence[str]:
        return history_ddl(self.context)

    async def prepare(self) -> None:
        await self._ensure_ready()

    async def append(self, records: Sequence[HistoryRecord]) -> None:
        if not records:
            return
        check_context(records, self.context)
        rows = [record_row(r) for r in records]
        await self._run("append", self._db.transaction(functools.partial(write_records, self.context, rows)))

    async def _select(self, operation: str, where: str, params: Sequence[Any], limit: int) -> list[HistoryRecord]:
        t = history_table(self.context)
        sql = f"SELECT {_COLS} FROM {t} WHERE {where} ORDER BY at DESC, version DESC LIMIT ?"
        rows = await self._run(operation, lambda conn: conn.execute(sql, (*params, limit)).fetchall())
        ctx = self.context
        return [record_from_row(ctx, r) for r in reversed(rows)]

    async def of_timer(self, timer_id: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        return await self._select("of_timer", "timer_id = ?", (timer_id,), limit)

    async def of_key(self, owner: AggregateRef, key: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        """The timers of the key (and the owner's deletes) by their schedule and cancel records,
        over the partial index of those (an attempt's row is in no index by key: the hot path
        writes fewer), then every record of those timers by the table's key."""
        if owner.context != self.context:
            return []
        t = history_table(self.context)
        where = (
            f"timer_id IN (SELECT timer_id FROM {t} WHERE owner_id = ? AND aggregate = ? AND owner_tenant = ?"
            " AND \"key\" IN (?, '') AND slot < 0)"
        )
        return await self._select("of_key", where, (owner.id, owner.aggregate, owner.tenant_id, key), limit)

    async def of_request(self, request_id: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        return await self._select("of_request", "request_id = ?", (request_id,), limit)

    async def sweep(self, before: int, limit: int) -> int:
        t = history_table(self.context)
        sql = (
            f"DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t}"
            " WHERE expires_at IS NOT NULL AND expires_at < ?1 ORDER BY expires_at LIMIT ?2)"
        )

        def work(conn: sqlite3.Connection) -> int:
            return int(conn.execute(sql, (before, limit)).rowcount)

        return await self._run("sweep", self._db.transaction(work))
