"""The embedded timer store: what only SQLite has (format records, shared files, query plans).
The protocol behaviour is in tests/contract/."""

from __future__ import annotations

import functools
import random
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import sql
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.daemon.timer_plan import next_occurrence
from wowd.errors import FormatError, InvalidInput
from wowd.model import (
    AggregateRef,
    Command,
    IntervalRule,
    OnceRule,
    Timer,
    TimerChange,
    TimerWrite,
    deterministic_timer_id,
    partition,
)
from wowd.stores.base import OutboxRound, TimerSearch
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.sqlite import variable_limit
from wowd.stores.embedded.timer_firing import due_sql
from wowd.stores.embedded.timer_rows import merge_due
from wowd.stores.embedded.timer_view import WRITE_CHUNK, parked_params

pytestmark = pytest.mark.anyio

CTX, N = "ctx", 8
T0 = 1_700_000_000_000
TARGET = AggregateRef(context="billing", aggregate="invoice", id="inv-1")


def timer(id: str, *, aggregate: str = "order", due_at: int = T0, version: int = 1) -> Timer:
    owner = AggregateRef(context=CTX, aggregate=aggregate, id=id)
    return Timer(
        timer_id=deterministic_timer_id(owner, "k", version),
        partition=partition(id, N),
        owner=owner,
        key="k",
        version=version,
        due_at=due_at,
        scheduled_at=due_at,
        target=TARGET,
        body=Command(name="Remind").to_json(),
        rule=OnceRule(),
    )


async def test_timer_store_refuses_a_registry_of_another_format(db_path: Path) -> None:
    store = embedded_timers(db_path, context=CTX, partitions=N)
    await store.view.put(timer("a"))
    await store.close()
    sql(db_path, "UPDATE wow_timer_aggregate SET format = 4 WHERE collection = ?", ("wow_timer__ctx__order",))
    again = embedded_timers(db_path, context=CTX, partitions=N)
    with pytest.raises(FormatError, match="wow_timer__ctx__order.*format 4"):
        await again.prepare()
    await again.close()
    # another context on the same file is not concerned
    other = embedded_timers(db_path, context="other", partitions=N)
    await other.prepare()
    await other.close()


async def test_timer_store_refuses_a_timer_outside_its_owners_partition_or_context(db_path: Path) -> None:
    store = embedded_timers(db_path, context=CTX, partitions=N)
    t = timer("a")
    with pytest.raises(InvalidInput, match="partition") as outside:
        await store.view.put(replace(t, partition=t.partition + 1))
    assert outside.value.field == "partition"
    with pytest.raises(InvalidInput, match="context"):
        await store.queries.find(AggregateRef(context="other", aggregate="order", id="a"), "k")
    await store.close()


async def test_a_timer_store_of_one_partition_keeps_timers_and_one_of_none_is_refused(db_path: Path) -> None:
    store = embedded_timers(db_path, context=CTX, partitions=1)
    owner = AggregateRef(context=CTX, aggregate="order", id="a")
    t = replace(timer("a"), partition=0)
    assert await store.view.put(t)
    assert await store.queries.find(owner, "k") == t
    await store.close()
    with pytest.raises(InvalidInput) as refused:
        embedded_timers(db_path, context=CTX, partitions=0)
    assert refused.value.field == "partitions"


async def test_a_put_of_a_type_another_process_recorded_in_another_format_is_refused(db_path: Path) -> None:
    """A type's collection is checked at its first put: one another process (another version)
    recorded since this store prepared the file is refused, and nothing is written."""
    store = embedded_timers(db_path, context=CTX, partitions=N)
    await store.view.put(timer("a"))
    sql(
        db_path,
        "INSERT INTO wow_timer_aggregate (collection, context, aggregate, format, created_at) VALUES (?, ?, ?, 4, 0)",
        ("wow_timer__ctx__cart", CTX, "cart"),
    )
    with pytest.raises(FormatError, match="wow_timer__ctx__cart.*format 4"):
        await store.view.put(timer("b", aggregate="cart"))
    assert sql(db_path, "SELECT count(*) FROM wow_timer__ctx WHERE aggregate = 'cart'") == [(0,)]
    await store.close()


async def test_a_timer_of_a_type_no_read_has_met_yet_reads_back_whole(db_path: Path) -> None:
    """The owner and target of a row are checked when their (context, type) pair is first read,
    and rebuilt unchecked after that: the first read of a pair answers them as put."""
    fresh = f"kind-{uuid.uuid4().hex[:12]}"
    owner = AggregateRef(context=CTX, aggregate=fresh, id="a", tenant_id="t9")
    target = AggregateRef(context=f"to-{fresh}", aggregate=fresh, id="b", tenant_id="t8")
    t = replace(timer("a"), owner=owner, target=target, timer_id=deterministic_timer_id(owner, "k", 1))
    store = embedded_timers(db_path, context=CTX, partitions=N)
    assert await store.view.put(t)
    found = await store.queries.find(owner, "k")
    assert found == t
    assert found is not None and (found.owner, found.target) == (owner, target)
    await store.close()


async def test_the_listing_reads_answer_a_timer_whose_rule_this_version_cannot_read_as_one_shot(
    db_path: Path,
) -> None:
    """A rule another version wrote, unknown here, stops no operator's read: the timer is listed
    with a one-shot rule (firing it is what sets it FAILED)."""
    store = embedded_timers(db_path, context=CTX, partitions=N)
    t = replace(timer("a"), rule=IntervalRule(every_ms=60_000))
    assert await store.view.put(t)
    sql(db_path, "UPDATE wow_timer__ctx SET rule = ? WHERE owner_id = 'a'", ('{"type":"lunar"}',))
    listed = replace(t, rule=OnceRule())
    assert await store.queries.find(t.owner, "k") == listed
    assert await store.queries.scan(limit=10) == [listed]
    assert await store.queries.search(TimerSearch(), 10) == [listed]
    await store.close()


async def test_a_claim_sets_a_recurring_timer_whose_rule_this_version_cannot_read_failed(db_path: Path) -> None:
    store = embedded_timers(db_path, context=CTX, partitions=N)
    ts = [replace(timer(i, due_at=T0 + n), rule=IntervalRule(every_ms=60_000)) for n, i in enumerate(("a", "b"))]
    for t in ts:
        assert await store.view.put(t)
    sql(db_path, "UPDATE wow_timer__ctx SET rule = ? WHERE owner_id = 'a'", ('{"type":"lunar"}',))
    claimed = await store.firing.claim_due(set(range(N)), T0 + 10, 10, owner_key="me", fence=1, claim_until=T0 + 9_000)
    assert [c.owner.id for c in claimed] == ["b"]
    assert claimed[0].rule == IntervalRule(every_ms=60_000)
    ((status, error),) = sql(db_path, "SELECT status, last_error FROM wow_timer__ctx WHERE owner_id = 'a'")
    assert status == "FAILED" and "lunar" in str(error)
    await store.close()


async def test_the_outbox_shortcut_sets_a_recurring_timer_whose_rule_this_version_cannot_read_failed(
    db_path: Path,
) -> None:
    """Rather than delivering it once as a one-shot timer; the other recurring timer of the round
    is delivered and moves to its next occurrence."""
    store = embedded_timers(db_path, context=CTX, partitions=N)
    ts = [replace(timer(i, due_at=T0 + n), rule=IntervalRule(every_ms=60_000)) for n, i in enumerate(("a", "b"))]
    for t in ts:
        assert await store.view.put(t)
    sql(db_path, "UPDATE wow_timer__ctx SET rule = ? WHERE owner_id = 'a'", ('{"type":"lunar"}',))
    at = T0 + 10
    done = await store.firing.fire_into_outbox(
        OutboxRound(
            partitions=frozenset(range(N)),
            at=at,
            read_to=at,
            limit=10,
            owner_key="me",
            fence=1,
            next_due=next_occurrence,
        )
    )
    assert [f.timer_id for f in done.fired] == [ts[1].timer_id]
    assert sql(db_path, "SELECT owner_id, status, due_at FROM wow_timer__ctx ORDER BY owner_id")[1] == (
        "b",
        "PENDING",
        T0 + 1 + 60_000,
    )
    ((status, error),) = sql(db_path, "SELECT status, last_error FROM wow_timer__ctx WHERE owner_id = 'a'")
    assert status == "FAILED" and "lunar" in str(error)
    await store.close()


async def test_a_write_of_more_timers_than_one_transaction_takes_answers_each(db_path: Path) -> None:
    store = embedded_timers(db_path, context=CTX, partitions=N)
    writes = [TimerWrite.put(timer(f"w{i}")) for i in range(WRITE_CHUNK + 5)]
    assert await store.view.write(writes) == [1] * len(writes)
    assert len(await store.queries.scan(limit=len(writes) + 1)) == len(writes)
    await store.close()


async def test_parked_timers_of_more_targets_than_one_statement_names_are_read_in_due_order(db_path: Path) -> None:
    """A feed batch may name more targets than one statement's variables hold (four a target):
    the read is split, its answer still one list in due order."""
    store = embedded_timers(db_path, context=CTX, partitions=N)
    per = variable_limit_of(store) // 4
    targets = [AggregateRef(context="billing", aggregate="invoice", id=f"inv-{i}") for i in range(per + per // 2)]
    # parked timers of the first target of each statement and of the last target, the later
    # targets' due earlier, their ids in the opposite order
    parked = []
    for n, (i, timer_id) in enumerate(((0, "t-a"), (per, "t-b"), (len(targets) - 1, "t-c"))):
        t = replace(timer(f"p{i}", due_at=T0 + 10 - n), target=targets[i], timer_id=timer_id)
        assert await store.view.put(t)
        (loaded,) = [f for f in await store.queries.scan(limit=10) if f.timer_id == timer_id]
        assert await store.firing.settle([TimerChange.park(loaded, fence=1, reason="404")]) == 1
        parked.append(timer_id)
    want = list(reversed(parked))
    assert [t.timer_id for t in await store.view.parked_many(targets)] == want
    # in the caller's transaction (as the feed reads them beside its writes)
    params = parked_params(targets)
    read = store.view._db.transaction(functools.partial(store.view.parked_timers, params))
    assert [t.timer_id for t in await store.view._db.run(read)] == want
    await store.close()


async def test_due_reads_each_partition_over_the_partial_index(db_path: Path) -> None:
    store = embedded_timers(db_path, context=CTX, partitions=N)
    await store.prepare()
    plan = sql(db_path, "EXPLAIN QUERY PLAN " + due_sql(CTX), (1, T0))
    detail = " ".join(str(r[-1]) for r in plan)
    assert "USING INDEX wow_timer__ctx__due" in detail and "TEMP B-TREE" not in detail
    await store.close()


async def test_due_timers_are_read_in_one_statement_and_a_blob_another_program_wrote_stops_nothing(
    db_path: Path,
) -> None:
    """The due rows come as one value built by SQLite; a row holding a value JSON cannot hold
    (a BLOB) makes the read go row by row: the claim takes the other due timers and sets that
    one FAILED."""
    store = embedded_timers(db_path, context=CTX, partitions=N)
    try:
        ids = [f"o{i}" for i in range(6)]
        for i in ids:
            await store.view.put(timer(i, due_at=T0 + int(i[1:])))
        statements: list[str] = []
        store.view._db.run_sync(lambda conn: conn.set_trace_callback(statements.append))
        first = await store.firing.claim_due(
            set(range(N)), T0 + 100, 3, owner_key="me", fence=1, claim_until=T0 + 10_000
        )
        assert [t.owner.id for t in first] == ids[:3]
        assert sum(s.startswith("SELECT json_group_array(") for s in statements) == 1
        sql(db_path, "UPDATE wow_timer__ctx SET target_id = CAST(target_id AS BLOB) WHERE owner_id = 'o4'")
        rest = await store.firing.claim_due(
            set(range(N)), T0 + 100, 10, owner_key="me", fence=1, claim_until=T0 + 10_000
        )
        assert sorted(t.owner.id for t in rest) == ["o3", "o5"]  # o4 cannot be decoded: FAILED
        assert sql(db_path, "SELECT status FROM wow_timer__ctx WHERE owner_id = 'o4'") == [("FAILED",)]
    finally:
        store.view._db.run_sync(lambda conn: conn.set_trace_callback(None))
        await store.close()


def variable_limit_of(store: EmbeddedTimers) -> int:
    return store.view._db.run_sync(variable_limit)


def test_merge_due_takes_the_first_rows_of_sorted_streams() -> None:
    rng = random.Random(3)
    rows = [(f"id{n:04d}", 0, 0, 0, 0, 0, 0, 0, rng.randrange(50)) for n in range(500)]
    streams = [sorted((r for r in rows if int(r[0][2:]) % 7 == p), key=lambda r: (r[8], r[0])) for p in range(7)]
    expected = sorted(rows, key=lambda r: (r[8], r[0]))
    assert merge_due(streams, 40) == expected[:40]
    assert merge_due(streams, 10_000) == expected
    assert merge_due([], 5) == []


async def test_two_connections_on_one_file_share_timers(db_path: Path) -> None:
    db = SqliteDatabase(db_path)
    a = embedded_timers(db, context=CTX, partitions=N)
    b = embedded_timers(db_path, context=CTX, partitions=N)
    t = timer("shared")
    assert await a.view.put(t)
    (due,) = await b.firing.due({t.partition}, T0, 10)
    assert due == t
    assert await b.firing.settle([TimerChange.claim(due, owner_key="b", fence=1, until=T0 + 10)]) == 1
    # a's copy as loaded moved on
    assert await a.firing.settle([TimerChange.claim(due, owner_key="a", fence=1, until=T0 + 10)]) == 0
    await a.close()
    await b.close()
    # a store closes only what it opened: the shared database still answers
    assert await db.run(lambda c: c.execute("SELECT count(*) FROM wow_timer__ctx").fetchone()[0]) == 1
    db.close()


async def test_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.bench_embedded_timers import main

    await main(2_000, 500, 16)
    assert "fired 2000 timers" in capsys.readouterr().out
