"""Each view follows the log on its own (docs/concepts.md, "Views"): a failing event index or a
raising reducer falls behind from its own checkpoints while the timer view keeps feeding and
timers keep firing on time; it catches up once its store takes its writes, nothing lost or
written twice. An upgraded store carries its one checkpoint over to every view; a view whose
checkpoints are reset is replayed alone."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import CONTEXT, Recorder, embedded_settings, eventually, timer_commit
from tests.helpers import RefusingSink, hold_slot, refusing, timer_loop
from wowd import metrics
from wowd.backends import opened_backend
from wowd.config import WowdSettings
from wowd.daemon import feed
from wowd.daemon.feed import CONSUMER, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.model import AggregateType, Commit, TimerWrite, partition
from wowd.retry import Backoff
from wowd.stores.base import Backend
from wowd.views import FROM_START, reset_view, view_named, views_status

pytestmark = pytest.mark.anyio

PARTS = 4
TYPE = AggregateType(context=CONTEXT, aggregate="order")
INDEX_CONSUMER = view_named("index").consumer


class Reducer:
    """Counts items; raises while ``broken``."""

    state_revision = 1
    broken = False

    def fold(self, state: dict[str, Any], event: Any) -> dict[str, Any]:
        if Reducer.broken:
            raise RuntimeError("reducer bug")
        return {"n": state.get("n", 0) + 1}


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS)


async def index_count(backend: Backend, commits: list[Commit]) -> dict[str, int]:
    sink = backend.sink(TYPE)
    return {c.ref.id: len(await sink.documents(c.ref)) for c in commits}  # type: ignore[attr-defined]


async def test_timers_fire_on_time_while_the_index_refuses_every_write(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feed, "STALL_BACKOFF", Backoff(0.1, 0.2, jitter=True))  # tried again soon after the repair
    sink = refusing(backend, broken=True)
    held = await hold_slot(backend, PARTS, "me")
    feeder = Feeder(settings(tmp_path), backend)
    gateway = Recorder()
    loop = timer_loop(backend.firing, gateway)
    waker = Waker()
    start = int(time.time() * 1000) + 500
    # 100 timers due over 0.7 s, each in its own commit, appended as they come due
    commits = [timer_commit(f"o-{i}", 1, ["k"], due_at=start + i * 7) for i in range(100)]
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await tg.start(feeder.run, held, waker)
            for i in range(0, len(commits), 20):
                await backend.log.append_many(commits[i : i + 20])
                await anyio.sleep(0.1)  # a producer's pace, not synchronisation

            async def all_sent() -> bool:
                return len({t.owner.id for t in gateway.sent}) == len(commits)

            await eventually(all_sent, 10, "every timer delivered")
            # the index is stalled, the timer view is not: the replica stays ready
            assert feeder.stalled is None
            assert "index" in feeder.view_stalls() and "StorageError" in feeder.view_stalls()["index"]
            assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 1
            assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="timers")._value.get() == 0
            # the index's checkpoints stay where it started (the log's start: none had been saved)
            cps = await backend.checkpoints.read(INDEX_CONSUMER, list(range(PARTS)))
            assert len(cps) == PARTS and all(cp.position == FROM_START for cp in cps.values())
            sink.broken = False  # the cluster is back

            async def joined() -> bool:
                return feeder.following() == ["timers", "index"]

            await eventually(joined, 10, "the index caught up and joined the shared read")
            held.request_stop()
    first = {t.owner.id: at for t, at in reversed(gateway.fired)}
    lags = sorted((first[c.ref.id] - c.create_time) / 1000 for c in commits)
    # on time: half of them within 0.3 s of their due time, none a second late (a loaded machine
    # delays some; a wait behind the index's retries would delay them all)
    assert lags[len(lags) // 2] < 0.3 and lags[-1] < 1.0, (
        f"fire lag p50 {lags[len(lags) // 2]:.3f} s, p100 {lags[-1]:.3f} s with the index down"
    )
    assert set((await index_count(backend, commits)).values()) == {1}  # each commit once
    assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 0


async def test_a_raising_reducer_holds_back_its_snapshots_only(tmp_path: Path) -> None:
    s = embedded_settings(tmp_path, PARTS, reducers={"order": "tests.daemon.test_views:Reducer"})
    Reducer.broken = True
    async with opened_backend(s) as backend:
        commits = [timer_commit(f"o-{i}", v, [f"k{v}"], due_at=10**13) for i in range(5) for v in (1, 2)]
        await backend.log.append_many(commits)
        held = await hold_slot(backend, PARTS, "me")
        feeder = Feeder(s, backend, reducers={"order": Reducer()})
        waker = Waker()
        snap = "snapshots.order"
        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, waker)

                async def stalled() -> bool:
                    return snap in feeder.view_stalls()

                await eventually(stalled, 10, "the snapshot view stalled")
                assert "reducer bug" in feeder.view_stalls()[snap] and feeder.stalled is None
                # the timer view and the index fed everything meanwhile
                assert len(await backend.timer_queries.scan(limit=50)) == 10
                assert set((await index_count(backend, commits)).values()) == {2}
                assert await backend.snapshots.load(commits[0].ref) is None
                Reducer.broken = False  # the reducer is fixed

                async def folded() -> bool:
                    return snap not in feeder.view_stalls() and feeder.following() == ["timers", "index", snap]

                await eventually(folded, 10, "the snapshot view caught up")
                held.request_stop()
        for c in commits[::2]:
            record = await backend.snapshots.load(c.ref)
            assert record is not None and record.version == 2 and record.state == {"n": 4}
        assert await backend.quarantine.items() == []


async def upgraded(backend: Backend) -> tuple[list[Commit], HeldSlot]:
    """The store as an earlier version left it: four commits fed and one checkpoint, ``wowd``'s,
    at the log's head; answers those commits and the slot, held."""
    old = [timer_commit(f"old-{i}", 1, [], due_at=10**13) for i in range(4)]
    await backend.log.append_many(old)
    held = await hold_slot(backend, PARTS, "me")
    head = {}
    async for batch in backend.log.read(dict.fromkeys(range(PARTS)), follow=False):
        head.update(batch.positions)
    assert await backend.checkpoints.save_all(CONSUMER, head, held.fence)
    return old, held


async def test_an_upgraded_store_carries_its_checkpoint_over_to_every_view(tmp_path: Path, backend: Backend) -> None:
    """A store written before views had checkpoints of their own has one, ``wowd``'s: every view
    starts there (nothing re-indexed), and saves its own from the next batch on."""
    old, held = await upgraded(backend)
    new = timer_commit("new-1", 1, [], due_at=10**13)
    await backend.log.append(new)
    feeder = Feeder(settings(tmp_path), backend)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, Waker())
            assert feeder.following() == ["timers", "index"]

            async def indexed() -> bool:
                return (await index_count(backend, [new]))[new.ref.id] == 1

            await eventually(indexed, 10, "the new commit indexed")
            held.request_stop()
    assert set((await index_count(backend, old)).values()) == {0}  # not replayed
    p = partition(new.ref.id, PARTS)
    assert p in await backend.checkpoints.read(INDEX_CONSUMER, [p])


class CountingSink(RefusingSink):
    """Counts the commits written through it."""

    written = 0

    async def write(self, records: Sequence[Commit]) -> None:
        await super().write(records)
        CountingSink.written += len(records)


async def test_a_reset_view_is_replayed_alone(tmp_path: Path, backend: Backend) -> None:
    commits = [timer_commit(f"o-{i}", 1, ["k"], due_at=10**13) for i in range(6)]
    await backend.log.append_many(commits)
    first = await hold_slot(backend, PARTS, "me")
    parts = list(range(PARTS))

    async def feed_to_head() -> None:
        held = dataclasses.replace(first, stop_event=anyio.Event(), _listeners=[])
        feeder = Feeder(settings(tmp_path), backend)
        waker = Waker()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, waker)

                async def done() -> bool:
                    cps = await backend.checkpoints.read(INDEX_CONSUMER, parts)
                    at_head = len(cps) == len({c.partition(PARTS) for c in commits})
                    return waker.watermark is not None and at_head and all(cp.position for cp in cps.values())

                await eventually(done, 10, "every view at the log's head")
                held.request_stop()

    await feed_to_head()
    # one timer settled away (as if it fired): a replay of the timer view would put it back
    gone = commits[0]
    await backend.timers.write([TimerWrite.cancel(gone.ref, "k", 2)])
    assert await backend.timer_queries.find(gone.ref, "k") is None
    assert await reset_view(backend.checkpoints, view_named("index"), parts, first.fence)
    cps = await backend.checkpoints.read(INDEX_CONSUMER, parts)
    assert len(cps) == PARTS and all(cp.position == FROM_START for cp in cps.values())
    # what `wowd status` reports: the index behind the timer view where the log has commits
    fed = sorted({c.partition(PARTS) for c in commits})
    status = {
        v["view"]: v["partitions_behind"] for v in await views_status(settings(tmp_path), backend.checkpoints, ())
    }
    assert status == {"timers": [], "index": fed}
    assert backend.sink_factory is not None
    counting = CountingSink(backend.sink_factory(TYPE))
    backend.sink_factory = lambda _type: counting  # type: ignore[assignment,return-value]
    backend._sinks.clear()
    await feed_to_head()
    assert CountingSink.written == len(commits)  # the index replayed from the first commit ...
    assert set((await index_count(backend, commits)).values()) == {1}  # ... each commit still once
    assert await backend.timer_queries.find(gone.ref, "k") is None  # the timer view was not replayed


async def test_a_view_behind_since_an_upgrade_keeps_its_place_across_restarts(tmp_path: Path, backend: Backend) -> None:
    """Upgraded (only the ``wowd`` checkpoint), the index down from the first batch, the replica
    restarted while the timer view moved on: the index still starts where it fell behind, so
    every commit since reaches it once the cluster is back."""
    old, first = await upgraded(backend)
    sink = refusing(backend, broken=True)
    new = [timer_commit(f"new-{i}", 1, ["k"], due_at=10**13) for i in range(8)]

    async def run_until(check: Callable[[Feeder], Awaitable[bool]], what: str) -> None:
        held = dataclasses.replace(first, stop_event=anyio.Event(), _listeners=[])
        feeder = Feeder(settings(tmp_path), backend)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, Waker())
                await eventually(lambda: check(feeder), 10, what)
                held.request_stop()

    async def timers_fed(count: int) -> Callable[[Feeder], Awaitable[bool]]:
        async def check(_feeder: Feeder) -> bool:
            return len(await backend.timer_queries.scan(limit=50)) == count

        return check

    await backend.log.append_many(new[:4])
    await run_until(await timers_fed(4), "the timer view fed the first commits, the index down")
    await backend.log.append_many(new[4:])
    await run_until(await timers_fed(8), "the timer view fed the rest after a restart, the index down")
    sink.broken = False

    async def joined(feeder: Feeder) -> bool:
        return feeder.following() == ["timers", "index"]

    await run_until(joined, "the index caught up")
    assert set((await index_count(backend, new)).values()) == {1}  # none skipped, none twice
    assert set((await index_count(backend, old)).values()) == {0}  # carried over: not re-indexed
