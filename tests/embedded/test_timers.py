"""The embedded timer store: what only SQLite has (format records, shared files, query plans).
The protocol behaviour is in tests/contract/."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.timer_stores import embedded_timers
from wowd.errors import FormatError, InvalidInput
from wowd.model import (
    AggregateRef,
    Command,
    OnceRule,
    Timer,
    TimerChange,
    deterministic_timer_id,
    partition,
)
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_firing import due_sql
from wowd.stores.embedded.timer_rows import merge_due

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


def sql(path: Path, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(statement, params).fetchall()
        conn.commit()
        return rows
    finally:
        conn.close()


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
    with pytest.raises(InvalidInput, match="partition"):
        await store.view.put(replace(t, partition=t.partition + 1))
    with pytest.raises(InvalidInput, match="context"):
        await store.queries.find(AggregateRef(context="other", aggregate="order", id="a"), "k")
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
