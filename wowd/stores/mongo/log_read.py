"""The read of the log on MongoDB (:meth:`~wowd.stores.base.Log.read`): the positions, the
partitions' re-reads from the collections and the change stream. The base of
:class:`~wowd.stores.mongo.log.MongoLog`.

Positions. A position read from the change stream is ``{"token": <resume token>,
"cluster_time": [time, inc]}``. A partition read from the collections (no checkpoint yet, or
the resume point fell off the oplog) gets ``{"cluster_time": [time, inc], "scan": {c, r, k,
s}}``: the cluster time taken *before* the scan (the majority commit point, below which no
write is still in flight: :func:`cluster_time_command`), which reads with ``majority`` read
concern and ``afterClusterTime`` of it (so it sees every commit at or before it, on every shard;
the stream starts there), and where the scan got to: its collection, its phase of
:data:`SCAN_PHASES` and, per range of the phase, the index key a later read goes on from
(:func:`scan_key`). A partition's own commits and those stored without ``partition`` are read
together, merged by aggregate id and version, so an aggregate whose commits carry ``partition``
on some only is read in version order. Each partition takes its own cut just before its scan;
when the scans run longer than ``scan_catch_up``, the partitions scanned so far are caught up by
a stream before the next cut, so no cut ages out of the oplog while the others are scanned.

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
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import anyio
import pymongo
from bson.decimal128 import Decimal128
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.timestamp import Timestamp
from pymongo.asynchronous.change_stream import AsyncDatabaseChangeStream
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern

from wowd.errors import (
    ConfigError,
    InvalidInput,
    LogBehindOplog,
    StorageError,
)
from wowd.model import (
    AggregateType,
    LogBatch,
    LogEntry,
    Position,
    commit_from_doc,
    partition,
)
from wowd.stores.mongo._common import (
    CHANGE_STREAM_UNSUPPORTED,
    HISTORY_LOST_CODES,
    Doc,
    MongoStore,
    checkpoint_collection,
    collection_pattern,
)

ClusterTime = tuple[int, int]

log = logging.getLogger(__name__)


HISTORY_LOST = 286
"""ChangeStreamHistoryLost: the resume point is no longer in the oplog."""


RESUME_TOKEN_NOT_FOUND = 280
"""ChangeStreamFatalError: the oplog covers the token's time but not its event (a token of a
rolled-back write or of another deployment); the stream cannot resume there either."""


RESUME_POINT_GONE = HISTORY_LOST_CODES
"""The answers that make the log re-read the partitions from the collections (286, 280 and 136
CappedPositionLost: the oplog was truncated under the stream's position)."""


def cluster_time_of(value: Any) -> ClusterTime | None:
    """A cluster time from a BSON ``Timestamp``, ``[time, inc]`` or ``{"t", "i"}``; else None."""
    if isinstance(value, Timestamp):
        return (value.time, value.inc)
    if isinstance(value, list | tuple) and len(value) == 2 and all(_is_int(v) for v in value):
        return (int(value[0]), int(value[1]))
    if isinstance(value, Mapping) and _is_int(value.get("t")) and _is_int(value.get("i")):
        return (int(value["t"]), int(value["i"]))
    return None


def token_cluster_time(token: Any) -> ClusterTime | None:
    """The cluster time a resume token starts with (its ``_data`` is KeyString hex whose first
    value is the event's cluster time: type byte ``82`` then 4 bytes time, 4 bytes increment)."""
    data = token.get("_data") if isinstance(token, Mapping) else None
    if not isinstance(data, str) or len(data) < 18 or not data[:2].lower() == "82":
        return None
    try:
        return (int(data[2:10], 16), int(data[10:18], 16))
    except ValueError:
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_data(token: Any) -> str | None:
    data = token.get("_data") if isinstance(token, Mapping) else None
    return data if isinstance(data, str) else None


def partition_of(doc: Mapping[str, Any], partitions: int) -> tuple[int, str | None]:
    """The partition a stored commit belongs to, and what is wrong with its ``partition`` field
    (``None``: nothing).

    The schema leaves ``partition`` out of the required fields: it is ``floorMod(Java
    String.hashCode(aggregate_id), partitions)``, computed here when the field is missing, as the
    embedded log computes it for every commit (``0`` when the aggregate id is not a string: the
    commit is quarantined for that). A number in ``[0, partitions)`` is the partition its floor
    names (the replica reading that partition's range of the index or of the stream meets it);
    it must be an integer and the aggregate id's partition, else the commit is quarantined there,
    naming ``partition``. Anything else (``null``, a string, a number out of range) is read in
    the aggregate id's partition and quarantined there, naming ``partition``: never dropped."""
    agg_id = doc.get("aggregate_id")
    computed = partition(agg_id, partitions) if isinstance(agg_id, str) else 0
    if "partition" not in doc:
        return computed, None
    stored = doc["partition"]
    number = stored.to_decimal() if isinstance(stored, Decimal128) else stored
    if isinstance(number, Decimal) and not number.is_finite():
        number = None  # NaN (which an ordering comparison refuses) or infinite: out of range
    if isinstance(number, int | float | Decimal) and not isinstance(number, bool) and 0 <= number < partitions:
        floor = int(number)
        if number != floor:
            return floor, f"is {stored!r}, not an integer"
        if floor != computed:
            return floor, f"is {floor}, but the aggregate id belongs to partition {computed} of {partitions}"
        return floor, None
    return computed, f"is {stored!r}, not an integer in [0, {partitions})"


def change_stream_match(context: str, partitions: Sequence[int], count: int) -> Doc:
    """The server-side filter: the context's log collections, inserts, the given partitions, and
    every commit whose ``partition`` is not an integer in ``[0, count)`` (missing, above all:
    the schema does not require it). Those are seen by every replica's stream and kept by the
    one holding the partition :func:`partition_of` gives them (computed from the aggregate id)."""
    return {
        "ns.coll": {"$regex": collection_pattern("log", context)},
        "operationType": "insert",
        "$or": [
            {"fullDocument.partition": {"$in": sorted(partitions)}},
            {"fullDocument.partition": {"$not": {"$type": ["int", "long"], "$gte": 0, "$lt": count}}},
        ],
    }


def change_stream_pipeline(context: str, partitions: Sequence[int], count: int) -> list[Doc]:
    """The pipeline after ``$changeStream`` (the driver adds that stage with the start point):
    the filter, then ``$changeStreamSplitLargeEvent`` (last, as it must be), which splits an
    event over 16 MiB (a commit near the document limit plus the event's own fields) into
    fragments instead of failing every ``getMore`` with BSONObjectTooLarge (10334)."""
    return [{"$match": change_stream_match(context, partitions, count)}, {"$changeStreamSplitLargeEvent": {}}]


def join_fragments(fragments: Sequence[Mapping[str, Any]]) -> Doc:
    """One change event from its ``splitEvent`` fragments (each holds some of the event's
    top-level fields); its resume token is the last fragment's."""
    event: Doc = {}
    for fragment in fragments:
        event.update((k, v) for k, v in fragment.items() if k not in ("_id", "splitEvent"))
    event["_id"] = fragments[-1]["_id"]
    return event


SCAN_INDEX = "partition_order"
"""The index a partition's re-read is bounded on (``hint`` with ``min``/``max``)."""


SCAN_SORT: list[tuple[str, int]] = [("partition", 1), ("aggregate_id", 1), ("version", 1), ("_id", 1)]
"""The order of a partition re-read: the ``partition_order`` index's (per aggregate by version)."""


SCAN_FIELDS = [f for f, _ in SCAN_SORT]


SCAN_SCHEME = 2
"""The scheme of a scan key (``s``): a key without it (of an older wowd) restarts its
collection's re-read from the start (re-reading is safe: every view is idempotent)."""


MERGED = 0
"""The phase of a re-read that reads the partition's own commits: those stored with its number
and those stored without ``partition`` (whose aggregate id it computes), merged."""


def scan_ranges(partition_: int, partitions: int) -> list[tuple[list[Any], list[Any]]]:
    """The index ranges ``(lower, upper)`` (inclusive, exclusive; the values of
    :data:`SCAN_FIELDS`) a re-read of partition ``partition_`` reads in each log collection:
    ``partition`` missing (indexed as null: the schema does not require it) and ``p`` itself,
    the two read together (:data:`MERGED`); then those holding only commits whose ``partition``
    is not an integer in range: below null (a ``MinKey``), negative numbers, between ``p`` and
    ``p + 1``, and ``[partitions, MaxKey]`` (a number out of range, a string or any other type,
    all of which sort above numbers). Of all but ``p``'s own, a re-read keeps the commits
    :func:`partition_of` gives its partition (so a producer that never writes ``partition`` has
    every partition's re-read read every commit)."""
    low, high = [MinKey()] * 3, [MaxKey()] * 3
    return [
        ([None, *low], [None, *high]),
        ([partition_, *low], [partition_, *high]),
        ([MinKey(), *low], [None, *low]),
        ([None, *high], [0, *low]),
        ([partition_, *high], [partition_ + 1, *low]),
        ([partitions, *low], [MaxKey(), *high]),
    ]


SCAN_PHASES = ((0, 1), (2,), (3,), (4,), (5,))
"""The phases of a re-read of one collection, each the ranges of :func:`scan_ranges` it reads:
the first (:data:`MERGED`) the missing ``partition`` and the partition's own, merged in
``(aggregate_id, version)`` order, so that an aggregate whose commits carry ``partition`` on some
and not on others is read in version order; then the others one after another."""


def scan_find(
    partition_: int, partitions: int, range_: int, after: Sequence[Any] | None, *, exclusive: bool = True
) -> tuple[Doc, Doc, Doc]:
    """``(filter, min, max)`` of the ``find`` of one range of :func:`scan_ranges` (sent with
    ``hint`` :data:`SCAN_INDEX` and :data:`SCAN_SORT`). Index bounds are compared in the index's
    own order, BSON order across types, so nothing malformed is skipped. ``after`` (an index key
    ``[p, a, v, id]`` in this range): from that key (inclusive), its own document left out by
    ``_id`` when ``exclusive`` (the bounds start at it, so nothing before it is read again)."""
    lower, upper = scan_ranges(partition_, partitions)[range_]
    flt: Doc = {}
    if after is not None:
        lower = list(after)
        if exclusive:
            flt = {"_id": {"$ne": after[3]}}
    return flt, dict(zip(SCAN_FIELDS, lower, strict=True)), dict(zip(SCAN_FIELDS, upper, strict=True))


def index_key(doc: Mapping[str, Any]) -> list[Any]:
    """A stored commit's key in the ``partition_order`` index (a missing field as null, as the
    index holds it)."""
    return [doc.get("partition"), doc.get("aggregate_id"), doc.get("version"), doc.get("_id")]


def scan_key(collection: str, phase: int, resume: Sequence[Sequence[Any] | None]) -> Doc:
    """Where a re-read got to: the collection, the phase (:data:`SCAN_PHASES`) and, per range of
    the phase, where to go on: ``[p, a, v, id, exclusive]`` (from that index key, the key's own
    document left out when ``exclusive``), or None (read to its end)."""
    return {"c": collection, "r": phase, "k": [list(k) if k is not None else None for k in resume], "s": SCAN_SCHEME}


_BSON_RANK = {type(None): 1, str: 3, dict: 4, list: 5, bytes: 6, ObjectId: 7, bool: 8, datetime: 9, Timestamp: 10}


def bson_order(value: Any) -> tuple[Any, ...]:
    """A sort key of ``value`` in BSON's order across types (MinKey, null, numbers, strings,
    objects, arrays, binary, ObjectId, booleans, dates, timestamps, ..., MaxKey), exact for
    numbers and strings (a string's UTF-8 bytes sort as its code points), by its text for what
    no commit holds well-formed: the merge of a re-read's two ranges (:data:`SCAN_PHASES`) takes
    the one whose next commit sorts first."""
    if isinstance(value, MinKey):
        return (0,)
    if isinstance(value, MaxKey):
        return (12,)
    if isinstance(value, Decimal128):
        value = value.to_decimal()
    if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
        return (2, 0, 0) if value != value else (2, 1, value)  # NaN sorts below every number
    rank = _BSON_RANK.get(type(value), 11)
    if rank == 3 or rank == 8:
        return (rank, value)
    if rank == 7:
        return (rank, value.binary)
    return (rank, repr(value))


def cluster_time_command(collection: str) -> Doc:
    """A read that finds nothing, with ``majority`` read concern: its ``operationTime`` is the
    majority commit point. Every write at or before that point is committed (no oplog hole
    below it), so a scan at or after it plus a stream from it miss nothing. (A ``ping``'s
    ``operationTime`` is the last applied write, which may have an earlier write still in flight
    below it: that write would be neither in the scan nor in a stream started after it.)"""
    return {
        "find": collection,
        "filter": {"_id": None},
        "limit": 1,
        "singleBatch": True,
        "readConcern": {"level": "majority"},
    }


@dataclass(slots=True)
class _Part:
    """What one partition of a read has seen (mutable, internal to :meth:`MongoLog.read`).

    With a ``token``, the partition saw the stream up to that change (at ``ct``). Without one,
    ``ct`` is a cluster time taken before a scan of the collections, which read everything at
    or before it (the scan reads with ``afterClusterTime: ct``)."""

    ct: ClusterTime | None = None
    token: Mapping[str, Any] | None = None
    scan: Mapping[str, Any] | None = None
    """A scan still to run: ``{}`` from the start, ``{c, a, v, id}`` after that document."""
    cut: bool = False
    """``ct`` is the cut this read took before scanning the partition, not streamed past yet."""

    @staticmethod
    def from_position(position: Position | None) -> _Part:
        if position is None:
            return _Part(scan={})
        if not isinstance(position, Mapping):
            raise InvalidInput(f"not a MongoDB log position: {position!r}", field="position")
        ct = cluster_time_of(position.get("cluster_time"))
        scan = position.get("scan")
        if isinstance(scan, Mapping) and ct is not None:
            return _Part(ct=ct, scan=scan)
        token = position.get("token")
        if isinstance(token, Mapping):
            return _Part(ct=ct or token_cluster_time(token), token=token)
        raise InvalidInput(f"not a MongoDB log position: {position!r}", field="position")

    def skips(self, ct: ClusterTime | None, token: Any) -> bool:
        """Whether a stream event is at or before this partition's position."""
        if self.ct is None or ct is None:
            return False
        if ct != self.ct:
            return ct < self.ct
        if self.token is None:
            return True  # the scan read everything at this cluster time
        mine, theirs = _token_data(self.token), _token_data(token)
        # Equal cluster times (one transaction): order by the token; unknown order: deliver.
        return mine is not None and theirs is not None and theirs <= mine

    def stream_start(self) -> tuple[ClusterTime, int]:
        """Sort key of where this partition needs the stream to start: a cluster time (the
        stream starts AT it) sorts before a token at the same time (the stream starts after)."""
        return (self.ct or (0, 0), 0 if self.token is None else 1)


class _HistoryLost(Exception):
    """The change stream's start point is gone (:data:`RESUME_POINT_GONE`); ``answered``: the
    stream had answered before (the start point was in the oplog when it opened)."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


CATCH_UP_AWAIT_MS = 200
"""The longest ``maxAwaitTimeMS`` of a read that does not follow (a rebuild's replay, a view
joining the shared read, a scan's catch-up): it ends at its first empty ``getMore``, so waiting
longer for commits it will not wait for only delays its end (and what waits on it). Its
positions carry the rest: a read ended early loses nothing."""


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


def _buffered(stream: AsyncDatabaseChangeStream[Doc]) -> bool:
    """Whether the stream holds more changes of the batch it received (no round trip needed).
    PyMongo has no public API for it; without one, every change ends a batch (still correct)."""
    cursor = getattr(stream, "_cursor", None)
    has_next = getattr(cursor, "_has_next", None)
    return bool(has_next()) if callable(has_next) else False


class LogReading(MongoStore):
    """The read of one context's log (module docstring): the base of
    :class:`~wowd.stores.mongo.log.MongoLog`, whose constructor sets what it reads with."""

    _label = "log"
    context: str
    partitions: int
    _max_await_ms: int
    _idle_advance_s: int | None
    _catch_up_s: float
    _prefix: str
    _pattern: str
    _observed: ClusterTime | None
    """The latest operation time the change stream's replies carried (the log check reads at or
    after it)."""

    def _aggregate_of(self, coll: str) -> AggregateType | None:
        if not re.match(self._pattern, coll):
            return None  # not this context's (another context's of a name this one starts with)
        try:
            return AggregateType(context=self.context, aggregate=coll[len(self._prefix) :])
        except (ConfigError, InvalidInput):
            log.warning("ignoring collection %s: not a valid aggregate name", coll)
            return None

    async def _log_collections(self, session: AsyncClientSession | None = None) -> list[str]:
        with self._call("list"):
            names = await self._db.list_collection_names(
                session=session, filter={"name": {"$regex": collection_pattern("log", self.context)}}
            )
        return sorted(n for n in names if self._aggregate_of(n) is not None)

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
                log.warning(
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
            reply = await self._db.command(cluster_time_command(checkpoint_collection(self.context)), session=session)
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
