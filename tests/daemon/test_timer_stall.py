"""A timer loop whose store fails (a full disk, a damaged file) stalls and retries; it does not end.
In-process on the embedded backend, its timer store failing on request: the loop is stalled
(``TimerLoop.stall``, ``wowd_timers_stalled`` 1) while every call fails, fires nothing meanwhile,
and fires every due timer once by itself when the store answers again; a settle the store refuses
is retried until it answers, bounded (also on stop). Over a round strategy whose rounds fail on
request: the loop pauses with its backoff (a stop ends the pause), resumes by itself, and keeps
another step's stall; at start it ends the claims an earlier holding left, and runs no round
before the feed has applied the log it read."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import Recorder, embedded_settings, eventually, now_ms, timer
from tests.helpers import FAR_FUTURE_MS, caught_up_waker, hold_slot, timer_loop
from wowd import metrics
from wowd.config import TimerSettings, WowdSettings
from wowd.daemon import firing, timer_plan, timers
from wowd.daemon.leases import HeldSlot
from wowd.daemon.stall import Stall
from wowd.daemon.timer_plan import Round
from wowd.daemon.timers import ROUND, Logx, TimerLoop
from wowd.daemon.waker import Waker
from wowd.errors import StorageError, StorageFull
from wowd.model import TimerChange, TimerStatus
from wowd.retry import Backoff
from wowd.stores.base import Backend, TimerFiring

pytestmark = pytest.mark.anyio

PARTS = 4


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS)


FULL = StorageFull("sqlite wowd.db: database or disk is full")
DAMAGED = StorageError("sqlite wowd.db: database disk image is malformed")


class FailingTimers:
    """The timer store, whose loop calls (those named in ``failing``) raise ``fail`` while it is
    set (``settle_fail``: its settles only)."""

    def __init__(self, inner: TimerFiring) -> None:
        self._inner = inner
        self.fail: StorageError | None = None
        self.settle_fail: StorageError | None = None
        self.settles = 0
        self.failing = ("claim_due", "reclaim", "next_due", "sweep")

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def settle(self, changes: Sequence[TimerChange]) -> int:
        self._check()
        self.settles += 1
        if self.settle_fail is not None:
            raise self.settle_fail
        return await self._inner.settle(changes)

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._inner, name)
        if name not in self.failing:
            return call

        async def failing(*args: Any, **kwargs: Any) -> Any:
            self._check()
            return await call(*args, **kwargs)

        return failing


async def refused_settles(backend: Backend) -> tuple[FailingTimers, Recorder, HeldSlot, TimerLoop]:
    """A timer due now, and the loop of a slot over a store whose settles the full disk refuses."""
    assert await backend.timers.put(timer("ok-1", now_ms(), partitions=PARTS))
    store = FailingTimers(backend.firing)
    store.settle_fail = FULL
    gw = Recorder()
    return store, gw, await hold_slot(backend, PARTS), timer_loop(store, gw)  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [FULL, DAMAGED], ids=["full-disk", "damaged-file"])
async def test_a_timer_loop_whose_store_fails_stalls_and_resumes_by_itself(
    backend: Backend, error: StorageError
) -> None:
    for i in range(3):
        assert await backend.timers.put(timer(f"ok-{i}", now_ms(), partitions=PARTS))
    store = FailingTimers(backend.firing)
    store.fail = error
    gw = Recorder()
    held = await hold_slot(backend, PARTS)
    gauge = metrics.TIMERS_STALLED.labels(slot=str(held.slot))
    loop = timer_loop(store, gw)  # type: ignore[arg-type]

    async def all_fired() -> bool:
        return len(gw.sent) == 3 and not await backend.timer_queries.scan(limit=10)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await eventually(lambda: is_stalled(loop), 5, "the loop stalled")  # at once: retrying will not fix it soon
            assert loop.stall is not None and loop.stall.reason is not None and str(error) in loop.stall.reason
            assert gauge._value.get() == 1
            assert gw.sent == []
            store.fail = None  # space returns, the file is restored
            await eventually(all_fired, 10, "every due timer fired")
            assert not loop.stall.stalled and gauge._value.get() == 0
            held.request_stop()
    assert sorted(t.target.id for t in gw.sent) == ["ok-0", "ok-1", "ok-2"]  # each once


async def test_a_settle_the_full_disk_refuses_is_retried_and_bounded_on_stop(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(firing, "SETTLE_TIMEOUT_S", 0.5)
    store, gw, held, loop = await refused_settles(backend)

    async with running(loop, held):
        await eventually(lambda: store.settles >= 2, 5, "the settle retried")
        assert [t.target.id for t in gw.sent] == ["ok-1"]
        assert loop.stall is not None and loop.stall.stalled  # the settle's failure stalls the loop
        held.request_stop()
        stopped = time.monotonic()
    # the settle that never succeeded ends within its bound: the claim stays, and expires
    assert time.monotonic() - stopped < 0.5 + 1.0
    [claimed] = await backend.timer_queries.scan(limit=10)
    assert claimed.status is TimerStatus.FIRING and claimed.claim is not None


async def test_a_settle_is_written_once_space_returns(backend: Backend) -> None:
    store, gw, held, loop = await refused_settles(backend)

    async def settled() -> bool:
        return not await backend.timer_queries.scan(limit=10)

    async with running(loop, held):
        await eventually(lambda: store.settles >= 2, 5, "the settle retried")
        store.settle_fail = None
        await eventually(settled, 5, "the fired timer settled")
        held.request_stop()
    assert [t.target.id for t in gw.sent] == ["ok-1"]  # delivered once


class Rounds:
    """A round strategy that takes nothing: its rounds raise ``fail`` while it is set, and follow
    each other at once while ``full``. It records the watermark each round saw, and reports its
    settles' failures in the loop's stall as a strategy does."""

    def __init__(self) -> None:
        self.fail: StorageError | None = None
        self.full = False
        self.watermarks: list[int | None] = []
        self.stall: Stall | None = None
        self.logx: Logx | None = None
        self._began = anyio.Event()

    @asynccontextmanager
    async def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AsyncIterator[None]:
        self.stall, self.logx = stall, logx
        yield

    async def round(self, held: HeldSlot, waker: Waker, parts: frozenset[int]) -> Round:
        self.watermarks.append(waker.watermark)
        self._began.set()
        self._began = anyio.Event()
        await anyio.lowlevel.checkpoint()
        if self.fail is not None:
            raise self.fail
        return Round(until=now_ms(), full=self.full)

    async def began(self, n: int) -> None:
        """Waits until round ``n`` (from 1) has begun: the loop is done with the ones before."""
        while len(self.watermarks) < n:
            await self._began.wait()

    def settle_failed(self, exc: StorageError) -> None:
        assert self.stall is not None and self.logx is not None
        self.stall.failed(firing.SETTLE, exc, self.logx)

    def settled(self) -> None:
        assert self.stall is not None and self.logx is not None
        self.stall.progressed(self.logx, firing.SETTLE)


def rounds_loop(backend: Backend, rounds: Rounds, nudge: Any = lambda: None) -> TimerLoop:
    return TimerLoop(TimerSettings(), backend.firing, rounds, nudge)


def is_stalled(loop: TimerLoop) -> bool:
    """The loop has run far enough to have a stall, and it is stalled."""
    return loop.stall is not None and loop.stall.stalled


def failing_loop(backend: Backend, fail: StorageError) -> tuple[FailingTimers, Rounds, TimerLoop]:
    """A timer loop over ``backend``'s firing store failing with ``fail`` (until its ``fail`` is
    set to ``None``), its rounds recorded."""
    store = FailingTimers(backend.firing)
    store.fail = fail
    rounds = Rounds()
    return store, rounds, TimerLoop(TimerSettings(), store, rounds, lambda: None)  # type: ignore[arg-type]


@asynccontextmanager
async def running(loop: TimerLoop, held: HeldSlot) -> AsyncIterator[None]:
    """``loop`` running on ``held`` with a caught-up waker while the block lasts, all within 10 s:
    the block ends with a stop of ``held``."""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            yield


def stall_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "wowd.daemon.timers" and r.levelno == logging.ERROR]


async def test_a_round_the_store_fails_stalls_the_loop_which_retries_after_its_backoff_and_recovers(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(timers, "ROUND_BACKOFF", Backoff(0.05, 0.05))
    caplog.set_level(logging.DEBUG, logger="wowd.daemon.timers")
    held = await hold_slot(backend, PARTS)
    gauge = metrics.TIMERS_STALLED.labels(slot=str(held.slot))
    rounds = Rounds()
    rounds.fail = FULL
    loop = rounds_loop(backend, rounds)

    async with running(loop, held):
        await rounds.began(1)
        first = anyio.current_time()
        await rounds.began(3)  # after two failed rounds, each followed by a pause
        paused = anyio.current_time() - first
        assert loop.stall is not None and loop.stall.stalled and gauge._value.get() == 1
        assert loop.stall.reason == f"{ROUND}: StorageFull: {FULL}"
        rounds.fail = None  # space returns
        rounds.full = True
        await rounds.began(5)  # the fourth succeeded
        assert not loop.stall.stalled and gauge._value.get() == 0
        held.request_stop()
    assert paused >= 0.09  # 0.05 s after each failure
    [line] = stall_lines(caplog)  # one ERROR line, naming the slot; the others are DEBUG
    assert line.getMessage().startswith(f"timer loop of slot {held.slot} stalled (retrying): {ROUND}")
    assert line.slot == held.slot  # type: ignore[attr-defined]


async def test_a_stop_ends_the_pause_after_a_failed_round(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timers, "ROUND_BACKOFF", Backoff(60.0, 60.0))
    held = await hold_slot(backend, PARTS)
    rounds = Rounds()
    rounds.fail = DAMAGED
    loop = rounds_loop(backend, rounds)

    async with running(loop, held):
        await rounds.began(1)
        await anyio.wait_all_tasks_blocked()  # the round failed: the loop pauses for a minute
        assert loop.stall is not None and loop.stall.stalled
        held.request_stop()
        stopped = anyio.current_time()
    assert anyio.current_time() - stopped < 5
    assert len(rounds.watermarks) == 1  # not retried during the pause


async def test_a_round_that_succeeds_leaves_the_loop_stalled_while_its_settles_fail(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """A round's success says nothing of a settle the store refuses: the loop stays stalled (with
    the settle's reason, its line naming the slot) until a settle succeeds."""
    caplog.set_level(logging.ERROR, logger="wowd.daemon.timers")
    held = await hold_slot(backend, PARTS)
    rounds = Rounds()
    rounds.full = True
    loop = rounds_loop(backend, rounds)

    async with running(loop, held):
        await rounds.began(1)
        rounds.settle_failed(FULL)
        await rounds.began(len(rounds.watermarks) + 2)  # a round that began after it succeeded
        assert loop.stall is not None and loop.stall.reason == f"{firing.SETTLE}: StorageFull: {FULL}"
        rounds.settled()
        assert not loop.stall.stalled
        held.request_stop()
    [line] = stall_lines(caplog)
    assert line.slot == held.slot  # type: ignore[attr-defined]


async def test_the_claims_an_earlier_holding_left_are_due_again_before_the_first_round(backend: Backend) -> None:
    """A previous holder's claims (a lower fence) and this holder's own from before its lease
    lapsed (this fence) are due again; a claim under a higher fence is a later holder's: kept."""
    held = await hold_slot(backend, PARTS)
    assert held.fence >= 1
    fences = {"previous": held.fence - 1, "own": held.fence, "later": held.fence + 1}
    for name, fence in fences.items():
        assert await backend.timers.put(timer(name, now_ms(), partitions=PARTS))
        [claimed] = await backend.firing.claim_due(
            held.partitions, now_ms(), 1, owner_key=name, fence=fence, claim_until=now_ms() + 600_000
        )
        assert claimed.status is TimerStatus.FIRING
    rounds = Rounds()
    loop = rounds_loop(backend, rounds)

    async with running(loop, held):
        await rounds.began(1)
        after = {t.target.id: t for t in await backend.timer_queries.scan(limit=10)}
        held.request_stop()
    assert {name: t.status for name, t in after.items()} == {
        "previous": TimerStatus.PENDING,
        "own": TimerStatus.PENDING,
        "later": TimerStatus.FIRING,
    }
    assert after["previous"].claim is None and after["own"].claim is None


async def test_a_reclaim_the_store_fails_stalls_the_loop_and_no_round_runs_before_it_succeeds(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timers, "ROUND_BACKOFF", Backoff(0.05, 0.05))
    held = await hold_slot(backend, PARTS)
    store, rounds, loop = failing_loop(backend, FULL)
    rounds.full = True

    async with running(loop, held):
        await eventually(lambda: is_stalled(loop), 5, "the loop stalled")
        assert loop.stall is not None and loop.stall.reason == f"{ROUND}: StorageFull: {FULL}"
        assert rounds.watermarks == []
        store.fail = None  # space returns
        await rounds.began(2)
        assert not loop.stall.stalled
        held.request_stop()


async def test_a_stop_ends_the_retries_of_a_reclaim_the_store_fails(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timers, "ROUND_BACKOFF", Backoff(60.0, 60.0))
    held = await hold_slot(backend, PARTS)
    _store, rounds, loop = failing_loop(backend, DAMAGED)

    async with running(loop, held):
        await eventually(lambda: is_stalled(loop), 5, "the loop stalled")  # the reclaim failed: retried in a minute
        held.request_stop()
        stopped = anyio.current_time()
    assert anyio.current_time() - stopped < 5
    assert rounds.watermarks == []


async def test_no_round_runs_before_the_feed_has_applied_the_log_it_read(backend: Backend) -> None:
    """The feed read the log up to its head and has not applied that batch yet: the loop asks it
    on and waits; its first round comes once the batch is applied."""
    held = await hold_slot(backend, PARTS)
    waker = Waker()
    waker.reading(FAR_FUTURE_MS, ())
    asked = anyio.Event()
    rounds = Rounds()
    loop = rounds_loop(backend, rounds, nudge=asked.set)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await asked.wait()
            await anyio.wait_all_tasks_blocked()
            assert rounds.watermarks == []
            waker.applied(waker.applied_batches + 1, FAR_FUTURE_MS)
            await rounds.began(1)
            held.request_stop()
    assert rounds.watermarks[0] == FAR_FUTURE_MS


async def test_a_sweep_or_next_due_read_the_store_fails_is_logged_and_the_loop_goes_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither stalls the loop (nothing waits for a sweep; without the next due time it polls):
    each failure is a WARNING line, a DEBUG one while the loop is stalled anyway."""
    monkeypatch.setattr(timers, "SWEEP_EVERY_S", 0.0)
    monkeypatch.setattr(timer_plan, "MAX_IDLE_S", 0.02)
    caplog.set_level(logging.DEBUG, logger="wowd.daemon.timers")
    held = await hold_slot(backend, PARTS)
    store = FailingTimers(backend.firing)
    store.failing = ("next_due", "sweep")
    store.fail = DAMAGED
    rounds = Rounds()
    loop = TimerLoop(TimerSettings(), store, rounds, lambda: None)  # type: ignore[arg-type]

    def lines() -> list[tuple[str, int]]:
        return [
            (what, r.levelno)
            for r in caplog.records
            for what in ("sweep", "next due")
            if what in r.getMessage() and str(DAMAGED) in r.getMessage()
        ]

    async with running(loop, held):
        await rounds.began(3)  # after two rounds, each followed by a sweep and a read that failed
        assert loop.stall is not None and not loop.stall.stalled
        before = len(lines())
        rounds.settle_failed(FULL)
        await rounds.began(5)
        held.request_stop()
    logged = lines()
    assert logged[:4] == [("sweep", logging.WARNING), ("next due", logging.WARNING)] * 2
    assert before >= 4 and all(level == logging.WARNING for _what, level in logged[:before])
    assert logged[before:] and all(level == logging.DEBUG for _what, level in logged[before:])


class CountedSweeps(FailingTimers):
    """:class:`FailingTimers` recording the cut-off of each tombstone sweep (none failing)."""

    def __init__(self, inner: TimerFiring) -> None:
        super().__init__(inner)
        self.sweeps: list[int] = []

    async def sweep(self, before: int, limit: int) -> int:
        self.sweeps.append(before)
        return int(await self._inner.sweep(before, limit))


async def test_the_loop_sweeps_the_tombstones_past_the_retention_once_per_sweep_period_not_each_round(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first round is followed by a sweep of the tombstones older than the retention (now
    less the retention, a week by default); the rounds after it, within the sweep period (10 s),
    sweep nothing: the sweep costs the store a write, not each round's."""
    monkeypatch.setattr(timer_plan, "MAX_IDLE_S", 0.02)
    held = await hold_slot(backend, PARTS)
    store = CountedSweeps(backend.firing)
    rounds = Rounds()
    loop = TimerLoop(TimerSettings(), store, rounds, lambda: None)  # type: ignore[arg-type]

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            started = now_ms()
            await tg.start(loop.run, held, caught_up_waker())
            await rounds.began(5)  # four rounds done, each followed by the sweep's turn
            ended = now_ms()
            held.request_stop()
    [cut_off] = store.sweeps
    retention_ms = TimerSettings().tombstone_retention_s * 1000
    assert started - retention_ms <= cut_off <= ended - retention_ms
