"""Replicas as processes on the embedded backend: failover, graceful shutdown, bad input, HTTP."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.inprocess import wowd_in_process
from tests.factories import CONTEXT, PARTITIONS, eventually, timer_commit
from tests.processes import SECRET_MONGO_PW, SECRET_TOKEN, Replica, base_env, run_wowd
from wowd.model import (
    AggregateType,
    Commit,
    Owner,
    TimerStatus,
    deterministic_timer_id,
    partition,
    request_id_for,
)
from wowd.stores.base import Backend
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = [pytest.mark.anyio, pytest.mark.process]

LEASE_LIMIT = 2
"""Slots of this module's replicas (the ``stores`` fixture's view)."""

NS = f"wowd.{CONTEXT}"
ORDER = AggregateType(context=CONTEXT, aggregate="order")


def expected_request_ids(commits: list[Commit]) -> set[str]:
    out = set()
    for c in commits:
        for e in c.events:
            if e.name == "TimerScheduled":
                tid = deterministic_timer_id(c.ref, e.body["key"], c.version)
                out.add(request_id_for(tid, e.body["due_at"]))
    return out


async def live_slots(b: Backend) -> dict[int, tuple[str | None, int]]:
    return {s.slot: (s.owner_key if s.live else None, s.fence) for s in await b.leases.slots(NS)}


def assert_no_secret(text: str) -> None:
    assert SECRET_TOKEN not in text
    assert SECRET_MONGO_PW not in text


async def _status_is(r: Replica, path: str, code: int) -> bool:
    return (await r.get(path)).status_code == code


async def test_failover_standby_takes_the_dead_slot_and_fires_its_timers(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    # a lease of 1 s renewed every 1/3 s: a's lease outlives its kill by 2/3 s at least
    env = base_env(db, WOWD_LEASE__TTL_S=1, WOWD_LEASE__TOLERANCE_S=0.25)
    a, b = spawn("a", env), spawn("b", env)
    await a.wait_ready()
    await b.wait_ready()
    slots = await live_slots(stores)
    holders = {owner: (slot, fence) for slot, (owner, fence) in slots.items() if owner}
    assert set(holders) == {"a", "b"}  # each owns its half
    a_slot, a_fence = holders["a"]
    b_slot, b_fence = holders["b"]

    c = spawn("c", env)
    await c.wait_port()
    assert (await c.get("/readyz?holding=1")).status_code == 503  # standby: no lease
    await eventually(lambda: _contains(c, "standing by"), 10, "c standing by")
    # a healthy standby is ready (it functions: its stores answer, it holds nothing to stall)
    await eventually(lambda: _status_is(c, "/readyz", 200), 10, "c ready as a standby")

    # round 1: timers over every partition, fired by a and b
    round1 = [timer_commit(f"order-{i}", 1, [f"k1-{i}"]) for i in range(32)]
    assert {partition(c_.ref.id, PARTITIONS) % 2 for c_ in round1} == {0, 1}
    await stores.log.append_many(round1)
    await eventually(lambda: _outbox_has(stores, 32), 15, "round 1 fired")
    # settled too: a timer a delivered but had not settled when killed is fired again by c
    await eventually(lambda: _no_timer_left(stores), 15, "round 1 settled")

    a.signal(signal.SIGKILL)
    await a.wait_exit(5)
    killed_at = time.monotonic()
    round2 = [timer_commit(f"order-{i}", 2, [f"k2-{i}"]) for i in range(32)]
    await stores.log.append_many(round2)

    # b never takes a's slot (it holds one slot); c takes it once the lease expired
    async def c_took_it() -> bool:
        now = await live_slots(stores)
        assert now[a_slot][0] in ("a", None, "c")
        assert now[b_slot] == ("b", b_fence)
        return now[a_slot][0] == "c"

    await eventually(c_took_it, 15, "c holds a's slot")
    assert time.monotonic() - killed_at >= 0.6  # not before a's lease expired (+ tolerance)
    assert (await live_slots(stores))[a_slot] == ("c", a_fence + 1)
    await c.wait_ready()
    await eventually(lambda: _outbox_has(stores, 64), 20, "round 2 fired")
    assert await stores.timer_queries.scan(limit=10) == []  # none left: none lost

    entries = await stores.outbox.entries(limit=1000)
    assert len(entries) == 64 and {e.request_id for e in entries} == expected_request_ids(round1 + round2)
    for e in entries:
        slot_of = partition(e.target.id, PARTITIONS) % 2
        if slot_of == b_slot:
            assert (e.owner_key, e.fence) == ("b", b_fence)
        elif e.request_id in expected_request_ids(round2):
            assert (e.owner_key, e.fence) == ("c", a_fence + 1)  # fired by the new holder only
        else:
            assert (e.owner_key, e.fence) == ("a", a_fence)
    metrics = (await c.get("/metrics")).text
    fired = _sample_sum(metrics, "wowd_timers_fired_total")
    assert fired == sum(1 for e in entries if e.owner_key == "c")
    for r in (b, c):
        r.signal(signal.SIGTERM)
        assert await r.wait_exit(10) == 0
        assert_no_secret(r.log())


async def test_sigterm_mid_batch_exits_zero_releases_and_settles(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    env = base_env(db, WOWD_LEASE__LIMIT=1, WOWD_TIMERS__BATCH=100)
    r = spawn("solo", env)
    await r.wait_ready()
    commits = [timer_commit(f"o-{i}", 1, [f"k-{i}-{j}" for j in range(4)]) for i in range(1000)]
    await stores.log.append_many(commits)
    await eventually(lambda: _outbox_has(stores, 1), 20, "firing started")
    r.signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert await r.wait_exit(10) == 0
    assert time.monotonic() - stopped_at < 5  # within the grace period
    assert await stores.outbox.count() < 4000  # it stopped mid-way
    log = r.log()
    assert "released slot 0" in log and "feed stopped at a batch boundary" in log
    # released: the slot is free, remembers its last owner
    (state,) = await stores.leases.slots(NS)
    assert state.owner_key is None and state.last_owner_key == "solo"
    # every claimed timer settled: nothing left FIRING under the stopped process's claim
    assert await stores.timer_queries.scan(status=TimerStatus.FIRING, limit=10) == []
    # the next acquire by that owner key is immediate and sticky
    res = await stores.leases.acquire(NS, Owner(key="solo"), 1, timedelta(seconds=2), timedelta(seconds=0.5))
    assert res.acquired and res.lease is not None and res.lease.slot == 0
    assert await stores.leases.release(res.lease, res.lease.written_at)
    # a restart fires the rest, each request id once
    r2 = spawn("solo", env)
    await r2.wait_ready()
    await eventually(lambda: _outbox_has(stores, 4000), 30, "every timer fired")
    entries = await stores.outbox.entries(limit=10_000)
    assert {e.request_id for e in entries} == expected_request_ids(commits)
    r2.signal(signal.SIGTERM)
    assert await r2.wait_exit(10) == 0


async def test_bad_input_quarantined_metrics_readiness_and_no_secret(
    spawn: Callable[..., Replica], db: Path, stores: Backend, tmp_path: Path
) -> None:
    env = base_env(db, WOWD_LEASE__LIMIT=1)
    # hold the only slot so the replica starts as a standby: /readyz?holding=1 503 before its first lease
    blocker = await stores.leases.acquire(NS, Owner(key="blocker"), 1, timedelta(seconds=60), timedelta(seconds=1))
    assert blocker.acquired and blocker.lease is not None
    good_before = timer_commit("g-1", 1, ["a"])
    await stores.log.append(good_before)
    await stores.log.insert_raw(ORDER, {"aggregate_id": "g-1", "version": "two", "events": "nope"})
    # a commit whose TimerScheduled has an unknown rule type: quarantined, the commit still fed
    scheduled = timer_commit("g-2", 1, ["b"])
    body = {**scheduled.events[1].body, "rule": {"type": "fortnightly"}}
    bad_timer = replace(scheduled, events=(scheduled.events[0], replace(scheduled.events[1], body=body)))
    good_after = timer_commit("g-3", 1, ["c"])
    await stores.log.append_many([bad_timer, good_after])

    notify_name = f"wowd-test-{uuid.uuid4().hex[:12]}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + notify_name)
    notify.setblocking(False)
    messages: list[str] = []

    async def notified(text: str) -> bool:
        while True:
            try:
                messages.append(notify.recv(4096).decode())
            except BlockingIOError:
                return any(text in m for m in messages)

    r = spawn("r", {**env, "NOTIFY_SOCKET": "@" + notify_name})
    await r.wait_port()
    assert (await r.get("/healthz")).status_code == 200
    assert (await r.get("/readyz?holding=1")).status_code == 503
    # sd_notify: READY at once as a standby, with a STATUS saying so
    await eventually(lambda: notified("READY=1"), 10, "READY=1")
    assert any("READY=1" in m and "STATUS=standby" in m for m in messages), messages
    assert await stores.leases.release(blocker.lease, 0)
    await r.wait_ready()
    await eventually(lambda: notified("STATUS=holding slot(s) 0"), 10, "STATUS holding")

    await eventually(lambda: _outbox_has(stores, 2), 15, "good timers fired")
    quarantined = await stores.quarantine.items()
    reasons = " | ".join(q["reason"] for q in quarantined)
    assert len(quarantined) == 2, reasons
    assert "rule.type" in reasons
    # the rest was fed: every good commit (and the one with the bad timer event) is in the sink
    sink = stores.sink(ORDER)
    for commit in (good_before, bad_timer, good_after):
        assert [d["version"] for d in await sink.documents(commit.ref)] == [1]
    assert await stores.checkpoints.read("wowd", [partition("g-3", PARTITIONS)])

    text = (await r.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "wowd_timers_fired" in families and "wowd_feed_commits" in families
    assert _sample_sum(text, "wowd_feed_commits_total") == 3
    assert _sample_sum(text, "wowd_timers_fired_total") == 2
    assert _sample_sum(text, "wowd_quarantined_total") == 2
    rejected = [s for s in families["wowd_timer_events_rejected"].samples if s.name.endswith("_total")]
    assert [(s.labels["field"], s.value) for s in rejected] == [("rule.type", 1.0)]
    assert_no_secret(text)

    rc, out, err = await wowd_in_process("status", "--json", env=env, cwd=tmp_path)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["slots"][0]["holder"] == "r" and doc["partitions_without_live_holder"] == []
    assert_no_secret(out + err)
    rc, out, err = await wowd_in_process("check", env=env, cwd=tmp_path)
    assert rc == 0, out + err
    assert "ok   log" in out and "ok   timers" in out
    assert_no_secret(out + err)

    r.signal(signal.SIGTERM)
    assert await r.wait_exit(10) == 0
    assert_no_secret(r.log())
    assert await notified("STOPPING=1")
    notify.close()


async def test_the_outbox_depth_scraped_is_the_outbox_at_the_scrape(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    """``wowd_outbox_depth`` after two bursts of fired timers is the outbox's 200 entries, and 0
    at the scrape right after they are all acknowledged."""
    r = spawn("r", base_env(db, WOWD_LEASE__LIMIT=1))
    await r.wait_ready()
    first = [timer_commit(f"o-{i}", 1, ["k"]) for i in range(100)]
    await stores.log.append_many(first)
    await eventually(lambda: _outbox_has(stores, 100), 15, "the first burst fired")
    assert await _depth(r) == 100
    await stores.log.append_many([timer_commit(f"p-{i}", 1, ["k"]) for i in range(100)])
    await eventually(lambda: _outbox_has(stores, 200), 15, "the second burst fired")
    assert await stores.outbox.count() == 200
    assert await _depth(r) == 200
    entries = await stores.outbox.entries(limit=1000)
    assert await stores.outbox.ack([e.request_id for e in entries]) == 200
    text = (await r.get("/metrics")).text
    assert _sample_sum(text, "wowd_outbox_depth") == 0
    assert 0 <= _sample_sum(text, "wowd_outbox_depth_age_seconds") < 5  # counted for this scrape
    r.signal(signal.SIGTERM)
    assert await r.wait_exit(10) == 0


async def _depth(r: Replica) -> float:
    return _sample_sum((await r.get("/metrics")).text, "wowd_outbox_depth")


async def test_a_replica_whose_clock_disagrees_with_the_file_refuses_to_start(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    """A slot lease stamped 10 minutes in the future (written by a replica whose clock was that
    far ahead): a replica starting on the file exits 2 naming the skew and the tolerance, before
    it takes a slot; with the stamps a clock in agreement writes, it starts as usual."""
    env = base_env(db, WOWD_LEASE__LIMIT=1)
    res = await stores.leases.acquire(NS, Owner(key="ahead"), 1, timedelta(seconds=0.3), timedelta(seconds=0.1))
    assert res.lease is not None
    shift = "UPDATE cosid_slot SET writtenAt = writtenAt + ?, expiresAt = expiresAt + ?, ceiling = ceiling + ?"
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(shift, (600_000,) * 3)
    r = spawn("r", env)
    assert await r.wait_exit(20) == 2
    log = r.log()
    assert "refusing to start: the slot lease last written by ahead" in log, log
    assert re.search(r"stamped 59\d\.\d s after this process's now", log), log  # 10 minutes, less the time since
    assert "WOWD_LEASE__TOLERANCE_S = 0.5 s" in log
    assert (await live_slots(stores))[0][0] == "ahead"  # untouched
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(shift, (-600_000,) * 3)
    r2 = spawn("r2", env)
    await r2.wait_ready()  # the slot taken once ahead's lease expired
    assert (await live_slots(stores))[0][0] == "r2"
    r2.signal(signal.SIGTERM)
    assert await r2.wait_exit(10) == 0


async def test_config_error_exits_2_with_message(tmp_path: Path, db: Path) -> None:
    env = base_env(db, WOWD_LEASE__TTL_S="1", WOWD_LEASE__TOLERANCE_S="3", WOWD_TIMERS__BACHT="5")
    rc, out, err = await run_wowd("check", env=env, cwd=tmp_path)
    assert rc == 2
    assert "invalid configuration" in err and "bacht" in err.lower()
    assert_no_secret(out + err)


async def _contains(r: Replica, text: str) -> bool:
    return text in r.log()


async def _outbox_has(b: Backend, n: int) -> bool:
    return await b.outbox.count() >= n


async def _no_timer_left(b: Backend) -> bool:
    return await b.timer_queries.scan(limit=1) == []


def _sample_sum(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
