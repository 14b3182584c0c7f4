"""The embedded batched reads (``SnapshotStore.load_many``, ``TimerFiring.parked_many``): each
ref or target is one index search (EXPLAIN QUERY PLAN), a batch is one statement, and a batch
over SQLite's variable limit is split into as few statements as the limit allows, read whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.timer_stores import embedded_timers
from wowd.model import AggregateRef, Command, SnapshotRecord, Timer, TimerChange, deterministic_timer_id, partition
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.schema import snapshot_ddl as snapshot_ddl
from wowd.stores.embedded.schema import snapshot_table as snapshot_table
from wowd.stores.embedded.schema import timer_ddl as timer_ddl
from wowd.stores.embedded.schema import timer_table as timer_table
from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore, load_many_sql
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_view import parked_many_sql

pytestmark = pytest.mark.anyio

CTX = "ctx"
PARTITIONS = 4


def plan(ddl: list[str], sql: str, params: int) -> list[str]:
    conn = sqlite3.connect(":memory:")
    try:
        for stmt in ddl:
            conn.execute(stmt)
        return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, ("x",) * params)]
    finally:
        conn.close()


def scans_the_keys(steps: list[str]) -> bool:
    """The plan's loop is over the statement's keys (``k``, a ``VALUES`` list): SQLite names that
    step ``SCAN k``, or from 3.47 on ``SCAN <n>-ROW VALUES CLAUSE``."""
    return any(s == "SCAN k" or (s.startswith("SCAN ") and s.endswith("VALUES CLAUSE")) for s in steps)


def test_load_many_sql_searches_the_key_once_per_ref() -> None:
    steps = plan(snapshot_ddl(CTX), load_many_sql(CTX, 3), 7)
    table = snapshot_table(CTX)
    searches = [s for s in steps if table in s]
    assert searches == [
        f"SEARCH s USING INDEX sqlite_autoindex_{table}_1 (aggregate=? AND tenant_id=? AND aggregate_id=?)"
    ]
    assert scans_the_keys(steps), steps  # the loop is over the refs, the table only searched


def test_parked_many_sql_searches_the_parked_index_once_per_target() -> None:
    steps = plan(timer_ddl(CTX), parked_many_sql(CTX, 3), 12)
    table = timer_table(CTX)
    searches = [s for s in steps if table in s or s.startswith("SEARCH t")]
    assert searches == [
        f"SEARCH t USING INDEX {table}__parked "
        "(target_id=? AND target_aggregate=? AND target_tenant=? AND target_context=?)"
    ], steps
    assert scans_the_keys(steps), steps


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[SqliteDatabase]:
    db = SqliteDatabase(tmp_path / "wowd.db")
    try:
        yield db
    finally:
        db.close()


async def limited(
    database: SqliteDatabase, monkeypatch: pytest.MonkeyPatch | None = None, variables: int = 9
) -> list[str]:
    """With ``monkeypatch``: the variable limit the stores read (:func:`variable_limit`) is
    ``variables`` (9 by default: at most 4 refs or 2 targets a statement). Answers the list of the
    SELECTs the connection runs from now on."""
    selects: list[str] = []
    if monkeypatch is not None:
        for store in ("snapshots", "timer_view"):
            monkeypatch.setattr(f"wowd.stores.embedded.{store}.variable_limit", lambda conn: variables)

    def limit(conn: sqlite3.Connection) -> None:
        conn.set_trace_callback(lambda sql: selects.append(sql) if sql.lstrip().startswith("SELECT") else None)

    await database.run(limit)
    return selects


async def test_load_many_splits_only_under_the_variable_limit(
    database: SqliteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EmbeddedSnapshotStore(database, context=CTX)
    refs = [AggregateRef(context=CTX, aggregate="order", id=f"o-{i}", tenant_id=f"t{i % 2}") for i in range(10)]
    carts = [AggregateRef(context=CTX, aggregate="cart", id=f"c-{i}") for i in range(3)]
    stored = [
        SnapshotRecord(ref=r, version=i + 1, state_revision=1, state={"i": i}) for i, r in enumerate(refs + carts)
    ]
    await store.save_all([s for i, s in enumerate(stored) if i != 4])
    selects = await limited(database, monkeypatch)
    got = await store.load_many([*refs, *carts, refs[0]])
    assert got == {s.ref: s for i, s in enumerate(stored) if i != 4}
    reads = [s for s in selects if snapshot_table(CTX) in s]
    assert len(reads) == 3 + 1, reads  # 10 orders by 4 a statement, 3 carts in one


async def test_parked_many_splits_only_under_the_variable_limit(
    database: SqliteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = embedded_timers(database, context=CTX, partitions=PARTITIONS)
    targets = [AggregateRef(context="billing", aggregate="invoice", id=f"inv-{i}") for i in range(5)]
    parked = []
    for i, target in enumerate(targets):
        owner = AggregateRef(context=CTX, aggregate="order", id=f"o-{i}")
        t = Timer(
            timer_id=deterministic_timer_id(owner, "k", 1),
            partition=partition(owner.id, PARTITIONS),
            owner=owner,
            key="k",
            version=1,
            due_at=1_000 - i,
            scheduled_at=1_000 - i,
            target=target,
            body=Command(name="go").to_json(),
        )
        assert await store.view.put(t)
        found = await store.queries.find(owner, "k")
        assert found is not None
        assert await store.firing.settle([TimerChange.park(found, fence=1, reason="404")]) == 1
        parked.append(await store.queries.find(owner, "k"))
    selects = await limited(database, monkeypatch)
    got = await store.view.parked_many(targets)
    assert got == sorted(parked, key=lambda t: (t.due_at, t.timer_id))  # type: ignore[union-attr]
    reads = [s for s in selects if timer_table(CTX) in s]
    assert len(reads) == 3, reads  # 5 targets by 2 a statement


async def test_a_feed_batch_is_one_statement_per_type_and_one_for_its_targets(database: SqliteDatabase) -> None:
    snapshots = EmbeddedSnapshotStore(database, context=CTX)
    timers = embedded_timers(database, context=CTX, partitions=PARTITIONS)
    refs = [AggregateRef(context=CTX, aggregate=("order", "cart")[i % 2], id=f"a-{i}") for i in range(500)]
    await snapshots.save_all([SnapshotRecord(ref=r, version=1, state_revision=1, state={}) for r in refs[::3]])
    await timers.prepare()
    selects = await limited(database)
    assert len(await snapshots.load_many(refs)) == len(refs[::3])
    assert await timers.view.parked_many(refs) == []
    assert len([s for s in selects if snapshot_table(CTX) in s]) == 2  # one per type
    assert len([s for s in selects if timer_table(CTX) in s]) == 1
