"""The timer loop of one held slot, in-process on the embedded backend: each outcome settled,
nothing sent after a stop, the next occurrence and the retry's backoff, a wall clock stepped back,
a misfired occurrence skipped."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests import helpers
from tests.factories import CONTEXT, Recorder, embedded_settings, eventually, now_ms, ref, timer
from tests.helpers import caught_up_waker, hold_slot, timer_loop
from wowd import metrics
from wowd.backends import opened_backend
from wowd.config import TimerSettings
from wowd.daemon.leases import HeldSlot
from wowd.daemon.stream import target_limits
from wowd.daemon.timer_plan import next_occurrence, outcome_changes
from wowd.daemon.timers import TimerLoop
from wowd.delivery import Delivered, Fail, Outcome, Park, Retry
from wowd.model import CronRule, IntervalRule, OnceRule, Timer, TimerStatus, attempt_record
from wowd.stores.base import Backend, TimerQueries

pytestmark = pytest.mark.anyio

PARTS = 4


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async with opened_backend(embedded_settings(tmp_path, PARTS)) as b:
        yield b


async def hold(b: Backend) -> HeldSlot:
    return await hold_slot(b, PARTS, "me")


ANSWERS: dict[str, Outcome] = {
    "ok": Delivered(),
    "retry": Retry(reason="HTTP 503"),
    "park": Park(reason="HTTP 404"),
    "fail": Fail(reason="HTTP 400"),
}


def scripted() -> Recorder:
    """A gateway answering by the target id's prefix (``ok-1`` is delivered, ``retry-1`` a 503,
    ``park-1`` a 404, ``fail-1`` a 400)."""
    return Recorder(answer=lambda t: ANSWERS[t.target.id.split("-")[0]])


async def run_until_settled(loop: TimerLoop, held: HeldSlot, gw: Recorder, timers: TimerQueries, n: int) -> None:
    """Runs the slot's timer loop until ``n`` timers were sent and none of ``timers`` is claimed,
    then stops it."""

    async def settled() -> bool:
        return len(gw.sent) >= n and not await timers.scan(status=TimerStatus.FIRING, limit=1)

    async with anyio.create_task_group() as tg:
        await tg.start(loop.run, held, caught_up_waker())
        await eventually(settled, 10, "every due timer delivered and settled", every=0.02)
        held.request_stop()


def due_timer(target: str, **fields: Any) -> Timer:
    """A timer of ``owner-TARGET`` due 50 ms ago, sent to order ``target``."""
    return timer(f"owner-{target}", now_ms() - 50, partitions=PARTS, target=ref(target), **fields)


async def test_timer_loop_settles_each_outcome(backend: Backend) -> None:
    timers = [
        due_timer("ok-1"),
        due_timer("ok-2", rule=IntervalRule(every_ms=60_000)),
        due_timer("retry-1"),
        due_timer("retry-2", attempts=9),
        due_timer("park-1"),
        due_timer("fail-1"),
    ]
    for x in timers:
        assert await backend.timers.put(x)
    gw = scripted()
    held = await hold(backend)
    counters = (metrics.TIMERS_FIRED, metrics.TIMERS_RETRIED, metrics.TIMERS_PARKED, metrics.TIMERS_FAILED)
    before = [c.labels(target=f"{CONTEXT}.order")._value.get() for c in counters]
    loop = timer_loop(backend.firing, gw, TimerSettings(max_attempts=10))
    await run_until_settled(loop, held, gw, backend.timer_queries, len(timers))
    assert len(gw.sent) == len(timers)  # each delivered once
    assert {x.claim.fence for x in gw.sent if x.claim} == {held.fence}

    async def get(target: str) -> Timer | None:
        return await backend.timer_queries.find(ref(f"owner-{target}"), "k")

    assert await get("ok-1") is None  # once: deleted
    nxt = await get("ok-2")
    assert nxt is not None and nxt.status == TimerStatus.PENDING and nxt.fired == 1
    assert nxt.scheduled_at == timers[1].scheduled_at + 60_000
    r1 = await get("retry-1")
    assert r1 is not None and r1.status == TimerStatus.PENDING and r1.attempts == 1
    assert r1.due_at >= timers[2].due_at + 500 and r1.last_error == "HTTP 503"
    r2 = await get("retry-2")
    assert r2 is not None and r2.status == TimerStatus.FAILED  # retry budget spent
    p = await get("park-1")
    assert p is not None and p.status == TimerStatus.PARKED
    f = await get("fail-1")
    assert f is not None and f.status == TimerStatus.FAILED and f.last_error == "HTTP 400"
    counted = [c.labels(target=f"{CONTEXT}.order")._value.get() - n for c, n in zip(counters, before, strict=True)]
    assert counted == [2, 1, 1, 2]  # fired, retried, parked, failed (the spent budget and the 400)


async def test_no_delivery_starts_after_a_stop_and_the_claimed_are_released(backend: Backend) -> None:
    """Five claimed timers of one target delivered one at a time: the stop comes while the first
    is in flight; that one finishes and settles, none of the others is sent, and they are
    released, due again with no attempt spent."""
    for i in range(5):
        assert await backend.timers.put(due_timer(f"ok-{i}"))
    gw = scripted()
    release = gw.hold()
    held = await hold(backend)
    loop = timer_loop(backend.firing, gw, limits=target_limits(64, lambda _target: 1))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await gw.entered.wait()  # claimed, the first in flight
            firing = await backend.timer_queries.scan(status=TimerStatus.FIRING, limit=10)
            assert len(firing) == 5 and all(x.claim and x.claim.owner_key == "me" for x in firing)
            held.request_stop()  # the signal: nothing more is sent
            release.set()
    assert len(gw.sent) == 1
    assert await backend.timer_queries.find(gw.sent[0].owner, "k") is None  # the one in flight: delivered and settled
    released = await backend.timer_queries.scan(limit=10)
    assert len(released) == 4
    assert all(x.status is TimerStatus.PENDING and x.attempts == 0 and x.claim is None for x in released)
    assert all(x.last_error == "not delivered: stopped" for x in released)


def test_next_occurrence_coalesces_missed_intervals() -> None:
    t = due_timer("ok-x", rule=IntervalRule(every_ms=1000))
    assert next_occurrence(t, t.scheduled_at) == t.scheduled_at + 1000
    assert next_occurrence(t, t.scheduled_at + 5500) == t.scheduled_at + 6000
    bounded = replace(t, rule=IntervalRule(every_ms=1000, until=t.scheduled_at + 2000))
    assert next_occurrence(bounded, t.scheduled_at + 5500) is None
    assert next_occurrence(due_timer("ok-y"), 0) is None


def test_next_occurrence_is_strictly_after_the_fire_time_and_may_fall_on_the_rules_end() -> None:
    t = due_timer("ok-x", rule=IntervalRule(every_ms=1000))
    at = t.scheduled_at
    assert next_occurrence(t, at + 1000) == at + 2000  # the occurrence due now is the one fired
    bounded = replace(t, rule=IntervalRule(every_ms=1000, until=at + 6000))
    assert next_occurrence(bounded, at + 5500) == at + 6000  # ``until`` is inclusive
    minute = 1_700_000_040_000  # a whole minute, UTC
    cron = replace(t, scheduled_at=minute, rule=CronRule(expression="* * * * *", zone="UTC"))
    assert next_occurrence(cron, minute + 330_000) == minute + 360_000  # missed minutes coalesced


def test_retry_backoff_is_exponential_with_jitter() -> None:
    s = TimerSettings(backoff_base_s=1.0, backoff_max_s=30.0, max_attempts=10)
    for attempts, lo, hi in ((0, 500, 1000), (3, 4000, 8000), (8, 15_000, 30_000)):
        t = replace(due_timer("retry-z"), attempts=attempts)
        (c,) = outcome_changes([(t, Retry(reason="x"), 1_000)], 1, s)
        assert c.kind == "retry" and c.due_at is not None and lo <= c.due_at - 1_000 <= hi


def test_the_settle_of_each_outcome_keeps_its_reason_the_targets_hint_and_the_park_time() -> None:
    """What operators read of a settled attempt: a retry waits at least the target's hint
    (``Retry-After``), a spent budget fails naming the attempts and the last reason, a park
    records when and why, a failure why."""
    s = TimerSettings(backoff_base_s=1.0, backoff_max_s=30.0, max_attempts=3)
    t = due_timer("outcome-a")
    at = 1_000
    retried, spent, parked, failed = outcome_changes(
        [
            (t, Retry(reason="503", after_s=120.0), at),
            (replace(t, attempts=2), Retry(reason="503 again"), at),
            (t, Park(reason="404 no such aggregate"), at),
            (t, Fail(reason="400 refused"), at),
        ],
        1,
        s,
    )
    assert retried.kind == "retry" and retried.due_at == at + 120_000 and retried.error == "503"
    assert (spent.kind, spent.error) == ("fail", "retry budget spent after 3 attempts: 503 again")
    assert (parked.kind, parked.due_at, parked.error) == ("park", at, "404 no such aggregate")
    assert (failed.kind, failed.error) == ("fail", "400 refused")


async def test_a_wall_clock_stepped_back_holds_a_claimed_round_no_longer_than_the_lookahead(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claimed, then the wall clock steps back ten minutes: the timer now looks ten minutes
    ahead, yet it is delivered after at most the lookahead (on the monotonic clock; the bound
    allows 0.8 s more for a loaded machine, short of the next second)."""
    from wowd.daemon import firing, timers

    assert await backend.timers.put(due_timer("ok-step"))
    real = timers.now_ms
    step = {"ms": 0}
    stepped_at: list[float] = []
    for module in (timers, firing):
        monkeypatch.setattr(module, "now_ms", lambda: real() - step["ms"])

    class SteppingStore:
        async def claim_due(self, *args: Any, **kwargs: Any) -> list[Timer]:
            claimed = await backend.firing.claim_due(*args, **kwargs)
            if claimed:
                step["ms"] = 600_000  # the clock steps back right after the claim
                stepped_at.append(anyio.current_time())
            return claimed

        def __getattr__(self, name: str) -> Any:
            return getattr(backend.firing, name)

    gw = scripted()
    held = await hold(backend)
    loop = timer_loop(SteppingStore(), gw, TimerSettings(lookahead_ms=200))  # type: ignore[arg-type]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await gw.entered.wait()
            delivered_at = anyio.current_time()
            held.request_stop()
    assert [x.target.id for x in gw.sent] == ["ok-step"]
    (claimed_at,) = stepped_at
    assert delivered_at - claimed_at <= 0.2 + 0.8, f"delivered {delivered_at - claimed_at:.3f} s after the claim"


async def test_an_occurrence_past_its_misfire_grace_is_skipped_not_delivered(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """Claimed late (a replica was down), an occurrence later than its rule's misfire grace is
    settled as passed, not sent: a one-shot timer is done, a recurring one moves to its next
    occurrence after now; one within its grace, and one without a grace, are delivered. The line
    that says so names the timer (id, owner, key), not only its request id."""
    caplog.set_level(logging.INFO, logger="wowd.daemon.timers")
    hour_ago = now_ms() - 3_600_000
    late = [
        replace(due_timer("ok-once"), rule=OnceRule(misfire_grace_ms=60_000), due_at=hour_ago, scheduled_at=hour_ago),
        replace(
            due_timer("ok-every"),
            rule=IntervalRule(every_ms=600_000, misfire_grace_ms=60_000),
            due_at=hour_ago,
            scheduled_at=hour_ago,
        ),
    ]
    on_time = [
        due_timer("ok-graced", rule=OnceRule(misfire_grace_ms=600_000)),
        replace(due_timer("ok-plain"), due_at=hour_ago, scheduled_at=hour_ago),
    ]
    for x in late + on_time:
        assert await backend.timers.put(x)
    gw = scripted()
    held = await hold(backend)
    skipped_before = metrics.TIMERS_MISFIRED.labels(target=f"{CONTEXT}.order")._value.get()
    loop = timer_loop(backend.firing, gw)
    await run_until_settled(loop, held, gw, backend.timer_queries, len(on_time))
    assert sorted(x.target.id for x in gw.sent) == ["ok-graced", "ok-plain"]
    assert await backend.timer_queries.find(ref("owner-ok-once"), "k") is None  # done, not delivered
    every = await backend.timer_queries.find(ref("owner-ok-every"), "k")
    assert every is not None and every.status is TimerStatus.PENDING
    assert every.scheduled_at > now_ms() - 600_000  # the next occurrence after now
    assert metrics.TIMERS_MISFIRED.labels(target=f"{CONTEXT}.order")._value.get() - skipped_before == 2
    (line,) = [r.getMessage() for r in caplog.records if "was skipped" in r.getMessage()]  # one per target
    assert any(f"(timer {x.timer_id} of {x.owner} key 'k', request id {x.request_id})" in line for x in late), line
    assert f"a timer for {CONTEXT}.order was skipped: " in line and "past its misfire grace of 60000 ms" in line, line


async def test_a_stop_wakes_a_round_waiting_for_claimed_timers_to_settle(backend: Backend) -> None:
    """With a batch claimed and unsettled, the next round waits for room; a stop ends that wait
    even after earlier settles (each of which renewed what the round waits on)."""
    assert await backend.timers.put(due_timer("ok-first"))
    gw = scripted()
    held = await hold(backend)
    loop = timer_loop(backend.firing, gw, TimerSettings(batch=1))

    async def first_settled() -> bool:
        return await backend.timer_queries.find(ref("owner-ok-first"), "k") is None

    async def two_claimed() -> bool:
        return len(await backend.timer_queries.scan(status=TimerStatus.FIRING, limit=10)) == 2

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await eventually(first_settled, 5, "the first timer settled")
            release = gw.hold()  # from now on deliveries wait
            for i in range(3):
                assert await backend.timers.put(due_timer(f"ok-{i}"))
            await eventually(two_claimed, 5, "two batches claimed and unsettled")
            held.request_stop()
            release.set()  # the requests in flight end (the grace period's work)
    assert len(await backend.timer_queries.scan(status=TimerStatus.FIRING, limit=10)) == 0  # settled or released


async def test_the_timer_loop_of_a_replica_keeping_a_history_deletes_its_expired_records(backend: Backend) -> None:
    """The history is swept by the slot's timer loop: a record past its retention is deleted at
    the loop's first sweep."""
    assert backend.history is not None
    old = due_timer("ok-old")
    await backend.history.append([attempt_record(old, "delivered", now_ms() - 60_000, 1_000)])
    assert len(await backend.history.of_timer(old.timer_id)) == 1
    held = await hold(backend)
    loop = replace(helpers.firing(backend.firing, scripted()), history=backend.history).loop()

    async def swept() -> bool:
        return not await backend.history.of_timer(old.timer_id)  # type: ignore[union-attr]

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await eventually(swept, 5, "the expired history record deleted", every=0.02)
            held.request_stop()
