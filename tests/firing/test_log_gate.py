"""The claim strategy's log check at a due time (``Log.committed_after``): a due timer the feed has
not read the log past is delivered when the log, asked after its due time, holds no commit that
may change it; one whose aggregate has such a commit stays claimed until the feed reads that
commit, then is settled back (never delivered, never released as stopped or unread). The feed's
read of the log's head is frozen here, as a quiet MongoDB log's post-batch resume token is."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from tests.factories import Recorder, eventually, now_ms, timer
from tests.firing.conftest import PARTS
from tests.helpers import held_slot, timer_loop
from wowd.daemon.firing import CHANGED
from wowd.daemon.waker import Waker, owner_key
from wowd.stores.base import OwnerProbe
from wowd.stores.embedded.timers import EmbeddedTimerStore

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


async def test_a_due_timer_is_delivered_after_the_log_check_without_the_watermark(store: EmbeddedTimerStore) -> None:
    due = now_ms() + 400
    await store.put(timer("o-1", due, partitions=PARTS))
    gate, gateway, waker = Gate(set()), Recorder(), frozen_feed()
    held = held_slot(PARTS)
    loop = timer_loop(store, gateway, gate=gate)
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
    store: EmbeddedTimerStore,
) -> None:
    due = now_ms() + 300
    t = timer("o-1", due, partitions=PARTS)
    await store.put(t)
    gate, gateway, waker = Gate({0}), Recorder(), frozen_feed()
    held = held_slot(PARTS)
    loop = timer_loop(store, gateway, gate=gate)

    async def settled_back() -> bool:
        stored = await store.find(t.owner, "k")
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
