"""The feed of one held slot, in-process on the embedded backend: what it projects (timers,
snapshots, the event index, checkpoints), and when it stops (a refused checkpoint, a lapsed lease)
or stalls (a log behind the oplog)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import embedded_settings, eventually, now_ms, ref, timer, timer_commit
from tests.helpers import hold_slot
from wowd import metrics
from wowd.config import WowdSettings
from wowd.daemon.feed import Feeder
from wowd.daemon.waker import Waker
from wowd.demo import reducer
from wowd.errors import LeaseLost
from wowd.model import TimerChange, TimerStatus, deterministic_timer_id, partition
from wowd.stores.base import Backend

pytestmark = pytest.mark.anyio

PARTS = 4


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS, reducers={"order": "wowd.demo:reducer"})


async def test_feed_projects_timers_snapshots_resumes_parked_and_checkpoints(tmp_path: Path, backend: Backend) -> None:
    far = now_ms() + 3_600_000
    c1 = timer_commit("o-1", 1, ["k1", "k2"], due_at=far)
    c2 = timer_commit("o-1", 2, [], due_at=far)
    c2 = replace(c2, events=(*c2.events, replace(c1.events[1], name="TimerCancelled", body={"key": "k1"})))
    d1 = timer_commit("o-2", 1, ["k"], due_at=far)
    d2 = replace(timer_commit("o-2", 2, [], due_at=far), deleted=True)
    # a timer of o-3 parked because its target o-4 did not exist; o-4's first commit resumes it
    parked = timer("o-3", far, key="wait", partitions=PARTS, target=ref("o-4"), timer_id="p1")
    assert await backend.timers.put(parked)
    await backend.firing.settle([TimerChange.park(parked, fence=1, reason="HTTP 404")])
    e1 = timer_commit("o-4", 1, [])
    await backend.log.append_many([c1, c2, d1, d2, e1])
    fed_before = metrics.FEED_COMMITS.labels(aggregate="order")._value.get()

    held = await hold_slot(backend, PARTS, "me")
    feeder = Feeder(settings(tmp_path), backend, reducers={"order": reducer})

    async def fed() -> bool:
        cps = await backend.checkpoints.read("wowd", list(range(PARTS)))
        return len(cps) == len({partition(i, PARTS) for i in ("o-1", "o-2", "o-4")})

    async with anyio.create_task_group() as tg:
        await tg.start(feeder.run, held, Waker())
        await eventually(fed, 10, "every partition with a commit checkpointed")
        held.request_stop()

    assert await backend.timer_queries.find(ref("o-1"), "k1") is None  # cancelled at v2
    k2 = await backend.timer_queries.find(ref("o-1"), "k2")
    assert k2 is not None and k2.timer_id == deterministic_timer_id(ref("o-1"), "k2", 1)
    assert k2.partition == partition("o-1", PARTS) and k2.due_at == far and k2.status == TimerStatus.PENDING
    assert await backend.timer_queries.find(ref("o-2"), "k") is None  # deleted commit: cancel_all
    resumed = await backend.timer_queries.find(ref("o-3"), "wait")
    assert resumed is not None and resumed.status == TimerStatus.PENDING
    snap = await backend.snapshots.load(ref("o-1"))
    assert snap is not None and snap.version == 2 and snap.state_revision == reducer.state_revision
    assert snap.state["timers"] == 2 and snap.state["cancelled"] == 1 and snap.state["events"] == 5
    assert [d["version"] for d in await backend.sink(ref("o-1").type).documents(ref("o-1"))] == [1, 2]
    assert metrics.FEED_COMMITS.labels(aggregate="order")._value.get() == fed_before + 5


async def test_feed_stops_on_a_refused_checkpoint(tmp_path: Path, backend: Backend) -> None:
    p = partition("o-9", PARTS)
    assert await backend.checkpoints.save("wowd", p, {"seq": 0}, 99)  # a newer holder's fence
    await backend.log.append(timer_commit("o-9", 1, ["k"]))
    held = await hold_slot(backend, PARTS, "me")
    with anyio.fail_after(10), pytest.raises(LeaseLost):
        await Feeder(settings(tmp_path), backend).run(held, Waker())


async def test_expired_lease_takes_no_side_effect(tmp_path: Path, backend: Backend) -> None:
    """A process that wakes (e.g. from SIGSTOP) after its validity acts on nothing."""
    await backend.log.append(timer_commit("o-5", 1, ["k"]))
    held = await hold_slot(backend, PARTS, "me", valid_for=-1.0)
    with anyio.fail_after(10), pytest.raises(LeaseLost):
        await Feeder(settings(tmp_path), backend).run(held, Waker())
    assert await backend.timer_queries.find(ref("o-5"), "k") is None
    assert await backend.checkpoints.read("wowd", list(range(PARTS))) == {}


async def test_a_log_behind_the_oplog_stalls_the_feed_at_once_and_does_not_re_read_in_a_loop(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log whose history was lost twice in one read (the feed slower than the oplog window)
    stalls the slot at once, naming it, and is not read again on the short retry backoff."""
    from wowd.errors import LogBehindOplog

    reads = 0

    def read(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async def lost() -> AsyncIterator[Any]:
            nonlocal reads
            reads += 1
            raise LogBehindOplog("history lost twice: keep more oplog (oplogMinRetentionHours)", partitions=(0,))
            yield  # an async generator

        return lost()

    monkeypatch.setattr(backend.log, "read", read)
    held = await hold_slot(backend, PARTS, "me")
    feeder = Feeder(settings(tmp_path), backend)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, Waker())

            async def stalled() -> bool:
                return feeder.stalled is not None

            await eventually(stalled, 5, "the feed stalled")
            assert feeder.stalled is not None and "oplog" in feeder.stalled
            assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="timers")._value.get() == 1
            first = reads
            with anyio.move_on_after(0.3):
                await held.stop_event.wait()  # the stall's backoff, not a hot loop of re-reads
            assert reads - first <= 2
            held.request_stop()
