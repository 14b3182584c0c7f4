"""The rebuild control plane of the snapshots on MongoDB (:class:`~wowd.stores.base.SnapshotRebuildStore`):
the claimed state revision of each type (its record in ``wow_snapshot_tables``) and the snapshots
rewritten in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo import ReturnDocument, UpdateOne
from pymongo.errors import OperationFailure

from wowd.errors import InvalidInput, StorageError
from wowd.model import (
    AggregateRef,
    AggregateType,
    SnapshotRecord,
    SnapshotTable,
)
from wowd.stores.mongo._common import (
    is_duplicate_key,
    write_one,
)
from wowd.stores.mongo.schema import (
    FORMAT,
    literal,
    now_ms_expr,
)
from wowd.stores.mongo.snapshots import SnapshotCollections, encodable, snapshot_filter, snapshot_key, snapshot_pipeline


def rewrite_filter(snapshot: SnapshotRecord) -> dict[str, Any]:
    """The guard of a rewrite in place: a lower stored state revision at a version not above the
    new one, or the same state revision at a lower version."""
    return {
        **snapshot_filter(snapshot.ref),
        "$or": [
            {"state_revision": {"$lt": snapshot.state_revision}, "version": {"$lte": snapshot.version}},
            {"state_revision": snapshot.state_revision, "version": {"$lt": snapshot.version}},
        ],
    }


def pending_filter(revision: int, after: AggregateRef | None) -> dict[str, Any]:
    """Snapshots below ``revision``, after the key of ``after`` (documents compare field by
    field, ``t`` then ``a``: the key order)."""
    query: dict[str, Any] = {"state_revision": {"$lt": revision}}
    if after is not None:
        query["_id"] = {"$gt": snapshot_key(after)}
    return query


def pending_sort() -> dict[str, int]:
    return {"_id": 1}


def claim_update(type: AggregateType, revision: int, lower: bool) -> list[dict[str, Any]]:
    """Records ``revision`` when higher than the stored one (or different, with ``lower``);
    a new claim starts neither rebuilding nor backfilled. Same revision: unchanged."""
    stored = {"$ifNull": ["$revision", None]}
    takes: dict[str, Any] = (
        {"$ne": [stored, revision]} if lower else {"$or": [{"$eq": [stored, None]}, {"$lt": [stored, revision]}]}
    )
    return [
        {"$set": {"_claim": takes}},
        {
            "$set": {
                "context": literal(type.context),
                "aggregate": literal(type.aggregate),
                "format": {"$ifNull": ["$format", FORMAT]},
                "created_at": {"$ifNull": ["$created_at", now_ms_expr()]},
                "revision": {"$cond": ["$_claim", revision, "$revision"]},
                "rebuilding": {"$cond": ["$_claim", False, {"$ifNull": ["$rebuilding", False]}]},
                "backfilled": {"$cond": ["$_claim", False, {"$ifNull": ["$backfilled", False]}]},
                "updated_at": {"$cond": ["$_claim", now_ms_expr(), {"$ifNull": ["$updated_at", now_ms_expr()]}]},
            }
        },
        {"$unset": "_claim"},
    ]


def mark_filter(name: str, revision: int) -> dict[str, Any]:
    return {"_id": name, "revision": revision}


def mark_update(rebuilding: bool | None, backfilled: bool | None) -> list[dict[str, Any]]:
    fields: dict[str, Any] = {"updated_at": now_ms_expr()}
    if rebuilding is not None:
        fields["rebuilding"] = rebuilding
    if backfilled is not None:
        fields["backfilled"] = backfilled
    return [{"$set": fields}]


def _table_from_doc(type: AggregateType, doc: Mapping[str, Any] | None) -> SnapshotTable | None:
    if doc is None or doc.get("revision") is None:
        return None
    return SnapshotTable(
        type=type,
        revision=int(doc["revision"]),
        rebuilding=bool(doc.get("rebuilding", False)),
        backfilled=bool(doc.get("backfilled", False)),
        updated_at=int(doc.get("updated_at", 0)),
    )


class MongoSnapshotRebuilds(SnapshotCollections):
    """:class:`~wowd.stores.base.SnapshotRebuildStore` of one context on MongoDB (the constructor
    of :class:`~wowd.stores.mongo.snapshots.SnapshotCollections`): a rebuilt snapshot is rewritten
    in the snapshot collection itself."""

    _label = "snapshots"

    async def claim(self, type: AggregateType, revision: int, lower: bool = False) -> SnapshotTable:
        self._check_type(type)
        await self._ensure(type.aggregate)
        name = self.collection_name(type.aggregate)
        with self._call("claim"):
            doc = await self._tables.find_one_and_update(
                {"_id": name},
                claim_update(type, revision, lower),
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        table = _table_from_doc(type, doc)
        if table is None:  # pragma: no cover - the upsert always answers the document
            raise StorageError(f"mongodb snapshots claim: no table document for {name}")
        return table

    async def mark(
        self,
        type: AggregateType,
        revision: int,
        rebuilding: bool | None = None,
        backfilled: bool | None = None,
    ) -> SnapshotTable | None:
        self._check_type(type)
        name = self.collection_name(type.aggregate)
        with self._call("mark"):
            doc = await self._tables.find_one_and_update(
                mark_filter(name, revision),
                mark_update(rebuilding, backfilled),
                return_document=ReturnDocument.AFTER,
            )
        return _table_from_doc(type, doc)

    async def table(self, type: AggregateType) -> SnapshotTable | None:
        self._check_type(type)
        with self._call("table"):
            doc = await self._tables.find_one({"_id": self.collection_name(type.aggregate)})
        return _table_from_doc(type, doc)

    async def pending(
        self, type: AggregateType, revision: int, after: AggregateRef | None, limit: int
    ) -> list[AggregateRef]:
        self._check_type(type)
        if limit <= 0:
            return []
        await self._ensure(type.aggregate)
        with self._call("pending"):
            cursor = self._collection(type.aggregate).find(
                pending_filter(revision, after),
                projection={"_id": 1},
                sort=pending_sort(),
                limit=limit,
            )
            docs = await cursor.to_list()
        return [
            AggregateRef(context=type.context, aggregate=type.aggregate, tenant_id=d["_id"]["t"], id=d["_id"]["a"])
            for d in docs
        ]

    async def rewrite(self, snapshot: SnapshotRecord) -> bool:
        """Writes a rebuilt snapshot in place under :func:`rewrite_filter` (one conditional
        upsert, like the embedded store: a missing snapshot is written; E11000 means the guard
        refused it); clears the stale mark."""
        self._check_ref(snapshot.ref)
        q, u = rewrite_filter(snapshot), snapshot_pipeline(snapshot, rewrite=True)
        reason = encodable({"q": q, "u": u})
        if reason is not None:
            raise InvalidInput(f"snapshot of {snapshot.ref} at version {snapshot.version}: {reason}", field="state")
        await self._ensure(snapshot.ref.aggregate)
        with self._call("rewrite"):
            try:
                await write_one(
                    self._collection(snapshot.ref.aggregate), UpdateOne(q, u, upsert=True), "snapshots.rewrite"
                )
            except OperationFailure as exc:
                if is_duplicate_key(exc):
                    return False
                raise
        return True
