"""The view of the timers of one context the feed writes on MongoDB (:class:`~wowd.stores.base.TimerView`):
one unordered bulk write per collection touched. The documents each method sends are built by the
pure functions next to it (the black-pipe tests assert them on the wire)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pymongo import UpdateMany, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, PyMongoError

from wowd.errors import StorageUnavailable
from wowd.model import (
    AggregateRef,
    Timer,
    TimerStatus,
    TimerWrite,
)
from wowd.stores.mongo._common import (
    duplicate_keys,
    is_duplicate_key,
    split_to_fit,
    write_one,
)
from wowd.stores.mongo.schema import TOMBSTONES
from wowd.stores.mongo.timer_docs import (
    TimerDocuments,
    key_filter,
    owner_filter,
    timer_to_doc,
    tombstone_update,
    union_pipeline,
)

_WRITE_ATTEMPTS = 3
"""Upserts of one put or cancel whose E11000 met a key that moved (a racing insert, an expiry)."""

log = logging.getLogger(__name__)


_KEY_FIELDS = {"_id": 0, "partition": 1, "owner": 1, "key": 1, "version": 1, "status": 1}
"""The projection of the read that decides an upsert that met the unique key."""


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


class MongoTimerView(TimerDocuments):
    """:class:`~wowd.stores.base.TimerView` on MongoDB (the constructor of
    :class:`~wowd.stores.mongo.timer_docs.TimerDocuments`)."""

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
            duplicate_keys(exc, "timers.write")  # a put refused by a later version or a tombstone
            result = exc.details
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
