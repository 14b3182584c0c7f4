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
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

import pymongo
from pymongo import AsyncMongoClient, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, OperationFailure, PyMongoError

from wowd import clock
from wowd.errors import FormatError, InvalidInput, StorageUnavailable
from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    AggregateRef,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
    validate_name,
)
from wowd.stores.base import Ddl, TimerSearch
from wowd.stores.formats import other_format, too_new
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    NAMESPACE_EXISTS,
    TIMER_FORMAT,
    TIMER_UPGRADES_FROM,
    MongoSharding,
    MongoStore,
    collection_name,
    duplicate_keys,
    durable_or_raise,
    is_duplicate_key,
    is_unauthorized,
    split_to_fit,
    write_one,
)
from wowd.stores.mongo.timer_queries import (
    _INDEX_CONFLICT_CODES,
    _KEY_FIELDS,
    _MAX_RELOADS,
    _WRITE_ATTEMPTS,
    RAISE,
    REGISTRY,
    SPREAD_BUDGET,
    TTL_INDEX,
    cancel_all_filter,
    chunk_mins,
    due_match,
    fail_operation,
    index_specs,
    key_filter,
    live_filter,
    next_due_pipelines,
    parked_many_match,
    parked_match,
    partition_groups,
    reclaim_filter,
    reclaim_update,
    registry_claim,
    registry_upgrade,
    scan_match,
    search_match,
    settle_filter,
    settle_operations,
    split_points,
    spread_lowers,
    timer_from_doc,
    tombstone_raise_filter,
    tombstone_update,
    ttl_index_spec,
    union_batch_size,
    union_pipeline,
    union_pipelines,
    write_operation,
    write_update,
    write_verdict,
)

log = logging.getLogger(__name__)

__all__ = ["MongoTimerStore"]


class MongoTimerStore(MongoStore):
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
        self._kind = kind
        self.registry_name = registry
        self._registry: AsyncCollection[Any] = self._db[registry]
        self._known: dict[str, str] = {}
        """Collections read by the union reads: name -> aggregate."""
        self._ready: set[str] = set()
        """Collections whose DDL this store made sure of (first put of the type)."""
        self._sharded: bool | None = None
        self._ttl_checked: set[str] = set()
        """Collections whose TTL index ``ddl=none`` looked for (once each)."""

    # ------------------------------------------------------------------ plumbing

    def collection_name(self, aggregate: str) -> str:
        return collection_name(self._kind, self.context, aggregate)

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
        if isinstance(found, int) and found > TIMER_FORMAT:
            # a newer wowd's collection: never dropped by an older one
            raise too_new(f"mongodb timers: {name}", found, TIMER_FORMAT)
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
                raise FormatError(f"mongodb timers: {name} is not registered in {self.registry_name} (ddl=validate)")
            if doc.get("format") == TIMER_UPGRADES_FROM:
                await self._upgrade(name)  # refuses
            if doc.get("format") != TIMER_FORMAT:
                raise other_format(f"mongodb timers: {name}", doc.get("format"), TIMER_FORMAT)
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
            "findAndModify": self.registry_name,
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
        """After a partial claim: the timers whose stored document is the claim written. A
        tombstone at the claim's revision (a cancel that won the race raised the revision as the
        claim would have) is not a claim: skipped, not decoded."""
        mine: list[Timer] = []
        for t in claimed:
            coll = self._collection(t.owner)
            doc = await coll.find_one(settle_filter(t))  # the claim's timer at its revision
            if doc is not None and doc.get("status") == TimerStatus.FIRING.value:
                stored = timer_from_doc(doc, context=self.context, aggregate=t.owner.aggregate)
                if stored.claim == t.claim:
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
