"""A rebuild of the timer view from the log, beside the live view, swapped in while the replicas
run (``wowd timers rebuild``; docs/operations.md, "Recovery").

1. **Lock.** The backend's rebuild lock of the context (one rebuild at a time; another one is
   refused naming the holder), renewed at every progress line.
2. **Replay.** The context's log from its start, in log order and in batches, into a shadow of
   the view beside the live one, through the feed's own projection of commits into timer writes
   (:func:`~wowd.daemon.feed.prepare_batch`), written with the timer store's own writes: the
   shadow is the view the feed would have built (cancels leave their tombstones). Commits whose
   text shows they write nothing to the view are skipped undecoded.
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

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from wowd.config import WowdSettings
from wowd.errors import ConfigError
from wowd.model import LogEntry, TimerWrite
from wowd.stores.base import Backend
from wowd.views import TIMERS, view_named

from .feed import prepare_batch

if TYPE_CHECKING:  # the embedded backend's engine (imported where that backend is used)
    from wowd.stores.embedded.timer_rebuild import EmbeddedTimerRebuild as EmbeddedEngine

__all__ = ["TimerRebuildReport", "TimerRebuilder", "timer_view_consumer"]

log = logging.getLogger(__name__)

LOCK_TTL_S = 60.0
"""How long the rebuild lock holds without a renewal (renewed at every progress line)."""
PROGRESS_EVERY_S = 1.0
"""A progress line at most this often."""
READ_AHEAD = 2
"""Batches of the log read and projected ahead of the one written."""


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


def _project(settings: WowdSettings, aggregate: str | None) -> Callable[[Sequence[LogEntry]], list[TimerWrite]]:
    """The feed's projection of log entries into the timer view's writes (only ``aggregate``'s
    commits when given)."""

    def project(entries: Sequence[LogEntry]) -> list[TimerWrite]:
        if aggregate is not None:
            entries = [e for e in entries if e.aggregate.aggregate == aggregate]
        if not entries:
            return []
        return prepare_batch(entries, settings.timers.max_body_bytes, settings.partitions).timer_writes

    return project


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
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._progress = progress
        self._batch_size = batch_size
        self._every_s = progress_every_s

    def _engine(self) -> EmbeddedEngine:
        if self._backend.name != "embedded":
            raise ConfigError(f"the timer view rebuild runs on the embedded backend, not on {self._backend.name}")
        from wowd.stores.embedded.timer_rebuild import EmbeddedTimerRebuild
        from wowd.stores.embedded.timers import EmbeddedTimerStore

        timers = self._backend.timers
        assert isinstance(timers, EmbeddedTimerStore)
        return EmbeddedTimerRebuild(timers.path, timers=timers)

    async def run(
        self, *, aggregate: str | None = None, dry_run: bool = False, fire_expired: bool = False
    ) -> TimerRebuildReport:
        """The rebuild; raises :class:`~wowd.stores.embedded.timer_rebuild.RebuildRunning` when
        another one runs, :class:`~wowd.errors.LeaseLost` when another took the lock meanwhile."""
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
        project = _project(s, aggregate)
        await engine.begin()
        report.total = await engine.log_commits()
        self._progress(
            f"rebuild of the timer view of context {s.context!r}"
            + (f", aggregate {aggregate!r}" if aggregate else "")
            + f": replaying {report.total} commits into {engine.shadow}"
        )
        shown = time.monotonic()
        last = [0]
        send, receive = anyio.create_memory_object_stream[tuple[int, list[TimerWrite]]](READ_AHEAD)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_ahead, engine, project, send, last)
            async with receive:
                async for n, writes in receive:
                    report.commits += n
                    await engine.write(writes)
                    now = time.monotonic()
                    if now - shown >= self._every_s:
                        shown = now
                        await engine.renew(LOCK_TTL_S)
                        await self._line(engine, report)
        await self._line(engine, report)
        read = dict.fromkeys(range(s.partitions), last[0])  # every partition read to the same point
        retention_ms = s.timers.tombstone_retention_s * 1000
        expired_before = None if fire_expired else int(time.time() * 1000) - retention_ms
        from wowd.stores.embedded.timer_rebuild import Finished

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
        report.statuses = finished.statuses
        report.carried = finished.carried
        report.old_view = finished.old_view
        report.unreadable = finished.unreadable
        report.fired_in_outbox = finished.fired_in_outbox
        report.expired = finished.expired
        report.expired_listed = [(e.timer_id, e.owner, e.key, e.due_at) for e in finished.expired_listed]
        report.swapped = finished.swapped
        log.info(
            "timer view of %s rebuilt%s: %d commits, %d live, %d expired, swapped %s",
            s.context,
            " (dry run)" if dry_run else "",
            report.commits + report.caught_up,
            report.live,
            report.expired,
            report.swapped,
        )

    async def _read_ahead(
        self,
        engine: EmbeddedEngine,
        project: Callable[[Sequence[LogEntry]], list[TimerWrite]],
        send: MemoryObjectSendStream[tuple[int, list[TimerWrite]]],
        last: list[int],
    ) -> None:
        """Reads the log in its order to its end and projects each batch while the batch before
        is written (the decoding is Python; the write runs on the connection's thread), handing
        on (commits read, timer writes); ``last[0]``: the ``seq`` read to."""
        async with send:
            while True:
                n, seq, entries = await engine.read(last[0], self._batch_size)
                if not n:
                    return
                last[0] = seq
                await send.send((n, project(entries)))

    async def _line(self, engine: EmbeddedEngine, report: TimerRebuildReport) -> None:
        live = await engine.live_count()
        share = f" ({100 * report.commits // report.total}%)" if report.total else ""
        self._progress(f"rebuild: {report.commits} of {report.total} commits read{share}, {live} timers live")
