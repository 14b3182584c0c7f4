"""Snapshots of one context on SQLite (docs/stores.md).

Layout (format 5):

- ``wow_snapshot__<context>``: one row per aggregate, keyed ``(aggregate, tenant_id,
  aggregate_id)`` (the aggregate type, then Mongo's ``_id: {t, a}``); the state and tags as JSON
  text, decimals as the tagged string ``{"$numberDecimal": "<digits>"}`` (exact, never a float,
  Extended JSON's spelling of Decimal128); two partial indexes ``(aggregate, tenant_id,
  owner_id)`` and ``(aggregate, tenant_id, space_id)`` over the snapshots not deleted.
- ``wow_snapshot_aggregate``: the format record of each aggregate type's (virtual) collection
  ``wow_snapshot__<context>__<aggregate>``; another format is refused (:class:`FormatError`).
- ``wow_snapshot_tables``: the rebuild control plane, one row per collection name: the claimed
  state revision and the ``rebuilding`` / ``backfilled`` flags.

A save is one conditional upsert (written when the stored version is below the new one and the
stored state revision not above it); a save refused for a higher stored state revision then
marks the stored snapshot stale in the same transaction. The SQL is built by the pure ``*_sql``
functions next to the methods that send it.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from wowd.errors import InvalidInput
from wowd.model import AggregateRef, AggregateType, SnapshotRecord, SnapshotSaveOutcome, validate_name
from wowd.stores.embedded.db import NOW_MS, SqliteDatabase, SqliteStore
from wowd.stores.embedded.schema import (
    SNAPSHOT_FORMAT,
    snapshot_ddl,
    snapshot_format_sql,
    snapshot_formats_sql,
    snapshot_register_sql,
    snapshot_table,
)
from wowd.stores.embedded.sqlite import sqlite3, variable_limit
from wowd.stores.formats import other_format, too_new

__all__ = ["SNAPSHOT_FORMAT", "EmbeddedSnapshotStore", "decode_state", "encode_state"]

T = TypeVar("T")

DECIMAL_TAG = "$numberDecimal"

COLUMNS = (
    "aggregate",
    "tenant_id",
    "aggregate_id",
    "version",
    "state_revision",
    "state",
    "owner_id",
    "space_id",
    "tags",
    "access_version",
    "deleted",
    "event_time",
    "stale_version",
)
_COLS = ", ".join(COLUMNS)
_KEY = "aggregate = ? AND tenant_id = ? AND aggregate_id = ?"


# --------------------------------------------------------------------------- state encoding


def _encode_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return {DECIMAL_TAG: str(value)}
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def encode_state(state: Mapping[str, Any]) -> str:
    """The state's JSON text; a Decimal becomes ``{"$numberDecimal": "<digits>"}`` (exact).
    Raises ``TypeError``/``ValueError`` for a value JSON cannot hold (a set, bytes, ...)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a state must be a mapping, got {type(state).__name__}")
    return json.dumps(state, default=_encode_default, separators=(",", ":"), ensure_ascii=False)


def _decode_hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1:
        tagged = obj.get(DECIMAL_TAG)
        if isinstance(tagged, str):
            return Decimal(tagged)
    return obj


def decode_state(text: str) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(text, object_hook=_decode_hook)
    return state


# --------------------------------------------------------------------------- pure SQL builders


def _stale_after(t: str) -> str:
    """The stale mark kept by a write of ``excluded.version``: the later of the stored one and
    the written one when it is above that version, else none."""
    mark = f"MAX(COALESCE({t}.stale_version, 0), COALESCE(excluded.stale_version, 0))"
    return f"CASE WHEN {mark} > excluded.version THEN {mark} ELSE NULL END"


def upsert_sql(context: str, guard: str, stale: str) -> str:
    t = snapshot_table(context)
    marks = ", ".join("?" for _ in COLUMNS)
    sets = ", ".join(f"{c} = excluded.{c}" for c in COLUMNS[3:-1])
    return (
        f"INSERT INTO {t} ({_COLS}, written_at) VALUES ({marks}, {NOW_MS})"
        f" ON CONFLICT (aggregate, tenant_id, aggregate_id) DO UPDATE SET {sets},"
        f" stale_version = {stale}, written_at = excluded.written_at WHERE {guard}"
    )


def save_sql(context: str) -> str:
    """The conditional upsert of a save: written when the stored version is below the new one and
    the stored state revision is not above the new one; clears a stale mark up to its version."""
    t = snapshot_table(context)
    return upsert_sql(
        context,
        f"{t}.version < excluded.version AND {t}.state_revision <= excluded.state_revision",
        _stale_after(t),
    )


def mark_refused_sql(context: str) -> str:
    """After a refused save of (version, state revision): a stored snapshot of a higher state
    revision and a lower version is behind the log; its stale mark becomes at least that version.
    Parameters: version, key, state revision, version."""
    return (
        f"UPDATE {snapshot_table(context)} SET stale_version = MAX(COALESCE(stale_version, 0), ?)"
        f" WHERE {_KEY} AND state_revision > ? AND version < ?"
    )


def load_sql(context: str) -> str:
    return f"SELECT {_COLS} FROM {snapshot_table(context)} WHERE {_KEY}"


def load_many_sql(context: str, refs: int) -> str:
    """The snapshots of ``refs`` aggregates of one type (the type, then ``tenant_id``,
    ``aggregate_id`` per ref): a ``VALUES`` list of the keys ``CROSS JOIN``ed to the table
    (SQLite keeps that loop order), so each ref is one search of the primary key. (A row value
    ``IN (VALUES ...)`` is planned as a scan of the type's rows instead.)"""
    rows = ", ".join(["(?, ?)"] * refs)
    cols = ", ".join(f"s.{c}" for c in COLUMNS)
    return (
        f"SELECT {cols} FROM (VALUES {rows}) AS k CROSS JOIN {snapshot_table(context)} AS s"
        " ON s.aggregate = ? AND s.tenant_id = k.column1 AND s.aggregate_id = k.column2"
    )


def mark_stale_sql(context: str) -> str:
    return (
        f"UPDATE {snapshot_table(context)} SET stale_version = MAX(COALESCE(stale_version, 0), version + 1)"
        f" WHERE {_KEY}"
    )


# --------------------------------------------------------------------------- row mapping


def snapshot_params(s: SnapshotRecord) -> tuple[Any, ...]:
    """The row of a snapshot (``COLUMNS``); raises ``TypeError``/``ValueError`` for a state JSON
    cannot hold."""
    r = s.ref
    stale = s.stale_version if s.stale_version is not None and s.stale_version > s.version else None
    return (
        r.aggregate,
        r.tenant_id,
        r.id,
        s.version,
        s.state_revision,
        encode_state(s.state),
        s.owner_id,
        s.space_id,
        json.dumps(list(s.tags), separators=(",", ":"), ensure_ascii=False),
        s.access_version,
        1 if s.deleted else 0,
        s.event_time,
        stale,
    )


def snapshot_from_row(context: str, r: Sequence[Any]) -> SnapshotRecord:
    return SnapshotRecord(
        ref=AggregateRef(context=context, aggregate=r[0], tenant_id=r[1], id=r[2]),
        version=r[3],
        state_revision=r[4],
        state=decode_state(r[5]),
        owner_id=r[6],
        space_id=r[7],
        tags=tuple(json.loads(r[8])),
        access_version=r[9],
        deleted=bool(r[10]),
        event_time=r[11],
        stale_version=r[12],
    )


# --------------------------------------------------------------------------- the store


class SnapshotTables(SqliteStore):
    """A store of the context's snapshot table (the base of the snapshots and of their rebuild
    control plane): the context's check, the tables made sure of at first use, each aggregate
    type's collection recorded in the registry (another format refused).

    ``db_or_path``: a :class:`SqliteDatabase` the caller owns, or a path this store opens (and
    closes in :meth:`close`).
    """

    STORE = "snapshots"

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str) -> None:
        self.context = validate_name(context, field="context")
        super().__init__(db_or_path)
        self._prepared = False
        self._known: set[str] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._db.path!r}, context={self.context!r})"

    def collection_name(self, aggregate: str) -> str:
        return f"wow_snapshot__{self.context}__{validate_name(aggregate, field='aggregate')}"

    # ---- DDL

    async def prepare(self) -> None:
        if not self._prepared:

            def work(conn: sqlite3.Connection) -> None:
                for stmt in snapshot_ddl(self.context):
                    conn.execute(stmt)
                for name, fmt in conn.execute(snapshot_formats_sql(), (self.context,)):
                    if isinstance(fmt, int) and fmt > SNAPSHOT_FORMAT:  # a newer wowd's: refused at start
                        raise too_new(f"snapshot collection {name}", fmt, SNAPSHOT_FORMAT)

            await self._run("prepare", self._db.transaction(work))
            self._prepared = True

    async def create_collection(self, aggregate: str) -> None:
        name = self.collection_name(aggregate)
        await self.prepare()
        if aggregate in self._known:
            return

        def work(conn: sqlite3.Connection) -> int:
            conn.execute(snapshot_register_sql(), (name, self.context, aggregate))
            row = conn.execute(snapshot_format_sql(), (name,)).fetchone()
            return int(row[0])

        fmt = await self._run("create_collection", work)
        if fmt != SNAPSHOT_FORMAT:
            raise other_format(f"snapshot collection {name}", fmt, SNAPSHOT_FORMAT)
        self._known.add(aggregate)

    def _check(self, ref: AggregateRef | AggregateType) -> None:
        if ref.context != self.context:
            raise InvalidInput(f"{ref} is not of this store's context {self.context!r}", field="context")


class EmbeddedSnapshotStore(SnapshotTables):
    """:class:`~wowd.stores.base.SnapshotStore` on SQLite."""

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str) -> None:
        super().__init__(db_or_path, context=context)
        self._save_sql = save_sql(context)
        self._mark_refused_sql = mark_refused_sql(context)

    async def load(self, ref: AggregateRef) -> SnapshotRecord | None:
        self._check(ref)
        await self.create_collection(ref.aggregate)
        sql, key = load_sql(self.context), (ref.aggregate, ref.tenant_id, ref.id)
        row = await self._run("load", lambda conn: conn.execute(sql, key).fetchone())
        return snapshot_from_row(self.context, row) if row is not None else None

    async def load_many(self, refs: Sequence[AggregateRef]) -> dict[AggregateRef, SnapshotRecord]:
        """One :func:`load_many_sql` statement per type, split only where its refs exceed
        SQLite's variable limit; all of them in one call."""
        by_type: dict[str, list[AggregateRef]] = {}
        for r in dict.fromkeys(refs):
            self._check(r)
            by_type.setdefault(r.aggregate, []).append(r)
        if not by_type:
            return {}
        for aggregate in by_type:
            await self.create_collection(aggregate)
        ctx = self.context

        def read(conn: sqlite3.Connection) -> list[Sequence[Any]]:
            per = max(1, (variable_limit(conn) - 1) // 2)
            rows: list[Sequence[Any]] = []
            for aggregate, group in by_type.items():
                for i in range(0, len(group), per):
                    chunk = group[i : i + per]
                    params = [v for r in chunk for v in (r.tenant_id, r.id)]
                    rows += conn.execute(load_many_sql(ctx, len(chunk)), (*params, aggregate)).fetchall()
            return rows

        found = (snapshot_from_row(ctx, row) for row in await self._run("load_many", read))
        return {s.ref: s for s in found}

    def _save_one(self, conn: sqlite3.Connection, s: SnapshotRecord, params: tuple[Any, ...]) -> bool:
        """The conditional upsert; when refused, the stale mark of a higher state revision."""
        if conn.execute(self._save_sql, params).rowcount == 1:
            return True
        r = s.ref
        conn.execute(self._mark_refused_sql, (s.version, r.aggregate, r.tenant_id, r.id, s.state_revision, s.version))
        return False

    async def save(self, snapshot: SnapshotRecord) -> bool:
        self._check(snapshot.ref)
        try:
            params = snapshot_params(snapshot)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"the state of {snapshot.ref} cannot be stored: {exc}", field="state") from exc
        await self.create_collection(snapshot.ref.aggregate)
        return await self._run("save", self._db.transaction(lambda conn: self._save_one(conn, snapshot, params)))

    async def save_all(self, snapshots: Sequence[SnapshotRecord]) -> list[SnapshotSaveOutcome]:
        outcomes: dict[int, SnapshotSaveOutcome] = {}
        # the k-th snapshot of a ref is in round k: each ref's indices in order
        indices: dict[AggregateRef, deque[int]] = {}
        for i, s in enumerate(snapshots):
            self._check(s.ref)
            indices.setdefault(s.ref, deque()).append(i)
        for aggregate in sorted({s.ref.aggregate for s in snapshots}):
            await self.create_collection(aggregate)
        for round_ in SnapshotSaveOutcome.rounds(snapshots):
            by_type: dict[str, list[tuple[int, SnapshotRecord, tuple[Any, ...]]]] = {}
            for s in round_:
                i = indices[s.ref].popleft()
                try:
                    params = snapshot_params(s)
                except (TypeError, ValueError) as exc:
                    outcomes[i] = SnapshotSaveOutcome(
                        ref=s.ref, version=s.version, status="failed", reason=f"state cannot be stored: {exc}"
                    )
                    continue
                by_type.setdefault(s.ref.aggregate, []).append((i, s, params))
            for items in by_type.values():
                # holding the file's write lock: queued behind this process's other writers
                write = self._db.transaction(self._save_round(items))
                outcomes.update(await self._run("save_all", write))
        return [outcomes[i] for i in range(len(snapshots))]

    def _save_round(
        self, items: list[tuple[int, SnapshotRecord, tuple[Any, ...]]]
    ) -> Callable[[sqlite3.Connection], dict[int, SnapshotSaveOutcome]]:
        def work(conn: sqlite3.Connection) -> dict[int, SnapshotSaveOutcome]:
            out: dict[int, SnapshotSaveOutcome] = {}
            for i, s, params in items:
                try:
                    saved = self._save_one(conn, s, params)
                except (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.DataError, OverflowError) as exc:
                    out[i] = SnapshotSaveOutcome(ref=s.ref, version=s.version, status="failed", reason=str(exc))
                    continue
                out[i] = SnapshotSaveOutcome(ref=s.ref, version=s.version, status="saved" if saved else "unchanged")
            return out

        return work

    async def mark_stale(self, ref: AggregateRef) -> bool:
        self._check(ref)
        await self.create_collection(ref.aggregate)
        sql, key = mark_stale_sql(self.context), (ref.aggregate, ref.tenant_id, ref.id)
        return await self._run("mark_stale", lambda conn: conn.execute(sql, key).rowcount == 1)
