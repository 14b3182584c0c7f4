"""Nothing stops for good (docs/reliability.md): a commit a step refuses is quarantined
with its step and error while the rest of its batch and partition is fed; a store that refuses
everything stalls the view (``wowd_feed_stalled{view}`` 1) and, when that view is the slot's lead
(the timer view; here the event index fed alone), makes the slot not ready and, after
``feed.stall_release_s``, gives the slot up."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import embedded_settings, eventually, timer_commit
from tests.helpers import hold_slot, refusing
from wowd import metrics
from wowd.config import FeedSettings, WowdSettings
from wowd.daemon import feed as feed_module
from wowd.daemon.feed import CONSUMER, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.errors import SlotStalled
from wowd.model import partition
from wowd.retry import Backoff
from wowd.stores.base import Backend
from wowd.views import view_named

pytestmark = pytest.mark.anyio

PARTS = 4


INDEX_ALONE = (view_named("index"),)
INDEX_CONSUMER = INDEX_ALONE[0].consumer


async def index_fed(backend: Backend) -> set[int]:
    """The partitions whose index checkpoint has moved past the log's start."""
    cps = await backend.checkpoints.read(INDEX_CONSUMER, list(range(PARTS)))
    return {p for p, cp in cps.items() if cp.position}


"""The event index as the slot's only view: its stall is the slot's."""


def settings(tmp_path: Path, **feed: Any) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS, feed=FeedSettings(**feed))


def caught_up(waker: Waker) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return waker.watermark is not None

    return check


async def hold(b: Backend) -> HeldSlot:
    return await hold_slot(b, PARTS, "me")


async def test_a_commit_the_sink_refuses_is_quarantined_and_the_rest_is_fed(tmp_path: Path, backend: Backend) -> None:
    sink = refusing(backend, refuse={"bad"})
    commits = [timer_commit(f"o-{i}", 1, ["k"], due_at=10**13) for i in range(6)]
    commits.insert(3, timer_commit("bad", 1, ["k"], due_at=10**13))
    await backend.log.append_many(commits)
    poisoned = metrics.FEED_POISON.labels(step="sink", error="InvalidInput")._value.get()
    held = await hold(backend)
    feeder = Feeder(settings(tmp_path), backend)
    waker = Waker()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, waker)
            await eventually(caught_up(waker), 10, "the feed at the log's head")

            async def index_joined() -> bool:
                return feeder.following() == ["timers", "index"]

            await eventually(index_joined, 10, "the index view caught up and joined the shared read")
            held.request_stop()
    assert feeder.stalled is None and feeder.view_stalls() == {}
    fed = {d["aggregate_id"] for c in commits for d in await sink.documents(c.ref)}
    assert fed == {f"o-{i}" for i in range(6)}
    # every commit's timers are in the timer view (only the index refused one); the refused
    # commit is kept with its step and error
    assert len(await backend.timer_queries.scan(limit=20)) == 7
    [q] = await backend.quarantine.items()
    assert q["raw"]["aggregate_id"] == "bad" and q["partition"] == partition("bad", PARTS)
    assert q["reason"].startswith("sink refused it: InvalidInput:") and "mapper_parsing_exception" in q["reason"]
    assert metrics.FEED_POISON.labels(step="sink", error="InvalidInput")._value.get() == poisoned + 1
    for consumer in (CONSUMER, "wowd.index"):
        cps = await backend.checkpoints.read(consumer, list(range(PARTS)))
        assert {p for p in cps} == {partition(c.ref.id, PARTS) for c in commits}


async def test_a_store_that_refuses_everything_stalls_the_slot_then_gives_it_up(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = refusing(backend, broken=True)
    await backend.log.append_many([timer_commit(f"o-{i}", 1, []) for i in range(3)])
    held = await hold(backend)
    monkeypatch.setattr(feed_module, "STALL_BACKOFF", Backoff(0.1, 0.2))  # tried again soon after the release
    s = settings(tmp_path, stall_release_s=1.0)
    feeder = Feeder(s, backend, views=INDEX_ALONE)
    started = time.monotonic()
    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, Waker())
    assert info.group_contains(SlotStalled, match="database disk image is malformed")
    assert time.monotonic() - started >= 1.0
    # stalled, nothing quarantined (the records are fine: the store is not), nothing checkpointed
    assert feeder.stalled is not None and "sink: StorageError" in feeder.stalled
    assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 1
    assert await backend.quarantine.items() == []
    assert await index_fed(backend) == set()
    # once the store answers again the same batch is fed
    sink.broken = False
    waker = Waker()
    feeder = Feeder(s, backend, views=INDEX_ALONE)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, waker)
            await eventually(caught_up(waker), 10, "the feed at the log's head")
            held.request_stop()
    assert feeder.stalled is None
    assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 0
    assert len(await index_fed(backend)) >= 1


async def test_a_full_disk_stalls_the_slot_at_once_and_quarantines_nothing_for_it(
    tmp_path: Path, backend: Backend
) -> None:
    """The disk fills while a batch's commits are applied one by one (one of them is refused for
    itself): the commits the full disk refused are not quarantined; the slot is stalled at once
    and the batch is retried whole until space returns, when only the refused commit is set aside."""
    sink = refusing(backend, refuse={"bad"})
    sink.full_after = 2  # the batch's write (refused for "bad"), then the first commit alone
    commits = [timer_commit(f"o-{i}", 1, ["k"], due_at=10**13) for i in range(4)]
    commits.insert(2, timer_commit("bad", 1, ["k"], due_at=10**13))
    await backend.log.append_many(commits)
    held = await hold(backend)
    feeder = Feeder(settings(tmp_path), backend, views=INDEX_ALONE)
    waker = Waker()
    gauge = metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, waker)

            async def stalled() -> bool:
                return feeder.stalled is not None

            await eventually(stalled, 5, "the feed stalled")
            assert feeder.stalled is not None and "database or disk is full" in feeder.stalled
            assert gauge._value.get() == 1
            assert await backend.quarantine.items() == []
            assert await index_fed(backend) == set()
            sink.full_after = None  # space returns
            await eventually(caught_up(waker), 10, "the feed at the log's head")
            held.request_stop()
    assert feeder.stalled is None and gauge._value.get() == 0
    [q] = await backend.quarantine.items()
    assert q["raw"]["aggregate_id"] == "bad" and q["reason"].startswith("sink refused it: InvalidInput:")
    fed = {d["aggregate_id"] for c in commits for d in await sink.documents(c.ref)}
    assert fed == {f"o-{i}" for i in range(4)}
