"""The snapshots of one bounded context on MongoDB (docs/stores.md).

Layout:

- one collection per aggregate type, ``wow_snapshot__<context>__<aggregate>``, one document per
  aggregate: ``{_id: {t: tenant_id, a: aggregate_id}, tenant_id, aggregate_id, version,
  state_revision, state {}, owner_id, space_id, access {owner_id, space_id, tags},
  access_version, deleted, event_time, stale_version?}``. ``_id`` is the only unique index; its
  order is the tenant's, then the aggregate id's. ``tenant_id`` and ``aggregate_id`` are in every
  document and every write's filter (the shard key of a sharded collection).
- two partial indexes ``{tenant_id, owner_id}`` and ``{tenant_id, space_id}`` over
  ``{deleted: false}``: the predicates the query side adds to every query.
- ``wow_snapshot_tables``: one document per snapshot collection, keyed by the collection name,
  ``{_id, context, aggregate, format, created_at, revision?, rebuilding, backfilled,
  updated_at}``: the format record (written on first touch) and the rebuild control plane's
  claimed state revision (``revision``, absent until the first ``claim``).

The state and the access attributes are BSON documents (queryable in place); a
:class:`decimal.Decimal` is stored as ``Decimal128`` exactly and read back as the same
``Decimal`` (:data:`CODEC_OPTIONS`). A value BSON cannot hold is refused before anything is sent.

Every document this module sends is built by a pure function next to the method sending it,
so the black-pipe tests (``tests/mongo/test_snapshots_wire.py``) assert them.
"""

from __future__ import annotations

import decimal
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import anyio
import bson
from bson.codec_options import CodecOptions, TypeCodec, TypeRegistry
from bson.decimal128 import Decimal128
from bson.errors import BSONError
from pymongo import AsyncMongoClient, ReturnDocument, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, OperationFailure

from wowd.errors import FormatError, InvalidInput, StorageError, StorageUnavailable
from wowd.model import (
    AggregateRef,
    AggregateType,
    SnapshotRecord,
    SnapshotSaveOutcome,
)
from wowd.stores.formats import too_new
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    DUPLICATE_KEY,
    NAMESPACE_EXISTS,
    SNAPSHOT_TABLES,
    TRANSIENT_CODES,
    Ddl,
    MongoSharding,
    MongoStore,
    collection_name,
    durable_or_raise,
    is_duplicate_key,
    mongo_name,
    split_to_fit,
    write_one,
)
from wowd.stores.mongo.schema import (
    FORMAT,
    literal,
    snapshot_index_specs,
    snapshot_shard_key,
    table_format_update,
)

__all__ = [
    "CODEC_OPTIONS",
    "DEFAULT_OPERATION_TIMEOUT",
    "MAX_DOCUMENT_BYTES",
    "TABLES",
    "DecimalCodec",
    "MongoSnapshotStore",
    "SnapshotCollections",
    "encodable",
    "conditional_upsert_filter",
    "load_many_filter",
    "mark_stale_update",
    "record_from_doc",
    "snapshot_filter",
    "snapshot_pipeline",
    "stale_filter",
    "stale_update",
]

log = logging.getLogger(__name__)

TABLES = SNAPSHOT_TABLES
"""The control-plane collection: format record and claimed state revision per snapshot collection."""

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
"""BSON's document limit: a snapshot whose write is larger is refused before it is sent."""

_MAX_RETRIES = 5
"""How often a conditional upsert that met the key of a lower version (a concurrent insert won)
is tried again before the store gives up (raises)."""


# --------------------------------------------------------------------------- exact decimals


class DecimalCodec(TypeCodec):
    """``decimal.Decimal`` <-> ``Decimal128``, exact: a decimal that needs more than 34 digits
    or an exponent out of Decimal128's range is refused (``decimal.Inexact``), never rounded.

    ``Decimal128(value)`` alone is exact in *value* only: its context (34 digits, clamp=1)
    silently drops trailing zeros past 34 digits (``1234…340E+10``), clamps the exponent of a
    zero (``0E-6200`` -> ``0E-6176``) and pads a large exponent (``1E+6144`` ->
    ``1.000…000E+6144``), each read back with other digits or another scale. Those are refused
    too (``decimal.Rounded``): what is stored reads back with the same sign, digits and exponent.
    """

    python_type = decimal.Decimal
    bson_type = Decimal128

    def transform_python(self, value: Any) -> Any:
        encoded = Decimal128(value)
        if encoded.to_decimal().as_tuple() != value.as_tuple():
            raise decimal.Rounded(
                f"Decimal {value} has no Decimal128 of the same digits and exponent "
                f"(it would read back as {encoded.to_decimal()})"
            )
        return encoded

    def transform_bson(self, value: Any) -> Any:
        return value.to_decimal()


CODEC_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    document_class=dict, tz_aware=True, type_registry=TypeRegistry([DecimalCodec()])
)
"""The codec options of every snapshot collection (Decimal <-> Decimal128)."""

_UNENCODABLE = (BSONError, OverflowError, ArithmeticError, TypeError, ValueError)
"""What encoding a value BSON cannot hold raises (``decimal.Inexact`` is an ArithmeticError)."""


# --------------------------------------------------------------------------- query builders


def snapshot_key(ref: AggregateRef) -> dict[str, Any]:
    return {"t": ref.tenant_id, "a": ref.id}


def snapshot_filter(ref: AggregateRef) -> dict[str, Any]:
    """The document of ``ref``: its key and the shard key fields."""
    return {"_id": snapshot_key(ref), "tenant_id": ref.tenant_id, "aggregate_id": ref.id}


def load_many_filter(refs: Sequence[AggregateRef]) -> dict[str, Any]:
    """The documents of ``refs`` (of one type): ``$in`` on ``_id`` (the key's index gives one
    point per ref), with the shard key fields' ``$in`` beside it, so that on a sharded collection
    ``mongos`` asks only the shards owning those keys (as :func:`snapshot_filter` for one)."""
    return {
        "_id": {"$in": [snapshot_key(r) for r in refs]},
        "tenant_id": {"$in": sorted({r.tenant_id for r in refs})},
        "aggregate_id": {"$in": sorted({r.id for r in refs})},
    }


def conditional_upsert_filter(snapshot: SnapshotRecord) -> dict[str, Any]:
    """The guard of a save: the stored version below the new one and the stored state revision
    not above it. On no match the upsert inserts, which meets the key when a document exists."""
    return {
        **snapshot_filter(snapshot.ref),
        "version": {"$lt": snapshot.version},
        "state_revision": {"$lte": snapshot.state_revision},
    }


def snapshot_pipeline(snapshot: SnapshotRecord, *, rewrite: bool = False) -> list[dict[str, Any]]:
    """The update pipeline of a save: the whole document replaced by the snapshot, and a stored
    stale mark of a version up to the snapshot's own cleared in the same write (a later mark, the
    stored one or the record's own, is kept: the snapshot is still behind the log). A rewrite
    (``rewrite=True``) clears the stale mark."""
    ref = snapshot.ref
    access = {"owner_id": snapshot.owner_id, "space_id": snapshot.space_id, "tags": list(snapshot.tags)}
    v = snapshot.version
    mark: Any = "$stale_version"
    if snapshot.stale_version is not None and snapshot.stale_version > v:
        mark = {"$max": ["$stale_version", snapshot.stale_version]}
    stale: Any = "$$REMOVE" if rewrite else {"$cond": [{"$gt": [mark, v]}, mark, "$$REMOVE"]}
    return [
        {
            "$replaceWith": {
                "_id": literal(snapshot_key(ref)),
                "tenant_id": literal(ref.tenant_id),
                "aggregate_id": literal(ref.id),
                "version": literal(v),
                "state_revision": literal(snapshot.state_revision),
                "state": literal(dict(snapshot.state)),
                "owner_id": literal(snapshot.owner_id),
                "space_id": literal(snapshot.space_id),
                "access": literal(access),
                "access_version": literal(snapshot.access_version),
                "deleted": literal(snapshot.deleted),
                "event_time": literal(snapshot.event_time),
                "stale_version": stale,
            }
        }
    ]


def stale_filter(snapshot: SnapshotRecord) -> dict[str, Any]:
    """After a save refused: the stored snapshot of a higher state revision that is behind the
    refused one's version (so the log is ahead of it)."""
    return {
        **snapshot_filter(snapshot.ref),
        "state_revision": {"$gt": snapshot.state_revision},
        "version": {"$lt": snapshot.version},
    }


def stale_update(snapshot: SnapshotRecord) -> dict[str, Any]:
    """Marks it stale as of the refused snapshot's version, unless already marked later."""
    return {"$max": {"stale_version": snapshot.version}}


def mark_stale_update() -> list[dict[str, Any]]:
    """``stale_version`` = its version + 1, unless already later."""
    return [{"$set": {"stale_version": {"$max": [{"$ifNull": ["$stale_version", 0]}, {"$add": ["$version", 1]}]}}}]


# --------------------------------------------------------------------------- readers


def record_from_doc(type: AggregateType, doc: Mapping[str, Any]) -> SnapshotRecord:
    """Reads a snapshot document; a malformed one raises :class:`StorageError` naming the field."""
    try:
        access = doc.get("access") or {}
        stale = doc.get("stale_version")
        return SnapshotRecord(
            ref=AggregateRef(
                context=type.context,
                aggregate=type.aggregate,
                tenant_id=doc["tenant_id"],
                id=doc["aggregate_id"],
            ),
            version=int(doc["version"]),
            state_revision=int(doc["state_revision"]),
            state=dict(doc.get("state") or {}),
            owner_id=str(doc.get("owner_id", access.get("owner_id", ""))),
            space_id=str(doc.get("space_id", access.get("space_id", ""))),
            tags=tuple(str(t) for t in access.get("tags") or ()),
            access_version=int(doc.get("access_version", 0)),
            deleted=bool(doc.get("deleted", False)),
            event_time=int(doc.get("event_time", 0)),
            stale_version=None if stale is None else int(stale),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StorageError(f"mongodb snapshot {doc.get('_id')!r} of {type}: malformed ({exc!r})") from exc


def encodable(statement: Mapping[str, Any]) -> str | None:
    """Why ``statement`` cannot be sent as BSON, or None when it can."""
    try:
        size = len(bson.encode(statement, codec_options=CODEC_OPTIONS))
    except _UNENCODABLE as exc:
        return f"not BSON: {type(exc).__name__}: {exc}"
    if size > MAX_DOCUMENT_BYTES:
        return f"not BSON: the write is {size} bytes, over the document limit of {MAX_DOCUMENT_BYTES}"
    return None


@dataclass(frozen=True, slots=True)
class _Item:
    index: int
    snapshot: SnapshotRecord


# --------------------------------------------------------------------------- the store


class SnapshotCollections(MongoStore):
    """The snapshot collections of one context on MongoDB (the base of the snapshots and of their
    rebuild control plane): each type's collection with its format record and indexes.

    The :class:`~wowd.stores.mongo._common.MongoStore` constructor (client or URI, database,
    ``operation_timeout``); ``shared_with``: another store of the same collections whose made-sure
    collections this one shares. Nothing happens in the constructor; a type's collection is created
    (with its format record and indexes, as ``ddl`` says) the first time the store touches the
    type, or by :meth:`create_collection`. A failure of the database is raised: network and
    election errors as :class:`~wowd.errors.StorageUnavailable`, others as
    :class:`~wowd.errors.StorageError` (a snapshot is a cache; the caller may drop it).
    """

    _label = "snapshots"  # the same as the embedded store's: one dashboard for both backends

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        context: str,
        ddl: Ddl = Ddl.AUTO,
        sharding: MongoSharding = MongoSharding.AUTO,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
        shared_with: SnapshotCollections | None = None,
    ) -> None:
        self.context = mongo_name(context, field="context")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout, codec_options=CODEC_OPTIONS)
        self._ddl = Ddl(ddl)
        self._sharding = MongoSharding(sharding)
        self._ready: set[str] = set() if shared_with is None else shared_with._ready
        """Collections made sure of (shared with ``shared_with``: the snapshots and their rebuild
        control plane of a backend make sure of a type's collection once)."""
        self._ddl_lock: anyio.Lock | None = None

    # ------------------------------------------------------------------ plumbing

    def collection_name(self, aggregate: str) -> str:
        """``wow_snapshot__<context>__<aggregate>``."""
        return collection_name("snapshot", self.context, aggregate)

    def _collection(self, aggregate: str) -> AsyncCollection[dict[str, Any]]:
        return self._db.get_collection(self.collection_name(aggregate))

    @property
    def _tables(self) -> AsyncCollection[dict[str, Any]]:
        return self._db.get_collection(TABLES)

    def _type(self, aggregate: str) -> AggregateType:
        return AggregateType(context=self.context, aggregate=aggregate)

    def _check_ref(self, ref: AggregateRef) -> None:
        if ref.context != self.context:
            raise InvalidInput(f"{ref} is not of context {self.context!r}", field="ref.context")

    async def _ensure(self, aggregate: str) -> None:
        if self._ddl is Ddl.NONE or self.collection_name(aggregate) in self._ready:
            return
        await self.create_collection(aggregate)

    # ------------------------------------------------------------------ DDL

    async def prepare(self) -> None:
        """Nothing to create up front: a type's collection is created on its first use, since
        the store does not know the context's aggregate types (kept for the host)."""

    async def create_collection(self, aggregate: str) -> None:
        """Creates the type's collection, format record and indexes when missing, once per store
        (``ddl=auto``), or checks them (``ddl=validate``). A collection recorded in another
        format is refused with :class:`~wowd.errors.FormatError`."""
        name = self.collection_name(aggregate)
        if name in self._ready:
            return
        if self._ddl_lock is None:
            self._ddl_lock = anyio.Lock()
        async with self._ddl_lock:  # concurrent first touches of a type: one creates, the others wait
            if name not in self._ready:
                await self._create_collection(name, self._type(aggregate))

    async def _create_collection(self, name: str, type: AggregateType) -> None:
        with self._call("create_collection"):
            if self._ddl is Ddl.AUTO:
                record = await self._tables.find_one_and_update(
                    {"_id": name},
                    table_format_update(type),
                    upsert=True,
                    return_document=ReturnDocument.AFTER,
                )
            else:
                record = await self._tables.find_one({"_id": name})
            if record is None or record.get("format") is None:
                if self._ddl is Ddl.VALIDATE:
                    raise FormatError(f"mongodb {name}: no format record in {TABLES} (ddl=validate)")
            elif isinstance(record.get("format"), int) and record["format"] > FORMAT:
                raise too_new(f"mongodb {name}", record["format"], FORMAT)
            elif record.get("format") != FORMAT:
                raise FormatError(
                    f"mongodb {name}: recorded in format {record.get('format')!r}, this wowd writes format "
                    f"{FORMAT}; drop the collection and its {TABLES} record to rebuild the snapshots"
                )
            if self._ddl is Ddl.AUTO:
                await self._create(name)
            elif self._ddl is Ddl.VALIDATE:
                await self._validate(name)
        self._ready.add(name)
        log.info("snapshot collection %s ready (format %s, ddl %s)", name, FORMAT, self._ddl.value)

    async def _create(self, name: str) -> None:
        try:
            await self._db.command("create", name)
        except OperationFailure as exc:
            # 7.0+ answers ok on an existing collection of the same options; 48 means other options
            if exc.code != NAMESPACE_EXISTS:
                raise
        sharded = await self._is_sharded(self._sharding)
        await self._create_indexes(name, snapshot_index_specs(sharded=sharded), log)
        if sharded:
            # the shard key's index exists first, so a collection that already holds snapshots
            # (created unsharded) can be sharded too; shardCollection is idempotent on 7.0
            await self._shard_collection(
                name, snapshot_shard_key(), self._sharding, log, what="snapshot", bounded=False
            )

    async def _validate(self, name: str) -> None:
        # a missing collection lists no indexes (PyMongo answers NamespaceNotFound as empty)
        found = {ix["name"]: ix async for ix in await self._db.get_collection(name).list_indexes()}
        for spec in snapshot_index_specs():
            ix = found.get(spec["name"])
            if (
                ix is None
                or dict(ix["key"]) != spec["key"]
                or dict(ix.get("partialFilterExpression") or {}) != spec["partialFilterExpression"]
            ):
                raise FormatError(f"mongodb {name}: index {spec['name']} is missing or differs (ddl=validate)")

    def _check_type(self, type: AggregateType) -> None:
        if type.context != self.context:
            raise InvalidInput(f"{type} is not of context {self.context!r}", field="type.context")


class MongoSnapshotStore(SnapshotCollections):
    """:class:`~wowd.stores.base.SnapshotStore` of one context on MongoDB (the constructor of
    :class:`SnapshotCollections`)."""

    async def load(self, ref: AggregateRef) -> SnapshotRecord | None:
        self._check_ref(ref)
        await self._ensure(ref.aggregate)
        with self._call("load"):
            doc = await self._collection(ref.aggregate).find_one(snapshot_filter(ref))
        return None if doc is None else record_from_doc(ref.type, doc)

    async def load_many(self, refs: Sequence[AggregateRef]) -> dict[AggregateRef, SnapshotRecord]:
        """One ``find`` per type (:func:`load_many_filter`), split only where its filter would
        not fit in one command, with ``limit`` and ``batchSize`` the number of refs: the server
        closes the cursor in its first answer unless the documents exceed its 16 MiB batch, and
        then the rest is read with ``getMore``."""
        by_type: dict[str, list[AggregateRef]] = {}
        for r in dict.fromkeys(refs):
            self._check_ref(r)
            by_type.setdefault(r.aggregate, []).append(r)
        for aggregate in by_type:
            await self._ensure(aggregate)
        out: dict[AggregateRef, SnapshotRecord] = {}
        with self._call("load_many"):
            for aggregate, group in by_type.items():
                coll, type_ = self._collection(aggregate), self._type(aggregate)
                for part in split_to_fit(group, load_many_filter):
                    cursor = coll.find(load_many_filter(part), limit=len(part), batch_size=len(part))
                    for doc in await cursor.to_list():
                        record = record_from_doc(type_, doc)
                        out[record.ref] = record
        return out

    async def save(self, snapshot: SnapshotRecord) -> bool:
        """One conditional upsert (see :meth:`_conditional_upsert`). A state BSON cannot hold
        raises :class:`~wowd.errors.InvalidInput` naming the snapshot."""
        self._check_ref(snapshot.ref)
        reason = encodable({"q": conditional_upsert_filter(snapshot), "u": snapshot_pipeline(snapshot)})
        if reason is not None:
            raise InvalidInput(f"snapshot of {snapshot.ref} at version {snapshot.version}: {reason}", field="state")
        await self._ensure(snapshot.ref.aggregate)
        with self._call("save"):
            return await self._conditional_upsert(snapshot)

    async def _conditional_upsert(self, snapshot: SnapshotRecord) -> bool:
        """The guarded upsert. When it meets the key (E11000: the guard refused it, or a
        concurrent insert won the key) the stored document decides: a higher state revision is
        marked stale (the log is at this version) and the save is refused; the same or a higher
        version is kept (refused); a lower version (a concurrent insert won) is tried again."""
        coll = self._collection(snapshot.ref.aggregate)
        for _ in range(_MAX_RETRIES):
            try:
                # E11000 with a write concern error: StorageUnavailable, never decided as refused
                op = UpdateOne(conditional_upsert_filter(snapshot), snapshot_pipeline(snapshot), upsert=True)
                await write_one(coll, op, "snapshots.save")
                return True
            except OperationFailure as exc:
                if not is_duplicate_key(exc):
                    raise
            if await self._refused(coll, snapshot):
                return False
        raise StorageError(
            f"mongodb snapshots save: {snapshot.ref} at version {snapshot.version} met the key "
            f"{_MAX_RETRIES} times with a lower version stored"
        )

    async def _refused(self, coll: AsyncCollection[dict[str, Any]], snapshot: SnapshotRecord) -> bool:
        """After E11000: True when the stored snapshot refuses this one (marking it stale when it
        has a higher state revision and a lower version); False when the upsert may be retried."""
        stale = await coll.update_one(stale_filter(snapshot), stale_update(snapshot))
        if stale.matched_count:
            log.info(
                "snapshot %s: save at version %s, state revision %s refused by a higher state revision; marked stale",
                snapshot.ref,
                snapshot.version,
                snapshot.state_revision,
            )
            return True
        stored = await coll.find_one(
            snapshot_filter(snapshot.ref), projection={"_id": 0, "version": 1, "state_revision": 1}
        )
        if stored is None:
            return False  # gone meanwhile: insert again
        return not (
            stored.get("version", 0) < snapshot.version and stored.get("state_revision", 0) <= snapshot.state_revision
        )

    async def save_all(self, snapshots: Sequence[SnapshotRecord]) -> list[SnapshotSaveOutcome]:
        """Saves in :meth:`SnapshotSaveOutcome.rounds`: each round's snapshots of one type in one
        unordered bulk write of conditional upserts. An item that met the key is saved again
        alone as :meth:`save` would; one refused with another error, or whose state cannot be
        BSON, is ``failed`` alone."""
        outcomes: dict[int, SnapshotSaveOutcome] = {}
        # the k-th snapshot of a ref is in round k: each ref's positions in the batch, in order
        positions: dict[AggregateRef, deque[int]] = {}
        for i, s in enumerate(snapshots):
            positions.setdefault(s.ref, deque()).append(i)
        for round_ in SnapshotSaveOutcome.rounds(snapshots):
            by_type: dict[str, list[_Item]] = {}
            for s in round_:
                i = positions[s.ref].popleft()
                if s.ref.context != self.context:
                    outcomes[i] = _failed(s, f"not of context {self.context!r}")
                    continue
                by_type.setdefault(s.ref.aggregate, []).append(_Item(i, s))
            for aggregate, items in by_type.items():
                outcomes.update(await self._save_round(aggregate, items))
        return [outcomes[i] for i in range(len(snapshots))]

    async def _save_round(self, aggregate: str, items: list[_Item]) -> list[tuple[int, SnapshotSaveOutcome]]:
        done: list[tuple[int, SnapshotSaveOutcome]] = []
        sendable: list[_Item] = []
        requests: list[UpdateOne] = []
        for item in items:
            q, u = conditional_upsert_filter(item.snapshot), snapshot_pipeline(item.snapshot)
            reason = encodable({"q": q, "u": u})
            if reason is not None:
                log.warning(
                    "snapshot %s at version %s not saved: %s",
                    item.snapshot.ref,
                    item.snapshot.version,
                    reason,
                )
                done.append((item.index, _failed(item.snapshot, reason)))
                continue
            sendable.append(item)
            requests.append(UpdateOne(q, u, upsert=True))
        if not sendable:
            return done
        await self._ensure(aggregate)
        coll = self._collection(aggregate)
        errors: dict[int, Mapping[str, Any]] = {}
        with self._call("save_all"):
            try:
                await coll.bulk_write(requests, ordered=False)
            except BulkWriteError as exc:
                durable_or_raise(exc, "snapshots save_all")  # idempotent: retried whole
                errors = {int(e["index"]): e for e in exc.details.get("writeErrors") or ()}
                transient = next((e for e in errors.values() if e.get("code") in TRANSIENT_CODES), None)
                if transient is not None:
                    # an election or a timeout met the bulk part way (NotWritablePrimary and
                    # MaxTimeMSExpired come back per item in writeErrors, and PyMongo does not
                    # retry those): the batch is retried whole, not its items dropped as failed
                    raise StorageUnavailable(
                        f"mongodb snapshots save_all: {len(errors)} of {len(requests)} writes refused, "
                        f"e.g. error {transient.get('code')}: {transient.get('errmsg', '')}"
                    ) from exc
            for k, item in enumerate(sendable):
                err = errors.get(k)
                if err is None:
                    done.append((item.index, _outcome(item.snapshot, "saved")))
                elif err.get("code") == DUPLICATE_KEY:
                    saved = await self._conditional_upsert(item.snapshot)
                    done.append((item.index, _outcome(item.snapshot, "saved" if saved else "unchanged")))
                else:
                    reason = f"mongodb error {err.get('code')}: {err.get('errmsg', '')}"
                    log.warning(
                        "snapshot %s at version %s not saved: %s",
                        item.snapshot.ref,
                        item.snapshot.version,
                        reason,
                    )
                    done.append((item.index, _failed(item.snapshot, reason)))
        return done

    async def mark_stale(self, ref: AggregateRef) -> bool:
        self._check_ref(ref)
        await self._ensure(ref.aggregate)
        with self._call("mark_stale"):
            result = await self._collection(ref.aggregate).update_one(snapshot_filter(ref), mark_stale_update())
        return result.matched_count > 0


def _outcome(snapshot: SnapshotRecord, status: Literal["saved", "unchanged"]) -> SnapshotSaveOutcome:
    return SnapshotSaveOutcome(ref=snapshot.ref, version=snapshot.version, status=status)


def _failed(snapshot: SnapshotRecord, reason: str) -> SnapshotSaveOutcome:
    return SnapshotSaveOutcome(ref=snapshot.ref, version=snapshot.version, status="failed", reason=reason)
