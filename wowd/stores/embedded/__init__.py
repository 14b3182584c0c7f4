"""The embedded backend: every store on one SQLite file in WAL mode (docs/stores.md).

Several processes may share the file. Importing this package never imports pymongo or
elasticsearch. The timer, snapshot and sink classes are imported on first use of their names
(so that a store module is loaded only by who uses it).
"""

from __future__ import annotations

import importlib
import logging
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from wowd import metrics
from wowd.stores.base import Backend
from wowd.stores.embedded.db import SqliteDatabase, WalCheckpointer
from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
from wowd.stores.embedded.log import EmbeddedLog
from wowd.stores.embedded.outbox import EmbeddedOutbox
from wowd.stores.embedded.sqlite import LIBRARY, MODULE, WAL_RESET_BUG, sqlite3

if TYPE_CHECKING:
    from wowd.config import WowdSettings
    from wowd.stores.embedded.sink import EmbeddedEventSink
    from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore
    from wowd.stores.embedded.timers import EmbeddedTimerStore

__all__ = [
    "EmbeddedEventSink",
    "EmbeddedLog",
    "EmbeddedOutbox",
    "EmbeddedSlotLeaseStore",
    "EmbeddedSnapshotStore",
    "EmbeddedTimerStore",
    "SqliteDatabase",
    "open_embedded",
]

logger = logging.getLogger(__name__)

SINK_MEMORY = 16_384
"""Aggregates whose last written attributes the event sinks remember, all types together."""

_LAZY = {
    "EmbeddedTimerStore": "wowd.stores.embedded.timers",
    "EmbeddedSnapshotStore": "wowd.stores.embedded.snapshots",
    "EmbeddedEventSink": "wowd.stores.embedded.sink",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


async def open_embedded(settings: WowdSettings) -> Backend:
    """Every embedded store of ``settings.context`` on ``settings.embedded.path``, each on its own
    connection, prepared, and the file's WAL checkpointed in the background
    (:class:`~wowd.stores.embedded.db.WalCheckpointer`). The backend's ``close`` closes them all."""
    from wowd.model import AggregateType
    from wowd.stores.embedded.feed import EmbeddedFeedWriter
    from wowd.stores.embedded.history import EmbeddedTimerHistory
    from wowd.stores.embedded.sink import AccessMemory, EmbeddedEventSink
    from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore
    from wowd.stores.embedded.timers import EmbeddedTimerStore

    path = settings.embedded.path
    if WAL_RESET_BUG:
        logger.warning(
            "embedded file %s on %s, which has the WAL-reset bug (https://sqlite.org/wal.html#walresetbug): "
            "its checkpoints are FULL, and writers wait for them; install pysqlite3 or a SQLite >= 3.51.3",
            path,
            LIBRARY,
        )
    else:
        logger.debug("embedded file %s on %s", path, LIBRARY)
    async with AsyncExitStack() as stack:
        checkpointer = WalCheckpointer(path)
        checkpointer.start()
        stack.push_async_callback(checkpointer.aclose)
        leases = EmbeddedSlotLeaseStore(path)
        stack.push_async_callback(leases.close)
        log = EmbeddedLog(path, context=settings.context, partitions=settings.partitions)
        stack.push_async_callback(log.close)
        timers = EmbeddedTimerStore(path, context=settings.context, partitions=settings.partitions)
        stack.push_async_callback(timers.close)
        snapshots = EmbeddedSnapshotStore(path, context=settings.context)
        stack.push_async_callback(snapshots.close)
        outbox = EmbeddedOutbox(path)
        stack.push_async_callback(outbox.close)
        history = EmbeddedTimerHistory(path, context=settings.context) if settings.timers.history else None
        if history is not None:
            stack.push_async_callback(history.close)
        # one at a time: the first prepare creates the file and switches it to WAL
        await leases.prepare()
        await log.prepare()
        await timers.prepare()
        await snapshots.prepare()
        await outbox.prepare()
        if history is not None:
            await history.prepare()

        # the sinks of every aggregate type share one connection (its thread, its descriptors)
        # and one memory of the attributes they wrote
        sink_db = SqliteDatabase(path)
        stack.push_async_callback(anyio.to_thread.run_sync, sink_db.close)
        memory = AccessMemory(SINK_MEMORY)

        def sink_factory(type: AggregateType) -> EmbeddedEventSink:
            return EmbeddedEventSink(sink_db, type, memory=memory)

        feed_writer = EmbeddedFeedWriter(path, log=log, timers=timers)
        stack.push_async_callback(feed_writer.close)

        backend = Backend(
            name="embedded",
            log=log,
            leases=leases,
            timers=timers,
            snapshots=snapshots,
            rebuilds=snapshots,
            outbox=outbox,
            history=history,
            offers=(timers,),  # the outbox table and the log are in the timers' own file
            feed_writer=feed_writer,  # and the event sink's documents
            clock_reading=leases.clock_reading,  # the store clock: each process's own
            sink_factory=sink_factory if settings.sink != "none" else None,
            resources=stack.pop_all(),  # success: the backend owns the stores now
        )
    metrics.EMBEDDED_SQLITE_INFO.labels(
        version=sqlite3.sqlite_version, module=MODULE, wal_reset_bug=str(WAL_RESET_BUG).lower()
    ).set(1)
    return backend
