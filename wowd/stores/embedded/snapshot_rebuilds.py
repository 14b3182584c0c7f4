"""The rebuild control plane of the snapshots on SQLite (:class:`~wowd.stores.base.SnapshotRebuildStore`):
the claimed state revision of each type (table ``wow_snapshot_tables``) and the snapshots
rewritten in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wowd.errors import InvalidInput
from wowd.model import AggregateRef, AggregateType, SnapshotRecord, SnapshotTable
from wowd.stores.embedded.db import NOW_MS
from wowd.stores.embedded.schema import (
    SNAPSHOT_TABLES,
    snapshot_table,
)
from wowd.stores.embedded.snapshots import SnapshotTables, snapshot_params, upsert_sql
from wowd.stores.embedded.sqlite import sqlite3


def rewrite_sql(context: str) -> str:
    """A rebuilt snapshot in place: admitted over a lower state revision at the same or a lower
    version, or the same state revision at a lower version; clears the stale mark."""
    t = snapshot_table(context)
    guard = (
        f"({t}.state_revision < excluded.state_revision AND {t}.version <= excluded.version)"
        f" OR ({t}.state_revision = excluded.state_revision AND {t}.version < excluded.version)"
    )
    return upsert_sql(context, guard, "excluded.stale_version")


def claim_sql() -> str:
    """Records a claimed revision when higher than the stored one (or lower, with ``lower``: the
    last parameter); a new revision starts with both flags cleared."""
    return (
        f"INSERT INTO {SNAPSHOT_TABLES} (collection, context, aggregate, revision, rebuilding, backfilled, updated_at)"
        f" VALUES (?, ?, ?, ?, 0, 0, {NOW_MS}) ON CONFLICT (collection) DO UPDATE SET"
        " revision = excluded.revision, rebuilding = 0, backfilled = 0, updated_at = excluded.updated_at"
        f" WHERE excluded.revision > {SNAPSHOT_TABLES}.revision"
        f" OR (? AND excluded.revision < {SNAPSHOT_TABLES}.revision)"
    )


def mark_sql() -> str:
    """Sets the flags given (NULL: unchanged) when the claimed revision is the one named."""
    return (
        f"UPDATE {SNAPSHOT_TABLES} SET rebuilding = COALESCE(?, rebuilding), backfilled = COALESCE(?, backfilled),"
        f" updated_at = {NOW_MS} WHERE collection = ? AND revision = ?"
    )


def table_sql() -> str:
    return (
        "SELECT context, aggregate, revision, rebuilding, backfilled, updated_at"
        f" FROM {SNAPSHOT_TABLES} WHERE collection = ?"
    )


def pending_sql(context: str, *, after: bool) -> str:
    """Snapshots of a type below a state revision, in key order, after a key (row values)."""
    cond = " AND (tenant_id, aggregate_id) > (?, ?)" if after else ""
    return (
        f"SELECT tenant_id, aggregate_id FROM {snapshot_table(context)} WHERE aggregate = ? AND state_revision < ?"
        f"{cond} ORDER BY tenant_id, aggregate_id LIMIT ?"
    )


def _table(row: Sequence[Any]) -> SnapshotTable:
    return SnapshotTable(
        type=AggregateType(context=row[0], aggregate=row[1]),
        revision=row[2],
        rebuilding=bool(row[3]),
        backfilled=bool(row[4]),
        updated_at=row[5],
    )


class EmbeddedSnapshotRebuilds(SnapshotTables):
    """:class:`~wowd.stores.base.SnapshotRebuildStore` on SQLite: a rebuilt snapshot is rewritten
    in the snapshot table itself."""

    async def claim(self, type: AggregateType, revision: int, lower: bool = False) -> SnapshotTable:
        self._check(type)
        await self.prepare()
        name = self.collection_name(type.aggregate)

        def work(conn: sqlite3.Connection) -> SnapshotTable:
            conn.execute(claim_sql(), (name, type.context, type.aggregate, revision, 1 if lower else 0))
            return _table(conn.execute(table_sql(), (name,)).fetchone())

        return await self._run("claim", self._db.transaction(work))

    async def mark(
        self, type: AggregateType, revision: int, rebuilding: bool | None = None, backfilled: bool | None = None
    ) -> SnapshotTable | None:
        self._check(type)
        await self.prepare()
        name = self.collection_name(type.aggregate)
        flags = (None if rebuilding is None else int(rebuilding), None if backfilled is None else int(backfilled))

        def work(conn: sqlite3.Connection) -> SnapshotTable | None:
            if conn.execute(mark_sql(), (*flags, name, revision)).rowcount != 1:
                return None
            return _table(conn.execute(table_sql(), (name,)).fetchone())

        return await self._run("mark", self._db.transaction(work))

    async def table(self, type: AggregateType) -> SnapshotTable | None:
        self._check(type)
        await self.prepare()
        name = self.collection_name(type.aggregate)
        row = await self._run("table", lambda conn: conn.execute(table_sql(), (name,)).fetchone())
        return _table(row) if row is not None else None

    async def pending(
        self, type: AggregateType, revision: int, after: AggregateRef | None, limit: int
    ) -> list[AggregateRef]:
        self._check(type)
        await self.create_collection(type.aggregate)
        params: tuple[Any, ...] = (type.aggregate, revision)
        if after is not None:
            params += (after.tenant_id, after.id)
        params += (limit,)
        sql = pending_sql(self.context, after=after is not None)
        rows = await self._run("pending", lambda conn: conn.execute(sql, params).fetchall())
        return [AggregateRef(context=type.context, aggregate=type.aggregate, tenant_id=t, id=i) for t, i in rows]

    async def rewrite(self, snapshot: SnapshotRecord) -> bool:
        self._check(snapshot.ref)
        try:
            params = (*snapshot_params(snapshot)[:-1], None)  # a rewrite clears the stale mark
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"the state of {snapshot.ref} cannot be stored: {exc}", field="state") from exc
        await self.create_collection(snapshot.ref.aggregate)
        sql = rewrite_sql(self.context)
        return await self._run("rewrite", lambda conn: conn.execute(sql, params).rowcount == 1)
