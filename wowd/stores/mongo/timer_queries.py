"""The documents the MongoDB timer store sends: pure builders of its filters, updates, pipelines
and index specs, and the codec of a timer document (the black-pipe tests assert them on the
wire)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from bson.min_key import MinKey
from pymongo import UpdateMany, UpdateOne

from wowd.errors import InvalidInput, StorageError
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    Claim,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
    parse_rule,
)
from wowd.stores.base import TimerSearch
from wowd.stores.mongo._common import (
    TIMER_FORMAT,
    TIMER_REGISTRY,
    TIMER_UPGRADES_FROM,
)

__all__ = [
    "MAX_UNIONS",
    "PIPELINE_LENGTH_LIMIT",
    "REGISTRY",
    "cancel_all_filter",
    "cancel_filter",
    "due_match",
    "fail_operation",
    "index_specs",
    "search_match",
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
    "settle_update",
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


TOMBSTONE_DROPS = ["claim", "body", "target", "rule", "last_error"]
"""What a tombstone does not keep: it answers for its key and version only (the command's body,
up to ``timers.max_body_bytes``, would otherwise be kept for the whole retention)."""


def tombstone_update(status: str, version: int | None, retention_ms: int) -> list[dict[str, Any]]:
    """The update (a pipeline) that makes the matched or upserted document a tombstone: ``status``,
    at ``version`` (``None``: the version it has), ``expires_at`` = the server's ``$$NOW`` + the
    retention (``$add`` of a Date and milliseconds is a Date: what a TTL index reads), revision +
    1 (0 for an inserted tombstone), and nothing of :data:`TOMBSTONE_DROPS` (no claim, command,
    target or rule): a small document."""
    fields: dict[str, Any] = {"status": status}
    if version is not None:
        fields["version"] = {"$literal": version}
    fields["expires_at"] = {"$add": ["$$NOW", retention_ms]}
    fields["revision"] = {"$add": [{"$ifNull": ["$revision", -1]}, 1]}
    return [{"$set": fields}, {"$unset": list(TOMBSTONE_DROPS)}]


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


def settle_update(before: Timer, after: Timer) -> dict[str, Any]:
    """The update of a settle: ``$set`` of the fields ``after`` changes (each top-level field
    whole, as :func:`timer_to_doc` writes it), ``$unset`` of those it no longer has. An update,
    not a replacement: the oplog holds the fields written, not the whole document (the command's
    body among them), so claims and settles do not eat into the oplog window the feed reads."""
    old, new = timer_to_doc(before), timer_to_doc(after)
    update: dict[str, Any] = {"$set": {k: v for k, v in new.items() if old.get(k, _ABSENT) != v}}
    removed = {k: "" for k in old if k not in new}
    if removed:
        update["$unset"] = removed
    return update


_ABSENT = object()


def settle_operations(changes: Iterable[TimerChange], retention_ms: int) -> list[UpdateOne]:
    """One operation per change: the fields :meth:`TimerChange.applied` changes
    (:func:`settle_update`), or (a fired timer with no next occurrence) its DONE tombstone at its
    version."""
    ops: list[UpdateOne] = []
    for change in changes:
        after = change.applied()
        flt = settle_filter(change.timer)
        if after is None:
            ops.append(UpdateOne(flt, tombstone_update("DONE", None, retention_ms)))
        else:
            ops.append(UpdateOne(flt, settle_update(change.timer, after)))
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


MAX_EXPLODED_SCANS = 200
"""The planner's ``internalQueryMaxScansToExplode``: the most point intervals it merges in order."""


def search_match(query: TimerSearch, partitions: int) -> dict[str, Any]:
    """The live timers of a :class:`~wowd.stores.base.TimerSearch` (its cursor included): the
    owners' unique-index keys, the status (PARKED and FAILED ones for a target search; PENDING and
    FIRING ones with every partition as the due index's points), the target (the parked index's
    keys), the due range."""
    clauses: list[dict[str, Any]] = []
    if query.owners:
        clauses.append({"$or": [owner_filter(o, o.partition(partitions)) for o in query.owners]})
    if query.key is not None:
        clauses.append({"key": query.key})
    statuses = [s.value for s in query.statuses()]
    if not query.owners and set(statuses) <= set(DUE_STATUSES) and partitions <= MAX_EXPLODED_SCANS:
        # the due index's partial filter and its first key by points: one scan per partition,
        # merged in due order (as :func:`due_match` explains)
        clauses.append({"partition": {"$in": list(range(partitions))}, "status": {"$in": list(DUE_STATUSES)}})
    clauses.append({"status": statuses[0] if len(statuses) == 1 else {"$in": statuses}})
    if query.target is not None:
        t = query.target
        clauses.append(
            {
                "target.id": t.id,
                "target.tenant_id": t.tenant_id,
                "target.aggregate": t.aggregate,
                "target.context": t.context,
            }
        )
    due: dict[str, int] = {}
    if query.due_from is not None:
        due["$gte"] = query.due_from
    if query.due_until is not None:
        due["$lte"] = query.due_until
    if due:
        clauses.append({"due_at": due})
    if query.after is not None:
        at, tid = query.after
        clauses.append({"$or": [{"due_at": {"$gt": at}}, {"due_at": at, "timer_id": {"$gt": tid}}]})
    return clauses[0] if len(clauses) == 1 else {"$and": clauses}


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
