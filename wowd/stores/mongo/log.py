"""The log on MongoDB (docs/schema.md): its commit collections, the appends and the log check.

``wow_log__<ctx>__<aggregate>`` (``<ctx>`` the context): one document per commit
(:func:`wowd.model.commit_to_doc`), ``_id: {t, a, v}``; unique ``{aggregate_id, request_id}``
(idempotent appends) and ``{partition, aggregate_id, version, _id}`` (the partition re-read's
order, the reads by aggregate). Its read (the partitions' re-reads and the change stream) is
:mod:`~wowd.stores.mongo.log_read`'s, the store's base; its checkpoints and its quarantine are
stores of their own (:mod:`~wowd.stores.mongo.checkpoints`, :mod:`~wowd.stores.mongo.quarantine`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient, InsertOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from wowd.errors import (
    ConfigError,
    ConflictError,
    FormatError,
    StorageError,
)
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    AggregateType,
    Commit,
    commit_to_doc,
    partition,
)
from wowd.stores.base import AppendOutcome, Ddl, OwnerProbe
from wowd.stores.mongo._common import (
    ALREADY_INITIALIZED,
    CANNOT_CREATE_INDEX,
    DEFAULT_OPERATION_TIMEOUT,
    Doc,
    MongoSharding,
    collection_name,
    collection_pattern,
    duplicate_keys,
    mongo_name,
    write_one,
)
from wowd.stores.mongo.log_read import ClusterTime, LogReading
from wowd.stores.mongo.schema import LOG_SHARD_KEY, log_indexes

log = logging.getLogger(__name__)

__all__ = ["MongoLog"]


class MongoLog(LogReading):
    """The :class:`~wowd.stores.base.Log` of one context on MongoDB.

    The :class:`~wowd.stores.mongo._common.MongoStore` constructor (client or URI, database,
    ``operation_timeout``: each call but the change stream). A change stream needs a replica set
    or a sharded cluster; on a standalone server :meth:`read` raises :class:`ConfigError`.
    ``max_await``: how long the server holds an empty ``getMore``. ``idle_advance``: after how
    long a quiet partition moves to the stream's high-water mark. ``scan_catch_up``: after how
    long of scanning the partitions scanned so far are caught up by a stream before the next.
    ``sharding``: with ``ddl=auto``, whether a log collection is sharded (on
    :data:`~wowd.stores.mongo.log_queries.LOG_SHARD_KEY`) when its indexes are made sure of.
    """

    _label = "log"

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Doc] | str,
        database_name: str,
        *,
        context: str,
        partitions: int,
        ddl: Ddl = Ddl.AUTO,
        sharding: MongoSharding = MongoSharding.AUTO,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
        max_await: timedelta = timedelta(seconds=1),
        idle_advance: timedelta | None = timedelta(minutes=1),
        scan_catch_up: timedelta = timedelta(minutes=1),
    ) -> None:
        if partitions < 1:
            raise ConfigError(f"partitions: must be >= 1, got {partitions}")
        self.context = mongo_name(context, field="context")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self.partitions = partitions
        self._ddl = Ddl(ddl)
        self._sharding = MongoSharding(sharding)
        self._max_await_ms = max(1, int(max_await.total_seconds() * 1000))
        self._idle_advance_s = int(idle_advance.total_seconds()) if idle_advance is not None else None
        self._catch_up_s = scan_catch_up.total_seconds()
        self._prefix = log_collection_prefix(context)
        self._pattern = collection_pattern("log", context)
        self._ensured: set[str] = set()
        self._observed: ClusterTime | None = None
        """The latest operation time the change stream's replies carried (:meth:`committed_after`
        reads at or after it)."""

    # ------------------------------------------------------------------ plumbing

    def collection_name(self, aggregate: str) -> str:
        """``wow_log__<context>__<aggregate>``."""
        return collection_name("log", self.context, aggregate)

    async def _collection(self, aggregate: AggregateType) -> AsyncCollection[Doc]:
        if aggregate.context != self.context:
            raise ConfigError(f"aggregate type {aggregate} is not of context {self.context!r}")
        name = self.collection_name(aggregate.aggregate)
        if name not in self._ensured:
            await self._ensure(name)
        return self._db[name]

    async def _ensure(self, name: str) -> None:
        """``ddl=auto``: the indexes (and on a sharded cluster the shard key's, then the
        collection sharded on :data:`LOG_SHARD_KEY`); a collection already sharded on a key the
        unique index cannot have as its prefix is a :class:`ConfigError` naming the key to use;
        one sharded on another key that allows it is left so. ``validate``: checked."""
        if self._ddl is Ddl.AUTO:
            with self._call("prepare", bounded=False):
                sharded = await self._is_sharded(self._sharding)
                try:
                    await self._create_indexes(name, log_indexes(sharded=sharded), log)
                except OperationFailure as exc:
                    if exc.code == CANNOT_CREATE_INDEX and "shard key" in str(exc):
                        raise ConfigError(
                            f"mongodb log: {self._db.name}.{name} is sharded on a key the unique index "
                            f"aggregate_request {{aggregate_id, request_id}} cannot start with ({exc}): shard the "
                            f"log collections on {LOG_SHARD_KEY} (docs/stores.md)"
                        ) from exc
                    raise
                if sharded:
                    await self._shard_log(name)
        elif self._ddl is Ddl.VALIDATE:
            await self._validate(name, log_indexes())
        self._ensured.add(name)

    async def _shard_log(self, name: str) -> None:
        """``shardCollection`` on :data:`LOG_SHARD_KEY` (idempotent); already sharded on another
        key (23 AlreadyInitialized) that the unique index could be made under: logged, left."""
        try:
            await self._shard_collection(name, LOG_SHARD_KEY, self._sharding, log, what="log", bounded=False)
        except OperationFailure as exc:
            if exc.code != ALREADY_INITIALIZED:
                raise
            log.info("log collection %s is sharded on another key than %s, left so: %s", name, LOG_SHARD_KEY, exc)

    async def _validate(self, name: str, indexes: Sequence[Doc]) -> None:
        """:class:`FormatError` naming the first of ``indexes`` (name, keys, unique) ``name`` lacks."""
        with self._call("prepare"):
            info = await self._db[name].index_information()
        for spec in indexes:
            found = info.get(spec["name"]) or {}
            if (dict(found.get("key", [])), found.get("unique", False)) != (spec["key"], spec.get("unique", False)):
                raise FormatError(f"mongodb {name}: index {spec['name']} {spec['key']} is missing")

    # ------------------------------------------------------------------ DDL, health

    async def prepare(self) -> None:
        """Creates (AUTO) or checks (VALIDATE) the indexes of the existing log collections.
        Idempotent."""
        if self._ddl is Ddl.NONE:
            return
        for name in await self._log_collections():
            await self._ensure(name)

    def nudge(self) -> None:
        """A no-op: the change stream answers at least every ``maxAwaitTimeMS``."""

    async def ping(self) -> None:
        with self._call("ping"):
            await self._db.command("ping")

    async def aggregate_types(self) -> list[AggregateType]:
        types = (self._aggregate_of(n) for n in await self._log_collections())
        return [t for t in types if t is not None]

    # ------------------------------------------------------------------ appends

    async def append(self, commit: Commit) -> AppendOutcome:
        """One insert. E11000 on the request-id index: ``duplicate``; on ``_id``: ``duplicate``
        when the stored commit has this request id, else :class:`ConflictError`. E11000 with a
        write concern error: :class:`StorageUnavailable` (the stored commit is not known durable;
        :func:`write_one`)."""
        doc = commit_to_doc(commit, self.partitions)
        coll = await self._collection(commit.ref.type)
        with self._call("append"):
            try:
                await write_one(coll, InsertOne(doc), "log.append")
                return "appended"
            except DuplicateKeyError as exc:
                outcome = (await self._duplicates(coll, [(doc, exc.details or {})]))[0]
        if outcome == "conflict":
            raise ConflictError(
                f"{commit.ref} version {commit.version} is held by another commit "
                f"(request id {commit.request_id!r} differs)"
            )
        return outcome

    async def append_many(self, commits: Sequence[Commit]) -> list[AppendOutcome]:
        """One unordered ``insert_many`` per aggregate type; one outcome per commit in order."""
        outcomes: list[AppendOutcome] = ["appended"] * len(commits)
        groups: dict[AggregateType, list[int]] = {}
        for i, c in enumerate(commits):
            groups.setdefault(c.ref.type, []).append(i)
        for type_, indexes in groups.items():
            coll = await self._collection(type_)
            docs = [commit_to_doc(commits[i], self.partitions) for i in indexes]
            with self._call("append_many"):
                try:
                    await coll.insert_many(docs, ordered=False)
                    continue
                except BulkWriteError as exc:
                    errors = duplicate_keys(exc, "log append_many")
                    dups = [(docs[e["index"]], e) for e in errors]
                    resolved = await self._duplicates(coll, dups)
                    for e, outcome in zip(errors, resolved, strict=True):
                        outcomes[indexes[e["index"]]] = outcome
        return outcomes

    async def _duplicates(
        self, coll: AsyncCollection[Doc], dups: Sequence[tuple[Doc, Mapping[str, Any]]]
    ) -> list[AppendOutcome]:
        """Classifies E11000 errors: the request-id index means ``duplicate``; ``_id`` means
        ``duplicate`` when the stored commit has the same request id, else ``conflict``."""
        on_id = [doc["_id"] for doc, err in dups if _duplicate_index(err) == "_id"]
        stored: dict[tuple[Any, ...], Any] = {}
        if on_id:
            async for d in coll.find({"_id": {"$in": on_id}}, {"request_id": 1}):
                stored[_id_key(d["_id"])] = d.get("request_id")
        out: list[AppendOutcome] = []
        for doc, err in dups:
            index = _duplicate_index(err)
            if index == "aggregate_request":
                out.append("duplicate")
            elif index == "_id":
                same = stored.get(_id_key(doc["_id"])) == doc["request_id"]
                out.append("duplicate" if same else "conflict")
            else:
                raise StorageError(f"mongodb log append: unexpected duplicate key: {err.get('errmsg')}")
        return out

    async def last_version(self, ref: AggregateRef) -> int:
        """One ``find`` (limit 1, the version only) on the aggregate's log collection."""
        coll = await self._collection(ref.type)
        query, sort = last_version_query(ref, self.partitions)
        with self._call("last_version"):
            doc = await coll.find_one(query, {"_id": 0, "version": 1}, sort=list(sort.items()))
        version = doc.get("version") if doc is not None else 0
        return version if isinstance(version, int) and not isinstance(version, bool) else 0

    async def committed_after(self, probes: Sequence[OwnerProbe]) -> set[int]:
        """One ``find`` per log collection asked about, on the primary with ``majority`` read
        concern: the commits of the probes' aggregates above their versions that schedule or
        cancel their keys or delete them (:func:`committed_after_filter`, the partitions listed),
        the version and timer events' names and keys only. A majority read on the primary returns
        the majority-committed state as of its start: every commit acknowledged with ``w:
        majority`` before it began (docs/concepts.md, "Firing on MongoDB"). It reads at or after the
        latest operation time the change stream saw (``afterClusterTime`` in a causally
        consistent session): a new primary whose majority commit point is still behind that
        (after an election, 7.0: SERVER-53813) waits until it is not, instead of answering from
        before commits the old primary acknowledged and the feed may have read already."""
        by_type: dict[str, list[int]] = {}
        for i, probe in enumerate(probes):
            if probe.ref.context != self.context:
                raise ConfigError(f"aggregate type {probe.ref.type} is not of context {self.context!r}")
            by_type.setdefault(probe.ref.aggregate, []).append(i)
        found: set[int] = set()
        for aggregate, indexes in sorted(by_type.items()):
            asked = {
                (partition(probes[i].ref.id, self.partitions), probes[i].ref.tenant_id, probes[i].ref.id,
                 probes[i].version, probes[i].key)
                for i in indexes
            }  # fmt: skip
            coll = self._db.get_collection(
                self.collection_name(aggregate),
                read_concern=ReadConcern("majority"),
                read_preference=ReadPreference.PRIMARY,
            )
            with self._call("committed_after"):
                async with self._client.start_session(causal_consistency=True) as session:
                    if self._observed is not None:
                        session.advance_operation_time(Timestamp(*self._observed))
                    docs = await coll.find(
                        committed_after_filter(sorted(asked, key=_probe_order)),
                        COMMITTED_AFTER_PROJECTION,
                        session=session,
                    ).to_list(None)
            commits: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
            for d in docs:
                commits.setdefault((stored_tenant(d), d.get("aggregate_id")), []).append(d)
            for i in indexes:
                p = probes[i]
                for d in commits.get((p.ref.tenant_id, p.ref.id), ()):
                    v = d.get("version")
                    if isinstance(v, int) and not isinstance(v, bool) and v > p.version and changes_timer(d, p.key):
                        found.add(i)
                        break
        return found

    async def insert_raw(self, aggregate: AggregateType, document: Mapping[str, Any]) -> None:
        """One insert of ``document`` as it is; :class:`ConflictError` when it collides with a
        stored commit (E11000: its ``_id``, or its aggregate id and request id), as the embedded
        log answers (a writer that retries after a lost reply finds its own document so)."""
        coll = await self._collection(aggregate)
        with self._call("insert_raw"):
            try:
                await coll.insert_one(dict(document))
            except DuplicateKeyError as exc:
                raise ConflictError(f"raw document collides with a stored commit: {exc}") from exc

    # ------------------------------------------------------------------ reading

    # ------------------------------------------------------------------ checkpoints


# --------------------------------------------------------------------------- helpers


def _probe_order(probe: tuple[int, str, str, int, str | None]) -> tuple[int, str, str, int, str]:
    """The order of the log check's branches (a stable filter for a stable set of probes)."""
    p, tenant, agg_id, version, key = probe
    return (p, tenant, agg_id, version, key if key is not None else "")


def _duplicate_index(err: Mapping[str, Any]) -> str:
    """The index an E11000 names: from ``keyPattern`` when the server sent it, else the message."""
    pattern = err.get("keyPattern")
    if isinstance(pattern, Mapping):
        if "_id" in pattern:
            return "_id"
        if "request_id" in pattern:
            return "aggregate_request"
    msg = str(err.get("errmsg", ""))
    m = re.search(r"index: (\S+)", msg)
    name = m.group(1) if m else ""
    return "_id" if name == "_id_" else name


def _id_key(id_: Any) -> tuple[Any, ...]:
    if isinstance(id_, Mapping):
        return tuple(sorted((k, repr(v)) for k, v in id_.items()))
    return (repr(id_),)


def log_collection_prefix(context: str) -> str:
    """``wow_log__<context>__``: every log collection of the context starts so (and so do those
    of no other context: :func:`~wowd.stores.mongo._common.mongo_name`)."""
    return f"wow_log__{mongo_name(context, field='context')}__"


def owner_match(p: int, tenant: str, agg_id: str) -> Doc:
    """One aggregate's commits, over the ``partition_order`` index's first two keys: the partition
    (or none stored: the schema leaves it out, and its value is the aggregate id's) and the
    aggregate id; the tenant (or none stored, for the default tenant: the schema's default)."""
    return {
        "partition": {"$in": [p, None]},
        "aggregate_id": agg_id,
        "tenant_id": {"$in": [tenant, None]} if tenant == DEFAULT_TENANT else tenant,
    }


def stored_tenant(doc: Mapping[str, Any]) -> Any:
    """A commit's tenant as :func:`owner_match` matches it (none stored: the default tenant)."""
    tenant = doc.get("tenant_id")
    return DEFAULT_TENANT if tenant is None else tenant


def last_version_query(ref: AggregateRef, partitions: int) -> tuple[Doc, Doc]:
    """``(filter, sort)`` of the read of one aggregate's highest version: :func:`owner_match`
    (two point intervals on the ``partition_order`` index's first key, one on its second),
    sorted on its third (the two scans merged in version order), of the integer versions only (a
    string sorts above every number: a commit whose version is no integer is the reader's to
    refuse, never the aggregate's last version)."""
    query = {**owner_match(partition(ref.id, partitions), ref.tenant_id, ref.id), "version": {"$type": ["int", "long"]}}
    return query, {"version": -1}


TIMER_EVENTS = ("TimerScheduled", "TimerCancelled")
"""The events that write a timer of the view by its key (docs/schema.md)."""


COMMITTED_AFTER_PROJECTION: Doc = {
    "_id": 0,
    "tenant_id": 1,
    "aggregate_id": 1,
    "version": 1,
    "deleted": 1,
    "events.name": 1,
    "events.body.key": 1,
}
"""What the log check reads of a commit it finds: its aggregate, version and what it does to
timers (no event bodies)."""


def committed_after_filter(probes: Sequence[tuple[int, str, str, int, str | None]]) -> Doc:
    """The filter of the log check of one log collection: per probe ``(partition, tenant, id,
    version, key)``, the aggregate's commits (:func:`owner_match`: also those stored without
    ``partition`` or, for the default tenant, without ``tenant_id``) above ``version`` that
    schedule or cancel ``key`` or delete the aggregate (any commit with ``key`` ``None``); each
    branch point intervals on the ``partition_order`` index's first two keys and a range on its
    third; on a sharded cluster each branch's aggregate id (the log's shard key) names the one
    shard that holds its commits."""
    branches: list[Doc] = []
    for p, tenant, agg_id, version, key in probes:
        branch: Doc = {**owner_match(p, tenant, agg_id), "version": {"$gt": version}}
        if key is not None:
            branch["$or"] = [
                {"deleted": True},
                {"events": {"$elemMatch": {"name": {"$in": list(TIMER_EVENTS)}, "body.key": key}}},
            ]
        branches.append(branch)
    return {"$or": branches}


def changes_timer(doc: Mapping[str, Any], key: str | None) -> bool:
    """Whether a commit the log check found may change the timer ``key`` of its aggregate."""
    if key is None or doc.get("deleted") is True:
        return True
    events = doc.get("events")
    if not isinstance(events, list):
        return False
    for e in events:
        if isinstance(e, Mapping) and e.get("name") in TIMER_EVENTS:
            body = e.get("body")
            if isinstance(body, Mapping) and body.get("key") == key:
                return True
    return False
