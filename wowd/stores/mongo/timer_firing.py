"""The due timers of one context on MongoDB (:class:`~wowd.stores.base.TimerFiring`): the timer
loop's reads, claims and settles. The documents each method sends are built by the pure functions
next to it (the black-pipe tests assert them on the wire)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from pymongo import UpdateOne
from pymongo.errors import BulkWriteError

from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    Timer,
    TimerChange,
    TimerStatus,
)
from wowd.stores.mongo._common import (
    durable_or_raise,
    split_to_fit,
)
from wowd.stores.mongo.schema import DUE_STATUSES
from wowd.stores.mongo.timer_docs import (
    MAX_RELOADS,
    TimerDocuments,
    key_filter,
    timer_from_doc,
    timer_to_doc,
    tombstone_update,
    union_parts,
)

MAX_SCANS_TO_EXPLODE = 200
"""The server's ``internalQueryMaxScansToExplode``: above this many point intervals (partitions
of one ``$in``) the planner stops merging one index scan per partition and sorts the whole
match instead; the due reads split the partitions into groups of at most this many."""

log = logging.getLogger(__name__)


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
    return [_next_due_around(context, part) for part in union_parts(_next_due_unions(collections, partitions, after))]


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


class MongoTimerFiring(TimerDocuments):
    """:class:`~wowd.stores.base.TimerFiring` on MongoDB (the constructor of
    :class:`~wowd.stores.mongo.timer_docs.TimerDocuments`)."""

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
        """After a partial claim: the timers whose stored document is the claim written, read
        back in one ``find`` per collection (a ``$or`` of the claims' :func:`settle_filter`,
        each over the unique index). A tombstone at the claim's revision (a cancel that won the
        race raised the revision as the claim would have) is not a claim: skipped, not decoded."""
        by_collection: dict[str, list[Timer]] = {}
        for t in claimed:
            by_collection.setdefault(self.collection_name(t.owner.aggregate), []).append(t)
        mine: list[Timer] = []
        for name, group in by_collection.items():
            wanted: dict[tuple[Any, Any, Any], Timer] = {(t.owner.tenant_id, t.owner.id, t.key): t for t in group}
            for part in split_to_fit(group, lambda ts: {"$or": [settle_filter(t) for t in ts]}):
                async for doc in self._db[name].find({"$or": [settle_filter(t) for t in part]}):
                    owner = doc.get("owner") or {}
                    asked = wanted.get((owner.get("tenant_id"), owner.get("id"), doc.get("key")))
                    if asked is None or doc.get("status") != TimerStatus.FIRING.value:
                        continue
                    stored = timer_from_doc(doc, context=self.context, aggregate=asked.owner.aggregate)
                    if stored.claim == asked.claim:
                        mine.append(stored)
        order = {t.timer_id: i for i, t in enumerate(claimed)}
        return sorted(mine, key=lambda t: order.get(t.timer_id, len(order)))

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
                durable_or_raise(exc, "timers.claim_due")
                log.error("timers of %s not set FAILED: %s", aggregate, exc.details.get("writeErrors"))
            for doc, reason in group:
                target = doc.get("target")
                if isinstance(target, Mapping):
                    TIMERS_FAILED.labels(target=f"{target.get('context')}.{target.get('aggregate')}").inc()
                else:
                    TIMERS_FAILED.labels(target="unknown").inc()
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
            for attempt in range(MAX_RELOADS + 1):
                known = dict(self._known)
                registered, found = 0, None
                for pipeline in next_due_pipelines(self.context, known, partitions, after):
                    cursor = await self._registry.aggregate(pipeline)
                    docs = await cursor.to_list(None)
                    registered = max(registered, int(docs[0].get("registered") or 0) if docs else 0)
                    due = docs[0].get("next_due") if docs else None
                    if due is not None and (found is None or due < found):
                        found = due
                if registered == len(known) or attempt == MAX_RELOADS:
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

    async def sweep(self, before: int, limit: int) -> int:
        """Tombstones expire by the TTL index: nothing to sweep."""
        return 0
