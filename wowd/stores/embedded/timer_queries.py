"""The operators' reads of the timers on SQLite (:class:`~wowd.stores.base.TimerQueries`), each
statement built beside the call that sends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wowd.model import (
    AggregateRef,
    Timer,
    TimerStatus,
)
from wowd.stores.base import TimerSearch
from wowd.stores.embedded.db import (
    merged_read,
)
from wowd.stores.embedded.schema import (
    STUCK,
    timer_table,
)
from wowd.stores.embedded.timer_rows import (
    KEY_MATCH,
    LIVE,
    OWNER_MATCH,
    SELECTED,
    TimerTable,
    merge_due,
    timer_from_row,
)


def find_sql(context: str) -> str:
    return f"SELECT {SELECTED} FROM {timer_table(context)} WHERE {KEY_MATCH} AND {LIVE}"


def parked_sql(context: str) -> str:
    return (
        f"SELECT {SELECTED} FROM {timer_table(context)} WHERE status = 'PARKED'"
        " AND target_id = ? AND target_aggregate = ? AND target_tenant = ? AND target_context = ?"
        " ORDER BY due_at, timer_id"
    )


def scan_sql(context: str, *, status: bool, partitions: int | None) -> str:
    where = []
    if status:
        where.append("status = ?")
    if partitions is not None:
        where.append('"partition" IN (' + ", ".join("?" for _ in range(partitions)) + ")")
    where.append(LIVE)
    clause = " WHERE " + " AND ".join(where)
    return f"SELECT {SELECTED} FROM {timer_table(context)}{clause} ORDER BY due_at, timer_id LIMIT ?"


def search_statements(
    context: str, query: TimerSearch, partitions: int, owner_keys: Sequence[tuple[Any, ...]], limit: int
) -> list[tuple[str, list[Any]]]:
    """The statements of ``search``, each in ``(due_at, timer_id)`` order over an index, merged
    by the caller: one per owner (``owner_keys``, over the unique index's owner prefix), else one
    per partition for PENDING and FIRING timers (the due index) and one for PARKED and FAILED
    timers (the ``__stuck`` index); the filters of ``query`` on each."""
    statuses = query.statuses()
    common: list[str] = []
    params: list[Any] = []
    if query.key is not None:
        common.append('"key" = ?')
        params.append(query.key)
    if query.target is not None:
        common.append("target_id = ? AND target_aggregate = ? AND target_tenant = ? AND target_context = ?")
        tg = query.target
        params += [tg.id, tg.aggregate, tg.tenant_id, tg.context]
    if query.due_from is not None:
        common.append("due_at >= ?")
        params.append(query.due_from)
    if query.due_until is not None:
        common.append("due_at <= ?")
        params.append(query.due_until)
    if query.after is not None:
        common.append("due_at >= ? AND (due_at, timer_id) > (?, ?)")
        params += [query.after[0], query.after[0], query.after[1]]
    marks = ", ".join("?" for _ in statuses)
    values = [s.value for s in statuses]
    head = f"SELECT {SELECTED} FROM {timer_table(context)} WHERE "
    tail = " ORDER BY due_at, timer_id LIMIT ?"

    def statement(first: list[str], first_params: list[Any]) -> tuple[str, list[Any]]:
        return head + " AND ".join([*first, *common]) + tail, [*first_params, *params, limit]

    if owner_keys:
        return [statement([OWNER_MATCH, f"status IN ({marks})"], [*key, *values]) for key in owner_keys]
    out: list[tuple[str, list[Any]]] = []
    due = [s for s in values if s in ("PENDING", "FIRING")]
    stuck = [s for s in values if s in ("PARKED", "FAILED")]
    if due:
        # the IN term is the due index's WHERE: SQLite reads the index only when the query repeats it
        narrow = ["status = ?"] if len(due) == 1 else []
        for p in range(partitions):
            out.append(
                statement(
                    ['"partition" = ?', "status IN ('PENDING', 'FIRING')", *narrow], [p, *due[:1]] if narrow else [p]
                )
            )
    if stuck:
        narrow = ["status = ?"] if len(stuck) == 1 else []
        out.append(statement([f"status IN {STUCK}", *narrow], stuck[:1] if narrow else []))
    return out


class EmbeddedTimerQueries(TimerTable):
    """:class:`~wowd.stores.base.TimerQueries` on SQLite: each read one statement, or several
    (one per index that serves it) read in one transaction and merged."""

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
