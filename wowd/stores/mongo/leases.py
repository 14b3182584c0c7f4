"""CosId-style slot leases on MongoDB (docs/concepts.md), decided on the store clock.

Collections:

- ``cosid_slot``: one document per slot, ``{ns, slot, ownerKey, incarnation, lastOwnerKey, fence,
  expiresAt, floor, ceiling, nextFloor, writtenAt, holdBy?, holdUntil?}``, unique on ``(ns,
  slot)``; every slot of a namespace is created on its first use. Times are BSON dates of the
  store clock (``$$NOW``). A *hold* (``holdBy`` until ``holdUntil``, set by :meth:`~MongoSlotLeaseStore.hold`
  for a timer view rebuild) keeps a slot from being taken; its holder learns of it at its next
  renewal (the answer's ``held_by``), drains the slot's work and releases it.
- ``cosid_namespace``: ``{_id: ns, limit, toleranceMs, slotOffset}``. A document written by an
  older version has no ``slotOffset``: it reads as 0 and is never rewritten.
- ``cosid_replica``: the presence record of each replica, holder or standby, ``{_id: {ns,
  ownerKey}, ns, ownerKey, instance, host, pid, version, state, slots, startedAt, seenAt,
  expiresAt}``; a heartbeat is one upsert by ``_id`` whose pipeline stamps ``seenAt = $$NOW`` and
  derives ``expiresAt`` from it. The TTL index on ``expiresAt`` (``expireAfterSeconds`` =
  :data:`~wowd.stores.base.PRESENCE_RETENTION`) deletes a record that long after it expired.

An acquire reads the namespace, then runs one aggregation over the namespace's slots that
answers the idempotent case (the owner key holds a live slot: decided by ``$$NOW`` on the
server, which the answer carries as the lease's ``store_now``), names the sticky candidates
and lists the slot documents that exist (so only the missing ones are inserted). Each step
that takes a slot is then one ``findAndModify`` on one document whose filter holds the whole
condition and whose pipeline update stamps ``writtenAt = $$NOW`` first and derives the rest
from it. No client clock is ever compared.

Every filter, pipeline and index spec is built by a pure function of this module; the
black-pipe tests (``tests/mongo/test_leases_wire.py``) assert them on the wire.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
from bson.codec_options import CodecOptions, DatetimeConversion
from bson.datetime_ms import DatetimeMS
from bson.int64 import Int64
from pymongo import AsyncMongoClient, InsertOne, ReadPreference, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, OperationFailure
from pymongo.write_concern import WriteConcern

from wowd.errors import ConfigError, FormatError, StorageError
from wowd.model import AcquireResult, Owner, SlotLease, SlotState
from wowd.stores.base import PRESENCE_RETENTION, SLOT_HOLD, Ddl, ReplicaInfo, ReplicaState
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    NAMESPACE_COLLECTION,
    REPLICA_COLLECTION,
    SLOT_COLLECTION,
    MongoStore,
    duplicate_keys,
    is_duplicate_key,
    write_one,
)
from wowd.stores.mongo.schema import REPLICA_TTL_INDEX, SLOT_INDEX_NAME, replica_indexes, slot_indexes, whole_seconds

__all__ = [
    "NAMESPACE_COLLECTION",
    "REPLICA_COLLECTION",
    "REPLICA_TTL_INDEX",
    "SLOT_COLLECTION",
    "SLOT_INDEX_NAME",
    "TAKE_SORT",
    "LEASE_PROJECTION",
    "MongoSlotLeaseStore",
    "free_expr",
    "free_filter",
    "held_expr",
    "hold_filter",
    "hold_update",
    "lift_filter",
    "lift_update",
    "heartbeat_update",
    "namespace_doc",
    "namespace_filter",
    "namespace_mismatch",
    "new_slot_docs",
    "owner_pipeline",
    "preferred_filter",
    "release_filter",
    "release_update",
    "renew_filter",
    "renew_update",
    "replica_filter",
    "replica_indexes",
    "replicas_pipeline",
    "slot_indexes",
    "slots_pipeline",
    "sticky_filter",
    "take_update",
]

log = logging.getLogger(__name__)


TAKE_SORT: dict[str, int] = {"slot": 1}
"""The free step takes the first free slot in slot order."""

LEASE_PROJECTION: dict[str, int] = {
    "_id": 0,
    "ns": 1,
    "slot": 1,
    "ownerKey": 1,
    "incarnation": 1,
    "fence": 1,
    "expiresAt": 1,
    "floor": 1,
    "ceiling": 1,
    "writtenAt": 1,
    "holdBy": 1,
    "holdUntil": 1,
}
"""What a take or a renewal returns (the document after the write)."""

_CODEC: CodecOptions[dict[str, Any]] = CodecOptions(
    tz_aware=True, tzinfo=UTC, datetime_conversion=DatetimeConversion.DATETIME_MS
)
"""Dates come back as ``DatetimeMS``: exact milliseconds, any range."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- pure builders


def namespace_filter(namespace: str) -> dict[str, Any]:
    return {"_id": namespace}


def namespace_doc(namespace: str, limit: int, tolerance_ms: int, slot_offset: int) -> dict[str, Any]:
    """The namespace document the first user of a namespace inserts."""
    return {"_id": namespace, "limit": limit, "toleranceMs": tolerance_ms, "slotOffset": slot_offset}


def namespace_mismatch(doc: Mapping[str, Any], limit: int, slot_offset: int) -> str | None:
    """Why ``doc`` refuses these parameters, or ``None``. A missing ``slotOffset`` reads as 0."""
    recorded_limit = doc.get("limit")
    recorded_offset = doc.get("slotOffset", 0)
    if recorded_limit != limit or recorded_offset != slot_offset:
        return (
            f"namespace {doc.get('_id')!r} is recorded with limit={recorded_limit}, "
            f"slotOffset={recorded_offset}; asked limit={limit}, slotOffset={slot_offset}"
        )
    return None


def _slot_range(slot_offset: int, limit: int) -> dict[str, int]:
    return {"$gte": slot_offset, "$lt": slot_offset + limit}


def owner_pipeline(namespace: str, owner_key: str, slot_offset: int, limit: int) -> list[dict[str, Any]]:
    """The acquire's read: one document ``{mine: [...], present: [slot, ...]}``.

    ``mine`` holds the slots the owner key holds or held last, most recently written first
    (then by slot), each with ``live`` (``expiresAt > $$NOW`` with the owner key on it, decided
    by the store clock) and ``storeNow`` (``$$NOW``: the idempotent answer's lease counts its
    remaining time from it); ``present`` lists the slot numbers whose documents exist. ``$facet``
    answers one document even when the namespace has no slot yet.
    """
    return [
        {"$match": {"ns": namespace, "slot": _slot_range(slot_offset, limit)}},
        {
            "$facet": {
                "mine": [
                    {"$match": {"$or": [{"ownerKey": owner_key}, {"lastOwnerKey": owner_key}]}},
                    {"$sort": {"writtenAt": -1, "slot": 1}},
                    {
                        "$set": {
                            "live": {
                                "$and": [
                                    {"$eq": ["$ownerKey", {"$literal": owner_key}]},
                                    {"$gt": ["$expiresAt", "$$NOW"]},
                                ]
                            },
                            "storeNow": "$$NOW",
                        }
                    },
                    {"$project": {"_id": 0}},
                ],
                "present": [{"$project": {"_id": 0, "slot": 1}}],
            }
        },
        {"$project": {"mine": 1, "present": "$present.slot"}},
    ]


def new_slot_docs(namespace: str, slots: Sequence[int]) -> list[dict[str, Any]]:
    """Slot documents of a namespace's first use: free, never held."""
    return [
        {
            "ns": namespace,
            "slot": slot,
            "ownerKey": None,
            "incarnation": 0,
            "lastOwnerKey": None,
            "fence": 0,
            "expiresAt": None,
            "floor": None,
            "ceiling": None,
            "nextFloor": None,
            "writtenAt": None,
        }
        for slot in slots
    ]


def held_expr() -> dict[str, Any]:
    """A live hold: ``holdUntil > $$NOW`` (a missing ``holdUntil`` compares below every date:
    manual, "Comparison/Sort Order")."""
    return {"$gt": ["$holdUntil", "$$NOW"]}


def free_expr(tolerance_ms: int) -> dict[str, Any]:
    """A slot is free when no live hold keeps it (:func:`held_expr`) and it has no owner or
    ``expiresAt + tolerance < $$NOW`` (store clock)."""
    return {
        "$and": [
            {"$not": [held_expr()]},
            {
                "$or": [
                    {"$eq": [{"$ifNull": ["$ownerKey", None]}, None]},
                    {"$lt": [{"$add": ["$expiresAt", tolerance_ms]}, "$$NOW"]},
                ]
            },
        ]
    }


def sticky_filter(namespace: str, slot: int, fence: int, owner_key: str, tolerance_ms: int) -> dict[str, Any]:
    """The owner's last slot, unchanged since it was read (same fence), and free or its own
    expired lease (the previous process of this owner key stopped at its ``ttl - tolerance``)
    with no live hold."""
    return {
        "ns": namespace,
        "slot": slot,
        "fence": fence,
        "$expr": {
            "$or": [
                free_expr(tolerance_ms),
                {
                    "$and": [
                        {"$not": [held_expr()]},
                        {"$eq": ["$ownerKey", {"$literal": owner_key}]},
                        {"$lte": ["$expiresAt", "$$NOW"]},
                    ]
                },
            ]
        },
    }


def preferred_filter(namespace: str, slot: int, tolerance_ms: int) -> dict[str, Any]:
    return {"ns": namespace, "slot": slot, "$expr": free_expr(tolerance_ms)}


def free_filter(namespace: str, slot_offset: int, limit: int, tolerance_ms: int) -> dict[str, Any]:
    """Any free slot of the namespace's range; sent with :data:`TAKE_SORT`."""
    return {"ns": namespace, "slot": _slot_range(slot_offset, limit), "$expr": free_expr(tolerance_ms)}


def take_update(owner_key: str, ttl_ms: int) -> list[dict[str, Any]]:
    """The pipeline update of a take: ``writtenAt = $$NOW`` first, then expiry and bounds from it.

    ``fence`` and ``incarnation`` +1, ``ownerKey = lastOwnerKey = owner``, ``expiresAt =
    writtenAt + ttl``, ``floor = nextFloor`` (``writtenAt`` when none), ``ceiling = expiresAt``,
    ``nextFloor = max(ceiling, floor)``. Each ``$set`` sees the fields of the one before.
    """
    return [
        {
            "$set": {
                "writtenAt": "$$NOW",
                "ownerKey": {"$literal": owner_key},
                "lastOwnerKey": {"$literal": owner_key},
                "fence": {"$add": [{"$ifNull": ["$fence", 0]}, 1]},
                "incarnation": {"$add": [{"$ifNull": ["$incarnation", 0]}, 1]},
            }
        },
        {
            "$set": {
                "expiresAt": {"$add": ["$writtenAt", ttl_ms]},
                "floor": {"$ifNull": ["$nextFloor", "$writtenAt"]},
            }
        },
        {"$set": {"ceiling": "$expiresAt", "nextFloor": {"$max": ["$expiresAt", "$floor"]}}},
    ]


def _tenure(lease: SlotLease) -> dict[str, Any]:
    """The lease's tenure: nobody took the slot since (fence) and no newer process of the same
    owner key did either (incarnation)."""
    return {
        "ns": lease.namespace,
        "slot": lease.slot,
        "ownerKey": lease.owner_key,
        "incarnation": lease.incarnation,
        "fence": lease.fence,
    }


def renew_filter(lease: SlotLease) -> dict[str, Any]:
    """The lease as held: same owner key, incarnation and fence, not expired by ``$$NOW``."""
    return {**_tenure(lease), "$expr": {"$gt": ["$expiresAt", "$$NOW"]}}


def renew_update(ttl_ms: int) -> list[dict[str, Any]]:
    """``writtenAt = $$NOW``, ``expiresAt = writtenAt + ttl``, ``ceiling = expiresAt``,
    ``nextFloor = max(ceiling, floor, nextFloor)`` (never lower, should the store clock step
    back across a failover)."""
    return [
        {"$set": {"writtenAt": "$$NOW"}},
        {"$set": {"expiresAt": {"$add": ["$writtenAt", ttl_ms]}}},
        {"$set": {"ceiling": "$expiresAt", "nextFloor": {"$max": ["$expiresAt", "$floor", "$nextFloor"]}}},
    ]


def release_filter(lease: SlotLease) -> dict[str, Any]:
    """The lease's tenure (as :func:`renew_filter`, without the expiry: a holder whose lease
    expired with nobody taking the slot over may still hand it back and record its floor)."""
    return _tenure(lease)


def release_update(last_issued: int) -> list[dict[str, Any]]:
    """Clears ``ownerKey`` (``lastOwnerKey`` stays: the slot is sticky to it), ends the lease
    now (``expiresAt = min(expiresAt, $$NOW)``, ``writtenAt = $$NOW``) and sets ``nextFloor =
    max(last_issued + 1, floor)`` (``$toDate`` takes a long, never an int). One ``$set``: every
    expression reads the document as it was."""
    return [
        {
            "$set": {
                "ownerKey": None,
                "writtenAt": "$$NOW",
                "expiresAt": {"$min": ["$expiresAt", "$$NOW"]},
                "nextFloor": {"$max": [{"$toDate": Int64(last_issued + 1)}, "$floor"]},
            }
        }
    ]


def hold_filter(namespace: str, by: str) -> dict[str, Any]:
    """The namespace's slots with no live hold of another holder than ``by``."""
    return {
        "ns": namespace,
        "$expr": {"$or": [{"$not": [held_expr()]}, {"$eq": ["$holdBy", {"$literal": by}]}]},
    }


def hold_update(by: str, ttl_ms: int) -> list[dict[str, Any]]:
    """``holdBy = by``, ``holdUntil = $$NOW + ttl`` (a hold not renewed lapses: a rebuild killed
    keeps no slot from its replicas for longer)."""
    return [{"$set": {"holdBy": {"$literal": by}, "holdUntil": {"$add": ["$$NOW", ttl_ms]}}}]


def lift_filter(namespace: str, by: str) -> dict[str, Any]:
    return {"ns": namespace, "holdBy": by}


def lift_update() -> dict[str, Any]:
    return {"$unset": {"holdBy": "", "holdUntil": ""}}


def slots_pipeline(namespace: str) -> list[dict[str, Any]]:
    """Every slot document of the namespace, in slot order, with the store's now."""
    return [
        {"$match": {"ns": namespace}},
        {"$sort": {"slot": 1}},
        {"$set": {"storeNow": "$$NOW"}},
        {"$project": {"_id": 0}},
    ]


def replica_filter(namespace: str, owner_key: str) -> dict[str, Any]:
    """A presence record by its ``_id``, ``{ns, ownerKey}`` in that order."""
    return {"_id": {"ns": namespace, "ownerKey": owner_key}}


def heartbeat_update(namespace: str, owner_key: str, info: ReplicaInfo, ttl_ms: int) -> list[dict[str, Any]]:
    """The pipeline update of a heartbeat (an upsert): ``seenAt = $$NOW``, ``startedAt`` kept
    while ``instance`` is the same (else ``$$NOW``), then ``expiresAt = seenAt + ttl``. Every
    value the replica gives goes in as a literal; the first ``$set`` reads the document as it
    was (none on the first heartbeat)."""
    return [
        {
            "$set": {
                "ns": {"$literal": namespace},
                "ownerKey": {"$literal": owner_key},
                "startedAt": {"$cond": [{"$eq": ["$instance", {"$literal": info.instance}]}, "$startedAt", "$$NOW"]},
                "instance": {"$literal": info.instance},
                "host": {"$literal": info.host},
                "pid": {"$literal": info.pid},
                "version": {"$literal": info.version},
                "state": {"$literal": info.state},
                "slots": {"$literal": sorted(info.slots)},
                "seenAt": "$$NOW",
            }
        },
        {"$set": {"expiresAt": {"$add": ["$seenAt", ttl_ms]}}},
    ]


def replicas_pipeline(namespace: str) -> list[dict[str, Any]]:
    """The namespace's presence records, live or expired within the retention (decided by
    ``$$NOW``, whatever the TTL monitor removed yet), by owner key, with the store's now."""
    return [
        {
            "$match": {
                "ns": namespace,
                "$expr": {"$gt": [{"$add": ["$expiresAt", _whole_ms(PRESENCE_RETENTION)]}, "$$NOW"]},
            }
        },
        {"$sort": {"ownerKey": 1}},
        {"$set": {"storeNow": "$$NOW"}},
        {"$project": {"_id": 0}},
    ]


# --------------------------------------------------------------------------- documents -> model


def _ms(value: Any, field: str, collection: str = SLOT_COLLECTION) -> int:
    if isinstance(value, DatetimeMS):
        return int(value)
    if isinstance(value, datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=UTC)
        return (aware - _EPOCH) // timedelta(milliseconds=1)
    raise StorageError(f"mongodb {collection}: {field} is not a date: {value!r}")


def _ms_or_zero(value: Any, field: str) -> int:
    return 0 if value is None else _ms(value, field)


def _int(doc: Mapping[str, Any], field: str) -> int:
    value = doc.get(field, 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise StorageError(f"mongodb {SLOT_COLLECTION}: {field} is not an integer: {value!r}")
    return value


def _lease(doc: Mapping[str, Any]) -> SlotLease:
    owner = doc.get("ownerKey")
    if not isinstance(owner, str):
        raise StorageError(f"mongodb {SLOT_COLLECTION}: a held slot without ownerKey: {doc!r}")
    written_at = _ms(doc.get("writtenAt"), "writtenAt")
    return SlotLease(
        namespace=str(doc.get("ns")),
        slot=_int(doc, "slot"),
        owner_key=owner,
        incarnation=_int(doc, "incarnation"),
        fence=_int(doc, "fence"),
        expires_at=_ms(doc.get("expiresAt"), "expiresAt"),
        floor=_ms(doc.get("floor"), "floor"),
        ceiling=_ms(doc.get("ceiling"), "ceiling"),
        written_at=written_at,
        held_by=_hold_of(doc, written_at),
    )


def _hold_of(doc: Mapping[str, Any], now: int) -> str | None:
    """``holdBy`` of a slot document whose hold is live at ``now`` (store clock, ms)."""
    by, until = doc.get("holdBy"), doc.get("holdUntil")
    if not isinstance(by, str) or until is None:
        return None
    return by if _ms(until, "holdUntil") > now else None


def _state(doc: Mapping[str, Any]) -> SlotState:
    owner = doc.get("ownerKey")
    last = doc.get("lastOwnerKey")
    return SlotState(
        namespace=str(doc.get("ns")),
        slot=_int(doc, "slot"),
        owner_key=owner if isinstance(owner, str) else None,
        last_owner_key=last if isinstance(last, str) else None,
        incarnation=_int(doc, "incarnation"),
        fence=_int(doc, "fence"),
        expires_at=_ms_or_zero(doc.get("expiresAt"), "expiresAt"),
        next_floor=_ms_or_zero(doc.get("nextFloor"), "nextFloor"),
        store_now=_ms(doc.get("storeNow"), "storeNow"),
        held_by=doc.get("holdBy") if isinstance(doc.get("holdBy"), str) else None,
        held_until=_ms_or_zero(doc.get("holdUntil"), "holdUntil"),
    )


def _replica(doc: Mapping[str, Any]) -> ReplicaState:
    def text(field: str) -> str:
        value = doc.get(field)
        if not isinstance(value, str):
            raise StorageError(f"mongodb {REPLICA_COLLECTION}: {field} is not a string: {doc!r}")
        return value

    def date(field: str) -> int:
        return _ms(doc.get(field), field, REPLICA_COLLECTION)

    pid = doc.get("pid")
    slots = doc.get("slots")
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise StorageError(f"mongodb {REPLICA_COLLECTION}: pid is not an integer: {doc!r}")
    if not isinstance(slots, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in slots):
        raise StorageError(f"mongodb {REPLICA_COLLECTION}: slots is not a list of integers: {doc!r}")
    return ReplicaState(
        namespace=text("ns"),
        owner_key=text("ownerKey"),
        instance=text("instance"),
        host=text("host"),
        pid=pid,
        version=text("version"),
        state="holding" if doc.get("state") == "holding" else "standby",
        slots=tuple(slots),
        started_at=date("startedAt"),
        seen_at=date("seenAt"),
        expires_at=date("expiresAt"),
        store_now=date("storeNow"),
    )


def _whole_ms(value: timedelta) -> int:
    return value // timedelta(milliseconds=1)


# --------------------------------------------------------------------------- the store


class MongoSlotLeaseStore(MongoStore):
    """:class:`~wowd.stores.base.SlotLeaseStore` on ``cosid_slot`` / ``cosid_namespace``.

    The :class:`~wowd.stores.mongo._common.MongoStore` constructor (client or URI, database,
    ``operation_timeout``). ``write_concern``: the concern of every write (acknowledged;
    ``majority`` keeps leases across a failover); ``None`` means the client's. Reads and writes
    always go to the primary. ``ddl``: the unique index on ``(ns, slot)`` and the TTL index of
    ``cosid_replica`` are created (AUTO), checked (VALIDATE) or assumed (NONE) by
    :meth:`prepare`; the first :meth:`acquire` (the slot index) and the first :meth:`heartbeat`
    (the TTL index) do it when nobody did before (the constructor does no I/O).
    """

    CAPABILITIES = (SLOT_HOLD,)
    """Every slot of a namespace can be held paused (:meth:`hold`, :meth:`lift`): a rebuild of the
    timer view swaps it in while no replica works."""

    _label = "leases"

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
        write_concern: WriteConcern | None = None,
        ddl: Ddl = Ddl.AUTO,
    ) -> None:
        if write_concern is not None and not write_concern.acknowledged:
            raise ConfigError("lease store write concern: must be acknowledged (w >= 1 or 'majority')")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self._ddl = Ddl(ddl)
        options: dict[str, Any] = {"codec_options": _CODEC, "read_preference": ReadPreference.PRIMARY}
        if write_concern is not None:
            options["write_concern"] = write_concern
        self._slots: AsyncCollection[dict[str, Any]] = self._db.get_collection(SLOT_COLLECTION, **options)
        self._namespaces: AsyncCollection[dict[str, Any]] = self._db.get_collection(NAMESPACE_COLLECTION, **options)
        self._replicas: AsyncCollection[dict[str, Any]] = self._db.get_collection(REPLICA_COLLECTION, **options)
        self._prepared = self._ddl is Ddl.NONE
        self._replicas_prepared = self._ddl is Ddl.NONE
        self._prepare_lock = anyio.Lock()

    # ------------------------------------------------------------------ plumbing

    async def _prepare(self) -> None:
        """One ``createIndexes`` (or ``listIndexes``) per store, also when the first acquires
        run concurrently."""
        if self._prepared:
            return
        async with self._prepare_lock:
            if self._prepared:
                return
            if self._ddl is Ddl.AUTO:
                await self._slots.create_indexes(slot_indexes())
            elif self._ddl is Ddl.VALIDATE:
                found = {ix["name"]: ix async for ix in await self._slots.list_indexes()}
                ix = found.get(SLOT_INDEX_NAME)
                if ix is None or list(ix["key"].items()) != [("ns", 1), ("slot", 1)] or not ix.get("unique"):
                    raise FormatError(
                        f"mongodb {SLOT_COLLECTION}: the unique index {SLOT_INDEX_NAME} is missing (ddl=validate)"
                    )
            self._prepared = True

    async def _prepare_replicas(self) -> None:
        """One ``createIndexes`` (or ``listIndexes``) of ``cosid_replica`` per store."""
        if self._replicas_prepared:
            return
        async with self._prepare_lock:
            if self._replicas_prepared:
                return
            if self._ddl is Ddl.AUTO:
                await self._replicas.create_indexes(replica_indexes())
            elif self._ddl is Ddl.VALIDATE:
                found = {ix["name"]: ix async for ix in await self._replicas.list_indexes()}
                ix = found.get(REPLICA_TTL_INDEX)
                want = whole_seconds(PRESENCE_RETENTION)
                if ix is None or list(ix["key"].items()) != [("expiresAt", 1)] or ix.get("expireAfterSeconds") != want:
                    raise FormatError(
                        f"mongodb {REPLICA_COLLECTION}: the TTL index {REPLICA_TTL_INDEX} on expiresAt "
                        f"(expireAfterSeconds {want}) is missing (ddl=validate)"
                    )
            self._replicas_prepared = True

    async def prepare(self) -> None:
        """Creates (AUTO) or checks (VALIDATE) the unique index on ``(ns, slot)`` of
        ``cosid_slot``, then the TTL index of ``cosid_replica`` (idempotent)."""
        with self._call("prepare"):
            await self._prepare()
            await self._prepare_replicas()

    # ------------------------------------------------------------------ acquire

    async def acquire(
        self,
        namespace: str,
        owner: Owner,
        limit: int,
        ttl: timedelta,
        tolerance: timedelta,
        slot_offset: int = 0,
        preferred_slot: int | None = None,
    ) -> AcquireResult:
        if limit < 1:
            raise ConfigError(f"lease limit: must be >= 1, got {limit}")
        if slot_offset < 0:
            raise ConfigError(f"lease slot offset: must be >= 0, got {slot_offset}")
        ttl_ms = _whole_ms(ttl)
        tolerance_ms = _whole_ms(tolerance)
        if ttl_ms < 1:
            raise ConfigError(f"lease ttl: must be at least 1 ms, got {ttl}")
        if tolerance_ms < 0:
            raise ConfigError(f"lease tolerance: must be >= 0, got {tolerance}")
        with self._call("acquire"):
            await self._prepare()
            refused = await self._check_namespace(namespace, limit, tolerance_ms, slot_offset)
            if refused is not None:
                log.warning("lease namespace %s refused: %s", namespace, refused)
                return AcquireResult(status="refused", reason=refused)
            return await self._acquire(namespace, owner.key, limit, ttl_ms, tolerance_ms, slot_offset, preferred_slot)

    async def _check_namespace(self, namespace: str, limit: int, tolerance_ms: int, slot_offset: int) -> str | None:
        doc = await self._namespaces.find_one(namespace_filter(namespace))
        if doc is None:
            try:
                doc = namespace_doc(namespace, limit, tolerance_ms, slot_offset)
                await write_one(self._namespaces, InsertOne(doc), "leases.namespace")
                return None
            except OperationFailure as exc:
                if not is_duplicate_key(exc):
                    raise
            doc = await self._namespaces.find_one(namespace_filter(namespace))  # lost the race
            if doc is None:
                raise StorageError(f"mongodb {NAMESPACE_COLLECTION}: {namespace!r} vanished after E11000")
        return namespace_mismatch(doc, limit, slot_offset)

    async def _acquire(
        self,
        namespace: str,
        owner_key: str,
        limit: int,
        ttl_ms: int,
        tolerance_ms: int,
        slot_offset: int,
        preferred_slot: int | None,
    ) -> AcquireResult:
        read = await self._read_owner(namespace, owner_key, slot_offset, limit)
        mine: list[dict[str, Any]] = list(read.get("mine") or [])
        for doc in mine:
            if doc.get("live") is True:
                lease = replace(_lease(doc), store_now=_ms(doc.get("storeNow"), "storeNow"))
                log.debug("lease %s/%d: %s holds it already", namespace, lease.slot, owner_key)
                return AcquireResult(status="acquired", lease=lease)

        present = set(read.get("present") or [])
        missing = [s for s in range(slot_offset, slot_offset + limit) if s not in present]
        if missing:
            await self._create_slots(namespace, missing)

        take = take_update(owner_key, ttl_ms)
        tried: set[int] = set()
        for doc in mine:
            slot, fence = _int(doc, "slot"), _int(doc, "fence")
            tried.add(slot)
            taken = await self._take(sticky_filter(namespace, slot, fence, owner_key, tolerance_ms), take)
            if taken is not None:
                return self._acquired(taken, "sticky")
        if preferred_slot is not None and preferred_slot not in tried:
            if slot_offset <= preferred_slot < slot_offset + limit:
                taken = await self._take(preferred_filter(namespace, preferred_slot, tolerance_ms), take)
                if taken is not None:
                    return self._acquired(taken, "preferred")
            else:
                log.warning(
                    "lease namespace %s: preferred slot %d is outside [%d, %d), ignored",
                    namespace,
                    preferred_slot,
                    slot_offset,
                    slot_offset + limit,
                )
        taken = await self._take(free_filter(namespace, slot_offset, limit, tolerance_ms), take, sort=TAKE_SORT)
        if taken is not None:
            return self._acquired(taken, "free")
        return AcquireResult(status="exhausted", reason=f"all {limit} slots of namespace {namespace!r} are held")

    @staticmethod
    def _acquired(doc: Mapping[str, Any], step: str) -> AcquireResult:
        lease = _lease(doc)
        log.info(
            "lease %s/%d taken (%s) by %s: fence %d, incarnation %d",
            lease.namespace,
            lease.slot,
            step,
            lease.owner_key,
            lease.fence,
            lease.incarnation,
        )
        return AcquireResult(status="acquired", lease=lease)

    async def _read_owner(self, namespace: str, owner_key: str, slot_offset: int, limit: int) -> dict[str, Any]:
        cursor = await self._slots.aggregate(owner_pipeline(namespace, owner_key, slot_offset, limit))
        docs = await cursor.to_list()
        if len(docs) > 1:
            raise StorageError(f"mongodb {SLOT_COLLECTION}: the owner read answered {len(docs)} documents")
        return docs[0] if docs else {}  # $facet answers one document, also over no input

    async def _create_slots(self, namespace: str, slots: Sequence[int]) -> None:
        """Inserts the missing slot documents, unordered; a duplicate key is another process
        creating the same slot at the same time (a race, not an error)."""
        try:
            await self._slots.insert_many(new_slot_docs(namespace, slots), ordered=False)
        except BulkWriteError as exc:
            errors = duplicate_keys(exc, "lease namespace slots")
            log.debug("lease namespace %s: %d slot documents created by another process", namespace, len(errors))

    async def _take(
        self, query: dict[str, Any], update: list[dict[str, Any]], sort: Mapping[str, int] | None = None
    ) -> dict[str, Any] | None:
        return await self._slots.find_one_and_update(
            query,
            update,
            projection=LEASE_PROJECTION,
            sort=list(sort.items()) if sort else None,
            return_document=ReturnDocument.AFTER,
        )

    # ------------------------------------------------------------------ renew / release

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        """Extends the lease when it is still held as is (``tolerance`` plays no part: an
        expired lease is lost to its holder even while others must still wait for it)."""
        ttl_ms = _whole_ms(ttl)
        if ttl_ms < 1:
            raise ConfigError(f"lease ttl: must be at least 1 ms, got {ttl}")
        with self._call("renew"):
            doc = await self._slots.find_one_and_update(
                renew_filter(lease),
                renew_update(ttl_ms),
                projection=LEASE_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
        if doc is None:
            log.warning(
                "lease %s/%d lost: renewal of fence %d, incarnation %d matched nothing",
                lease.namespace,
                lease.slot,
                lease.fence,
                lease.incarnation,
            )
            return None
        return _lease(doc)

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        with self._call("release"):
            result = await self._slots.update_one(release_filter(lease), release_update(last_issued))
        if result.matched_count == 0:
            log.warning(
                "lease %s/%d: release of fence %d, incarnation %d matched nothing",
                lease.namespace,
                lease.slot,
                lease.fence,
                lease.incarnation,
            )
            return False
        return True

    # ------------------------------------------------------------------ holds

    async def hold(self, namespace: str, by: str, ttl: timedelta) -> list[SlotState]:
        """Holds every slot of ``namespace`` paused for ``by`` until the store's now + ``ttl``
        (renewed by calling it again): no acquire takes a held slot, and each holder learns of
        the hold at its next renewal and releases its slot once its work has drained. Every slot
        of the namespace's recorded range is created first (so a replica starting meanwhile
        finds it held). Answers the namespace's slots after the write; raises
        :class:`~wowd.errors.StorageError` when another holder's live hold is on any of them."""
        ttl_ms = _whole_ms(ttl)
        with self._call("hold"):
            await self._prepare()
            ns = await self._namespaces.find_one(namespace_filter(namespace))
            if ns is not None:
                offset, limit = int(ns.get("slotOffset", 0)), int(ns.get("limit", 0))
                present = {_int(d, "slot") async for d in self._slots.find({"ns": namespace}, {"_id": 0, "slot": 1})}
                missing = [s for s in range(offset, offset + limit) if s not in present]
                if missing:
                    await self._create_slots(namespace, missing)
            await self._slots.update_many(hold_filter(namespace, by), hold_update(by, ttl_ms))
        states = await self.slots(namespace)
        others = sorted({s.held_by for s in states if s.held and s.held_by != by and s.held_by is not None})
        if others:
            raise StorageError(f"lease namespace {namespace!r} is held by {', '.join(others)}")
        return states

    async def lift(self, namespace: str, by: str) -> int:
        """Ends ``by``'s hold of the namespace's slots; answers how many it held. Idempotent."""
        with self._call("lift"):
            res = await self._slots.update_many(lift_filter(namespace, by), lift_update())
        return int(res.modified_count)

    # ------------------------------------------------------------------ status

    async def slots(self, namespace: str) -> list[SlotState]:
        with self._call("slots"):
            cursor = await self._slots.aggregate(slots_pipeline(namespace))
            docs = await cursor.to_list()
        return [_state(doc) for doc in docs]

    # ------------------------------------------------------------------ presence

    async def heartbeat(self, namespace: str, owner_key: str, info: ReplicaInfo, ttl: timedelta) -> None:
        ttl_ms = _whole_ms(ttl)
        if ttl_ms < 1:
            raise ConfigError(f"heartbeat ttl: must be at least 1 ms, got {ttl}")
        with self._call("heartbeat"):
            await self._prepare_replicas()
            await self._replicas.update_one(
                replica_filter(namespace, owner_key), heartbeat_update(namespace, owner_key, info, ttl_ms), upsert=True
            )

    async def replicas(self, namespace: str) -> list[ReplicaState]:
        with self._call("replicas"):
            cursor = await self._replicas.aggregate(replicas_pipeline(namespace))
            docs = await cursor.to_list()
        return [_replica(doc) for doc in docs]

    async def leave(self, namespace: str, owner_key: str) -> bool:
        with self._call("leave"):
            result = await self._replicas.delete_one(replica_filter(namespace, owner_key))
        return result.deleted_count == 1
