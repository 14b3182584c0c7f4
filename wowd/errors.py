"""wowd's exceptions: one root, translated from driver errors at the store's edge.

The daemon catches these, never a PyMongo, Elasticsearch or sqlite3 exception: each store
raises ``StorageUnavailable(...) from exc`` (or another class here) where it met the driver's.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ConflictError",
    "FormatError",
    "InvalidInput",
    "LeaseLost",
    "LogBehindOplog",
    "ReducerFailed",
    "SinkWriteError",
    "SlotStalled",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "StoreRefused",
    "WowdError",
]


class WowdError(Exception):
    """Root of every error wowd raises on purpose."""


class ConfigError(WowdError, ValueError):
    """The configuration is invalid (a misspelled key, a value out of range, an invalid name)."""


class InvalidInput(WowdError, ValueError):
    """Input from outside (a commit, a timer event, an answer) cannot be read.

    ``field`` names the offending field (dotted path) so the message and the metric can say it;
    ``ref`` and ``version`` name the record (a commit: its aggregate and version) when a store
    refused one record of a batch for what it holds, so that the caller can set it aside.
    """

    def __init__(
        self, message: str, *, field: str | None = None, ref: object | None = None, version: int | None = None
    ) -> None:
        text = f"{field}: {message}" if field else message
        if ref is not None:
            text += f" (record {ref}" + (f" version {version})" if version is not None else ")")
        super().__init__(text)
        self.field = field
        self.reason = message
        self.ref = ref
        self.version = version


class StorageError(WowdError):
    """A store failed in a way retrying will not fix (a defect, a refused write, a bad answer)."""


class StorageUnavailable(StorageError):
    """A transient store failure: network error, timeout, election, 429/502/503/504, busy file.

    The caller retries with backoff; nothing it wrote before is lost.
    """


class StorageFull(StorageUnavailable):
    """The store has no room for a write (a full disk or quota: SQLite's "database or disk is
    full"). Transient: nothing is written, reads still answer, and the same write succeeds once
    space returns; the caller retries with backoff and reports the work stalled at once (it will
    not resolve by itself within seconds)."""


class StoreRefused(StorageUnavailable):
    """The store refuses every write for a reason of its own, not the record's: expired
    credentials, a missing privilege, a write block, a closed index, a server error. Nothing is
    set aside: the caller stalls (not ready) and retries until the store takes writes again.
    The message names the cause (``index wow.x.events is write-blocked (index.blocks.write)``).
    """


class LogBehindOplog(StorageUnavailable):
    """A log read fell behind the MongoDB oplog window again after re-reading its partitions
    once: its change stream lost its history (the oplog was truncated past its position) twice
    in one read. Re-reading would only lose it again: the slot stalls until more oplog is kept
    (``oplogMinRetentionHours``, ``replSetResizeOplog``) or the feed keeps up. ``partitions``:
    the partitions the stream lost."""

    def __init__(self, message: str, *, partitions: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.partitions = partitions


class ConflictError(StorageError):
    """A write met a conflicting one: e.g. a log append at a version that exists."""


class FormatError(StorageError):
    """A collection, table or index was recorded in another layout version (``MongoFormat``)."""


class SinkWriteError(StorageError):
    """The event sink refused an item for a reason that is not transient; names the item."""


class ReducerFailed(WowdError):
    """A reducer raised folding a commit: its snapshot view stalls and retries the batch (a
    reducer's bug is fixed by a new release, not by setting commits aside); the other views go on."""


class SlotStalled(WowdError):
    """A slot's feed could not progress for ``feed.stall_release_s``: the slot is given up so
    that another replica can try it."""


class LeaseLost(WowdError):
    """A lease is no longer valid (expired on the holder's clock, or renew/release refused)."""
