"""A timer loop whose store fails (a full disk, a damaged file) stalls and retries; it does not end.
In-process on the embedded backend, its timer store failing on request: the loop is stalled
(``TimerLoop.stall``, ``wowd_timers_stalled`` 1) while every call fails, fires nothing meanwhile,
and fires every due timer once by itself when the store answers again; a settle the store refuses
is retried until it answers, bounded (also on stop)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import Recorder, embedded_settings, eventually, now_ms, timer
from tests.helpers import caught_up_waker, hold_slot, timer_loop
from wowd import metrics
from wowd.config import WowdSettings
from wowd.daemon import firing
from wowd.daemon.leases import HeldSlot
from wowd.daemon.timers import TimerLoop
from wowd.errors import StorageError, StorageFull
from wowd.model import TimerChange, TimerStatus
from wowd.stores.base import Backend, TimerFiring

pytestmark = pytest.mark.anyio

PARTS = 4


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS)


FULL = StorageFull("sqlite wowd.db: database or disk is full")
DAMAGED = StorageError("sqlite wowd.db: database disk image is malformed")


class FailingTimers:
    """The timer store, whose loop calls raise ``fail`` while it is set (``settle_fail``: its
    settles only)."""

    def __init__(self, inner: TimerFiring) -> None:
        self._inner = inner
        self.fail: StorageError | None = None
        self.settle_fail: StorageError | None = None
        self.settles = 0

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
        if name not in ("claim_due", "reclaim", "next_due", "sweep"):
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

    async def stalled() -> bool:
        return loop.stall is not None and loop.stall.stalled

    async def all_fired() -> bool:
        return len(gw.sent) == 3 and not await backend.timer_queries.scan(limit=10)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await eventually(stalled, 5, "the loop stalled")  # at once: retrying will not fix it soon
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

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
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

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, caught_up_waker())
            await eventually(lambda: store.settles >= 2, 5, "the settle retried")
            store.settle_fail = None
            await eventually(settled, 5, "the fired timer settled")
            held.request_stop()
    assert [t.target.id for t in gw.sent] == ["ok-1"]  # delivered once
