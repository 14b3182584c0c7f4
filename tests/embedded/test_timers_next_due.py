"""The embedded ``next_due``: its statement reads the partial due index (EXPLAIN QUERY PLAN) one
seek per partition, and partitions beyond one statement's arms are read too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import ref
from tests.factories import timer as a_timer
from tests.timer_stores import embedded_timers
from wowd.model import Timer, partition
from wowd.stores.embedded.schema import timer_ddl, timer_table
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_firing import DUE_ARMS, next_due_sql

CTX = "ctx"


def timer(id: str, partitions: int, due_at: int) -> Timer:
    return a_timer(id, due_at, owner=ref(id, context=CTX), partitions=partitions)


def test_next_due_sql_seeks_the_partial_due_index_in_each_arm() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        for stmt in timer_ddl(CTX):
            conn.execute(stmt)
        sql = next_due_sql(CTX, 3)
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, (0, 1, 2, 3))]
        index = f"{timer_table(CTX)}__due"
        searches = [p for p in plan if p.startswith("SEARCH ") and timer_table(CTX) in p]
        assert len(searches) == 3, plan  # one per partition
        for p in searches:
            # equality on partition, range on due_at, over the partial index: no scan, no sort
            assert f"USING INDEX {index} (partition=? AND due_at>?)" in p, plan
        assert not any(p.startswith("SCAN ") and timer_table(CTX) in p for p in plan), plan
        assert not any("TEMP B-TREE" in p for p in plan), plan
    finally:
        conn.close()
    with pytest.raises(ValueError):
        next_due_sql(CTX, 0)


@pytest.mark.anyio
async def test_next_due_reads_every_statement_of_many_partitions(tmp_path: Path) -> None:
    parts = DUE_ARMS * 2 + 5  # three statements
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=parts)
    try:
        ids: dict[int, str] = {}
        for i in range(20_000):
            p = partition(f"o-{i}", parts)
            ids.setdefault(p, f"o-{i}")
            if len(ids) == parts:
                break
        # the earliest in the last statement's partitions, later ones in the first statements'
        last = max(ids)
        assert await store.view.put(timer(ids[last], parts, 5_000))
        assert await store.view.put(timer(ids[0], parts, 9_000))
        assert await store.view.put(timer(ids[DUE_ARMS], parts, 7_000))
        everything = frozenset(range(parts))
        assert await store.firing.next_due(everything, 0) == 5_000
        assert await store.firing.next_due(everything, 5_000) == 7_000
        assert await store.firing.next_due(everything - {last}, 0) == 7_000
        assert await store.firing.next_due(everything, 9_000) is None
    finally:
        await store.close()
