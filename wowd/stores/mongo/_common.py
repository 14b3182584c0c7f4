"""What the MongoDB stores share: names and format numbers, error translation, one store base.

Vendor errors stop here (httpx's ``map_httpcore_exceptions`` habit): inside
``with translate_errors("op"):`` a PyMongo error becomes :class:`StorageUnavailable` when
retrying can help (network, timeout, election, a transient code or error label) and
:class:`StorageError` (with the server's message) otherwise. Callers that must inspect a
specific server error (E11000 on an upsert, ``BulkWriteError`` details) catch it first.

:class:`MongoStore` is the one base of the stores: a client it does not own or a URI it opens
itself (and closes), the database, the operation timeout, and :meth:`MongoStore._call`, the one
metered call (deadline, error translation, latency and unavailability metrics).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from enum import StrEnum
from typing import Any, TypeVar

import bson
import pymongo
from bson.codec_options import CodecOptions
from pymongo import AsyncMongoClient, InsertOne, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import (
    BulkWriteError,
    ConnectionFailure,
    DuplicateKeyError,
    ExecutionTimeout,
    NotPrimaryError,
    OperationFailure,
    PyMongoError,
    WTimeoutError,
)
from pymongo.results import BulkWriteResult

from wowd.errors import ConfigError, FormatError, StorageError, StorageUnavailable
from wowd.metrics import STORE_CALL_SECONDS, STORE_UNAVAILABLE
from wowd.model import validate_name
from wowd.stores.base import Ddl

__all__ = [
    "Doc",
    "ALREADY_INITIALIZED",
    "CANNOT_CREATE_INDEX",
    "CHANGE_STREAM_UNSUPPORTED",
    "DEFAULT_OPERATION_TIMEOUT",
    "DUPLICATE_KEY",
    "COMMAND_PART_BYTES",
    "HISTORY_LOST_CODES",
    "INDEX_COMMIT_QUORUM",
    "NAMESPACE_COLLECTION",
    "NAMESPACE_EXISTS",
    "REPLICA_COLLECTION",
    "SLOT_COLLECTION",
    "SNAPSHOT_TABLES",
    "TIMER_REGISTRY",
    "TRANSIENT_CODES",
    "TRANSIENT_LABELS",
    "UNAUTHORIZED",
    "Ddl",
    "MongoSharding",
    "MongoStore",
    "checkpoint_collection",
    "collection_name",
    "collection_pattern",
    "mongo_name",
    "duplicate_keys",
    "durable_or_raise",
    "is_duplicate_key",
    "is_transient",
    "is_unauthorized",
    "outbox_collection",
    "quarantine_collection",
    "split_to_fit",
    "translate_errors",
    "write_one",
]

# --------------------------------------------------------------------------- formats and names


TIMER_REGISTRY = "wow_timer_aggregate"
"""The registry of the timer collections of every context."""
SNAPSHOT_TABLES = "wow_snapshot_tables"
"""The snapshots' control plane: format record and claimed state revision per collection."""
SLOT_COLLECTION = "cosid_slot"
"""The lease slots (one document per slot of every namespace)."""
NAMESPACE_COLLECTION = "cosid_namespace"
"""The lease namespaces (limit, tolerance, slot offset)."""
REPLICA_COLLECTION = "cosid_replica"
"""The presence records (one document per replica of every namespace, holder or standby)."""


NAME_PART = "[a-z0-9-]+(?:_[a-z0-9-]+)*"
"""A context or aggregate name as it may stand in a collection name (:func:`mongo_name`)."""


def mongo_name(value: str, *, field: str) -> str:
    """A context or aggregate name (:func:`~wowd.model.validate_name`) that keeps the collection
    names ``wow_<kind>__<context>__<aggregate>`` apart: no ``__`` in it, no ``_`` first or last.
    Otherwise two pairs would name one collection (context ``shop``'s aggregate ``eu__order``
    and context ``shop__eu``'s ``order``: their timers in one collection, each context firing
    the other's) and a context would read another's log as its own types: a
    :class:`~wowd.errors.ConfigError`."""
    validate_name(value, field=field)
    if "__" in value or value.startswith("_") or value.endswith("_"):
        raise ConfigError(
            f"{field}: {value!r} cannot be told apart in MongoDB collection names (wow_<kind>__<context>__<aggregate>,"
            " where '__' separates the parts): use no '__' in it and no '_' at its start or end"
        )
    return value


def collection_name(kind: str, context: str, aggregate: str) -> str:
    """``wow_<kind>__<context>__<aggregate>``: the rule of the per-type collections."""
    return f"wow_{kind}__{mongo_name(context, field='context')}__{mongo_name(aggregate, field='aggregate')}"


def collection_pattern(kind: str, context: str) -> str:
    """The regular expression of the names of ``context``'s per-type collections of ``kind``
    (:func:`collection_name`): another context's never matches, whatever its name."""
    prefix = f"wow_{kind}__{mongo_name(context, field='context')}__"
    return f"^{re.escape(prefix)}{NAME_PART}$"


def checkpoint_collection(context: str) -> str:
    return f"wow_checkpoint__{mongo_name(context, field='context')}"


def quarantine_collection(context: str) -> str:
    return f"wow_quarantine__{mongo_name(context, field='context')}"


def outbox_collection(context: str) -> str:
    return f"wow_outbox__{mongo_name(context, field='context')}"


DEFAULT_OPERATION_TIMEOUT = timedelta(seconds=10)
"""The deadline of one store call (PyMongo's ``pymongo.timeout``) unless told otherwise."""

INDEX_COMMIT_QUORUM = "majority"
"""The ``commitQuorum`` of wowd's index builds (manual, "createIndexes": the default,
``votingMembers``, waits for every data-bearing voting member, one down included)."""

COMMAND_PART_BYTES = 15 * 1024 * 1024
"""What the part of one command a store builds (a filter, a pipeline) may encode to: the server's
16 MiB ``maxBsonObjectSize`` for the whole command, less room for what the driver adds beside it
(``$db``, ``lsid``, ``$clusterTime``, ``maxTimeMS``, the cursor options)."""

T = TypeVar("T")
Doc = dict[str, Any]
"""A MongoDB document as the stores build and read them."""


def split_to_fit(
    items: Sequence[T], build: Callable[[Sequence[T]], Mapping[str, Any]], limit: int = COMMAND_PART_BYTES
) -> list[Sequence[T]]:
    """``items``, in order, in as few runs as keep the document ``build`` makes of each run
    within ``limit`` bytes of BSON: all of them in one run when they fit, else halved as often
    as needed. A single item over ``limit`` stays a run of its own (the driver refuses it)."""
    if not items:
        return []
    if len(items) == 1 or len(bson.encode(build(items))) <= limit:
        return [items]
    half = len(items) // 2
    return split_to_fit(items[:half], build, limit) + split_to_fit(items[half:], build, limit)


# --------------------------------------------------------------------------- server errors

DUPLICATE_KEY = 11000
NAMESPACE_EXISTS = 48
ALREADY_INITIALIZED = 23
"""``shardCollection`` of a collection sharded on another key."""
CANNOT_CREATE_INDEX = 67
"""CannotCreateIndex: among others, a unique index the shard key is not a prefix of."""
UNAUTHORIZED = 13
CHANGE_STREAM_UNSUPPORTED = 40573
"""``$changeStream`` on a standalone server."""

HISTORY_LOST_CODES = frozenset(
    {
        286,  # ChangeStreamHistoryLost: the resume point is no longer in the oplog
        136,  # CappedPositionLost: the oplog was truncated under the stream's position
        280,  # ChangeStreamFatalError: the oplog covers the token's time but not its event
    }
)
"""The change stream's answers that mean its start point is gone: the log re-reads."""

TRANSIENT_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        43,  # CursorNotFound (a cursor killed by a failover or an idle timeout)
        50,  # MaxTimeMSExpired
        64,  # WriteConcernFailed / WriteConcernTimeout (wtimeout)
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        133,  # FailedToSatisfyReadPreference (no primary for the moment: an election)
        134,  # ReadConcernMajorityNotAvailableYet
        175,  # QueryPlanKilled (a yield met a dropped index or a moved chunk)
        189,  # PrimarySteppedDown
        202,  # NetworkInterfaceExceededTimeLimit
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)

TRANSIENT_LABELS = ("RetryableWriteError", "ResumableChangeStreamError", "TransientTransactionError")
"""The server's own word that a retry can succeed (4.4+ sends them with the error)."""


class MongoSharding(StrEnum):
    """Whether a store shards its collections: ``auto`` when the deployment is a sharded
    cluster, as far as the user may (best effort: refused sharding leaves it unsharded)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def durable_or_raise(exc: BulkWriteError, operation: str) -> None:
    """An unordered bulk that met a write-concern error raises :class:`StorageUnavailable`: what
    it wrote landed, but not as durably as asked; the writes are idempotent, so the caller
    retries the bulk whole (what landed answers as repeats)."""
    concern = (exc.details or {}).get("writeConcernErrors")
    if concern:
        raise StorageUnavailable(
            f"mongodb {operation}: write concern not satisfied ({concern[0].get('errmsg')})"
        ) from exc


def duplicate_keys(exc: BulkWriteError, operation: str) -> list[Mapping[str, Any]]:
    """The write errors of an unordered bulk that met only duplicate keys (E11000: documents
    another writer, or an earlier try, wrote already: routine, not failures), each with the
    ``index`` of its write. A write-concern error raises :class:`StorageUnavailable`
    (:func:`durable_or_raise`); any other write error re-raises ``exc``."""
    durable_or_raise(exc, operation)
    errors = (exc.details or {}).get("writeErrors") or []
    if not errors or any(e.get("code") != DUPLICATE_KEY for e in errors):
        raise exc
    return list(errors)


def is_duplicate_key(exc: BaseException) -> bool:
    return isinstance(exc, OperationFailure) and exc.code == DUPLICATE_KEY


def is_unauthorized(exc: BaseException) -> bool:
    return isinstance(exc, OperationFailure) and exc.code == UNAUTHORIZED


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same (idempotent) call can succeed.

    A bulk write that met a write-concern error is transient whatever its write errors: the
    writes are idempotent (E11000 items are routine on a replay) and the retry answers what
    landed as repeats. A bulk whose write errors include a transient code (an election part way)
    is transient too."""
    if isinstance(exc, ConnectionFailure | ExecutionTimeout | WTimeoutError | NotPrimaryError):
        return True
    if isinstance(exc, PyMongoError) and any(exc.has_error_label(label) for label in TRANSIENT_LABELS):
        return True
    if isinstance(exc, BulkWriteError):
        if exc.details.get("writeConcernErrors"):
            return True
        return any(e.get("code") in TRANSIENT_CODES for e in exc.details.get("writeErrors") or ())
    return isinstance(exc, OperationFailure) and exc.code in TRANSIENT_CODES


async def write_one(coll: AsyncCollection[Any], op: InsertOne[Any] | UpdateOne, operation: str) -> BulkWriteResult:
    """One single-document write, sent as ``insert_one``/``update_one`` send it (one command, one
    document) but read as a bulk: the server answers a duplicate key together with the write
    concern error of the same write (it waits for the write concern also when the write failed,
    so that the document the key met is as durable as asked), and PyMongo's single-document
    helpers raise the write error alone, dropping the write concern error. Here a write concern
    error, with or without a write error, raises :class:`StorageUnavailable` (the duplicate is
    not known durable: the caller retries); a duplicate key alone raises ``DuplicateKeyError``
    (its ``details`` the server's write error), as ``insert_one`` would; another write error
    raises ``OperationFailure``."""
    try:
        return await coll.bulk_write([op], ordered=True)
    except BulkWriteError as exc:
        details = exc.details or {}
        if details.get("writeConcernErrors"):
            raise StorageUnavailable(
                f"mongodb {operation}: write concern not satisfied ({details['writeConcernErrors'][0].get('errmsg')}); "
                f"the write answered {[e.get('code') for e in details.get('writeErrors') or []]}: not known durable"
            ) from exc
        errors = details.get("writeErrors") or []
        if not errors:
            raise
        error = errors[0]
        if error.get("code") == DUPLICATE_KEY:
            raise DuplicateKeyError(str(error.get("errmsg")), DUPLICATE_KEY, error) from exc
        raise OperationFailure(str(error.get("errmsg")), error.get("code"), error) from exc


@contextmanager
def translate_errors(operation: str) -> Iterator[None]:
    """Turns PyMongo errors into wowd's; the message names the operation and the server's reason."""
    try:
        yield
    except PyMongoError as exc:
        if is_transient(exc):
            raise StorageUnavailable(f"mongodb {operation}: {exc}") from exc
        raise StorageError(f"mongodb {operation}: {exc}") from exc


# --------------------------------------------------------------------------- the store base


class MongoStore:
    """The base of every MongoDB store.

    ``client_or_uri``: an ``AsyncMongoClient`` the caller owns (never closed here) or a URI the
    store opens a client for and closes in :meth:`close`. ``operation_timeout``: the deadline of
    each store call (PyMongo's ``pymongo.timeout``, sent as ``maxTimeMS``); ``None`` leaves the
    client's own ``timeoutMS``. ``label`` names the store in the metrics.
    """

    _label = "mongo"

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
        codec_options: CodecOptions[Any] | None = None,
    ) -> None:
        if operation_timeout is not None and operation_timeout <= timedelta(0):
            raise ConfigError(f"operation_timeout: must be > 0 or None, got {operation_timeout}")
        if isinstance(client_or_uri, str):
            self._client: AsyncMongoClient[Any] = AsyncMongoClient(client_or_uri)
            self._owns_client = True
        else:
            self._client = client_or_uri
            self._owns_client = False
        self._db: AsyncDatabase[Any] = self._client.get_database(database_name, codec_options=codec_options)
        self.operation_timeout = operation_timeout
        self._timeout = None if operation_timeout is None else operation_timeout.total_seconds()
        self._sharded: bool | None = None

    @property
    def client(self) -> AsyncMongoClient[Any]:
        """The client the store talks through (``wowd check`` asks it for the user's privileges)."""
        return self._client

    @contextmanager
    def _call(self, operation: str, *, bounded: bool = True) -> Iterator[None]:
        """One store call: the operation timeout over it (``bounded=False``: none, for calls
        whose commands are bounded one by one with :meth:`_deadline`), error translation, the
        latency histogram and the unavailability counter."""
        started = time.perf_counter()
        try:
            with translate_errors(f"{self._label}.{operation}"), self._deadline() if bounded else nullcontext():
                yield
        except StorageUnavailable:
            STORE_UNAVAILABLE.labels(self._label, operation).inc()
            raise
        finally:
            STORE_CALL_SECONDS.labels(self._label, operation).observe(time.perf_counter() - started)

    def _deadline(self) -> Any:
        """The operation timeout over one command or call (CSOT nests: an outer deadline caps it)."""
        return nullcontext() if self._timeout is None else pymongo.timeout(self._timeout)

    async def _create_indexes(
        self, name: str, indexes: Sequence[Mapping[str, Any]], logger: logging.Logger, *, why: str = ""
    ) -> Mapping[str, Any]:
        """``createIndexes`` of ``indexes`` on the collection ``name`` with no deadline at all
        (``pymongo.timeout(0)``: no ``maxTimeMS`` is sent, the client's ``timeoutMS`` does not
        apply): a build reads the whole collection, and the server aborts a build whose command
        was interrupted, so under a deadline an index over a large collection would never be
        built. ``commitQuorum`` :data:`INDEX_COMMIT_QUORUM`: a build commits once a majority of
        the voting members built it, not every one (the server's default), so a member down does
        not hold a start without end. Logs what it makes sure of before it (an index missing is
        built then), and what the server built after it. Answers the server's reply. Call it inside ``_call(...,
        bounded=False)``."""
        names = ", ".join(str(ix["name"]) for ix in indexes)
        logger.info(
            "mongodb %s: making sure of the indexes %s of %s%s (a missing one is built now, over the whole "
            "collection, with no deadline; it commits once a majority of the voting members built it)",
            self._label,
            names,
            name,
            f" ({why})" if why else "",
        )
        started = time.monotonic()
        command = {"createIndexes": name, "indexes": list(indexes), "commitQuorum": INDEX_COMMIT_QUORUM}
        with pymongo.timeout(0):
            reply: Mapping[str, Any] = await self._db.command(command)
        before, after = reply.get("numIndexesBefore"), reply.get("numIndexesAfter")
        if isinstance(before, int) and isinstance(after, int) and after > before:
            logger.info(
                "mongodb %s: built %d index(es) of %s in %.1f s",
                self._label,
                after - before,
                name,
                time.monotonic() - started,
            )
        return reply

    async def _is_sharded(self, sharding: MongoSharding) -> bool:
        """Whether to shard the store's collections: ``on`` yes, ``off`` no, ``auto`` when the
        server is a ``mongos`` (``hello``'s ``msg: isdbgrid``, asked once)."""
        if sharding is MongoSharding.OFF:
            return False
        if sharding is MongoSharding.ON:
            return True
        if self._sharded is None:
            with self._deadline():
                hello = await self._client.admin.command("hello")
            self._sharded = hello.get("msg") == "isdbgrid"
        return self._sharded

    async def _shard_collection(
        self,
        name: str,
        key: Mapping[str, Any],
        sharding: MongoSharding,
        logger: logging.Logger,
        *,
        what: str,
        bounded: bool,
    ) -> bool:
        """``shardCollection`` of ``name`` by ``key`` (idempotent on 7.0); True when sharded. A
        user who may not shard (Unauthorized): with ``sharding=auto`` the collection stays
        unsharded, logged (False); with ``sharding=on`` a :class:`ConfigError`. ``bounded``: the
        command under the operation timeout."""
        ns = f"{self._db.name}.{name}"
        try:
            with self._deadline() if bounded else nullcontext():
                await self._client.admin.command("shardCollection", ns, key=dict(key))
        except OperationFailure as exc:
            if not is_unauthorized(exc):
                raise
            if sharding is MongoSharding.ON:
                raise ConfigError(
                    f"mongodb {self._label}: sharding=on, but the user may not shard {ns} ({exc}); grant "
                    "enableSharding on the database, or set WOWD_MONGODB__SHARDING=off"
                ) from exc
            logger.warning(
                "%s collection %s left unsharded: the user may not run shardCollection (%s); grant "
                "enableSharding on the database or set WOWD_MONGODB__SHARDING=off",
                what,
                ns,
                exc,
            )
            return False
        return True

    async def close(self) -> None:
        """Closes the client when the store opened it from a URI (never the caller's)."""
        if self._owns_client:
            await self._client.close()


class CollectionStore(MongoStore):
    """A store of one collection of a context (the outbox, the timers' history): named by
    :meth:`collection_of` the context, with the indexes :meth:`indexes`, which :meth:`prepare`
    creates (``ddl`` AUTO) or checks (VALIDATE: each by name, its keys in order, uniqueness,
    partial filter and expiry) or assumes (NONE). The :class:`MongoStore` constructor, with the
    context and the DDL mode."""

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        context: str,
        ddl: Ddl = Ddl.AUTO,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
    ) -> None:
        self.context = mongo_name(context, field="context")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self._coll: AsyncCollection[Any] = self._db[self.collection_of(context)]
        self._ddl = Ddl(ddl)

    def collection_of(self, context: str) -> str:
        raise NotImplementedError

    def indexes(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def prepare(self) -> None:
        """Creates (AUTO) or checks (VALIDATE) the indexes; idempotent."""
        logger = logging.getLogger(type(self).__module__)
        if self._ddl is Ddl.AUTO:
            with self._call("prepare", bounded=False):
                await self._create_indexes(self._coll.name, self.indexes(), logger)
        elif self._ddl is Ddl.VALIDATE:
            with self._call("prepare"):
                found = {ix["name"]: ix async for ix in await self._coll.list_indexes()}
            for spec in self.indexes():
                if not index_matches(found.get(spec["name"]), spec):
                    raise FormatError(f"mongodb {self._coll.name}: the index {spec} is missing (ddl=validate)")


def index_matches(found: Mapping[str, Any] | None, spec: Mapping[str, Any]) -> bool:
    """Whether the index ``found`` (as ``listIndexes`` answers it) is ``spec``: its keys in order
    (a compound index on the same keys in another order serves other queries), uniqueness,
    partial filter and expiry."""
    return (
        found is not None
        and list(found["key"].items()) == list(spec["key"].items())
        and bool(found.get("unique", False)) == bool(spec.get("unique", False))
        and found.get("partialFilterExpression") == spec.get("partialFilterExpression")
        and found.get("expireAfterSeconds") == spec.get("expireAfterSeconds")
    )
