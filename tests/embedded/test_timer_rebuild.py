"""The timer view rebuilt from the log in-process (the embedded engine and the rebuilder): one
aggregate type alone, the commits a replay may skip undecoded."""

from __future__ import annotations

import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from wowd.config import EmbeddedSettings, WowdSettings
from wowd.daemon.timer_rebuild import TimerRebuilder
from wowd.model import (
    AggregateRef,
    Command,
    Commit,
    DomainEvent,
    OnceRule,
    Timer,
    TimerChange,
    TimerStatus,
    deterministic_timer_id,
)
from wowd.stores.base import TIMER_VIEW_REBUILD, Backend
from wowd.stores.embedded import open_embedded
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_rebuild import may_write_timers
from wowd.stores.timer_rebuild import Finished

pytestmark = pytest.mark.anyio

CTX = "shop"


def _commit(aggregate: str, agg_id: str, *events: DomainEvent, deleted: bool = False, version: int = 1) -> Commit:
    return Commit(
        ref=AggregateRef(context=CTX, aggregate=aggregate, id=agg_id),
        version=version,
        command_id=uuid.uuid4().hex,
        request_id=uuid.uuid4().hex,
        create_time=int(time.time() * 1000),
        events=events or (DomainEvent(id=uuid.uuid4().hex, name="Noted", body={}),),
        deleted=deleted,
    )


def _scheduled(aggregate: str, agg_id: str, key: str) -> DomainEvent:
    return DomainEvent(
        id=uuid.uuid4().hex,
        name="TimerScheduled",
        body={
            "key": key,
            "due_at": int(time.time() * 1000) + 3_600_000,
            "target": {"context": CTX, "aggregate": aggregate, "id": agg_id},
            "command": {"name": "expire", "body": {}},
        },
    )


def _put(agg_id: str, key: str, *, version: int) -> Timer:
    """The put of an order's timer as the feed writes it for a commit at ``version`` (one
    partition), due in an hour."""
    owner = AggregateRef(context=CTX, aggregate="order", id=agg_id)
    return Timer(
        timer_id=deterministic_timer_id(owner, key, version),
        partition=0,
        owner=owner,
        key=key,
        version=version,
        due_at=int(time.time() * 1000) + 3_600_000,
        scheduled_at=0,
        target=owner,
        body=Command(name="expire").to_json(),
        rule=OnceRule(),
    )


async def test_only_the_aggregate_asked_is_rebuilt_the_others_kept_as_they_are(tmp_path: Path) -> None:
    settings = WowdSettings(context=CTX, partitions=4, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        await backend.log.append_many(
            [
                _commit("order", "o-1", _scheduled("order", "o-1", "k")),
                _commit("cart", "c-1", _scheduled("cart", "c-1", "k")),
                _commit("order", "o-2", _scheduled("order", "o-2", "k")),
                _commit("order", "o-2", deleted=True, version=2),  # its timers cancelled
            ]
        )
        lines: list[str] = []
        report = await TimerRebuilder(settings, backend, progress=lines.append).run()
        assert report.swapped and report.statuses == {"PENDING": 2, "CANCELLED": 1}
        assert lines[0].startswith(f"rebuild of the timer view of context {CTX!r}: replaying 4 commits")
        (cart,) = [t for t in await backend.timer_queries.scan(limit=10) if t.owner.aggregate == "cart"]
        assert await backend.firing.settle([TimerChange.park(cart, fence=0, reason="kept")]) == 1
        with closing(sqlite3.connect(settings.embedded.path, isolation_level=None)) as conn:
            conn.execute(f"DELETE FROM wow_timer__{CTX} WHERE aggregate = 'order'")

        report = await TimerRebuilder(settings, backend).run(aggregate="order")
        assert report.swapped and report.statuses == {"PENDING": 1, "CANCELLED": 1}  # the order type's
        by_owner = {t.owner.id: t for t in await backend.timer_queries.scan(limit=10)}
        assert set(by_owner) == {"o-1", "c-1"}
        assert by_owner["o-1"].status is TimerStatus.PENDING
        assert by_owner["c-1"].status is TimerStatus.PARKED and by_owner["c-1"].last_error == "kept"
    finally:
        await backend.close()


def test_a_replay_skips_undecoded_only_commits_that_write_nothing_to_the_view() -> None:
    assert not may_write_timers('{"events":[{"name":"Noted"}],"deleted":false}')
    assert not may_write_timers('{"events":[{"name":"Noted","body":{"deleted":false}}],"deleted":false}')
    assert may_write_timers('{"events":[{"name":"TimerScheduled"}],"deleted":false}')
    assert may_write_timers('{"events":[{"name":"TimerCancelled"}],"deleted":false}')
    assert may_write_timers('{"events":[],"deleted":true}')
    assert may_write_timers('{"events":[],"deleted": true}')
    assert may_write_timers('{"events":[{"body":{"deleted":false}}],"deleted":true}')
    assert may_write_timers('{"events":[{"name":"\\u0054imerScheduled"}],"deleted":false}')


async def test_expired_timers_are_failed_not_fired_unless_asked(tmp_path: Path) -> None:
    settings = WowdSettings(context=CTX, partitions=4, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        old = _scheduled("order", "o-1", "k")
        old.body["due_at"] = int(time.time() * 1000) - 8 * 86_400_000  # before the 7-day retention
        await backend.log.append_many(
            [_commit("order", "o-1", old), _commit("order", "o-2", _scheduled("order", "o-2", "k"))]
        )
        report = await TimerRebuilder(settings, backend).run(dry_run=True, fire_expired=True)
        assert (report.expired, report.statuses, report.swapped) == (0, {"PENDING": 2}, False)
        assert await backend.timer_queries.scan(limit=10) == []  # a dry run changes nothing
        report = await TimerRebuilder(settings, backend).run()
        assert (report.expired, report.statuses) == (1, {"PENDING": 1, "FAILED": 1})
        assert [(e[1], e[2]) for e in report.expired_listed] == [(f"{CTX}.order/o-1 (tenant (0))", "k")]
        (failed,) = await backend.timer_queries.scan(status=TimerStatus.FAILED, limit=10)
        assert failed.owner.id == "o-1" and (failed.last_error or "").startswith("expired, state unknown")
    finally:
        await backend.close()


def rebuild_of(settings: WowdSettings, backend: Backend) -> Any:
    """The embedded backend's rebuild of the whole timer view (:data:`TIMER_VIEW_REBUILD`), with
    the feed's projection."""
    from wowd.daemon.timer_rebuild import project_for, timer_view_consumer

    rebuilds = backend.capability(TIMER_VIEW_REBUILD)
    assert rebuilds is not None
    return rebuilds.rebuild(project=project_for(settings, None), consumer=timer_view_consumer(), aggregate=None)


async def replayed(engine: Any, batch_size: int) -> list[int]:
    """Locks, begins and replays the log to its end in batches of ``batch_size`` (in process):
    the commits of each batch."""
    await engine.acquire(60)
    await engine.begin()
    return [n async for n in engine.replay(batch_size=batch_size, workers=0)]


async def nothing() -> None:
    """The finishing transaction's tick: the embedded one pauses the writers itself."""


async def test_the_swap_catches_up_to_the_timer_views_checkpoints_and_no_further(tmp_path: Path) -> None:
    """What the feed applied after the replay read the log is read again in the finishing
    transaction, up to the timer view's checkpoint of each partition: the view swapped in is
    where the feed continues (a commit past the checkpoint is left to the feed)."""
    from wowd.daemon.timer_rebuild import timer_view_consumer

    settings = WowdSettings(context=CTX, partitions=1, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        await backend.log.append_many([_commit("order", "o-1", _scheduled("order", "o-1", "k"))])
        engine = rebuild_of(settings, backend)
        assert await replayed(engine, 100) == [1]
        last = 1
        # meanwhile: two more commits, the feed applied (checkpointed) the first of them only
        await backend.log.append_many(
            [
                _commit("order", "o-2", _scheduled("order", "o-2", "k")),
                _commit("order", "o-3", _scheduled("order", "o-3", "k")),
            ]
        )
        await backend.checkpoints.save_all(timer_view_consumer(), {0: {"seq": last + 1}}, 1)
        result = Finished()
        await engine.carry_over(expired_before=None, result=result)
        await engine.finish(swap=True, result=result, tick=nothing)
        assert result.swapped and result.caught_up == 1 and result.checkpoints == {0: last + 1}
        assert sorted(t.owner.id for t in await backend.timer_queries.scan(limit=10)) == ["o-1", "o-2"]
        await engine.release()
        await engine.close()
    finally:
        await backend.close()


async def test_the_swap_catches_up_on_a_new_types_put_a_cancel_and_a_deleted_aggregate(tmp_path: Path) -> None:
    """The commits read again in the finishing transaction are applied as the feed applies them:
    a put of an aggregate type the view has not met (its collection recorded), a cancel of one
    key (the owner's other key kept), every timer of a deleted aggregate cancelled, a cancel of a
    key with no timer kept as a tombstone (the put of an earlier commit replayed is refused)."""
    from wowd.daemon.timer_rebuild import timer_view_consumer

    settings = WowdSettings(context=CTX, partitions=1, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        await backend.log.append_many(
            [
                _commit("order", "o-1", _scheduled("order", "o-1", "a"), _scheduled("order", "o-1", "b")),
                _commit("order", "o-2", _scheduled("order", "o-2", "a"), _scheduled("order", "o-2", "b")),
            ]
        )
        engine = rebuild_of(settings, backend)
        assert await replayed(engine, 100) == [2]
        cancel_a = DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": "a"})
        await backend.log.append_many(
            [
                _commit("cart", "c-1", _scheduled("cart", "c-1", "k")),
                _commit("order", "o-1", cancel_a, version=2),
                _commit("order", "o-2", deleted=True, version=2),
                _commit("order", "o-3", cancel_a, version=2),
            ]
        )
        await backend.checkpoints.save_all(timer_view_consumer(), {0: {"seq": 6}}, 1)
        result = Finished()
        await engine.carry_over(expired_before=None, result=result)
        await engine.finish(swap=True, result=result, tick=nothing)
        assert result.swapped and result.caught_up == 4
        live = await backend.timer_queries.scan(limit=10)
        assert sorted((t.owner.aggregate, t.owner.id, t.key) for t in live) == [
            ("cart", "c-1", "k"),
            ("order", "o-1", "b"),
        ]
        with closing(sqlite3.connect(tmp_path / "w.db")) as conn:
            recorded = conn.execute("SELECT collection FROM wow_timer_aggregate WHERE aggregate = 'cart'").fetchall()
        assert recorded == [(f"wow_timer__{CTX}__cart",)]
        assert await backend.timers.put(_put("o-3", "a", version=1)) is False
        await engine.release()
        await engine.close()
    finally:
        await backend.close()


async def test_a_rebuilt_view_keeps_the_tombstone_of_a_cancel_no_put_preceded(tmp_path: Path) -> None:
    """A cancel of a key that holds no timer leaves a tombstone in the view rebuilt too (and none
    in the live view on a dry run): the put of an earlier commit the feed replays after the swap
    is refused, as on the view it replaced."""
    settings = WowdSettings(context=CTX, partitions=1, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        cancel = DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": "k"})
        await backend.log.append_many([_commit("order", "o-1", cancel, version=2)])
        report = await TimerRebuilder(settings, backend).run(dry_run=True)
        assert not report.swapped
        with closing(sqlite3.connect(tmp_path / "w.db")) as conn:
            assert conn.execute(f"SELECT count(*) FROM wow_timer__{CTX}").fetchone() == (0,)  # a dry run writes nothing
        report = await TimerRebuilder(settings, backend).run()
        assert report.swapped
        replayed = _put("o-1", "k", version=1)
        assert await backend.timers.put(replayed) is False
        assert await backend.timer_queries.find(replayed.owner, "k") is None
    finally:
        await backend.close()


async def test_a_change_of_the_live_view_after_the_carry_over_is_carried_by_the_swap(tmp_path: Path) -> None:
    settings = WowdSettings(context=CTX, partitions=1, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        await backend.log.append_many(
            [_commit("order", f"o-{i}", _scheduled("order", f"o-{i}", "k")) for i in range(3)]
        )
        await TimerRebuilder(settings, backend).run()  # the live view
        engine = rebuild_of(settings, backend)
        assert await replayed(engine, 100) == [3]
        result = Finished()
        await engine.carry_over(expired_before=None, result=result)
        # the timer loop parks one after the carry-over, before the swap
        (t,) = [t for t in await backend.timer_queries.scan(limit=10) if t.owner.id == "o-1"]
        assert await backend.firing.settle([TimerChange.park(t, fence=0, reason="late change")]) == 1
        await engine.finish(swap=True, result=result, tick=nothing)
        (parked,) = await backend.timer_queries.scan(status=TimerStatus.PARKED, limit=10)
        assert parked.owner.id == "o-1" and parked.last_error == "late change"
        await engine.release()
        await engine.close()
    finally:
        await backend.close()


def _rows(path: Path) -> list[tuple[object, ...]]:
    """The view's rows as a replay writes them (a tombstone's ``due_at`` is the time it was
    written: left out)."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        return conn.execute(
            f'SELECT timer_id, "partition", aggregate, owner_id, "key", version, status,'
            f" CASE WHEN status = 'PENDING' THEN due_at END, body, rule FROM wow_timer__{CTX} ORDER BY timer_id"
        ).fetchall()


@pytest.mark.process
async def test_a_replay_by_a_pool_of_processes_builds_the_view_a_replay_in_process_builds(tmp_path: Path) -> None:
    """The pool reads the log in ranges, each decoded and projected by the feed's projection in
    a process of its own, and the ranges are written in log order: the view is the same, down
    to the order of a cancel and a schedule of one key in ranges of two processes."""
    commits = []
    for i in range(12):
        commits.append(_commit("order", f"o-{i}", _scheduled("order", f"o-{i}", "k")))
    for i in range(0, 12, 3):  # cancelled, scheduled again and cancelled by a deletion, in later ranges
        cancel = DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": "k"})
        commits.append(_commit("order", f"o-{i}", cancel, version=2))
        commits.append(_commit("order", f"o-{i + 1}", _scheduled("order", f"o-{i + 1}", "k"), version=2))
        commits.append(_commit("order", f"o-{i + 2}", deleted=True, version=2))
        commits.append(_commit("cart", f"c-{i}", _scheduled("cart", f"c-{i}", "k")))
    paths = {workers: tmp_path / f"w{workers}.db" for workers in (0, 2)}
    found = {}
    for workers, path in paths.items():
        settings = WowdSettings(context=CTX, partitions=4, embedded=EmbeddedSettings(path=path))
        backend = await open_embedded(settings)
        try:
            await backend.log.append_many(commits)
            report = await TimerRebuilder(settings, backend, batch_size=3, workers=workers).run()
            found[workers] = (report.commits, report.statuses, _rows(path))
        finally:
            await backend.close()
    assert found[2] == found[0]
    assert found[0][:2] == (len(commits), {"PENDING": 8, "CANCELLED": 8})


async def test_a_replays_reads_walk_the_log_by_seq_not_by_an_index_of_the_whole_context(tmp_path: Path) -> None:
    """Each read of a replay starts where the last one ended on the log's primary key: a read
    through an index of the context would go over all of its commits, every batch."""
    from wowd.stores.embedded.timer_rebuild import rows_between

    settings = WowdSettings(context=CTX, partitions=4, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        await backend.log.append_many(
            [_commit("order", f"o-{i}", _scheduled("order", f"o-{i}", "k")) for i in range(5)]
        )
        engine = rebuild_of(settings, backend)
        statements: list[str] = []
        engine._reader.run_sync(lambda conn: conn.set_trace_callback(statements.append))  # type: ignore[attr-defined]
        try:
            assert await replayed(engine, 3) == [3, 2]
        finally:
            await engine.release()
            await engine.close()
        with closing(sqlite3.connect(settings.embedded.path, isolation_level=None)) as conn:
            conn.set_trace_callback(statements.append)
            assert [r[0] for r in rows_between(conn, CTX, 3, 5)] == [4, 5]
            conn.set_trace_callback(None)
            reads = [s for s in statements if s.startswith("SELECT") and "FROM log" in s]
            assert len(reads) == 4  # the replay's three (the last finds nothing) and the one here
            for statement in reads:
                plan = " ".join(str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {statement}"))
                assert "USING INTEGER PRIMARY KEY" in plan and "TEMP B-TREE" not in plan, plan
    finally:
        await backend.close()


async def test_a_claim_taken_before_the_swap_is_not_settled_onto_a_newer_row_of_its_key(tmp_path: Path) -> None:
    """The replay read a cancel the feed had not applied yet: the rebuilt row is newer than the
    claimed one. Settled after the swap, the claim (guarded by the revision it was claimed at)
    finds a revision past it and writes nothing: the cancelled timer stays cancelled, never
    released to fire."""
    settings = WowdSettings(context=CTX, partitions=1, embedded=EmbeddedSettings(path=tmp_path / "w.db"))
    backend = await open_embedded(settings)
    try:
        await backend.log.append_many([_commit("order", "o-1", _scheduled("order", "o-1", "k"))])
        await TimerRebuilder(settings, backend).run()  # the live view, as the feed left it
        timers = backend.firing
        (claimed,) = await timers.claim_due(
            frozenset({0}),
            int(time.time() * 1000) + 7_200_000,
            10,
            owner_key="a",
            fence=1,
            claim_until=int(time.time() * 1000) + 60_000,
        )
        # a cancel appended, not applied by the feed yet; the rebuild's replay reads it
        cancel = DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": "k"})
        await backend.log.append_many([_commit("order", "o-1", cancel, version=2)])
        engine = rebuild_of(settings, backend)
        assert await replayed(engine, 1) == [1, 1]  # the put and the cancel in batches of their own
        result = Finished()
        await engine.carry_over(expired_before=None, result=result)
        await engine.finish(swap=True, result=result, tick=nothing)
        assert result.swapped
        release = TimerChange.release(claimed, fence=1, due_at=int(time.time() * 1000), reason="changed")
        assert await timers.settle([release]) == 0
        with closing(sqlite3.connect(tmp_path / "w.db", isolation_level=None)) as conn:
            rows = conn.execute(f"SELECT owner_id, version, status FROM wow_timer__{CTX}").fetchall()
        assert rows == [("o-1", 2, "CANCELLED")]
        assert await timers.claim_due(frozenset({0}), int(time.time() * 1000) + 7_200_000, 10, owner_key="a", fence=1,
                                      claim_until=int(time.time() * 1000) + 60_000) == []  # fmt: skip
        await engine.release()
        await engine.close()
    finally:
        await backend.close()
