"""The timer view follows the log (docs/concepts.md): the feed and the timer loop of a slot
together, in-process on the embedded backend. A cancel appended before a timer's due time is
never delivered whatever the feed's lag; a takeover re-delivers nothing already fired and ends
the previous holder's claims at once; a replay from no checkpoint changes nothing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest

from tests.factories import CONTEXT, cancelled, commit, embedded_settings, eventually, ref, scheduled, timer_commit
from tests.helpers import hold_slot, replica_firing, timer_loop
from wowd.config import TimerSettings, WowdSettings
from wowd.daemon.feed import CONSUMER, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.delivery import OutboxGateway, Outcome
from wowd.model import Commit, Timer, TimerStatus, deterministic_timer_id, request_id_for
from wowd.stores.base import Backend

pytestmark = pytest.mark.anyio

PARTS = 4


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(tmp_path, PARTS)


@pytest.fixture(params=["steps", "outbox shortcut"])
async def backend(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The embedded backend; ``run_slot`` fires with the outbox gateway's claim, deliver and
    settle steps, or with the outbox shortcut (as ``wowd run`` does)."""
    from wowd.stores.embedded import open_embedded

    b = await open_embedded(settings(tmp_path))
    if request.param == "steps":
        b.offers = ()
    try:
        yield b
    finally:
        await b.close()


async def hold(b: Backend, key: str) -> HeldSlot:
    """The slot, taken by ``key`` (after the previous holder's lease was released)."""
    return await hold_slot(b, PARTS, key)


async def run_slot(
    tmp_path: Path, backend: Backend, held: HeldSlot, *, until_outbox: int, feed_batch: int = 500
) -> None:
    """Runs the slot's feed and timer loop until the outbox holds ``until_outbox`` entries and
    every checkpoint is at the log's end, then stops them."""
    s = settings(tmp_path)
    waker = Waker()
    loop = replica_firing(s.model_copy(update={"timers": TimerSettings(batch=100)}), backend).loop()
    feeder = Feeder(s, backend, batch_size=feed_batch)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await tg.start(feeder.run, held, waker)

            async def done() -> bool:
                return await backend.outbox.count() >= until_outbox and waker.watermark is not None

            await eventually(done, 10, f"{until_outbox} outbox entries and the feed at the log's end", every=0.01)
            held.request_stop()


async def feed_until(tmp_path: Path, backend: Backend, held: HeldSlot, n: int) -> None:
    """Runs the slot's feed alone until the timer view holds ``n`` timers, then stops it."""

    async def fed() -> bool:
        return len(await backend.timer_queries.scan(limit=10)) >= n

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(Feeder(settings(tmp_path), backend).run, held, Waker())
            await eventually(fed, 10, f"{n} timers fed", every=0.01)
            held.request_stop()


async def test_a_cancel_appended_before_the_due_time_is_never_delivered_whatever_the_feeds_lag(
    tmp_path: Path, backend: Backend
) -> None:
    """Appended with no replica running (the feed starts after every due time): puts and their
    cancels land in different feed batches, and none of the cancelled timers is delivered."""
    due = int(time.time() * 1000)
    commits: list[Commit] = []
    for i in range(20):
        commits.append(timer_commit(f"o-{i}", 1, ["k"], due_at=due))
        if i % 2 == 0:
            commits.append(commit(f"o-{i}", 2, cancelled()))
    await backend.log.append_many(commits)
    held = await hold(backend, "a")
    await run_slot(tmp_path, backend, held, until_outbox=10, feed_batch=3)
    delivered = {e.target.id for e in await backend.outbox.entries()}
    assert delivered == {f"o-{i}" for i in range(1, 20, 2)}


async def test_a_timer_cancelled_and_scheduled_again_by_one_commit_is_delivered(
    tmp_path: Path, backend: Backend
) -> None:
    """A commit that cancels a timer and schedules it again (one command handler), and one that
    schedules a key twice, the second time due: fed a commit a batch, the timer each commit left
    is delivered, once."""
    due = int(time.time() * 1000)
    later = due + 3_600_000
    x2 = commit("x", 2, cancelled("k"), scheduled("k", due, target=ref("x")))
    y1 = commit(
        "y",
        1,
        scheduled("k", later, target=ref("y"), body={"n": "A"}),
        scheduled("k", due, target=ref("y"), body={"n": "B"}),
    )
    await backend.log.append_many([timer_commit("x", 1, ["k"], due_at=later), x2, y1])
    held = await hold(backend, "a")
    await run_slot(tmp_path, backend, held, until_outbox=2, feed_batch=1)
    entries = await backend.outbox.entries()
    assert sorted((e.target.id, e.request_id) for e in entries) == [
        (c.ref.id, request_id_for(deterministic_timer_id(c.ref, "k", c.version), due)) for c in (x2, y1)
    ]
    assert await backend.timer_queries.scan(limit=10) == []


async def test_a_takeover_from_no_checkpoint_re_delivers_nothing_already_fired(
    tmp_path: Path, backend: Backend
) -> None:
    due = int(time.time() * 1000)
    await backend.log.append_many([timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(30)])
    first = await hold(backend, "a")
    await run_slot(tmp_path, backend, first, until_outbox=30)
    assert await backend.leases.release(first.lease, 0)
    # the successor's feed starts from the start of the log (as after a checkpoint lost)
    second = await hold(backend, "b")
    assert second.fence > first.fence
    for p in range(PARTS):
        assert await backend.checkpoints.save(CONSUMER, p, {"seq": 0}, second.fence)
    await backend.log.append_many([timer_commit("late", 1, ["k"], due_at=due)])
    await run_slot(tmp_path, backend, second, until_outbox=31)
    entries = await backend.outbox.entries()
    assert len(entries) == 31 and len({e.request_id for e in entries}) == 31
    assert await backend.timer_queries.scan(limit=100) == []


async def test_a_takeover_ends_the_dead_holders_claims_at_once(tmp_path: Path, backend: Backend) -> None:
    """The dead replica claimed (claim_ttl 30 s) and never delivered: the successor fires them
    within its first rounds, not after the claims expire."""
    due = int(time.time() * 1000)
    await backend.log.append_many([timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(5)])
    first = await hold(backend, "a")
    await feed_until(tmp_path, backend, first, 5)
    claimed = await backend.firing.claim_due(
        frozenset(range(PARTS)), due, 10, owner_key="a", fence=first.fence, claim_until=due + 30_000
    )
    assert len(claimed) == 5  # the dead replica's claims, live for 30 s
    await backend.leases.release(first.lease, 0)
    second = await hold(backend, "b")
    started = time.monotonic()
    await run_slot(tmp_path, backend, second, until_outbox=5)
    assert time.monotonic() - started < 5
    assert {e.fence for e in await backend.outbox.entries()} == {second.fence}


async def test_an_undecodable_timer_fails_alone_and_its_batch_mates_are_delivered(
    tmp_path: Path, backend: Backend
) -> None:
    from wowd.stores.embedded.sqlite import sqlite3

    due = int(time.time() * 1000)
    commits = [timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(4)]
    every_minute = {"type": "cron", "expression": "* * * * *", "zone": "UTC"}
    ev = scheduled("k", due, target=ref("bad"), command={"name": "go"}, rule=every_minute)
    await backend.log.append_many([*commits, commit("bad", 1, ev, create_time=due)])
    held = await hold(backend, "a")
    await feed_until(tmp_path, backend, held, 5)
    # the zone disappears from the time zone database the replica runs with
    conn = sqlite3.connect(tmp_path / "wowd.db")
    with conn:
        conn.execute(
            f"UPDATE wow_timer__{CONTEXT} SET rule = ? WHERE owner_id = 'bad'",
            ('{"expression":"* * * * *","type":"cron","zone":"Europe/Gone"}',),
        )
    conn.close()
    await run_slot(tmp_path, backend, await hold(backend, "a"), until_outbox=4)
    assert {e.target.id for e in await backend.outbox.entries()} == {f"o-{i}" for i in range(4)}
    [failed] = await backend.timer_queries.scan(status=TimerStatus.FAILED, limit=10)
    assert failed.owner.id == "bad"
    assert failed.last_error is not None and "undecodable" in failed.last_error and "Europe/Gone" in failed.last_error


async def test_a_lapsed_lease_still_settles_what_was_delivered_and_its_holding_ends_its_own_claims(
    tmp_path: Path, backend: Backend
) -> None:
    """The lease lapses while a round delivers (a slow store under load): the round's outcomes
    are still settled (guarded by each timer's revision), so a holder that takes the slot back
    with the same fence re-delivers none of them, and claims of the same fence left over are
    due again at once, not after ``claim_ttl_s``."""
    due = int(time.time() * 1000)
    await backend.log.append_many([timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(6)])
    held = await hold(backend, "a")

    class LapsingOutbox(OutboxGateway):
        async def send_batch(self, timers: Sequence[Timer]) -> Outcome:
            held.valid_until = anyio.current_time() - 1  # the lease lapses while delivering
            outcome = await super().send_batch(timers)
            held.request_stop()  # (the keeper stops a lapsed slot's work)
            return outcome

    waker = Waker()
    loop = timer_loop(backend.firing, LapsingOutbox(backend.outbox), TimerSettings(batch=100), nudge=backend.log.nudge)
    feeder = Feeder(settings(tmp_path), backend)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await tg.start(feeder.run, held, waker)
    assert await backend.outbox.count() == 6
    assert await backend.timer_queries.scan(limit=10) == []  # settled: fired one-shots are done
    # a claim of this fence left over by an earlier holding: fed, then claimed, never delivered
    await backend.log.append_many([timer_commit("left", 1, ["k"], due_at=due)])
    again = await hold(backend, "a")
    assert again.fence == held.fence
    await feed_until(tmp_path, backend, again, 1)
    claimed = await backend.firing.claim_due(
        frozenset(range(PARTS)), due + 1, 10, owner_key="a", fence=again.fence, claim_until=due + 30_000
    )
    assert [t.owner.id for t in claimed] == ["left"]
    started = time.monotonic()
    await run_slot(tmp_path, backend, await hold(backend, "a"), until_outbox=7)
    assert time.monotonic() - started < 5
    entries = await backend.outbox.entries()
    assert len(entries) == 7 and len({e.request_id for e in entries}) == 7


async def test_a_cancel_appended_after_the_claim_and_before_the_due_time_wins(tmp_path: Path, backend: Backend) -> None:
    """The loop claims timers up to its lookahead ahead of their due time; cancels and puts of a
    later version appended after the claim (before the due time) still win: the claimed copies
    are dropped, the cancelled timers never delivered, the moved ones delivered at their new
    time."""
    s = settings(tmp_path)
    held = await hold(backend, "a")
    waker = Waker()
    loop = timer_loop(
        backend.firing, OutboxGateway(backend.outbox), TimerSettings(batch=100, lookahead_ms=2_000),
        nudge=backend.log.nudge,
    )  # fmt: skip
    feeder = Feeder(s, backend)
    due = int(time.time() * 1000) + 600
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await tg.start(feeder.run, held, waker)
            await backend.log.append_many([timer_commit(f"o-{i}", 1, ["k"], due_at=due) for i in range(12)])

            async def claimed() -> bool:
                return len(await backend.timer_queries.scan(status=TimerStatus.FIRING, limit=20)) >= 12

            # every one claimed, about 600 ms ahead of its due time
            await eventually(claimed, 10, "every timer claimed", every=0.01)
            assert int(time.time() * 1000) < due
            cancels = [commit(f"o-{i}", 2, cancelled()) for i in range(0, 12, 3)]
            moves = [timer_commit(f"o-{i}", 2, ["k"], due_at=due + 300) for i in range(1, 12, 3)]
            await backend.log.append_many([*cancels, *moves])

            async def delivered() -> bool:
                return await backend.outbox.count() >= 8

            await eventually(delivered, 10, "eight deliveries", every=0.01)
            held.request_stop()
    entries = await backend.outbox.entries()
    assert sorted(e.target.id for e in entries) == sorted(f"o-{i}" for i in range(12) if i % 3)
    moved = {f"o-{i}" for i in range(1, 12, 3)}
    assert all(e.created_at >= due + 300 for e in entries if e.target.id in moved)
    assert not await backend.timer_queries.scan(status=TimerStatus.FIRING, limit=20)
