"""Snapshot rebuilds: claim, rebuild each partition by its owner, backfilled; status; the CLI."""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon.reducers import ExplodingReducer, reducer_v2
from tests.factories import CONTEXT, commit, event, eventually, timer_commit
from tests.processes import base_env
from wowd.backends import opened_backend
from wowd.cli import main
from wowd.config import EmbeddedSettings, HttpSettings, LeaseSettings, WowdSettings
from wowd.daemon.leases import HeldSlot
from wowd.daemon.rebuild import Rebuilder, RebuildReport, progress_consumer
from wowd.daemon.replica import delivery, replica_of
from wowd.demo import reducer as reducer_v1
from wowd.errors import LeaseLost, StorageUnavailable
from wowd.metrics import SNAPSHOT_REBUILD_FAILED
from wowd.model import AggregateRef, AggregateType, Owner, SnapshotRecord, partition
from wowd.reducers import fold_commit
from wowd.stores.base import Backend

pytestmark = pytest.mark.anyio

PARTS = 4
ORDER = AggregateType(context=CONTEXT, aggregate="order")
IDS = [f"o-{i}" for i in range(8)]  # two aggregates in each of the 4 partitions
VERSIONS = 3
TTL = timedelta(seconds=60)


def settings(tmp_path: Path, *, partitions: int = PARTS, **extra: Any) -> WowdSettings:
    extra.setdefault("lease", LeaseSettings(limit=2, ttl_s=30, tolerance_s=1))
    return WowdSettings(
        context=CONTEXT, partitions=partitions, embedded=EmbeddedSettings(path=tmp_path / "wowd.db"), **extra
    )


def ref(agg_id: str) -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate="order", id=agg_id)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    """The stores, the log holding :data:`VERSIONS` commits of each of :data:`IDS`."""
    async with opened_backend(settings(tmp_path)) as b:
        await b.log.append_many([timer_commit(i, v, []) for v in range(1, VERSIONS + 1) for i in IDS])
        yield b


async def hold(b: Backend, slot_parts: set[int], *, owner: str = "me", valid_for: float = 60.0) -> HeldSlot:
    res = await b.leases.acquire(f"ns-{owner}", Owner(key=owner), 2, TTL, timedelta(seconds=1))
    assert res.lease is not None
    return HeldSlot(
        lease=res.lease,
        partitions=frozenset(slot_parts),
        valid_until=anyio.current_time() + valid_for,
        owner_key=owner,
    )


async def expected(b: Backend, agg_id: str, reducer: Any) -> SnapshotRecord:
    """The snapshot folded from the log, commit by commit, as the feed would fold it."""
    snap: SnapshotRecord | None = None
    async for batch in b.log.read({partition(agg_id, PARTS): None}, follow=False):
        for e in batch.entries:
            if e.commit is not None and e.commit.ref == ref(agg_id):
                snap = fold_commit(reducer, snap, e.commit)
    assert snap is not None
    return snap


async def backfill_v1(tmp_path: Path, b: Backend) -> None:
    [r] = await Rebuilder(settings(tmp_path), b, {"order": reducer_v1}).rebuild(range(PARTS))
    assert r.outcome == "rebuilt" and r.backfilled and r.rewritten == len(IDS)


async def rebuild_slot(
    s: WowdSettings, b: Backend, reducer: Any, slot_parts: set[int], owner: str
) -> list[RebuildReport]:
    """What a replica holding ``slot_parts`` (as ``owner``) does before feeding them."""
    return await Rebuilder(s, b, {"order": reducer}).rebuild_slot(await hold(b, slot_parts, owner=owner))


def count_reads(monkeypatch: pytest.MonkeyPatch, b: Backend) -> list[dict[int, Any]]:
    calls: list[dict[int, Any]] = []
    read = b.log.read

    def spy(positions: Any, **kw: Any) -> Any:
        calls.append(dict(positions))
        return read(positions, **kw)

    monkeypatch.setattr(b.log, "read", spy)
    return calls


async def test_a_new_reducer_backfills_every_aggregate_and_marks_the_table(tmp_path: Path, backend: Backend) -> None:
    rebuilder = Rebuilder(settings(tmp_path), backend, {"order": reducer_v1})
    [before] = await rebuilder.status()
    assert before.table is None and before.pending == 0 and before.partitions_done == 0

    await backfill_v1(tmp_path, backend)

    table = await backend.rebuilds.table(ORDER)
    assert table is not None and table.revision == 1 and table.backfilled and not table.rebuilding
    for agg_id in IDS:
        assert await backend.snapshots.load(ref(agg_id)) == await expected(backend, agg_id, reducer_v1)
    [after] = await rebuilder.status()
    assert (after.pending, after.partitions_done, after.partitions, after.target) == (0, PARTS, PARTS, 1)


async def test_a_raised_revision_is_rebuilt_each_partition_by_its_owner(tmp_path: Path, backend: Backend) -> None:
    await backfill_v1(tmp_path, backend)
    assert await backend.snapshots.mark_stale(ref("o-2"))  # partition 0: the feed found it behind
    rebuilder = Rebuilder(settings(tmp_path), backend, {"order": reducer_v2})
    slot0, slot1 = {0, 2}, {1, 3}

    [r0] = await rebuilder.rebuild_slot(await hold(backend, slot0, owner="a"))

    assert r0.outcome == "rebuilt" and sorted(r0.partitions) == [0, 2] and not r0.backfilled
    table = await backend.rebuilds.table(ORDER)
    assert table is not None and table.revision == 2 and table.rebuilding and not table.backfilled
    for agg_id in IDS:
        snap = await backend.snapshots.load(ref(agg_id))
        assert snap is not None
        if partition(agg_id, PARTS) in slot0:
            assert snap == await expected(backend, agg_id, reducer_v2)  # stale mark cleared too
            assert snap.state == {"seen": VERSIONS, "last": "ItemAdded"}
        else:
            assert snap.state_revision == 1  # another owner's partition: untouched
    [st] = await rebuilder.status()
    assert (st.target, st.pending, st.partitions_done) == (2, 4, 2)
    assert sorted(await backend.rebuilds.pending(ORDER, 2, None, 100)) == sorted(
        ref(i) for i in IDS if partition(i, PARTS) in slot1
    )

    [r1] = await rebuilder.rebuild_slot(await hold(backend, slot1, owner="b"))

    assert sorted(r1.partitions) == [1, 3] and r1.backfilled and r1.rewritten == 4
    table = await backend.rebuilds.table(ORDER)
    assert table is not None and table.revision == 2 and table.backfilled and not table.rebuilding
    [st] = await rebuilder.status()
    assert (st.pending, st.partitions_done) == (0, PARTS)


async def test_a_takeover_skips_rebuilt_partitions_and_an_older_reducer_writes_nothing(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    await backfill_v1(tmp_path, backend)
    s = settings(tmp_path)
    await rebuild_slot(s, backend, reducer_v2, {0, 2}, "a")
    reads = count_reads(monkeypatch, backend)

    # the slot changes hands before the other slot was rebuilt: its partitions are not read again
    [again] = await rebuild_slot(s, backend, reducer_v2, {0, 2}, "c")
    assert again.outcome == "rebuilt" and again.partitions == [] and reads == []

    # a replica still running revision 1 (a rolling upgrade) leaves the snapshots to revision 2
    [old] = await rebuild_slot(s, backend, reducer_v1, {1, 3}, "d")
    assert old.outcome == "superseded" and reads == []
    snap = await backend.snapshots.load(ref("o-2"))
    assert snap is not None and snap.state_revision == 2
    table = await backend.rebuilds.table(ORDER)
    assert table is not None and table.revision == 2 and not table.backfilled

    # once backfilled, a new holder reads nothing
    await rebuild_slot(s, backend, reducer_v2, {1, 3}, "b")
    reads.clear()
    [done] = await rebuild_slot(s, backend, reducer_v2, {0, 2}, "e")
    assert done.outcome == "current" and done.backfilled and reads == []


def after(n: int) -> Callable[[], bool]:
    """A question answered no ``n`` times, then yes."""
    asked = itertools.count(1)
    return lambda: next(asked) > n


async def test_the_fence_is_checked_before_each_rewrite_batch(tmp_path: Path, backend: Backend) -> None:
    await backfill_v1(tmp_path, backend)
    rebuilder = Rebuilder(settings(tmp_path), backend, {"order": reducer_v2}, rewrite_batch=1)
    lost = after(1)

    def check() -> None:
        if lost():
            raise LeaseLost("lease no longer valid")

    with pytest.raises(LeaseLost):
        await rebuilder.rebuild([0], check=check, fence=7)

    states = [await backend.snapshots.load(ref(i)) for i in IDS if partition(i, PARTS) == 0]
    assert sorted(s.state_revision for s in states if s is not None) == [1, 2]  # one batch, then stopped
    assert await backend.checkpoints.read(progress_consumer("order", 2), [0]) == {}


async def test_a_refused_progress_checkpoint_is_not_recorded_as_rebuilt(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot changes hands while partition 1 is being rebuilt: the new holder (fence 4)
    records it first, so this holder's checkpoint (fence 3) is refused. The rebuild stops there
    as a lost lease; partition 1 is the new holder's, 2 and 3 are left to it."""
    await backfill_v1(tmp_path, backend)
    consumer = progress_consumer("order", 2)
    theirs = {"revision": 2, "aggregates": 0, "skipped": 0, "holder": "the next"}
    save = backend.checkpoints.save

    async def racing(c: str, p: int, position: Any, fence: int) -> bool:
        if c == consumer and p == 1:
            assert await save(c, p, theirs, fence + 1)
        return await save(c, p, position, fence)

    monkeypatch.setattr(backend.checkpoints, "save", racing)
    rebuilder = Rebuilder(settings(tmp_path), backend, {"order": reducer_v2})
    with pytest.raises(LeaseLost, match="partition 1 was refused under fence 3"):
        await rebuilder.rebuild(range(PARTS), fence=3)
    recorded = await backend.checkpoints.read(consumer, list(range(PARTS)))
    assert sorted(recorded) == [0, 1]
    assert (recorded[0].fence, recorded[1].fence, recorded[1].position) == (3, 4, theirs)
    table = await backend.rebuilds.table(ORDER)
    assert table is not None and not table.backfilled


async def test_an_expired_slot_rewrites_nothing(tmp_path: Path, backend: Backend) -> None:
    await backfill_v1(tmp_path, backend)
    held = await hold(backend, {0, 2}, valid_for=-1.0)
    with pytest.raises(LeaseLost):
        await Rebuilder(settings(tmp_path), backend, {"order": reducer_v2}).rebuild_slot(held)
    assert await backend.rebuilds.pending(ORDER, 2, None, 100) == sorted(ref(i) for i in IDS)


async def test_a_stop_ends_the_rebuild_at_a_batch_boundary_unrecorded(tmp_path: Path, backend: Backend) -> None:
    await backfill_v1(tmp_path, backend)
    rebuilder = Rebuilder(settings(tmp_path), backend, {"order": reducer_v2}, batch_size=1)
    [r] = await rebuilder.rebuild(range(PARTS), stopping=after(1))
    assert r.outcome == "stopped" and r.partitions == [] and r.rewritten == 0
    table = await backend.rebuilds.table(ORDER)
    assert table is not None and table.revision == 2 and table.rebuilding and not table.backfilled
    assert await backend.checkpoints.read(progress_consumer("order", 2), list(range(PARTS))) == {}


async def test_a_gap_in_the_log_leaves_the_aggregate_pending(tmp_path: Path, backend: Backend) -> None:
    await backfill_v1(tmp_path, backend)
    # o-0 gets a malformed v4 and a valid v5; "late" starts at version 2 (its v1 is missing)
    doc = {"tenant_id": "(0)", "aggregate_id": "o-0", "version": 4, "request_id": "bad", "events": "no"}
    await backend.log.insert_raw(ORDER, doc)
    await backend.log.append_many([timer_commit("o-0", 5, []), timer_commit("late", 2, [])])

    [r] = await Rebuilder(settings(tmp_path), backend, {"order": reducer_v2}).rebuild(range(PARTS))

    assert r.skipped == 2 and r.rewritten == len(IDS) - 1 and r.failed == 0 and r.backfilled
    o0 = await backend.snapshots.load(ref("o-0"))
    assert o0 is not None and o0.state_revision == 1 and o0.version == VERSIONS
    assert await backend.snapshots.load(ref("late")) is None
    assert await backend.rebuilds.pending(ORDER, 2, None, 100) == [ref("o-0")]


async def test_a_raising_reducer_fails_its_type_where_it_raised_and_the_other_types_go_on(
    tmp_path: Path, backend: Backend
) -> None:
    """The reducer of ``order`` raises on a commit in partition 2: partitions 0 and 1 are rebuilt
    and recorded, 2 and 3 are neither rewritten nor recorded, and the report says why; ``item``
    (another type, in every partition) is rebuilt whole and backfilled."""
    await backfill_v1(tmp_path, backend)
    bad = next(i for i in IDS if partition(i, PARTS) == 2)
    await backend.log.append(commit(bad, VERSIONS + 1, event("Explode")))
    items = [AggregateRef(context=CONTEXT, aggregate="item", id=f"i-{n}") for n in range(8)]
    assert {partition(i.id, PARTS) for i in items} == set(range(PARTS))
    await backend.log.append_many([commit(i.id, 1, owner=i) for i in items])

    reports = await Rebuilder(settings(tmp_path), backend, {"order": ExplodingReducer(2), "item": reducer_v2}).rebuild(
        range(PARTS)
    )

    [item, order] = reports
    assert order.outcome == "failed" and order.partitions == [0, 1] and not order.backfilled
    assert order.error == f"reducer of order raised on {ref(bad)} v{VERSIONS + 1}: RuntimeError('reducer exploded')"
    assert sorted(await backend.checkpoints.read(progress_consumer("order", 2), list(range(PARTS)))) == [0, 1]
    for agg_id in IDS:
        snap = await backend.snapshots.load(ref(agg_id))
        assert snap is not None and snap.state_revision == (2 if partition(agg_id, PARTS) < 2 else 1), agg_id
    assert item.outcome == "rebuilt" and item.partitions == list(range(PARTS)) and item.backfilled
    assert None not in [await backend.snapshots.load(i) for i in items]


async def test_a_slot_whose_reducer_raises_says_so_and_returns_to_start_its_feed(
    tmp_path: Path, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    await backfill_v1(tmp_path, backend)
    await backend.log.append(commit("o-1", VERSIONS + 1, event("Explode")))
    held = await hold(backend, set(range(PARTS)))
    gauge = SNAPSHOT_REBUILD_FAILED.labels(slot=str(held.slot), aggregate="order")
    with caplog.at_level(logging.ERROR, logger="wowd.daemon.rebuild"), anyio.fail_after(5):
        [r] = await Rebuilder(settings(tmp_path), backend, {"order": ExplodingReducer(2)}).rebuild_slot(held)
    assert r.outcome == "failed" and gauge._value.get() == 1
    [line] = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert line.startswith(f"snapshots of {ORDER} not rebuilt at state revision 2: reducer of order raised on")
    [r] = await Rebuilder(settings(tmp_path), backend, {"order": reducer_v2}).rebuild_slot(held)  # fixed
    assert r.outcome == "rebuilt" and r.backfilled and gauge._value.get() == 0


async def test_a_transient_failure_is_retried(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    await backfill_v1(tmp_path, backend)
    rewrite = backend.rebuilds.rewrite
    failures = [StorageUnavailable("database is locked")]

    async def flaky(snapshot: SnapshotRecord) -> bool:
        if failures:
            raise failures.pop()
        return await rewrite(snapshot)

    monkeypatch.setattr(backend.rebuilds, "rewrite", flaky)
    s = settings(tmp_path)
    with anyio.fail_after(10):
        [r] = await rebuild_slot(s, backend, reducer_v2, set(range(PARTS)), "me")
    assert failures == [], "the injected failure never happened"
    assert r.backfilled and sorted(r.partitions) == list(range(PARTS))
    assert await backend.rebuilds.pending(ORDER, 2, None, 100) == []


async def test_a_replica_rebuilds_its_slot_then_feeds_on_top(tmp_path: Path, backend: Backend) -> None:
    await backfill_v1(tmp_path, backend)
    s = settings(
        tmp_path,
        lease=LeaseSettings(limit=1, ttl_s=30, tolerance_s=1),
        http=HttpSettings(host="127.0.0.1", port=0),
        reducers={"order": "tests.daemon.reducers:reducer_v2"},
    )
    sup = replica_of(s, backend, delivery(s, backend))

    async def backfilled() -> bool:
        t = await backend.rebuilds.table(ORDER)
        return t is not None and t.revision == 2 and t.backfilled

    async def fed() -> bool:
        snap = await backend.snapshots.load(ref("o-1"))
        return snap is not None and snap.version == VERSIONS + 1

    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await eventually(backfilled, 10, "the table backfilled at revision 2")
        await backend.log.append(timer_commit("o-1", VERSIONS + 1, []))
        await eventually(fed, 10, "the feed folding a new commit on the rebuilt snapshot")
        sup.stop()

    snap = await backend.snapshots.load(ref("o-1"))
    assert snap is not None and snap.state_revision == 2
    assert snap.state == {"seen": VERSIONS + 1, "last": "ItemAdded"}
    assert await backend.rebuilds.pending(ORDER, 2, None, 100) == []


async def test_cli_status_and_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from wowd.stores.embedded import open_embedded

    db = tmp_path / "wowd.db"
    parts = 8  # the processes' settings (conftest.base_env): 8 partitions, 2 slots
    b = await open_embedded(settings(tmp_path, partitions=parts))
    try:
        await b.log.append_many([timer_commit(f"c-{i}", 1, []) for i in range(16)])
        held = await b.leases.acquire("wowd.demo", Owner(key="live"), 2, TTL, timedelta(seconds=1))
        assert held.lease is not None and held.lease.slot == 0  # a live replica holds partitions 0, 2, 4, 6
    finally:
        await b.close()
    env = base_env(db, WOWD_REDUCERS=json.dumps({"order": "tests.daemon.reducers:reducer_v2"}))
    for key in list(os.environ):
        if key.startswith("WOWD_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("WOWD_"):
            monkeypatch.setenv(key, value)

    async def run_wowd(*args: str) -> tuple[int, str, str]:
        """``wowd ARGS`` in-process (``main``, in a thread: it runs its own event loop); the
        root logger's handlers and level are given back (``main`` sets up its own)."""
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        capsys.readouterr()
        try:
            code = await anyio.to_thread.run_sync(main, list(args))
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, err = await run_wowd("snapshots", "status", "--json")
    assert code == 0, err
    assert json.loads(out) == [
        {
            "aggregate": "order",
            "reducer_revision": 2,
            "table": None,
            "target_revision": 2,
            "pending": 0,
            "partitions_done": 0,
            "partitions": parts,
        }
    ]

    code, out, err = await run_wowd("snapshots", "rebuild")
    assert code == 1 and "partitions 0,2..6 (4 partitions) have a live holder" in err

    args = ("snapshots", "rebuild", "--partitions", "1,3", "5", "7", "--json")
    code, out, err = await run_wowd(*args)
    assert code == 0, err
    [r] = json.loads(out)
    expected = sum(1 for i in range(16) if partition(f"c-{i}", parts) % 2 == 1)
    assert (r["outcome"], r["partitions"], r["rewritten"]) == ("rebuilt", [1, 3, 5, 7], expected)
    assert not r["backfilled"]
    assert r["table"]["revision"] == 2 and r["table"]["rebuilding"]

    code, out, err = await run_wowd("snapshots", "status")
    assert code == 0, err
    assert out.splitlines()[1].split() == ["order", "2", "2", "rebuilding", "0", f"4/{parts}"]

    code, out, err = await run_wowd("snapshots", "rebuild", "--aggregate", "nope")
    assert code == 2 and "no reducer configured for nope" in err

    # a reducer that raises: the report names the commit, and the command fails
    bad = next(f"c-{i}" for i in range(16) if partition(f"c-{i}", parts) == 1)
    b = await open_embedded(settings(tmp_path, partitions=parts))
    try:
        await b.log.append(commit(bad, 2, event("Explode")))
    finally:
        await b.close()
    monkeypatch.setenv("WOWD_REDUCERS", json.dumps({"order": "tests.daemon.reducers:reducer_exploding"}))
    code, out, err = await run_wowd("snapshots", "rebuild", "--partitions", "1", "--json")
    [r] = json.loads(out)
    assert code == 1 and (r["outcome"], r["partitions"]) == ("failed", [])
    assert r["error"] == f"reducer of order raised on {ref(bad)} v2: RuntimeError('reducer exploded')"
