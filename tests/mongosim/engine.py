"""The simulated replica-set primary: commands, storage, cluster time, oplog, change streams,
transactions, fail points. One lock serialises every command (each runs atomically); waits
(``maxAwaitTimeMS``, ``blockTimeMS``, a transaction in progress) happen outside it.

Documents live in a ``mongomock`` client; filters, update operators, sorts and aggregation
stages are mongomock's (:mod:`tests.mongosim.evaluate` adds what it lacks). docs/mongosim.md
lists every behaviour modelled and every limit with its source.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import datetime
import hashlib
import itertools
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import bson
import mongomock
from bson.binary import Binary
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

from tests.mongosim import evaluate
from tests.mongosim.evaluate import Failure, _Ordered, check_filter, get_path, matches, run_pipeline, sort_docs

__all__ = ["Connection", "Engine", "Settings"]

logger = logging.getLogger(__name__)

MAX_BSON_OBJECT = 16 * 1024 * 1024
"""``maxBsonObjectSize`` (src/mongo/bson/util/builder.h: BSONObjMaxUserSize)."""
MAX_WRITE_BATCH = 100_000
"""``maxWriteBatchSize`` (src/mongo/s/write_ops/batched_command_request.h, write_ops::kMaxWriteBatchSize)."""
MAX_PIPELINE_STAGES = 1000
"""``internalPipelineLengthLimit`` (src/mongo/db/query/query_knobs.idl)."""
MAX_DB_NAME = 63
"""Database names are at most 64 bytes less one (manual, "MongoDB Limits and Thresholds")."""
MAX_NAMESPACE = 255
"""A namespace ``<db>.<coll>`` is at most 255 bytes (same page, 4.4+)."""
MAX_INDEXES = 64
"""Indexes per collection (same page)."""
DEFAULT_BATCH = 101
"""The first batch of a ``find``/``aggregate`` without ``batchSize`` (manual, "Cursors")."""
MAX_SCANS_TO_EXPLODE = 200
"""``internalQueryMaxScansToExplode`` (src/mongo/db/query/query_knobs.idl): the most point
intervals the planner turns into index scans merged in the sort's order; above, a server plans a
blocking sort (or another index) instead. The opt-in plan check's bound, never an error."""
SLOW_COMMAND_S = 2.0
"""A command (not a waiting ``getMore`` or ``hello``) that took longer is logged, with its target."""
TRANSACTION_LIFETIME_S = 60
"""``transactionLifetimeLimitSeconds``: a transaction older is aborted (manual, "Production
Considerations" of transactions)."""

CODE_NAMES = {
    2: "BadValue",
    9: "FailedToParse",
    11: "UserNotFound",
    13: "Unauthorized",
    14: "TypeMismatch",
    16: "InvalidLength",
    20: "IllegalOperation",
    23: "AlreadyInitialized",
    26: "NamespaceNotFound",
    27: "IndexNotFound",
    43: "CursorNotFound",
    48: "NamespaceExists",
    50: "MaxTimeMSExpired",
    59: "CommandNotFound",
    64: "WriteConcernFailed",
    67: "CannotCreateIndex",
    70: "ShardNotFound",
    72: "InvalidOptions",
    73: "InvalidNamespace",
    85: "IndexOptionsConflict",
    86: "IndexKeySpecsConflict",
    91: "ShutdownInProgress",
    112: "WriteConflict",
    118: "NamespaceNotSharded",
    136: "CappedPositionLost",
    189: "PrimarySteppedDown",
    197: "InvalidIndexSpecificationOption",
    251: "NoSuchTransaction",
    256: "TransactionCommitted",
    263: "OperationNotSupportedInTransaction",
    280: "ChangeStreamFatalError",
    286: "ChangeStreamHistoryLost",
    10107: "NotWritablePrimary",
    10334: "BSONObjectTooLarge",
    11000: "DuplicateKey",
    11600: "InterruptedAtShutdown",
    11602: "InterruptedDueToReplStateChange",
    13435: "NotPrimaryNoSecondaryOk",
    225: "TransactionTooOld",
    291: "NoQueryExecutionPlans",
    17419: "Location17419",
    40415: "Location40415",
    40324: "Location40324",
    40573: "Location40573",
}
RETRYABLE_CODES = {6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436}
"""The codes a 4.4+ server labels ``RetryableWriteError`` on a retryable write (retryable
writes specification, "Determining Retryable Errors")."""
GENERIC_FIELDS = {
    "$db",
    "lsid",
    "$clusterTime",
    "txnNumber",
    "autocommit",
    "startTransaction",
    "$readPreference",
    "comment",
    "apiVersion",
    "apiStrict",
    "apiDeprecationErrors",
    "maxTimeMS",
    "readConcern",
    "writeConcern",
}
"""Fields every command takes (the generic arguments of src/mongo/idl/generic_argument.idl)."""


@dataclass
class Settings:
    """What the simulated deployment does (all times in seconds)."""

    set_name: str = "wowdsim"
    noop_interval: float = 10.0
    """``periodicNoopIntervalSecs``: a no-op oplog entry when nothing else was written for it."""
    oplog_window: float | None = None
    """History older than this is truncated (None: kept); a change stream starting before the
    oldest entry left answers 286 ChangeStreamHistoryLost."""
    ttl_interval: float = 60.0
    """``ttlMonitorSleepSecs``: how often the TTL monitor deletes expired documents."""
    max_wire_version: int = 21
    """7.0."""
    plan_check: bool = False
    """A test-only check, no server's: a sorted ``find``/``aggregate`` whose sort an index could
    give only by merging more than :data:`MAX_SCANS_TO_EXPLODE` point scans (its ``$in`` values
    and ``$or`` branches on the keys before the sort's) is recorded in
    :attr:`Engine.plan_findings` (and logged); the query is answered as a server answers it."""
    shards: int = 0
    """0: a replica-set primary; N: a ``mongos`` of a sharded cluster of N shards (each with
    its own cluster-time clock, oplog and periodic no-op writer; the data in one store)."""
    election_timeout_ms: int = 10_000
    """The replica set's ``settings.electionTimeoutMillis`` (``replSetGetConfig`` answers it)."""
    table_scan_limit: int | None = None
    """As ``notablescan``, beyond a small collection: a query that only a collection scan can
    answer (no index its filter or sort can use) is refused (291) on a collection of more
    documents than this (None: never)."""
    scan_seconds_per_doc: float = 0.0
    """What examining one document costs a read (``find``, ``aggregate``, ``count``,
    ``distinct``): the time its answer takes, which ``maxTimeMS`` bounds (0: no time)."""
    index_build_seconds_per_doc: float = 0.0
    """What an index build costs per document of the collection: ``createIndexes`` answers
    after it (its ``maxTimeMS`` aborts the build), the index usable only then."""


@dataclass(eq=False)
class Connection:
    """One client connection (its socket, its handshake's ``appName``)."""

    sock: socket.socket | None
    id: int
    app_name: str | None = None


@dataclass
class StepDownTrigger:
    """A step-down made when a command named ``command`` (of client ``app_name``, if given)
    arrives: before it runs (it is interrupted, 11602) or after it applied (the reply lost with
    the connection, or a ``w: majority`` wait ended by it: a write concern error, 189)."""

    command: str
    seconds: float
    after_apply: bool
    app_name: str | None = None
    close_connection: bool = False


@dataclass
class Event:
    """One oplog entry's operation as a change stream shows it (``op`` ``n`` is a no-op)."""

    ts: Timestamp
    index: int
    op: str
    db: str
    coll: str
    key: Any = None
    doc: dict[str, Any] | None = None
    update: dict[str, Any] | None = None
    wall: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).replace(tzinfo=None))
    txn: dict[str, Any] | None = None
    shard: int = 0
    """The shard whose oplog holds the entry (a sharded cluster; 0 otherwise)."""
    pre: dict[str, Any] | None = None
    """The document before an update, a replacement or a delete (a read of an earlier point in
    time undoes the entry with it: :meth:`Engine._as_of`)."""


@dataclass
class Shard:
    """One shard of a sharded cluster: its clock, the time of its oplog's last entry, when it
    last wrote (its no-op writer's idleness)."""

    name: str
    ct: Timestamp
    last: Timestamp
    last_write: float


@dataclass
class Chunk:
    """A range of a sharded collection's shard key values from ``min`` (the next chunk's
    ``min`` is its end) and the shard owning it."""

    min: list[Any]
    shard: int


@dataclass
class ShardedCollection:
    key: dict[str, Any]
    uuid: uuid.UUID
    chunks: list[Chunk]


@dataclass
class Cursor:
    id: int
    ns: str
    docs: list[dict[str, Any]] = field(default_factory=list)
    stream: ChangeStream | None = None
    lsid: Any = None


@dataclass
class ChangeStream:
    db: str
    coll: str | None
    after: tuple[int, int, int, int]
    """Events with a key above this are returned (see :func:`_event_key`)."""
    pipeline: list[dict[str, Any]]
    split: bool
    full_document: str
    last_token: dict[str, Any]
    pending: list[dict[str, Any]] = field(default_factory=list)
    behind: bool = False
    """The last scan stopped short of the oplog's end (:meth:`Engine._collect`)."""
    gate: Callable[[Event], bool] | None = None
    """False for an entry the pipeline's leading ``$match`` surely excludes (:func:`_stream_gate`)."""


@dataclass
class Txn:
    lsid: bytes
    number: int
    started: float
    undo: list[tuple[str, str, Any, dict[str, Any] | None]] = field(default_factory=list)
    touched: set[tuple[str, str, bytes]] = field(default_factory=set)
    """The documents it wrote: another writer of one of them meets a write conflict."""
    events: list[Event] = field(default_factory=list)
    created: list[tuple[str, str]] = field(default_factory=list)


def _ts_key(ts: Timestamp) -> tuple[int, int]:
    return (ts.time, ts.inc)


SCAN_STEP = 500
"""How many oplog entries one change-stream scan reads before it lets the other commands run."""

_GATE_FIELDS = ("operationType", "ns.coll")
"""What an oplog entry tells before its event document is made (:func:`_stream_gate`)."""


def _stream_gate(pipeline: list[dict[str, Any]]) -> Callable[[Event], bool] | None:
    """A cheap test of an oplog entry against the top-level ``operationType`` and ``ns.coll``
    conditions of a change stream's leading ``$match`` (each must hold: a filter's top-level
    conditions are ANDed, manual "Query Documents"), run by mongomock's match on those two
    fields before the event document is made: an entry it rejects could not pass the
    ``$match``. The full match still decides the rest."""
    if not pipeline or set(pipeline[0]) != {"$match"} or not isinstance(pipeline[0]["$match"], dict):
        return None
    flt = {k: v for k, v in pipeline[0]["$match"].items() if k in _GATE_FIELDS}
    if not flt:
        return None

    def gate(e: Event) -> bool:
        # a database's drop has no ns.coll, as its event has none
        ns = {"db": e.db} if e.op == "dropDatabase" else {"db": e.db, "coll": e.coll}
        with _evaluating():
            return matches(flt, {"operationType": e.op, "ns": ns})

    return gate


def _event_key(e: Event) -> tuple[int, int, int, int]:
    return (e.ts.time, e.ts.inc, 128, e.index)


def token_of(key: tuple[int, int, int, int], fragment: int | None = None) -> dict[str, Any]:
    """A resume token: hex ``_data`` ordered like the server's KeyString (``82``, the cluster
    time, the token type: 00 high-water mark, 80 event; the operation's index in its entry)."""
    data = f"82{key[0]:08X}{key[1]:08X}{key[2]:02X}{key[3]:08X}"
    if fragment is not None:
        data += f"{fragment:08X}"
    return {"_data": data}


def key_of_token(token: Any) -> tuple[int, int, int, int]:
    data = token.get("_data") if isinstance(token, Mapping) else None
    if not isinstance(data, str) or len(data) < 28 or not data.startswith("82"):
        raise Failure(2, f"KeyString format error: invalid resume token {token!r}")
    try:
        return (int(data[2:10], 16), int(data[10:18], 16), int(data[18:20], 16), int(data[20:28], 16))
    except ValueError:
        raise Failure(2, f"KeyString format error: invalid resume token {token!r}") from None


def _hashable(value: Any) -> bytes:
    """A key of ``value`` equal for BSON-equal values: numbers of one value (1, 1.0, Int64(1)) as
    one (Decimal128 is not folded), documents field order included as BSON compares them."""
    return bson.encode({"v": _canonical(value)})


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return Int64(int(value))
    if isinstance(value, int):
        return Int64(value) if -(2**63) <= value < 2**63 else float(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _bson_size(doc: Mapping[str, Any]) -> int:
    return len(bson.encode(doc))


class Engine:
    """The state of the simulated primary and the commands it runs."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.set_name = self.settings.set_name
        self.address = "127.0.0.1:27017"
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.data: dict[tuple[str, str], dict[bytes, dict[str, Any]]] = {}
        self.order: dict[tuple[str, str], dict[bytes, int]] = {}
        """Each stored document's place in its collection's natural order (a candidate set read
        through a field index is put in that order without walking the whole collection)."""
        self._places = itertools.count()
        self.fields: dict[tuple[str, str], dict[str, dict[Any, set[bytes]]]] = {}
        """Field indexes built as queries use the fields: (db, coll) -> path -> value key -> the
        documents' store keys (the value key ``_COMPLEX``: documents every query considers)."""
        self.uniques: dict[tuple[str, str], dict[str, dict[bytes, bytes]]] = {}
        """The unique indexes' maps: (db, coll) -> index name -> key -> the holder's store key."""
        self._mm = mongomock.MongoClient()["mongosim"]["updates"]
        """A mongomock collection whose update-operator code the updates run (it stores nothing)."""
        self.catalog: dict[tuple[str, str], dict[str, Any]] = {}
        """(db, coll) -> {"uuid", "indexes": [spec...]}"""
        self.ct = Timestamp(int(time.time()), 1)
        self.majority: Timestamp | None = None
        """The majority commit point when held back (None: it follows every write)."""
        self.oplog: list[Event] = []
        self.truncated_before: tuple[int, int] = (0, 0)
        self.cursors: dict[int, Cursor] = {}
        self.failpoints: dict[str, dict[str, Any]] = {}
        self.txns: dict[bytes, Txn] = {}
        """The open transactions by session."""
        self.txn: Txn | None = None
        """The transaction of the command being run (None: not in one)."""
        self._deadline: float | None = None
        """The ``maxTimeMS`` deadline of the command being run."""
        self.commands: dict[str, int] = {}
        """How many of each command were run (the wire counts)."""
        self.command_counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        """How many commands were run by (client ``appName``, command, collection): the target
        collection of a CRUD or DDL command, a ``getMore``'s cursor's, ``""`` for the others."""
        self.plan_findings: list[str] = []
        """What the opt-in plan check found (``Settings.plan_check``)."""
        self.stream_batches: collections.Counter[str] = collections.Counter()
        """Change-stream batches that carried events and their events, by client ``appName``
        (``<app>:batches``, ``<app>:events``)."""
        self._ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._cursor_ids = itertools.count(1000)
        self._stop = threading.Event()
        self._last_write = time.monotonic()
        self._process_id = ObjectId()
        self._election_id = ObjectId("7fffffff0000000000000001")
        self.shards: list[Shard] = [
            Shard(f"shard{i}", self.ct, self.ct, self._last_write) for i in range(self.settings.shards)
        ]
        """The shards of a sharded cluster (empty: a replica set); shard 0 is every database's
        primary shard."""
        self.sharded: dict[tuple[str, str], ShardedCollection] = {}
        self.writable = True
        """A writable primary; False between a step-down and the next election."""
        self.term = 1
        """The election term (each election makes a new one: ``electionId``)."""
        self.topology_counter = 0
        """``topologyVersion.counter``: moves on every change of the member's state."""
        self.topology_changed = threading.Condition(threading.Lock())
        """What an awaitable ``hello`` waits on (a lock of its own: a write's wake-up of the
        other waits does not wake it)."""
        self.conns: set[Connection] = set()
        self.retryable: dict[bytes, tuple[int, dict[str, Any]]] = {}
        """Per session, the last retryable write's ``txnNumber`` and its reply (the server's
        transaction table: a retry of the same number answers the recorded result)."""
        self.step_down_triggers: list[StepDownTrigger] = []
        """Step-downs to make when a command of a name arrives (:meth:`step_down_on`)."""
        self._timers: list[threading.Timer] = []
        self._tls = threading.local()
        """The command's own: ``cost``, the time its reads' work takes (:meth:`_spend`)."""
        self._threads = [
            threading.Thread(target=self._noop_writer, name="mongosim-noop", daemon=True),
            threading.Thread(target=self._ttl_monitor, name="mongosim-ttl", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ connections

    def connect(self, sock: socket.socket | None) -> Connection:
        conn = Connection(sock=sock, id=next(self._ids))
        with self.lock:
            self.conns.add(conn)
        return conn

    def disconnect(self, conn: Connection) -> None:
        with self.lock:
            self.conns.discard(conn)

    def next_request_id(self) -> int:
        return next(self._request_ids)

    def shutdown(self) -> None:
        self._stop.set()
        for timer in self._timers:
            timer.cancel()
        with self.changed:
            self.changed.notify_all()
        self._topology_moved()

    def _topology_moved(self) -> None:
        with self.topology_changed:
            self.topology_changed.notify_all()

    # ------------------------------------------------------------------ elections

    def step_down(
        self,
        seconds: float,
        *,
        close_connections: bool = False,
        majority_at: Timestamp | None = None,
        majority_for: float = 0.0,
    ) -> None:
        """The primary steps down (``replSetStepDown``, or it lost its majority): no writable
        primary for ``seconds``, then an election makes a new one, of a new term (it writes a
        "new primary" no-op first, as src/mongo/db/repl/replication_coordinator_impl.cpp does).

        Meanwhile, as a 4.2+ member steps down (manual, "replSetStepDown": writes in progress are
        killed, connections stay): a write answers 10107 NotWritablePrimary ("not primary"), a
        read of primary read preference 13435 NotPrimaryNoSecondaryOk, both labelled
        ``RetryableWriteError`` on a retryable write (the driver retries them once a primary is
        elected); a ``w: majority`` wait in progress ends with a write concern error 189
        PrimarySteppedDown ("Primary stepped down while waiting for replication"); ``hello``
        says ``secondary`` and names no primary (an awaitable ``hello`` is answered at once).
        ``close_connections``: the member went away instead (a crash, a partition): every
        connection is closed and its cursors are gone (a change stream resumes on the new
        primary). ``majority_at``: the new primary's majority commit point stays there for
        ``majority_for`` seconds (a new primary of 7.0 may answer majority reads from a stale
        commit point after an election, SERVER-53813, fixed in 8.0): majority reads answer the
        documents as they were then."""
        with self.changed:
            self.writable = False
            self.topology_counter += 1
            if close_connections:
                for conn in list(self.conns):
                    if conn.sock is not None:
                        with contextlib.suppress(OSError):
                            conn.sock.shutdown(socket.SHUT_RDWR)
                self.cursors.clear()
            self.changed.notify_all()
        self._topology_moved()
        timer = threading.Timer(seconds, self._elect, kwargs={"majority_at": majority_at, "majority_for": majority_for})
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def step_down_on(self, trigger: StepDownTrigger) -> None:
        """Steps down when the next command ``trigger`` names arrives (mid-command)."""
        with self.lock:
            self.step_down_triggers.append(trigger)

    def _elect(self, *, majority_at: Timestamp | None, majority_for: float) -> None:
        with self.changed:
            if self._stop.is_set():
                return
            self.writable = True
            self.term += 1
            self.topology_counter += 1
            self._election_id = ObjectId(f"7fffffff{self.term:016x}")
            self._append([Event(Timestamp(0, 0), 0, "n", "admin", "$cmd.noop", doc={"msg": "new primary"})])
            if majority_at is not None:
                self.majority = majority_at
                timer = threading.Timer(majority_for, self.release_majority)
                timer.daemon = True
                self._timers.append(timer)
                timer.start()
            self.changed.notify_all()
        self._topology_moved()

    def _triggered(self, conn: Connection, name: str, *, after_apply: bool) -> StepDownTrigger | None:
        if not self.step_down_triggers:  # most commands: no lock taken for it
            return None
        with self.lock:
            for t in self.step_down_triggers:
                if t.command == name and t.after_apply == after_apply and t.app_name in (None, conn.app_name):
                    self.step_down_triggers.remove(t)
                    return t
        return None

    # ------------------------------------------------------------------ time

    def _tick(self, shard: int | None = None) -> Timestamp:
        """The cluster time of a new oplog entry: the wall clock's second, or one increment past
        the last entry when the clock has not moved on (src/mongo/db/logical_clock.cpp). On a
        sharded cluster the shard's own clock ticks, first advanced to the ``mongos``'s time
        (every command the ``mongos`` sends a shard gossips its ``$clusterTime``, and an open
        change stream's ``getMore`` reaches every shard); the ``mongos`` then knows the later."""
        now = int(time.time())
        if shard is None or not self.shards:
            self.ct = Timestamp(now, 1) if now > self.ct.time else Timestamp(self.ct.time, self.ct.inc + 1)
            self._last_write = time.monotonic()
            return self.ct
        s = self.shards[shard]
        base = self.ct if _ts_key(self.ct) > _ts_key(s.ct) else s.ct
        s.ct = Timestamp(now, 1) if now > base.time else Timestamp(base.time, base.inc + 1)
        s.last = s.ct
        s.last_write = time.monotonic()
        if _ts_key(s.ct) > _ts_key(self.ct):
            self.ct = s.ct
        return s.ct

    def merged_point(self) -> Timestamp:
        """What a change stream may show: the majority commit point, and on a sharded cluster no
        later than the oldest of the shards' last oplog entries (the ``mongos`` merges the
        shards' streams in cluster-time order, so it returns an event only once every shard has
        shown it nothing earlier remains: the slowest shard holds the stream back)."""
        point = self.majority_point()
        for s in self.shards:
            if _ts_key(s.last) < _ts_key(point):
                point = s.last
        return point

    def noop(self, shard: int | None = None) -> None:
        """Writes the periodic no-op entry now (on ``shard`` of a sharded cluster; None: the
        primary, or every shard): what the no-op writer does once an interval is idle."""
        with self.changed:
            shards = ([shard] if shard is not None else list(range(len(self.shards)))) if self.shards else []
            if not self.shards:
                self._append([Event(Timestamp(0, 0), 0, "n", "admin", "$cmd.noop")])
            for i in shards:
                self._append([Event(Timestamp(0, 0), 0, "n", "admin", "$cmd.noop", shard=i)])

    def majority_point(self) -> Timestamp:
        return self.ct if self.majority is None else self.majority

    def hold_majority(self) -> None:
        """The majority commit point stops at the current cluster time (secondaries lag)."""
        with self.lock:
            self.majority = self.ct

    def release_majority(self) -> None:
        with self.changed:
            self.majority = None
            self.changed.notify_all()

    def _append(self, events: list[Event]) -> None:
        if self.txn is not None:
            self.txn.events.extend(events)
            return
        if self.shards:
            # one entry per shard written (a transaction across shards: one per participant)
            for shard in dict.fromkeys(e.shard for e in events):
                ts = self._tick(shard)
                for i, e in enumerate(e for e in events if e.shard == shard):
                    e.ts, e.index = ts, i
                    self.oplog.append(e)  # the gossiped clocks: past every entry before it
            self._truncate()
            self.changed.notify_all()
            return
        ts = self._tick()
        for i, e in enumerate(events):
            e.ts, e.index = ts, i
        self.oplog.extend(events)
        self._truncate()
        self.changed.notify_all()

    def _truncate(self, now: float | None = None) -> None:
        """Drops the entries older than the oplog window (the newest entry is always kept)."""
        window = self.settings.oplog_window
        if window is None or not self.oplog:
            return
        cutoff = (time.time() if now is None else now) - window
        n = 0
        while n < len(self.oplog) - 1 and self.oplog[n].ts.time < cutoff:
            n += 1
        if n:
            self.truncated_before = _ts_key(self.oplog[n].ts)
            del self.oplog[:n]

    def _noop_writer(self) -> None:
        """The primary's periodic no-op (``periodicNoopIntervalSecs``, src/mongo/db/repl/
        noop_writer.cpp): an entry only when nothing else was written for an interval."""
        interval = self.settings.noop_interval
        while not self._stop.wait(interval / 4 if interval > 0 else 1):
            with self.changed:
                if interval <= 0:
                    continue
                if not self.shards and time.monotonic() - self._last_write >= interval:
                    self._append([Event(Timestamp(0, 0), 0, "n", "admin", "$cmd.noop")])
                for i, s in enumerate(self.shards):  # each shard's writer sees its own writes only
                    if time.monotonic() - s.last_write >= interval:
                        self.noop(i)

    def _ttl_monitor(self) -> None:
        while not self._stop.wait(self.settings.ttl_interval):
            self.expire()

    def expire(self) -> int:
        """One pass of the TTL monitor (manual, "TTL Indexes"): deletes every document whose
        indexed Date (or earliest Date of an array) is ``expireAfterSeconds`` past, within the
        index's partial filter; each delete is an oplog entry. Answers how many."""
        removed = 0
        with self.changed:
            now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
            for (db, coll), meta in list(self.catalog.items()):
                for spec in meta["indexes"]:
                    if "expireAfterSeconds" not in spec or len(spec["key"]) != 1:
                        continue
                    (path,) = spec["key"]
                    limit = now - datetime.timedelta(seconds=int(spec["expireAfterSeconds"]))
                    pfe = spec.get("partialFilterExpression")
                    for doc in list(self._docs(db, coll)):
                        value = get_path(doc, path)
                        dates = [
                            v
                            for v in (value if isinstance(value, list) else [value])
                            if isinstance(v, datetime.datetime)
                        ]
                        if (
                            dates
                            and min(d.replace(tzinfo=None) for d in dates) <= limit
                            and (pfe is None or matches(pfe, doc))
                        ):
                            try:
                                self._remove(db, coll, doc)
                                removed += 1
                            except _Retry:
                                pass  # a transaction held it: the next pass decides
        return removed

    # ------------------------------------------------------------------ storage

    def _coll(self, db: str, coll: str) -> dict[bytes, dict[str, Any]]:
        """The documents of a collection by :func:`_key` of their ``_id``, in insertion order."""
        return self.data.setdefault((db, coll), {})

    def _docs(self, db: str, coll: str) -> list[dict[str, Any]]:
        if (db, coll) not in self.catalog:
            return []
        return list(self._coll(db, coll).values())

    def _ensure(self, db: str, coll: str, *, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        meta = self.catalog.get((db, coll))
        if meta is None:
            _check_namespace(db, coll)
            meta = {
                "uuid": uuid.uuid4(),
                "indexes": [{"v": 2, "key": {"_id": 1}, "name": "_id_"}],
                "options": dict(options or {}),
            }
            self.catalog[(db, coll)] = meta
            if self.txn is not None:
                self.txn.created.append((db, coll))
            self._append([Event(Timestamp(0, 0), 0, "create", db, coll)])
        return meta

    def _store_key(self, _id: Any) -> bytes:
        return _hashable(_id)

    def _doc_key(self, db: str, coll: str, doc: Mapping[str, Any]) -> bytes:
        """The store key of ``doc``: its ``_id``, and in a sharded collection its shard's name
        too. Each shard holds its own ``_id`` index, unique on that shard only (manual, "Shard
        Key Indexes": "the _id index only enforces the uniqueness constraint per shard if the
        _id field is not the shard key"), so two shards may hold one ``_id``."""
        if self.shards and (db, coll) in self.sharded:
            return _hashable({"s": self._route(db, coll, doc), "_id": doc["_id"]})
        return _hashable(doc["_id"])

    def _unique_entry(self, spec: Mapping[str, Any], doc: Mapping[str, Any], shard: int = 0) -> bytes | None:
        """The key of ``doc`` in the unique index ``spec`` on ``shard`` (None: outside its partial
        filter). Each shard checks its own documents only (manual, "Maintain Uniqueness in
        Sharded Clusters"); the shard key is a prefix of every unique index of a sharded
        collection (``createIndexes``, ``shardCollection`` refuse others), so equal keys are on
        one shard."""
        pfe = spec.get("partialFilterExpression")
        if pfe is not None and not matches(pfe, doc):
            return None
        return _hashable([shard, *(get_path(doc, p) for p in spec["key"])])

    def _shard_of(self, db: str, coll: str, doc: Mapping[str, Any]) -> int:
        return self._route(db, coll, doc) if self.shards and (db, coll) in self.sharded else 0

    def _rekey(self, db: str, coll: str) -> None:
        """Stores a collection's documents under their keys again (:meth:`_doc_key`) after its
        sharding or a chunk's move, and its unique indexes' maps; two documents of one ``_id``
        meeting on one shard: E11000, as the migration's insert on the recipient would answer."""
        store = self._coll(db, coll)
        rekeyed: dict[bytes, dict[str, Any]] = {}
        for doc in store.values():
            key = self._doc_key(db, coll, doc)
            if key in rekeyed:
                raise Failure(11000, f"E11000 duplicate key error collection: {db}.{coll} index: _id_ dup key: "
                                     f"{{ _id: {doc['_id']!r} }}")  # fmt: skip
            rekeyed[key] = doc
        self.data[(db, coll)] = rekeyed
        self.order[(db, coll)] = {k: next(self._places) for k in rekeyed}
        self.fields.pop((db, coll), None)  # rebuilt at the next query
        maps: dict[str, dict[bytes, bytes]] = {}
        for spec in self._unique_specs(db, coll):
            m = maps[spec["name"]] = {}
            for key, doc in rekeyed.items():
                k = self._unique_entry(spec, doc, self._shard_of(db, coll, doc))
                if k is not None:
                    m[k] = key
        self.uniques[(db, coll)] = maps

    def _unique_specs(self, db: str, coll: str) -> list[dict[str, Any]]:
        return [ix for ix in self.catalog[(db, coll)]["indexes"] if ix.get("unique")]

    def _put(self, db: str, coll: str, key: bytes, new: dict[str, Any] | None) -> None:
        """Stores ``new`` under ``key`` (None: removes it), keeping the unique indexes' maps."""
        store = self._coll(db, coll)
        old = store.get(key)
        maps = self.uniques.setdefault((db, coll), {})
        if (db, coll) in self.catalog:
            for spec in self._unique_specs(db, coll):
                m = maps.setdefault(spec["name"], {})
                if old is not None:
                    k = self._unique_entry(spec, old, self._shard_of(db, coll, old))
                    if k is not None and m.get(k) == key:
                        del m[k]
                if new is not None:
                    k = self._unique_entry(spec, new, self._shard_of(db, coll, new))
                    if k is not None:
                        m[k] = key
        for path, index in self.fields.get((db, coll), {}).items():
            if old is not None:
                index.setdefault(evaluate.field_value(old, path), set()).discard(key)
            if new is not None:
                index.setdefault(evaluate.field_value(new, path), set()).add(key)
        order = self.order.setdefault((db, coll), {})
        if new is None:
            store.pop(key, None)
            order.pop(key, None)
        else:
            if key not in store:
                order[key] = next(self._places)
            store[key] = new

    def _check_unique(self, db: str, coll: str, doc: dict[str, Any], self_key: Any) -> None:
        """E11000 when another document has ``doc``'s key in a unique index (``_id`` included)."""
        other = self._coll(db, coll).get(self._doc_key(db, coll, doc))
        specs: list[tuple[dict[str, Any], Any]] = []
        if other is not None and self._doc_key(db, coll, other) != self_key:
            specs.append(({"key": {"_id": 1}, "name": "_id_"}, other))
        maps = self.uniques.get((db, coll), {})
        for spec in self._unique_specs(db, coll):
            k = self._unique_entry(spec, doc, self._shard_of(db, coll, doc))
            holder = None if k is None else maps.get(spec["name"], {}).get(k)
            if holder is not None and holder != self_key:
                specs.append((spec, holder))
        for spec, _ in specs[:1]:
            paths = list(spec["key"])
            values = {p: get_path(doc, p) for p in paths}
            shown = ", ".join(f"{p}: {v!r}" for p, v in values.items())
            raise Failure(
                11000,
                f"E11000 duplicate key error collection: {db}.{coll} index: {spec['name']} dup key: {{ {shown} }}",
                extra={"keyPattern": dict(spec["key"]), "keyValue": values},
            )

    def _check_size(self, doc: Mapping[str, Any], *, update: bool) -> None:
        size = _bson_size(doc)
        if size > MAX_BSON_OBJECT:
            if update:
                raise Failure(17419, f"Resulting document after update is larger than {MAX_BSON_OBJECT}")
            raise Failure(
                10334,
                f"BSONObj size: {size} (0x{size:X}) is invalid. Size must be between 0 and {MAX_BSON_OBJECT}(16MB)",
            )

    def _insert(self, db: str, coll: str, doc: dict[str, Any]) -> Any:
        self._ensure(db, coll)
        if "_id" not in doc:
            doc = {"_id": ObjectId(), **doc}
        elif next(iter(doc)) != "_id":
            doc = {"_id": doc["_id"], **{k: v for k, v in doc.items() if k != "_id"}}
        if isinstance(doc["_id"], list):
            raise Failure(2, "can't use an array for _id")
        _check_field_names(doc)
        self._check_size(doc, update=False)
        key = self._doc_key(db, coll, doc)
        self._claim_doc(db, coll, key)
        self._check_unique(db, coll, doc, object())
        doc = copy.deepcopy(doc)
        self._put(db, coll, key, doc)
        if self.txn is not None:
            self.txn.undo.append((db, coll, key, None))
        self._append(
            [
                Event(
                    Timestamp(0, 0),
                    0,
                    "insert",
                    db,
                    coll,
                    key={"_id": doc["_id"]},
                    doc=doc,
                    shard=self._route(db, coll, doc),
                )
            ]
        )
        return doc["_id"]

    def _replace_stored(
        self, db: str, coll: str, old: dict[str, Any], new: dict[str, Any], update: dict[str, Any] | None
    ) -> None:
        if new.get("_id", old["_id"]) != old["_id"]:
            raise Failure(
                66,
                f"After applying the update, the (immutable) field "
                f"'_id' was found to have been altered to _id: {new.get('_id')!r}",
            )
        new = {"_id": old["_id"], **{k: v for k, v in new.items() if k != "_id"}}
        _check_field_names(new)
        self._check_size(new, update=True)
        key = self._doc_key(db, coll, old)
        if self._shard_of(db, coll, new) != self._shard_of(db, coll, old):
            raise Failure(
                2, "mongosim: an update that moves a document to another shard (its shard key) is not modelled"
            )
        self._claim_doc(db, coll, key)
        self._check_unique(db, coll, new, key)
        if self.txn is not None:
            self.txn.undo.append((db, coll, key, copy.deepcopy(old)))
        new = copy.deepcopy(new)
        self._put(db, coll, key, new)
        op = "replace" if update is None else "update"
        shard = self._route(db, coll, old)
        self._append(
            [
                Event(
                    Timestamp(0, 0),
                    0,
                    op,
                    db,
                    coll,
                    key={"_id": old["_id"]},
                    doc=new,
                    update=update,
                    shard=shard,
                    pre=old,
                )  # fmt: skip
            ]
        )

    def _remove(self, db: str, coll: str, doc: dict[str, Any]) -> None:
        key = self._doc_key(db, coll, doc)
        self._claim_doc(db, coll, key)
        if self.txn is not None:
            self.txn.undo.append((db, coll, key, copy.deepcopy(doc)))
        self._put(db, coll, key, None)
        shard = self._route(db, coll, doc)
        self._append([Event(Timestamp(0, 0), 0, "delete", db, coll, key={"_id": doc["_id"]}, shard=shard, pre=doc)])

    def _id_lookup(self, db: str, coll: str, flt: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """The candidates of an ``_id`` equality or ``$in`` of plain values through the ``_id``
        index (the full match still decides); None when the filter is not such."""
        if "_id" not in flt:
            return None
        _id = flt["_id"]
        if isinstance(_id, dict) and any(k.startswith("$") for k in _id):
            if set(_id) != {"$in"} or not isinstance(_id["$in"], list):
                return None
            values = _id["$in"]
        else:
            values = [_id]
        if any(
            isinstance(v, list | re.Pattern | Regex) or isinstance(v, dict) and any(str(k).startswith("$") for k in v)
            for v in values
        ):
            return None
        store = self._coll(db, coll) if (db, coll) in self.catalog else {}
        sharded = bool(self.shards) and (db, coll) in self.sharded
        hits = {}
        for v in values:
            for k in [_hashable({"s": s, "_id": v}) for s in range(len(self.shards))] if sharded else [_hashable(v)]:
                if k in store:
                    hits[k] = store[k]
        return list(hits.values())

    def _candidates(
        self, db: str, coll: str, flt: Mapping[str, Any] | None, view: Mapping[bytes, dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The documents that may match ``flt``: through a field index (built at the first
        query on the field, kept by every write) for each top-level equality or ``$in`` of
        strings or integral numbers, all of them otherwise; all of ``view`` (:meth:`_view`)
        when given. Never copies. What a read examines is its cost (:meth:`_spend`)."""
        if view is not None:
            return self._examined(db, coll, flt, list(view.values()))
        if (db, coll) not in self.catalog:
            return []
        store = self._coll(db, coll)
        keys = self._candidate_keys(db, coll, flt or {})
        if keys is None:
            return self._examined(db, coll, flt, list(store.values()))
        if len(keys) * 8 < len(store):  # a few of many: by their places, not a walk of the collection
            order = self.order.get((db, coll), {})
            found = sorted((k for k in keys if k in store), key=lambda k: order.get(k, -1))
            return self._examined(db, coll, flt, [store[k] for k in found])
        return self._examined(db, coll, flt, [d for k, d in store.items() if k in keys])  # in natural order

    def _candidate_keys(self, db: str, coll: str, flt: Mapping[str, Any]) -> set[bytes] | None:
        """The store keys of the documents that may match ``flt`` by its top-level equalities
        and ``$in`` lists (intersected), and by a top-level ``$or`` whose every branch has such a
        condition (the union of the branches', as a server's OR plan scans an index per clause:
        manual, "$or Clauses and Indexes"); None when nothing narrows it."""
        keys: set[bytes] | None = None
        for path, cond in flt.items():
            found: set[bytes] | None = None
            if path == "$or" and isinstance(cond, list) and cond and all(isinstance(b, Mapping) for b in cond):
                found = set()
                for branch in cond:
                    of_branch = self._candidate_keys(db, coll, branch)
                    if of_branch is None:
                        found = None
                        break
                    found |= of_branch
            elif not path.startswith("$"):
                wanted = evaluate.indexable(cond)
                if wanted is not None:
                    index = self._field_index(db, coll, path)
                    found = set(index.get(evaluate._COMPLEX, ()))
                    for w in wanted:
                        found |= index.get(w, set())
            if found is not None:
                keys = found if keys is None else keys & found
        return keys

    def _field_index(self, db: str, coll: str, path: str) -> dict[Any, set[bytes]]:
        """The field index of ``path`` (value key -> the documents' store keys), built at its first
        use and kept by every write (:meth:`_put`)."""
        index = self.fields.setdefault((db, coll), {}).get(path)
        if index is None:
            index = self.fields[(db, coll)][path] = {}
            for k, d in self._coll(db, coll).items():
                index.setdefault(evaluate.field_value(d, path), set()).add(k)
        return index

    def _examined(
        self, db: str, coll: str, flt: Mapping[str, Any] | None, docs: list[dict[str, Any]], *, indexed: bool = False
    ) -> list[dict[str, Any]]:
        """``docs`` (the candidates), their examination counted in the command's cost: as many
        as a server examines, the collection's documents when no index can answer ``flt`` (and
        the read is not ``indexed`` by its bounds)."""
        per_doc = self.settings.scan_seconds_per_doc
        if per_doc:
            meta = self.catalog.get((db, coll))
            indexed = indexed or (meta is not None and _uses_index(flt or {}, meta["indexes"]))
            examined = len(docs) if indexed else max(len(docs), len(self._coll(db, coll)))
            self._tls.cost = getattr(self._tls, "cost", 0.0) + examined * per_doc
        return docs

    def _find(
        self,
        db: str,
        coll: str,
        flt: Mapping[str, Any],
        view: Mapping[bytes, dict[str, Any]] | None = None,
        *,
        candidates: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        check_filter(flt)
        docs = self._id_lookup(db, coll, flt) if view is None and candidates is None else candidates
        if docs is None:
            docs = self._candidates(db, coll, flt, view)
        with _evaluating():
            return evaluate.select(flt, docs)

    def _view(self, db: str, coll: str, cmd: Mapping[str, Any]) -> dict[bytes, dict[str, Any]] | None:
        """What a read of ``cmd`` sees of a collection when that is not its latest state (None:
        the latest state). Another session's open transaction's writes are not seen (manual,
        "Transactions": "data changes made in the transaction are not visible outside the
        transaction" until it commits): their documents read as before it. A read with
        ``readConcern: majority`` sees the majority-committed state (manual, "Read Concern
        "majority""): the writes after the majority commit point are undone, from the oplog."""
        point = None
        rc = cmd.get("readConcern") or {}
        if rc.get("level") == "majority" and self.majority is not None and _ts_key(self.majority) < _ts_key(self.ct):
            point = _ts_key(self.majority)
        others = [t for t in self.txns.values() if t is not self.txn and any(u[:2] == (db, coll) for u in t.undo)]
        if point is None and not others:
            return None
        docs = dict(self._coll(db, coll)) if (db, coll) in self.catalog else {}
        for t in others:
            seen: set[bytes] = set()
            for d, c, key, old in t.undo:
                if (d, c) == (db, coll) and key not in seen:
                    seen.add(key)
                    if old is None:
                        docs.pop(key, None)
                    else:
                        docs[key] = old
        if point is not None:
            for e in reversed(self.oplog):
                if _ts_key(e.ts) <= point:
                    break
                if e.db != db or e.coll != coll:
                    continue
                if e.op == "insert" and e.doc is not None:
                    docs.pop(self._doc_key(db, coll, e.doc), None)
                elif e.op in ("update", "replace", "delete") and e.pre is not None:
                    docs[self._doc_key(db, coll, e.pre)] = e.pre
        return docs

    def _check_scan(
        self, db: str, coll: str, flt: Mapping[str, Any] | None, sort: Any = None, hint: Any = None
    ) -> None:
        """``notablescan`` beyond :attr:`Settings.table_scan_limit` documents: a query no index
        can answer (none its filter's top-level conditions or every branch of its ``$or`` can
        bound, a partial index only when the filter implies its partial filter; none giving its
        sort; no ``hint``) is refused, 291 NoQueryExecutionPlans, as a server started with
        ``notablescan`` refuses it (manual, "notablescan"; src/mongo/db/query/
        query_planner.cpp: "No indexed plans available, and running with 'notablescan'")."""
        limit = self.settings.table_scan_limit
        meta = self.catalog.get((db, coll))
        if limit is None or meta is None or hint or len(self._coll(db, coll)) <= limit:
            return
        indexes = [ix for ix in meta["indexes"] if not ix.get("building")]
        if _uses_index(flt or {}, indexes):
            return
        if isinstance(sort, Mapping) and sort:
            first = next(iter(sort))
            if any(next(iter(ix["key"])) == first and "partialFilterExpression" not in ix for ix in indexes):
                return
        raise Failure(
            291,
            f"error processing query: ns={db}.{coll} planner returned error :: caused by :: No indexed plans "
            f"available, and running with 'notablescan' (filter {dict(flt or {})}, {len(self._coll(db, coll))} "
            "documents)",
        )

    # ------------------------------------------------------------------ running a command

    def run(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """The reply document of ``cmd`` (errors as ``ok: 0`` documents, never raised)."""
        name = next(iter(cmd), "")
        arrived = time.monotonic()
        self.commands[name] = self.commands.get(name, 0) + 1
        self.command_counts[(conn.app_name or "", name, self._target(name, cmd))] += 1
        try:
            fail = self._failpoint(conn, name)
            if fail is not None and fail.get("closeConnection"):
                if conn.sock is not None:
                    conn.sock.close()
                raise ConnectionError("failCommand: closeConnection")
            if fail is not None and fail.get("errorCode") is not None:
                raise Failure(
                    int(fail["errorCode"]),
                    f"Failing command {name} via 'failCommand' failpoint",
                    labels=fail.get("errorLabels", _labels_for(name, cmd, int(fail["errorCode"]))),
                )
            method = COMMANDS.get(name)
            if method is None:
                raise Failure(59, f"no such command: '{name}'")
            before = self._triggered(conn, name, after_apply=False)
            if before is not None:
                self.step_down(before.seconds, close_connections=before.close_connection)
                raise Failure(
                    11602,
                    "operation was interrupted because of a replication state change",
                    labels=_labels_for(name, cmd, 11602),
                )
            self._check_primary(name, cmd)
            started = time.monotonic()
            self._tls.cost = 0.0
            reply = self._run_locked(conn, name, cmd, getattr(self, method))
            self._spend(name, cmd, started)
            after = self._triggered(conn, name, after_apply=True)
            if after is not None:
                self.step_down(after.seconds, close_connections=after.close_connection)
                if after.close_connection:
                    raise ConnectionError("step-down: the connection closed after the command applied")
                if (cmd.get("writeConcern") or {}).get("w") == "majority":
                    reply["writeConcernError"] = dict(STEPPED_DOWN_WAITING)
                    if _labels_for(name, cmd, 189):
                        reply["errorLabels"] = _labels_for(name, cmd, 189)
            if (cmd.get("readConcern") or {}).get("level") == "majority":
                with self.lock:
                    reply["operationTime"] = self.majority_point()
            if fail is not None and "writeConcernError" in fail:
                reply["writeConcernError"] = dict(fail["writeConcernError"])
                labels = fail.get("errorLabels")
                if labels:
                    reply["errorLabels"] = list(labels)
        except Failure as exc:
            reply = {
                "ok": 0.0,
                "errmsg": exc.message,
                "code": exc.code,
                "codeName": CODE_NAMES.get(exc.code, f"Location{exc.code}"),
            }
            reply.update(exc.extra)
            if exc.labels:
                reply["errorLabels"] = exc.labels
        except (ConnectionError, OSError):
            raise
        except Exception as exc:  # a gap of the simulator: an error answer naming it, never a hang
            logger.exception("mongosim: %s failed", name)
            reply = {"ok": 0.0, "errmsg": f"mongosim internal error: {exc!r}", "code": 1, "codeName": "InternalError"}
        reply.setdefault("ok", 1.0)
        took = time.monotonic() - arrived
        if took > SLOW_COMMAND_S and not (name == "getMore" or "maxAwaitTimeMS" in cmd):
            logger.warning("mongosim: %s of %s (%s) took %.1f s", name, self._target(name, cmd), conn.app_name, took)
        cursor = reply.get("cursor")
        if isinstance(cursor, dict) and "postBatchResumeToken" in cursor:
            events = cursor.get("firstBatch") or cursor.get("nextBatch") or []
            if events:
                with self.lock:
                    self.stream_batches[f"{conn.app_name or ''}:batches"] += 1
                    self.stream_batches[f"{conn.app_name or ''}:events"] += len(events)
        with self.lock:
            signature = {"hash": b"\x00" * 20, "keyId": Int64(0)}
            reply["$clusterTime"] = {"clusterTime": self.ct, "signature": signature}
            reply.setdefault("operationTime", self.ct)
        return reply

    def _check_primary(self, name: str, cmd: dict[str, Any]) -> None:
        """Between a step-down and an election: a write is 10107 NotWritablePrimary, a read of
        primary read preference 13435 NotPrimaryNoSecondaryOk (src/mongo/db/service_entry_point_
        mongod.cpp; the ``RetryableWriteError`` label on a retryable write, 4.4+). A ``getMore``
        goes on (a cursor lives on in a secondary), as do ``hello`` and the other commands
        about the connection."""
        if self.writable or self.shards:
            return
        if name in WRITE_COMMANDS:
            raise Failure(10107, "not primary", labels=_labels_for(name, cmd, 10107))
        mode = (cmd.get("$readPreference") or {}).get("mode", "primary")
        if name in READ_COMMANDS and mode == "primary":
            raise Failure(13435, "not primary and secondaryOk=false", labels=_labels_for(name, cmd, 13435))

    def _spend(self, name: str, cmd: dict[str, Any], started: float) -> None:
        """The time a read's work took (:attr:`Settings.scan_seconds_per_doc` per document it
        examined), spent outside the lock: past the command's ``maxTimeMS`` it answers 50
        MaxTimeMSExpired ("operation exceeded time limit"), as the server interrupts a read
        that runs out of time."""
        cost, self._tls.cost = getattr(self._tls, "cost", 0.0), 0.0
        if cost <= 0 or name not in READ_COMMANDS:
            return
        limit = _deadline(cmd)
        end = started + cost
        if limit is not None and limit < end:
            time.sleep(max(0.0, limit - time.monotonic()))
            raise Failure(50, "operation exceeded time limit")
        time.sleep(max(0.0, end - time.monotonic()))

    def _target(self, name: str, cmd: dict[str, Any]) -> str:
        if name == "getMore":
            return str(cmd.get("collection") or "")
        target = cmd.get(name)
        return target if isinstance(target, str) and name not in ("shardCollection", "split", "moveRange") else ""

    def counts(self) -> dict[tuple[str, str, str], int]:
        """A copy of :attr:`command_counts` (a phase's commands: the difference of two)."""
        with self.lock:
            return dict(self.command_counts)

    def _failpoint(self, conn: Connection, name: str) -> dict[str, Any] | None:
        with self.lock:
            fp = self.failpoints.get("failCommand")
            if fp is None or name in ("hello", "isMaster", "ismaster", "configureFailPoint", "buildInfo", "buildinfo"):
                return None
            data = fp["data"]
            if name not in data.get("failCommands", []):
                return None
            if data.get("appName") is not None and data["appName"] != conn.app_name:
                return None
            if fp["skip"] > 0:
                fp["skip"] -= 1
                return None
            fp["count"] += 1
            if fp["times"] is not None:
                fp["times"] -= 1
                if fp["times"] <= 0:
                    del self.failpoints["failCommand"]
            self.changed.notify_all()  # a test may wait for the fail point to be met
        if data.get("blockConnection"):
            time.sleep(int(data.get("blockTimeMS", 0)) / 1000)
        return dict(data)

    def _run_locked(
        self, conn: Connection, name: str, cmd: dict[str, Any], handler: Callable[..., dict[str, Any]]
    ) -> dict[str, Any]:
        if name in ("hello", "isMaster", "ismaster"):
            return handler(conn, cmd)
        if name == "getMore":
            return self.cmd_getmore(conn, cmd)
        with self.changed:
            self._expire_transactions()
            self._deadline = _deadline(cmd)
            if cmd.get("$clusterTime") and isinstance(cmd["$clusterTime"].get("clusterTime"), Timestamp):
                gossip = cmd["$clusterTime"]["clusterTime"]
                if _ts_key(gossip) > _ts_key(self.ct):
                    self.ct = gossip  # a valid gossiped time advances the clock (logical_clock.cpp)
            try:
                txn_reply = self._transaction_state(cmd, name)
                if txn_reply is not None:
                    return txn_reply
                retried = self._retried_write(name, cmd)
                if retried is not None:
                    return retried
                now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)  # a BSON date: milliseconds
                token = evaluate.NOW.set(now.replace(microsecond=now.microsecond // 1000 * 1000))
                try:
                    reply = handler(conn, cmd)
                    self._record_write(name, cmd, reply)
                    return reply
                except Failure:
                    if self.txn is not None:
                        self._abort(self.txn)  # an error in a transaction aborts it
                    raise
                finally:
                    evaluate.NOW.reset(token)
            finally:
                self.txn = None

    # ------------------------------------------------------------------ retryable writes

    def _retried_write(self, name: str, cmd: dict[str, Any]) -> dict[str, Any] | None:
        """A retryable write (``txnNumber``, no ``autocommit``) the session ran already: the
        recorded reply, the write concern waited for again; nothing is applied twice (manual,
        "Retryable Writes": the server keeps each session's last transaction number and its
        result in the transaction table). An older number than the session's last: 225
        TransactionTooOld."""
        if name not in RETRYABLE_WRITES or "txnNumber" not in cmd or "autocommit" in cmd:
            return None
        lsid, number = _lsid(cmd), int(cmd["txnNumber"])
        recorded = self.retryable.get(lsid)
        if recorded is None or recorded[0] < number:
            return None
        if recorded[0] > number:
            raise Failure(
                225,
                f"Retryable write with txnNumber {number} is prohibited on session because a newer retryable "
                f"write with txnNumber {recorded[0]} has already started on this session.",
            )
        return self._write_concern(cmd, dict(recorded[1]))

    def _record_write(self, name: str, cmd: dict[str, Any], reply: dict[str, Any]) -> None:
        if name in RETRYABLE_WRITES and "txnNumber" in cmd and "autocommit" not in cmd:
            # the reply's values are never changed once answered: kept as they are
            kept = {k: v for k, v in reply.items() if k not in ("writeConcernError", "errorLabels")}
            self.retryable[_lsid(cmd)] = (int(cmd["txnNumber"]), kept)

    # ------------------------------------------------------------------ transactions

    def _transaction_state(self, cmd: dict[str, Any], name: str) -> dict[str, Any] | None:
        """Sets :attr:`txn` for a command of a transaction; answers ``commitTransaction`` and
        ``abortTransaction`` (manual, "Transactions"; the driver's transactions specification)."""
        lsid = _lsid(cmd)
        number = cmd.get("txnNumber")
        open_txn = self.txns.get(lsid)
        aborted = Failure(
            251, f"Transaction with {{ txnNumber: {number} }} has been aborted.", labels=["TransientTransactionError"]
        )
        if name in ("commitTransaction", "abortTransaction"):
            if open_txn is None or open_txn.number != number:
                raise aborted
            if name == "commitTransaction":
                del self.txns[lsid]
                if open_txn.events:
                    self._append(open_txn.events)  # one oplog entry, one cluster time
                self.changed.notify_all()
            else:
                self._abort(open_txn)
            return {"ok": 1.0}
        if cmd.get("startTransaction"):
            if cmd.get("autocommit") is not False:
                raise Failure(72, "autocommit must be false to start a transaction")
            if name not in ("find", "insert", "update", "delete", "findAndModify", "aggregate", "count", "distinct"):
                raise Failure(263, f"Cannot run '{name}' in a multi-document transaction.")
            if open_txn is not None:
                self._abort(open_txn)  # a newer transaction number ends the session's older one
            self.txn = self.txns[lsid] = Txn(lsid=lsid, number=int(number or 0), started=time.monotonic())
        elif cmd.get("autocommit") is False:
            if open_txn is None or open_txn.number != number:
                raise aborted
            self.txn = open_txn
        return None

    def _expire_transactions(self) -> None:
        for txn in list(self.txns.values()):
            if time.monotonic() - txn.started > TRANSACTION_LIFETIME_S:
                logger.warning(
                    "mongosim: transaction of session %s aborted after %ds", txn.lsid.hex(), TRANSACTION_LIFETIME_S
                )
                self._abort(txn)

    def _abort(self, txn: Txn) -> None:
        self.txns.pop(txn.lsid, None)
        current, self.txn = self.txn, None  # the undo writes are no transaction's
        for db, coll, key, old in reversed(txn.undo):
            if (db, coll) in self.catalog:
                self._put(db, coll, key, old)
        for ns in txn.created:
            self.catalog.pop(ns, None)
            self.data.pop(ns, None)
            self.order.pop(ns, None)
            self.uniques.pop(ns, None)
            self.fields.pop(ns, None)
        self.txn = None if current is txn else current
        self.changed.notify_all()

    def _claim_doc(self, db: str, coll: str, key: bytes) -> None:
        """Before a write of the document ``key``: a document another open transaction wrote is
        a write conflict. In a transaction: 112 WriteConflict with TransientTransactionError (the
        driver runs the transaction again). Outside one: the write waits until that transaction
        ends (its ``maxTimeMS``, 50, when it runs out), then raises :class:`_Retry`: the caller
        reads the document again (the server retries a conflicting single write internally)."""
        ident = (db, coll, key)
        waited = False
        deadline = self._deadline  # the command's own (another command sets its own while this waits)
        while True:
            holder = next((t for t in self.txns.values() if t is not self.txn and ident in t.touched), None)
            if holder is None:
                break
            if self.txn is not None:
                raise Failure(
                    112,
                    "WriteConflict error: this operation conflicted with another operation. Please retry your "
                    "operation or multi-document transaction.",
                    labels=["TransientTransactionError"],
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Failure(50, "operation exceeded time limit")
            waited = True
            self.changed.wait(0.05 if left is None else min(left, 0.05))
            self._expire_transactions()
        if waited:
            raise _Retry
        if self.txn is not None:
            self.txn.touched.add(ident)

    # ------------------------------------------------------------------ handshake, admin

    def _hello(self) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        server = {  # what a mongos and a replica set member both answer
            "topologyVersion": {"processId": self._process_id, "counter": Int64(0)},
            "isWritablePrimary": True,
            "maxBsonObjectSize": MAX_BSON_OBJECT,
            "maxMessageSizeBytes": 48_000_000,
            "maxWriteBatchSize": MAX_WRITE_BATCH,
            "localTime": now,
            "logicalSessionTimeoutMinutes": 30,
            "connectionId": 1,
            "minWireVersion": 0,
            "maxWireVersion": self.settings.max_wire_version,
            "readOnly": False,
        }
        server["topologyVersion"] = {"processId": self._process_id, "counter": Int64(self.topology_counter)}
        if self.shards:  # a mongos: no replica-set fields (manual, "hello": "Sharded Instances")
            return {**server, "msg": "isdbgrid"}
        optime = {"ts": self.ct, "t": Int64(self.term)}
        reply = {
            **server,
            "hosts": [self.address],
            "setName": self.set_name,
            "setVersion": 1,
            "secondary": not self.writable,
            "me": self.address,
            "lastWrite": {
                "opTime": optime,
                "lastWriteDate": now,
                "majorityOpTime": {"ts": self.majority_point(), "t": Int64(self.term)},
                "majorityWriteDate": now,
            },
        }
        if self.writable:  # between a step-down and an election: a secondary, no primary known
            reply.update(primary=self.address, electionId=self._election_id)
        else:
            reply["isWritablePrimary"] = False
        return reply

    def cmd_hello(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        app = ((cmd.get("client") or {}).get("application") or {}).get("name")
        if app:
            conn.app_name = app
        if "topologyVersion" in cmd and "maxAwaitTimeMS" in cmd:
            # an awaitable hello: answered when the topology changes (a step-down, an election)
            # or the wait is over (the server's streaming protocol, SDAM's "Streaming Protocol")
            seen = (cmd["topologyVersion"] or {}).get("counter")
            with self.topology_changed:
                self.topology_changed.wait_for(
                    lambda: self.topology_counter != seen or self._stop.is_set(),
                    min(int(cmd["maxAwaitTimeMS"]), 10_000) / 1000,
                )
        with self.lock:
            reply = self._hello()
        if "isMaster" in cmd or "ismaster" in cmd:
            reply["ismaster"] = reply.pop("isWritablePrimary")
        if cmd.get("helloOk"):
            reply["helloOk"] = True
        reply["connectionId"] = conn.id
        return reply

    cmd_ismaster = cmd_hello

    def cmd_committransaction(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("answered by _transaction_state")

    cmd_aborttransaction = cmd_committransaction

    def cmd_ping(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        return {}

    def cmd_replsetgetconfig(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """The replica set's configuration (manual, "replSetGetConfig": on ``admin``; a
        ``mongos`` has no such command, 59); ``settings.electionTimeoutMillis`` as
        :attr:`Settings.election_timeout_ms`."""
        if self.shards:
            raise Failure(59, "no such command: 'replSetGetConfig'")
        if cmd.get("$db") != "admin":
            raise Failure(13, "replSetGetConfig may only be run against the admin database.")
        _check_fields(cmd, "replSetGetConfig", {"commitmentStatus", "includeNewlyAdded"})
        member = {"_id": 0, "host": self.address, "arbiterOnly": False, "buildIndexes": True, "hidden": False,
                  "priority": 1.0, "tags": {}, "secondaryDelaySecs": Int64(0), "votes": 1}  # fmt: skip
        settings = {
            "chainingAllowed": True,
            "heartbeatIntervalMillis": 2000,
            "heartbeatTimeoutSecs": 10,
            "electionTimeoutMillis": self.settings.election_timeout_ms,
            "catchUpTimeoutMillis": -1,
            "catchUpTakeoverDelayMillis": 30000,
            "getLastErrorModes": {},
            "getLastErrorDefaults": {"w": 1, "wtimeout": 0},
        }
        config = {
            "_id": self.set_name,
            "version": 1,
            "term": Int64(self.term),
            "members": [member],
            "protocolVersion": Int64(1),
            "writeConcernMajorityJournalDefault": True,
            "settings": settings,
        }
        return {"config": config}

    def cmd_buildinfo(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": "7.0.0",
            "versionArray": [7, 0, 0, 0],
            "maxBsonObjectSize": MAX_BSON_OBJECT,
            "gitVersion": "mongosim",
        }

    def cmd_endsessions(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """Ends the sessions and aborts their open transactions (manual, "endSessions")."""
        for lsid in cmd.get("endSessions") or []:
            txn = self.txns.get(_lsid({"lsid": lsid}))
            if txn is not None:
                self._abort(txn)
        return {}

    def cmd_connectionstatus(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        info: dict[str, Any] = {"authenticatedUsers": [], "authenticatedUserRoles": []}
        if cmd.get("showPrivileges"):
            info["authenticatedUserPrivileges"] = []
        return {"authInfo": info}

    def cmd_configurefailpoint(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """``configureFailPoint`` of ``failCommand`` (as a server started with
        ``enableTestCommands=1`` takes it: mode ``alwaysOn``/``off``/``{times}``/``{skip}``)."""
        if cmd.get("$db") != "admin":
            raise Failure(13, "configureFailPoint may only be run against the admin database.")
        name, mode = cmd["configureFailPoint"], cmd.get("mode")
        if name != "failCommand":
            raise Failure(2, f"mongosim: unknown fail point {name!r} (only failCommand is modelled)")
        previous = self.failpoints.pop(name, None)
        count = previous["count"] if previous else 0
        if mode == "off":
            return {"count": count}
        data = dict(cmd.get("data") or {})
        known = {
            "failCommands",
            "errorCode",
            "errorLabels",
            "writeConcernError",
            "blockConnection",
            "blockTimeMS",
            "closeConnection",
            "appName",
            "failInternalCommands",
        }
        unknown = set(data) - known
        if unknown:
            raise Failure(2, f"mongosim: failCommand data {sorted(unknown)} not modelled")
        times = skip = None
        if mode == "alwaysOn":
            pass
        elif isinstance(mode, dict) and set(mode) == {"times"}:
            times = int(mode["times"])
        elif isinstance(mode, dict) and set(mode) == {"skip"}:
            skip = int(mode["skip"])
        else:
            raise Failure(2, f"mode {mode!r} is not a known fail point mode")
        self.failpoints[name] = {"data": data, "times": times, "skip": skip or 0, "count": 0}
        return {"count": count}

    # ------------------------------------------------------------------ a sharded cluster

    def _mongos_only(self, name: str, cmd: dict[str, Any]) -> None:
        """A replica-set member does not know the sharding commands (59); a ``mongos`` runs them
        on ``admin`` only (13)."""
        if not self.shards:
            raise Failure(59, f"no such command: '{name}'")
        if cmd.get("$db") != "admin":
            raise Failure(13, f"{name} may only be run against the admin database.")

    def cmd_listshards(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """``listShards`` (manual, "listShards"): each shard's name, host and state."""
        self._mongos_only("listShards", cmd)
        return {
            "shards": [
                {"_id": s.name, "host": f"{s.name}/127.0.0.1:{27018 + i}", "state": 1, "topologyTime": Timestamp(1, 1)}
                for i, s in enumerate(self.shards)
            ]
        }

    def _split_ns(self, ns: Any) -> tuple[str, str]:
        if not isinstance(ns, str) or "." not in ns:
            raise Failure(73, f"Invalid namespace specified '{ns}'")
        db, coll = ns.split(".", 1)
        return db, coll

    def cmd_shardcollection(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """``shardCollection`` (manual, "shardCollection"; 7.0): idempotent with the same key
        (another key: 23 AlreadyInitialized); a missing collection is created; an empty one gets
        the shard key's index, a non-empty one must have it (72); a unique index must have the
        shard key as its prefix (72). A ranged key starts as one chunk on the primary shard; a
        hashed first field is split into one chunk per shard."""
        self._mongos_only("shardCollection", cmd)
        _check_fields(cmd, "shardCollection", {"key", "unique", "numInitialChunks", "collation", "timeseries"})
        db, coll = self._split_ns(cmd["shardCollection"])
        key = cmd.get("key")
        if not isinstance(key, dict) or not key or any(v not in (1, 1.0, "hashed") for v in key.values()):
            raise Failure(
                2,
                f"Unsupported shard key pattern {key!r}. Pattern must either be a single hashed field, "
                "or a list of ascending fields",
            )
        if sum(v == "hashed" for v in key.values()) > 1:
            raise Failure(2, "mongosim: a shard key pattern of more than one hashed field")
        current = self.sharded.get((db, coll))
        if current is not None:
            if list(current.key.items()) != list(key.items()):
                raise Failure(
                    23, f"sharding already enabled for collection {db}.{coll} with options {{ key: {current.key} }}"
                )
            return {"collectionsharded": f"{db}.{coll}"}
        meta = self._ensure(db, coll)
        fields = list(key.items())
        for ix in meta["indexes"]:
            prefix = list(ix["key"].items())[: len(fields)]
            if ix.get("unique") and ix["name"] != "_id_" and [p for p, _ in prefix] != [f for f, _ in fields]:
                raise Failure(
                    72,
                    f"can't shard collection '{db}.{coll}' with unique index on {ix['key']} and "
                    f"proposed shard key {key}. Uniqueness can't be maintained unless shard key is a "
                    "prefix",
                )
        supported = any(
            list(ix["key"].items())[: len(fields)] == fields and "partialFilterExpression" not in ix
            for ix in meta["indexes"]
        )
        if not supported:
            if self._docs(db, coll):
                raise Failure(
                    72, "Please create an index that starts with the proposed shard key before sharding the collection"
                )
            meta["indexes"].append({"v": 2, "key": dict(key), "name": "_".join(f"{f}_{v}" for f, v in fields)})
        first_hashed = fields[0][1] == "hashed"
        n = len(self.shards) if first_hashed else 1
        chunks = [Chunk([MinKey()] + [MinKey()] * (len(fields) - 1), 0)]
        for i in range(1, n):  # even ranges of the 64-bit hash
            chunks.append(Chunk([Int64(-(2**63) + i * (2**64 // n))] + [MinKey()] * (len(fields) - 1), i))
        self.sharded[(db, coll)] = ShardedCollection(dict(key), meta["uuid"], chunks)
        self._rekey(db, coll)
        self._config_catalog(db, coll)
        return {"collectionsharded": f"{db}.{coll}"}

    def _config_catalog(self, db: str, coll: str) -> None:
        """``config.collections`` and ``config.chunks`` of a sharded collection, as the config
        servers keep them (their writes are on no shard's oplog)."""
        sc = self.sharded[(db, coll)]
        ns = f"{db}.{coll}"
        for name in ("collections", "chunks"):
            if ("config", name) not in self.catalog:
                self.catalog[("config", name)] = {
                    "uuid": uuid.uuid4(),
                    "indexes": [{"v": 2, "key": {"_id": 1}, "name": "_id_"}],
                    "options": {},
                }
        uid = Binary.from_uuid(sc.uuid)
        self._put("config", "collections", self._store_key(ns), {"_id": ns, "uuid": uid, "key": dict(sc.key)})
        for d in [d for d in self._docs("config", "chunks") if d["uuid"] == uid]:
            self._put("config", "chunks", self._store_key(d["_id"]), None)
        fields = list(sc.key)
        for i, c in enumerate(sc.chunks):
            upper = sc.chunks[i + 1].min if i + 1 < len(sc.chunks) else [MaxKey()] * len(fields)
            doc = {
                "_id": ObjectId(),
                "uuid": uid,
                "min": dict(zip(fields, c.min, strict=True)),
                "max": dict(zip(fields, upper, strict=True)),
                "shard": self.shards[c.shard].name,
            }
            self._put("config", "chunks", self._store_key(doc["_id"]), doc)

    def _shard_key_value(self, sc: ShardedCollection, doc: Mapping[str, Any]) -> list[Any]:
        values = []
        for f, kind in sc.key.items():
            v = get_path(doc, f)
            if kind == "hashed":
                v = Int64(int.from_bytes(hashlib.md5(_hashable(v)).digest()[:8], "little", signed=True))
            values.append(v)
        return values

    def _chunk_index(self, sc: ShardedCollection, values: list[Any]) -> int:
        key = [_Ordered(v) for v in values]
        mins = [[_Ordered(v) for v in c.min] for c in sc.chunks]
        return max(bisect.bisect_right(mins, key) - 1, 0)

    def _route(self, db: str, coll: str, doc: Mapping[str, Any]) -> int:
        """The shard owning ``doc``: its chunk's by the shard key value (a hashed field by its
        hash); an unsharded collection lives on the primary shard (0)."""
        sc = self.sharded.get((db, coll)) if self.shards else None
        if sc is None:
            return 0
        return sc.chunks[self._chunk_index(sc, self._shard_key_value(sc, doc))].shard

    def cmd_split(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """``split`` at ``middle`` (manual, "split"): the chunk holding it becomes two on its shard."""
        self._mongos_only("split", cmd)
        _check_fields(cmd, "split", {"middle", "find", "bounds"})
        db, coll = self._split_ns(cmd["split"])
        sc = self.sharded.get((db, coll))
        if sc is None:
            raise Failure(118, f"ns {db}.{coll} is not sharded")
        middle = cmd.get("middle")
        if not isinstance(middle, dict) or list(middle) != list(sc.key):
            raise Failure(2, "mongosim: split is modelled with 'middle' of the shard key's fields only")
        values = [middle[f] for f in sc.key]
        i = self._chunk_index(sc, values)
        if [_Ordered(v) for v in sc.chunks[i].min] == [_Ordered(v) for v in values]:
            raise Failure(2, f"mongosim: a chunk already starts at {middle}")
        sc.chunks.insert(i + 1, Chunk(values, sc.chunks[i].shard))
        self._config_catalog(db, coll)
        return {}

    def cmd_moverange(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """``moveRange`` of the chunk starting at ``min`` to ``toShard`` (manual, "moveRange";
        the whole chunk: the simulator has no chunk size). The donor's and the recipient's
        migration entries are on their oplogs, which change streams do not show."""
        self._mongos_only("moveRange", cmd)
        _check_fields(
            cmd,
            "moveRange",
            {"min", "max", "toShard", "forceJumbo", "waitForDelete", "_waitForDelete", "secondaryThrottle"},
        )
        db, coll = self._split_ns(cmd["moveRange"])
        sc = self.sharded.get((db, coll))
        if sc is None:
            raise Failure(118, f"ns {db}.{coll} is not sharded")
        target = next((i for i, s in enumerate(self.shards) if s.name == cmd.get("toShard")), None)
        if target is None:
            raise Failure(70, f"Shard {cmd.get('toShard')} not found")
        low = cmd.get("min")
        if not isinstance(low, dict) or list(low) != list(sc.key) or "max" in cmd:
            raise Failure(2, "mongosim: moveRange is modelled with 'min' (a chunk's lower bound) only")
        wanted = [_Ordered(low[f]) for f in sc.key]
        chunk = next((c for c in sc.chunks if [_Ordered(v) for v in c.min] == wanted), None)
        if chunk is None:
            raise Failure(2, f"mongosim: no chunk starts at {low} (a range inside a chunk is not modelled)")
        if chunk.shard != target:
            donor, chunk.shard = chunk.shard, target
            try:
                self._rekey(db, coll)  # the chunk's documents are on the recipient now
            except Failure:
                chunk.shard = donor
                raise
            self._append([Event(Timestamp(0, 0), 0, "n", db, coll, shard=donor)])
            self._append([Event(Timestamp(0, 0), 0, "n", db, coll, shard=target)])
        self._config_catalog(db, coll)
        return {}

    # ------------------------------------------------------------------ DDL

    def cmd_create(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "create", set())
        db, coll = cmd["$db"], cmd["create"]
        if (db, coll) in self.catalog:
            return {}  # 7.0: the same options again answer ok
        self._ensure(db, coll)
        return {}

    def cmd_drop(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        db, coll = cmd["$db"], cmd["drop"]
        if (db, coll) not in self.catalog:
            return {}  # 7.0: dropping a missing collection answers ok
        self._drop(db, coll)
        return {"ns": f"{db}.{coll}", "nIndexesWas": 1}

    def _drop(self, db: str, coll: str) -> None:
        meta = self.catalog.pop((db, coll))
        self.data.pop((db, coll), None)
        self.order.pop((db, coll), None)
        self.uniques.pop((db, coll), None)
        self.fields.pop((db, coll), None)
        self.sharded.pop((db, coll), None)
        self._append([Event(Timestamp(0, 0), 0, "drop", db, coll, key=None)])
        del meta

    def cmd_renamecollection(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """``renameCollection`` within one database (manual, "renameCollection": run against
        ``admin``; 26 NamespaceNotFound for a missing source, 48 NamespaceExists for an existing
        target without ``dropTarget``; the indexes go with the collection; one oplog entry, a
        ``rename`` event on the source's namespace with ``to``). A rename across databases (a
        copy on a server) is not modelled: refused."""
        _check_fields(cmd, "renameCollection", {"to", "dropTarget", "stayTemp"})
        if cmd["$db"] != "admin":
            raise Failure(13, "renameCollection may only be run against the admin database.")
        source, target = str(cmd["renameCollection"]), str(cmd.get("to", ""))
        (sdb, _, scoll), (tdb, _, tcoll) = source.partition("."), target.partition(".")
        if sdb != tdb:
            raise Failure(115, "the simulator renames within one database only")
        _check_namespace(tdb, tcoll)
        if (sdb, scoll) not in self.catalog:
            raise Failure(26, f"Source collection {source} does not exist")
        if (tdb, tcoll) in self.catalog:
            if not cmd.get("dropTarget"):
                raise Failure(48, "target namespace exists")
            meta = self.catalog.pop((tdb, tcoll))
            del meta
        tables: tuple[dict[tuple[str, str], Any], ...] = (self.data, self.order, self.uniques, self.fields)
        for table in tables:
            table.pop((tdb, tcoll), None)
            if (sdb, scoll) in table:
                table[(tdb, tcoll)] = table.pop((sdb, scoll))
        self.catalog[(tdb, tcoll)] = self.catalog.pop((sdb, scoll))
        self._append([Event(Timestamp(0, 0), 0, "rename", sdb, scoll, doc={"db": tdb, "coll": tcoll})])
        return {}

    def cmd_dropdatabase(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        db = cmd["$db"]
        for d, c in [k for k in self.catalog if k[0] == db]:
            self._drop(d, c)
        self._append([Event(Timestamp(0, 0), 0, "dropDatabase", db, "$cmd")])
        return {"dropped": db}

    def cmd_createindexes(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "createIndexes", {"indexes", "commitQuorum"})
        db, coll = cmd["$db"], cmd["createIndexes"]
        self._build_time(db, coll, cmd)
        created_collection = (db, coll) not in self.catalog
        meta = self._ensure(db, coll)
        before = len(meta["indexes"])
        for spec in cmd["indexes"]:
            allowed = {"key", "name", "unique", "partialFilterExpression", "expireAfterSeconds", "sparse", "background"}
            unknown = set(spec) - allowed
            if unknown:
                raise Failure(
                    197,
                    f"The field '{sorted(unknown)[0]}' is not valid for an index specification. Specification: {spec}",
                )
            if "key" not in spec or "name" not in spec or not spec["key"]:
                raise Failure(9, f"Error in specification {spec}: the 'key' and 'name' fields are required")
            for v in spec["key"].values():
                if v not in (1, -1, "hashed") or v == "hashed" and spec.get("unique"):
                    raise Failure(67, f"mongosim: index key type {v!r} not modelled (only 1/-1, hashed not unique)")
            if "partialFilterExpression" in spec:
                _check_partial(spec["partialFilterExpression"])
            if "expireAfterSeconds" in spec and len(spec["key"]) != 1:
                raise Failure(67, "TTL indexes are single-field indexes, compound indexes do not support TTL.")
            new = {"v": 2, "key": dict(spec["key"]), "name": spec["name"]}
            for k in ("unique", "partialFilterExpression", "expireAfterSeconds", "sparse"):
                if k in spec and not (k in ("unique", "sparse") and not spec[k]):
                    new[k] = spec[k]
            same_name = next((ix for ix in meta["indexes"] if ix["name"] == new["name"]), None)
            same_key = next(
                (
                    ix
                    for ix in meta["indexes"]
                    if list(ix["key"].items()) == list(new["key"].items())
                    and ix.get("partialFilterExpression") == new.get("partialFilterExpression")
                ),
                None,
            )
            if same_name is not None:
                if list(same_name["key"].items()) != list(new["key"].items()):
                    raise Failure(
                        86,
                        "An existing index has the same name as the requested index. When index names are not "
                        "specified, they are auto generated and can cause conflicts. Please refer to our "
                        f"documentation. Requested index: {new}, existing index: {same_name}",
                    )
                if _index_options(same_name) != _index_options(new):
                    raise Failure(
                        85,
                        f"An equivalent index already exists with the same name but "
                        f"different options. Requested index: {new}, existing index: {same_name}",
                    )
                continue
            if same_key is not None:
                raise Failure(85, f"Index already exists with a different name: {same_key['name']}")
            if len(meta["indexes"]) >= MAX_INDEXES:
                raise Failure(67, f"add index fails, too many indexes for {db}.{coll} key:{new['key']}")
            sc = self.sharded.get((db, coll)) if self.shards else None
            if sc is not None and new.get("unique") and list(new["key"])[: len(sc.key)] != list(sc.key):
                # a unique index of a sharded collection must start with the shard key's fields
                # (manual, "Create a Unique Index on Existing Sharded Collection"; the server's
                # check: src/mongo/s/shard_key_pattern.cpp, isUniqueIndexCompatible)
                raise Failure(67, f"cannot create unique index over {new['key']} with shard key pattern {sc.key}")
            if new.get("unique"):
                self._check_existing_unique(db, coll, new)
                m = self.uniques.setdefault((db, coll), {}).setdefault(new["name"], {})
                for key, doc in self._coll(db, coll).items():
                    k = self._unique_entry(new, doc, self._shard_of(db, coll, doc))
                    if k is not None:
                        m[k] = key
            meta["indexes"].append(new)
        return {
            "numIndexesBefore": before,
            "numIndexesAfter": len(meta["indexes"]),
            "createdCollectionAutomatically": created_collection,
        }

    def _build_time(self, db: str, coll: str, cmd: dict[str, Any]) -> None:
        """An index build reads the whole collection: the indexes of ``cmd`` not there yet take
        :attr:`Settings.index_build_seconds_per_doc` per document each, while the other commands
        run (the index is not there, nor used, until the build is done). The command's
        ``maxTimeMS`` running out aborts the build (50 MaxTimeMSExpired, nothing built: manual,
        "createIndexes", "If you kill the createIndexes command ... the index build is
        aborted")."""
        per_doc = self.settings.index_build_seconds_per_doc
        meta = self.catalog.get((db, coll))
        if not per_doc or meta is None:
            return
        names = {ix["name"] for ix in meta["indexes"]}
        new = [spec for spec in cmd.get("indexes") or [] if isinstance(spec, dict) and spec.get("name") not in names]
        cost = per_doc * len(self._coll(db, coll)) * len(new)
        if cost <= 0:
            return
        deadline, end = self._deadline, time.monotonic() + cost
        while (left := end - time.monotonic()) > 0:
            if deadline is not None and deadline <= time.monotonic():
                raise Failure(50, "operation exceeded time limit")
            self.changed.wait(left if deadline is None else min(left, max(0.0, deadline - time.monotonic())))
        self.txn = None  # the build is no transaction's (another command's may have been set meanwhile)

    def _check_existing_unique(self, db: str, coll: str, spec: dict[str, Any]) -> None:
        seen: set[bytes] = set()
        pfe = spec.get("partialFilterExpression")
        for doc in self._docs(db, coll):
            if pfe is not None and not matches(pfe, doc):
                continue
            k = _hashable([get_path(doc, p) for p in spec["key"]])
            if k in seen:
                raise Failure(
                    11000,
                    f"Index build failed: E11000 duplicate key error collection: {db}.{coll} index: {spec['name']}",
                )
            seen.add(k)

    def cmd_listindexes(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        db, coll = cmd["$db"], cmd["listIndexes"]
        meta = self.catalog.get((db, coll))
        if meta is None:
            raise Failure(26, f"ns does not exist: {db}.{coll}")
        return self._first_batch(f"{db}.{coll}", copy.deepcopy(meta["indexes"]), cmd.get("cursor", {}), cmd)

    def cmd_listcollections(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        db = cmd["$db"]
        docs = [
            {
                "name": c,
                "type": "collection",
                "options": {},
                "info": {"readOnly": False, "uuid": meta["uuid"]},
                "idIndex": {"v": 2, "key": {"_id": 1}, "name": "_id_"},
            }
            for (d, c), meta in sorted(self.catalog.items())
            if d == db
        ]
        flt = cmd.get("filter") or {}
        docs = [d for d in docs if matches(flt, d)]
        if cmd.get("nameOnly"):
            docs = [{"name": d["name"], "type": d["type"]} for d in docs]
        return self._first_batch(f"{db}.$cmd.listCollections", docs, cmd.get("cursor", {}), cmd)

    def cmd_listdatabases(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        names = sorted({d for d, _ in self.catalog})
        return {"databases": [{"name": n, "sizeOnDisk": 0, "empty": False} for n in names], "totalSize": 0}

    # ------------------------------------------------------------------ reads

    def _first_batch(
        self,
        ns: str,
        docs: list[dict[str, Any]],
        cursor_opts: Mapping[str, Any],
        cmd: Mapping[str, Any],
        *,
        single: bool = False,
    ) -> dict[str, Any]:
        size = cursor_opts.get("batchSize", cmd.get("batchSize"))
        size = DEFAULT_BATCH if size is None else int(size)
        if size < 0:
            raise Failure(2, "BatchSize value must be non-negative")
        batch, rest = _cut(docs, size if size else 0)
        cid = 0
        if rest and not single:
            cid = next(self._cursor_ids)
            self.cursors[cid] = Cursor(cid, ns, rest, lsid=_lsid(cmd))
        return {"cursor": {"firstBatch": batch, "id": Int64(cid), "ns": ns}}

    def cmd_find(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        allowed = {
            "filter",
            "sort",
            "projection",
            "limit",
            "skip",
            "batchSize",
            "singleBatch",
            "hint",
            "min",
            "max",
            "allowDiskUse",
            "noCursorTimeout",
            "let",
            "showRecordId",
            "returnKey",
            "tailable",
            "awaitData",
            "allowPartialResults",
            "collation",
        }
        _check_fields(cmd, "find", allowed)
        for f in ("collation", "let", "showRecordId", "returnKey", "tailable", "awaitData"):
            if f in cmd:
                raise Failure(2, f"mongosim: find option {f!r} not modelled")
        db, coll = cmd["$db"], cmd["find"]
        self._read_concern(cmd)
        flt = cmd.get("filter") or {}
        if self.settings.plan_check and cmd.get("sort"):
            self._check_plan(db, coll, flt, cmd["sort"])
        self._check_scan(db, coll, flt, cmd.get("sort"), cmd.get("hint"))
        view = self._view(db, coll, cmd)
        if ("min" in cmd or "max" in cmd) and view is None:
            docs = self._find(db, coll, flt, candidates=self._in_bounds(db, coll, cmd))
        else:
            docs = self._find(db, coll, flt, view)
        if "min" in cmd or "max" in cmd:
            docs = self._bounded(db, coll, docs, cmd)
        if cmd.get("sort"):
            docs = sort_docs(docs, cmd["sort"])
        skip = int(cmd.get("skip") or 0)
        if skip < 0:
            raise Failure(2, "skip value must be non-negative")
        docs = docs[skip:]
        limit = int(cmd.get("limit") or 0)
        if limit < 0:
            raise Failure(2, "limit value must be non-negative")
        if limit:
            docs = docs[:limit]
        if cmd.get("projection"):
            docs = _project(docs, cmd["projection"])
        # stored documents are never changed in place (a write stores a new one): answered as they are
        single = bool(cmd.get("singleBatch")) or (
            limit > 0 and len(docs) <= int(cmd.get("batchSize", DEFAULT_BATCH) or DEFAULT_BATCH)
        )
        return self._first_batch(f"{db}.{coll}", docs, {}, cmd, single=single)

    def _in_bounds(self, db: str, coll: str, cmd: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The documents whose value of the hinted index's first key is within ``min``/``max``'s
        first values, through the field index of that key (as a server's index scan reads only
        the bounds; :meth:`_bounded` then decides); None when the hint names no index."""
        meta = self.catalog.get((db, coll))
        hint = cmd.get("hint")
        index = None
        for ix in meta["indexes"] if meta is not None else []:
            if ix["name"] == hint or (isinstance(hint, dict) and list(ix["key"].items()) == list(hint.items())):
                index = ix
        if index is None:
            return None
        path = next(iter(index["key"]))
        low = _Ordered(next(iter(cmd["min"].values()), MinKey()) if "min" in cmd else MinKey())
        high = _Ordered(next(iter(cmd["max"].values()), MaxKey()) if "max" in cmd else MaxKey())
        store = self._coll(db, coll)
        values = self._field_index(db, coll, path)
        keys: set[bytes] = set(values.get(evaluate._COMPLEX, ()))
        for value_key, held in values.items():
            if value_key is evaluate._COMPLEX:
                continue
            v = _Ordered(value_key[1])
            if not v < low and not high < v:
                keys |= held
        return self._examined(db, coll, {}, [store[k] for k in keys if k in store], indexed=True)

    def _bounded(self, db: str, coll: str, docs: list[dict[str, Any]], cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """``min``/``max`` (manual, "cursor.min()"): index bounds of the hinted index, ``min``
        inclusive, ``max`` exclusive, compared in the index's key order (BSON order across
        types; MinKey/MaxKey)."""
        hint = cmd.get("hint")
        meta = self.catalog.get((db, coll))
        if hint is None:
            raise Failure(51173, "When using min()/max() a hint of which index to use must be provided")
        index = None
        if meta is not None:
            for ix in meta["indexes"]:
                if ix["name"] == hint or (isinstance(hint, dict) and list(ix["key"].items()) == list(hint.items())):
                    index = ix
        if index is None:
            raise Failure(
                2,
                "error processing query: planner returned error :: "
                "caused by :: hint provided does not correspond to an existing index",
            )
        paths = list(index["key"])
        for bound in ("min", "max"):
            if bound in cmd and list(cmd[bound]) != paths:
                raise Failure(51174, "The index key pattern and the min/max objects must match")

        def key(d: Mapping[str, Any]) -> list[_Ordered]:
            return [_Ordered(get_path(d, p)) for p in paths]

        lo = [_Ordered(v) for v in cmd["min"].values()] if "min" in cmd else None
        hi = [_Ordered(v) for v in cmd["max"].values()] if "max" in cmd else None
        out = []
        for d in docs:
            k = key(d)
            if lo is not None and k < lo:
                continue
            if hi is not None and not k < hi:
                continue
            out.append((k, d))
        out.sort(key=lambda kd: kd[0])  # in the index's order, as its scan reads them
        return [d for _, d in out]

    def _read_concern(self, cmd: dict[str, Any]) -> None:
        rc = cmd.get("readConcern")
        if rc is None:
            return
        level = rc.get("level", "local")
        if level not in ("local", "majority", "available", "linearizable", "snapshot"):
            raise Failure(2, f"'{level}' is not a valid readConcern level")
        unknown = set(rc) - {"level", "afterClusterTime", "atClusterTime"}
        if unknown:
            raise Failure(40415, f"BSON field 'readConcern.{sorted(unknown)[0]}' is an unknown field.")
        after = rc.get("afterClusterTime")
        if isinstance(after, Timestamp) and _ts_key(after) > _ts_key(self.ct):
            self._append([Event(Timestamp(0, 0), 0, "n", "admin", "$cmd.noop")])
        if isinstance(after, Timestamp) and level == "majority":
            # the read waits until its majority-committed snapshot holds that time (manual, "Read
            # Concern": afterClusterTime), within its maxTimeMS (50)
            deadline = self._deadline
            while _ts_key(self.majority_point()) < _ts_key(after):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise Failure(50, "operation exceeded time limit")
                self.changed.wait(0.05 if left is None else min(left, 0.05))

    def cmd_aggregate(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(
            cmd,
            "aggregate",
            {"pipeline", "cursor", "allowDiskUse", "hint", "let", "explain", "bypassDocumentValidation", "collation"},
        )
        for f in ("let", "explain", "collation"):
            if f in cmd:
                raise Failure(2, f"mongosim: aggregate option {f!r} not modelled")
        if "cursor" not in cmd:
            raise Failure(9, "The 'cursor' option is required, except for aggregate with the explain argument")
        db, target = cmd["$db"], cmd["aggregate"]
        pipeline = cmd.get("pipeline")
        if not isinstance(pipeline, list):
            raise Failure(14, "'pipeline' option must be specified as an array")
        _check_length(pipeline)
        if pipeline and isinstance(pipeline[0], dict) and "$changeStream" in pipeline[0]:
            return self._open_stream(conn, cmd, db, None if target == 1 else target, pipeline)
        if target == 1:
            raise Failure(2, "mongosim: collection-less aggregate not modelled")
        self._read_concern(cmd)
        if self.settings.plan_check:
            self._check_pipeline_plans(db, target, pipeline)
        self._check_pipeline_scans(db, target, pipeline, cmd.get("hint"))
        with _evaluating():
            out = run_pipeline(
                lambda f: self._candidates(db, target, f, self._view(db, target, cmd)),
                pipeline,
                lambda c, f: self._candidates(db, c, f, self._view(db, c, cmd)),
            )
        return self._first_batch(f"{db}.{target}", out, cmd["cursor"], cmd)

    def _check_pipeline_plans(self, db: str, coll: str, pipeline: list[Any]) -> None:
        """The plan check of a pipeline starting ``$match``, ``$sort`` (what the server plans as
        a sorted query), and of each ``$unionWith`` sub-pipeline."""
        stages = [st for st in pipeline if isinstance(st, dict)]
        if len(stages) >= 2 and "$match" in stages[0] and "$sort" in stages[1]:
            self._check_plan(db, coll, stages[0]["$match"], stages[1]["$sort"])
        for st in stages:
            union = st.get("$unionWith")
            if isinstance(union, dict) and isinstance(union.get("coll"), str):
                self._check_pipeline_plans(db, union["coll"], list(union.get("pipeline") or []))

    def _check_pipeline_scans(self, db: str, coll: str, pipeline: list[Any], hint: Any = None) -> None:
        """:meth:`_check_scan` of a pipeline's leading ``$match`` (and ``$sort`` after it), or of
        none; and of each ``$unionWith`` sub-pipeline on its collection."""
        stages = [st for st in pipeline if isinstance(st, dict)]
        flt = stages[0]["$match"] if stages and "$match" in stages[0] else {}
        sort = stages[1].get("$sort") if len(stages) >= 2 and "$match" in stages[0] else None
        if stages and "$sort" in stages[0]:
            sort = stages[0]["$sort"]
        self._check_scan(db, coll, flt, sort, hint)
        for st in stages:
            union = st.get("$unionWith")
            if isinstance(union, dict) and isinstance(union.get("coll"), str):
                self._check_pipeline_scans(db, union["coll"], list(union.get("pipeline") or []))

    def _check_plan(self, db: str, coll: str, flt: Mapping[str, Any], sort: Mapping[str, Any]) -> None:
        """Records a finding when every index that has the sort's keys after a prefix the filter
        pins to points (equalities, ``$in`` values, ``$or`` branches) needs more than
        :data:`MAX_SCANS_TO_EXPLODE` scans to give that order, and none gives it with fewer (an
        index starting with the sort's keys gives it with one). Partial filters and key
        directions are not weighed."""
        meta = self.catalog.get((db, coll))
        if meta is None or not sort:
            return
        wanted = list(sort)
        scans: list[int] = []
        for ix in meta["indexes"]:
            keys = list(ix["key"])
            if wanted[0] not in keys:
                continue
            at = keys.index(wanted[0])
            if keys[at : at + len(wanted)] != wanted[: len(keys) - at]:
                continue
            n = _point_scans([flt], keys[:at])
            if n is not None:
                scans.append(n)
        if scans and min(scans) > MAX_SCANS_TO_EXPLODE:
            finding = (
                f"{db}.{coll}: the sort {dict(sort)} needs {min(scans)} index scans merged (more than "
                f"internalQueryMaxScansToExplode = {MAX_SCANS_TO_EXPLODE}): a server sorts it in memory"
            )
            logger.warning("mongosim plan check: %s", finding)
            self.plan_findings.append(finding)

    def cmd_count(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "count", {"query", "limit", "skip", "hint"})
        db, coll = cmd["$db"], cmd["count"]
        self._read_concern(cmd)
        if cmd.get("query"):  # no query: the collection's count from its metadata, no plan at all
            self._check_scan(db, coll, cmd.get("query"), None, cmd.get("hint"))
        n = len(self._find(db, coll, cmd.get("query") or {}, self._view(db, coll, cmd)))
        n = max(0, n - int(cmd.get("skip") or 0))
        if cmd.get("limit"):
            n = min(n, abs(int(cmd["limit"])))
        return {"n": n}

    def cmd_distinct(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "distinct", {"key", "query", "hint"})
        db, coll = cmd["$db"], cmd["distinct"]
        values: list[Any] = []
        seen: set[bytes] = set()
        self._read_concern(cmd)
        self._check_scan(db, coll, cmd.get("query"), None, cmd.get("hint"))
        for d in self._find(db, coll, cmd.get("query") or {}, self._view(db, coll, cmd)):
            v = get_path(d, cmd["key"])
            for x in v if isinstance(v, list) else [v]:
                h = _hashable(x)
                if x is not None and h not in seen:
                    seen.add(h)
                    values.append(x)
        return {"values": values}

    def cmd_getmore(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "getMore", {"collection", "batchSize", "maxTimeMS"})
        cid = int(cmd["getMore"])
        with self.changed:
            cursor = self.cursors.get(cid)
            if cursor is None or cursor.ns.split(".", 1)[1] != cmd.get("collection") and cursor.stream is None:
                raise Failure(43, f"cursor id {cid} not found")
            size = int(cmd.get("batchSize") or 0)
            if cursor.stream is None:
                batch, cursor.docs = _cut(cursor.docs, size)
                if not cursor.docs:
                    del self.cursors[cid]
                    cid = 0
                return {"cursor": {"nextBatch": batch, "id": Int64(cid), "ns": cursor.ns}}
        return self._stream_more(cursor, size or DEFAULT_BATCH, cmd.get("maxTimeMS"))

    def cmd_killcursors(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        killed, missing = [], []
        for cid in cmd.get("cursors", []):
            if self.cursors.pop(int(cid), None) is not None:
                killed.append(cid)
            else:
                missing.append(cid)
        return {"cursorsKilled": killed, "cursorsNotFound": missing, "cursorsAlive": [], "cursorsUnknown": []}

    # ------------------------------------------------------------------ writes

    def _write_concern(self, cmd: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        """``w: majority`` waits for the majority commit point to pass the write; it ends with a
        write concern error (the write stays applied) past ``wtimeout`` (64 WriteConcernFailed),
        past the command's ``maxTimeMS`` (50 MaxTimeMSExpired: manual, "Write Concern", "the
        write concern wait counts against maxTimeMS") or when the member steps down meanwhile
        (189 PrimarySteppedDown, labelled ``RetryableWriteError`` on a retryable write: 50 is not
        a retryable code)."""
        wc = cmd.get("writeConcern") or {}
        unknown = set(wc) - {"w", "j", "wtimeout", "provenance"}
        if unknown:
            raise Failure(40415, f"BSON field 'writeConcern.{sorted(unknown)[0]}' is an unknown field.")
        w = wc.get("w", 1)
        if w == "majority" and self.majority is not None and _ts_key(self.majority) < _ts_key(self.ct):
            wtimeout = wc.get("wtimeout")
            deadline = self._deadline  # the command's own (another command sets its own while this waits)
            timeout_at = time.monotonic() + int(wtimeout) / 1000 if wtimeout else None
            deadlines = [d for d in (deadline, timeout_at) if d is not None]
            target = _ts_key(self.ct)
            name = next(iter(cmd), "")
            while self.majority is not None and _ts_key(self.majority) < target:
                error: dict[str, Any] | None = None
                left = min(deadlines) - time.monotonic() if deadlines else None
                if not self.writable:
                    error = dict(STEPPED_DOWN_WAITING)
                elif left is not None and left <= 0:
                    timed_out = deadline is not None and deadline <= time.monotonic()
                    error = (
                        {"code": 50, "codeName": "MaxTimeMSExpired", "errmsg": "operation exceeded time limit"}
                        if timed_out
                        else {
                            "code": 64,
                            "codeName": "WriteConcernFailed",
                            "errmsg": "waiting for replication timed out",
                            "errInfo": {"wtimeout": True},
                        }
                    )
                if error is not None:
                    reply["writeConcernError"] = error
                    labels = _labels_for(name, cmd, error["code"])
                    if labels:
                        reply["errorLabels"] = labels
                    break
                self.changed.wait(0.05 if left is None else min(left, 0.05))
        elif isinstance(w, int) and w > 1:
            raise Failure(100, f"Not enough data-bearing nodes to satisfy write concern w: {w}")
        return reply

    def _batch(self, cmd: dict[str, Any], field_name: str) -> list[Any]:
        items = cmd.get(field_name)
        if not isinstance(items, list) or not items:
            raise Failure(2, f"Write batch sizes must be between 1 and {MAX_WRITE_BATCH}. Got 0 operations.")
        if len(items) > MAX_WRITE_BATCH:
            raise Failure(
                16, f"Write batch sizes must be between 1 and {MAX_WRITE_BATCH}. Got {len(items)} operations."
            )
        return items

    def _writes(self, cmd: dict[str, Any], items: list[Any], one: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        ordered = cmd.get("ordered", True)
        n = 0
        modified = 0
        upserted: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for i, item in enumerate(items):
            try:
                while True:
                    try:
                        r = one(item)
                        break
                    except _Retry:
                        continue  # the statement waited for a transaction: run it again
            except Failure as exc:
                if self.txn is not None:
                    raise
                err = {"index": i, "code": exc.code, "errmsg": exc.message}
                err.update(exc.extra)
                errors.append(err)
                if ordered:
                    break
                continue
            n += r.get("n", 0)
            modified += r.get("nModified", 0)
            if "upserted" in r:
                upserted.append({"index": i, "_id": r["upserted"]})
        reply: dict[str, Any] = {"n": n}
        if cmd.get("update") is not None and "updates" in cmd:
            reply["nModified"] = modified
            if upserted:
                reply["upserted"] = upserted
        if errors:
            reply["writeErrors"] = errors
        return self._write_concern(cmd, reply)

    def cmd_insert(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "insert", {"documents", "ordered", "bypassDocumentValidation"})
        db, coll = cmd["$db"], cmd["insert"]
        docs = self._batch(cmd, "documents")

        def one(doc: Any) -> dict[str, Any]:
            self._insert(db, coll, doc)
            return {"n": 1}

        return self._writes(cmd, docs, one)

    def cmd_delete(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "delete", {"deletes", "ordered", "let"})
        db, coll = cmd["$db"], cmd["delete"]

        def one(spec: Any) -> dict[str, Any]:
            unknown = set(spec) - {"q", "limit", "hint", "collation"}
            if unknown:
                raise Failure(40415, f"BSON field 'delete.deletes.{sorted(unknown)[0]}' is an unknown field.")
            self._check_scan(db, coll, spec["q"], None, spec.get("hint"))
            matched = self._find(db, coll, spec["q"])
            if spec.get("limit") == 1:
                matched = matched[:1]
            n = 0
            for d in matched:
                current: dict[str, Any] | None = d
                while current is not None:
                    try:
                        self._remove(db, coll, current)
                        n += 1
                        break
                    except _Retry:
                        if spec.get("limit") == 1:
                            raise  # nothing removed yet: the statement runs again from its match
                        current = self._coll(db, coll).get(self._doc_key(db, coll, d))
                        if current is not None and not matches(spec["q"], current):
                            current = None
            return {"n": n}

        return self._writes(cmd, self._batch(cmd, "deletes"), one)

    def cmd_update(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(cmd, "update", {"updates", "ordered", "bypassDocumentValidation", "let"})
        db, coll = cmd["$db"], cmd["update"]

        def one(spec: Any) -> dict[str, Any]:
            unknown = set(spec) - {"q", "u", "upsert", "multi", "hint", "arrayFilters", "collation"}
            if unknown:
                raise Failure(40415, f"BSON field 'update.updates.{sorted(unknown)[0]}' is an unknown field.")
            if "arrayFilters" in spec or "collation" in spec:
                raise Failure(2, "mongosim: arrayFilters/collation not modelled")
            self._check_scan(db, coll, spec["q"], None, spec.get("hint"))
            n, modified, upserted, _, _ = self._update(
                db, coll, spec["q"], spec["u"], upsert=bool(spec.get("upsert")), multi=bool(spec.get("multi"))
            )
            r: dict[str, Any] = {"n": n, "nModified": modified}
            if upserted is not None:
                r["upserted"] = upserted
            return r

        return self._writes(cmd, self._batch(cmd, "updates"), one)

    def _update(
        self,
        db: str,
        coll: str,
        flt: dict[str, Any],
        update: Any,
        *,
        upsert: bool,
        multi: bool,
        sort: Mapping[str, Any] | None = None,
    ) -> tuple[int, int, Any, dict[str, Any] | None, dict[str, Any] | None]:
        """Runs one update statement: ``(n, nModified, upserted _id, before, after)`` (the
        before and after of the last document written)."""
        kind = _update_kind(update, multi)
        matched = self._find(db, coll, flt)
        if sort:
            matched = sort_docs(matched, sort)
        if not multi:
            matched = matched[:1]
        before = after = None
        modified = n = 0
        for doc in matched:
            current: dict[str, Any] | None = doc
            while current is not None:
                try:
                    new = self._apply(db, coll, current, flt, update, kind, insert=False)
                    if new != current:
                        diff = None if kind == "replacement" else _diff(current, new)
                        self._replace_stored(db, coll, current, new, diff)
                        modified += 1
                    before, after = copy.deepcopy(current), new
                    n += 1
                    break
                except _Retry:
                    if not multi:
                        raise  # nothing written yet: the statement runs again from its match
                    current = self._coll(db, coll).get(self._doc_key(db, coll, doc))
                    if current is not None and not matches(flt, current):
                        current = None  # it moved out of the filter while the write waited
        if matched or not upsert:
            return n, modified, None, before, after
        base = _upsert_base(flt) if kind != "replacement" else {}
        if kind == "replacement" and "_id" in flt:
            base["_id"] = flt["_id"]
        new = self._apply(db, coll, base, flt, update, kind, insert=True)
        if "_id" not in new:
            new = {"_id": ObjectId(), **new}
        self._insert(db, coll, new)
        return 1, 0, new["_id"], None, new

    def _apply(
        self, db: str, coll: str, doc: dict[str, Any], flt: dict[str, Any], update: Any, kind: str, *, insert: bool
    ) -> dict[str, Any]:
        with _evaluating():
            if kind == "replacement":
                _check_field_names(update)
                return {**({"_id": doc["_id"]} if "_id" in doc else {}), **copy.deepcopy(update)}
            if kind == "pipeline":
                _check_length(update)
                for stage in update:
                    name, _ = evaluate.check_stage(stage)
                    if name not in evaluate.UPDATE_STAGES:
                        raise Failure(72, f"{name} is not allowed to be used within an update")
                (new,) = run_pipeline([doc], update, lambda c, f: self._candidates(db, c, f))
                return new
            new = copy.deepcopy(doc)
            for op in update:
                if op not in _UPDATE_OPERATORS:
                    raise Failure(
                        9,
                        f"Unknown modifier: {op}. Expected a valid update "
                        f"modifier or pipeline-style update specified as an array",
                    )
            self._mm._apply_update_document(new, flt, update, insert)
            return new

    def cmd_findandmodify(self, conn: Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        while True:
            try:
                return self._find_and_modify(cmd)
            except _Retry:
                continue  # the write waited for a transaction: the command runs again

    def _find_and_modify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        _check_fields(
            cmd,
            "findAndModify",
            {
                "query",
                "sort",
                "update",
                "remove",
                "new",
                "fields",
                "upsert",
                "bypassDocumentValidation",
                "hint",
                "let",
                "arrayFilters",
                "collation",
            },
        )
        for f in ("let", "arrayFilters", "collation"):
            if f in cmd:
                raise Failure(2, f"mongosim: findAndModify option {f!r} not modelled")
        db, coll = cmd["$db"], cmd["findAndModify"]
        flt = cmd.get("query") or {}
        self._check_scan(db, coll, flt, cmd.get("sort"), cmd.get("hint"))
        if cmd.get("remove"):
            if "update" in cmd or cmd.get("upsert") or cmd.get("new"):
                raise Failure(9, "Cannot specify both an update and remove=true")
            matched = self._find(db, coll, flt)
            if cmd.get("sort"):
                matched = sort_docs(matched, cmd["sort"])
            value = None
            if matched:
                value = copy.deepcopy(matched[0])
                self._remove(db, coll, matched[0])
            reply = {
                "lastErrorObject": {"n": 1 if value else 0},
                "value": _project([value], cmd["fields"])[0] if value and cmd.get("fields") else value,
            }
            return self._write_concern(cmd, reply)
        if "update" not in cmd:
            raise Failure(9, "Either an update or remove=true must be specified")
        n, _, upserted, before, after = self._update(
            db, coll, flt, cmd["update"], upsert=bool(cmd.get("upsert")), multi=False, sort=cmd.get("sort")
        )
        value = after if cmd.get("new") else before
        if value is not None and cmd.get("fields"):
            value = _project([value], cmd["fields"])[0]
        leo: dict[str, Any] = {"n": n, "updatedExisting": bool(n and upserted is None)}
        if upserted is not None:
            leo["upserted"] = upserted
        return self._write_concern(cmd, {"lastErrorObject": leo, "value": copy.deepcopy(value)})

    # ------------------------------------------------------------------ change streams

    def _open_stream(
        self, conn: Connection, cmd: dict[str, Any], db: str, coll: str | None, pipeline: list[Any]
    ) -> dict[str, Any]:
        """``aggregate`` with ``$changeStream`` (manual, "Change Streams"; "Resume a Change
        Stream"): the start point, history lost, the pipeline allowed after the stage."""
        spec = pipeline[0]["$changeStream"]
        allowed = {
            "resumeAfter",
            "startAfter",
            "startAtOperationTime",
            "fullDocument",
            "fullDocumentBeforeChange",
            "allChangesForCluster",
            "showExpandedEvents",
        }
        unknown = set(spec) - allowed
        if unknown:
            raise Failure(40415, f"BSON field '$changeStream.{sorted(unknown)[0]}' is an unknown field.")
        if (
            spec.get("fullDocumentBeforeChange", "off") != "off"
            or spec.get("showExpandedEvents")
            or spec.get("allChangesForCluster")
        ):
            raise Failure(2, "mongosim: this $changeStream option is not modelled")
        full = spec.get("fullDocument", "default")
        if full not in ("default", "updateLookup"):
            raise Failure(2, f"mongosim: fullDocument {full!r} not modelled")
        starts = [k for k in ("resumeAfter", "startAfter", "startAtOperationTime") if k in spec]
        if len(starts) > 1:
            raise Failure(40674, "Only one type of resume option is allowed, but multiple were found.")
        rest = pipeline[1:]
        split = False
        for i, stage in enumerate(rest):
            name, _ = (
                evaluate.check_stage(stage)
                if "$changeStreamSplitLargeEvent" not in stage
                else ("$changeStreamSplitLargeEvent", None)
            )
            if name == "$changeStreamSplitLargeEvent":
                if i != len(rest) - 1:
                    raise Failure(7182802, "$changeStreamSplitLargeEvent must be the last stage in the pipeline")
                split = True
                continue
            if name not in ("$match", "$project", "$addFields", "$set", "$unset", "$replaceRoot", "$replaceWith"):
                raise Failure(ErrorIllegalInChangeStream, f"{name} is not permitted in a $changeStream pipeline")
        if split:
            rest = rest[:-1]
        oldest = (self.oplog[0].ts.time, self.oplog[0].ts.inc) if self.oplog else _ts_key(self.ct)
        if "startAtOperationTime" in spec:
            ts = spec["startAtOperationTime"]
            if not isinstance(ts, Timestamp):
                raise Failure(
                    14, "BSON field '$changeStream.startAtOperationTime' is the wrong type, expected type 'timestamp'"
                )
            after = (ts.time, ts.inc, -1, 0)
            start = _ts_key(ts)
        elif starts:
            after = key_of_token(spec[starts[0]])
            start = after[:2]
            if after[2] == 128 and start >= oldest and not any(_event_key(e) == after for e in self.oplog):
                raise Failure(280, "cannot resume stream; the resume token was not found.")
        else:
            after = (self.ct.time, self.ct.inc, 255, 0)
            start = _ts_key(self.ct)
        if self.truncated_before > (0, 0) and start < self.truncated_before:
            raise Failure(
                286, "Resume of change stream was not possible, as the resume point may no longer be in the oplog."
            )
        for stage in rest:
            if "$match" in stage:
                check_filter(stage["$match"])
        stream = ChangeStream(
            db, coll, after, rest, split, full, token_of(after[:2] + (0, 0)) if after[2] < 128 else token_of(after)
        )
        stream.gate = _stream_gate(rest)
        cid = next(self._cursor_ids)
        cursor = Cursor(cid, f"{db}.{coll or '$cmd.aggregate'}", stream=stream, lsid=_lsid(cmd))
        size = int(cmd["cursor"].get("batchSize", DEFAULT_BATCH))
        batch = self._collect(stream, size)
        self.cursors[cid] = cursor
        return {
            "cursor": {
                "firstBatch": batch,
                "postBatchResumeToken": stream.last_token,
                "id": Int64(cid),
                "ns": cursor.ns,
            }
        }

    def _collect(self, s: ChangeStream, size: int) -> list[dict[str, Any]]:
        """Up to ``size`` events after the stream's position within the majority commit point
        (a change stream shows majority-committed writes only); the post-batch resume token is
        the last event's, or a high-water mark at the last entry scanned when that is later.
        One call scans at most :data:`SCAN_STEP` entries (then up to the end of their cluster
        time) and sets ``s.behind`` when it stopped short: the lock is not held over a long
        stretch of oplog (a server yields during such a scan; its ``getMore`` answers what it
        found by ``maxAwaitTimeMS``, with the resume token of where it got to)."""
        s.behind = False
        batch: list[dict[str, Any]] = []
        while s.pending and len(batch) < size:
            batch.append(s.pending.pop(0))
            s.last_token = batch[-1]["_id"]
        if s.pending:
            return batch
        limit = _ts_key(self.merged_point())
        scanned: tuple[int, int] | None = None
        start = bisect.bisect_right(self.oplog, s.after, key=_event_key)  # the oplog is in key order
        for i in range(start, len(self.oplog)):
            e = self.oplog[i]
            k = _event_key(e)
            if _ts_key(e.ts) > limit or len(batch) >= size:
                break
            if i - start >= SCAN_STEP and scanned is not None and _ts_key(e.ts) != scanned:
                s.behind = True
                break
            s.after = k
            scanned = _ts_key(e.ts)
            if e.op == "n" or e.db != s.db or (s.coll is not None and e.coll != s.coll):
                continue
            if e.op in ("create", "createIndexes"):
                continue
            if s.gate is not None and not s.gate(e):
                continue
            doc = self._change_doc(s, e)
            with _evaluating():
                out = (
                    run_pipeline([doc], s.pipeline, lambda c, f: [], checked=True)
                    if s.pipeline
                    else [copy.deepcopy(doc)]
                )
            for d in out:
                fragments = _split_event(d) if s.split else [d]
                if not s.split and _bson_size(d) > MAX_BSON_OBJECT:
                    raise Failure(
                        10334, f"BSONObj size: {_bson_size(d)} is invalid. Size must be between 0 and 16793600(16MB)"
                    )
                for f in fragments:
                    if len(batch) < size:
                        batch.append(f)
                        s.last_token = f["_id"]
                    else:
                        s.pending.append(f)
        if scanned is not None and (not batch or scanned > key_of_token(s.last_token)[:2]) and not s.pending:
            if len(batch) < size:
                s.last_token = token_of(scanned + (0, 0))
        if (
            self.shards
            and not s.pending
            and not s.behind
            and len(batch) < size
            and limit > key_of_token(s.last_token)[:2]
        ):
            # a mongos's post-batch resume token: the minimum of the shards' (the merge point)
            s.last_token = token_of(limit + (0, 0))
        return batch

    def _change_doc(self, s: ChangeStream, e: Event) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "_id": token_of(_event_key(e)),
            "operationType": e.op,
            "clusterTime": e.ts,
            "wallTime": e.wall,
        }
        if e.op == "dropDatabase":
            doc["ns"] = {"db": e.db}
            return doc
        doc["ns"] = {"db": e.db, "coll": e.coll}
        if e.op == "drop":
            return doc
        if e.op == "rename":
            doc["to"] = dict(e.doc or {})
            return doc
        # the entry's own values, not copies: :meth:`_collect` copies what a stream returns
        if e.op in ("insert", "replace"):
            doc["fullDocument"] = e.doc
        doc["documentKey"] = e.key
        if e.op == "update":
            doc["updateDescription"] = e.update
            if s.full_document == "updateLookup":
                current = [d for d in self._docs(e.db, e.coll) if d["_id"] == e.key["_id"]]
                doc["fullDocument"] = current[0] if current else None
        return doc

    def _stream_more(self, cursor: Cursor, size: int, max_time_ms: Any) -> dict[str, Any]:
        """A change stream's ``getMore``: answered at once when events are there, else after
        ``maxTimeMS`` (the driver sends ``maxAwaitTimeMS`` so; default 1 s) with an empty
        batch and the post-batch resume token."""
        s = cursor.stream
        assert s is not None
        wait = (1000 if max_time_ms is None else int(max_time_ms)) / 1000
        deadline = time.monotonic() + wait
        with self.changed:
            while True:
                if self.cursors.get(cursor.id) is not cursor:
                    raise Failure(43, f"cursor id {cursor.id} not found")
                batch = self._collect(s, size)
                left = deadline - time.monotonic()
                if batch or left <= 0 or self._stop.is_set():
                    break
                # more oplog to scan: let the other commands run a moment, then go on
                self.changed.wait(0.001 if s.behind else left)
            return {
                "cursor": {
                    "nextBatch": batch,
                    "postBatchResumeToken": s.last_token,
                    "id": Int64(cursor.id),
                    "ns": cursor.ns,
                }
            }


COMMANDS = {
    name: "cmd_" + name.lower()
    for name in (
        "hello",
        "isMaster",
        "ping",
        "replSetGetConfig",
        "buildInfo",
        "endSessions",
        "connectionStatus",
        "configureFailPoint",
        "listShards",
        "shardCollection",
        "split",
        "moveRange",
        "create",
        "drop",
        "dropDatabase",
        "renameCollection",
        "createIndexes",
        "listIndexes",
        "listCollections",
        "listDatabases",
        "find",
        "aggregate",
        "count",
        "distinct",
        "getMore",
        "killCursors",
        "insert",
        "update",
        "delete",
        "findAndModify",
        "commitTransaction",
        "abortTransaction",
    )
}
"""The commands the simulator runs, by their exact (case-sensitive) names; any other is 59
CommandNotFound."""
COMMANDS.update({"ismaster": "cmd_hello", "buildinfo": "cmd_buildinfo"})

WRITE_COMMANDS = frozenset(
    {
        "insert",
        "update",
        "delete",
        "findAndModify",
        "create",
        "drop",
        "dropDatabase",
        "renameCollection",
        "createIndexes",
        "commitTransaction",
        "abortTransaction",
    }
)
"""What only a writable primary runs."""
READ_COMMANDS = frozenset({"find", "aggregate", "count", "distinct", "listCollections", "listIndexes"})
"""Reads a secondary runs only with a read preference other than ``primary``."""
RETRYABLE_WRITES = frozenset({"insert", "update", "delete", "findAndModify"})
"""The commands a driver retries as retryable writes (with ``txnNumber``)."""
STEPPED_DOWN_WAITING = {
    "code": 189,
    "codeName": "PrimarySteppedDown",
    "errmsg": "Primary stepped down while waiting for replication",
}
"""The write concern error of a write whose ``w: majority`` wait a step-down ended (src/mongo/db/
repl/replication_coordinator_impl.cpp, awaiting replication on a member no longer primary)."""

ErrorIllegalInChangeStream = 5491300
"""The code of a stage not allowed after ``$changeStream`` (src/mongo/db/pipeline/
document_source_change_stream.cpp: "... is not permitted in a $changeStream pipeline")."""


# --------------------------------------------------------------------------- helpers

_UPDATE_OPERATORS = {
    "$set",
    "$unset",
    "$inc",
    "$setOnInsert",
    "$min",
    "$max",
    "$mul",
    "$rename",
    "$push",
    "$addToSet",
    "$pull",
    "$pop",
    "$currentDate",
    "$pullAll",
}


class _Retry(Exception):
    """A write waited for a transaction: the document is read again before it is written."""


class _evaluating:
    """mongomock's own errors become server errors (code 2: what the server answers to a bad
    operator argument), NotImplementedError an error naming the gap (never a silent result)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: Any, exc: Any, tb: Any) -> bool:
        if exc is None or isinstance(exc, Failure):
            return False
        if isinstance(exc, mongomock.OperationFailure):
            raise Failure(exc.code or 2, str(exc)) from exc
        if isinstance(exc, NotImplementedError):
            raise Failure(2, f"mongosim: not implemented by the evaluator: {exc}") from exc
        if isinstance(exc, mongomock.WriteError | mongomock.DuplicateKeyError):
            raise Failure(exc.code or 2, str(exc)) from exc
        return False


_BOUNDED = frozenset({"$eq", "$in", "$gt", "$gte", "$lt", "$lte", "$type", "$exists", "$regex", "$all", "$elemMatch",
                      "$ne", "$nin", "$not", "$options"})  # fmt: skip
"""Operators a query's index bounds are built from (src/mongo/db/query/index_bounds_builder.cpp:
comparisons, ``$in``, ``$type``, ``$exists``, a regular expression, ``$elemMatch``, ``$all``, and
the negations of those, which bound the rest of the index); ``$expr``, ``$mod``, ``$size``,
``$where`` bound nothing."""


def _conjuncts(flt: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The top-level conditions of a filter, its ``$and``s flattened."""
    out: list[tuple[str, Any]] = []
    for k, v in flt.items():
        if k == "$and" and isinstance(v, list):
            for sub in v:
                if isinstance(sub, Mapping):
                    out.extend(_conjuncts(sub))
        else:
            out.append((k, v))
    return out


def _bounds(cond: Any) -> bool:
    """Whether a field's condition gives an index on that field bounds."""
    if isinstance(cond, Mapping) and any(str(k).startswith("$") for k in cond):
        return all(k in _BOUNDED for k in cond)
    return True  # an equality (a document, an array, a regular expression: one point each)


def _implies(conds: list[tuple[str, Any]], pfe: Mapping[str, Any]) -> bool:
    """Whether a query's top-level conditions imply a partial index's filter (manual, "Partial
    Indexes": the query must contain the filter expression, or a subset of it, for the index to
    be used): each of the filter's conditions is one of the query's, or an equality / ``$in``
    within the filter's ``$in``."""
    have: dict[str, list[Any]] = {}
    for k, v in conds:
        have.setdefault(k, []).append(v)
    for path, want in _conjuncts(pfe):
        got = have.get(path, [])
        allowed = want["$in"] if isinstance(want, Mapping) and set(want) == {"$in"} else None
        if want in got:
            continue
        if allowed is not None and any(
            (isinstance(g, Mapping) and set(g) == {"$in"} and all(x in allowed for x in g["$in"]))
            or (not isinstance(g, Mapping) and g in allowed)
            for g in got
        ):
            continue
        return False
    return True


def _uses_index(flt: Mapping[str, Any], indexes: list[dict[str, Any]]) -> bool:
    """Whether an index can answer ``flt``: one whose first key the filter's top-level conditions
    bound (a partial one only when the filter implies its partial filter), or an index for every
    branch of a top-level ``$or`` (each with the conditions beside it: "$or Clauses and Indexes",
    every clause must be supported by an index)."""
    conds = _conjuncts(flt)
    for ix in indexes:
        first = next(iter(ix["key"]))
        pfe = ix.get("partialFilterExpression")
        if pfe is not None and not _implies(conds, pfe):
            continue
        if any(k == first and _bounds(v) for k, v in conds):
            return True
    for k, v in conds:
        if k == "$or" and isinstance(v, list) and v:
            rest = {"$and": [{a: b} for a, b in conds if a != "$or"]}
            if all(isinstance(b, Mapping) and _uses_index({"$and": [rest, b]}, indexes) for b in v):
                return True
    return False


def _point_scans(clauses: list[Mapping[str, Any]], prefix: list[str]) -> int | None:
    """How many point scans of an index whose keys start ``prefix`` the conjunction ``clauses``
    needs (the product of each key's points, summed over ``$or`` branches); None when a key of
    the prefix is not pinned to points."""
    flat: list[Mapping[str, Any]] = []
    for c in clauses:
        if isinstance(c, Mapping) and isinstance(c.get("$and"), list):
            flat.extend(x for x in c["$and"] if isinstance(x, Mapping))
            flat.append({k: v for k, v in c.items() if k != "$and"})
        elif isinstance(c, Mapping):
            flat.append(c)
    if not prefix:
        return 1
    for i, c in enumerate(flat):
        if isinstance(c.get("$or"), list):
            rest = flat[:i] + [{k: v for k, v in c.items() if k != "$or"}] + flat[i + 1 :]
            total = 0
            for branch in c["$or"]:
                n = _point_scans([*rest, branch], prefix)
                if n is None:
                    return None
                total += n
            return total
    product = 1
    for key in prefix:
        counts = [n for c in flat if key in c for n in [_points_of(c[key])] if n is not None]
        if not counts:
            return None
        product *= min(counts)
    return product


def _points_of(cond: Any) -> int | None:
    if isinstance(cond, Mapping) and any(str(k).startswith("$") for k in cond):
        if set(cond) == {"$in"} and isinstance(cond["$in"], list):
            return len(cond["$in"])
        if set(cond) == {"$eq"}:
            return 1
        return None
    return 1


def _update_kind(update: Any, multi: bool) -> str:
    if isinstance(update, list):
        return "pipeline"
    if not isinstance(update, dict):
        raise Failure(14, "Update argument must be either an object or an array")
    ops = [k.startswith("$") for k in update]
    if update and all(ops):
        return "operators"
    if any(ops):
        raise Failure(9, "Unknown modifier in update: mixed operators and fields")
    if multi:
        raise Failure(9, "multi update is not supported for replacement-style update")
    return "replacement"


def _upsert_base(flt: Mapping[str, Any]) -> dict[str, Any]:
    """The document an upsert inserts starts from the filter's equality conditions (manual,
    "upsert: true": "the update creates a base document from the equality clauses"), ``$and``
    included; ``$or``/``$nor``/comparisons are not copied."""
    out: dict[str, Any] = {}

    def visit(f: Mapping[str, Any]) -> None:
        for k, v in f.items():
            if k == "$and":
                for sub in v:
                    visit(sub)
            elif k.startswith("$"):
                continue
            elif isinstance(v, dict) and any(str(x).startswith("$") for x in v):
                if set(v) == {"$eq"}:
                    _set_path(out, k, v["$eq"])
            else:
                _set_path(out, k, v)

    visit(flt)
    return out


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    for p in parts[:-1]:
        doc = doc.setdefault(p, {})
    doc[parts[-1]] = copy.deepcopy(value)


def _diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``updateDescription`` at the top level (the server gives dotted paths of nested
    changes; the simulator names the changed top-level fields)."""
    return {
        "updatedFields": {k: copy.deepcopy(v) for k, v in new.items() if k not in old or old[k] != v},
        "removedFields": [k for k in old if k not in new],
        "truncatedArrays": [],
    }


def _split_event(event: dict[str, Any]) -> list[dict[str, Any]]:
    """``$changeStreamSplitLargeEvent`` (manual, "$changeStreamSplitLargeEvent"): an event over
    16 MiB in fragments of its top-level fields, each with ``splitEvent {fragment, of}`` and its
    own resume token; an event that fits is passed as it is."""
    if _bson_size(event) <= MAX_BSON_OBJECT:
        return [event]
    key = key_of_token(event["_id"])
    fragments: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    for k, v in event.items():
        if k == "_id":
            continue
        if current and _bson_size({**current, k: v}) > MAX_BSON_OBJECT - 1024:
            fragments.append(current)
            current = {}
        current[k] = v
    fragments.append(current)
    out = []
    for i, f in enumerate(fragments, 1):
        out.append({"_id": token_of(key, i), "splitEvent": {"fragment": i, "of": len(fragments)}, **f})
    return out


_PROJECTING = mongomock.MongoClient().get_database("mongosim").get_collection("projection")
"""A mongomock collection whose projection code the simulator uses (no document is stored in it)."""


def _project(docs: list[dict[str, Any] | None], projection: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A ``find``'s projection, as mongomock projects (paths through arrays of documents
    included: ``{"events.name": 1}`` keeps each element's ``name``, manual: Project Fields to
    Return from Query, "Project Specific Array Elements in the Returned Array")."""
    out = []
    for d in docs:
        if d is None:
            out.append(d)
            continue
        try:
            out.append(_PROJECTING._copy_only_fields(d, dict(projection), dict))
        except (ValueError, mongomock.OperationFailure) as exc:
            raise Failure(2, f"mongosim: projection {dict(projection)!r}: {exc}") from exc
    return out  # type: ignore[return-value]


def _has(doc: Mapping[str, Any], path: str) -> bool:
    cur: Any = doc
    for p in path.split("."):
        if not isinstance(cur, Mapping) or p not in cur:
            return False
        cur = cur[p]
    return True


def _cut(docs: list[dict[str, Any]], size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A batch: ``size`` documents (0: no count limit), and at most 16 MiB of them (the
    server's reply limit, src/mongo/db/query/find_common.h: kMaxBytesToReturnToClientAtOnce)."""
    batch: list[dict[str, Any]] = []
    total = 0
    for i, d in enumerate(docs):
        if size and len(batch) >= size:
            return batch, docs[i:]
        total += _bson_size(d)
        if batch and total > MAX_BSON_OBJECT:
            return batch, docs[i:]
        batch.append(d)
    return batch, []


def _lsid(cmd: Mapping[str, Any]) -> bytes:
    lsid = cmd.get("lsid")
    if isinstance(lsid, Mapping) and "id" in lsid:
        v = lsid["id"]
        return bytes(v.bytes if isinstance(v, uuid.UUID) else v)
    return b""


def _deadline(cmd: Mapping[str, Any]) -> float | None:
    ms = cmd.get("maxTimeMS")
    return None if not ms else time.monotonic() + int(ms) / 1000


def _check_fields(cmd: Mapping[str, Any], name: str, allowed: set[str]) -> None:
    """An unknown field of a command is refused as the server's IDL parser refuses it."""
    for k in cmd:
        if k == name or k in GENERIC_FIELDS or k in allowed:
            continue
        raise Failure(40415, f"BSON field '{name}.{k}' is an unknown field.")


def _check_length(pipeline: list[Any]) -> None:
    if len(pipeline) > MAX_PIPELINE_STAGES:
        raise Failure(7749501, f"Pipeline length must be no longer than {MAX_PIPELINE_STAGES} stages.")


def _check_namespace(db: str, coll: str) -> None:
    if not db or len(db) > MAX_DB_NAME or any(c in db for c in '/\\. "$'):
        raise Failure(73, f"Invalid database name: '{db}'")
    if not coll or "$" in coll or coll.startswith("system.") or "\x00" in coll:
        raise Failure(73, f"Invalid collection name: {coll}")
    if len(f"{db}.{coll}".encode()) > MAX_NAMESPACE:
        raise Failure(73, f"Fully qualified namespace is too long. Namespace: {db}.{coll} Max: {MAX_NAMESPACE}")


def _check_field_names(doc: Mapping[str, Any]) -> None:
    for k in doc:
        if k.startswith("$"):
            raise Failure(2, f"Document can't have $ prefixed field names: {k}")


def _check_partial(expr: Any) -> None:
    """A ``partialFilterExpression`` holds only what the manual's "Partial Indexes" page lists:
    equality, ``$exists: true``, ``$gt``/``$gte``/``$lt``/``$lte``, ``$type``, top-level
    ``$and``/``$or`` and ``$in`` (6.0+); anything else is code 67."""
    ok = {"$eq", "$exists", "$gt", "$gte", "$lt", "$lte", "$type", "$and", "$or", "$in"}
    for key in evaluate._operators(expr):
        if key not in ok:
            raise Failure(67, f"Error in specification: unsupported expression in partial index: {key}")


def _index_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: spec.get(k) for k in ("unique", "partialFilterExpression", "expireAfterSeconds", "sparse")}


def _labels_for(name: str, cmd: Mapping[str, Any], code: int) -> list[str]:
    retryable = (
        name in ("insert", "update", "delete", "findAndModify", "commitTransaction", "abortTransaction")
        and "txnNumber" in cmd
    )
    labels = ["RetryableWriteError"] if retryable and code in RETRYABLE_CODES else []
    if cmd.get("autocommit") is False and name not in ("commitTransaction", "abortTransaction"):
        labels.append("TransientTransactionError")
    return labels
