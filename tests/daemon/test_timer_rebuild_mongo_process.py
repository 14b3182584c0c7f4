"""``wowd timers rebuild`` on MongoDB (the simulator of ``tests/mongosim``) while a replica runs:
the replica releases its slot for the swap and takes it back, pending timers fire once, nothing
that fired or was cancelled fires again, PARKED and FAILED come back from the old view, a dropped
view is rebuilt from the log; a rebuild killed leaves the live view as it was; a rebuild while
commits keep coming leaves the view following the log."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from pymongo import AsyncMongoClient

from tests.daemon.timer_rebuilds import assert_parked_and_failed_kept, outbox_timer_ids, schedule_five_kinds, summary
from tests.factories import CONTEXT, cancelled, commit, eventually, timer_commit
from tests.processes import Replica, base_env, rebuild_killed_partway, run_wowd
from wowd.config import WowdSettings
from wowd.model import TimerStatus
from wowd.stores.base import Backend
from wowd.stores.mongo.schema import mongo_rebuild_state
from wowd.stores.mongo.timer_rebuild import BATCH

pytestmark = [pytest.mark.anyio, pytest.mark.process]

DAY_MS = 86_400_000
N = 250
"""Timers scheduled: a fifth each fired, cancelled, parked, failed and pending at the rebuild
(fewer than on the embedded file: the simulator evaluates every query by a scan), enough for
more than one batch of the carry-over."""
N_DROPPED = 100
"""Timers scheduled before the view is dropped (nothing to carry over: one batch of each)."""
DATABASE = "rebuild"
COLLECTION = f"wow_timer__{CONTEXT}__order"


@pytest.fixture
def sim_uri() -> Iterator[str]:
    from tests.mongosim import serving

    with serving() as server:
        yield server.uri


@pytest.fixture
def env(db: Path, sim_uri: str) -> dict[str, str]:
    return base_env(
        db,
        WOWD_BACKEND="mongo",
        WOWD_MONGODB__URI=sim_uri,
        WOWD_MONGODB__DATABASE=DATABASE,
        WOWD_SINK="none",
        WOWD_LEASE__LIMIT=1,
        # a renew every 1/3 s: the replica sees the rebuild's hold of its slot soon
        WOWD_LEASE__TTL_S=1,
        WOWD_LEASE__TOLERANCE_S=0.25,
    )


@pytest.fixture
async def mongo(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Backend]:
    from wowd.stores.mongo import open_mongo

    for k, v in env.items():
        if k.startswith("WOWD_"):
            monkeypatch.setenv(k, v)
    backend = await open_mongo(WowdSettings())
    try:
        yield backend
    finally:
        await backend.close()


async def _docs(uri: str, collection: str = COLLECTION) -> list[dict[str, Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri)
    try:
        docs = await client[DATABASE][collection].find({}, {"_id": 0}).to_list(None)
        return sorted(docs, key=lambda d: (d["partition"], d["owner"]["id"], d["key"]))
    finally:
        await client.close()


async def _drop(uri: str) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri)
    try:
        await client[DATABASE].drop_collection(COLLECTION)
    finally:
        await client.close()


def _slot_given_back_within(log: str) -> float:
    """Seconds between the replica's release of its slot for the hold and its next acquire."""
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    held = next(i for i, x in enumerate(lines) if "is held by timer view rebuild" in x["msg"])
    released = next(x for x in lines[held:] if x["msg"].startswith("released slot"))
    acquired = next(x for x in lines[held:] if x["msg"].startswith("acquired slot"))
    ts = [datetime.fromisoformat(x["ts"]).timestamp() for x in (released, acquired)]
    return ts[1] - ts[0]


async def _forget_outbox_entries_but(uri: str, kept: set[str]) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri)
    try:
        await client[DATABASE][f"wow_outbox__{CONTEXT}"].delete_many({"timer_id": {"$nin": sorted(kept)}})
    finally:
        await client.close()


async def _fired_total(r: Replica) -> float:
    text = (await r.get("/metrics")).text
    return sum(float(m) for m in re.findall(r"^wowd_timers_fired_total\{[^}]*\} (\S+)$", text, re.M))


async def _fired_counted(r: Replica, n: int) -> None:
    """The replica's ``wowd_timers_fired_total`` reaches ``n`` and is ``n``: a timer is counted
    once its settle is written, a moment after its outbox entry."""

    async def reached() -> bool:
        return await _fired_total(r) >= n

    await eventually(reached, 5, f"wowd_timers_fired_total at {n}")
    assert await _fired_total(r) == n


async def test_rebuild_while_a_replica_runs_pauses_it_briefly_and_fires_pending_once(
    spawn: Callable[..., Replica], env: dict[str, str], mongo: Backend
) -> None:
    a = spawn("a", env)
    await a.wait_ready()
    assert N > BATCH  # the old view is carried over in more than one batch
    ids = await schedule_five_kinds(mongo, a, park=True, pending_in_ms=2_500, n=N)
    fifth = N // 5

    code, out, err = await run_wowd("timers", "rebuild", env=env)
    assert code == 0, err
    counts = summary(out)
    assert counts["commits"] == N + fifth
    assert (counts["PARKED"], counts["FAILED"], counts["CANCELLED"], counts["expired"]) == (fifth, fifth, fifth, 0)
    # the pending ones are due 2.5 s after they were scheduled: on a slow machine a few may fire first
    assert counts["PENDING"] + counts["DONE"] == 2 * fifth and counts["DONE"] >= fifth
    held = re.search(r"swapped in \(the slots held ([\d.]+) s\)", out)
    assert held is not None, out
    assert "holding the slots of" in out

    async def pending_fired() -> bool:
        return set(await outbox_timer_ids(mongo)) >= ids["pending"]

    await eventually(pending_fired, 20, "every pending timer fired")
    await a.wait_ready()  # the replica holds its slot again
    assert _slot_given_back_within(a.log()) < 5.0  # deliveries paused for the swap only
    fired = await outbox_timer_ids(mongo)
    assert sorted(fired) == sorted(ids["fired"] | ids["pending"])
    await _fired_counted(a, len(ids["fired"]) + len(ids["pending"]))  # nothing delivered twice
    await assert_parked_and_failed_kept(mongo, ids)
    assert a.proc.poll() is None


async def test_rebuild_of_a_dropped_view_while_a_replica_runs(
    spawn: Callable[..., Replica], env: dict[str, str], mongo: Backend, sim_uri: str
) -> None:
    a = spawn("a", env)
    await a.wait_ready()
    # the pending ones are due 2.5 s after they were scheduled, after the drop (a pending one
    # fired before it would be counted DONE below); the replica cannot fire them from the dropped view
    ids = await schedule_five_kinds(mongo, a, park=False, pending_in_ms=2_500, n=N_DROPPED)
    fifth = N_DROPPED // 5
    # some fired long ago, their outbox entries acknowledged and gone: nothing says they fired
    old = [timer_commit(f"o-old-{i}", 1, [f"k-old-{i}"], due_at=int(time.time() * 1000) - 8 * DAY_MS) for i in range(5)]
    await mongo.log.append_many(old)

    async def old_fired() -> bool:
        return await mongo.outbox.count() == len(ids["fired"]) + len(old)

    await eventually(old_fired, 20, "the old timers fired")
    await _forget_outbox_entries_but(sim_uri, ids["fired"])
    await _drop(sim_uri)  # by mistake, while the replica runs

    code, out, err = await run_wowd("timers", "rebuild", env=env)
    assert code == 0, err
    counts = summary(out)
    assert counts["DONE"] == fifth and counts["CANCELLED"] == fifth  # from the outbox and the log
    assert counts["PENDING"] == 3 * fifth
    assert f"{fifth} one-shot timer(s) found fired in the outbox" in out
    assert counts["expired"] == counts["FAILED"] == len(old)
    assert "expired, state unknown: 5 one-shot timer(s)" in out

    async def pending_fired() -> bool:
        return set(await outbox_timer_ids(mongo)) >= ids["pending"]

    await eventually(pending_fired, 20, "the pending timers fired")
    assert sorted(await outbox_timer_ids(mongo)) == sorted(ids["fired"] | ids["pending"])  # no old one again
    await _fired_counted(a, len(ids["fired"]) + len(ids["pending"]) + len(old))
    expired = await mongo.timer_queries.scan(status=TimerStatus.FAILED, limit=100)
    assert {t.owner.id for t in expired} == {f"o-old-{i}" for i in range(5)}


async def test_a_rebuild_killed_leaves_the_live_view_and_the_next_one_while_commits_keep_coming_follows_the_log(
    spawn: Callable[..., Replica], env: dict[str, str], mongo: Backend, sim_uri: str
) -> None:
    """A rebuild killed leaves the live view and its replica as they were; ``wowd check`` names
    what it left, a dry run counts and changes nothing. The next rebuild runs while a producer
    appends all along (timers, a third of them cancelled by the next commit): its reads stop at
    their bounds, not at a head the producer keeps moving, and after the swap the view holds
    exactly the live timers of the log, none lost to the swap, the ones before as they were."""
    a = spawn("a", env)
    await a.wait_ready()
    await mongo.log.append_many(
        [timer_commit(f"o-{i}", 1, [f"k-{i}"], due_at=int(time.time() * 1000) + 3_600_000) for i in range(200)]
    )

    async def fed() -> bool:
        return len(await mongo.timer_queries.scan(limit=100_000)) == 200

    await eventually(fed, 20, "fed")
    before = await _docs(sim_uri)
    await rebuild_killed_partway(env)
    assert await _docs(sim_uri) == before
    code, out, err = await run_wowd("check", env=env)
    assert "ok   timer view rebuild: an interrupted rebuild left" in out, err  # its lock (of a process gone)

    code, out, err = await run_wowd("timers", "rebuild", "--dry-run", env=env)
    assert code == 0, err
    assert summary(out)["PENDING"] == 200 and "dry run: nothing changed" in out
    assert await _docs(sim_uri) == before

    due = int(time.time() * 1000) + 3_600_000
    appended = [f"o-{i}" for i in range(200)]
    gone: set[str] = set()
    stop = anyio.Event()

    async def produce() -> None:
        i = 0
        while not stop.is_set():
            await mongo.log.append_many([timer_commit(f"p-{i}", 1, [f"k-{i}"], due_at=due)])
            appended.append(f"p-{i}")
            if i % 3 == 0:
                await mongo.log.append_many([commit(f"p-{i}", 2, cancelled(f"k-{i}"))])
                gone.add(f"p-{i}")
            i += 1
            with anyio.move_on_after(0.03):
                await stop.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        code, out, err = await run_wowd("timers", "rebuild", env=env)
        stop.set()
    assert code == 0, err
    assert "swapped in" in out and summary(out)["PENDING"] >= 200

    async def follows() -> bool:
        live = {t.owner.id for t in await mongo.timer_queries.scan(limit=100_000)}
        return live == set(appended) - gone

    await eventually(follows, 20, "the view holds the log's live timers")

    def without_revision(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in d.items() if k != "revision"} for d in docs if d["owner"]["id"].startswith("o-")]

    assert without_revision(await _docs(sim_uri)) == without_revision(before)
    await a.wait_ready()
    client: AsyncMongoClient[Any] = AsyncMongoClient(sim_uri)
    try:
        assert await mongo_rebuild_state(client[DATABASE], CONTEXT) is None  # what wowd check names: nothing left
    finally:
        await client.close()


async def test_a_replica_that_keeps_its_slot_fails_the_rebuild_and_the_hold_is_lifted(
    env: dict[str, str], sim_uri: str
) -> None:
    """A replica of a version that knows no hold renews on: the rebuild gives up after the
    lease's ttl and the grace period, names the slot and its holder, and lifts its hold."""
    from datetime import timedelta

    from wowd.model import Owner
    from wowd.stores.mongo.leases import MongoSlotLeaseStore

    store = MongoSlotLeaseStore(sim_uri, DATABASE)
    ttl, tol = timedelta(seconds=2), timedelta(milliseconds=500)
    got = await store.acquire(f"wowd.{CONTEXT}", Owner(key="old-replica"), 1, ttl, tol)
    assert got.lease is not None
    lease = got.lease
    done = anyio.Event()

    async def renew_regardless() -> None:
        nonlocal lease
        while not done.is_set():
            renewed = await store.renew(lease, ttl, tol)
            assert renewed is not None
            lease = renewed
            with anyio.move_on_after(0.3):
                await done.wait()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(renew_regardless)
            # the rebuild's own lease ttl (what it waits for) short: the holder renews regardless
            rebuild_env = {
                **env,
                "WOWD_LEASE__TTL_S": "0.3",
                "WOWD_LEASE__TOLERANCE_S": "0.1",
                "WOWD_SHUTDOWN__GRACE_S": "0",
            }
            code, _out, err = await run_wowd("timers", "rebuild", env=rebuild_env)
            done.set()
        assert code == 1
        assert "slot 0 by old-replica" in err and "the live view is left as it was" in err
        assert [s.held for s in await store.slots(f"wowd.{CONTEXT}")] == [False]
    finally:
        await store.close()


async def test_a_second_rebuild_is_refused_naming_the_first(env: dict[str, str], sim_uri: str) -> None:
    from datetime import UTC, timedelta

    client: AsyncMongoClient[Any] = AsyncMongoClient(sim_uri)
    try:
        now = datetime.now(UTC)
        await client[DATABASE]["wow_timer_rebuild"].insert_one(
            {"_id": CONTEXT, "owner": "elsewhere:4242:abcd", "startedAt": now, "expiresAt": now + timedelta(seconds=60)}
        )
        code, _out, err = await run_wowd("timers", "rebuild", env=env)
        assert code == 1
        assert f"a rebuild of the timer view of context '{CONTEXT}' runs: lock held by elsewhere:4242:abcd" in err
        assert await client[DATABASE]["wow_timer_shadow_aggregate"].count_documents({}) == 0
    finally:
        await client.close()
