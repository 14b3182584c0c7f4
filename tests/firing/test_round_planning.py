"""The timer loop's sleep decision (``plan_wait``, ``wants_next_due``) and the delivery stream's
lanes, window and settle groups, without a store or a clock."""

from __future__ import annotations

import anyio
import pytest

from tests.helpers import caught_up_waker, held_slot
from wowd.config import TimerSettings
from wowd.daemon.firing import OutboxRounds
from wowd.daemon.stream import SETTLE_GROUP, DeliveryStream, Lane, Limits, Settler
from wowd.daemon.timer_plan import ReadFirst, Round, Sleep, plan_wait, wants_next_due
from wowd.delivery import Delivered, Outcome
from wowd.model import AggregateRef, Command, Timer, TimerChange, deterministic_timer_id
from wowd.stores.base import OutboxFired, OutboxRound

LOOK = 1_000
IDLE_S = 0.5


def test_nothing_due_sleeps_an_idle_period() -> None:
    assert plan_wait(10_000, Round(until=11_000), (None, None), LOOK, IDLE_S) == Sleep(10_500, 11_500)


def test_a_timer_beyond_the_lookahead_wakes_the_loop_a_lookahead_before_it() -> None:
    # due at 10,300 + 1,000: woken at 10,300, claimed then, half a lookahead's rounds apart at least
    r = Round(until=10_000 + LOOK)
    assert plan_wait(10_000, r, (11_300, None), LOOK, 30) == Sleep(10_500, 11_500)
    assert plan_wait(10_000, r, (14_000, 12_500), LOOK, 30) == Sleep(11_500, 12_500)


def test_a_timer_within_the_lookahead_past_the_feeds_read_asks_for_a_read() -> None:
    # the round read up to 10,600 (the feed's read lagged); a timer at 10,800 is within the lookahead
    r = Round(until=10_600)
    assert plan_wait(10_200, r, (10_800, None), LOOK, IDLE_S) == ReadFirst(10_800, 9_800)
    # not before half the round's lookahead has passed
    assert isinstance(plan_wait(10_000, r, (10_800, None), LOOK, IDLE_S), Sleep)


def test_rounds_at_the_due_time_wake_at_the_next_due_time() -> None:
    r = Round(until=10_000, claims_ahead=False)
    assert plan_wait(10_000, r, (10_040, None), LOOK, IDLE_S) == Sleep(10_040, 10_040)
    assert plan_wait(10_000, r, (None, 20_000), LOOK, IDLE_S) == Sleep(10_500, 10_500)


def test_the_stores_next_due_time_is_read_unless_a_put_comes_due_within_an_idle_period() -> None:
    at_due = Round(until=10_000, claims_ahead=False)
    assert not wants_next_due(at_due, 10_400, IDLE_S)
    assert wants_next_due(at_due, 10_600, IDLE_S)
    assert wants_next_due(at_due, None, IDLE_S)
    assert wants_next_due(Round(until=10_000), 10_100, IDLE_S)


def timer(i: int, target: str) -> Timer:
    owner = AggregateRef(context="c", aggregate="order", id=f"o-{i}")
    return Timer(
        timer_id=deterministic_timer_id(owner, "k", 1), partition=0, owner=owner, key="k", version=1,
        due_at=0, scheduled_at=0, target=AggregateRef(context="c", aggregate=target, id=f"t-{i}"),
        body=Command(name="go").to_json(),
    )  # fmt: skip


class Gate:
    """Targets whose requests wait for their gate; counts requests in flight per target."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.gates: dict[str, anyio.Event] = {}
        self.in_flight: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.sent = anyio.Event()

    def limits(self, concurrency: int) -> Limits:
        """A lane per target aggregate of ``limit`` calls at once, ``concurrency`` in all."""
        return Limits(concurrency=concurrency, lane_of=lambda t: Lane(t.target.aggregate, self.limit))

    async def send(self, t: Timer) -> Outcome:
        name = t.target.aggregate
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        self.peak[name] = max(self.peak.get(name, 0), self.in_flight[name])
        self.sent.set()
        gate = self.gates.get(name)
        try:
            if gate is not None:
                await gate.wait()
        finally:
            self.in_flight[name] -= 1
        return Delivered()

    async def aclose(self) -> None:
        return None


@pytest.mark.anyio
async def test_a_hanging_target_holds_only_its_own_slots() -> None:
    gw = Gate(limit=4)
    gw.gates["hang"] = anyio.Event()
    done: list[Timer] = []

    def record(t: Timer, _outcome: Outcome) -> None:
        done.append(t)
        stream.settled(1)  # written at once: the window never fills

    stream = DeliveryStream(gw, gw.limits(8), record, stopped=lambda: False)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            stream.bind(tg)
            stream.put([timer(i, "hang") for i in range(10)])
            stream.put([timer(100 + i, "ok") for i in range(200)])
            while len(done) < 200:
                await anyio.wait_all_tasks_blocked()
            # every healthy one delivered while the hanging target holds its 4 slots, no more
            assert gw.in_flight["hang"] == 4 and gw.peak["hang"] == 4
            assert gw.peak["ok"] <= 4
            assert stream.queued == 6
            gw.gates["hang"].set()
    assert len(done) == 210


@pytest.mark.anyio
async def test_the_window_bounds_what_is_sent_and_not_settled() -> None:
    gw = Gate(limit=64)
    recorded: list[Timer] = []
    limits = gw.limits(16)
    window = limits.window
    assert window == 16 + SETTLE_GROUP
    stream = DeliveryStream(gw, limits, lambda t, _o: recorded.append(t), stopped=lambda: False)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            stream.bind(tg)
            stream.put([timer(i, "ok") for i in range(window + 100)])
            await anyio.wait_all_tasks_blocked()
            assert len(recorded) == window and stream.open == window  # nothing settled: the window is full
            stream.settled(15)
            await anyio.wait_all_tasks_blocked()
            assert len(recorded) == window + 15 and stream.open == window
            stream.settled(window + 100)
            await anyio.wait_all_tasks_blocked()
    assert len(recorded) == window + 100


def change(i: int) -> TimerChange:
    return TimerChange.fired(timer(i, "ok"), fence=1, next_due=None)


@pytest.mark.anyio
async def test_the_settler_writes_a_full_group_at_once_and_a_partial_one_after_its_linger() -> None:
    writes: list[int] = []
    written = anyio.Event()

    async def write(changes: list[TimerChange]) -> int:
        writes.append(len(changes))
        written.set()
        return len(changes)

    settler = Settler(write, lambda _c, _n: None, group=10, linger_s=30.0)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(settler.run)
            settler.add([change(i) for i in range(10)])
            await written.wait()
            assert writes == [10]  # a full group does not wait for the linger
            settler.add([change(i) for i in range(3)])
            await anyio.wait_all_tasks_blocked()
            assert writes == [10]  # a partial one waits (30 s here)
            tg.cancel_scope.cancel()
    await settler.drain(1.0)
    assert writes == [10, 3]


class SlowShortcut:
    """An outbox shortcut that takes a while: timers come due during its transaction."""

    def __init__(self) -> None:
        self.rounds: list[OutboxRound] = []

    async def fire_into_outbox(self, round: OutboxRound) -> OutboxFired:
        self.rounds.append(round)
        await anyio.sleep(0.05)  # the transaction's time, not a synchronisation
        return OutboxFired([])


@pytest.mark.anyio
async def test_an_outbox_round_reads_up_to_its_fire_time_not_past_it() -> None:
    """What a round read is what was due at its fire time: a timer that came due while the
    transaction ran is not taken as read (the waker keeps it, and the loop wakes for it)."""
    shortcut = SlowShortcut()
    strategy = OutboxRounds(TimerSettings(), shortcut)
    waker = caught_up_waker()
    r = await strategy.round(held_slot(8), waker, frozenset(range(8)))
    (request,) = shortcut.rounds
    assert r.until == request.at and not r.claims_ahead
