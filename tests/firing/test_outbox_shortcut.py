"""The timer loop with the outbox shortcut (the embedded backend, the outbox gateway): the timers
due now are fired and settled in one store call per batch, with no claim, and the outcome is the
one the claim, deliver and settle steps give: the same outbox entries, the same timer view, the
same counts in the metrics. ``wowd run`` on the embedded backend uses it unless turned off."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import REGISTRY

from tests.factories import CONTEXT, commit, eventually, ref, timer, timer_commit
from tests.helpers import caught_up_waker, held_slot, timer_loop
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.config import (
    EmbeddedSettings,
    GatewaySettings,
    HttpSettings,
    LeaseSettings,
    OutboxSettings,
    TimerSettings,
    WowdSettings,
)
from wowd.daemon.firing import ClaimDeliverSettle, OutboxRounds
from wowd.daemon.replica import delivery, replica_of
from wowd.daemon.waker import Waker
from wowd.delivery import HttpGateway, OutboxGateway
from wowd.model import Command, IntervalRule, OnceRule, Timer
from wowd.stores.base import Backend
from wowd.stores.embedded.log import EmbeddedLog
from wowd.stores.embedded.outbox import EmbeddedOutbox
from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring

pytestmark = pytest.mark.anyio

PARTS = 8
TYPES = ("order", "cart", "invoice")


class CountingTimers(EmbeddedTimerFiring):
    """Counts the firing calls and the timers they fire; ``all_fired`` once ``expect`` did."""

    def __init__(self, *args: Any, expect: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()
        self.claimed = 0
        self.fired = 0
        self.expect = expect
        self.all_fired = anyio.Event()

    def _count_fired(self, n: int) -> None:
        self.fired += n
        if self.fired >= self.expect:
            self.all_fired.set()

    async def claim_due(self, *args: Any, **kwargs: Any) -> list[Timer]:
        self.calls["claim_due"] += 1
        claimed = await super().claim_due(*args, **kwargs)
        self.claimed += len(claimed)
        return claimed

    async def settle(self, *args: Any, **kwargs: Any) -> int:
        self.calls["settle"] += 1
        written = await super().settle(*args, **kwargs)
        self._count_fired(sum(1 for c in args[0] if c.kind == "fired"))
        return written

    async def fire_into_outbox(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["fire_into_outbox"] += 1
        done = await super().fire_into_outbox(*args, **kwargs)
        self._count_fired(len(done.fired))
        return done


def timers(now: int, n: int) -> list[Timer]:
    """``n`` timers of three aggregate types due over the last second; every fifth recurring."""
    return [
        timer(
            owner=ref(f"o-{i}", aggregate=TYPES[i % 3]),
            due_at=now - 1000 + i,
            partitions=PARTS,
            target=ref(f"inv-{i}", context="billing", aggregate="invoice"),
            command=Command(name="Remind", body={"i": i}),
            rule=IntervalRule(every_ms=3_600_000) if i % 5 == 0 else OnceRule(),
        )
        for i in range(n)
    ]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def fired_metrics() -> dict[str, float]:
    """What a fired round counts: fired per target, fire lag observations."""
    out = {"billing.invoice": sample("wowd_timers_fired_total", target="billing.invoice")}
    out["lag"] = sample("wowd_fire_lag_seconds_count")
    return out


async def run_loop(
    path: Path, ts: list[Timer], *, fast: bool
) -> tuple[EmbeddedTimers, EmbeddedOutbox, dict[str, float]]:
    """One slot's timer loop (fence 3, owner key ``me``) until every timer of ``ts`` fired;
    answers the store, the outbox and the metrics it counted."""
    store = embedded_timers(path, context=CONTEXT, partitions=PARTS, firing=CountingTimers, expect=len(ts))
    box = EmbeddedOutbox(path)
    for t in ts:
        assert await store.view.put(t)
    held = held_slot(PARTS, fence=3)
    loop = timer_loop(
        store.firing, OutboxGateway(box), TimerSettings(batch=100), shortcut=store.firing if fast else None
    )
    assert isinstance(loop.strategy, OutboxRounds if fast else ClaimDeliverSettle)
    before = fired_metrics()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await store.firing.all_fired.wait()
            held.request_stop()
    after = fired_metrics()
    return store, box, {k: after[k] - before[k] for k in after}


async def test_the_loop_fires_due_timers_through_the_outbox_shortcut_as_the_steps_would(tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    ts = timers(now, 250)
    steps, steps_box, steps_metrics = await run_loop(tmp_path / "steps.db", ts, fast=False)
    fast, fast_box, fast_metrics = await run_loop(tmp_path / "fast.db", ts, fast=True)
    try:
        # the shortcut: one call per batch of 100, no claim, no settle
        assert (
            fast.firing.calls["fire_into_outbox"] >= 3 and fast.firing.calls["settle"] == 0 and fast.firing.claimed == 0
        )
        assert steps.firing.calls["fire_into_outbox"] == 0 and steps.firing.claimed == 250

        # the same entries (request id, target, command, occurrence, fence, owner key)
        def entries(es: Any) -> set[tuple[Any, ...]]:
            return {(e.request_id, e.timer_id, e.target, e.command, e.scheduled_at, e.fence, e.owner_key) for e in es}

        fast_entries = await fast_box.entries(limit=1000)
        assert entries(fast_entries) == entries(await steps_box.entries(limit=1000))
        assert {e.request_id for e in fast_entries} == {t.request_id for t in ts}
        assert {(e.fence, e.owner_key) for e in fast_entries} == {(3, "me")}

        # the same view: the recurring timers at their next occurrence, the one-shots gone
        def view(xs: list[Timer]) -> list[tuple[Any, ...]]:
            return sorted((t.timer_id, t.status, t.due_at, t.scheduled_at, t.fired, t.attempts, t.claim) for t in xs)

        left = await fast.queries.scan(limit=1000)
        assert view(left) == view(await steps.queries.scan(limit=1000))
        assert {t.timer_id: t.scheduled_at for t in left} == {
            t.timer_id: t.scheduled_at + 3_600_000 for t in ts if isinstance(t.rule, IntervalRule)
        }
        for t in ts:  # a replay of the log changes nothing: no one-shot back, no occurrence reset
            await fast.view.put(t)
        assert view(await fast.queries.scan(limit=1000)) == view(left)
        # the same counts
        assert fast_metrics == steps_metrics == {"billing.invoice": 250, "lag": 250}
    finally:
        for s in (steps, steps_box, fast, fast_box):
            await s.close()


def embedded(tmp_path: Path, **kwargs: Any) -> WowdSettings:
    return WowdSettings(
        context=CONTEXT,
        partitions=PARTS,
        embedded=EmbeddedSettings(path=tmp_path / "wowd.db"),
        lease=LeaseSettings(limit=1, ttl_s=30, tolerance_s=1),
        http=HttpSettings(host="127.0.0.1", port=0),
        **kwargs,
    )


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    from wowd.stores.embedded import open_embedded

    b = await open_embedded(embedded(tmp_path))
    try:
        yield b
    finally:
        await b.close()


async def test_wowd_run_uses_the_outbox_shortcut_with_the_embedded_outbox_unless_turned_off(
    tmp_path: Path, backend: Backend
) -> None:
    def strategy(settings: WowdSettings) -> object:
        sup = replica_of(settings, backend, delivery(settings, backend))
        return sup.firing.strategy()

    assert isinstance(strategy(embedded(tmp_path)), OutboxRounds)
    assert isinstance(strategy(embedded(tmp_path, outbox=OutboxSettings(fast_path=False))), ClaimDeliverSettle)
    http = embedded(tmp_path, gateway=GatewaySettings(kind="http", url="http://127.0.0.1:9"))
    deliveries = delivery(http, backend)
    assert isinstance(deliveries.gateway, HttpGateway) and deliveries.outbox is None
    assert isinstance(replica_of(http, backend, deliveries).firing.strategy(), ClaimDeliverSettle)
    await deliveries.gateway.aclose()


async def test_a_replica_fires_a_backlog_through_the_outbox_shortcut(tmp_path: Path, backend: Backend) -> None:
    """The supervisor's slot: timers already due when the feed applies them are fired by the
    loop's outbox rounds (no claim and no settle of the timer store), each once."""
    due = int(time.time() * 1000) - 5_000
    await backend.log.append_many([timer_commit(f"o-{i}", 1, ["a", "b"], due_at=due) for i in range(40)])
    settings = embedded(tmp_path)
    sup = replica_of(settings, backend, delivery(settings, backend))

    def calls(operation: str) -> float:
        return sample("wowd_store_call_seconds_count", store="timers", operation=operation)

    before = {op: calls(op) for op in ("claim_due", "settle")}

    async def delivered() -> bool:
        return await backend.outbox.count() >= 80

    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await eventually(delivered, 15, "80 entries in the outbox")
        sup.stop()
    assert calls("claim_due") == before["claim_due"]
    assert calls("settle") == before["settle"]
    entries = await backend.outbox.entries()
    assert len(entries) == 80 and len({e.request_id for e in entries}) == 80
    assert await backend.timer_queries.scan(limit=10) == []


async def test_an_outbox_round_leaves_a_timer_whose_owner_has_a_commit_the_feed_has_not_applied(
    tmp_path: Path,
) -> None:
    """The fire rule in the outbox round's transaction: a timer due by the feed's watermark fires;
    one due after it fires unless the log holds a commit of its owner above the timer's version
    (a cancel the feed has not applied may be among them), however late it is by the clock."""
    now = int(time.time() * 1000)
    ts = timers(now, 10)  # due over [now - 1000, now - 991]
    store = embedded_timers(tmp_path / "wowd.db", context=CONTEXT, partitions=PARTS, firing=CountingTimers, expect=10)
    box = EmbeddedOutbox(tmp_path / "wowd.db")
    log = EmbeddedLog(tmp_path / "wowd.db", context=CONTEXT, partitions=PARTS)
    try:
        for t in ts:
            assert await store.view.put(t)
        # the owners of the last three have a second commit the view has not applied
        later = [commit(owner=t.owner, version=2, create_time=now) for t in ts[7:]]
        assert await log.append_many(later) == ["appended"] * 3
        held = held_slot(PARTS, fence=3)
        loop = timer_loop(store.firing, OutboxGateway(box), TimerSettings(batch=100), shortcut=store.firing)
        rounds = loop.strategy
        assert isinstance(rounds, OutboxRounds)
        waker = Waker()
        parts = frozenset(range(PARTS))
        waker.advance(now - 996)  # applied up to the fifth due time
        r = await rounds.round(held, waker, parts)
        assert (r.taken, r.skipped) == (7, 3)  # the five by the watermark, two the log has nothing past
        assert sorted(e.timer_id for e in await box.entries()) == sorted(t.timer_id for t in ts[:7])
        waker.advance(now)  # the feed applied the second commits: nothing of theirs changed the timers
        r = await rounds.round(held, waker, parts)
        assert (r.taken, r.skipped) == (3, 0)
        assert await box.count() == 10
    finally:
        for closing in (store, box, log):
            await closing.close()
