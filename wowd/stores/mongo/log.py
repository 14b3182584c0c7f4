"""The log on MongoDB (docs/schema.md): commit collections, change-stream tailing,
fenced checkpoints and the quarantine.

Collections (``<ctx>`` the context):

- ``wow_log__<ctx>__<aggregate>``: one document per commit (:func:`wowd.model.commit_to_doc`),
  ``_id: {t, a, v}``; unique ``{aggregate_id, request_id}`` (idempotent appends) and
  ``{partition, aggregate_id, version, _id}`` (the partition re-read's order).
- ``wow_checkpoint__<ctx>``: ``{_id: {consumer, partition}, position, fence, written_at}``.
- ``wow_quarantine__<ctx>``: documents the feed cannot read or apply, with the reason
  (:mod:`wowd.stores.mongo.log_quarantine`, the store's base).

Positions. A position read from the change stream is ``{"token": <resume token>,
"cluster_time": [time, inc]}``. A partition read from the collections (no checkpoint yet, or
the resume point fell off the oplog) gets ``{"cluster_time": [time, inc], "scan": {c, r, k,
s}}``: the cluster time taken *before* the scan (the majority commit point, below which no
write is still in flight: :func:`cluster_time_command`), which reads with ``majority`` read
concern and ``afterClusterTime`` of it (so it sees every commit at or before it, on every shard;
the stream starts there), and where the scan got to: its collection, its phase of
:data:`~wowd.stores.mongo.log_queries.SCAN_PHASES` and, per range of the phase, the index key a
later read goes on from (:func:`~wowd.stores.mongo.log_queries.scan_key`). A partition's own
commits and those stored without ``partition`` are read together, merged by aggregate id and
version, so an aggregate whose commits carry ``partition`` on some only is read in version
order.
Each partition takes its own cut just before its scan; when the scans run longer than
``scan_catch_up``, the partitions scanned so far are caught up by a stream before the next cut,
so no cut ages out of the oplog while the others are scanned.

The stream is one ``watch`` on the database from the oldest position of the partitions read,
started at that position's cluster time (``startAtOperationTime``: a token of any partition,
of any ``$match``, resumes); each partition skips what is at or before its own position (cluster
time, then the resume token's ``_data``). A partition that sees nothing for ``idle_advance`` is
moved to the stream's post-batch resume token (a high-water mark, never another partition's
event). The stream runs without the client's ``timeoutMS`` (``pymongo.timeout(0)``): a first
``aggregate`` scanning a long stretch of oplog may take longer than any call deadline; the server
bounds each empty ``getMore`` by ``maxAwaitTimeMS`` (``max_await`` for a read that follows;
at most :data:`CATCH_UP_AWAIT_MS` for one that ends when caught up, which an empty ``getMore``
tells at once). Events over 16 MiB come split (``$changeStreamSplitLargeEvent``, 7.0+) and are
joined again.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager, suppress
from datetime import timedelta
from typing import Any

import anyio
import pymongo
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient, InsertOne, UpdateOne
from pymongo.asynchronous.change_stream import AsyncDatabaseChangeStream
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from wowd.errors import (
    ConfigError,
    ConflictError,
    FormatError,
    InvalidInput,
    LogBehindOplog,
    StorageError,
)
from wowd.model import (
    AggregateRef,
    AggregateType,
    Checkpoint,
    Commit,
    LogBatch,
    LogEntry,
    Position,
    commit_from_doc,
    commit_to_doc,
    partition,
)
from wowd.stores.base import AppendOutcome, Ddl, OwnerProbe, consumers_of
from wowd.stores.mongo._common import (
    ALREADY_INITIALIZED,
    CANNOT_CREATE_INDEX,
    CHANGE_STREAM_UNSUPPORTED,
    DEFAULT_OPERATION_TIMEOUT,
    MongoSharding,
    checkpoint_collection,
    collection_name,
    collection_pattern,
    duplicate_keys,
    write_one,
)
from wowd.stores.mongo.log_quarantine import LogQuarantine
from wowd.stores.mongo.log_queries import (
    COMMITTED_AFTER_PROJECTION,
    LOG_SHARD_KEY,
    MERGED,
    RESUME_POINT_GONE,
    SCAN_INDEX,
    SCAN_PHASES,
    SCAN_SCHEME,
    SCAN_SORT,
    ClusterTime,
    Doc,
    _HistoryLost,
    _Part,
    bson_order,
    change_stream_pipeline,
    changes_timer,
    checkpoint_filter,
    checkpoint_ids_filter,
    checkpoint_update,
    cluster_time_command,
    cluster_time_of,
    committed_after_filter,
    index_key,
    join_fragments,
    last_version_query,
    log_collection_prefix,
    log_indexes,
    logger,
    partition_of,
    quarantine_indexes,
    scan_find,
    scan_key,
    stored_tenant,
    token_cluster_time,
)

log = logging.getLogger(__name__)

__all__ = ["MongoLog"]

CATCH_UP_AWAIT_MS = 200
"""The longest ``maxAwaitTimeMS`` of a read that does not follow (a rebuild's replay, a view
joining the shared read, a scan's catch-up): it ends at its first empty ``getMore``, so waiting
longer for commits it will not wait for only delays its end (and what waits on it). Its
positions carry the rest: a read ended early loses nothing."""


class MongoLog(LogQuarantine):
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
        super().__init__(client_or_uri, database_name, context=context, operation_timeout=operation_timeout)
        self.partitions = partitions
        self._ddl = Ddl(ddl)
        self._sharding = MongoSharding(sharding)
        self._max_await_ms = max(1, int(max_await.total_seconds() * 1000))
        self._idle_advance_s = int(idle_advance.total_seconds()) if idle_advance is not None else None
        self._catch_up_s = scan_catch_up.total_seconds()
        self._prefix = log_collection_prefix(context)
        self._pattern = collection_pattern("log", context)
        self._checkpoints: AsyncCollection[Doc] = self._db[checkpoint_collection(context)]
        self._ensured: set[str] = set()
        self._observed: ClusterTime | None = None
        """The latest operation time the change stream's replies carried (:meth:`committed_after`
        reads at or after it)."""

    # ------------------------------------------------------------------ plumbing

    def collection_name(self, aggregate: str) -> str:
        """``wow_log__<context>__<aggregate>``."""
        return collection_name("log", self.context, aggregate)

    def _aggregate_of(self, coll: str) -> AggregateType | None:
        if not re.match(self._pattern, coll):
            return None  # not this context's (another context's of a name this one starts with)
        try:
            return AggregateType(context=self.context, aggregate=coll[len(self._prefix) :])
        except (ConfigError, InvalidInput):
            logger.warning("ignoring collection %s: not a valid aggregate name", coll)
            return None

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
                    await self._create_indexes(name, log_indexes(sharded=sharded), logger)
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
            await self._shard_collection(name, LOG_SHARD_KEY, self._sharding, logger, what="log", bounded=False)
        except OperationFailure as exc:
            if exc.code != ALREADY_INITIALIZED:
                raise
            logger.info("log collection %s is sharded on another key than %s, left so: %s", name, LOG_SHARD_KEY, exc)

    async def _validate(self, name: str, indexes: Sequence[Doc]) -> None:
        """:class:`FormatError` naming the first of ``indexes`` (name, keys, unique) ``name`` lacks."""
        with self._call("prepare"):
            info = await self._db[name].index_information()
        for spec in indexes:
            found = info.get(spec["name"]) or {}
            if (dict(found.get("key", [])), found.get("unique", False)) != (spec["key"], spec.get("unique", False)):
                raise FormatError(f"mongodb {name}: index {spec['name']} {spec['key']} is missing")

    async def _log_collections(self, session: AsyncClientSession | None = None) -> list[str]:
        with self._call("list"):
            names = await self._db.list_collection_names(
                session=session, filter={"name": {"$regex": collection_pattern("log", self.context)}}
            )
        return sorted(n for n in names if self._aggregate_of(n) is not None)

    # ------------------------------------------------------------------ DDL, health

    async def prepare(self) -> None:
        """Creates (AUTO) or checks (VALIDATE) the indexes of the existing log collections and
        of the quarantine. Idempotent."""
        if self._ddl is Ddl.NONE:
            return
        for name in await self._log_collections():
            await self._ensure(name)
        if self._ddl is Ddl.AUTO:
            with self._call("prepare", bounded=False):
                await self._create_indexes(self._quarantine.name, quarantine_indexes(), logger)
        else:
            await self._validate(self._quarantine.name, quarantine_indexes())

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

    def read(
        self, positions: Mapping[int, Position | None], *, batch_size: int = 500, follow: bool = True
    ) -> AsyncIterator[LogBatch]:
        """Partitions without a position are first re-read from the collections (by
        ``partition``, ``(aggregate_id, version)``), then one change stream on the database
        serves every partition from the oldest position. A lost resume point (code 286 or 280)
        re-reads the partitions at that oldest position and restarts the stream at the cluster
        time taken before the re-read (or at the next oldest position, should that be older).
        A stream that had answered and loses its history a second time in one read (the reader
        is slower than the oplog window) raises :class:`~wowd.errors.LogBehindOplog` instead of
        re-reading again."""
        for p in positions:
            if not 0 <= p < self.partitions:
                raise ConfigError(f"partition {p} is outside [0, {self.partitions})")
        return self._read(dict(positions), max(1, batch_size), follow)

    async def _read(
        self, positions: dict[int, Position | None], batch_size: int, follow: bool
    ) -> AsyncIterator[LogBatch]:
        if not positions:
            if follow:
                await anyio.sleep_forever()  # nothing to tail, but a follower never ends by itself
            return
        parts = {p: _Part.from_position(pos) for p, pos in positions.items()}
        lost_while_following = 0
        while True:
            try:
                async with aclosing(self._scan(parts, batch_size)) as scanned:
                    async for batch in scanned:
                        yield batch
                async with aclosing(self._stream(parts, batch_size, follow)) as streamed:
                    async for batch in streamed:
                        yield batch
                return
            except _HistoryLost as exc:
                # the stream started from the oldest position: those partitions are re-read (a
                # partition whose checkpoint is still in the oplog keeps it; should the next
                # oldest be gone too, the next attempt says so and re-reads that one)
                oldest = min(s.stream_start() for s in parts.values())
                lost = sorted(p for p, s in parts.items() if s.stream_start() == oldest)
                if not exc.answered and any(parts[p].cut for p in lost):
                    # the cut this read took before scanning left the oplog while it scanned:
                    # scanning again would only lose it again
                    raise StorageError(
                        f"mongodb log {self.context}: the scan of partitions {lost} took longer than "
                        "the oplog window (the change stream cannot start at the cut taken before "
                        f"it: {exc}); keep more oplog: raise the replica set's oplogMinRetentionHours "
                        "or oplog size (replSetResizeOplog)"
                    ) from exc
                if exc.answered:
                    lost_while_following += 1
                if lost_while_following > 1:
                    # the stream answered, then fell off the oplog; re-read, it did so again: the
                    # reader is slower than the oplog window and re-reading would loop for ever
                    raise LogBehindOplog(
                        f"mongodb log {self.context}: the change stream of partitions {lost} fell behind "
                        "the oplog window again after they were re-read (ChangeStreamHistoryLost while "
                        f"following: {exc}); the feed reads slower than the oplog keeps history: keep more "
                        "oplog (the replica set's oplogMinRetentionHours, or replSetResizeOplog) or give the "
                        "feed more replicas",
                        partitions=tuple(lost),
                    ) from exc
                logger.warning(
                    "log %s: change stream history lost; re-reading partitions %s from the collections "
                    "(once: should the stream fall behind the oplog window again, the read stops with "
                    "LogBehindOplog)",
                    self.context,
                    lost,
                )
                for p in lost:
                    parts[p] = _Part(scan={})

    async def _cluster_time(self, session: AsyncClientSession) -> ClusterTime:
        """The majority commit point (the ``operationTime`` of :func:`cluster_time_command`)."""
        with self._call("cluster_time"):
            reply = await self._db.command(cluster_time_command(self._checkpoints.name), session=session)
        ct = cluster_time_of(reply.get("operationTime"))
        if ct is None:
            raise ConfigError(
                "MongoDB gave no cluster time: the log needs a replica set or a sharded cluster "
                "(change streams); a one-node replica set will do"
            )
        return ct

    async def _scan(self, parts: dict[int, _Part], batch_size: int) -> AsyncGenerator[LogBatch, None]:
        """Scans the partitions that need it, one after another, each after its own cut; once
        the scans have run for ``scan_catch_up`` since the oldest cut not streamed past, the
        partitions done so far are caught up by a stream before the next cut."""
        pending = sorted(p for p, s in parts.items() if s.scan is not None)
        oldest_cut: float | None = None
        for p in pending:
            if oldest_cut is not None and time.monotonic() - oldest_cut >= self._catch_up_s:
                done = {q: s for q, s in parts.items() if s.scan is None}
                covers = frozenset(done)
                async with aclosing(self._stream(done, batch_size, follow=False)) as streamed:
                    async for batch in streamed:
                        # its watermark holds for the partitions it reads, not those still to scan
                        yield dataclasses.replace(batch, covers=covers) if batch.watermark is not None else batch
                oldest_cut = None
            # a causally consistent session: the scan reads at or after the cut (afterClusterTime)
            # with majority read concern, so on every shard it sees each commit at or before it
            async with self._client.start_session(causal_consistency=True) as session:
                t0 = await self._cluster_time(session)
                session.advance_operation_time(Timestamp(*t0))
                s = parts[p]
                if s.ct is None:  # a resumed scan keeps its original cut: the stream starts there
                    s.ct, s.token, s.cut = t0, None, True
                if oldest_cut is None:
                    oldest_cut = time.monotonic()
                async with aclosing(self._scan_partition(p, s, batch_size, session)) as scanned:
                    async for batch in scanned:
                        yield batch
            s.scan = None

    async def _scan_partition(
        self, p: int, s: _Part, batch_size: int, session: AsyncClientSession
    ) -> AsyncGenerator[LogBatch, None]:
        """Each log collection's phases of :data:`SCAN_PHASES` in order, each range one ``find``
        bounded on the ``partition_order`` index (:func:`scan_find`), from the scan key when
        resumed: first the partition's own commits and those stored without ``partition``,
        merged in ``(aggregate_id, version)`` order; then the other ranges. Of the ranges
        besides the partition's own, only the commits whose partition (:func:`partition_of`) is
        ``p``."""
        assert s.ct is not None and s.scan is not None
        names = await self._log_collections(session)
        after = s.scan
        ct = list(s.ct)
        entries: list[LogEntry] = []
        for name in names:
            if after and name < str(after.get("c", "")):
                continue
            aggregate = self._aggregate_of(name)
            assert aggregate is not None
            key = after if after and name == after.get("c") and after.get("s") == SCAN_SCHEME else None
            first = int(key.get("r", MERGED)) if key else MERGED
            coll = self._db.get_collection(name, read_concern=ReadConcern("majority"))
            for phase in range(first, len(SCAN_PHASES)):
                resume = key.get("k") if key is not None and phase == first else None
                docs = self._scan_phase(coll, p, phase, resume, batch_size, session)
                async with aclosing(docs) as scanned:
                    async for doc, resumed in scanned:
                        if partition_of(doc, self.partitions)[0] != p:
                            continue  # another partition's commit stored without a regular partition
                        position: Position = {"cluster_time": ct, "scan": scan_key(name, phase, resumed)}
                        entries.append(self._entry(position, p, aggregate, doc))
                        if len(entries) >= batch_size:
                            yield _batch(entries)
                            entries = []
        if entries:
            yield _batch(entries)

    async def _scan_phase(
        self,
        coll: AsyncCollection[Doc],
        p: int,
        phase: int,
        resume: Sequence[Sequence[Any] | None] | None,
        batch_size: int,
        session: AsyncClientSession,
    ) -> AsyncGenerator[tuple[Doc, list[list[Any] | None]], None]:
        """The documents of one phase's ranges (:data:`SCAN_PHASES`), merged in
        ``(aggregate_id, version)`` order (:func:`bson_order`; a tie goes to the first range),
        each with where the phase goes on after it: its own range after its key, each other
        range at its next document (or done)."""
        ranges = SCAN_PHASES[phase]
        cursors: list[_Cursor | None] = []
        for i, range_ in enumerate(ranges):
            start = resume[i] if resume is not None and i < len(resume) else None
            if resume is not None and start is None:
                cursors.append(None)  # read to its end before
                continue
            flt, lower, upper = scan_find(
                p, self.partitions, range_, start[:4] if start else None, exclusive=bool(start and start[4])
            )
            find = coll.find(
                flt, sort=SCAN_SORT, batch_size=batch_size, session=session, hint=SCAN_INDEX, min=lower, max=upper
            )
            cursors.append(_Cursor(find, batch_size, lambda: self._call("scan")))
        try:
            heads = [await c.next() if c is not None else None for c in cursors]
            while True:
                live = [i for i, h in enumerate(heads) if h is not None]
                if not live:
                    return
                i = min(live, key=lambda j: (_merge_order(heads[j]), j))
                doc = heads[i]
                assert doc is not None
                cursor = cursors[i]
                assert cursor is not None
                heads[i] = await cursor.next()
                resumed: list[list[Any] | None] = [
                    [*index_key(doc), True] if j == i else ([*index_key(h), False] if h is not None else None)
                    for j, h in enumerate(heads)
                ]
                yield doc, resumed
        finally:
            for c in cursors:
                if c is not None:
                    await c.close()

    async def _stream(self, parts: dict[int, _Part], batch_size: int, follow: bool) -> AsyncGenerator[LogBatch, None]:
        if not parts:
            return
        start = min(parts.values(), key=_Part.stream_start)
        kwargs: dict[str, Any] = {}
        if start.ct is not None:
            # at the position's cluster time (each partition skips what it saw): a token of
            # another partition or of another $match resumes too, where startAfter would not (280)
            kwargs["start_at_operation_time"] = Timestamp(*start.ct)
        else:
            kwargs["start_after"] = start.token
        pipeline = change_stream_pipeline(self.context, list(parts), self.partitions)
        async with self._client.start_session(causal_consistency=False) as session:
            with self._stream_errors("watch", answered=False):
                stream = await self._db.watch(
                    pipeline,
                    batch_size=batch_size,
                    max_await_time_ms=self._max_await_ms if follow else min(self._max_await_ms, CATCH_UP_AWAIT_MS),
                    session=session,
                    **kwargs,
                )
            # a read that does not follow ends once its stream has passed the cluster time of the
            # reply that opened it (every commit acknowledged before the read is at or below it),
            # or at an empty getMore, whichever first: a log that keeps receiving commits has no
            # empty getMore to end on
            until = None if follow else cluster_time_of(session.operation_time)
            async with aclosing(self._stream_batches(stream, parts, batch_size, follow, until)) as batches:
                async for batch in batches:
                    self._observe(session.operation_time)
                    yield batch

    async def _stream_batches(
        self,
        stream: Any,
        parts: dict[int, _Part],
        batch_size: int,
        follow: bool,
        until: ClusterTime | None,
    ) -> AsyncGenerator[LogBatch, None]:
        answered = False
        try:
            entries: list[LogEntry] = []
            fragments: list[Mapping[str, Any]] = []
            last_event: Any = None
            while True:
                with self._stream_errors("getMore", answered=answered):
                    change = await stream.try_next()
                answered = True
                if change is not None and isinstance(change.get("splitEvent"), Mapping):
                    fragments.append(change)
                    split = change["splitEvent"]
                    if split.get("fragment") != split.get("of"):
                        continue  # the rest of the event is in the next fragments
                    change, fragments = join_fragments(fragments), []
                if change is not None:
                    last_event = change.get("_id")
                    entry = self._change_entry(change, parts)
                    if entry is not None:
                        entries.append(entry)
                    if len(entries) < batch_size and _buffered(stream):
                        continue  # the rest of the server's batch is here already
                # the server's batch is all here: its post-batch resume token's time is the watermark
                watermark = _watermark(stream.resume_token) if change is None or not _buffered(stream) else None
                if entries:
                    yield _batch(entries, watermark)
                    entries = []
                idle = self._idle_positions(parts, stream.resume_token, last_event)
                if idle or (change is None and watermark is not None):
                    yield LogBatch(entries=(), positions=idle, watermark=watermark)
                if change is None and not stream.alive:
                    # the server closed the cursor (an invalidate: the database was dropped);
                    # try_next would answer None at once from now on, a busy loop
                    raise StorageError(
                        f"mongodb log {self.context}: the change stream was closed by the server "
                        "(invalidated: was the database dropped?)"
                    )
                if change is None and not follow:
                    return  # caught up: a getMore came back empty
                if until is not None and not _buffered(stream):
                    passed = token_cluster_time(stream.resume_token)
                    if passed is not None and passed > until:
                        return  # past what was committed when the read began
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5), suppress(PyMongoError):
                await stream.close()

    @contextmanager
    def _stream_errors(self, operation: str, *, answered: bool) -> Iterator[None]:
        """The stream's calls without the client's ``timeoutMS`` (``pymongo.timeout(0)``: a
        first ``aggregate`` over a long stretch of oplog may take longer than any call deadline;
        ``timeout(None)`` would fall back to the client's). :data:`RESUME_POINT_GONE` becomes
        :class:`_HistoryLost` (handled by :meth:`_read`), 40573 a :class:`ConfigError`; the rest
        as :meth:`_call` translates it."""
        with self._call(operation, bounded=False), pymongo.timeout(0):
            try:
                yield
            except OperationFailure as exc:
                if exc.code in RESUME_POINT_GONE:
                    raise _HistoryLost(str(exc), answered=answered) from exc
                if exc.code == CHANGE_STREAM_UNSUPPORTED:
                    raise ConfigError(
                        "MongoDB refused a change stream: the log needs a replica set or a "
                        f"sharded cluster, not a standalone server ({exc})"
                    ) from exc
                raise

    def _observe(self, operation_time: Any) -> None:
        ct = cluster_time_of(operation_time)
        if ct is not None and (self._observed is None or ct > self._observed):
            self._observed = ct

    def _idle_positions(
        self, parts: dict[int, _Part], token: Mapping[str, Any] | None, last_event: Any
    ) -> dict[int, Position]:
        """Moves partitions that saw nothing for ``idle_advance`` to the stream's resume token,
        so a quiet partition's checkpoint does not fall off the oplog. Only a high-water-mark
        token (the post-batch resume token past the last event): the token of an event of
        another partition is never stored as this partition's position."""
        if self._idle_advance_s is None or token is None or token == last_event:
            return {}
        ct = token_cluster_time(token)
        if ct is None:
            return {}
        moved: dict[int, Position] = {}
        for p, s in parts.items():
            if s.scan is None and s.ct is not None and ct[0] - s.ct[0] >= self._idle_advance_s:
                s.ct, s.token, s.cut = ct, dict(token), False
                moved[p] = {"token": dict(token), "cluster_time": list(ct)}
        return moved

    def _change_entry(self, change: Mapping[str, Any], parts: dict[int, _Part]) -> LogEntry | None:
        ns = change.get("ns") or {}
        aggregate = self._aggregate_of(str(ns.get("coll", "")))
        doc = change.get("fullDocument")
        if aggregate is None or not isinstance(doc, Mapping):
            return None
        p = partition_of(doc, self.partitions)[0]
        if p not in parts:
            return None  # another replica's (a commit without a regular partition reaches every stream)
        s = parts[p]
        token = change.get("_id")
        ct = cluster_time_of(change.get("clusterTime")) or token_cluster_time(token)
        if s.skips(ct, token):
            return None
        s.ct, s.token, s.cut = ct, token, False
        position: Position = {"token": token, "cluster_time": list(ct) if ct else None}
        return self._entry(position, p, aggregate, doc)

    def _entry(self, position: Position, p: int, aggregate: AggregateType, doc: Mapping[str, Any]) -> LogEntry:
        """The entry of a commit read in partition ``p`` (:func:`partition_of`'s): a commit, or
        what is wrong with it (the commit's fields first, then its ``partition``)."""
        try:
            commit = commit_from_doc(aggregate, doc)
            wrong = partition_of(doc, self.partitions)[1]
            if wrong is not None:
                raise InvalidInput(wrong, field="partition")
        except (InvalidInput, ConfigError) as exc:
            return LogEntry(position=position, partition=p, aggregate=aggregate, commit=None, raw=doc, error=str(exc))
        return LogEntry(position=position, partition=p, aggregate=aggregate, commit=commit, raw=doc)

    # ------------------------------------------------------------------ checkpoints

    async def checkpoints(self, consumer: str, partitions: Sequence[int]) -> dict[int, Checkpoint]:
        if not partitions:
            return {}
        out: dict[int, Checkpoint] = {}
        with self._call("checkpoints"):
            async for d in self._checkpoints.find(checkpoint_ids_filter(consumer, partitions)):
                p = d["_id"]["partition"]
                out[p] = Checkpoint(
                    consumer=consumer,
                    partition=p,
                    position=dict(d.get("position") or {}),
                    fence=int(d.get("fence", 0)),
                    written_at=int(d.get("written_at", 0)),
                )
        return out

    async def save_checkpoints(
        self, consumer: str | Sequence[str], positions: Mapping[int, Position], fence: int
    ) -> bool:
        """One unordered bulk of the upserts :meth:`save_checkpoint` sends; an E11000 item (a
        higher fence holds that partition) makes the answer False."""
        if not positions:
            return True
        ops = [
            UpdateOne(checkpoint_filter(c, p, fence), checkpoint_update(_bson_position(pos), fence), upsert=True)
            for c in consumers_of(consumer)
            for p, pos in sorted(positions.items())
        ]
        with self._call("save_checkpoint"):
            try:
                await self._checkpoints.bulk_write(ops, ordered=False)
            except BulkWriteError as exc:
                duplicate_keys(exc, "log save_checkpoints")  # a higher fence holds one
                return False
        return True

    async def save_checkpoint(self, consumer: str, partition: int, position: Position, fence: int) -> bool:
        """One upsert filtered on the fence guard; E11000 (a higher fence holds it) is False, but
        E11000 with a write concern error :class:`StorageUnavailable` (:func:`write_one`)."""
        with self._call("save_checkpoint"):
            try:
                await write_one(
                    self._checkpoints,
                    UpdateOne(
                        checkpoint_filter(consumer, partition, fence),
                        checkpoint_update(_bson_position(position), fence),
                        upsert=True,
                    ),
                    "log.save_checkpoint",
                )
            except DuplicateKeyError:
                return False
        return True


# --------------------------------------------------------------------------- helpers


class _Cursor:
    """A re-read's ``find`` read a batch at a time, a document at a time."""

    def __init__(self, cursor: Any, batch_size: int, call: Any) -> None:
        self._cursor = cursor
        self._batch_size = batch_size
        self._call = call
        self._docs: list[Doc] = []
        self._done = False

    async def next(self) -> Doc | None:
        if not self._docs and not self._done:
            with self._call():
                self._docs = list(reversed(await self._cursor.to_list(self._batch_size)))
            self._done = not self._docs
        return self._docs.pop() if self._docs else None

    async def close(self) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5), suppress(PyMongoError):
            await self._cursor.close()


def _merge_order(doc: Doc | None) -> tuple[Any, ...]:
    """Where a document of a re-read's merged ranges sorts: by aggregate id, then version."""
    assert doc is not None
    return (bson_order(doc.get("aggregate_id")), bson_order(doc.get("version")))


def _batch(entries: list[LogEntry], watermark: int | None = None) -> LogBatch:
    positions: dict[int, Position] = {}
    for e in entries:
        positions[e.partition] = e.position
    return LogBatch(entries=tuple(entries), positions=positions, watermark=watermark)


def _watermark(token: Mapping[str, Any] | None) -> int | None:
    """The watermark of a change stream's post-batch resume token: the start (ms) of its cluster
    time's second. Every event of the stream's partitions with an earlier cluster time has been
    returned; a commit appended before it by the primary's clock has such a cluster time while
    the cluster time follows that clock (it runs ahead only after the clock stepped back).
    Second-grained: a timer fires up to about a second after its due time, plus the stream's
    wait (``maxAwaitTimeMS``) when the log is quiet."""
    ct = token_cluster_time(token) if token is not None else None
    return ct[0] * 1000 if ct is not None else None


def _probe_order(probe: tuple[int, str, str, int, str | None]) -> tuple[int, str, str, int, str]:
    """The order of the log check's branches (a stable filter for a stable set of probes)."""
    p, tenant, agg_id, version, key = probe
    return (p, tenant, agg_id, version, key if key is not None else "")


def _buffered(stream: AsyncDatabaseChangeStream[Doc]) -> bool:
    """Whether the stream holds more changes of the batch it received (no round trip needed).
    PyMongo has no public API for it; without one, every change ends a batch (still correct)."""
    cursor = getattr(stream, "_cursor", None)
    has_next = getattr(cursor, "_has_next", None)
    return bool(has_next()) if callable(has_next) else False


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


def _bson_position(position: Position) -> Position:
    """A position as stored: a cluster time as ``[time, inc]`` (JSON- and BSON-friendly)."""
    out = dict(position)
    ct = cluster_time_of(out.get("cluster_time"))
    if ct is not None:
        out["cluster_time"] = list(ct)
    return out
