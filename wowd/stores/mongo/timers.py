"""The timers of one context on MongoDB (DESIGN.md section 5).

One collection per owner aggregate type, ``wow_timer__<context>__<aggregate>``, recorded in the
registry ``wow_timer_aggregate`` (``{_id: collection, context, aggregate, format: 6, created_at}``).
One document per timer::

    {timer_id, partition, owner {tenant_id, id}, key, version, status, due_at, scheduled_at,
     target {context, aggregate, tenant_id, id}, body, rule {type, ...}, attempts, fired,
     claim {owner_key, fence, until}?, last_error?, revision}

Tombstones: a fired one-shot timer (``DONE``) or a cancelled one (``CANCELLED``) stays the same
document (one per key, so the conditional upserts stay atomic) with that status, the version it
ended at and ``expires_at``, a Date (server time + the retention) that the partial TTL index
``tombstones_ttl`` (``expireAfterSeconds: 0``) expires. A cancel of a key that holds nothing
upserts a bare tombstone ``{partition, owner, key, version, status, expires_at, revision}``. A put
at or below a tombstone's version is refused, so replaying the log re-delivers nothing. Tombstones
are outside the due and parked indexes and every read filters them out. Format 5 (no tombstones,
otherwise the same) is upgraded in place: the TTL index is created, then the registry records 6.

Times (``due_at``, ``scheduled_at``, ``claim.until``) are int64 milliseconds since the epoch.
``body`` is the command's JSON text; ``rule`` the subdocument Wow's JSON writes.

Every filter by owner carries the owner's partition (the shard key), so on a sharded cluster the
reads and writes by owner reach one shard. The documents each method sends are built by the pure
functions next to it (the black-pipe tests assert them on the wire).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import pymongo
from bson.min_key import MinKey
from pymongo import AsyncMongoClient, ReplaceOne, UpdateMany, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, OperationFailure, PyMongoError

from wowd import clock
from wowd.errors import FormatError, InvalidInput, StorageError, StorageUnavailable
from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    Claim,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
    parse_rule,
    validate_name,
)
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    DUPLICATE_KEY,
    NAMESPACE_EXISTS,
    TIMER_FORMAT,
    TIMER_REGISTRY,
    TIMER_UPGRADES_FROM,
    MongoSharding,
    MongoStore,
    collection_name,
    is_duplicate_key,
    is_unauthorized,
    split_to_fit,
    write_one,
)

__all__ = [
    "MAX_UNIONS",
    "PIPELINE_LENGTH_LIMIT",
    "REGISTRY",
    "MongoTimerStore",
    "cancel_all_filter",
    "cancel_filter",
    "due_match",
    "fail_operation",
    "index_specs",
    "next_due_match",
    "next_due_pipeline",
    "next_due_pipelines",
    "owner_filter",
    "parked_many_match",
    "put_filter",
    "put_update",
    "reclaim_filter",
    "reclaim_update",
    "registry_claim",
    "registry_upgrade",
    "settle_filter",
    "settle_operations",
    "timer_from_doc",
    "timer_to_doc",
    "tombstone_raise_filter",
    "tombstone_update",
    "ttl_index_spec",
    "union_batch_size",
    "union_pipeline",
    "union_pipelines",
    "write_operation",
    "write_update",
    "write_verdict",
]

log = logging.getLogger(__name__)

REGISTRY = TIMER_REGISTRY
"""The registry of the timer collections of every context."""

DUE_STATUSES = [TimerStatus.PENDING.value, TimerStatus.FIRING.value]
"""The statuses the due index holds (its ``partialFilterExpression``)."""
TOMBSTONES = ["DONE", "CANCELLED"]
"""The statuses of a tombstone (the TTL index's ``partialFilterExpression``)."""

SORT = {"due_at": 1, "timer_id": 1}

UNIQUE_INDEX = "partition_owner_key"
DUE_INDEX = "due"
PARKED_INDEX = "parked_target"
RECLAIM_INDEX = "reclaim"
TTL_INDEX = "tombstones_ttl"

_INDEX_CONFLICT_CODES = frozenset({85, 86})  # IndexOptionsConflict, IndexKeySpecsConflict
MAX_SCANS_TO_EXPLODE = 200
"""The server's ``internalQueryMaxScansToExplode``: above this many point intervals (partitions
of one ``$in``) the planner stops merging one index scan per partition and sorts the whole
match instead; the due reads split the partitions into groups of at most this many."""
SPREAD_CHUNKS_PER_SHARD = 4
"""How many chunks :meth:`MongoTimerStore.spread_chunks` gives each shard of a new collection:
contiguous partition ranges, so the splits and moves are bounded by the shard count, never by
the partition count."""
SPREAD_BUDGET = timedelta(minutes=5)
"""How long :meth:`MongoTimerStore.spread_chunks` may take by default, all collections together;
what is left then is the balancer's."""
PIPELINE_LENGTH_LIMIT = 1000
"""The server's ``internalPipelineLengthLimit``: an aggregation pipeline of more stages is refused
(``FailedToParse``, code 9, or 7749501 before parsing: src/mongo/db/pipeline/pipeline.cpp) and
every due, claim and next-due read with it."""
MAX_UNIONS = PIPELINE_LENGTH_LIMIT - 10
"""The ``$unionWith`` stages of one union aggregation: the limit less the stages around them
(``$match``, ``$count``, which the server parses into two, ``$sort``, ``$limit``) and a margin.
More (collections x partition groups) are read in as many aggregations as needed."""
_MAX_RELOADS = 3
_WRITE_ATTEMPTS = 3
"""Upserts of one put or cancel whose E11000 met a key that moved (a racing insert, an expiry)."""
_KEY_FIELDS = {"_id": 0, "partition": 1, "owner": 1, "key": 1, "version": 1, "status": 1}
"""The projection of the read that decides an upsert that met the unique key."""


# --------------------------------------------------------------------------- documents


def timer_to_doc(timer: Timer) -> dict[str, Any]:
    """The stored document of ``timer`` (no ``_id``: the server assigns one on insert and a
    replacement keeps it). ``claim`` and ``last_error`` are absent when None."""
    doc: dict[str, Any] = {
        "timer_id": timer.timer_id,
        "partition": timer.partition,
        "owner": {"tenant_id": timer.owner.tenant_id, "id": timer.owner.id},
        "key": timer.key,
        "version": timer.version,
        "status": timer.status.value,
        "due_at": timer.due_at,
        "scheduled_at": timer.scheduled_at,
        "target": {
            "context": timer.target.context,
            "aggregate": timer.target.aggregate,
            "tenant_id": timer.target.tenant_id,
            "id": timer.target.id,
        },
        "body": timer.body,
        "rule": timer.rule.to_doc(),
        "attempts": timer.attempts,
        "fired": timer.fired,
        "revision": timer.revision,
    }
    if timer.claim is not None:
        claim = timer.claim
        doc["claim"] = {"owner_key": claim.owner_key, "fence": claim.fence, "until": claim.until}
    if timer.last_error is not None:
        doc["last_error"] = timer.last_error
    return doc


def timer_from_doc(doc: Mapping[str, Any], *, context: str, aggregate: str) -> Timer:
    """Reads a stored timer of ``context.aggregate``; a malformed document is a :class:`StorageError`."""
    try:
        owner = doc["owner"]
        target = doc["target"]
        claim = doc.get("claim")
        return Timer(
            timer_id=doc["timer_id"],
            partition=int(doc["partition"]),
            owner=AggregateRef(
                context=context,
                aggregate=aggregate,
                tenant_id=owner.get("tenant_id", DEFAULT_TENANT),
                id=owner["id"],
            ),
            key=doc["key"],
            version=int(doc["version"]),
            due_at=int(doc["due_at"]),
            scheduled_at=int(doc["scheduled_at"]),
            target=AggregateRef(
                context=target["context"],
                aggregate=target["aggregate"],
                tenant_id=target.get("tenant_id", DEFAULT_TENANT),
                id=target["id"],
            ),
            body=doc["body"],
            rule=parse_rule(doc.get("rule", {"type": "once"})),
            status=TimerStatus(doc["status"]),
            attempts=int(doc.get("attempts", 0)),
            fired=int(doc.get("fired", 0)),
            claim=None
            if claim is None
            else Claim(owner_key=claim["owner_key"], fence=int(claim["fence"]), until=int(claim["until"])),
            last_error=doc.get("last_error"),
            revision=int(doc.get("revision", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError, InvalidInput) as exc:
        raise StorageError(f"mongodb timers: malformed timer document in {context}.{aggregate}: {exc!r}") from exc


# --------------------------------------------------------------------------- DDL builders


def index_specs() -> list[dict[str, Any]]:
    """The indexes of a timer collection (``createIndexes``'s ``indexes``).

    - unique ``(partition, owner.tenant_id, owner.id, key)``: one timer per owner and key; its
      partition prefix is the shard key, so the key stays unique across the shards;
    - partial ``(partition, due_at, timer_id)`` over PENDING and FIRING: the due read (needs
      MongoDB 6.0+ for ``$in`` in a ``partialFilterExpression``);
    - partial ``(target.id, target.tenant_id, target.aggregate, target.context)`` over PARKED: the
      parked read, which runs whenever a target commits (a small index: parked timers are few);
    - partial ``(partition, claim.fence)`` over FIRING: the takeover's reclaim (:func:`reclaim_filter`)
      reads the FIRING timers of its partitions under an older fence, not every live timer (a
      small index: a timer is FIRING only while it is delivered);
    - the tombstones' TTL index (:func:`ttl_index_spec`).
    """
    return [
        {
            "key": {"partition": 1, "owner.tenant_id": 1, "owner.id": 1, "key": 1},
            "name": UNIQUE_INDEX,
            "unique": True,
        },
        {
            "key": {"partition": 1, "due_at": 1, "timer_id": 1},
            "name": DUE_INDEX,
            "partialFilterExpression": {"status": {"$in": list(DUE_STATUSES)}},
        },
        {
            "key": {"target.id": 1, "target.tenant_id": 1, "target.aggregate": 1, "target.context": 1},
            "name": PARKED_INDEX,
            "partialFilterExpression": {"status": TimerStatus.PARKED.value},
        },
        {
            "key": {"partition": 1, "claim.fence": 1},
            "name": RECLAIM_INDEX,
            "partialFilterExpression": {"status": TimerStatus.FIRING.value},
        },
        ttl_index_spec(),
    ]


def ttl_index_spec() -> dict[str, Any]:
    """The tombstones' expiry: a TTL index is a single-field index on a Date (manual, "TTL
    Indexes"); ``expireAfterSeconds: 0`` removes a document once its ``expires_at`` has passed
    (the retention is in the value, so changing it needs no ``collMod``). Partial over the
    tombstone statuses: live timers have no ``expires_at`` and are not in the index at all."""
    return {
        "key": {"expires_at": 1},
        "name": TTL_INDEX,
        "expireAfterSeconds": 0,
        "partialFilterExpression": {"status": {"$in": list(TOMBSTONES)}},
    }


def registry_upgrade(name: str, now_ms: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The guarded registry update of an in-place upgrade: records format 6 only over format 5
    (a concurrent upgrade, drop or re-registration is not overwritten)."""
    return {"_id": name, "format": TIMER_UPGRADES_FROM}, {"$set": {"format": TIMER_FORMAT, "upgraded_at": now_ms}}


def registry_claim(context: str, aggregate: str, now_ms: int) -> dict[str, Any]:
    """The registry upsert's update: writes the format only when the document is new, so the
    answer (the document after the upsert) tells which format is recorded."""
    return {"$setOnInsert": {"context": context, "aggregate": aggregate, "format": TIMER_FORMAT, "created_at": now_ms}}


def spread_lowers(partitions: int, shards: int) -> list[int]:
    """The lowest partition of each chunk :meth:`MongoTimerStore.spread_chunks` makes:
    ``min(partitions, shards x SPREAD_CHUNKS_PER_SHARD)`` contiguous ranges of partitions, as even
    as the division allows; the first starts at 0."""
    ranges = max(1, min(partitions, shards * SPREAD_CHUNKS_PER_SHARD))
    return [(i * partitions) // ranges for i in range(ranges)]


def split_points(lowers: Sequence[int]) -> list[dict[str, Any]]:
    """``split`` middles: each range's lower bound but the first's (``[MinKey, l1), [l1, l2) ...
    [ln, MaxKey)``)."""
    return [{"partition": p} for p in lowers[1:]]


def chunk_mins(lowers: Sequence[int]) -> list[dict[str, Any]]:
    """The lower bound of each range's chunk, for ``moveRange``'s ``min``."""
    return [{"partition": MinKey() if i == 0 else p} for i, p in enumerate(lowers)]


# --------------------------------------------------------------------------- query builders


def owner_filter(owner: AggregateRef, partition: int) -> dict[str, Any]:
    """An owner's timers: the partition (shard key) first, then the unique index's owner keys."""
    return {"partition": partition, "owner.tenant_id": owner.tenant_id, "owner.id": owner.id}


def put_filter(timer: Timer) -> dict[str, Any]:
    """The put's conditional upsert: matches the stored document of (owner, key) when it is of an
    earlier version (a timer or a tombstone: replaced) or a live timer of the same version (kept
    as it is: a replay changes nothing). Anything else stored, a later version or a tombstone at
    the same or a later one, does not match, so the upsert inserts and meets the unique index:
    E11000, the refusal (a read then tells it from a racing insert). The server retries a
    duplicate-key upsert by itself only when the filter is equalities on the unique index's fields
    (manual, "Upsert with Duplicate Values"); the version terms keep the error ours. The filter
    carries the whole unique key and the partition (the shard key, which an upsert on a sharded
    collection must match by equality); an upsert's insert starts from its equality fields only
    (the ``$or`` is not copied), which the replacement overwrites anyway."""
    return {
        **key_filter(timer.owner, timer.partition, timer.key),
        "$or": [
            {"version": {"$lt": timer.version}},
            {"version": timer.version, "status": {"$nin": list(TOMBSTONES)}},
        ],
    }


def put_update(timer: Timer) -> list[dict[str, Any]]:
    """The put's update (a pipeline): a stored live timer of the same version stays as it is
    (``$$ROOT``: a replay never resets FIRING, FAILED, PARKED or attempts); otherwise the whole new
    timer (``$literal``: a body or key starting with ``$`` stays text), keeping the stored ``_id``,
    with the revision bumped over the stored one (``max(stored + 1, new)``, as the embedded store
    does) so that a settle made against the replaced timer is skipped. On insert there is no
    stored version or revision: the new timer as it is."""
    doc = timer_to_doc(timer)
    del doc["revision"]
    revision = {"$max": [{"$add": [{"$ifNull": ["$revision", timer.revision - 1]}, 1]}, timer.revision]}
    replaced = {"$mergeObjects": [{"_id": "$_id"}, {"$literal": doc}, {"revision": revision}]}
    return [{"$replaceWith": {"$cond": [{"$eq": ["$version", timer.version]}, "$$ROOT", replaced]}}]


def key_filter(owner: AggregateRef, partition: int, key: str) -> dict[str, Any]:
    return {**owner_filter(owner, partition), "key": key}


def live_filter(owner: AggregateRef, partition: int, key: str) -> dict[str, Any]:
    """The live timer of (owner, key): its key, not a tombstone (``find``)."""
    return {**key_filter(owner, partition, key), "status": {"$nin": list(TOMBSTONES)}}


def cancel_filter(owner: AggregateRef, partition: int, key: str, version: int) -> dict[str, Any]:
    """The cancel's conditional upsert: matches a live timer of (owner, key) at or below
    ``version`` (cancelled). Nothing stored: the upsert inserts a tombstone. A tombstone or a later
    live version stored: the insert meets the unique index (E11000), a read then decides."""
    return {**key_filter(owner, partition, key), "version": {"$lte": version}, "status": {"$nin": list(TOMBSTONES)}}


def cancel_all_filter(owner: AggregateRef, partition: int, version: int) -> dict[str, Any]:
    """Every live timer of an owner at or below ``version`` (an ``updateMany``, no upsert)."""
    return {**owner_filter(owner, partition), "version": {"$lte": version}, "status": {"$nin": list(TOMBSTONES)}}


def tombstone_raise_filter(owner: AggregateRef, partition: int, key: str, version: int) -> dict[str, Any]:
    """A tombstone of (owner, key) below ``version``: a cancel at ``version`` raises it."""
    return {**key_filter(owner, partition, key), "version": {"$lt": version}, "status": {"$in": list(TOMBSTONES)}}


def tombstone_update(status: str, version: int | None, retention_ms: int) -> list[dict[str, Any]]:
    """The update (a pipeline) that makes the matched or upserted document a tombstone: ``status``,
    at ``version`` (``None``: the version it has), ``expires_at`` = the server's ``$$NOW`` + the
    retention (``$add`` of a Date and milliseconds is a Date: what a TTL index reads), no claim,
    revision + 1 (0 for an inserted tombstone)."""
    fields: dict[str, Any] = {"status": status}
    if version is not None:
        fields["version"] = {"$literal": version}
    fields["expires_at"] = {"$add": ["$$NOW", retention_ms]}
    fields["revision"] = {"$add": [{"$ifNull": ["$revision", -1]}, 1]}
    return [{"$set": fields}, {"$unset": "claim"}]


def write_update(w: TimerWrite, partition: int, retention_ms: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update (a pipeline) of one timer write: a put's or a cancel's conditional
    upsert, or a ``cancel_all``'s ``updateMany``."""
    if w.kind == "put":
        assert w.timer is not None
        return put_filter(w.timer), put_update(w.timer)
    update = tombstone_update("CANCELLED", w.version, retention_ms)
    if w.kind == "cancel":
        return cancel_filter(w.owner, partition, w.key, w.version), update
    return cancel_all_filter(w.owner, partition, w.version), update


def write_operation(w: TimerWrite, partition: int, retention_ms: int) -> UpdateOne | UpdateMany:
    """The bulk operation of one timer write: an ``UpdateOne`` upsert (put, cancel) or an
    ``UpdateMany`` (``cancel_all``)."""
    flt, update = write_update(w, partition, retention_ms)
    return UpdateMany(flt, update) if w.kind == "cancel_all" else UpdateOne(flt, update, upsert=True)


RETRY = "retry"
"""A write whose key moved between its upsert's match and insert: its upsert is sent again."""
RAISE = "raise"
"""A cancel that met an earlier tombstone: the tombstone's version is raised."""


def write_verdict(w: TimerWrite, stored: Mapping[str, Any] | None) -> int | str:
    """What a put or cancel whose upsert met the unique key answers, given the document read
    after it (:data:`_KEY_FIELDS`): 1/0 as :meth:`MongoTimerStore.write` answers, or
    :data:`RETRY` when the document read would have matched (a racing insert, or it expired),
    or :data:`RAISE` (a cancel over an earlier tombstone)."""
    if stored is None:
        return RETRY
    version = int(stored.get("version", 0))
    tombstone = stored.get("status") in TOMBSTONES
    if w.kind == "put":
        if version > w.version or (tombstone and version == w.version):
            return 0
        return 1 if version == w.version else RETRY
    if tombstone:
        return 0 if version >= w.version else RAISE
    return 0 if version > w.version else RETRY


def settle_filter(timer: Timer) -> dict[str, Any]:
    """The document *as loaded*: ``timer_id`` and ``revision``, plus the owner's partition (shard
    key) and unique key, so the write reaches one shard and the unique index finds the document
    (``timer_id`` alone has no index)."""
    return {
        **key_filter(timer.owner, timer.partition, timer.key),
        "timer_id": timer.timer_id,
        "revision": timer.revision,
    }


def settle_operations(changes: Iterable[TimerChange], retention_ms: int) -> list[ReplaceOne[Any] | UpdateOne]:
    """One operation per change: the document :meth:`TimerChange.applied` gives, or (a fired
    timer with no next occurrence) its DONE tombstone at its version."""
    ops: list[ReplaceOne[Any] | UpdateOne] = []
    for change in changes:
        after = change.applied()
        flt = settle_filter(change.timer)
        if after is None:
            ops.append(UpdateOne(flt, tombstone_update("DONE", None, retention_ms)))
        else:
            ops.append(ReplaceOne(flt, timer_to_doc(after)))
    return ops


def fail_operation(doc: Mapping[str, Any], reason: str) -> UpdateOne:
    """A stored document that cannot be decoded: FAILED with ``reason``, by ``_id`` (with its
    partition, the shard key) at the revision read (absent: still absent). The new revision is
    computed here, so a malformed ``revision`` cannot fail the update."""
    flt: dict[str, Any] = {"_id": doc["_id"], "partition": doc.get("partition")}
    rev = doc.get("revision")
    flt["revision"] = rev if "revision" in doc else {"$exists": False}
    new_rev = rev + 1 if isinstance(rev, int) and not isinstance(rev, bool) else 1
    update = {"$set": {"status": TimerStatus.FAILED.value, "last_error": reason, "revision": new_rev}}
    return UpdateOne(flt, {**update, "$unset": {"claim": ""}})


def reclaim_filter(partitions: Iterable[int], fence: int) -> dict[str, Any]:
    """The FIRING timers of ``partitions`` claimed under a fence below ``fence``, over the reclaim
    index (manual, Partial Indexes: the predicate contains the index's filter ``status: FIRING``):
    point intervals on ``partition`` (the shard key, so a sharded cluster asks only the
    partitions' shards), a range ``[MinKey, fence)`` on ``claim.fence``. Only the keys of FIRING
    timers claimed under an older fence are read, however many PENDING timers a slot holds."""
    return {
        "partition": {"$in": sorted(set(partitions))},
        "status": TimerStatus.FIRING.value,
        "claim.fence": {"$lt": fence},
    }


def reclaim_update() -> list[dict[str, Any]]:
    """Back to PENDING due at its scheduled time, the old claim's fence named in ``last_error``,
    the claim removed, revision + 1 (attempts unchanged)."""
    error = {"$concat": ["claim of a previous holder (fence ", {"$toString": "$claim.fence"}, ") ended by a takeover"]}
    return [
        {
            "$set": {
                "status": TimerStatus.PENDING.value,
                "due_at": "$scheduled_at",
                "last_error": error,
                "revision": {"$add": ["$revision", 1]},
            }
        },
        {"$unset": "claim"},
    ]


def due_match(partitions: Iterable[int], until: int) -> dict[str, Any]:
    """The due timers of ``partitions`` (inside each ``$unionWith`` sub-pipeline).

    Why the partial index ``(partition, due_at, timer_id)`` over ``{status: {$in: [PENDING,
    FIRING]}}`` serves it, by the MongoDB manual's rules:

    - *Partial index use*: the query predicate must imply the ``partialFilterExpression`` (contain
      it or a subset of it); ``status: {$in: [PENDING, FIRING]}`` is that very expression.
    - *Bounds*: ``partition`` (the index's first key) by ``$in`` gives point intervals, ``due_at``
      (the second) by ``$lte`` a range inside each point: ``[[p, p], [-inf, until], [MinKey,
      MaxKey]]`` per partition, no document outside is examined.
    - *Sort*: the sort ``{due_at: 1, timer_id: 1}`` follows the keys after the ``$in`` prefix,
      which is ordered within each partition only; the planner "explodes" the point intervals
      (at most ``internalQueryMaxScansToExplode`` = 200 scans, our partitions are fewer) into one
      index scan per partition merged by a SORT_MERGE stage, so there is no blocking SORT and the
      ``$limit`` stops the scans after ``limit`` keys. With a single partition it is a plain scan.
      More partitions than that are split by :func:`partition_groups`, one match per group.
    """
    return {
        "partition": {"$in": sorted(set(partitions))},
        "status": {"$in": list(DUE_STATUSES)},
        "due_at": {"$lte": until},
    }


def partition_groups(partitions: Iterable[int]) -> list[list[int]]:
    """The partitions, sorted, in groups of at most :data:`MAX_SCANS_TO_EXPLODE`: each group's
    ``$in`` stays within the planner's merge of one index scan per partition."""
    ordered = sorted(set(partitions))
    return [ordered[i : i + MAX_SCANS_TO_EXPLODE] for i in range(0, len(ordered), MAX_SCANS_TO_EXPLODE)]


def parked_match(target: AggregateRef) -> dict[str, Any]:
    """PARKED timers of a target: equality on the parked partial index's keys and its filter."""
    return {
        "target.id": target.id,
        "target.tenant_id": target.tenant_id,
        "target.aggregate": target.aggregate,
        "target.context": target.context,
        "status": TimerStatus.PARKED.value,
    }


def parked_many_match(targets: Iterable[AggregateRef]) -> dict[str, Any]:
    """PARKED timers of any of ``targets``: one ``$or`` clause per (context, aggregate, tenant)
    of the targets, with their ids by ``$in``, over the parked partial index's keys.

    Each clause carries the index's partial filter (``status: PARKED``) itself: the manual has an
    ``$or`` use indexes only when every clause is supported by one, and a partial index only
    when the query's predicate contains its filter expression; within a clause the ids are point
    intervals on the index's first key and the other keys are equalities (a one-clause ``$or``
    is planned as its clause)."""
    groups: dict[tuple[str, str, str], set[str]] = {}
    for t in targets:
        groups.setdefault((t.context, t.aggregate, t.tenant_id), set()).add(t.id)
    return {
        "$or": [
            {
                "target.id": {"$in": sorted(ids)},
                "target.tenant_id": tenant,
                "target.aggregate": aggregate,
                "target.context": context,
                "status": TimerStatus.PARKED.value,
            }
            for (context, aggregate, tenant), ids in sorted(groups.items())
        ]
    }


def scan_match(status: TimerStatus | None, partitions: Iterable[int] | None) -> dict[str, Any]:
    """Timers of a status (a live one) or, without, every live timer (no tombstone)."""
    match: dict[str, Any] = {}
    if partitions is not None:
        match["partition"] = {"$in": sorted(set(partitions))}
    match["status"] = {"$nin": list(TOMBSTONES)} if status is None else status.value
    return match


def union_batch_size(limit: int | None) -> int | None:
    """The aggregation's ``cursor.batchSize``: one more than the most documents the pipeline can
    answer (the count document and ``limit`` timers), so the first batch ends at EOF.

    The server fills the first batch with up to ``batchSize`` documents and closes the cursor
    only when it met EOF while filling it; a batch filled exactly leaves the cursor open (id != 0)
    and the driver pays a ``getMore`` round trip that answers nothing. ``None`` (no limit: the
    parked read) keeps the server's default and reads on with ``getMore``."""
    return None if limit is None else limit + 2


def union_pipeline(
    context: str,
    collections: Mapping[str, str],
    match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    limit: int | None,
    *,
    keep_id: bool = False,
) -> list[dict[str, Any]]:
    """ONE aggregation on the registry: the count of ``context``'s collections (``{registered:
    n}``, absent when there are none), then each known collection's matching timers through
    ``$unionWith`` (``$match``, ``$sort``, ``$limit`` inside, then the owner's aggregate, which
    the document leaves to its collection), merged by ``(due_at, timer_id)``.

    The count document has no ``due_at`` and sorts first (a missing field sorts as null, before
    numbers); the final ``$limit`` keeps it with ``limit`` timers after it. A list of matches (the
    groups of :func:`partition_groups`) gives one ``$unionWith`` per collection and match.
    ``keep_id``: each timer keeps its ``_id`` (a document that cannot be decoded is then written
    back by it). More unions than :data:`MAX_UNIONS`: see :func:`union_pipelines`.
    """
    return _union_around(context, _unions(collections, match, limit, keep_id=keep_id), limit)


def union_pipelines(
    context: str,
    collections: Mapping[str, str],
    match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    limit: int | None,
    *,
    keep_id: bool = False,
) -> list[list[dict[str, Any]]]:
    """:func:`union_pipeline` in as many aggregations as keep each within the server's pipeline
    length (:data:`MAX_UNIONS` unions each; one when they fit), each with the count and the final
    sort and limit: the first ``limit`` timers of all are among the first ``limit`` of each."""
    unions = _unions(collections, match, limit, keep_id=keep_id)
    return [_union_around(context, part, limit) for part in _parts(unions)]


def _parts(unions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [unions[i : i + MAX_UNIONS] for i in range(0, len(unions), MAX_UNIONS)] or [[]]


def _unions(
    collections: Mapping[str, str],
    match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    limit: int | None,
    *,
    keep_id: bool,
) -> list[dict[str, Any]]:
    matches = [match] if isinstance(match, Mapping) else list(match)
    unions: list[dict[str, Any]] = []
    for name in sorted(collections):
        for m in matches:
            sub: list[dict[str, Any]] = [{"$match": dict(m)}, {"$sort": dict(SORT)}]
            if limit is not None:
                sub.append({"$limit": limit})
            sub.append({"$set": {"owner.aggregate": {"$literal": collections[name]}}})
            if not keep_id:
                sub.append({"$unset": "_id"})
            unions.append({"$unionWith": {"coll": name, "pipeline": sub}})
    return unions


def _union_around(context: str, unions: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    pipeline: list[dict[str, Any]] = [{"$match": {"context": context}}, {"$count": "registered"}, *unions]
    pipeline.append({"$sort": dict(SORT)})
    if limit is not None:
        pipeline.append({"$limit": limit + 1})
    return pipeline


def next_due_match(partitions: Iterable[int], after: int) -> dict[str, Any]:
    """The PENDING and FIRING timers of ``partitions`` due after ``after``: the due index's
    partial filter, point intervals on ``partition`` and a range ``(after, +inf]`` on ``due_at``
    (as :func:`due_match`, with ``$gt``)."""
    return {
        "partition": {"$in": sorted(set(partitions))},
        "status": {"$in": list(DUE_STATUSES)},
        "due_at": {"$gt": after},
    }


def next_due_pipeline(
    context: str, collections: Iterable[str], partitions: Iterable[int], after: int
) -> list[dict[str, Any]]:
    """ONE aggregation on the registry answering at most one document ``{_id: null, registered,
    next_due}``: the count of ``context``'s collections (as :func:`union_pipeline`), then through
    ``$unionWith`` each known collection's first due time after ``after`` (``$match``, ``$sort
    {due_at: 1}``, ``$limit: 1``: over the partial index ``(partition, due_at, timer_id)``, one
    index scan per partition merged in ``due_at`` order, stopped at the first key; ``$project``
    keeps ``due_at`` alone), then ``$group`` by ``null``: ``$sum`` of the count and ``$min`` of the
    due times (``$min`` ignores the count document, which has no ``due_at``; ``null`` when no
    timer matched). No input at all (no collection registered, none known) answers no document.
    More partitions than :data:`MAX_SCANS_TO_EXPLODE`: one ``$unionWith`` per collection and group.
    More unions than :data:`MAX_UNIONS`: see :func:`next_due_pipelines`.
    """
    return _next_due_around(context, _next_due_unions(collections, partitions, after))


def next_due_pipelines(
    context: str, collections: Iterable[str], partitions: Iterable[int], after: int
) -> list[list[dict[str, Any]]]:
    """:func:`next_due_pipeline` in as many aggregations as keep each within the server's
    pipeline length (:data:`MAX_UNIONS` unions each; one when they fit): the next due time is the
    least of their answers."""
    return [_next_due_around(context, part) for part in _parts(_next_due_unions(collections, partitions, after))]


def _next_due_unions(collections: Iterable[str], partitions: Iterable[int], after: int) -> list[dict[str, Any]]:
    matches = [next_due_match(group, after) for group in partition_groups(partitions)]
    unions: list[dict[str, Any]] = []
    for name in sorted(collections):
        for match in matches:
            sub: list[dict[str, Any]] = [
                {"$match": match},
                {"$sort": {"due_at": 1}},
                {"$limit": 1},
                {"$project": {"_id": 0, "due_at": 1}},
            ]
            unions.append({"$unionWith": {"coll": name, "pipeline": sub}})
    return unions


def _next_due_around(context: str, unions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"$match": {"context": context}},
        {"$count": "registered"},
        *unions,
        {"$group": {"_id": None, "registered": {"$sum": "$registered"}, "next_due": {"$min": "$due_at"}}},
    ]


# --------------------------------------------------------------------------- the store


class MongoTimerStore(MongoStore):
    """The :class:`~wowd.stores.base.TimerStore` of one context on MongoDB.

    The :class:`~wowd.stores.mongo._common.MongoStore` constructor (client or URI, database,
    ``operation_timeout``). No I/O in the constructor; ``prepare`` reads the registry, each
    type's collection is created (``ddl``) on its first put. ``drop_other_format``: a collection
    recorded in another format is dropped and re-registered (the timers are a view of the log:
    the caller resets the timer view's checkpoints) instead of refused with
    :class:`~wowd.errors.FormatError`; format 5 is upgraded in place instead.
    ``tombstone_retention``: how long a fired or cancelled timer is remembered (its ``expires_at``).
    """

    _label = "timers"  # the same label as the embedded twin: one dashboard for both backends

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        context: str,
        partitions: int,
        ddl: Ddl = Ddl.AUTO,
        sharding: MongoSharding = MongoSharding.AUTO,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
        drop_other_format: bool = False,
        tombstone_retention: timedelta = timedelta(days=7),
    ) -> None:
        self.context = validate_name(context, field="context")
        if partitions < 1:
            raise InvalidInput(f"must be >= 1, got {partitions}", field="partitions")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self.partitions = partitions
        self.ddl = Ddl(ddl)
        self.sharding = MongoSharding(sharding)
        self.drop_other_format = drop_other_format
        self.tombstone_retention = tombstone_retention
        self._retention_ms = int(tombstone_retention.total_seconds() * 1000)
        self._registry: AsyncCollection[Any] = self._db[REGISTRY]
        self._known: dict[str, str] = {}
        """Collections read by the union reads: name -> aggregate."""
        self._ready: set[str] = set()
        """Collections whose DDL this store made sure of (first put of the type)."""
        self._sharded: bool | None = None
        self._ttl_checked: set[str] = set()
        """Collections whose TTL index ``ddl=none`` looked for (once each)."""

    # ------------------------------------------------------------------ plumbing

    def collection_name(self, aggregate: str) -> str:
        return collection_name("timer", self.context, aggregate)

    def _collection(self, owner: AggregateRef) -> AsyncCollection[Any]:
        if owner.context != self.context:
            raise InvalidInput(f"{owner} is not of context {self.context!r}", field="owner.context")
        return self._db[self.collection_name(owner.aggregate)]

    def _partition(self, owner: AggregateRef) -> int:
        return owner.partition(self.partitions)

    # ------------------------------------------------------------------ registry and DDL

    async def prepare(self) -> None:
        """Reads the registry of the context and claims its format: a collection recorded in
        another format is refused (:class:`FormatError`) or, with ``drop_other_format``, dropped;
        format 5 is upgraded in place (:meth:`_upgrade`). Not bounded by one operation timeout as
        a whole: an upgrade's index build takes as long as the collection is large."""
        with self._call("prepare", bounded=False):
            await self._load_registry()

    async def _load_registry(self) -> None:
        known: dict[str, str] = {}
        with self._deadline():
            docs = await self._registry.find({"context": self.context}).to_list(None)
        for doc in docs:
            name, aggregate = str(doc["_id"]), str(doc.get("aggregate", ""))
            if doc.get("format") == TIMER_UPGRADES_FROM:
                await self._upgrade(name)
            elif doc.get("format") != TIMER_FORMAT:
                await self._other_format(name, aggregate, doc.get("format"))
                continue
            known[name] = aggregate
        self._known = known
        if self.ddl is Ddl.NONE:
            # registered in format 6 and assumed to exist: a put goes straight to its upsert. (AUTO
            # still makes sure of the indexes once: a replica may have registered the type and died
            # before creating them; VALIDATE checks them.)
            for name in sorted(set(known) - self._ready - self._ttl_checked):
                self._ttl_checked.add(name)
                if not await self._ttl_present(name):
                    log.warning(
                        "timer collection %s has no TTL index %s: its tombstones never expire (ddl=none "
                        "creates nothing and sweep is the TTL index's on MongoDB); create %s on it, or "
                        "start once with WOWD_MONGODB__DDL=auto",
                        name,
                        TTL_INDEX,
                        ttl_index_spec(),
                    )
            self._ready.update(known)

    async def _upgrade(self, name: str) -> None:
        """Format 5 -> 6 in place (the layout without tombstones): with ``ddl=auto`` creates the
        TTL index (no deadline at all: the build reads the whole collection), then records 6
        with a guarded update (``ddl=none``: the index must be there already, else
        :class:`FormatError` naming it: the record is not made without it).
        ``ddl=validate`` changes nothing and refuses. A record that moved meanwhile (another
        replica upgraded, dropped or re-registered it) is read again and checked."""
        if self.ddl is Ddl.VALIDATE:
            raise FormatError(
                f"mongodb timers: {name} is recorded in format {TIMER_UPGRADES_FROM}, this wowd needs {TIMER_FORMAT}"
                " (start once with ddl=auto to upgrade it in place)"
            )
        if self.ddl is Ddl.NONE:
            if not await self._ttl_present(name):
                raise FormatError(
                    f"mongodb timers: {name} is recorded in format {TIMER_UPGRADES_FROM}; its upgrade to "
                    f"{TIMER_FORMAT} needs the TTL index {ttl_index_spec()} (tombstones would never expire "
                    "without it), and ddl=none creates nothing: create it, or start once with "
                    "WOWD_MONGODB__DDL=auto"
                )
            self._ttl_checked.add(name)
        if self.ddl is Ddl.AUTO:
            try:
                await self._create_indexes(name, [ttl_index_spec()], log, why=f"upgrade to format {TIMER_FORMAT}")
            except OperationFailure as exc:
                if exc.code in _INDEX_CONFLICT_CODES:
                    raise FormatError(f"mongodb timers: {name} has an index of another layout: {exc}") from exc
                raise
        flt, update = registry_upgrade(name, clock.now_ms())
        with self._deadline():
            res = await self._registry.update_one(flt, update)
        if res.matched_count == 1:
            log.info("timer collection %s upgraded in place to format %d", name, TIMER_FORMAT)
            return
        with self._deadline():
            doc = await self._registry.find_one({"_id": name})
        if doc is None or doc.get("format") != TIMER_FORMAT:
            found = None if doc is None else doc.get("format")
            raise FormatError(
                f"mongodb timers: {name} moved to format {found!r} while being upgraded to {TIMER_FORMAT}"
            )

    async def _ttl_present(self, name: str) -> bool:
        """Whether the collection ``name`` has the tombstones' TTL index (:func:`ttl_index_spec`:
        its name, key and ``expireAfterSeconds``); a missing collection has none."""
        try:
            with self._deadline():
                indexes = {doc["name"]: doc async for doc in await self._db[name].list_indexes()}
        except OperationFailure as exc:
            if exc.code == 26:  # NamespaceNotFound
                return False
            raise
        spec, found = ttl_index_spec(), indexes.get(TTL_INDEX)
        return (
            found is not None
            and list(found["key"].items()) == list(spec["key"].items())
            and found.get("expireAfterSeconds") == spec["expireAfterSeconds"]
        )

    async def missing_ttl(self) -> list[str]:
        """The registered timer collections of the context that lack the tombstones' TTL index
        (their tombstones never expire: ``sweep`` is the index's on MongoDB). ``wowd check``
        names them. Read-only."""
        with self._call("missing_ttl", bounded=False):
            with self._deadline():
                docs = await self._registry.find({"context": self.context, "format": TIMER_FORMAT}).to_list(None)
            return [str(d["_id"]) for d in docs if not await self._ttl_present(str(d["_id"]))]

    async def _other_format(self, name: str, aggregate: str, found: Any) -> None:
        if not self.drop_other_format:
            raise FormatError(
                f"mongodb timers: {name} is recorded in format {found!r}, this wowd needs {TIMER_FORMAT} "
                "(start with drop_other_format to drop it and rebuild the timer view from the log)"
            )
        log.warning("dropping timer collection %s of format %r (rebuilt from the log)", name, found)
        with self._deadline():
            await self._db.drop_collection(name)
        with self._deadline():
            await self._registry.delete_one({"_id": name, "format": found})
        self._ready.discard(name)
        self._known.pop(name, None)

    async def _ensure(self, aggregate: str) -> None:
        """The type's first use in this store: registers the collection (format checked) and,
        as the DDL mode says, creates it, its indexes and its chunks."""
        name = self.collection_name(aggregate)
        if name in self._ready:
            return
        if self.ddl is Ddl.VALIDATE:
            with self._deadline():
                doc = await self._registry.find_one({"_id": name})
            if doc is None:
                raise FormatError(f"mongodb timers: {name} is not registered in {REGISTRY} (ddl=validate)")
            if doc.get("format") == TIMER_UPGRADES_FROM:
                await self._upgrade(name)  # refuses
            if doc.get("format") != TIMER_FORMAT:
                raise FormatError(
                    f"mongodb timers: {name} is recorded in format {doc.get('format')!r}, not {TIMER_FORMAT}"
                )
            await self._validate_indexes(name)
        else:
            doc, _ = await self._register(name, aggregate)
            if doc.get("format") == TIMER_UPGRADES_FROM:
                await self._upgrade(name)
            elif doc.get("format") != TIMER_FORMAT:
                await self._other_format(name, aggregate, doc.get("format"))
                doc, _ = await self._register(name, aggregate)
            if self.ddl is Ddl.AUTO:
                await self._create(name)
        self._known[name] = aggregate
        self._ready.add(name)

    async def _register(self, name: str, aggregate: str) -> tuple[dict[str, Any], bool]:
        """``findAndModify`` upsert on ``_id`` (concurrent first uses: the server retries the
        duplicate-key upsert of an ``_id`` equality itself), answering the document after it and
        whether this call inserted it (``lastErrorObject.upserted``: the type's very first use)."""
        command: dict[str, Any] = {
            "findAndModify": REGISTRY,
            "query": {"_id": name},
            "update": registry_claim(self.context, aggregate, clock.now_ms()),
            "upsert": True,
            "new": True,
        }
        write_concern = self._registry.write_concern
        if not write_concern.is_server_default:
            command["writeConcern"] = write_concern.document
        with self._deadline():
            reply = await self._db.command(command)
        doc = reply.get("value")
        assert doc is not None  # an upsert answers the document after it
        inserted = "upserted" in (reply.get("lastErrorObject") or {})
        return dict(doc), inserted

    async def _create(self, name: str) -> None:
        """``create`` (7.0+ answers ok on an existing collection of the same options, so its answer
        cannot tell a new collection) and ``createIndexes``; on a sharded cluster
        ``shardCollection`` (its chunks are spread off the write path: :meth:`spread_chunks`)."""
        try:
            with self._deadline():
                await self._db.command("create", name)
        except OperationFailure as exc:
            if exc.code != NAMESPACE_EXISTS:  # another layout (options) than a plain collection
                raise
        try:
            await self._create_indexes(name, index_specs(), log)
        except OperationFailure as exc:
            if exc.code in _INDEX_CONFLICT_CODES:
                raise FormatError(f"mongodb timers: {name} has an index of another layout: {exc}") from exc
            raise
        if await self._is_sharded():
            await self._shard(name)

    async def _validate_indexes(self, name: str) -> None:
        """Each index of :func:`index_specs` by name, with its keys *in order* (a compound index
        on the same keys in another order serves other queries), filter and uniqueness."""
        with self._deadline():  # a missing collection lists no index (PyMongo answers code 26 so)
            indexes = {doc["name"]: doc async for doc in await self._db[name].list_indexes()}
        for spec in index_specs():
            found = indexes.get(spec["name"])
            if (
                found is None
                or list(found["key"].items()) != list(spec["key"].items())
                or found.get("partialFilterExpression") != spec.get("partialFilterExpression")
                or bool(found.get("unique", False)) != bool(spec.get("unique", False))
                or found.get("expireAfterSeconds") != spec.get("expireAfterSeconds")
            ):
                raise FormatError(f"mongodb timers: {name} lacks the index {spec} (ddl=validate)")

    async def _is_sharded(self) -> bool:
        if self.sharding is MongoSharding.OFF:
            return False
        if self.sharding is MongoSharding.ON:
            return True
        if self._sharded is None:
            with self._deadline():
                hello = await self._client.admin.command("hello")
            self._sharded = hello.get("msg") == "isdbgrid"
        return self._sharded

    async def _shard(self, name: str) -> None:
        """Shards by ``{partition: 1}`` (idempotent; no ``enableSharding`` needed since 6.0). The
        collection starts as one chunk: its spread over the shards is :meth:`spread_chunks`'s,
        never on a feed batch's path. With ``sharding=auto`` a user who may not shard
        (Unauthorized) leaves the collection unsharded, logged; with ``sharding=on`` that is a
        :class:`ConfigError`."""
        await self._shard_collection(name, {"partition": 1}, self.sharding, log, what="timer", bounded=True)

    async def spread_chunks(self, *, budget: timedelta = SPREAD_BUDGET) -> dict[str, str]:
        """Spreads the chunks of each registered timer collection that still has a single chunk
        over the shards of a sharded cluster of two shards or more: ``split`` into
        :func:`spread_lowers` ranges (at most :data:`SPREAD_CHUNKS_PER_SHARD` per shard) and
        ``moveRange`` of each, round robin (MongoDB 6.0+; ``moveRange`` with ``min`` alone moves
        the whole chunk starting there while it holds less than the chunk size). A collection
        with more than one chunk is left to the balancer. All of it within ``budget`` (each
        command also within the operation timeout); what is left then is logged and left to the
        balancer. Best effort: a refused command is logged. Answers, per collection, what was
        done. Run off the feed's path (``wowd check --prepare``, a background task)."""
        done: dict[str, str] = {}
        deadline = time.monotonic() + budget.total_seconds()
        with self._call("spread_chunks", bounded=False):
            await self._load_registry()
            if self.partitions < 2 or not self._known or not await self._is_sharded():
                return done
            try:
                with self._deadline():
                    listed = await self._client.admin.command("listShards")
            except OperationFailure as exc:
                if not is_unauthorized(exc):
                    raise
                log.warning(
                    "timer chunks not spread: the user may not list the shards (%s); grant the listShards "
                    "action on the cluster resource (the clusterMonitor role has it)",
                    exc,
                )
                return {name: "not spread: listShards not allowed" for name in sorted(self._known)}
            shards = [str(s["_id"]) for s in listed.get("shards", [])]
            if len(shards) < 2:
                return {name: "one shard: nothing to spread" for name in sorted(self._known)}
            for name in sorted(self._known):
                ns = f"{self._db.name}.{name}"
                if not await self._one_chunk(ns):
                    done[name] = "left to the balancer (not a single chunk, or not sharded)"
                    continue
                done[name] = await self._spread(ns, shards, deadline)
        return done

    async def _spread(self, ns: str, shards: list[str], deadline: float) -> str:
        lowers = spread_lowers(self.partitions, len(shards))
        commands: list[tuple[str, dict[str, Any]]] = [("split", {"middle": m}) for m in split_points(lowers)]
        commands += [
            ("moveRange", {"min": lower, "toShard": shards[i % len(shards)]})
            for i, lower in enumerate(chunk_mins(lowers))
        ]
        for n, (command, options) in enumerate(commands):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "timer chunks of %s: the spread's budget is spent with %d of %d commands left (the "
                    "balancer moves chunks on its own)",
                    ns,
                    len(commands) - n,
                    len(commands),
                )
                return f"partly spread: {len(commands) - n} of {len(commands)} commands left"
            timeout = left if self._timeout is None else min(left, self._timeout)
            try:
                with pymongo.timeout(timeout):
                    await self._client.admin.command(command, ns, **options)
            except PyMongoError as exc:  # best effort: the server may still complete a timed-out move
                log.warning("%s of %s %s refused: %s", command, ns, options, exc)
        log.info("timer chunks of %s spread: %d chunks over %d shards", ns, len(lowers), len(shards))
        return f"spread: {len(lowers)} chunks over {len(shards)} shards"

    async def _one_chunk(self, ns: str) -> bool:
        """Whether the sharded collection ``ns`` still has a single chunk (``config.chunks`` by
        the collection's uuid). Best effort: a user who may not read ``config`` answers False
        (the spread is skipped, logged)."""
        config = self._client.config
        try:
            with self._deadline():
                coll = await config.collections.find_one({"_id": ns}, {"uuid": 1})
                if coll is None:
                    return False
                chunks = await config.chunks.count_documents({"uuid": coll["uuid"]}, limit=2)
        except OperationFailure as exc:
            log.warning("chunks of %s not counted (%s): their spread is skipped", ns, exc)
            return False
        return bool(chunks == 1)

    # ------------------------------------------------------------------ writes

    def _check_partition(self, timer: Timer) -> None:
        if timer.partition != self._partition(timer.owner):
            raise InvalidInput(
                f"is {timer.partition}, the owner's partition is {self._partition(timer.owner)}",
                field="partition",
            )

    async def put(self, timer: Timer) -> bool:
        return bool((await self._write([TimerWrite.put(timer)], "put"))[0])

    async def cancel(self, owner: AggregateRef, key: str, version: int) -> bool:
        return bool((await self._write([TimerWrite.cancel(owner, key, version)], "cancel"))[0])

    async def cancel_all(self, owner: AggregateRef, version: int) -> int:
        return (await self._write([TimerWrite.cancel_all(owner, version)], "cancel_all"))[0]

    async def write(self, writes: Sequence[TimerWrite]) -> list[int]:
        """One unordered bulk write per collection touched (:func:`write_operation` each). The
        answers come from the bulk's result: a put or cancel is upserted, met the unique key
        (E11000, decided by one read of those keys, :func:`write_verdict`; a key that moved is
        written again alone) or else matched (a put admitted, a live timer cancelled). A
        collection's ``cancel_all`` counts what the bulk matched beyond its single-document
        operations; with several in one collection, a count per owner is read before the bulk."""
        return await self._write(writes, "write")

    async def _write(self, writes: Sequence[TimerWrite], operation: str) -> list[int]:
        if not writes:
            return []
        groups: dict[str, list[int]] = {}
        inserting: dict[str, str] = {}
        for i, w in enumerate(writes):
            self._collection(w.owner)  # checks the context
            if w.kind == "put":
                assert w.timer is not None
                self._check_partition(w.timer)
            name = self.collection_name(w.owner.aggregate)
            groups.setdefault(name, []).append(i)
            if w.kind != "cancel_all":  # an upsert may create the collection: its DDL first
                inserting[name] = w.owner.aggregate
        for name, aggregate in inserting.items():
            if name not in self._ready:
                with self._call("ddl", bounded=False):
                    await self._ensure(aggregate)
        out = [0] * len(writes)
        with self._call(operation):
            for name, indexes in groups.items():
                answers = await self._write_collection(self._db[name], [writes[i] for i in indexes])
                for i, answer in zip(indexes, answers, strict=True):
                    out[i] = answer
        return out

    async def _write_collection(self, coll: AsyncCollection[Any], writes: list[TimerWrite]) -> list[int]:
        ops = [write_operation(w, self._partition(w.owner), self._retention_ms) for w in writes]
        alls = [j for j, w in enumerate(writes) if w.kind == "cancel_all"]
        counted = await self._count_live(coll, [writes[j] for j in alls]) if len(alls) > 1 else None
        result: Mapping[str, Any]
        try:
            result = (await coll.bulk_write(ops, ordered=False)).bulk_api_result
        except BulkWriteError as exc:
            result = exc.details
            if result.get("writeConcernErrors"):
                raise StorageUnavailable(f"mongodb timers.write: {exc}") from exc
            if any(e.get("code") != DUPLICATE_KEY for e in result.get("writeErrors", [])):
                raise
        refused = {int(e["index"]) for e in result.get("writeErrors", [])}
        upserted = {int(u["index"]) for u in result.get("upserted", [])}
        answers = [0] * len(writes)
        matched_one = 0
        conflicts: list[int] = []
        for j, w in enumerate(writes):
            if w.kind == "cancel_all":
                continue
            if j in refused:
                conflicts.append(j)
            elif j in upserted:
                answers[j] = 1 if w.kind == "put" else 0  # a cancel of nothing stored leaves a tombstone
            else:  # matched: a put admitted, a live timer cancelled
                answers[j] = 1
                matched_one += 1
        if counted is not None:
            for j in alls:
                answers[j] = counted.get((writes[j].owner.tenant_id, writes[j].owner.id), 0)
        elif alls:
            answers[alls[0]] = int(result.get("nMatched", 0)) - matched_one
        if conflicts:
            verdicts = await self._decide(coll, [writes[j] for j in conflicts])
            for j, verdict in zip(conflicts, verdicts, strict=True):
                answers[j] = verdict
        return answers

    async def _count_live(self, coll: AsyncCollection[Any], alls: list[TimerWrite]) -> dict[tuple[str, str], int]:
        """Per owner, the live timers its ``cancel_all`` is about to cancel (one aggregation)."""
        match = {"$or": [cancel_all_filter(w.owner, self._partition(w.owner), w.version) for w in alls]}
        group = {"_id": {"tenant_id": "$owner.tenant_id", "id": "$owner.id"}, "n": {"$sum": 1}}
        cursor = await coll.aggregate([{"$match": match}, {"$group": group}])
        return {(d["_id"]["tenant_id"], d["_id"]["id"]): int(d["n"]) async for d in cursor}

    async def _decide(self, coll: AsyncCollection[Any], writes: list[TimerWrite]) -> list[int]:
        """The answers of puts and cancels whose upsert met the unique key: one read of their keys,
        then, for a key that moved, the write again alone."""
        flt = {"$or": [key_filter(w.owner, self._partition(w.owner), w.key) for w in writes]}
        stored = {(d["owner"]["tenant_id"], d["owner"]["id"], d["key"]): d async for d in coll.find(flt, _KEY_FIELDS)}
        out: list[int] = []
        for w in writes:
            verdict = write_verdict(w, stored.get((w.owner.tenant_id, w.owner.id, w.key)))
            out.append(verdict if isinstance(verdict, int) else await self._write_alone(coll, w, verdict))
        return out

    async def _write_alone(self, coll: AsyncCollection[Any], w: TimerWrite, verdict: str) -> int:
        part = self._partition(w.owner)
        for _ in range(_WRITE_ATTEMPTS):
            if verdict == RAISE:
                update = tombstone_update("CANCELLED", w.version, self._retention_ms)
                res = await coll.update_one(tombstone_raise_filter(w.owner, part, w.key, w.version), update)
                if res.matched_count == 1:
                    return 0
            else:
                flt, upsert = write_update(w, part, self._retention_ms)
                try:
                    # E11000 with a write concern error: StorageUnavailable, never decided as refused
                    written = await write_one(coll, UpdateOne(flt, upsert, upsert=True), "timers.write")
                except PyMongoError as exc:
                    if not is_duplicate_key(exc):
                        raise
                else:
                    return 1 if w.kind == "put" or not written.upserted_ids else 0
            doc = await coll.find_one(key_filter(w.owner, part, w.key), _KEY_FIELDS)
            decided = write_verdict(w, doc)
            if isinstance(decided, int):
                return decided
            verdict = decided
        raise StorageUnavailable(
            f"mongodb timers.write: the timer {w.key!r} of {w.owner} kept changing under {_WRITE_ATTEMPTS} writes"
        )

    async def sweep(self, before: int, limit: int) -> int:
        """Tombstones expire by the TTL index: nothing to sweep."""
        return 0

    async def settle(self, changes: Sequence[TimerChange]) -> int:
        with self._call("settle"):
            return await self._settle(changes)

    async def _settle(self, changes: Sequence[TimerChange]) -> int:
        by_collection: dict[str, list[TimerChange]] = {}
        for change in changes:
            self._collection(change.timer.owner)  # checks the context
            by_collection.setdefault(self.collection_name(change.timer.owner.aggregate), []).append(change)
        written = 0
        for name, group in by_collection.items():
            res = await self._db[name].bulk_write(settle_operations(group, self._retention_ms), ordered=False)
            written += res.matched_count
        return written

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
        """The due read (as :meth:`due`: one match per group of :func:`partition_groups`; over-read
        by ``len(exclude)``, the excluded ids skipped), then one claim settle; when a timer moved
        between the two, the claims are confirmed by reading them back. A document the read
        cannot decode is set FAILED (:func:`fail_operation`), counted in
        ``wowd_timers_failed_total`` and logged, never raised."""
        if not partitions or limit < 1:
            return []
        skip = frozenset(exclude)
        bad: list[tuple[dict[str, Any], Exception]] = []
        with self._call("claim_due"):
            read = await self._union(
                "claim_due",
                [due_match(group, until) for group in partition_groups(partitions)],
                limit + len(skip),
                keep_id=True,
                undecodable=lambda doc, exc: bad.append((doc, exc)),
            )
            if bad:
                await self._fail_undecodable(bad)
            due = [t for t in read if t.timer_id not in skip][:limit]
            if not due:
                return []
            claims = [TimerChange.claim(t, owner_key=owner_key, fence=fence, until=claim_until) for t in due]
            written = await self._settle(claims)
            claimed = [t for c in claims if (t := c.applied()) is not None]
            if written < len(claims):
                claimed = await self._confirm(claimed) if written else []
        return claimed

    async def _confirm(self, claimed: list[Timer]) -> list[Timer]:
        """After a partial claim: the timers whose stored document is the claim written."""
        mine: list[Timer] = []
        for t in claimed:
            coll = self._collection(t.owner)
            doc = await coll.find_one(settle_filter(t))  # the claim's timer at its revision
            if doc is not None:
                stored = timer_from_doc(doc, context=self.context, aggregate=t.owner.aggregate)
                if stored.status is TimerStatus.FIRING and stored.claim == t.claim:
                    mine.append(stored)
        return mine

    async def _fail_undecodable(self, bad: list[tuple[dict[str, Any], Exception]]) -> None:
        by_collection: dict[str, list[tuple[dict[str, Any], str]]] = {}
        for doc, error in bad:
            owner = doc.get("owner")
            aggregate = str(owner.get("aggregate", "")) if isinstance(owner, Mapping) else ""
            reason = f"undecodable timer: {type(error).__name__}: {error}"
            by_collection.setdefault(aggregate, []).append((doc, reason))
        for aggregate, group in by_collection.items():
            try:
                await self._db[self.collection_name(aggregate)].bulk_write(
                    [fail_operation(doc, reason) for doc, reason in group], ordered=False
                )
            except BulkWriteError as exc:
                if exc.details.get("writeConcernErrors"):
                    raise StorageUnavailable(f"mongodb timers.claim_due: {exc}") from exc
                log.error("timers of %s not set FAILED: %s", aggregate, exc.details.get("writeErrors"))
            for doc, reason in group:
                TIMERS_FAILED.labels(aggregate=aggregate).inc()
                log.error(
                    "timer %s of %s (partition %s, _id %s) set FAILED: %s",
                    doc.get("key"),
                    aggregate,
                    doc.get("partition"),
                    doc.get("_id"),
                    reason,
                )

    async def reclaim(self, partitions: set[int] | frozenset[int], fence: int) -> int:
        """One ``updateMany`` per collection of the context (the registry read first: a type
        another replica registered is reclaimed too)."""
        if not partitions:
            return 0
        n = 0
        with self._call("reclaim"):
            await self._load_registry()
            for name in sorted(self._known):
                res = await self._db[name].update_many(reclaim_filter(partitions, fence), reclaim_update())
                n += res.modified_count
        return n

    # ------------------------------------------------------------------ reads

    async def find(self, owner: AggregateRef, key: str) -> Timer | None:
        coll = self._collection(owner)
        with self._call("find"):
            doc = await coll.find_one(live_filter(owner, self._partition(owner), key))
        return None if doc is None else timer_from_doc(doc, context=self.context, aggregate=owner.aggregate)

    async def due(self, partitions: set[int] | frozenset[int], until: int, limit: int) -> list[Timer]:
        if not partitions or limit < 1:
            return []
        with self._call("due"):
            matches = [due_match(group, until) for group in partition_groups(partitions)]
            return await self._union("due", matches, limit)

    async def next_due(self, partitions: set[int] | frozenset[int], after: int) -> int | None:
        """One :func:`next_due_pipeline` aggregation (or as many as :func:`next_due_pipelines`
        needs); when the registry counts another number of the context's collections than the
        known ones, reloads the registry and reads again."""
        if not partitions:
            return None
        with self._call("next_due"):
            for attempt in range(_MAX_RELOADS + 1):
                known = dict(self._known)
                registered, found = 0, None
                for pipeline in next_due_pipelines(self.context, known, partitions, after):
                    cursor = await self._registry.aggregate(pipeline)
                    docs = await cursor.to_list(None)
                    registered = max(registered, int(docs[0].get("registered") or 0) if docs else 0)
                    due = docs[0].get("next_due") if docs else None
                    if due is not None and (found is None or due < found):
                        found = due
                if registered == len(known) or attempt == _MAX_RELOADS:
                    if registered != len(known):
                        log.warning(
                            "timers next_due: the registry still counts %d collections of %s, %d read",
                            registered,
                            self.context,
                            len(known),
                        )
                    return None if found is None else int(found)
                log.info(
                    "timers next_due: registry counts %d collections of %s, %d known: reloading",
                    registered,
                    self.context,
                    len(known),
                )
                await self._load_registry()
        raise AssertionError("unreachable")  # pragma: no cover

    async def parked(self, target: AggregateRef) -> list[Timer]:
        with self._call("parked"):
            return await self._union("parked", parked_match(target), None)

    async def parked_many(self, targets: Sequence[AggregateRef]) -> list[Timer]:
        """One :func:`union_pipeline` aggregation of :func:`parked_many_match` (as :meth:`parked`,
        the server's default first batch, read on by ``getMore``), split only where the pipeline
        (the match once per collection) would not fit in one command."""
        unique = list(dict.fromkeys(targets))
        if not unique:
            return []
        with self._call("parked_many"):

            def command(part: Sequence[AggregateRef]) -> dict[str, Any]:
                return {"pipeline": union_pipeline(self.context, self._known, parked_many_match(part), None)}

            parts = split_to_fit(unique, command)
            timers = [t for part in parts for t in await self._union("parked", parked_many_match(part), None)]
        if len(parts) > 1:  # each part in order; a timer has one target, so it is in one part
            timers.sort(key=lambda t: (t.due_at, t.timer_id))
        return timers

    async def scan(
        self, *, status: TimerStatus | None = None, limit: int = 100, partitions: set[int] | None = None
    ) -> list[Timer]:
        if limit < 1:
            return []
        with self._call("scan"):
            return await self._union("scan", scan_match(status, partitions), limit)

    async def _union(
        self,
        operation: str,
        match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        limit: int | None,
        *,
        keep_id: bool = False,
        undecodable: Callable[[dict[str, Any], Exception], None] | None = None,
    ) -> list[Timer]:
        """Runs :func:`union_pipelines` over the known collections; when the registry counts
        another number of the context's collections, reloads the registry and reads again.
        ``undecodable``: a document that cannot be decoded is given to it and skipped (else the
        read raises)."""
        for attempt in range(_MAX_RELOADS + 1):
            known = dict(self._known)
            bad: list[tuple[dict[str, Any], Exception]] = []
            batch = union_batch_size(limit)
            kwargs: dict[str, Any] = {} if batch is None else {"batchSize": batch}
            docs: list[dict[str, Any]] = []
            for pipeline in union_pipelines(self.context, known, match, limit, keep_id=keep_id):
                cursor = await self._registry.aggregate(pipeline, **kwargs)
                docs.extend(await cursor.to_list(None))
            registered = 0
            timers: list[Timer] = []
            for doc in docs:
                if "registered" in doc and "timer_id" not in doc:
                    registered = max(registered, int(doc["registered"]))
                    continue
                if undecodable is None:
                    aggregate = str(doc.get("owner", {}).get("aggregate", ""))
                    timers.append(timer_from_doc(doc, context=self.context, aggregate=aggregate))
                    continue
                try:
                    aggregate = str(doc["owner"]["aggregate"])
                    timers.append(timer_from_doc(doc, context=self.context, aggregate=aggregate))
                except Exception as exc:  # a document this version cannot read: the caller fails it
                    bad.append((doc, exc))
            if registered == len(known) or attempt == _MAX_RELOADS:
                if undecodable is not None:
                    for doc, error in bad:
                        undecodable(doc, error)
                if registered != len(known):
                    log.warning(
                        "timers %s: the registry still counts %d collections of %s, %d read",
                        operation,
                        registered,
                        self.context,
                        len(known),
                    )
                timers.sort(key=lambda t: (t.due_at, t.timer_id))
                return timers if limit is None else timers[:limit]
            log.info(
                "timers %s: registry counts %d collections of %s, %d known: reloading",
                operation,
                registered,
                self.context,
                len(known),
            )
            await self._load_registry()
        raise AssertionError("unreachable")  # pragma: no cover
