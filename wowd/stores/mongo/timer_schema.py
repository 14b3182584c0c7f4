"""The timer collections of one context on MongoDB: their registry (``wow_timer_aggregate``,
``{_id: collection, context, aggregate, format, created_at}``) and format, their DDL as
``ddl`` says (created with their indexes, checked, or assumed and looked at), their sharding and
the spread of their chunks over the shards, and the in-place upgrade of format 5. The base of
:class:`~wowd.stores.mongo.timers.MongoTimerStore`, which reads and writes the timers in them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pymongo
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import OperationFailure, PyMongoError

from wowd import clock
from wowd.errors import FormatError, InvalidInput
from wowd.stores.base import Ddl
from wowd.stores.formats import other_format, too_new
from wowd.stores.mongo._common import (
    NAMESPACE_EXISTS,
    TIMER_FORMAT,
    TIMER_UPGRADES_FROM,
    MongoSharding,
    MongoStore,
    collection_name,
    collection_pattern,
    is_unauthorized,
    mongo_name,
)
from wowd.stores.mongo.timer_queries import (
    _INDEX_CONFLICT_CODES,
    SPREAD_BUDGET,
    TTL_INDEX,
    chunk_mins,
    index_specs,
    registry_claim,
    registry_upgrade,
    split_points,
    spread_lowers,
    ttl_index_spec,
)

log = logging.getLogger(__name__)

__all__ = ["TimerCollections"]


def _has_ttl(indexes: Mapping[str, Any]) -> bool:
    """Whether ``indexes`` (by name) hold the tombstones' TTL index (:func:`ttl_index_spec`: its
    name, key and ``expireAfterSeconds``)."""
    spec, found = ttl_index_spec(), indexes.get(TTL_INDEX)
    return (
        found is not None
        and list(found["key"].items()) == list(spec["key"].items())
        and found.get("expireAfterSeconds") == spec["expireAfterSeconds"]
    )


class TimerCollections(MongoStore):
    """The registry and the DDL of one context's timer collections (the
    :class:`~wowd.stores.mongo._common.MongoStore` constructor, and the timer store's ``context``,
    ``partitions``, ``ddl``, ``sharding``, ``drop_other_format``, ``kind`` and ``registry``)."""

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        context: str,
        partitions: int,
        ddl: Ddl,
        sharding: MongoSharding,
        operation_timeout: timedelta | None,
        drop_other_format: bool,
        kind: str,
        registry: str,
    ) -> None:
        self.context = mongo_name(context, field="context")
        if partitions < 1:
            raise InvalidInput(f"must be >= 1, got {partitions}", field="partitions")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self.partitions = partitions
        self.ddl = Ddl(ddl)
        self.sharding = MongoSharding(sharding)
        self.drop_other_format = drop_other_format
        self._kind = kind
        self.registry_name = registry
        self._registry: AsyncCollection[Any] = self._db[registry]
        self._known: dict[str, str] = {}
        """Collections read by the union reads: name -> aggregate."""
        self._ready: set[str] = set()
        """Collections whose DDL this store made sure of (first put of the type)."""
        self._ttl_checked: set[str] = set()
        """Collections whose indexes ``ddl=none`` looked at (once each)."""

    def collection_name(self, aggregate: str) -> str:
        return collection_name(self._kind, self.context, aggregate)

    def collection_pattern(self) -> str:
        """The regular expression of this store's collection names (:func:`collection_pattern`)."""
        return collection_pattern(self._kind, self.context)

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
            # registered in format 6 and assumed to exist: its indexes are looked at once, then a
            # put goes straight to its upsert. (AUTO still makes sure of the indexes once: a
            # replica may have registered the type and died before creating them; VALIDATE
            # checks them.)
            for name in sorted(set(known) - self._ready - self._ttl_checked):
                indexes = await self._validate_indexes(name)  # the TTL index aside: refused without the others
                self._ttl_checked.add(name)
                if not _has_ttl(indexes):
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
        """Whether the collection ``name`` has the tombstones' TTL index (:func:`_has_ttl`); a
        missing collection has none."""
        return _has_ttl(await self._indexes(name))

    async def _indexes(self, name: str) -> dict[str, Any]:
        """The indexes of the collection ``name`` by name (``listIndexes``); none for a missing
        collection (26 NamespaceNotFound)."""
        try:
            with self._deadline():
                return {doc["name"]: doc async for doc in await self._db[name].list_indexes()}
        except OperationFailure as exc:
            if exc.code == 26:  # NamespaceNotFound
                return {}
            raise

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
            if self.ddl is Ddl.NONE:
                await self._validate_indexes(name)  # before the registry names it to the reads
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
        if await self._is_sharded(self.sharding):
            await self._shard(name)

    async def _validate_indexes(self, name: str) -> dict[str, Any]:
        """Each index of :func:`index_specs` by name, with its keys *in order* (a compound index
        on the same keys in another order serves other queries), filter and uniqueness: a
        :class:`FormatError` naming those missing or different. ``ddl=none`` leaves out the TTL
        index (its absence only keeps tombstones: a warning, and ``wowd check`` fails on it) and
        names a missing collection: the collection of a new aggregate type is created by nobody
        then, and its first put would make one without a unique key (a replayed put would make
        a second live timer of a key: a double delivery), a due index or a TTL index. Answers the
        indexes found."""
        indexes = await self._indexes(name)
        wanted = [s for s in index_specs() if self.ddl is not Ddl.NONE or s["name"] != TTL_INDEX]
        lacking = [
            spec
            for spec in wanted
            if (found := indexes.get(spec["name"])) is None
            or list(found["key"].items()) != list(spec["key"].items())
            or found.get("partialFilterExpression") != spec.get("partialFilterExpression")
            or bool(found.get("unique", False)) != bool(spec.get("unique", False))
            or found.get("expireAfterSeconds") != spec.get("expireAfterSeconds")
        ]
        if not lacking:
            return indexes
        if self.ddl is Ddl.NONE:
            what = "does not exist" if not indexes else f"lacks the indexes {', '.join(s['name'] for s in lacking)}"
            raise FormatError(
                f"mongodb timers: {name} {what}, and WOWD_MONGODB__DDL=none creates nothing: its timers cannot be "
                f"kept (no unique key, no due index). Create the collection and its indexes {lacking} "
                "(docs/stores.md), or start once with WOWD_MONGODB__DDL=auto"
            )
        raise FormatError(f"mongodb timers: {name} lacks the index {lacking[0]} (ddl=validate)")

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
            if self.partitions < 2 or not self._known or not await self._is_sharded(self.sharding):
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
