"""A feed batch in one transaction (the embedded backend's ``FeedWriter``): the view it leaves is
the one the steps leave one by one; it is all or nothing under the slot's fence; a batch it does
not take whole is applied step by step."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from wowd.cli.backend import opened_backend
from wowd.config import WowdSettings
from wowd.daemon.feed import CONSUMER, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.model import AggregateRef, AggregateType, Commit, DomainEvent, TimerChange, TimerWrite, partition
from wowd.stores.base import Backend, FeedWriter
from wowd.stores.embedded.timers import WRITE_CHUNK

from .conftest import CONTEXT, embedded_settings, hold_slot, timer_commit

pytestmark = pytest.mark.anyio

PARTS = 4
ORDER = AggregateType(context=CONTEXT, aggregate="order")
HOUR_MS = 3_600_000


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async with opened_backend(settings(tmp_path)) as b:
        yield b


class CountingWriter:
    """The backend's feed writer, counting the batches it applied."""

    def __init__(self, inner: FeedWriter) -> None:
        self.inner = inner
        self.applied = 0

    async def apply(self, *args: Any, **kwargs: Any) -> Any:
        done = await self.inner.apply(*args, **kwargs)
        self.applied += done is not None
        return done


async def hold(b: Backend) -> HeldSlot:
    return await hold_slot(b, PARTS)


async def feed(s: WowdSettings, b: Backend) -> None:
    """The slot's feed until it reached the log's end, then stopped."""
    held = await hold(b)
    waker = Waker()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(Feeder(s, b).run, held, waker)
            while waker.watermark is None:  # the feed read to the log's end and applied it
                await waker.wait_applied(waker.applied_batches, 1.0)
            held.request_stop()
    await b.leases.release(held.lease, 0)


def commit(agg_id: str, version: int, *events: DomainEvent, deleted: bool = False) -> Commit:
    return Commit(
        ref=AggregateRef(context=CONTEXT, aggregate="order", id=agg_id), version=version,
        command_id=uuid.uuid4().hex, request_id=uuid.uuid4().hex, create_time=int(time.time() * 1000),
        events=(DomainEvent(id=uuid.uuid4().hex, name="ItemAdded", body={"n": version}), *events), deleted=deleted,
    )  # fmt: skip


def cancelled(key: str) -> DomainEvent:
    return DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": key})


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
    counting = None
    if at_once:
        assert b.feed_writer is not None
        counting = CountingWriter(b.feed_writer)
        b.feed_writer = counting
    else:
        b.feed_writer = None
    await b.log.append_many(first)
    await feed(s, b)
    # b's timer is claimed and parked (its target refused it)
    claimed = await b.timers.claim_due(
        frozenset(range(PARTS)), now, 10, owner_key="x", fence=1, claim_until=now + 30_000
    )
    assert [t.owner.id for t in claimed] == ["b"]
    assert await b.timers.settle([TimerChange.park(claimed[0], fence=1, reason="404 Not Found")]) == 1
    await b.log.append_many(second)
    await feed(s, b)
    return b, counting


async def view(b: Backend) -> tuple[Any, ...]:
    timers = sorted(
        (t.owner.id, t.key, t.version, t.status.value, t.scheduled_at, t.attempts, t.command)
        for t in await b.timers.scan(limit=100)
    )
    docs = {i: await b.sink(ORDER).documents(AggregateRef(context=CONTEXT, aggregate="order", id=i)) for i in "abc"}
    checkpoints = {p: cp.position for p, cp in (await b.log.checkpoints(CONSUMER, list(range(PARTS)))).items()}
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


async def test_a_refused_checkpoint_writes_nothing_of_the_batch(backend: Backend) -> None:
    """Another holder saved a checkpoint under a higher fence: the batch's documents, timers and
    checkpoints are all rolled back, and the caller is told (the feed then stops: LeaseLost)."""
    writer = backend.feed_writer
    assert writer is not None
    c = timer_commit("a", 1, ["k1"], due_at=int(time.time() * 1000) + HOUR_MS)
    p = partition("a", PARTS)
    sink = backend.sink(ORDER)
    await sink.prepare()
    assert await backend.log.save_checkpoints(CONSUMER, {p: {"seq": 1}}, 5)
    done = await writer.apply(
        [(sink, [c])], [TimerWrite.put(_timer(c))], CONSUMER, {p: {"seq": 2}}, 3, now=int(time.time() * 1000)
    )
    assert done is not None and not done.saved
    assert await sink.documents(c.ref) == []
    assert await backend.timers.scan(limit=10) == []
    assert (await backend.log.checkpoints(CONSUMER, [p]))[p].position == {"seq": 1}


async def test_a_record_the_sink_refuses_leaves_the_batch_to_the_steps(backend: Backend) -> None:
    """A document that cannot be encoded: the writer takes nothing, so that the sink step names
    the record and the feed quarantines it alone."""
    writer = backend.feed_writer
    assert writer is not None
    sink = backend.sink(ORDER)
    await sink.prepare()
    good = timer_commit("a", 1, [])
    bad = commit("b", 1, DomainEvent(id="e", name="Odd", body={"values": {1, 2}}))
    p = partition("a", PARTS)
    assert await writer.apply([(sink, [good, bad])], [], CONSUMER, {p: {"seq": 2}}, 1, now=0) is None
    assert await sink.documents(good.ref) == []
    assert await backend.log.checkpoints(CONSUMER, [p]) == {}


async def test_more_timer_writes_than_a_transaction_holds_go_to_the_steps(backend: Backend) -> None:
    """The timer store writes a long batch in chunks (the file's write lock is held briefly)."""
    writer = backend.feed_writer
    assert writer is not None
    c = timer_commit("a", 1, [f"k{i}" for i in range(WRITE_CHUNK + 1)], due_at=int(time.time() * 1000) + HOUR_MS)
    writes = [TimerWrite.put(_timer(c, i)) for i in range(WRITE_CHUNK + 1)]
    sink = backend.sink(ORDER)
    await sink.prepare()
    assert await writer.apply([(sink, [c])], writes, CONSUMER, {0: {"seq": 1}}, 1, now=0) is None
    assert await backend.timers.scan(limit=10) == []


def _timer(c: Commit, index: int = 0) -> Any:
    from wowd.model import timer_event_from, timer_from_event

    scheduled = [e for e in c.events if e.name == "TimerScheduled"]
    te = timer_event_from(scheduled[index], max_body_bytes=65536)
    return timer_from_event(c, te, PARTS)  # type: ignore[arg-type]
