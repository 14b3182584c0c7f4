"""The claim strategy's log check at a due time (``Log.committed_after``): a due timer the feed has
not read the log past is delivered when the log, asked after its due time, holds no commit that
may change it; one whose aggregate has such a commit stays claimed until the feed reads that
commit, then is settled back (never delivered, never released as stopped or unread). The feed's
read of the log's head is frozen here, as a quiet MongoDB log's post-batch resume token is."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
from prometheus_client import REGISTRY

from tests.factories import Recorder, eventually, now_ms, timer
from tests.firing.conftest import PARTS
from tests.helpers import held_slot, timer_loop
from tests.timer_stores import EmbeddedTimers
from wowd.daemon import firing
from wowd.daemon.firing import CHANGED, NOT_READ
from wowd.daemon.waker import Waker, owner_key
from wowd.stores.base import OwnerProbe

pytestmark = pytest.mark.anyio


class Gate:
    """A log check answering ``found`` (the probes' indexes), recording each call and when."""

    def __init__(self, found: set[int]) -> None:
        self.found = found
        self.calls: list[tuple[int, list[OwnerProbe]]] = []
        self.called = anyio.Event()

    async def __call__(self, probes: Sequence[OwnerProbe]) -> set[int]:
        self.calls.append((now_ms(), list(probes)))
        self.called.set()
        return set(self.found)


def frozen_feed(idle_ms: int = 5_000) -> Waker:
    """A waker whose feed read the log's head just now, its watermark ``idle_ms`` behind (a quiet
    log whose resume token has not moved)."""
    w = Waker(partitions=range(PARTS))
    w.reading(now_ms() - idle_ms, ())
    w.advance(now_ms() - idle_ms)
    return w


async def test_a_due_timer_is_delivered_after_the_log_check_without_the_watermark(store: EmbeddedTimers) -> None:
    due = now_ms() + 400
    await store.view.put(timer("o-1", due, partitions=PARTS))
    gate, gateway, waker = Gate(set()), Recorder(), frozen_feed()
    held = held_slot(PARTS)
    loop = timer_loop(store.firing, gateway, gate=gate)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await gateway.until_fired(1)
            held.request_stop()
    (_t, at), = gateway.fired  # fmt: skip
    assert due <= at <= due + 200
    ((asked_at, probes),) = gate.calls
    assert asked_at >= due and probes == [OwnerProbe(timer("o-1", due, partitions=PARTS).owner, 1, "k")]


async def test_a_timer_the_log_check_holds_back_is_settled_back_once_the_feed_reads_the_commit(
    store: EmbeddedTimers,
) -> None:
    due = now_ms() + 300
    t = timer("o-1", due, partitions=PARTS)
    await store.view.put(t)
    gate, gateway, waker = Gate({0}), Recorder(), frozen_feed()
    held = held_slot(PARTS)
    loop = timer_loop(store.firing, gateway, gate=gate)

    async def settled_back() -> bool:
        stored = await store.queries.find(t.owner, "k")
        return stored is not None and stored.last_error == CHANGED

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await gate.called.wait()
            # the feed reads the commit the check found (a cancel): the claimed timer goes back
            waker.reading(None, [owner_key(t.owner)])
            await eventually(settled_back, 3, "the held timer settled back as changed")
            held.request_stop()
    assert gateway.fired == []


def waiting(reason: str) -> float:
    """``wowd_timers_waiting`` of the held slot (slot 0) for ``reason``."""
    return REGISTRY.get_sample_value("wowd_timers_waiting", {"slot": "0", "reason": reason}) or 0.0


class HeldGate(Gate):
    """A log check that answers only once :attr:`answer` is set."""

    def __init__(self, found: set[int]) -> None:
        super().__init__(found)
        self.answer = anyio.Event()

    async def __call__(self, probes: Sequence[OwnerProbe]) -> set[int]:
        found = await super().__call__(probes)
        await self.answer.wait()
        return found


async def test_timers_under_the_log_check_are_counted_waiting_while_it_runs_and_no_more_after(
    store: EmbeddedTimers,
) -> None:
    due = now_ms() + 200
    await store.view.put(timer("o-1", due, partitions=PARTS))
    await store.view.put(timer("o-2", due, partitions=PARTS))
    gate, gateway, waker = HeldGate(set()), Recorder(), frozen_feed()
    held = held_slot(PARTS)
    loop = timer_loop(store.firing, gateway, gate=gate)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await gate.called.wait()
            assert waiting("log_check") == 2  # the group the log is asked about
            gate.answer.set()
            await gateway.until_fired(2)
            assert waiting("log_check") == 0
            held.request_stop()


async def test_a_timer_the_feed_never_reads_past_is_settled_back_undelivered_after_the_read_wait(
    store: EmbeddedTimers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No log check, and a feed that read the log up to now and no further: the timer due within
    the lookahead is claimed, waits :data:`~wowd.daemon.firing.READ_WAIT_S` for the feed to read
    past its due time, then goes back to the view undelivered (claimable again), not held for
    ever."""
    monkeypatch.setattr(firing, "READ_WAIT_S", 0.3)
    waker = frozen_feed(idle_ms=0)
    due = now_ms() + 100
    t = timer("o-1", due, partitions=PARTS)
    await store.view.put(t)
    gateway = Recorder()
    held = held_slot(PARTS)
    loop = timer_loop(store.firing, gateway)

    async def settled_back() -> bool:
        stored = await store.queries.find(t.owner, "k")
        return stored is not None and stored.last_error == NOT_READ

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await eventually(settled_back, 3, "the held timer settled back as not read")
            assert waiting("feed_behind") <= 1  # counted while held (claimed and held again), no more
            held.request_stop()
    assert gateway.fired == []
