"""A feed batch in one transaction (the embedded backend's ``FeedWriter``): the view it leaves is
the one the steps leave one by one; it is all or nothing under the slot's fence; a batch it does
not take whole is applied step by step. With the ``outbox`` gateway it fires the due one-shot
timers it puts: only those no later commit of the log can cancel, under the slot's fence and
lease, at most the timer loop's batch; a backlog's timers fire as it is fed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest

from tests.factories import CONTEXT, cancelled, commit, embedded_settings, ref, scheduled, timer_commit
from tests.helpers import hold_slot
from wowd.backends import opened_backend
from wowd.config import WowdSettings
from wowd.daemon.feed import CONSUMER, READ_AHEAD, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
    DomainEvent,
    TimerChange,
    TimerScheduled,
    TimerWrite,
    partition,
    timer_event_from,
    timer_from_event,
)
from wowd.stores.base import FEED_TRANSACTION, Backend, FeedWriter
from wowd.stores.embedded.timer_view import WRITE_CHUNK

pytestmark = pytest.mark.anyio

PARTS = 4
ORDER = AggregateType(context=CONTEXT, aggregate="order")
HOUR_MS = 3_600_000


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS)


W = TypeVar("W")


def swap_writer(b: Backend, wrap: Callable[[FeedWriter], W] | None) -> W | None:
    """Offers ``wrap`` of the backend's feed transaction instead of it (``None``: no feed
    transaction: the feed writes step by step); answers the wrapper."""
    writer = b.capability(FEED_TRANSACTION)
    assert writer is not None
    others = tuple(o for o in b.offers if o is not writer)
    wrapped = None if wrap is None else wrap(writer)
    b.offers = others if wrapped is None else (wrapped, *others)
    return wrapped


class CountingWriter:
    """The backend's feed writer, counting the batches it applied."""

    CAPABILITIES = (FEED_TRANSACTION,)

    def __init__(self, inner: FeedWriter) -> None:
        self.inner = inner
        self.applied = 0

    async def plan(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.plan(*args, **kwargs)

    async def apply(self, *args: Any, **kwargs: Any) -> Any:
        done = await self.inner.apply(*args, **kwargs)
        self.applied += done is not None
        return done


async def hold(b: Backend) -> HeldSlot:
    return await hold_slot(b, PARTS)


async def feed(s: WowdSettings, b: Backend, *, batch_size: int = 500) -> None:
    """The slot's feed (batches of ``batch_size`` commits) until it reached the log's end, then
    stopped."""
    held = await hold(b)
    waker = Waker()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(Feeder(s, b, batch_size=batch_size).run, held, waker)
            while waker.watermark is None:  # the feed read to the log's end and applied it
                await waker.wait_applied(waker.applied_batches, 1.0)
            held.request_stop()
    await b.leases.release(held.lease, 0)


def puts(*commits: Commit) -> list[TimerWrite]:
    """The puts of the commits' TimerScheduled events, in order."""
    out = []
    for c in commits:
        for e in c.events:
            te = timer_event_from(e)
            if isinstance(te, TimerScheduled):
                out.append(TimerWrite.put(timer_from_event(c, te, PARTS)))
    return out


def rounds(now: int) -> tuple[list[Commit], list[Commit]]:
    """Schedules, cancels in the same batch and in a later one, a ``cancel_all`` (a deleted
    aggregate), and a commit of an aggregate whose timer is PARKED meanwhile: two rounds."""
    first = [
        timer_commit("a", 1, ["k1", "k2", "k3"], due_at=now + HOUR_MS),
        commit("a", 2, cancelled("k3")),  # the same batch: never written live
        timer_commit("b", 1, ["k1"], due_at=now),
        timer_commit("c", 1, ["k1", "k2"], due_at=now + HOUR_MS),
    ]
    second = [
        commit("a", 3, cancelled("k1")),
        commit("b", 2),  # resumes b's parked timer
        commit("c", 2, deleted=True),  # cancels every timer of c
    ]
    return first, second


async def scenario(
    tmp_path: Path, now: int, first: list[Commit], second: list[Commit], *, at_once: bool
) -> tuple[Backend, CountingWriter | None]:
    """The two rounds fed, b's timer parked between them."""
    from wowd.stores.embedded import open_embedded

    s = settings(tmp_path)
    b = await open_embedded(s)
    counting = swap_writer(b, CountingWriter if at_once else None)
    await b.log.append_many(first)
    await feed(s, b)
    # b's timer is claimed and parked (its target refused it)
    claimed = await b.firing.claim_due(
        frozenset(range(PARTS)), now, 10, owner_key="x", fence=1, claim_until=now + 30_000
    )
    assert [t.owner.id for t in claimed] == ["b"]
    assert await b.firing.settle([TimerChange.park(claimed[0], fence=1, reason="404 Not Found")]) == 1
    await b.log.append_many(second)
    await feed(s, b)
    return b, counting


async def view(b: Backend) -> tuple[Any, ...]:
    timers = sorted(
        (t.owner.id, t.key, t.version, t.status.value, t.scheduled_at, t.attempts, t.command)
        for t in await b.timer_queries.scan(limit=100)
    )
    docs = {i: await b.sink(ORDER).documents(AggregateRef(context=CONTEXT, aggregate="order", id=i)) for i in "abc"}
    checkpoints = {p: cp.position for p, cp in (await b.checkpoints.read(CONSUMER, list(range(PARTS)))).items()}
    return timers, docs, checkpoints


async def test_a_batch_in_one_transaction_leaves_the_view_the_steps_leave(tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    first, second = rounds(now)
    one, counting = await scenario(tmp_path / "one", now, first, second, at_once=True)
    steps, _ = await scenario(tmp_path / "steps", now, first, second, at_once=False)
    try:
        assert counting is not None and counting.applied >= 2  # both rounds took the one-transaction path
        timers, docs, checkpoints = await view(one)
        assert (timers, docs, checkpoints) == await view(steps)
        assert [(o, k, status) for o, k, _v, status, *_ in timers] == [("a", "k2", "PENDING"), ("b", "k1", "PENDING")]
        assert [len(docs[i]) for i in "abc"] == [3, 2, 2]
        assert sum(int(p["seq"]) for p in checkpoints.values()) > 0
    finally:
        await one.close()
        await steps.close()


def rewriting(now: int) -> list[Commit]:
    """Commits writing one timer key twice in their events, in one order or the other."""
    return [
        timer_commit("x", 1, ["k"], due_at=now + HOUR_MS),
        # cancelled and scheduled again in one command handler: the new timer is live
        commit("x", 2, cancelled("k"), scheduled("k", now + 2 * HOUR_MS, target=ref("x"))),
        # scheduled twice in one commit: the second is live
        commit(
            "y",
            1,
            scheduled("k", now + HOUR_MS, target=ref("y"), body={"n": "A"}),
            scheduled("k", now + 2 * HOUR_MS, target=ref("y"), body={"n": "B"}),
        ),
        # scheduled, then cancelled in one commit: nothing is live
        commit("w", 1, scheduled("k", now + HOUR_MS, target=ref("w")), cancelled("k")),
        # scheduled by the commit that deletes the aggregate: cancelled with every timer of it
        timer_commit("z", 1, ["k"], due_at=now + HOUR_MS),
        commit("z", 2, scheduled("j", now + HOUR_MS, target=ref("z")), deleted=True),
    ]


@asynccontextmanager
async def writing(s: WowdSettings, at_once: bool) -> AsyncIterator[tuple[Backend, CountingWriter | None]]:
    """The backend of ``s``, its feed batches written in one transaction each (counted) when
    ``at_once``, else step by step."""
    async with opened_backend(s) as b:
        counting = swap_writer(b, CountingWriter if at_once else None)
        yield b, counting


async def test_the_timer_events_of_a_commit_are_applied_in_order(tmp_path: Path) -> None:
    """The last timer event of a key in a commit wins, whether the batch is written in one
    transaction or step by step, and wherever the batches are cut."""
    now = int(time.time() * 1000)
    commits = rewriting(now)
    views = []
    for name, at_once, batch_size in (("one", True, 500), ("steps", False, 500), ("each", True, 1)):
        s = settings(tmp_path / name)
        async with writing(s, at_once) as (b, counting):
            await b.log.append_many(commits)
            await feed(s, b, batch_size=batch_size)
            assert counting is None or counting.applied >= 1
            views.append(
                sorted(
                    (t.owner.id, t.key, t.version, t.status.value, t.due_at, t.command.body.get("n"))
                    for t in await b.timer_queries.scan(limit=100)
                )
            )
    assert views[0] == [
        ("x", "k", 2, "PENDING", now + 2 * HOUR_MS, None),
        ("y", "k", 1, "PENDING", now + 2 * HOUR_MS, "B"),
    ]
    assert views[1] == views[0] and views[2] == views[0]


async def test_attributes_changed_across_batches_read_ahead_are_stamped_as_the_steps_stamp_them(
    tmp_path: Path,
) -> None:
    """Batches of two commits, each made ready while the one before is written: an aggregate's
    access attributes changing from batch to batch are stamped over its earlier documents as the
    steps one by one stamp them (what the sink remembers is read when a batch is written)."""
    # back and forth: a stale memory of an earlier version would take u1 again for no change
    owners = [{"owner_id": f"u{v % 2}", "space_id": "", "tags": []} for v in range(1, 24)]
    later = int(time.time() * 1000) + HOUR_MS
    commits = [
        replace(timer_commit(i, v, [f"k{v}"], due_at=later) if v % 2 else commit(i, v), access=a, access_version=n)
        for v, (a, n) in enumerate(zip(owners, range(23), strict=True), 1)
        for i in "ab"
    ]
    seen = []
    for at_once in (True, False):
        s = settings(tmp_path / str(at_once))
        async with writing(s, at_once) as (b, counting):
            await b.log.append_many(commits)
            await feed(s, b, batch_size=2)
            if counting is not None:
                assert counting.applied >= 23
            docs = [await b.sink(ORDER).documents(AggregateRef(context=CONTEXT, aggregate="order", id=i)) for i in "ab"]
            seen.append([[(d["version"], d["owner_id"], d["access_version"]) for d in ds] for ds in docs])
    assert seen[0] == seen[1]
    assert seen[0] == [[(v, "u1", 22) for v in range(1, 24)]] * 2


async def test_a_refused_checkpoint_writes_nothing_of_the_batch(backend: Backend) -> None:
    """Another holder saved a checkpoint under a higher fence: the batch's documents, timers and
    checkpoints are all rolled back, and the caller is told (the feed then stops: LeaseLost)."""
    writer = backend.capability(FEED_TRANSACTION)
    assert writer is not None
    c = timer_commit("a", 1, ["k1"], due_at=int(time.time() * 1000) + HOUR_MS)
    p = partition("a", PARTS)
    sink = backend.sink(ORDER)
    await sink.prepare()
    assert await backend.checkpoints.save_all(CONSUMER, {p: {"seq": 1}}, 5)
    done = await writer.apply([(sink, [c])], puts(c), CONSUMER, {p: {"seq": 2}}, 3, now=int(time.time() * 1000))
    assert done is not None and not done.saved
    assert await sink.documents(c.ref) == []
    assert await backend.timer_queries.scan(limit=10) == []
    assert (await backend.checkpoints.read(CONSUMER, [p]))[p].position == {"seq": 1}


async def test_a_record_the_sink_refuses_leaves_the_batch_to_the_steps(backend: Backend) -> None:
    """A document that cannot be encoded: the writer takes nothing, so that the sink step names
    the record and the feed quarantines it alone."""
    writer = backend.capability(FEED_TRANSACTION)
    assert writer is not None
    sink = backend.sink(ORDER)
    await sink.prepare()
    good = timer_commit("a", 1, [])
    bad = commit("b", 1, DomainEvent(id="e", name="Odd", body={"values": {1, 2}}))
    p = partition("a", PARTS)
    assert await writer.apply([(sink, [good, bad])], [], CONSUMER, {p: {"seq": 2}}, 1, now=0) is None
    assert await sink.documents(good.ref) == []
    assert await backend.checkpoints.read(CONSUMER, [p]) == {}


async def test_more_timer_writes_than_a_transaction_holds_go_to_the_steps(backend: Backend) -> None:
    """The timer store writes a long batch in chunks (the file's write lock is held briefly)."""
    writer = backend.capability(FEED_TRANSACTION)
    assert writer is not None
    c = timer_commit("a", 1, [f"k{i}" for i in range(WRITE_CHUNK + 1)], due_at=int(time.time() * 1000) + HOUR_MS)
    writes = puts(c)
    assert len(writes) == WRITE_CHUNK + 1
    sink = backend.sink(ORDER)
    await sink.prepare()
    assert await writer.apply([(sink, [c])], writes, CONSUMER, {0: {"seq": 1}}, 1, now=0) is None
    assert await backend.timer_queries.scan(limit=10) == []


class StalledWriter:
    """The backend's feed writer, its transactions held until ``go`` is set (another writer
    holding the file's write lock)."""

    CAPABILITIES = (FEED_TRANSACTION,)

    def __init__(self, inner: FeedWriter) -> None:
        self.inner = inner
        self.waiting = anyio.Event()
        self.go = anyio.Event()

    async def plan(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.plan(*args, **kwargs)

    async def apply(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting.set()
        await self.go.wait()
        return await self.inner.apply(*args, **kwargs)


async def test_a_batch_waiting_for_its_transaction_does_not_stop_the_reads_of_the_log_head(
    tmp_path: Path, backend: Backend
) -> None:
    """While a batch waits for its transaction, the feed goes on reading the log's head: every
    read that began is registered (the timer loop delivers what is due once a read began at its
    due time), however many more than the batches it reads ahead."""
    s = settings(tmp_path)
    stalled = swap_writer(backend, StalledWriter)
    assert stalled is not None
    held = await hold(backend)
    waker = Waker()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(Feeder(s, backend).run, held, waker)
            await backend.log.append_many([commit("a", 1)])
            await stalled.waiting.wait()
            for _ in range(READ_AHEAD + 4):
                assert waker.read_mark is not None
                at = waker.read_mark + 1  # a read that began after the last one registered
                backend.log.nudge()
                assert await waker.read_past(at, 5.0)
            stalled.go.set()
            while waker.watermark is None:
                await waker.wait_applied(waker.applied_batches, 1.0)
            held.request_stop()
    await backend.leases.release(held.lease, 0)
