"""The documents the MongoDB log sends: pure builders of its filters, pipelines, updates and index
specs, the quarantine's documents, and the reading of change-stream tokens (the black-pipe tests
assert them on the wire)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import bson
from bson.decimal128 import Decimal128
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from wowd.errors import (
    InvalidInput,
)
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    AggregateType,
    Position,
    partition,
)
from wowd.stores.mongo._common import (
    HISTORY_LOST_CODES,
    collection_name,
    collection_pattern,
    mongo_name,
)

__all__ = [
    "HISTORY_LOST",
    "LOG_SHARD_KEY",
    "RESUME_POINT_GONE",
    "RESUME_TOKEN_NOT_FOUND",
    "SCAN_SORT",
    "change_stream_match",
    "change_stream_pipeline",
    "checkpoint_filter",
    "checkpoint_ids_filter",
    "checkpoint_update",
    "cluster_time_command",
    "cluster_time_of",
    "last_version_query",
    "log_collection_prefix",
    "log_indexes",
    "quarantine_doc",
    "quarantine_item",
    "quarantined_filter",
    "owner_match",
    "partition_of",
    "scan_find",
    "scan_key",
    "scan_ranges",
    "bson_order",
    "index_key",
    "stored_tenant",
    "token_cluster_time",
]


logger = logging.getLogger(__name__)
Doc = dict[str, Any]
ClusterTime = tuple[int, int]
HISTORY_LOST = 286
"""ChangeStreamHistoryLost: the resume point is no longer in the oplog."""
RESUME_TOKEN_NOT_FOUND = 280
"""ChangeStreamFatalError: the oplog covers the token's time but not its event (a token of a
rolled-back write or of another deployment); the stream cannot resume there either."""
RESUME_POINT_GONE = HISTORY_LOST_CODES
"""The answers that make the log re-read the partitions from the collections (286, 280 and 136
CappedPositionLost: the oplog was truncated under the stream's position)."""


def log_collection_prefix(context: str) -> str:
    """``wow_log__<context>__``: every log collection of the context starts so (and so do those
    of no other context: :func:`~wowd.stores.mongo._common.mongo_name`)."""
    return f"wow_log__{mongo_name(context, field='context')}__"


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


def checkpoint_id(consumer: str, partition_: int) -> Doc:
    return {"consumer": consumer, "partition": partition_}


def checkpoint_filter(consumer: str, partition_: int, fence: int) -> Doc:
    """Matches the stored checkpoint only at the same or a lower fence (the fence guard)."""
    return {"_id": checkpoint_id(consumer, partition_), "fence": {"$lte": fence}}


def checkpoint_update(position: Position, fence: int) -> list[Doc]:
    """A pipeline update (the store clock stamps ``written_at``); the position as a literal."""
    return [
        {
            "$set": {
                "position": {"$literal": position},
                "fence": fence,
                "written_at": {"$toLong": "$$NOW"},
            }
        }
    ]


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


def checkpoint_ids_filter(consumer: str, partitions: Sequence[int]) -> Doc:
    return {"_id": {"$in": [checkpoint_id(consumer, p) for p in partitions]}}


QUARANTINE_RAW_BYTES = 15 * 1024 * 1024
"""The most BSON bytes of a document a quarantine item keeps whole: the item, with its reason and
the rest, stays within the server's 16 MiB (``maxBsonObjectSize``)."""
RAW_IDENTITY = ("_id", "tenant_id", "aggregate_id", "version", "request_id", "command_id", "create_time", "partition")
"""What an item keeps of a document too large to keep whole: the fields that name the commit."""


def quarantine_doc(
    consumer: str, partition_: int, aggregate: AggregateType, raw: Mapping[str, Any], reason: str, now: datetime
) -> Doc:
    """The quarantine document: ``_id`` from the consumer, the type and the raw document's id
    (a digest of the document when it has none), so quarantining twice is idempotent. A raw
    document of more than :data:`QUARANTINE_RAW_BYTES` (a commit near the 16 MiB limit) is kept
    by its identity (:data:`RAW_IDENTITY`, each value under 1 KiB) and its size, the reason
    saying so: the item is kept, the document stays in its log collection."""
    key: Any = raw.get("_id") if "_id" in raw else _digest(raw)
    kept = dict(raw)
    size = len(bson.encode(kept))
    if size > QUARANTINE_RAW_BYTES:
        kept = {k: raw[k] for k in RAW_IDENTITY if k in raw and len(bson.encode({"v": raw[k]})) <= 1024}
        kept["raw_bytes"] = size
        reason = (
            f"{reason} (the document, {size} bytes, is too large to keep whole here: only the fields that name it "
            f"are; it stays in {collection_name('log', aggregate.context, aggregate.aggregate)})"
        )
    return {
        "_id": {"consumer": consumer, "aggregate": aggregate.aggregate, "key": key},
        "consumer": consumer,
        "partition": partition_,
        "aggregate": aggregate.aggregate,
        "raw": kept,
        "reason": reason,
        "quarantined_at": now,
    }


QUARANTINE_SEQ_ID = "seq"
"""The ``_id`` of the quarantine's counter document (``{_id: "seq", n}``), which has no ``seq``."""
SEQ_PREFIX = b"\xff\xff\xff\xff"
"""The first 4 bytes of a counted ``seq``: above every ObjectId's timestamp until 2106, so items
counted sort after the items of earlier versions (client-made ObjectIds)."""
NO_SEQ = ObjectId(b"\x00" * 12)


def counted_seq(n: int) -> ObjectId:
    """The ``seq`` of the ``n``-th quarantined item: :data:`SEQ_PREFIX` then ``n`` (8 bytes)."""
    return ObjectId(SEQ_PREFIX + n.to_bytes(8, "big"))


def seq_number(seq: Any) -> int:
    """The ``n`` of a counted ``seq`` (:func:`counted_seq`); 0 for anything else (an item of an
    earlier version, whose client-made ObjectId sorts below every counted one)."""
    if isinstance(seq, ObjectId) and seq.binary.startswith(SEQ_PREFIX):
        return int.from_bytes(seq.binary[len(SEQ_PREFIX) :], "big")
    return 0


def last_drawn(counter: Mapping[str, Any] | None, last: Mapping[str, Any] | None) -> int:
    """The highest ``seq`` number drawn: the counter document's ``n`` (a release raises it past
    the items it deletes) or the last counted item's, whichever is higher."""
    n = counter.get("n") if counter is not None else 0
    return max(n if isinstance(n, int) else 0, seq_number(last.get("seq")) if last is not None else 0)


COUNTED_FILTER: Doc = {"seq": {"$gte": counted_seq(0)}}
"""The counted items (sorted by ``seq`` descending, the first is the last drawn)."""


def quarantined_filter(after: ObjectId | None, ids: Sequence[ObjectId] | None) -> Doc:
    """The items after ``after`` and/or among ``ids``, by their ``seq`` (the order of a listing);
    every item at least (an ObjectId ``seq``: the counter document has none)."""
    seq: Doc = {"$gt": after if after is not None else NO_SEQ} if ids is None or after is not None else {}
    if ids is not None:
        seq["$in"] = list(ids)
    return {"seq": seq}


def quarantine_item(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A quarantine document as :meth:`~wowd.stores.base.Log.quarantined` answers it."""
    at = doc.get("quarantined_at")
    if isinstance(at, datetime):
        created_at = int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp() * 1000)
    else:
        created_at = 0
    item = {"id": str(doc.get("seq")), "created_at": created_at}
    item.update({k: doc.get(k) for k in ("consumer", "partition", "aggregate", "raw", "reason")})
    return item


def _object_ids(ids: Iterable[str]) -> list[ObjectId]:
    """The ObjectIds among ``ids`` (a string that is not one names nothing)."""
    return sorted({ObjectId(i) for i in ids if ObjectId.is_valid(i)})


def _digest(raw: Mapping[str, Any]) -> str:
    text = json.dumps(raw, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


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
