"""A rebuild of the timer view from the log, beside the live view, swapped in while the replicas
run (``wowd timers rebuild``; docs/operations.md, "Recovery").

1. **Lock.** The backend's rebuild lock of the context (one rebuild at a time; another one is
   refused naming the holder), renewed at every progress line.
2. **Replay.** The context's log from its start, in log order and in batches, into a shadow of
   the view beside the live one, through the feed's own projection of commits into timer writes
   (:func:`~wowd.daemon.feed.prepare_batch`), written with the timer store's own writes: the
   shadow is the view the feed would have built (cancels leave their tombstones). Commits whose
   text shows they write nothing to the view are skipped undecoded. A large log is read, decoded
   and projected in ranges by a pool of processes (:func:`pool_size`), written in log order.
3. **Finish.** In one write transaction of the backend: the shadow catches up to the timer view's
   checkpoint of each partition (:func:`timer_view_consumer`), fired one-shot timers the outbox
   knows of become tombstones, one-shot timers due before the tombstone retention with no
   tombstone are "expired, state unknown" (FAILED, not fired, unless ``fire_expired``), what the
   old view holds that the log does not (tombstones, attempts, PARKED, FAILED and their reasons,
   claims, occurrences of recurring timers) is carried over where its rows can be read, and the
   shadow replaces the view. Deliveries pause while that transaction holds the write lock.

A dry run does all of it and rolls the finishing transaction back: the counts, nothing changed.
A rebuild interrupted anywhere leaves the live view as it was; run it again.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from wowd.config import TimerSettings, WowdSettings
from wowd.errors import ConfigError
from wowd.model import LogEntry, TimerWrite
from wowd.stores.base import Backend
from wowd.stores.timer_rebuild import Finished
from wowd.views import TIMERS, view_named

from .feed import prepare_batch

if TYPE_CHECKING:  # the embedded backend's engine (imported where that backend is used)
    from wowd.stores.embedded.timer_rebuild import EmbeddedTimerRebuild as EmbeddedEngine

__all__ = ["TimerRebuildReport", "TimerRebuilder", "project_for", "timer_view_consumer"]

SO_FAR = "timers scheduled and not cancelled so far (the summary counts those live once the fired ones are known)"
"""What a progress line's count is: the summary's live timers are fewer by the one-shot timers
found fired at the end (in the outbox, or the old view's tombstones)."""

log = logging.getLogger(__name__)

LOCK_TTL_S = 60.0
"""How long the rebuild lock holds without a renewal (renewed at every progress line)."""
PROGRESS_EVERY_S = 1.0
"""A progress line at most this often."""
COUNT_SHARE = 0.05
"""The most of the replay's time the progress lines spend counting live timers (a count reads
the whole shadow: a line between two counts shows the last one)."""
READ_AHEAD = 2
"""Batches of the log read and projected ahead of the one written."""
POOL_MIN_COMMITS = 50_000
"""A replay of at least this many commits is decoded and projected by a pool of processes (one
per CPU) while this one writes: below it, starting the pool costs more than it saves."""
POOL_MAX = 4
"""The most processes of a replay's pool."""
POOL_IN_FLIGHT = 3
"""Ranges of the log given to each process of the pool ahead of the one written."""


def timer_view_consumer() -> str:
    """The checkpoint consumer whose checkpoints say how far the timer view has applied the log
    (its own: no other view is replayed): the one a rebuilt view is made consistent with before
    it is swapped in."""
    return view_named(TIMERS).consumer


@dataclass(slots=True)
class TimerRebuildReport:
    """What a rebuild read, found and did."""

    context: str
    aggregate: str | None
    commits: int = 0
    """Commits replayed before the finishing transaction."""
    caught_up: int = 0
    """Commits read in the finishing transaction (applied by the feed since the replay read them)."""
    total: int = 0
    """Commits of the log when the replay started."""
    statuses: dict[str, int] = field(default_factory=dict)
    """Timers of the new view per status (tombstones as DONE and CANCELLED)."""
    carried: int = 0
    old_view: bool = True
    unreadable: list[int] = field(default_factory=list)
    fired_in_outbox: int = 0
    expired: int = 0
    expired_listed: list[tuple[str, str, str, int]] = field(default_factory=list)
    """``(timer_id, owner, key, due_at)`` of the first expired timers."""
    swapped: bool = False
    dry_run: bool = False
    finish_s: float = 0.0
    """How long the finishing transaction held the write lock."""

    @property
    def live(self) -> int:
        return sum(n for s, n in self.statuses.items() if s not in ("DONE", "CANCELLED"))

    def finished(self, found: Finished, *, context: str) -> None:
        """Takes what the finish found and did, and logs the rebuild's end."""
        self.statuses = found.statuses
        self.carried = found.carried
        self.old_view = found.old_view
        self.unreadable = found.unreadable
        self.fired_in_outbox = found.fired_in_outbox
        self.expired = found.expired
        self.expired_listed = [(e.timer_id, e.owner, e.key, e.due_at) for e in found.expired_listed]
        self.swapped = found.swapped
        log.info(
            "timer view of %s rebuilt%s: %d commits, %d live, %d expired, swapped %s",
            context,
            " (dry run)" if self.dry_run else "",
            self.commits + self.caught_up,
            self.live,
            self.expired,
            self.swapped,
        )


def project_for(settings: WowdSettings, aggregate: str | None) -> Callable[[Sequence[LogEntry]], list[TimerWrite]]:
    """The feed's projection of log entries into the timer view's writes under ``settings``
    (only ``aggregate``'s commits when given)."""
    return _projection(settings.timers, settings.partitions, aggregate)


def _projection(
    limits: TimerSettings, partitions: int, aggregate: str | None
) -> Callable[[Sequence[LogEntry]], list[TimerWrite]]:
    """The feed's projection of log entries into the timer view's writes (only ``aggregate``'s
    commits when given)."""

    def project(entries: Sequence[LogEntry]) -> list[TimerWrite]:
        if aggregate is not None:
            entries = [e for e in entries if e.aggregate.aggregate == aggregate]
        if not entries:
            return []
        return prepare_batch(entries, limits, partitions).timer_writes

    return project


Steps = list[tuple[str, tuple[Any, ...]]]
"""The timer store's planned writes (``EmbeddedTimerStore.steps_of``)."""


class _Planner:
    """Reads ranges of the log on a connection of its own, decodes them and projects them into
    the timer store's planned writes: in a process of the replay's pool (:func:`_plan_range`)."""

    def __init__(self, path: str, context: str, partitions: int, limits: TimerSettings, aggregate: str | None) -> None:
        from wowd.stores.embedded.db import SqliteDatabase
        from wowd.stores.embedded.timers import EmbeddedTimerStore

        self._db = SqliteDatabase(path)
        self._context = context
        self._timers = EmbeddedTimerStore(self._db, context=context, partitions=partitions)
        self._project = _projection(limits, partitions, aggregate)

    def plan(self, after: int, upto: int) -> tuple[int, Steps, set[str]]:
        """The commits of ``after < seq <= upto``: how many, their planned writes and the
        aggregate types whose timers those put."""
        from wowd.stores.embedded.timer_rebuild import replay_entries, rows_between
        from wowd.stores.embedded.timers import put_types

        ctx = self._context
        rows = self._db.run_sync(lambda conn: rows_between(conn, ctx, after, upto))
        writes = self._project(replay_entries(ctx, rows))
        return len(rows), self._timers.steps_of(writes), put_types(writes)


_planner: _Planner | None = None
"""A pool process's planner (:func:`_start_planner`)."""


def _start_planner(path: str, context: str, partitions: int, limits: TimerSettings, aggregate: str | None) -> None:
    global _planner
    _planner = _Planner(path, context, partitions, limits, aggregate)


def _plan_range(after: int, upto: int) -> tuple[int, Steps, set[str]]:
    assert _planner is not None
    return _planner.plan(after, upto)


def pool_size(commits: int) -> int:
    """The processes that decode and project a replay of ``commits`` commits: none (this process
    does) below :data:`POOL_MIN_COMMITS`, else one per CPU this process may use, at most
    :data:`POOL_MAX`."""
    if commits < POOL_MIN_COMMITS:
        return 0
    return max(
        1, min(POOL_MAX, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


class TimerRebuilder:
    """Rebuilds one context's timer view (module docstring)."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        *,
        progress: Callable[[str], None] = lambda _line: None,
        batch_size: int = 2000,
        progress_every_s: float = PROGRESS_EVERY_S,
        workers: int | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._progress = progress
        self._batch_size = batch_size
        self._every_s = progress_every_s
        self._workers = workers
        """Processes of the replay's pool (``None``: :func:`pool_size` of the log)."""
        self._live = 0
        self._count_at = 0.0

    def _engine(self) -> EmbeddedEngine:
        if self._backend.name != "embedded":
            raise ConfigError(f"no timer view rebuild on the {self._backend.name} backend")
        from wowd.stores.embedded.timer_rebuild import EmbeddedTimerRebuild
        from wowd.stores.embedded.timers import EmbeddedTimerStore

        timers = self._backend.timers
        assert isinstance(timers, EmbeddedTimerStore)
        return EmbeddedTimerRebuild(timers.path, timers=timers)

    async def run(
        self, *, aggregate: str | None = None, dry_run: bool = False, fire_expired: bool = False
    ) -> TimerRebuildReport:
        """The rebuild; raises :class:`~wowd.stores.timer_rebuild.RebuildRunning` when another
        one runs, :class:`~wowd.errors.LeaseLost` when another took the lock meanwhile (on MongoDB:
        :class:`~wowd.daemon.timer_rebuild_mongo.MongoTimerRebuilder`)."""
        s = self._settings
        report = TimerRebuildReport(context=s.context, aggregate=aggregate, dry_run=dry_run)
        engine = self._engine()
        try:
            await engine.acquire(LOCK_TTL_S)
            try:
                await self._replay(engine, aggregate, fire_expired, dry_run, report)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await engine.abort()
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await engine.release()
        finally:
            await engine.close()
        return report

    async def _replay(
        self,
        engine: EmbeddedEngine,
        aggregate: str | None,
        fire_expired: bool,
        dry_run: bool,
        report: TimerRebuildReport,
    ) -> None:
        s = self._settings
        project = project_for(s, aggregate)
        await engine.begin()
        report.total = await engine.log_commits()
        self._progress(
            f"rebuild of the timer view of context {s.context!r}"
            + (f", aggregate {aggregate!r}" if aggregate else "")
            + f": replaying {report.total} commits into {engine.shadow}"
        )
        shown = time.monotonic()
        last = [0]
        workers = pool_size(report.total) if self._workers is None else self._workers
        send, receive = anyio.create_memory_object_stream[tuple[int, Steps, set[str]]](READ_AHEAD)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_ahead, engine, project, aggregate, workers, send, last)
            async with receive:
                async for n, steps, types in receive:
                    report.commits += n
                    await engine.write_steps(steps, types)
                    now = time.monotonic()
                    if now - shown >= self._every_s:
                        shown = now
                        await engine.renew(LOCK_TTL_S)
                        await self._line(engine, report)
        await self._line(engine, report, last=True)
        read = dict.fromkeys(range(s.partitions), last[0])  # every partition read to the same point
        retention_ms = s.timers.tombstone_retention_s * 1000
        expired_before = None if fire_expired else int(time.time() * 1000) - retention_ms
        finished = Finished()
        await engine.carry_over(expired_before=expired_before, result=finished)
        started = time.monotonic()
        await engine.finish(
            read,
            consumer=timer_view_consumer(),
            project=project,
            aggregate=aggregate,
            swap=not dry_run,
            result=finished,
        )
        report.finish_s = time.monotonic() - started
        report.caught_up = finished.caught_up
        report.finished(finished, context=s.context)

    async def _read_ahead(
        self,
        engine: EmbeddedEngine,
        project: Callable[[Sequence[LogEntry]], list[TimerWrite]],
        aggregate: str | None,
        workers: int,
        send: MemoryObjectSendStream[tuple[int, Steps, set[str]]],
        last: list[int],
    ) -> None:
        """Reads the log in its order to its end and projects each batch while the batch before
        is written (the write runs on the connection's thread), handing on (commits read, planned
        writes, the aggregate types they put timers of); ``last[0]``: the ``seq`` read to. With
        ``workers``, the log as it was at the start is read, decoded and projected in ranges by
        a pool of that many processes (the decoding is Python: the processes use the other
        CPUs), then what was appended meanwhile by this one."""
        from wowd.stores.embedded.timers import put_types

        async with send:
            if workers and engine.path != ":memory:":
                await self._pooled(engine, aggregate, workers, send, last)
            while True:
                n, seq, entries = await engine.read(last[0], self._batch_size)
                if not n:
                    return
                last[0] = seq
                writes = project(entries)
                await send.send((n, engine.steps_of(writes), put_types(writes)))

    async def _pooled(
        self,
        engine: EmbeddedEngine,
        aggregate: str | None,
        workers: int,
        send: MemoryObjectSendStream[tuple[int, Steps, set[str]]],
        last: list[int],
    ) -> None:
        """:meth:`_read_ahead` of the log to its last ``seq`` at the start, by a pool of
        ``workers`` processes, in ranges of :attr:`_batch_size` ``seq`` handed on in log order."""
        s = self._settings
        top = await engine.last_seq()
        loop = asyncio.get_running_loop()
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_planner,
            initargs=(engine.path, s.context, s.partitions, s.timers, aggregate),
        )
        try:
            pending: deque[tuple[int, asyncio.Future[tuple[int, Steps, set[str]]]]] = deque()
            after = last[0]
            while after < top or pending:
                while after < top and len(pending) < workers * POOL_IN_FLIGHT:
                    upto = min(after + self._batch_size, top)
                    pending.append((upto, loop.run_in_executor(pool, _plan_range, after, upto)))
                    after = upto
                upto, future = pending.popleft()
                n, steps, types = await future
                last[0] = upto
                if n:
                    await send.send((n, steps, types))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _line(self, engine: EmbeddedEngine, report: TimerRebuildReport, *, last: bool = False) -> None:
        """A progress line; the live timers counted again when the counting has taken no more
        than :data:`COUNT_SHARE` of the time since the last count (it reads the whole shadow),
        and on the ``last`` line."""
        now = time.monotonic()
        if last or now >= self._count_at:
            self._live = await engine.live_count()
            took = time.monotonic() - now
            self._count_at = now + took / COUNT_SHARE
        share = f" ({100 * report.commits // report.total}%)" if report.total else ""
        self._progress(f"rebuild: {report.commits} of {report.total} commits read{share}, {self._live} {SO_FAR}")
