"""``wowd demo`` spreads its commits over the orders asked for, however many chunks (or ticks of
``wowd run --demo``) it appends them in, and every fifth order's second commit cancels the timer
its first one scheduled."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from wowd.backends import opened_backend
from wowd.config import EmbeddedSettings, WowdSettings
from wowd.demo import DemoStats, produce, produce_forever
from wowd.model import Commit
from wowd.stores.base import Backend, Log

pytestmark = pytest.mark.anyio


def settings(tmp_path: Path) -> WowdSettings:
    return WowdSettings(context="demo", partitions=4, embedded=EmbeddedSettings(path=tmp_path / "wowd.db"))


async def logged(b: Backend) -> list[Commit]:
    out = []
    async for batch in b.log.read({p: None for p in range(4)}, follow=False):
        for e in batch.entries:
            assert e.commit is not None
            out.append(e.commit)
    return out


@pytest.mark.parametrize(("orders", "versions", "cancels"), [(1200, 1, 0), (500, {2, 3}, 100), (100, 12, 20)])
async def test_the_commits_are_spread_over_every_order_across_chunks(
    tmp_path: Path, orders: int, versions: int | set[int], cancels: int
) -> None:
    async with opened_backend(settings(tmp_path)) as b:
        stats = await produce(b.log, commits=1200, timers=1200, due_in_ms=0, aggregates=orders, chunk=500)
        commits = await logged(b)
    per_order = Counter(c.ref.id for c in commits)
    assert stats.commits == 1200 and stats.timers == 1200
    assert len(per_order) == orders
    assert set(per_order.values()) == (versions if isinstance(versions, set) else {versions})
    # an order's second commit may be in another chunk than its first: it cancels all the same
    cancelled = [e.body["key"] for c in commits for e in c.events if e.name == "TimerCancelled"]
    assert stats.cancelled == len(cancelled) == cancels
    assert set(cancelled) <= {"expire-1-0"}  # the timer of the order's first commit


class CountingLog:
    """A log whose appends are counted; ``enough`` is set after ``calls`` of them."""

    def __init__(self, inner: Log, calls: int) -> None:
        self.inner = inner
        self.context = inner.context
        self.calls = calls
        self.enough = anyio.Event()

    async def append_many(self, commits: Sequence[Commit]) -> None:
        await self.inner.append_many(commits)
        self.calls -= 1
        if self.calls <= 0:
            self.enough.set()


async def test_the_running_demo_spreads_its_ticks_over_every_order(tmp_path: Path) -> None:
    async with opened_backend(settings(tmp_path)) as b:
        log = CountingLog(b.log, calls=4)
        stats = DemoStats()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                # 20 commits a tick over 40 orders: four ticks reach every order
                tg.start_soon(lambda: produce_forever(log, stats, rate_per_s=100, aggregates=40))  # type: ignore[arg-type]
                await log.enough.wait()
                tg.cancel_scope.cancel()
        commits = await logged(b)
    assert len(commits) == stats.commits >= 80
    assert len({c.ref.id for c in commits[:80]}) == 40
