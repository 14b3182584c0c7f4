"""The fire rule in the outbox shortcut's transaction (the embedded backend: log and timers in one
file). A timer due after the feed's watermark is fired only when the log, read in the firing
transaction, holds no commit of its owner above the timer's version: a cancel appended before the
due time always wins, and the timers of every other aggregate fire at their due time although the
feed is behind."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import cancelled, commit, embedded_settings, eventually, timer, timer_commit
from tests.helpers import hold_slot
from wowd.backends import opened_backend
from wowd.config import HttpSettings, WowdSettings
from wowd.daemon.feed import Feeder
from wowd.daemon.firing import OutboxRounds
from wowd.daemon.leases import HeldSlot
from wowd.daemon.replica import delivery, replica_of
from wowd.daemon.waker import Waker
from wowd.model import AggregateType, Commit, TimerStatus
from wowd.model import partition as partition_of
from wowd.stores.base import OUTBOX_SHORTCUT, Backend, EventSink, OutboxRound

pytestmark = pytest.mark.anyio

PARTS = 4
ALL = frozenset(range(PARTS))


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS, http=HttpSettings(host="127.0.0.1", port=0))


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async with opened_backend(settings(tmp_path)) as b:
        yield b


async def hold(b: Backend) -> HeldSlot:
    return await hold_slot(b, PARTS)


async def feed_to_head(tmp_path: Path, b: Backend, held: HeldSlot) -> None:
    """Runs the slot's feed until every partition's checkpoint is at the log's end."""
    waker = Waker()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(Feeder(settings(tmp_path), b).run, held, waker)

            async def at_head() -> bool:
                return waker.watermark is not None

            await eventually(at_head, 10, "the feed at the log's head")
            held.request_stop()


async def fire(b: Backend, read_to: int) -> tuple[list[str], int]:
    """The outbox shortcut over every partition, due by now, the feed's watermark at
    ``read_to``: the timer ids fired and how many were left for the feed."""
    shortcut = b.capability(OUTBOX_SHORTCUT)
    assert shortcut is not None
    now = int(time.time() * 1000)
    done = await shortcut.fire_into_outbox(
        OutboxRound(
            partitions=ALL, at=now, read_to=read_to, limit=100, owner_key="a", fence=1, next_due=lambda t, at: None
        )
    )
    return sorted(str(f.timer_id) for f in done.fired), done.left


async def owners_fired(b: Backend) -> list[str]:
    return sorted(e.target.id for e in await b.outbox.entries())


async def test_a_timer_whose_owner_has_a_commit_above_its_version_is_left_for_the_feed(
    tmp_path: Path, backend: Backend
) -> None:
    due = int(time.time() * 1000) - 1_000
    await backend.log.append_many([timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(6)])
    await feed_to_head(tmp_path, backend, await hold(backend))
    # two cancels appended before the due time's fire, not applied by the feed yet
    await backend.log.append_many([commit("o-0", 2, cancelled()), commit("o-1", 2, cancelled())])
    fired, left_n = await fire(backend, due - 1)
    assert (len(fired), left_n) == (4, 2)
    assert await owners_fired(backend) == [f"o-{i}" for i in range(2, 6)]
    left = await backend.timer_queries.scan(limit=10)
    assert sorted(t.owner.id for t in left) == ["o-0", "o-1"] and {t.status for t in left} == {TimerStatus.PENDING}
    # the feed applies the cancels: nothing is left to fire
    await feed_to_head(tmp_path, backend, await hold(backend))
    assert await fire(backend, due - 1) == ([], 0)
    assert await backend.timer_queries.scan(limit=10) == []
    assert await owners_fired(backend) == [f"o-{i}" for i in range(2, 6)]


async def test_timers_due_by_the_watermark_are_fired_without_reading_the_log(tmp_path: Path, backend: Backend) -> None:
    """The watermark says the feed applied every commit appended before it: a timer due by then
    is fired as read (a commit appended after its due time does not hold it back)."""
    due = int(time.time() * 1000) - 1_000
    await backend.log.append_many([timer_commit("o-0", 1, ["k"], due_at=due)])
    await feed_to_head(tmp_path, backend, await hold(backend))
    await backend.log.append_many([timer_commit("o-0", 2, [], due_at=due)])  # after the due time
    fired, left = await fire(backend, due)
    assert (len(fired), left) == (1, 0)


async def test_a_commit_above_the_timers_version_holds_it_whatever_the_feeds_checkpoints(
    tmp_path: Path, backend: Backend
) -> None:
    """Timers at version 1 in a view the feed never checkpointed; one owner's log holds a commit
    at version 2: that timer is left until the feed has applied it, the other fires."""
    due = int(time.time() * 1000) - 1_000
    ts = [timer(f"x-{i}", due, partitions=PARTS) for i in range(2)]
    for t in ts:
        assert await backend.timers.put(t)
    await backend.log.append_many([timer_commit("x-0", 1, []), commit("x-0", 2, cancelled())])
    assert await owners_after(backend, due - 1) == (["x-1"], 1)


async def test_only_commits_of_the_timers_own_aggregate_hold_it_back(tmp_path: Path, backend: Backend) -> None:
    """The feed behind on a partition: a timer whose aggregate has no commit past the checkpoint
    is fired although other aggregates of its partition have; one whose aggregate has is left."""
    due = int(time.time() * 1000) - 1_000
    ids = [f"y-{i}" for i in range(60)]
    part = partition_of(ids[0], PARTS)
    same = [i for i in ids if partition_of(i, PARTS) == part]
    assert len(same) >= 5
    for agg in same[:2]:
        assert await backend.timers.put(timer(agg, due, partitions=PARTS))
    # commits of other aggregates of the same partition, and one above the second timer's version
    others = [timer_commit(agg, v, []) for agg in same[2:5] for v in (1, 2)]
    await backend.log.append_many([*others, timer_commit(same[1], 1, []), commit(same[1], 2, cancelled())])
    assert await owners_after(backend, due - 1) == ([same[0]], 1)
    [left] = await backend.timer_queries.scan(limit=10)
    assert left.owner.id == same[1]


async def owners_after(b: Backend, read_to: int) -> tuple[list[str], int]:
    """The owners fired by one shortcut round (the watermark at ``read_to``), and how many were
    left."""
    _fired, left = await fire(b, read_to)
    return await owners_fired(b), left


class HeldSink:
    """An event sink whose writes wait while ``hold`` is set (the feed stuck on a slow store)."""

    def __init__(self, inner: EventSink, gate: dict[str, Any]) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def write(self, commits: Sequence[Commit]) -> Any:
        if self._gate["hold"]:
            self._gate["held"].set()
            await self._gate["release"].wait()
        return await self._inner.write(commits)


async def test_the_loop_fires_on_time_while_the_feed_is_stuck_and_never_a_cancelled_timer(
    tmp_path: Path, backend: Backend
) -> None:
    """``wowd run``'s slot on the embedded backend with the outbox shortcut: the feed applied
    six timers due in 600 ms, then sticks on a batch holding a cancel of one of them. At the
    due time the five others are fired (the loop does not wait for the feed); the cancelled one
    is not, and is gone once the feed applied the cancel."""
    s = settings(tmp_path).model_copy(update={"timers": settings(tmp_path).timers.model_copy(update={"batch": 100})})
    firing = replica_of(s, backend, delivery(s, backend)).firing
    assert firing.shortcut is not None
    gate: dict[str, Any] = {"hold": False, "held": anyio.Event(), "release": anyio.Event()}
    make_sink = backend.sink_factory

    def sink_factory(type_: AggregateType) -> Any:
        return HeldSink(make_sink(type_), gate)

    backend.sink_factory = sink_factory
    held = await hold(backend)
    waker = Waker()
    loop = firing.loop()
    assert isinstance(loop.strategy, OutboxRounds)
    due = int(time.time() * 1000) + 600
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await tg.start(Feeder(s, backend).run, held, waker)
            await backend.log.append_many([timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(6)])

            async def viewed(n: int) -> bool:
                return len(await backend.timer_queries.scan(limit=10)) == n

            await eventually(lambda: viewed(6), 10, "six timers in the view")
            gate["hold"] = True
            await backend.log.append_many([commit("o-0", 2, cancelled())])
            await gate["held"].wait()  # the feed read the cancel and is stuck writing it

            async def delivered() -> bool:
                return await backend.outbox.count() >= 5

            await eventually(delivered, 10, "five timers fired")
            assert int(time.time() * 1000) >= due
            assert waker.watermark is not None and waker.watermark < due
            assert await owners_fired(backend) == [f"o-{i}" for i in range(1, 6)]
            [left] = await backend.timer_queries.scan(limit=10)
            assert left.owner.id == "o-0"
            gate["hold"] = False
            gate["release"].set()
            await eventually(lambda: viewed(0), 10, "the cancel applied")
            held.request_stop()
    assert await owners_fired(backend) == [f"o-{i}" for i in range(1, 6)]
    entries = await backend.outbox.entries()
    # at the due time, not before; not a second late (0.7 s: a loaded machine's share of it)
    lags = sorted(e.created_at - due for e in entries)
    assert 0 <= lags[0] and lags[-1] <= 700, f"fired {lags} ms after the due time"
