"""The embedded log reads a batch with one arm per partition (``UNION ALL`` ordered by ``seq``),
in statements of at most ``READ_ARMS`` arms merged in log order: a slot of any number of
partitions reads the same commits, in log order, as one query over all of them would, each
partition after its own position, within the batch size and the batch byte bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from wowd.model import AggregateRef, Commit, DomainEvent, LogBatch, Position, partition
from wowd.stores.embedded import log as embedded_log
from wowd.stores.embedded.log import READ_ARMS, EmbeddedLog, read_plan, read_sql
from wowd.stores.embedded.schema import LOG_SCHEMA
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = pytest.mark.anyio


def ids_in(partitions: int, each: int) -> dict[int, list[str]]:
    """``each`` aggregate ids in every partition of ``partitions``."""
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    i = 0
    while any(len(v) < each for v in found.values()):
        agg_id = f"o-{i}"
        p = partition(agg_id, partitions)
        if len(found[p]) < each:
            found[p].append(agg_id)
        i += 1
    return found


def ids_per_partition(partitions: int, each: int) -> list[str]:
    """``each`` aggregate ids in every partition of ``partitions``, interleaved across partitions."""
    found = ids_in(partitions, each)
    return [found[p][k] for k in range(each) for p in range(partitions)]


def commit(agg_id: str, version: int, pad: int = 0) -> Commit:
    ref = AggregateRef(context="ctx", aggregate="order", id=agg_id)
    body = {"pad": "x" * pad} if pad else {}
    ev = DomainEvent(id=f"{agg_id}-{version}", name="ItemAdded", body=body)
    return Commit(
        ref=ref, version=version, command_id="c", request_id=f"{agg_id}-{version}", create_time=1, events=(ev,)
    )


def stored(path: Path) -> list[tuple[int, int]]:
    """Every ``(seq, partition)`` of the log, in log order (the reference the reads must match)."""
    with sqlite3.connect(str(path)) as conn:
        return [(int(s), int(p)) for s, p in conn.execute("SELECT seq, partition FROM log ORDER BY seq")]


async def read_all(log: EmbeddedLog, positions: dict[int, Position | None], batch_size: int) -> list[LogBatch]:
    return [b async for b in log.read(positions, batch_size=batch_size, follow=False)]


def test_read_plan_groups_at_most_read_arms_partitions() -> None:
    assert read_plan([3]) == [(3,)]
    assert [len(g) for g in read_plan(range(64))] == [64]
    assert [len(g) for g in read_plan(range(65))] == [64, 1]
    assert [len(g) for g in read_plan(range(200))] == [64, 64, 64, 8]
    assert read_plan([5, 1, 3], arms=2) == [(1, 3), (5,)]
    assert READ_ARMS <= 500  # SQLite's limit of arms in a compound select


@pytest.mark.parametrize("arms", [1, 3, READ_ARMS])
def test_read_sql_merges_the_arms_in_index_order_without_a_sort(arms: int) -> None:
    conn = sqlite3.connect(":memory:")
    try:
        for statement in LOG_SCHEMA:
            conn.execute(statement)
        params = ("ctx", *(0,) * (2 * arms))
        steps = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + read_sql(arms, 10), params)]
    finally:
        conn.close()
    searches = [s for s in steps if s.startswith("SEARCH")]
    assert searches == ["SEARCH log USING INDEX log_partition (context=? AND partition=? AND seq>?)"] * arms
    assert not any("TEMP B-TREE" in s for s in steps), steps
    if arms > 1:
        assert "MERGE (UNION ALL)" in steps, steps


@pytest.mark.parametrize("partitions", [1, 64, 65, 200])
async def test_a_slot_reads_its_commits_in_log_order_within_the_batch_size(tmp_path: Path, partitions: int) -> None:
    path = tmp_path / "wowd.db"
    log = EmbeddedLog(path, context="ctx", partitions=partitions)
    try:
        ids = ids_per_partition(partitions, 2)
        await log.append_many([commit(i, 1) for i in ids])
        await log.append_many([commit(i, 2) for i in reversed(ids)])
        rows = stored(path)
        # the slot: every partition but the last (when there are several), each after its own
        # position (nothing read, its first commit read, all read)
        slot = list(range(partitions - 1)) if partitions > 1 else [0]
        first = {p: min(s for s, q in rows if q == p) for p in slot}
        last = {p: max(s for s, q in rows if q == p) for p in slot}
        start: dict[int, int] = {p: (0, first[p], last[p])[p % 3] for p in slot}
        positions: dict[int, Position | None] = {p: {"seq": s} if s else None for p, s in start.items()}
        batches = await read_all(log, positions, batch_size=7)
    finally:
        await log.close()
    expected = [(s, p) for s, p in rows if p in start and s > start[p]]
    read = [(e.position["seq"], e.partition) for b in batches for e in b.entries]
    assert read == expected
    assert all(e.commit is not None for b in batches for e in b.entries)
    with_entries = [b for b in batches if b.entries]
    assert all(len(b.entries) == 7 for b in with_entries[:-1])
    assert 1 <= len(with_entries[-1].entries) <= 7
    for b in batches:
        assert dict(b.positions) == {e.partition: e.position for e in b.entries}
    # a batch short of the batch size reached the head (it has a watermark), a full one did not
    assert [b.watermark is not None for b in batches] == [len(b.entries) < 7 for b in batches]


async def test_the_byte_bound_holds_over_several_statements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_log, "BATCH_BYTES", 10_000)
    partitions = READ_ARMS + 1
    path = tmp_path / "wowd.db"
    log = EmbeddedLog(path, context="ctx", partitions=partitions)
    try:
        # about 3 KB each, spread over both statements' partitions (the second one reads 64)
        found = ids_in(partitions, 3)
        picks = [(64, 0), (0, 0), (40, 0), (64, 1), (10, 0), (63, 0), (20, 0), (64, 2), (30, 0), (5, 0)]
        ids = [found[p][k] for p, k in picks]
        await log.append_many([commit(i, 1, pad=2_900) for i in ids])
        batches = await read_all(log, {p: None for p in range(partitions)}, batch_size=500)
        rows = stored(path)
    finally:
        await log.close()
    assert len({p for _s, p in rows} & set(range(READ_ARMS))) > 1
    assert any(p >= READ_ARMS for _s, p in rows)
    sizes = [len(b.entries) for b in batches if b.entries]
    assert sizes == [4, 4, 2]  # a batch stops at the fourth document (12 KB >= 10 KB)
    assert [e.position["seq"] for b in batches for e in b.entries] == [s for s, _p in rows]


async def test_a_batch_stops_at_four_mib_of_documents(tmp_path: Path) -> None:
    assert embedded_log.BATCH_BYTES == 4 * 1024 * 1024
    partitions = 65
    log = EmbeddedLog(tmp_path / "wowd.db", context="ctx", partitions=partitions)
    try:
        ids = ids_per_partition(partitions, 1)[:6]
        await log.append_many([commit(i, 1, pad=1024 * 1024) for i in ids])  # a little over 1 MiB each
        batches = await read_all(log, {p: None for p in range(partitions)}, batch_size=500)
    finally:
        await log.close()
    assert [len(b.entries) for b in batches if b.entries] == [4, 2]
    assert sorted(e.commit.ref.id for b in batches for e in b.entries if e.commit) == sorted(ids)
