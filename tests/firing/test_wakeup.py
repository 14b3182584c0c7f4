"""When the timer loop wakes: the Waker's heap of the due times this process put, the store's
next due time, and the idle period as a safety net only.

The loop tests set the idle period to 30 s: a timer that fires within a few seconds was woken
for, not found by the idle poll."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import CONTEXT, Recorder, now_ms, ref, timer, timer_commit
from tests.firing.conftest import PARTS, opened_timers
from tests.helpers import caught_up_waker, held_slot, timer_loop
from tests.timer_stores import EmbeddedTimers
from wowd.config import EmbeddedSettings, LeaseSettings, TimerSettings, WowdSettings
from wowd.daemon import timer_plan, timers
from wowd.daemon.feed import Feeder
from wowd.daemon.timer_plan import wake_time
from wowd.daemon.waker import Waker, owner_key
from wowd.errors import StorageUnavailable
from wowd.model import (
    IntervalRule,
    Timer,
)
from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- the Waker


def test_a_round_covers_only_the_puts_made_before_its_read() -> None:
    w = Waker()
    t = now_ms()
    w.maybe_wake(t + 100)
    w.maybe_wake(t + 300)
    mark = w.mark()  # a due read up to t + 200 begins
    w.maybe_wake(t + 50)  # stored while it reads: perhaps after its snapshot
    w.covered(t + 200, mark)
    assert w.earliest() == t + 50 and len(w) == 2  # t + 100 dropped, t + 300 is later
    w.covered(t + 200, w.mark())  # the next round read it
    assert w.earliest() == t + 300 and len(w) == 1
    w.covered(t + 300, w.mark())
    assert w.earliest() is None


def test_the_waker_leaves_far_and_overflowing_puts_to_the_store_read() -> None:
    t = now_ms()
    far = Waker(horizon_ms=1_000)
    far.maybe_wake(t + 60_000)
    assert far.earliest() is None  # the loop's reads meanwhile find it (next_due)
    small = Waker(max_size=2)
    for d in (t + 300, t + 100, t + 200):
        small.maybe_wake(d)
    assert len(small) == 2 and small.earliest() == t + 100


async def test_a_slots_watermark_is_the_lowest_of_its_partitions() -> None:
    """A read that reached the head of some partitions only (a catch-up stream while the others
    are still re-read) moves theirs: the slot has a watermark once every partition has one, the
    lowest; a read of every partition moves them all."""
    w = Waker(partitions={0, 1, 2})
    w.reading(1_000, (), frozenset({0, 1}))
    w.advance(1_000, frozenset({0, 1}))
    assert (w.read_mark, w.watermark) == (None, None)
    w.reading(1_100, (), frozenset({2}))
    w.applied(w.applied_batches + 1, 1_100, frozenset({2}))
    assert (w.read_mark, w.watermark) == (1_000, 1_000)  # partitions 0 and 1's, not the last read's
    w.advance(2_000)
    assert w.watermark == 2_000
    blind = Waker()  # the slot's partitions unknown: a read of some of them moves nothing
    blind.reading(1_000, (), frozenset({0}))
    blind.advance(1_000, frozenset({0}))
    assert (blind.read_mark, blind.watermark) == (None, None)


async def test_the_feeds_reads_and_applies_release_their_waiters_once_past_the_mark() -> None:
    """``read_past(at)``: every commit appended before ``at`` read (a read mark at ``at`` is
    enough, one below it is not); ``wait_applied(after)``: a batch numbered above ``after``
    applied."""
    w = Waker()
    w.reading(1_000, ())
    with anyio.fail_after(1):
        assert await w.read_past(1_000, 5)  # at once
    assert not await w.read_past(1_001, 0)
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            passed = anyio.Event()

            async def read_to_1_500() -> None:
                assert await w.read_past(1_500, 5)
                passed.set()

            tg.start_soon(read_to_1_500)
            await anyio.wait_all_tasks_blocked()
            w.reading(1_499, ())
            await anyio.wait_all_tasks_blocked()
            assert not passed.is_set()
            w.reading(1_500, ())
            await passed.wait()
    batch = w.reading(None, ())
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            applied = anyio.Event()

            async def after_batch() -> None:
                await w.wait_applied(batch, 5)
                applied.set()

            tg.start_soon(after_batch)
            await anyio.wait_all_tasks_blocked()
            w.applied(batch, None)  # the batch itself: not above it
            await anyio.wait_all_tasks_blocked()
            assert not applied.is_set()
            w.applied(w.reading(None, ()), None)
            await applied.wait()


async def test_a_put_due_before_the_wake_up_wakes_the_waiting_loop() -> None:
    w = Waker()
    woke = anyio.Event()

    async def wait() -> None:
        await w.wait(30, now_ms() + 1_000)
        woke.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            w.maybe_wake(now_ms() + 5_000)  # due after the planned wake-up: sleeps on
            await anyio.wait_all_tasks_blocked()
            assert not woke.is_set()
            w.maybe_wake(now_ms() + 500)
            await woke.wait()
    assert w.earliest() is not None  # kept for the next round


async def test_a_put_while_the_loop_is_busy_does_not_cut_its_next_sleep_short() -> None:
    """Between waits the loop reads the heap itself: a put then costs no extra round."""
    w = Waker()
    w.maybe_wake(now_ms() - 10)  # not waiting: remembered, no wake-up pending
    started = anyio.current_time()
    with anyio.fail_after(5):
        await w.wait(0.05, float("inf"))
    assert anyio.current_time() - started >= 0.04


async def test_wake_ends_a_wait_at_once() -> None:
    w = Waker()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.wait, 30, 0.0)
            await anyio.wait_all_tasks_blocked()
            w.wake()


async def test_wake_ends_the_waits_for_the_feeds_next_read_and_next_batch_at_once() -> None:
    """A stop wakes the loop wherever it waits for the feed: for its next read (a held timer)
    and for its next batch applied (a due timer the log check left)."""
    w = Waker()
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.next_read, 30)
            tg.start_soon(w.wait_applied, w.applied_batches, 30)
            await anyio.wait_all_tasks_blocked()
            w.wake()


def test_a_batch_read_after_a_mark_is_taken_names_its_owners_changed_the_feeds_first_one_too() -> None:
    """A timer claimed under a mark taken before the feed read anything is changed by the
    commits of the first batch it reads, as by any later one."""
    w = Waker()
    mark = w.hold()
    order = owner_key(ref("o-1"))
    batch = w.reading(None, [order])
    assert w.changed_since(mark, order)
    w.applied(batch, None)
    assert w.changed_since(mark, order)  # kept while the mark is held
    w.release(mark)
    assert not w.changed_since(w.hold(), order)


async def test_a_partitions_mark_never_moves_back() -> None:
    """A read of some partitions stamped before one already taken for them leaves their marks:
    the slot's read mark and watermark are the lowest of the partitions' latest."""
    w = Waker(partitions={0, 1})
    w.reading(2_000, (), frozenset({0}))
    w.reading(1_000, (), frozenset({1}))
    w.reading(1_500, (), frozenset({0}))  # older than partition 0's mark
    w.reading(3_000, (), frozenset({1}))
    assert w.read_mark == 2_000
    w.advance(2_000, frozenset({0}))
    w.advance(1_500, frozenset({0}))
    w.advance(3_000, frozenset({1}))
    assert w.watermark == 2_000


def test_a_waker_is_dated_when_made() -> None:
    """The slot's feed counts its watermark lag from when its waker was made (the slot taken)
    until it first reaches the log's head."""
    before = now_ms()
    w = Waker()
    assert before <= w.created_ms <= now_ms()


def test_wake_time_is_the_next_due_less_the_lookahead_within_the_idle_period() -> None:
    assert wake_time(1_000, (None, None), 200, 0.25) == 1_250
    assert wake_time(1_000, (5_000, None), 200, 0.25) == 1_250
    assert wake_time(1_000, (1_300, 2_000), 200, 0.25) == 1_100
    assert wake_time(1_000, (None, 1_150), 200, 0.25) == 950  # already within the lookahead: now
    assert wake_time(1_000, (), 0, 30) == 31_000
    assert wake_time(1_000, (None,), 0) == 1_000 + int(timer_plan.MAX_IDLE_S * 1000)  # the loop's idle period


# --------------------------------------------------------------------------- the loop


class NoNextDue(EmbeddedTimerFiring):
    """A store whose ``next_due`` knows nothing (or fails): only the Waker tells the loop."""

    fail = False
    calls = 0

    async def next_due(self, partitions: Any, after: int) -> int | None:
        self.calls += 1
        if self.fail:
            raise StorageUnavailable("sqlite timers.next_due: busy (injected)")
        return None


@pytest.fixture
def long_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle period the loop waits (``timers``) and plans its wake-ups with (``timer_plan``)."""
    monkeypatch.setattr(timers, "MAX_IDLE_S", 30.0)
    monkeypatch.setattr(timer_plan, "MAX_IDLE_S", 30.0)


@pytest.fixture
async def blind(tmp_path: Path) -> AsyncIterator[EmbeddedTimers]:
    async with opened_timers(tmp_path, NoNextDue) as s:
        yield s


async def run_loop(store: EmbeddedTimers, waker: Waker, body: Any) -> Recorder:
    gw = Recorder()
    held = held_slot(PARTS)
    loop = timer_loop(store.firing, gw, TimerSettings(lookahead_ms=100))
    with anyio.fail_after(8):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await body(gw)
            held.request_stop()
    return gw


@pytest.mark.usefixtures("long_idle")
async def test_the_loop_sleeps_until_the_stores_next_due_time(store: EmbeddedTimers) -> None:
    """Stored before the loop runs (no Waker involved): found by the first round's ``next_due``."""
    due = [now_ms() + 300, now_ms() + 500]
    for i, d in enumerate(due):
        assert await store.view.put(timer(f"s-{i}", d, partitions=PARTS))

    async def body(gw: Recorder) -> None:
        await gw.until_fired(2)

    gw = await run_loop(store, caught_up_waker(), body)
    assert [t.scheduled_at for t, _at in gw.fired] == due
    assert all(at >= t.scheduled_at for t, at in gw.fired)  # never before its time


@pytest.mark.usefixtures("long_idle")
async def test_the_loop_remembers_later_puts_after_a_round_covers_an_earlier_one(blind: EmbeddedTimers) -> None:
    """With a single mark, the round that covered the
    first put forgot the second and slept the idle period."""
    waker = caught_up_waker()

    async def body(gw: Recorder) -> None:
        await anyio.wait_all_tasks_blocked()  # the loop read nothing and sleeps (30 s)
        base = now_ms()
        for i, d in enumerate((base + 200, base + 400, base + 600)):  # each a round of its own
            assert await blind.view.put(timer(f"w-{i}", d, partitions=PARTS))
            waker.maybe_wake(d)  # as the feed does after a put
        await gw.until_fired(3)

    gw = await run_loop(blind, waker, body)
    assert len({t.timer_id for t, _at in gw.fired}) == 3
    assert waker.earliest() is None  # every put covered


@pytest.mark.usefixtures("long_idle")
async def test_a_recurring_timers_next_occurrence_wakes_the_loop(blind: EmbeddedTimers) -> None:
    assert await blind.view.put(timer("r-1", now_ms(), partitions=PARTS, rule=IntervalRule(every_ms=200)))

    async def body(gw: Recorder) -> None:
        await gw.until_fired(3)

    gw = await run_loop(blind, caught_up_waker(), body)  # three fires, not one round per idle period (30 s)
    due = [t.scheduled_at for t, _at in gw.fired[:3]]
    # each fire a later occurrence of the rule (one the loop reached late, on a loaded machine, is
    # coalesced into the next: next_occurrence)
    assert all(b > a and (b - a) % 200 == 0 for a, b in zip(due, due[1:], strict=False))


async def test_the_loop_polls_when_the_next_due_time_cannot_be_read(blind: EmbeddedTimers) -> None:
    """A failing ``next_due`` only leaves the loop to the idle poll (the default period)."""
    blind.firing.fail = True

    async def body(gw: Recorder) -> None:
        await anyio.wait_all_tasks_blocked()
        assert await blind.view.put(timer("p-1", now_ms(), partitions=PARTS))  # no Waker: another process's put
        await gw.until_fired(1)

    await run_loop(blind, caught_up_waker(), body)
    assert blind.firing.calls >= 1


@pytest.mark.usefixtures("long_idle")
async def test_the_feeds_puts_fire_at_their_time_without_an_idle_poll(tmp_path: Path) -> None:
    """End to end in one process: commits appended while the loop sleeps are fed, put, and fired
    at their due times, each after the round that fired the one before."""
    from wowd.stores.embedded import open_embedded

    settings = WowdSettings(
        context=CONTEXT,
        partitions=PARTS,
        embedded=EmbeddedSettings(path=tmp_path / "wowd.db"),
        lease=LeaseSettings(limit=1),
    )
    backend = await open_embedded(settings)
    try:
        waker = Waker()
        held = held_slot(PARTS)
        gw = Recorder()
        loop = timer_loop(backend.firing, gw, TimerSettings(lookahead_ms=100), nudge=backend.log.nudge)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, waker)
                await tg.start(Feeder(settings, backend).run, held, waker)
                base = now_ms() + 300
                due = [base, base + 250, base + 500]
                await backend.log.append_many([timer_commit(f"f-{i}", 1, ["k"], due_at=d) for i, d in enumerate(due)])
                await gw.until_fired(3)
                held.request_stop()
        assert sorted(t.scheduled_at for t, _at in gw.fired) == due
        assert all(at >= t.scheduled_at for t, at in gw.fired)
    finally:
        await backend.close()


class CountingClaims(EmbeddedTimerFiring):
    """Records when each due read (``claim_due``) began."""

    claims: list[int]

    async def claim_due(self, *args: Any, **kwargs: Any) -> list[Timer]:
        self.claims.append(now_ms())
        return await super().claim_due(*args, **kwargs)


@pytest.mark.usefixtures("long_idle")
async def test_a_timer_is_claimed_ahead_and_delivered_after_a_read_of_the_log_that_began_at_its_due_time(
    tmp_path: Path,
) -> None:
    """The watermark adds no poll: the loop claims the timer within the lookahead, and at its due
    time asks the log to look at its head at once (no due read then) and delivers it as soon as
    the feed has read that far. Here the feed is an idle log: each nudge is one empty read."""
    reads: list[int] = []
    async with opened_timers(tmp_path, CountingClaims) as store:
        store.firing.claims = []
        due = now_ms() + 300
        gw = await fire_over_an_idle_log(store, [timer("n-1", due, partitions=PARTS)], lookahead_ms=100, reads=reads)
    t, at = gw.fired[0]
    assert t.scheduled_at == due <= at
    assert [r for r in reads if r >= due]  # a read that began at or after the due time ...
    assert min(r for r in reads if r >= due) <= at  # ... came before the delivery
    assert not [c for c in store.firing.claims if c >= due]  # claimed ahead: no due read at the due time


async def fire_over_an_idle_log(
    store: EmbeddedTimers, timers: Sequence[Timer], *, lookahead_ms: int, reads: list[int] | None = None
) -> Recorder:
    """Puts ``timers`` and runs a timer loop over ``store`` until it has delivered them all; the
    feed is an idle log: each nudge is one empty read of its head, applied at once (its start
    added to ``reads``)."""
    waker = Waker()

    def nudge() -> None:
        began = now_ms()
        if reads is not None:
            reads.append(began)
        waker.advance(began)

    waker.advance(now_ms())
    for t in timers:
        assert await store.view.put(t)
    gw = Recorder()
    loop = timer_loop(store.firing, gw, TimerSettings(lookahead_ms=lookahead_ms), nudge=nudge)
    held = held_slot(PARTS)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await gw.until_fired(len(timers))
            held.request_stop()
    return gw


class AheadClaims(EmbeddedTimerFiring):
    """Records how long before its first timer's due time each claim that took timers began."""

    ahead: list[int]

    async def claim_due(self, *args: Any, **kwargs: Any) -> list[Timer]:
        began = now_ms()
        claimed = await super().claim_due(*args, **kwargs)
        if claimed:
            self.ahead.append(min(t.scheduled_at for t in claimed) - began)
        return claimed


@pytest.mark.usefixtures("long_idle")
async def test_a_steady_stream_is_claimed_half_a_lookahead_before_each_round_is_due(tmp_path: Path) -> None:
    """One timer every 10 ms, a lookahead of 400 ms: each round takes half a lookahead of timers
    and is claimed about half a lookahead before its first one is due, not when that one comes due
    (the claim, and the settle of the round before that it may wait for, would then delay it)."""
    async with opened_timers(tmp_path, AheadClaims) as store:
        store.firing.ahead = []
        # the first one due past the first round's lookahead: that round is planned too, whether
        # the loop starts at once or, on a busy machine, some hundreds of milliseconds later
        first = now_ms() + 600
        stream = [timer(f"s-{i}", first + 10 * i, partitions=PARTS) for i in range(120)]
        gw = await fire_over_an_idle_log(store, stream, lookahead_ms=400)
    assert all(at >= t.scheduled_at for t, at in gw.fired)
    assert len(store.firing.ahead) >= 5
    assert min(store.firing.ahead) >= 100, store.firing.ahead  # about 200 ms each, with room for a slow machine


@pytest.mark.usefixtures("long_idle")
async def test_a_timer_due_past_the_feeds_last_read_waits_for_the_feeds_next_read_not_another_round(
    tmp_path: Path,
) -> None:
    """A timer within the lookahead but past what the feed last read of the log: the loop asks
    the feed to read the log's head and reads nothing more until it has; that read brings the
    round that claims the timer, delivered at its due time."""
    async with opened_timers(tmp_path, CountingClaims) as store:
        store.firing.claims = []
        waker = Waker()
        asked = anyio.Event()
        claims_when_asked: list[int] = []
        feeding = False

        def nudge() -> None:
            if not asked.is_set():
                claims_when_asked.append(len(store.firing.claims))
                asked.set()
            if feeding:
                waker.advance(now_ms())

        waker.advance(now_ms())  # the feed's last read, not repeated until asked
        due = now_ms() + 300
        assert await store.view.put(timer("late-read", due, partitions=PARTS))
        gw = Recorder()
        loop = timer_loop(store.firing, gw, TimerSettings(lookahead_ms=100), nudge=nudge)
        held = held_slot(PARTS)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, waker)
                await asked.wait()
                await anyio.wait_all_tasks_blocked()
                assert len(store.firing.claims) == claims_when_asked[0]  # waiting for the feed
                waker.maybe_wake(due + 1_000)  # a put due after it: no reason to read now
                await anyio.wait_all_tasks_blocked()
                assert len(store.firing.claims) == claims_when_asked[0]
                feeding = True
                waker.advance(now_ms())
                await gw.until_fired(1)
                held.request_stop()
    [(t, at)] = gw.fired
    assert t.target.id == "late-read" and at >= due
