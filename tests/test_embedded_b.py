"""Embedded timers, snapshots and sink: what only SQLite has (format records, shared files,
query plans, metrics). The protocol behaviour is in tests/contract/."""

from __future__ import annotations

import random
import sqlite3
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from wowd.errors import FormatError, InvalidInput, SinkWriteError
from wowd.metrics import REGISTRY
from wowd.model import (
    AggregateRef,
    AggregateType,
    Command,
    Commit,
    OnceRule,
    SnapshotRecord,
    Timer,
    TimerChange,
    deterministic_timer_id,
    partition,
)
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.sink import EmbeddedEventSink
from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore, encode_state
from wowd.stores.embedded.timers import EmbeddedTimerStore, due_sql, merge_due

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


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "wowd.db"


def sql(path: Path, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(statement, params).fetchall()
        conn.commit()
        return rows
    finally:
        conn.close()


# --------------------------------------------------------------------------- timers


async def test_timer_store_refuses_a_registry_of_another_format(db_path: Path) -> None:
    store = EmbeddedTimerStore(db_path, context=CTX, partitions=N)
    await store.put(timer("a"))
    await store.close()
    sql(db_path, "UPDATE wow_timer_aggregate SET format = 4 WHERE collection = ?", ("wow_timer__ctx__order",))
    again = EmbeddedTimerStore(db_path, context=CTX, partitions=N)
    with pytest.raises(FormatError, match="wow_timer__ctx__order.*format 4"):
        await again.prepare()
    await again.close()
    # another context on the same file is not concerned
    other = EmbeddedTimerStore(db_path, context="other", partitions=N)
    await other.prepare()
    await other.close()


async def test_timer_store_refuses_a_timer_outside_its_owners_partition_or_context(db_path: Path) -> None:
    store = EmbeddedTimerStore(db_path, context=CTX, partitions=N)
    t = timer("a")
    with pytest.raises(InvalidInput, match="partition"):
        await store.put(replace(t, partition=t.partition + 1))
    with pytest.raises(InvalidInput, match="context"):
        await store.find(AggregateRef(context="other", aggregate="order", id="a"), "k")
    await store.close()


async def test_due_reads_each_partition_over_the_partial_index(db_path: Path) -> None:
    store = EmbeddedTimerStore(db_path, context=CTX, partitions=N)
    await store.prepare()
    plan = sql(db_path, "EXPLAIN QUERY PLAN " + due_sql(CTX), (1, T0))
    detail = " ".join(str(r[-1]) for r in plan)
    assert "USING INDEX wow_timer__ctx__due" in detail and "TEMP B-TREE" not in detail
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
    a = EmbeddedTimerStore(db, context=CTX, partitions=N)
    b = EmbeddedTimerStore(db_path, context=CTX, partitions=N)
    t = timer("shared")
    assert await a.put(t)
    (due,) = await b.due({t.partition}, T0, 10)
    assert due == t
    assert await b.settle([TimerChange.claim(due, owner_key="b", fence=1, until=T0 + 10)]) == 1
    # a's copy as loaded moved on
    assert await a.settle([TimerChange.claim(due, owner_key="a", fence=1, until=T0 + 10)]) == 0
    await a.close()
    await b.close()
    # a store closes only what it opened: the shared database still answers
    assert await db.run(lambda c: c.execute("SELECT count(*) FROM wow_timer__ctx").fetchone()[0]) == 1
    db.close()


async def test_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.bench_embedded_timers import main

    await main(2_000, 500, 16)
    assert "fired 2000 timers" in capsys.readouterr().out


# --------------------------------------------------------------------------- snapshots


def snap(id: str, version: int, state: dict[str, Any] | None = None, revision: int = 1) -> SnapshotRecord:
    r = AggregateRef(context=CTX, aggregate="order", id=id)
    return SnapshotRecord(ref=r, version=version, state_revision=revision, state=state or {"v": version})


async def test_snapshot_store_refuses_a_collection_of_another_format(db_path: Path) -> None:
    store = EmbeddedSnapshotStore(db_path, context=CTX)
    await store.save(snap("a", 1))
    await store.close()
    sql(db_path, "UPDATE wow_snapshot_aggregate SET format = 3 WHERE collection = 'wow_snapshot__ctx__order'")
    again = EmbeddedSnapshotStore(db_path, context=CTX)
    with pytest.raises(FormatError, match="format 3"):
        await again.create_collection("order")
    with pytest.raises(FormatError):
        await again.load(snap("a", 1).ref)
    await again.create_collection("cart")  # another type is fine
    await again.close()


def test_decimals_are_stored_as_tagged_strings() -> None:
    text = encode_state({"price": Decimal("0.10"), "n": [Decimal("1E+3")]})
    assert text == '{"price":{"$numberDecimal":"0.10"},"n":[{"$numberDecimal":"1E+3"}]}'
    with pytest.raises(TypeError):
        encode_state({"s": {1}})


async def test_concurrent_saves_from_two_connections_keep_the_highest_version(db_path: Path) -> None:
    stores = [EmbeddedSnapshotStore(db_path, context=CTX) for _ in range(2)]
    for s in stores:
        await s.prepare()
    versions = list(range(1, 61))
    random.Random(5).shuffle(versions)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i, v in enumerate(versions):
                tg.start_soon(stores[i % 2].save, snap("race", v))
    loaded = await stores[0].load(snap("race", 1).ref)
    assert loaded is not None and loaded.version == 60
    for s in stores:
        await s.close()


async def test_save_of_an_unstorable_state_raises_invalid_input(db_path: Path) -> None:
    store = EmbeddedSnapshotStore(db_path, context=CTX)
    with pytest.raises(InvalidInput, match="state"):
        await store.save(snap("a", 1, {"when": object()}))
    assert await store.load(snap("a", 1).ref) is None
    await store.close()


# --------------------------------------------------------------------------- sink

TYPE = AggregateType(context=CTX, aggregate="order")
A = {"owner_id": "u-1"}
B = {"owner_id": "u-2"}


def commit(id: str, version: int, access: dict[str, Any], access_version: int) -> Commit:
    return Commit(
        ref=AggregateRef(context=CTX, aggregate="order", id=id),
        version=version,
        command_id="c",
        request_id=f"r-{id}-{version}",
        create_time=T0,
        access=access,
        access_version=access_version,
    )


def items(status: str) -> float:
    return REGISTRY.get_sample_value("wowd_sink_items_total", {"status": status}) or 0.0


@pytest.mark.parametrize("capacity", [0, 1024])
async def test_a_new_sink_compares_with_the_streams_latest_stored_document(db_path: Path, capacity: int) -> None:
    first = EmbeddedEventSink(db_path, TYPE)
    await first.write([commit("o", 1, A, 1), commit("o", 2, A, 1)])
    await first.close()
    # a takeover: another sink (no memory of the stream) writes the next commits
    second = EmbeddedEventSink(db_path, TYPE, capacity=capacity)
    await second.write([commit("o", 3, B, 3)])
    await second.write([commit("o", 4, A, 4)])  # remembered (or read) as B: a change again
    docs = await second.documents(commit("o", 1, A, 1).ref)
    assert [(d["version"], d["access"], d["access_version"]) for d in docs] == [
        (1, A, 4),
        (2, A, 4),
        (3, A, 4),
        (4, A, 4),
    ]
    assert docs[0]["id"] == "%280%29:o:1" and docs[0]["owner_id"] == "u-1"
    await second.close()


async def test_sink_counts_created_and_existing_items(db_path: Path) -> None:
    sink = EmbeddedEventSink(db_path, TYPE)
    created, existing = items("201"), items("409")
    records = [commit("m", v, A, 1) for v in (1, 2, 3)]
    await sink.write(records)
    await sink.write(records[1:])
    assert (items("201") - created, items("409") - existing) == (3, 2)
    await sink.close()


async def test_sink_write_names_a_refused_item_and_keeps_the_others(db_path: Path) -> None:
    sink = EmbeddedEventSink(db_path, TYPE)
    bad = Commit(
        ref=AggregateRef(context=CTX, aggregate="order", id="x"),
        version=2,
        command_id="c",
        request_id="r",
        create_time=T0,
        header={"when": object()},
    )
    with pytest.raises(SinkWriteError, match="x:2"):
        await sink.write([commit("x", 1, A, 1), bad, commit("x", 3, A, 1)])
    assert [d["version"] for d in await sink.documents(bad.ref)] == [1, 3]
    other = EmbeddedEventSink(db_path, AggregateType(context=CTX, aggregate="cart"))
    with pytest.raises(SinkWriteError, match="not of this sink's type"):
        await other.write([commit("x", 4, A, 1)])
    await sink.close()
    await other.close()
