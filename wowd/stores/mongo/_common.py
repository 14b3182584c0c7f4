"""Naming, DDL and error translation shared by the MongoDB stores.

Vendor errors stop here (httpx's ``map_httpcore_exceptions`` habit): inside
``with translate_errors("op"):`` a PyMongo error becomes :class:`StorageUnavailable` when
retrying can help (network, timeout, election, ``RetryableWriteError`` label) and
:class:`StorageError` (with the server's message) otherwise. Callers that must inspect a
specific server error (E11000 on an upsert, ``BulkWriteError`` details) catch it first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

from pymongo.errors import (
    BulkWriteError,
    ConnectionFailure,
    ExecutionTimeout,
    NotPrimaryError,
    OperationFailure,
    PyMongoError,
    WTimeoutError,
)

from wowd.errors import StorageError, StorageUnavailable
from wowd.model import validate_name
from wowd.stores.base import Ddl

__all__ = [
    "DUPLICATE_KEY",
    "FORMAT",
    "TRANSIENT_CODES",
    "Ddl",
    "MongoSharding",
    "collection_name",
    "is_duplicate_key",
    "translate_errors",
]

FORMAT = 5
"""The layout version of wowd's collections (``format`` in the registries)."""

DUPLICATE_KEY = 11000

TRANSIENT_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        50,  # MaxTimeMSExpired
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        189,  # PrimarySteppedDown
        202,  # NetworkInterfaceExceededTimeLimit
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
        64,  # WriteConcernFailed (wtimeout)
    }
)


class MongoSharding(StrEnum):
    """Whether a store shards its collections: ``auto`` when the deployment is a sharded cluster."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def collection_name(kind: str, context: str, aggregate: str) -> str:
    """``wow_<kind>__<context>__<aggregate>``: the rule of the log's collections."""
    validate_name(context, field="context")
    validate_name(aggregate, field="aggregate")
    return f"wow_{kind}__{context}__{aggregate}"


def is_duplicate_key(exc: BaseException) -> bool:
    return isinstance(exc, OperationFailure) and exc.code == DUPLICATE_KEY


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionFailure | ExecutionTimeout | WTimeoutError | NotPrimaryError):
        return True
    if isinstance(exc, PyMongoError) and exc.has_error_label("RetryableWriteError"):
        return True
    if isinstance(exc, BulkWriteError):
        wce = exc.details.get("writeConcernErrors") or []
        return bool(wce) and not exc.details.get("writeErrors")
    return isinstance(exc, OperationFailure) and exc.code in TRANSIENT_CODES


@contextmanager
def translate_errors(operation: str) -> Iterator[None]:
    """Turns PyMongo errors into wowd's; the message names the operation and the server's reason."""
    try:
        yield
    except PyMongoError as exc:
        if is_transient(exc):
            raise StorageUnavailable(f"mongodb {operation}: {exc}") from exc
        raise StorageError(f"mongodb {operation}: {exc}") from exc


__all__ += ["is_transient"]
_ = Ddl  # re-exported for the stores
