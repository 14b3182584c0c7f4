"""The timer loop's sleep decision (``plan_wait``, ``wants_next_due``) and what an outbox round
takes as read, without a store or a clock."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client import REGISTRY

from tests.factories import Recorder, now_ms, timer
from tests.helpers import caught_up_waker, held_slot
from wowd.config import TimerSettings
from wowd.daemon import firing
from wowd.daemon.firing import ClaimDeliverSettle, OutboxRounds
from wowd.daemon.leases import HeldSlot
from wowd.daemon.stall import Stall
from wowd.daemon.stream import target_limits
from wowd.daemon.timer_plan import ReadFirst, Round, Sleep, plan_wait, retry_delay_s, wants_next_due
from wowd.daemon.waker import Waker
from wowd.delivery.outcomes import CIRCUIT_OPEN, Delivered, Outcome, Park, Retry, target_of
from wowd.model import Timer, TimerChange
from wowd.stores.base import FiredTimer, OutboxFired, OutboxRound, OwnerProbe

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
    assert not wants_next_due(at_due, 11_500, 2.0)  # within the idle period the loop was given


class ScriptedShortcut:
    """An outbox shortcut answering ``answer`` to each round after ``takes_s`` (its transaction's
    time: timers come due meanwhile), recording what it was asked."""

    def __init__(self, answer: OutboxFired | None = None, *, takes_s: float = 0.0) -> None:
        self.answer = answer if answer is not None else OutboxFired([])
        self.takes_s = takes_s
        self.rounds: list[OutboxRound] = []

    async def fire_into_outbox(self, round: OutboxRound) -> OutboxFired:
        self.rounds.append(round)
        if self.takes_s:
            await anyio.sleep(self.takes_s)  # the transaction's time, not a synchronisation
        return self.answer


@pytest.mark.anyio
async def test_an_outbox_round_reads_up_to_its_fire_time_not_past_it() -> None:
    """What a round read is what was due at its fire time: a timer that came due while the
    transaction ran is not taken as read (the waker keeps it, and the loop wakes for it)."""
    shortcut = ScriptedShortcut(takes_s=0.05)
    strategy = OutboxRounds(TimerSettings(), shortcut)
    waker = caught_up_waker()
    r = await strategy.round(held_slot(8), waker, frozenset(range(8)))
    (request,) = shortcut.rounds
    assert r.until == request.at and not r.claims_ahead


def test_a_retry_waits_its_jittered_backoff_and_at_least_the_targets_hint() -> None:
    settings = TimerSettings(backoff_base_s=0.1, backoff_max_s=10.0)
    delays = [retry_delay_s(3, settings) for _ in range(200)]
    assert all(0.4 <= d <= 0.8 for d in delays)  # 0.1 s * 2**3, scaled by [0.5, 1]
    assert len(set(delays)) > 100  # jittered: the replicas retrying one target spread out
    assert all(retry_delay_s(30, settings) <= 10.0 for _ in range(20))  # capped
    assert retry_delay_s(3, settings, hint_s=5.0) == 5.0  # a Retry-After longer than the backoff


def _fired(n: int, **kw: Any) -> list[FiredTimer]:
    return [FiredTimer(f"t-{i}", "demo.order", 1_000 + i, None, **kw) for i in range(n)]


def _misfired_count(target: str) -> float:
    return REGISTRY.get_sample_value("wowd_timers_misfired_total", {"target": target}) or 0.0


def _fired_count(target: str) -> float:
    return REGISTRY.get_sample_value("wowd_timers_fired_total", {"target": target}) or 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("history", [True, False])
async def test_an_outbox_round_is_bounded_by_the_slots_lease_and_keeps_the_history_as_tombstones(
    history: bool,
) -> None:
    """The round's transaction commits only within the lease the slot holds (its deadline), and
    records the attempts for as long as tombstones are kept, or not at all without a history."""
    shortcut = ScriptedShortcut(OutboxFired([]))
    held = held_slot(8, valid_for=30)
    await OutboxRounds(TimerSettings(tombstone_retention_s=600), shortcut, history=history).round(
        held, caught_up_waker(), frozenset(range(8))
    )
    (request,) = shortcut.rounds
    assert request.deadline is not None and abs(request.deadline - held.deadline()) < 0.5
    assert request.history_retention_ms == (600_000 if history else None)
    assert request.limit == TimerSettings().batch and request.fence == held.fence


@pytest.mark.anyio
async def test_a_full_outbox_round_asks_for_the_next_at_once_and_a_partial_one_read_all_due() -> None:
    settings = TimerSettings(batch=3)
    waker = caught_up_waker()
    full = await OutboxRounds(settings, ScriptedShortcut(OutboxFired(_fired(3)))).round(
        held_slot(8), waker, frozenset(range(8))
    )
    assert full.full and full.taken == 3 and full.until > 0
    partial = await OutboxRounds(settings, ScriptedShortcut(OutboxFired(_fired(2), left=4))).round(
        held_slot(8), waker, frozenset(range(8))
    )
    assert (partial.full, partial.taken, partial.claims_ahead, partial.skipped) == (False, 2, False, 4)


@pytest.mark.anyio
async def test_an_outbox_round_counts_its_misfired_occurrences_by_target_and_not_as_fired() -> None:
    """A misfired occurrence is counted under its target: read whole (its skip logged naming it),
    or by the target the shortcut names; never as fired."""
    late = timer("o-late", 1_000)
    answer = OutboxFired(
        [
            FiredTimer("t-gone", "demo.invoice", 1_000, None, True),
            FiredTimer(late.timer_id, target_of(late), 1_000, None, True, late),
            *_fired(2),
        ]
    )
    before = (_misfired_count("demo.invoice"), _misfired_count(target_of(late)), _fired_count("demo.invoice"))
    await OutboxRounds(TimerSettings(), ScriptedShortcut(answer)).round(
        held_slot(8), caught_up_waker(), frozenset(range(8))
    )
    assert _misfired_count("demo.invoice") == before[0] + 1
    assert _misfired_count(target_of(late)) == before[1] + 1
    assert _fired_count("demo.invoice") == before[2]


class ScriptedClaims:
    """A timer store answering each claim with the next of ``answers`` (then none), recording
    what each claim asked (``exclude`` as it was then); every settle is written."""

    def __init__(self, *answers: list[Timer]) -> None:
        self.answers = list(answers)
        self.asked: list[dict[str, Any]] = []
        self.settled: list[TimerChange] = []
        self.changed = anyio.Event()

    async def claim_due(self, partitions: frozenset[int], until: int, limit: int, **kw: Any) -> list[Timer]:
        self.asked.append({**kw, "until": until, "limit": limit, "exclude": set(kw.get("exclude", ()))})
        return self.answers.pop(0) if self.answers else []

    async def settle(self, changes: list[TimerChange]) -> int:
        self.settled += changes
        self.changed.set()
        self.changed = anyio.Event()
        return len(changes)

    async def settled_at_least(self, n: int) -> None:
        """Returns once ``n`` changes were settled."""
        while len(self.settled) < n:
            await self.changed.wait()


async def _no_commit(_probes: list[OwnerProbe]) -> set[int]:
    return set()


@asynccontextmanager
async def first_round(
    store: ScriptedClaims, gw: Recorder
) -> AsyncIterator[tuple[ClaimDeliverSettle, HeldSlot, Waker, frozenset[int]]]:
    """A claiming strategy over ``store`` and ``gw``, running on a slot of eight partitions with a
    caught-up waker (within 5 s), its first round done."""
    strategy = _claiming(store, gw)
    held, waker, parts = held_slot(8), caught_up_waker(), frozenset(range(8))
    with anyio.fail_after(5):
        async with running(strategy, held, waker):
            await strategy.round(held, waker, parts)
            yield strategy, held, waker, parts


def running(strategy: ClaimDeliverSettle | OutboxRounds, held: HeldSlot, waker: Waker) -> Any:
    """``strategy.running`` on ``held`` and ``waker``, as the timer loop enters it."""
    return strategy.running(held, waker, Stall("timer loop"), logging.LoggerAdapter(logging.getLogger("t")))


def _claiming(
    store: ScriptedClaims, gw: Recorder | None = None, *, batch: int = 100, claim_ttl_s: float = 30, **kw: Any
) -> ClaimDeliverSettle:
    settings = TimerSettings(lookahead_ms=100, claim_ttl_s=claim_ttl_s, batch=batch)
    limits = target_limits(64, lambda _target: 16)
    return ClaimDeliverSettle(settings, store, gw or Recorder(), limits, lambda: None, **kw)


@pytest.mark.anyio
async def test_a_claim_reaches_the_lookahead_past_the_feeds_read_or_with_the_log_check_past_now() -> None:
    """Without the log check a round claims up to the lookahead past the feed's read of the log
    (10 s behind here); with it, and the feed reading the log's head lately, up to the lookahead
    past now. Either claim holds for the claim's time to live."""
    store = ScriptedClaims()
    waker = Waker()
    read_mark = now_ms() - 10_000
    waker.reading(read_mark, [])  # the feed read the log's head just now, up to 10 s ago
    before = now_ms()
    ungated = await _claiming(store).round(held_slot(8), waker, frozenset(range(8)))
    gated = await _claiming(store, gate=_no_commit).round(held_slot(8), waker, frozenset(range(8)))
    after = now_ms()
    assert (ungated.until, ungated.read_bound) == (read_mark + 100, True)
    assert before + 100 <= gated.until <= after + 100 and not gated.read_bound
    assert [a["until"] for a in store.asked] == [ungated.until, gated.until]
    assert all(before + 30_000 <= a["claim_until"] <= after + 30_000 for a in store.asked)


@pytest.mark.anyio
async def test_a_timer_claimed_and_not_settled_is_excluded_from_the_next_claim() -> None:
    """A claimed timer whose delivery is still under way is never claimed again, however long it
    takes (its claim may have expired meanwhile): the next round's claim excludes it. The round
    that claimed a whole batch says so (the loop claims again at once)."""
    due = timer("o-slow", now_ms() - 50)
    store = ScriptedClaims([due])
    gw = Recorder()
    release = gw.hold()
    strategy = _claiming(store, gw, batch=1)
    held, waker, parts = held_slot(8), caught_up_waker(), frozenset(range(8))
    with anyio.fail_after(5):
        async with running(strategy, held, waker):
            first = await strategy.round(held, waker, parts)
            await gw.entered.wait()  # delivery under way
            await strategy.round(held, waker, parts)
            held.request_stop()
            release.set()
    assert (first.taken, first.full, first.read_bound) == (1, True, True)
    assert [a["exclude"] for a in store.asked] == [set(), {due.timer_id}]


@pytest.mark.anyio
async def test_a_timer_the_log_check_holds_back_waits_half_the_claims_ttl_for_the_feed_then_goes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The log holds a commit of the due timer's aggregate and the feed never reads it: the
    timer waits for the feed for half its claim's time to live (longer than the read wait), then
    is settled back undelivered (the bounds allow 0.6 s for a loaded machine). The round that
    claimed it, asking the log at the due times, was not bound by the feed's read."""
    monkeypatch.setattr(firing, "READ_WAIT_S", 0.05)
    due = timer("o-changed", now_ms() - 50)
    store = ScriptedClaims([due])
    checked_at: list[float] = []

    async def commit_found(probes: list[OwnerProbe]) -> set[int]:
        checked_at.append(anyio.current_time())
        return set(range(len(probes)))

    gw = Recorder()
    strategy = _claiming(store, gw, claim_ttl_s=0.6, gate=commit_found)
    held, waker, parts = held_slot(8), Waker(), frozenset(range(8))
    waker.reading(due.scheduled_at - 1_000, [])  # read the log's head just now, not past the due time
    with anyio.fail_after(5):
        async with running(strategy, held, waker):
            claimed = await strategy.round(held, waker, parts)
            while not store.settled:
                await store.changed.wait()
            settled_at = anyio.current_time()
            still_waiting = REGISTRY.get_sample_value("wowd_timers_waiting", {"slot": "0", "reason": "log_check"})
            held.request_stop()
    (change,) = store.settled
    (checked,) = checked_at
    assert (change.kind, change.timer.timer_id, change.error) == ("release", due.timer_id, firing.NOT_READ)
    assert 0.3 <= settled_at - checked <= 0.9, f"settled back {settled_at - checked:.3f} s after the check"
    assert gw.sent == []
    assert still_waiting == 0  # no longer counted as waiting once settled back
    assert (claimed.taken, claimed.read_bound) == (1, False)  # claimed up to the lookahead past now


@pytest.mark.anyio
async def test_a_timer_claimed_ahead_is_delivered_at_its_scheduled_time_not_at_the_lookaheads_end() -> None:
    """Claimed 200 ms ahead with a 2 s lookahead, a timer the feed has read past is sent at its
    scheduled time (the bound allows 0.8 s for a loaded machine), without asking the log to look
    at its head."""
    ahead = timer("o-ahead", now_ms() + 200)
    store = ScriptedClaims([ahead])
    gw = Recorder()
    nudges: list[float] = []
    settings = TimerSettings(lookahead_ms=2_000, claim_ttl_s=30)
    limits = target_limits(64, lambda _target: 16)
    strategy = ClaimDeliverSettle(settings, store, gw, limits, lambda: nudges.append(anyio.current_time()))
    held, waker, parts = held_slot(8), caught_up_waker(), frozenset(range(8))
    with anyio.fail_after(5):
        async with running(strategy, held, waker):
            await strategy.round(held, waker, parts)
            await gw.entered.wait()
            held.request_stop()
    ((sent, fired_at),) = gw.fired
    assert sent.timer_id == ahead.timer_id
    assert ahead.scheduled_at <= fired_at <= ahead.scheduled_at + 800
    assert nudges == []


@pytest.mark.anyio
async def test_a_stop_while_a_timer_waits_for_the_feed_settles_it_back_as_stopped() -> None:
    """Held back by the log check, a timer still waiting for the feed when the slot stops is
    settled back undelivered (stopped), and the slot's strategy ends cleanly."""
    due = timer("o-waiting", now_ms() - 50)
    store = ScriptedClaims([due])
    checked = anyio.Event()

    async def commit_found(probes: list[OwnerProbe]) -> set[int]:
        checked.set()
        return set(range(len(probes)))

    gw = Recorder()
    strategy = _claiming(store, gw, gate=commit_found)
    held, waker, parts = held_slot(8), Waker(), frozenset(range(8))
    waker.reading(due.scheduled_at - 1_000, [])  # read the log's head just now, not past the due time
    with anyio.fail_after(5):
        async with running(strategy, held, waker):
            await strategy.round(held, waker, parts)
            await checked.wait()
            held.request_stop()
    assert [(c.kind, c.timer.timer_id, c.error) for c in store.settled] == [("release", due.timer_id, firing.STOPPED)]
    assert gw.sent == []


@pytest.mark.anyio
async def test_a_settled_retry_tells_the_waker_its_due_time_and_a_park_does_not() -> None:
    """After a settle the loop's waker knows when each retried timer is due again (the loop wakes
    for it, however long it means to sleep); a parked timer is never due, so the waker is not told
    of it (it would wake the loop for nothing)."""
    retried, parked = timer("o-retried", now_ms() - 50), timer("o-parked", now_ms() - 50)
    store = ScriptedClaims([retried, parked])
    answers: dict[str, Outcome] = {retried.timer_id: Retry(reason="busy"), parked.timer_id: Park(reason="no order")}
    async with first_round(store, Recorder(lambda t: answers[t.timer_id])) as (_strategy, held, waker, _parts):
        await store.settled_at_least(2)
        await anyio.wait_all_tasks_blocked()  # the settle's answer handled
        told = [waker.earliest()]
        waker.covered(told[0] or 0, waker.mark())
        told.append(waker.earliest())
        held.request_stop()
    changes = {c.timer.timer_id: c for c in store.settled}
    assert changes[retried.timer_id].kind == "retry" and changes[parked.timer_id].kind == "park"
    assert told == [changes[retried.timer_id].due_at, None]


class HeldSettles(ScriptedClaims):
    """:class:`ScriptedClaims` whose settles after the first wait until :attr:`release` is set
    (:attr:`held` is set when one does)."""

    def __init__(self, *answers: list[Timer]) -> None:
        super().__init__(*answers)
        self.written: list[int] = []
        self.held = anyio.Event()
        self.release = anyio.Event()

    async def settle(self, changes: list[TimerChange]) -> int:
        if self.written:
            self.held.set()
            await self.release.wait()
        self.written.append(len(changes))
        return await super().settle(changes)


@pytest.mark.anyio
async def test_deliveries_whose_outcomes_are_not_written_stay_within_the_streams_window() -> None:
    """Outcomes recorded and not yet written hold their place in the delivery stream's window
    until their settle is written, one place each: with the store's settles held, the stream
    sends a window (one call in flight plus a settle group) past the outcomes written, no more."""
    due = [timer(f"o-{i}", now_ms() - 50) for i in range(200)]
    store = HeldSettles(due)
    gw = Recorder()
    limits = target_limits(1, lambda _target: 1)
    settings = TimerSettings(lookahead_ms=100, batch=200)
    strategy = ClaimDeliverSettle(settings, store, gw, limits, lambda: None)
    held, waker, parts = held_slot(8), caught_up_waker(), frozenset(range(8))
    with anyio.fail_after(5):
        async with running(strategy, held, waker):
            await strategy.round(held, waker, parts)
            await store.held.wait()  # the first settle written, the second held
            await anyio.wait_all_tasks_blocked()  # the stream sends until its window is full
            sent_while_held = len(gw.sent)
            store.release.set()
            await gw.until_fired(len(due))
            held.request_stop()
    (written_first, *_rest) = store.written
    assert 0 < written_first < len(due)
    assert sent_while_held == written_first + limits.window
    assert len({t.timer_id for t in gw.sent}) == len(due)


def _waiting(reason: str) -> float | None:
    return REGISTRY.get_sample_value("wowd_timers_waiting", {"slot": "0", "reason": reason})


@pytest.mark.anyio
async def test_a_timer_whose_targets_circuit_was_open_counts_as_waiting_until_its_next_outcome() -> None:
    """A retry answered without a request (the target's circuit open) counts the timer as waiting
    for the circuit (``wowd_timers_waiting{reason="circuit_open"}``) until another outcome of it
    comes; the other timers' outcomes meanwhile leave it counted."""
    shut, first, second = (timer(f"o-{name}", now_ms() - 50 + i) for i, name in enumerate(("shut", "a", "b")))
    store = ScriptedClaims([shut, first, second], [shut])
    outcomes: list[Outcome] = [Retry(reason=f"{CIRCUIT_OPEN}demo.order"), Delivered(), Delivered(), Delivered()]
    gw = Recorder(lambda _t: outcomes.pop(0))
    async with first_round(store, gw) as (strategy, held, waker, parts):
        await store.settled_at_least(3)
        after_retry = _waiting(firing.WAITING_CIRCUIT)
        await strategy.round(held, waker, parts)  # its retry, delivered: the circuit closed
        await store.settled_at_least(4)
        after_delivery = _waiting(firing.WAITING_CIRCUIT)
        held.request_stop()
    assert [t.timer_id for t in gw.sent] == [shut.timer_id, first.timer_id, second.timer_id, shut.timer_id]
    assert (after_retry, after_delivery) == (1, 0)
