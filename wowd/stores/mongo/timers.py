"""The timers of one context on MongoDB (docs/concepts.md).

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
are outside the due and parked indexes and every read filters them out. The registry, the DDL and
the format's upgrade are :mod:`wowd.stores.mongo.timer_schema`'s (the store's base).

Times (``due_at``, ``scheduled_at``, ``claim.until``) are int64 milliseconds since the epoch.
``body`` is the command's JSON text; ``rule`` the subdocument Wow's JSON writes.

Every filter by owner carries the owner's partition (the shard key), so on a sharded cluster the
reads and writes by owner reach one shard. The documents each method sends are built by the pure
functions next to it (the black-pipe tests assert them on the wire).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from pymongo import AsyncMongoClient, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, PyMongoError

from wowd.errors import InvalidInput, StorageUnavailable
from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    AggregateRef,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
)
from wowd.stores.base import Ddl, TimerSearch
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    MongoSharding,
    duplicate_keys,
    durable_or_raise,
    is_duplicate_key,
    split_to_fit,
    write_one,
)
from wowd.stores.mongo.timer_queries import (
    _KEY_FIELDS,
    _MAX_RELOADS,
    _WRITE_ATTEMPTS,
    RAISE,
    REGISTRY,
    cancel_all_filter,
    due_match,
    fail_operation,
    key_filter,
    live_filter,
    next_due_pipelines,
    parked_many_match,
    parked_match,
    partition_groups,
    reclaim_filter,
    reclaim_update,
    scan_match,
    search_match,
    settle_filter,
    settle_operations,
    timer_from_doc,
    tombstone_raise_filter,
    tombstone_update,
    union_batch_size,
    union_pipeline,
    union_pipelines,
    write_operation,
    write_update,
    write_verdict,
)
from wowd.stores.mongo.timer_schema import TimerCollections

log = logging.getLogger(__name__)

__all__ = ["MongoTimerStore"]


class MongoTimerStore(TimerCollections):
    """The :class:`~wowd.stores.base.TimerStore` of one context on MongoDB.

    The :class:`~wowd.stores.mongo._common.MongoStore` constructor (client or URI, database,
    ``operation_timeout``). No I/O in the constructor; ``prepare`` reads the registry, each
    type's collection is created (``ddl``) on its first put. ``drop_other_format``: a collection
    recorded in another format is dropped and re-registered (the timers are a view of the log:
    the caller resets the timer view's checkpoints) instead of refused with
    :class:`~wowd.errors.FormatError`; format 5 is upgraded in place instead.
    ``tombstone_retention``: how long a fired or cancelled timer is remembered (its ``expires_at``).
    ``kind`` and ``registry``: the collections' ``wow_<kind>__...`` names and their registry (a
    timer view rebuild writes its shadow view through a store of other names).
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
        kind: str = "timer",
        registry: str = REGISTRY,
    ) -> None:
        super().__init__(
            client_or_uri,
            database_name,
            context=context,
            partitions=partitions,
            ddl=ddl,
            sharding=sharding,
            operation_timeout=operation_timeout,
            drop_other_format=drop_other_format,
            kind=kind,
            registry=registry,
        )
        self.tombstone_retention = tombstone_retention
        self._retention_ms = int(tombstone_retention.total_seconds() * 1000)

    # ------------------------------------------------------------------ plumbing

    def _collection(self, owner: AggregateRef) -> AsyncCollection[Any]:
        if owner.context != self.context:
            raise InvalidInput(f"{owner} is not of context {self.context!r}", field="owner.context")
        return self._db[self.collection_name(owner.aggregate)]

    def _partition(self, owner: AggregateRef) -> int:
        return owner.partition(self.partitions)

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

    async def search(self, query: TimerSearch, limit: int) -> list[Timer]:
        """One union read of :func:`search_match`; an owner's timers are those of its aggregate's
        collection (the documents leave the aggregate to it)."""
        match = search_match(query, self.partitions)
        if limit < 1:
            return []
        with self._call("search"):
            found = await self._union("search", match, limit)
        if query.owners:
            found = [t for t in found if t.owner in query.owners]
        return found

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
