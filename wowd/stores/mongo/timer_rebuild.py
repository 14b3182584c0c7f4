"""A rebuild of the timer view on MongoDB (:class:`~wowd.stores.base.TimerViewRebuild`, driven by
:mod:`wowd.daemon.timer_rebuild`): shadow collections beside the live ones, renamed in while the
slots are held.

- **Lock.** One document per context in ``wow_timer_rebuild`` (``{_id: context, owner,
  startedAt, expiresAt}``, times on the store clock): a second rebuild is refused while the
  document is another live owner's. The owner renews it as it goes; an owner of this host whose
  process is gone (a rebuild killed) holds nothing.
- **Shadow.** ``wow_timer_shadow__<context>__<aggregate>``, registered in
  ``wow_timer_shadow_aggregate``: a :class:`~wowd.stores.mongo.timer_view.MongoTimerView` of
  those names (the same indexes and sharding), dropped and made anew by
  :meth:`MongoTimerRebuild.begin`.
- **Replay.** The context's log from its start (every partition, in log order per aggregate:
  :meth:`~wowd.stores.base.Log.read`) through the projection into the shadow, written with the
  timer view's own writes, until every partition's read has passed the majority commit point
  taken before it.
- **Changes.** From before the first carry-over, a change stream on the live timer collections
  records the ``_id`` of every timer written meanwhile (:meth:`MongoTimerRebuild.changes`): the
  finish carries those again, not the whole old view.
- **Carry-over.** Every document of the old view replaces the shadow's document of its key when
  its version is the same or later (tombstones, attempts, PARKED and FAILED and their reasons,
  claims, revisions, recurring timers' occurrences); a key the shadow does not hold is copied; a
  shadow document of a later version takes a revision past the old one's (a late settle of a
  claim of the old document then writes nothing).
  One-shot timers the outbox holds an entry of become DONE tombstones; one-shot timers due before
  the tombstone retention become FAILED as "expired, state unknown" (unless asked to fire them).
- **Swap.** While the slots are held (no replica works on them: the leases'
  :class:`~wowd.stores.base.SlotHold`), the shadow catches up to the log's head (what the feed
  applied since the replay), the old view's documents written since the carry-over (the change
  stream's) are carried again, and
  each shadow collection is renamed over its live collection (``renameCollection`` with
  ``dropTarget``: one atomic step per collection) and recorded in the live registry. A rebuild
  killed at any point leaves the live view as it was (its hold lapses).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pymongo
from pymongo import ReplaceOne, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from wowd import clock
from wowd.errors import LeaseLost, StorageError
from wowd.fmt import iso_ms
from wowd.model import Position, TimerStatus, request_id_for
from wowd.stores.base import Log, Projection
from wowd.stores.mongo._common import MongoStore, duplicate_keys, outbox_collection
from wowd.stores.mongo.log_read import cluster_time_command, cluster_time_of
from wowd.stores.mongo.schema import LOCK_COLLECTION, SHADOW_KIND, SHADOW_REGISTRY, TOMBSTONES, registry_claim
from wowd.stores.mongo.timer_docs import TimerDocuments
from wowd.stores.mongo.timer_view import MongoTimerView
from wowd.stores.timer_rebuild import (
    EXPIRED_LISTED,
    EXPIRED_REASON,
    Expired,
    Finished,
    RebuildRunning,
    lock_gone,
    lock_owner,
)

__all__ = [
    "BATCH",
    "REPLAY_BATCH",
    "Changes",
    "MongoTimerRebuild",
    "carry_operation",
    "revision_past",
    "lock_filter",
    "lock_update",
]

log = logging.getLogger(__name__)

BATCH = 200
"""Documents read or written per command by the carry-over and the outbox's look-up (small
commands: the replicas' lease renewals and deliveries go on beside them)."""
REPLAY_BATCH = 500
"""Commits read per batch of the replay, whose timer writes go in one bulk per collection: a
rebuild shares the server with the replicas, whose lease renewals must not wait behind it."""


def _key_of(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The filter of the key of the timer document ``doc``: the unique index's fields
    (``partition`` is the shard key)."""
    owner = doc.get("owner") or {}
    return {
        "partition": doc.get("partition"),
        "owner.tenant_id": owner.get("tenant_id"),
        "owner.id": owner.get("id"),
        "key": doc.get("key"),
    }


def carry_operation(doc: Mapping[str, Any]) -> ReplaceOne[Any]:
    """The old view's document ``doc`` in place of the shadow's document of its key when that
    one's version is the same or lower, or as a new document when the shadow holds none (an
    upsert; a key whose shadow document is of a later version answers a duplicate key, which
    keeps the shadow's)."""
    flt = {**_key_of(doc), "version": {"$lte": doc.get("version")}}
    return ReplaceOne(flt, {k: v for k, v in doc.items() if k != "_id"}, upsert=True)


def revision_past(doc: Mapping[str, Any]) -> UpdateOne:
    """The shadow's document of the key of the old view's ``doc``, of a later version (a commit
    the replay read before the feed applied it), given a revision past ``doc``'s: a claim of
    ``doc``, settled after the swap under the revision it was claimed at, then finds the newer
    document moved on and writes nothing (a cancel the replay read stays a cancel)."""
    revision = int(doc.get("revision") or 0)
    flt = {**_key_of(doc), "version": {"$gt": doc.get("version")}, "revision": {"$lte": revision}}
    return UpdateOne(flt, {"$set": {"revision": revision + 1}})


def lock_filter(context: str, owner: str) -> dict[str, Any]:
    """The lock of ``context`` when ``owner`` holds it or it has expired (store clock)."""
    return {"_id": context, "$or": [{"owner": owner}, {"$expr": {"$lte": ["$expiresAt", "$$NOW"]}}]}


def lock_update(owner: str, ttl_ms: int) -> list[dict[str, Any]]:
    return [
        {
            "$set": {
                "owner": {"$literal": owner},
                "startedAt": {"$cond": [{"$eq": ["$owner", {"$literal": owner}]}, "$startedAt", "$$NOW"]},
                "expiresAt": {"$add": ["$$NOW", ttl_ms]},
            }
        }
    ]


class Changes:
    """The ``_id`` of every live timer document written since :meth:`MongoTimerRebuild.changes`
    opened (by collection), filled by a change stream."""

    def __init__(self) -> None:
        self.ids: dict[str, set[Any]] = {}
        self._seen: set[str] = set()
        self._marked = anyio.Event()

    def _record(self, change: Mapping[str, Any], lock: str) -> None:
        ns = change.get("ns") or {}
        coll = ns.get("coll")
        if coll == lock:
            marker = ((change.get("updateDescription") or {}).get("updatedFields") or {}).get("marker")
            if isinstance(marker, str):
                self._seen.add(marker)
                self._marked.set()
            return
        key = (change.get("documentKey") or {}).get("_id")
        if isinstance(coll, str) and key is not None:
            self.ids.setdefault(coll, set()).add(key)

    async def seen(self, marker: str) -> None:
        """Returns once the stream has passed ``marker`` (a write of the lock made after the
        writes to wait for)."""
        while marker not in self._seen:
            self._marked = anyio.Event()
            if marker in self._seen:
                return
            await self._marked.wait()


class MongoTimerRebuild(MongoStore):
    """The shadow collections, their lock, their replay and their swap (module docstring), on
    the client of ``timers`` (the live view), replaying ``log`` through ``project``; only
    ``aggregate``'s timers rebuilt when given."""

    _label = "timer_rebuild"
    shadow = "the shadow collections wow_timer_shadow__*"
    holds_slots = True
    pause = "the slots held"

    def __init__(
        self,
        timers: TimerDocuments,
        log: Log,
        *,
        database_name: str,
        project: Projection,
        aggregate: str | None,
        owner: str | None = None,
    ) -> None:
        super().__init__(timers.client, database_name, operation_timeout=timers.operation_timeout)
        self._timers = timers
        self._log = log
        self._project = project
        self._aggregate = aggregate
        self.context = timers.context
        self.owner = owner or lock_owner()
        self.shadow_view = MongoTimerView(
            timers.client,
            database_name,
            context=timers.context,
            partitions=timers.partitions,
            sharding=timers.sharding,
            operation_timeout=timers.operation_timeout,
            tombstone_retention=timers.tombstone_retention,
            kind=SHADOW_KIND,
            registry=SHADOW_REGISTRY,
        )
        self._lock = self._db[LOCK_COLLECTION]
        self._shadow_registry = self._db[SHADOW_REGISTRY]
        self._positions: dict[int, Position | None] = dict.fromkeys(range(timers.partitions))
        self._changes: Changes | None = None

    # ---- the lock

    async def acquire(self, ttl_s: float) -> None:
        """Takes the lock for ``ttl_s``; raises :class:`RebuildRunning` naming its holder when
        another live rebuild holds it (one of this host whose process is gone holds nothing)."""
        ttl = int(ttl_s * 1000)
        with self._call("acquire"):
            try:
                await self._lock.update_one(
                    lock_filter(self.context, self.owner), lock_update(self.owner, ttl), upsert=True
                )
                return
            except DuplicateKeyError:
                doc = await self._lock.find_one({"_id": self.context})
            if doc is not None and lock_gone(str(doc.get("owner"))):
                await self._lock.delete_one({"_id": self.context, "owner": doc.get("owner")})
                await self._lock.update_one(
                    lock_filter(self.context, self.owner), lock_update(self.owner, ttl), upsert=True
                )
                return
        held = "" if doc is None else f": lock held by {doc.get('owner')} since {_date(doc.get('startedAt'))}"
        until = "" if doc is None else f", until {_date(doc.get('expiresAt'))} unless renewed"
        raise RebuildRunning(
            f"a rebuild of the timer view of context {self.context!r} runs{held}{until} (wait for it to end)"
        )

    async def renew(self, ttl_s: float) -> None:
        """Extends the lock; raises :class:`LeaseLost` when another rebuild took it."""
        with self._call("renew"):
            res = await self._lock.update_one(
                {"_id": self.context, "owner": self.owner}, lock_update(self.owner, int(ttl_s * 1000))
            )
        if res.matched_count == 0:
            raise LeaseLost(f"the timer view rebuild's lock of context {self.context!r} was taken by another rebuild")

    async def release(self) -> None:
        """Deletes the lock if this rebuild holds it."""
        with self._call("release"):
            await self._lock.delete_one({"_id": self.context, "owner": self.owner})

    # ---- the shadow

    async def begin(self) -> None:
        """New, empty shadow collections (the leftovers of an interrupted rebuild are dropped);
        the commits to replay are not counted (``None``)."""
        await self.drop_shadow()
        await self.shadow_view.prepare()
        self._positions = dict.fromkeys(range(self._timers.partitions))

    async def replay(self, *, batch_size: int | None = None, workers: int | None = None) -> AsyncIterator[int]:
        """The log from its start into the shadow until every partition's read has passed the
        majority commit point taken now (:meth:`_replay`); ``workers`` aside (one process)."""
        async for n in self._replay(await self.majority_time_ms(), batch_size or REPLAY_BATCH):
            yield n

    async def _replay(self, bound_ms: int, batch_size: int) -> AsyncIterator[int]:
        """The log after the positions read so far into the shadow until every partition's read
        has passed ``bound_ms`` (a watermark at or past it: every commit before it was read) or
        the read is at the log's head, whichever first (producers go on appending meanwhile);
        the positions move on. Yields the commits read after each batch is written."""
        positions = self._positions
        everyone = frozenset(positions)
        passed: set[int] = set()
        batches = self._log.read(dict(positions), batch_size=batch_size, follow=False)
        try:
            async for batch in batches:
                positions.update(batch.positions)
                writes = self._project([e for e in batch.entries if e.commit is not None])
                if writes:
                    await self.shadow_view.write(writes)
                yield len(batch.entries)
                if batch.watermark is not None and batch.watermark >= bound_ms:
                    passed |= batch.covers if batch.covers is not None else everyone
                    if passed >= everyone:
                        break
        finally:
            await batches.aclose()  # type: ignore[attr-defined]

    @asynccontextmanager
    async def finishing(self, *, expired_before: int | None, result: Finished) -> AsyncIterator[None]:
        """A change stream on the live timer collections opened first (:meth:`changes`), then,
        the replicas going on: one-shot timers due before ``expired_before`` FAILED as expired,
        those the outbox holds DONE tombstones, the old view carried over (:meth:`carry`); the
        stream records what the old view is written until the block ends."""
        async with self.changes(self.context) as changes:
            self._changes = changes
            if expired_before is not None:
                await self.expire(expired_before)
            await self.outbox_fired(result)
            names = await self.live_names(self._aggregate)
            result.old_view = await self.old_view_exists(names)
            await self.carry(names, result)
            try:
                yield
            finally:
                self._changes = None

    async def finish(self, *, swap: bool, result: Finished, tick: Callable[[], Awaitable[None]]) -> None:
        """With the slots held: the shadow catches up to the log's head (the majority commit
        point taken now), the old view's documents written since the carry-over are carried
        again (the change stream's, once it passed a marker written now), the outbox looked at
        again, the new view counted, and each shadow collection renamed over its live one (a
        dry run drops the shadow instead)."""
        changes = self._changes
        assert changes is not None, "finish runs within finishing"
        bound = await self.majority_time_ms()  # every commit the feeds applied is below it
        async for n in self._replay(bound, REPLAY_BATCH):
            result.caught_up += n
            await tick()
        await tick()
        await self.mark(changes)
        names = await self.live_names(self._aggregate)
        await self.carry(names, result, ids=changes.ids)
        await self.outbox_fired(result)
        await self.count(self._aggregate, result)
        if not swap:
            await self.drop_shadow()
            return
        await tick()
        await self.swap(self._aggregate)
        result.swapped = True

    async def abort(self) -> None:
        """Drops the shadow (the live view is left as it is)."""
        await self.drop_shadow()

    async def drop_shadow(self) -> None:
        """Drops the context's shadow collections and their registry records."""
        with self._call("drop_shadow"):
            for name in await self._shadow_names():
                await self._db.drop_collection(name)
            await self._shadow_registry.delete_many({"context": self.context})

    async def live_names(self, aggregate: str | None) -> dict[str, str]:
        """The live timer collections of the context (``aggregate``'s alone when given), recorded
        in the live registry or made by the shadow: name -> aggregate."""
        with self._call("live_names"):
            live = await self._db[self._timers.registry_name].find({"context": self.context}).to_list(None)
            shadow = await self._shadow_names()
        names = {str(d["_id"]): str(d.get("aggregate")) for d in live}
        names.update({self._timers.collection_name(agg): agg for agg in shadow.values()})
        return {n: a for n, a in names.items() if aggregate is None or a == aggregate}

    async def _shadow_names(self) -> dict[str, str]:
        """The shadow's collections, from its registry: name -> aggregate (inside a caller's
        :meth:`_call`)."""
        docs = await self._shadow_registry.find({"context": self.context}).to_list(None)
        return {str(d["_id"]): str(d["aggregate"]) for d in docs}

    async def live_count(self) -> int:
        """Live timers in the shadow so far (for the progress lines)."""
        n = 0
        with self._call("count"):
            for name in await self._shadow_names():
                n += await self._db[name].count_documents({"status": {"$nin": list(TOMBSTONES)}})
        return n

    async def majority_time_ms(self) -> int:
        """A bound a log read must reach to hold every commit committed now: the second after the
        majority commit point's (the ``operationTime`` of a majority read that finds nothing;
        a read's watermark is the start of its cluster time's second)."""
        with self._call("cluster_time"):
            reply = await self._db.command(cluster_time_command(LOCK_COLLECTION))
        ct = cluster_time_of(reply.get("operationTime"))
        if ct is None:
            raise StorageError("MongoDB gave no cluster time: the timer view rebuild needs a replica set")
        return (ct[0] + 1) * 1000

    # ---- what the old view and the outbox hold

    @asynccontextmanager
    async def changes(self, context: str) -> AsyncIterator[Changes]:
        """A change stream on the live timer collections of ``context`` (``wow_timer__<context>__*``,
        also those made meanwhile) and the lock, opened before this returns, recording the
        ``_id`` of every document written meanwhile."""
        lock = LOCK_COLLECTION
        pattern = self._timers.collection_pattern()
        pipeline: list[dict[str, Any]] = [
            {"$match": {"$or": [{"ns.coll": {"$regex": pattern}}, {"ns.coll": lock}]}},
            {"$project": {"ns": 1, "documentKey": 1, "updateDescription.updatedFields.marker": 1}},
        ]
        changes = Changes()
        # without the client's timeoutMS (``pymongo.timeout(0)``), as the log's stream: the server
        # bounds each empty getMore by maxAwaitTimeMS, and the stream lives as long as the rebuild
        with self._call("watch", bounded=False), pymongo.timeout(0):
            stream = await self._db.watch(pipeline, max_await_time_ms=500)

        async def follow() -> None:
            with self._call("changes", bounded=False), pymongo.timeout(0):
                async for change in stream:
                    changes._record(change, lock)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow)
                try:
                    yield changes
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:  # the body's own error, as it raised it
                raise group.exceptions[0] from None
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await stream.close()

    async def mark(self, changes: Changes) -> None:
        """Returns once ``changes`` holds every write of the live timers made before the call:
        a marker written to the lock, then seen by the stream (it follows the oplog's order)."""
        marker = uuid.uuid4().hex
        with self._call("mark"):
            await self._lock.update_one({"_id": self.context, "owner": self.owner}, {"$set": {"marker": marker}})
        await changes.seen(marker)

    async def carry(
        self, names: Mapping[str, str], result: Finished, ids: Mapping[str, set[Any]] | None = None
    ) -> None:
        """The old view's documents into the shadow (:func:`carry_operation`): every one of the
        live collections ``names`` (name -> aggregate), or only those of ``ids`` (by collection)."""
        for name, aggregate in sorted(names.items()):
            shadow = self._db[self.shadow_view.collection_name(aggregate)]
            wanted = None if ids is None else sorted(ids.get(name, ()), key=str)
            if wanted is not None and not wanted:
                continue
            try:
                with self._call("carry", bounded=False):
                    if wanted is None:
                        cursor = self._db[name].find({}, batch_size=BATCH)
                        batch: list[Mapping[str, Any]] = []
                        async for doc in cursor:
                            batch.append(doc)
                            if len(batch) >= BATCH:
                                result.carried += await self._write_carried(shadow, batch)
                                batch = []
                        result.carried += await self._write_carried(shadow, batch)
                    else:
                        for i in range(0, len(wanted), BATCH):
                            docs = await self._db[name].find({"_id": {"$in": wanted[i : i + BATCH]}}).to_list(None)
                            result.carried += await self._write_carried(shadow, docs)
            except OperationFailure as exc:
                # nothing is carried from it (what the log holds is rebuilt all the same)
                log.warning("timer view rebuild: the old view's %s could not be read: %s", name, exc)

    async def _write_carried(self, shadow: Any, docs: Sequence[Mapping[str, Any]]) -> int:
        """``docs`` of the old view into ``shadow`` (:func:`carry_operation`); a key whose shadow
        document is of a later version keeps it, with a revision past the old document's
        (:func:`revision_past`)."""
        if not docs:
            return 0
        try:
            res = await shadow.bulk_write([carry_operation(d) for d in docs], ordered=False)
        except BulkWriteError as exc:
            # the shadow's key is of a later version: kept
            newer = [docs[e["index"]] for e in duplicate_keys(exc, "timer view rebuild carry-over")]
            await shadow.bulk_write([revision_past(d) for d in newer], ordered=False)
            details = exc.details or {}
            return int(details.get("nModified", 0)) + int(details.get("nUpserted", 0))
        return int(res.modified_count) + int(res.upserted_count)

    async def old_view_exists(self, names: Iterable[str]) -> bool:
        with self._call("old_view"):
            present = set(await self._db.list_collection_names())
        return any(n in present for n in names)

    async def expire(self, before: int) -> None:
        """One-shot timers of the shadow due before ``before`` (epoch ms): FAILED as expired."""
        with self._call("expire", bounded=False):
            for name in await self._shadow_names():
                await self._db[name].update_many(
                    {"status": TimerStatus.PENDING.value, "rule.type": "once", "due_at": {"$lt": before}},
                    [
                        {
                            "$set": {
                                "status": TimerStatus.FAILED.value,
                                "last_error": EXPIRED_REASON,
                                "revision": {"$add": [{"$ifNull": ["$revision", 0]}, 1]},
                            }
                        }
                    ],
                )

    async def outbox_fired(self, result: Finished) -> None:
        """One-shot timers of the shadow the outbox holds an entry of (by the request id of their
        occurrence): DONE tombstones."""
        outbox = self._db[outbox_collection(self.context)]
        retention_ms = int(self._timers.tombstone_retention.total_seconds() * 1000)
        with self._call("outbox_fired", bounded=False):
            for name in await self._shadow_names():
                coll = self._db[name]
                pending = coll.find(
                    {"status": TimerStatus.PENDING.value, "rule.type": "once"},
                    {"_id": 1, "timer_id": 1, "scheduled_at": 1},
                    batch_size=BATCH,
                )
                batch: dict[str, Any] = {}
                async for doc in pending:
                    batch[request_id_for(str(doc["timer_id"]), int(doc["scheduled_at"]))] = doc["_id"]
                    if len(batch) >= BATCH:
                        result.fired_in_outbox += await self._tombstone_fired(coll, outbox, batch, retention_ms)
                        batch = {}
                result.fired_in_outbox += await self._tombstone_fired(coll, outbox, batch, retention_ms)

    @staticmethod
    async def _tombstone_fired(coll: Any, outbox: Any, by_request: Mapping[str, Any], retention_ms: int) -> int:
        if not by_request:
            return 0
        found = await outbox.find({"request_id": {"$in": list(by_request)}}, {"_id": 0, "request_id": 1}).to_list(None)
        ids = [by_request[d["request_id"]] for d in found if d.get("request_id") in by_request]
        if not ids:
            return 0
        res = await coll.update_many(
            {"_id": {"$in": ids}, "status": TimerStatus.PENDING.value},
            [
                {
                    "$set": {
                        "status": "DONE",
                        "expires_at": {"$add": ["$$NOW", retention_ms]},
                        "revision": {"$add": [{"$ifNull": ["$revision", 0]}, 1]},
                    }
                },
                {"$unset": "claim"},
            ],
        )
        return int(res.modified_count)

    async def count(self, aggregate: str | None, result: Finished) -> None:
        """The shadow's timers per status, and its expired ones (the first of them listed)."""
        statuses: dict[str, int] = {}
        expired: list[Expired] = []
        with self._call("count", bounded=False):
            for name, agg in sorted((await self._shadow_names()).items()):
                if aggregate is not None and agg != aggregate:
                    continue
                coll = self._db[name]
                async for doc in await coll.aggregate([{"$group": {"_id": "$status", "n": {"$sum": 1}}}]):
                    statuses[str(doc["_id"])] = statuses.get(str(doc["_id"]), 0) + int(doc["n"])
                flt = {"status": TimerStatus.FAILED.value, "last_error": EXPIRED_REASON}
                result.expired += await coll.count_documents(flt)
                cursor = coll.find(flt).sort([("due_at", 1), ("timer_id", 1)]).limit(EXPIRED_LISTED)
                async for d in cursor:
                    owner = d.get("owner") or {}
                    expired.append(
                        Expired(
                            timer_id=str(d.get("timer_id")),
                            owner=f"{self.context}.{agg}/{owner.get('id')} (tenant {owner.get('tenant_id')})",
                            key=str(d.get("key")),
                            due_at=int(d.get("due_at", 0)),
                        )
                    )
        result.statuses = statuses
        result.expired_listed = sorted(expired, key=lambda e: (e.due_at, e.timer_id))[:EXPIRED_LISTED]

    # ---- the swap

    async def swap(self, aggregate: str | None) -> list[str]:
        """Renames each shadow collection (``aggregate``'s alone when given) over its live
        collection (``dropTarget``) and records it in the live registry; the shadow's records
        are deleted. Answers the live collections replaced."""
        replaced: list[str] = []
        database = self._db.name
        with self._call("swap", bounded=False):
            for name, agg in sorted((await self._shadow_names()).items()):
                if aggregate is not None and agg != aggregate:
                    await self._db.drop_collection(name)
                    continue
                live = self._timers.collection_name(agg)
                await self._client.admin.command(
                    "renameCollection", f"{database}.{name}", to=f"{database}.{live}", dropTarget=True
                )
                await self._db[self._timers.registry_name].update_one(
                    {"_id": live}, registry_claim(self.context, agg, clock.now_ms()), upsert=True
                )
                replaced.append(live)
            await self._shadow_registry.delete_many({"context": self.context})
        return replaced


def _date(value: Any) -> str:
    from datetime import UTC, datetime

    if isinstance(value, datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=UTC)
        return iso_ms(int(aware.timestamp() * 1000))
    return str(value)
