"""The layout of the MongoDB stores (docs/stores.md, "MongoDB"): the index specs of every
collection and their sharding, the formats the stores record and the upgrade of an older one,
the timer collections' registry and DDL (:class:`TimerCollections`), and the formats read without
changing anything (``wowd check``). The documents each store sends are beside the calls that send
them, in its module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pymongo
from bson.min_key import MinKey
from pymongo import (
    AsyncMongoClient,
    IndexModel,
)
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import (
    OperationFailure,
    PyMongoError,
)

from wowd import clock
from wowd.errors import (
    FormatError,
    InvalidInput,
)
from wowd.fmt import iso_ms
from wowd.model import (
    AggregateType,
    TimerStatus,
)
from wowd.stores.base import PRESENCE_RETENTION, Ddl
from wowd.stores.formats import StoreFormat, other_format, too_new
from wowd.stores.mongo._common import (
    NAMESPACE_EXISTS,
    SNAPSHOT_TABLES,
    TIMER_REGISTRY,
    Doc,
    MongoSharding,
    MongoStore,
    collection_name,
    collection_pattern,
    is_unauthorized,
    mongo_name,
)

log = logging.getLogger(__name__)


def literal(value: Any) -> dict[str, Any]:
    """A value given to an update pipeline as data: a string starting with ``$`` or a key
    starting with ``$`` in it is not read as a field path or an operator."""
    return {"$literal": value}


def now_ms_expr() -> dict[str, Any]:
    """The server's now in milliseconds since the epoch, in a pipeline."""
    return {"$toLong": "$$NOW"}


def whole_seconds(value: timedelta) -> int:
    return value // timedelta(seconds=1)


# ---- the formats


FORMAT = 5
"""The layout version of wowd's collections (``format`` in the registries), the timer
collections' aside (:data:`TIMER_FORMAT`)."""


TIMER_FORMAT = 6
"""The layout version of the timer collections (``format`` in :data:`TIMER_REGISTRY`): with
tombstones (DONE/CANCELLED documents and their TTL index)."""


TIMER_UPGRADES_FROM = 5
"""The timer collections' format upgraded in place to :data:`TIMER_FORMAT` (the same layout
without tombstones: the TTL index is created, then the registry records the new format)."""

# ---- the timer collections: their indexes, the registry's records, the spread of their chunks


REGISTRY = TIMER_REGISTRY
"""The registry of the timer collections of every context."""


DUE_STATUSES = [TimerStatus.PENDING.value, TimerStatus.FIRING.value]
"""The statuses the due index holds (its ``partialFilterExpression``)."""


TOMBSTONES = ["DONE", "CANCELLED"]
"""The statuses of a tombstone (the TTL index's ``partialFilterExpression``)."""


UNIQUE_INDEX = "partition_owner_key"


DUE_INDEX = "due"


PARKED_INDEX = "parked_target"


RECLAIM_INDEX = "reclaim"


TTL_INDEX = "tombstones_ttl"


INDEX_CONFLICT_CODES = frozenset({85, 86})  # IndexOptionsConflict, IndexKeySpecsConflict


SPREAD_CHUNKS_PER_SHARD = 4
"""How many chunks :meth:`MongoTimerStore.spread_chunks` gives each shard of a new collection:
contiguous partition ranges, so the splits and moves are bounded by the shard count, never by
the partition count."""


SPREAD_BUDGET = timedelta(minutes=5)
"""How long :meth:`MongoTimerStore.spread_chunks` may take by default, all collections together;
what is left then is the balancer's."""


def timer_index_specs() -> list[dict[str, Any]]:
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


# ---- the timer collections' registry, DDL, upgrade and sharding


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
    ``partitions``, ``ddl``, ``sharding``, ``drop_other_format``, ``kind`` and ``registry``).
    ``shared_with``: another store of the same collections whose registry this one shares (the
    three timer stores of a backend: a type the view registers is read by firing at once)."""

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
        shared_with: TimerCollections | None = None,
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
        self._known: dict[str, str] = {} if shared_with is None else shared_with._known
        """Collections read by the union reads: name -> aggregate."""
        self._ready: set[str] = set() if shared_with is None else shared_with._ready
        """Collections whose DDL this store made sure of (first put of the type)."""
        self._ttl_checked: set[str] = set() if shared_with is None else shared_with._ttl_checked
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
        self._known.clear()
        self._known.update(known)
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
                if exc.code in INDEX_CONFLICT_CODES:
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
            await self._create_indexes(name, timer_index_specs(), log)
        except OperationFailure as exc:
            if exc.code in INDEX_CONFLICT_CODES:
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
        wanted = [s for s in timer_index_specs() if self.ddl is not Ddl.NONE or s["name"] != TTL_INDEX]
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


# ---- the log and its quarantine


LOG_SHARD_KEY: Doc = {"aggregate_id": "hashed"}
"""The shard key of a log collection on a sharded cluster. The aggregate id: every commit of an
aggregate on one shard, so the ``_id`` ``{t, a, v}`` (unique per shard only) and the unique
``{aggregate_id, request_id}`` (a unique index must have the shard key as its prefix) hold across
the cluster, and the reads by aggregate (the log check, ``last_version``) reach one shard;
hashed, so that time-ordered ids (Wow's, CosId's) spread their inserts over the shards instead of
all landing in the last chunk. A partition's re-read asks every shard (it is rare: a start
without checkpoints, a lost resume point). ``{partition: 1}`` cannot be the key: the unique
index would not have it as its prefix (createIndexes answers 67 CannotCreateIndex)."""


def log_indexes(*, sharded: bool = False) -> list[Doc]:
    """The index specs of a log collection (``createIndexes``'s ``indexes``), besides ``_id``;
    on a sharded cluster also the shard key's (:data:`LOG_SHARD_KEY`: a collection that holds
    commits already can be sharded only with it)."""
    specs: list[Doc] = [
        {"key": {"aggregate_id": 1, "request_id": 1}, "name": "aggregate_request", "unique": True},
        {"key": {"partition": 1, "aggregate_id": 1, "version": 1, "_id": 1}, "name": "partition_order"},
    ]
    if sharded:
        specs.append({"key": dict(LOG_SHARD_KEY), "name": "aggregate_hashed"})
    return specs


def quarantine_indexes() -> list[Doc]:
    """``seq`` (the listing's order) and ``seq_unique``: one item per ``seq``, the guard of
    :meth:`~wowd.stores.mongo.log.MongoLog.quarantine`'s draw (partial to the items: the counter
    document has no ``seq``)."""
    return [
        {"key": {"quarantined_at": 1, "seq": 1}, "name": "quarantined_at"},
        {"key": {"seq": 1}, "name": "seq"},
        {
            "key": {"seq": -1},
            "name": "seq_unique",
            "unique": True,
            "partialFilterExpression": {"seq": {"$type": "objectId"}},
        },
    ]


# ---- the snapshots


def snapshot_index_specs(*, sharded: bool = False) -> list[dict[str, Any]]:
    """The indexes of a snapshot collection (createIndexes' ``indexes``): the two partial ones,
    and on a sharded collection the shard key's (not unique: ``_id`` alone keeps it unique)."""
    partial = {"deleted": False}
    specs: list[dict[str, Any]] = [
        {
            "key": {"tenant_id": 1, "owner_id": 1},
            "name": "tenant_id_1_owner_id_1",
            "partialFilterExpression": partial,
        },
        {
            "key": {"tenant_id": 1, "space_id": 1},
            "name": "tenant_id_1_space_id_1",
            "partialFilterExpression": partial,
        },
    ]
    if sharded:
        specs.append({"key": snapshot_shard_key(), "name": "tenant_id_1_aggregate_id_hashed"})
    return specs


def snapshot_shard_key() -> dict[str, Any]:
    """The shard key of a sharded snapshot collection: the tenant, then the hashed aggregate id
    (every write's filter names both)."""
    return {"tenant_id": 1, "aggregate_id": "hashed"}


def table_format_update(type: AggregateType) -> list[dict[str, Any]]:
    """The format record of a type's collection (upsert): recorded when missing, kept otherwise,
    so the answer tells which format the collection holds."""
    return [
        {
            "$set": {
                "context": literal(type.context),
                "aggregate": literal(type.aggregate),
                "format": {"$ifNull": ["$format", FORMAT]},
                "created_at": {"$ifNull": ["$created_at", now_ms_expr()]},
            }
        }
    ]


# ---- the outbox


def outbox_indexes() -> list[Doc]:
    return [
        {"key": {"request_id": 1}, "name": "request_id", "unique": True},
        {"key": {"created_at": 1}, "name": "created_at"},
    ]


# ---- the timers' history


def history_indexes() -> list[Doc]:
    return [
        {
            "key": {"owner_id": 1, "aggregate": 1, "tenant_id": 1, "key": 1, "at": 1},
            "name": "key",
            "partialFilterExpression": {"slot": {"$lt": 0}},
        },
        {"key": {"request_id": 1, "at": 1}, "name": "request_id"},
        {"key": {"expires_at": 1}, "name": "expires_ttl", "expireAfterSeconds": 0},
    ]


# ---- the slot leases and the presence records


SLOT_INDEX_NAME = "ns_1_slot_1"


REPLICA_TTL_INDEX = "expiresAt_ttl"


def slot_indexes() -> list[IndexModel]:
    """The one index of ``cosid_slot``: unique ``(ns, slot)``."""
    return [IndexModel([("ns", 1), ("slot", 1)], name=SLOT_INDEX_NAME, unique=True)]


def replica_indexes() -> list[IndexModel]:
    """The one index of ``cosid_replica``: a TTL index on ``expiresAt`` that deletes a presence
    record :data:`~wowd.stores.base.PRESENCE_RETENTION` after it expired (``replicas`` lists it
    as gone meanwhile). The ``_id`` index serves the heartbeat and the leave; a namespace's read
    scans the few records of the collection."""
    return [
        IndexModel([("expiresAt", 1)], name=REPLICA_TTL_INDEX, expireAfterSeconds=whole_seconds(PRESENCE_RETENTION))
    ]


# ---- a rebuild of the timer view


LOCK_COLLECTION = "wow_timer_rebuild"
"""One document per context whose timer view is being rebuilt."""


SHADOW_KIND = "timer_shadow"
"""The shadow collections' kind: ``wow_timer_shadow__<context>__<aggregate>``."""


SHADOW_REGISTRY = "wow_timer_shadow_aggregate"
"""The registry of the shadow collections."""

# ---- the formats recorded, read without changing anything (``wowd check``)


async def mongo_formats(db: AsyncDatabase[Any], context: str) -> list[StoreFormat]:
    """The format of each timer collection of ``context`` (from ``wow_timer_aggregate``; one
    line with ``found`` None when none is registered yet) and of each snapshot collection (from
    ``wow_snapshot_tables``). Two ``find`` commands; reads only."""
    found: list[StoreFormat] = []
    projection = {"_id": 1, "format": 1}
    timers = await db[TIMER_REGISTRY].find({"context": context}, projection).to_list(None)
    for doc in sorted(timers, key=lambda d: str(d["_id"])):
        fmt = doc.get("format")
        found.append(
            StoreFormat(
                f"mongodb timers: {doc['_id']}", fmt if isinstance(fmt, int) else -1, TIMER_FORMAT, TIMER_UPGRADES_FROM
            )
        )
    if not timers:
        found.append(StoreFormat(f"mongodb timers: wow_timer__{context}__*", None, TIMER_FORMAT, TIMER_UPGRADES_FROM))
    snapshots = await db[SNAPSHOT_TABLES].find({"context": context}, projection).to_list(None)
    for doc in sorted(snapshots, key=lambda d: str(d["_id"])):
        fmt = doc.get("format")
        if fmt is None:
            continue  # a control-plane record of a rebuild without its format record yet
        found.append(StoreFormat(f"mongodb {doc['_id']}", fmt if isinstance(fmt, int) else -1, FORMAT))
    return found


async def mongo_rebuild_state(db: AsyncDatabase[Any], context: str) -> str | None:
    """A rebuild of the context's timer view that runs or was interrupted (``wowd timers
    rebuild``): its lock and its shadow collections, in one line (a lock of a process of this
    host that is gone is an interrupted rebuild's); ``None`` when there are neither. An
    ``aggregate`` and a ``find``; reads only."""
    from wowd.stores.timer_rebuild import lock_gone

    cursor = await db[LOCK_COLLECTION].aggregate([{"$match": {"_id": context}}, {"$set": {"storeNow": "$$NOW"}}])
    locks = await cursor.to_list(None)
    lock = locks[0] if locks else None
    shadows = await db[SHADOW_REGISTRY].find({"context": context}, {"_id": 1}).to_list(None)
    if lock is None and not shadows:
        return None
    live = lock is not None and lock.get("expiresAt") is not None and lock["expiresAt"] > lock["storeNow"]
    if lock is not None and live and not lock_gone(str(lock.get("owner"))):
        started, until = (_ms(lock[f]) for f in ("startedAt", "expiresAt"))
        return f"runs: lock held by {lock.get('owner')} since {iso_ms(started)}, until {iso_ms(until)} unless renewed"
    left = ", ".join(sorted(str(d["_id"]) for d in shadows)) or "its lock"
    return (
        f"an interrupted rebuild left {left}: the live view is as it was; wowd timers rebuild runs it again "
        "(and drops what it left)"
    )


def _ms(value: datetime) -> int:
    """A BSON date as decoded (naive, UTC) in milliseconds since the epoch."""
    return int(value.replace(tzinfo=UTC).timestamp() * 1000)
