"""The embedded backend's operations object (:class:`~wowd.stores.base.Operations`): made from the
settings, it opens every store on one SQLite file in WAL mode, reads what ``wowd check`` reads
before that, and offers the online backup (:data:`~wowd.stores.base.ONLINE_BACKUP`) and the timer
view rebuild (:data:`~wowd.stores.base.TIMER_VIEW_REBUILD`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread

from wowd import metrics
from wowd.errors import ConfigError, WowdError
from wowd.model import AggregateType
from wowd.stores.base import (
    ONLINE_BACKUP,
    TIMER_VIEW_REBUILD,
    Backend,
    BackupDone,
    CheckLine,
    Offers,
    Preflight,
    Projection,
    TimerViewRebuild,
)
from wowd.stores.embedded.db import SqliteDatabase, WalCheckpointer
from wowd.stores.embedded.sqlite import LIBRARY, MODULE, WAL_RESET_BUG, sqlite3

if TYPE_CHECKING:
    from wowd.config import WowdSettings
    from wowd.stores.embedded.sink import EmbeddedEventSink

__all__ = ["SINK_MEMORY", "EmbeddedOperations"]

log = logging.getLogger("wowd.stores.embedded")

SINK_MEMORY = 16_384
"""Aggregates whose last written attributes the event sinks remember, all types together."""


class EmbeddedOperations(Offers):
    """The operations of the embedded backend on the file ``settings.embedded.path``."""

    CAPABILITIES = (ONLINE_BACKUP, TIMER_VIEW_REBUILD)
    name = "embedded"
    recovery = "wowd backup PATH, while replicas run (docs/operations.md, Recovery)"

    def __init__(self, settings: WowdSettings) -> None:
        self._settings = settings
        self._path = settings.embedded.path

    def where(self) -> str:
        return f"embedded file {self._path}"

    def outbox_where(self) -> str:
        return "the outbox table of the file"

    def absent(self, how_to_create: str) -> ConfigError | None:
        """The file does not exist (a mistyped path, the wrong directory)."""
        path = self._path
        if path.exists():
            return None
        where = "" if path.is_absolute() else f" (in {str(path.absolute().parent)!r})"
        return ConfigError(
            f"WOWD_EMBEDDED__PATH: the database file {str(path)!r}{where} does not exist "
            f"(wowd run creates it; {how_to_create})"
        )

    # ---- wowd check, before opening

    async def preflight(self) -> Preflight:
        """A file that does not exist: whether its directory allows it (nothing created, the
        stores not opened). Else SQLite's ``quick_check`` of the file (a corrupted page is a
        failure even when every store still answers its probe: the probes read a few pages),
        the SQLite library, and the formats recorded (read-only)."""
        path = self._path
        if not path.exists():
            return Preflight([_new_file(path)])
        found = Preflight(await _quick_check(path))
        db = SqliteDatabase(path)
        try:
            from wowd.stores.embedded.schema import embedded_formats, rebuild_state

            context = self._settings.context
            rebuild = await db.run(lambda conn: rebuild_state(conn, context))
            if rebuild is not None:
                found.lines.append(CheckLine(True, f"timer view rebuild: {rebuild}"))
            found.formats = await db.run(lambda conn: embedded_formats(conn, context))
        except WowdError as exc:
            found.lines.append(CheckLine(False, f"formats: {type(exc).__name__}: {exc}"))
        finally:
            db.close()
        return found

    # ---- the stores

    async def open(self) -> Backend:
        """Every embedded store of ``settings.context`` on ``settings.embedded.path``, prepared;
        the log's tables on one connection (its reads of the head on another), the timer
        stores on one, each other store on its own, and the file's WAL checkpointed in the
        background (:class:`~wowd.stores.embedded.db.WalCheckpointer`). The backend's ``close``
        closes them all."""
        from wowd.stores.embedded.checkpoints import EmbeddedCheckpoints
        from wowd.stores.embedded.feed import EmbeddedFeedWriter
        from wowd.stores.embedded.history import EmbeddedTimerHistory
        from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
        from wowd.stores.embedded.log import EmbeddedLog
        from wowd.stores.embedded.outbox import EmbeddedOutbox
        from wowd.stores.embedded.quarantine import EmbeddedQuarantine
        from wowd.stores.embedded.sink import AccessMemory, EmbeddedEventSink
        from wowd.stores.embedded.snapshot_rebuilds import EmbeddedSnapshotRebuilds
        from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore
        from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring
        from wowd.stores.embedded.timer_queries import EmbeddedTimerQueries
        from wowd.stores.embedded.timer_view import EmbeddedTimerView

        settings, path = self._settings, self._path
        context, partitions = settings.context, settings.partitions
        if WAL_RESET_BUG:
            log.warning(
                "embedded file %s on %s, which has the WAL-reset bug (https://sqlite.org/wal.html#walresetbug): "
                "its checkpoints are FULL, and writers wait for them; install pysqlite3 or a SQLite >= 3.51.3",
                path,
                LIBRARY,
            )
        else:
            log.debug("embedded file %s on %s", path, LIBRARY)
        async with AsyncExitStack() as stack:
            checkpointer = WalCheckpointer(path)
            checkpointer.start()
            stack.push_async_callback(checkpointer.aclose)

            def connection() -> SqliteDatabase:
                db = SqliteDatabase(path)
                stack.push_async_callback(anyio.to_thread.run_sync, db.close)
                return db

            leases = EmbeddedSlotLeaseStore(path)
            stack.push_async_callback(leases.close)
            log_db = connection()  # appends, checkpoints and the quarantine: one connection
            log_ = EmbeddedLog(log_db, context=context, partitions=partitions)
            stack.push_async_callback(log_.close)
            checkpoints = EmbeddedCheckpoints(log_db, context=context)
            quarantine = EmbeddedQuarantine(log_db, context=context)
            timer_db = connection()  # the view, firing and the reads of the timers: one connection
            timers = EmbeddedTimerView(timer_db, context=context, partitions=partitions)
            firing = EmbeddedTimerFiring(timer_db, context=context, partitions=partitions)
            queries = EmbeddedTimerQueries(timer_db, context=context, partitions=partitions)
            snapshot_db = connection()
            snapshots = EmbeddedSnapshotStore(snapshot_db, context=context)
            rebuilds = EmbeddedSnapshotRebuilds(snapshot_db, context=context)
            outbox = EmbeddedOutbox(path)
            stack.push_async_callback(outbox.close)
            history = EmbeddedTimerHistory(path, context=context) if settings.timers.history else None
            if history is not None:
                stack.push_async_callback(history.close)
            # one at a time: the first prepare creates the file and switches it to WAL
            await leases.prepare()
            await log_.prepare()
            await timers.prepare()
            await snapshots.prepare()
            await outbox.prepare()
            if history is not None:
                await history.prepare()

            # the sinks of every aggregate type share one connection (its thread, its descriptors)
            # and one memory of the attributes they wrote
            sink_db = connection()
            memory = AccessMemory(SINK_MEMORY)

            def sink_factory(type: AggregateType) -> EmbeddedEventSink:
                return EmbeddedEventSink(sink_db, type, memory=memory)

            feed_writer = EmbeddedFeedWriter(path, checkpoints=checkpoints, timers=timers, firing=firing)
            stack.push_async_callback(feed_writer.close)

            backend = Backend(
                name=self.name,
                log=log_,
                checkpoints=checkpoints,
                quarantine=quarantine,
                leases=leases,
                timers=timers,
                firing=firing,
                timer_queries=queries,
                snapshots=snapshots,
                rebuilds=rebuilds,
                outbox=outbox,
                history=history,
                # the firing store: the outbox table and the log are in its own file; the feed
                # writer: the stores share the file's transactions; the leases: the store clock
                # is each process's own; and this object's capabilities
                offers=(firing, feed_writer, leases, self),
                sink_factory=sink_factory if settings.sink != "none" else None,
                resources=stack.pop_all(),  # success: the backend owns the stores now
            )
        metrics.EMBEDDED_SQLITE_INFO.labels(
            version=sqlite3.sqlite_version, module=MODULE, wal_reset_bug=str(WAL_RESET_BUG).lower()
        ).set(1)
        return backend

    # ---- capabilities

    async def backup(
        self, target: Path, *, force: bool, step_pages: int, progress: Callable[[str], None]
    ) -> BackupDone:
        """:class:`~wowd.stores.base.OnlineBackup` of the file
        (:func:`~wowd.stores.embedded.backup.backup`), in a worker thread."""
        from wowd.stores.embedded.backup import backup

        return await anyio.to_thread.run_sync(
            lambda: backup(self._path, target, force=force, step_pages=step_pages, progress=progress)
        )

    def rebuild(self, *, project: Projection, consumer: str, aggregate: str | None) -> TimerViewRebuild:
        """A rebuild of the timer view in a shadow table of the file, swapped in by one write
        transaction (:class:`~wowd.stores.embedded.timer_rebuild.EmbeddedTimerRebuild`)."""
        from wowd.stores.embedded.timer_rebuild import EmbeddedTimerRebuild

        s = self._settings
        return EmbeddedTimerRebuild(
            str(self._path),
            context=s.context,
            partitions=s.partitions,
            project=project,
            consumer=consumer,
            aggregate=aggregate,
        )


def _new_file(path: Path) -> CheckLine:
    """The file does not exist: it is not created here; its directory must allow it."""
    parent = path.parent if str(path.parent) else path.cwd()
    if not parent.is_dir():
        return CheckLine(False, f"embedded: {path} does not exist and its directory {parent} does not either")
    if not os.access(parent, os.W_OK | os.X_OK):
        return CheckLine(False, f"embedded: {path} does not exist and its directory {parent} is not writable")
    return CheckLine(True, f"embedded: {path} does not exist yet (not created by check; wowd run creates it)")


async def _quick_check(path: Path) -> list[CheckLine]:
    """SQLite's ``quick_check`` of the file, then the library it runs on."""
    db = SqliteDatabase(path)
    try:
        problem = await db.quick_check()
    except WowdError as exc:
        return [CheckLine(False, f"embedded file {path}: {type(exc).__name__}: {exc}")]
    finally:
        db.close()
    if problem is not None:
        return [CheckLine(False, f"embedded file {path}: quick_check: {problem}")]
    library = (
        f"{LIBRARY}, which has the WAL-reset bug: its checkpoints are FULL (writers wait for them)"
        if WAL_RESET_BUG
        else LIBRARY
    )
    return [CheckLine(True, f"embedded file {path} (quick_check)"), CheckLine(True, library)]
