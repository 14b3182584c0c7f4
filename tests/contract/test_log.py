"""Log contract (docs/schema.md): appends, the log check, reads per partition.

Positions are opaque here: a test only passes back positions the log gave it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from tests.contract.conftest import CONTEXT, PARTITIONS
from tests.helpers import tailing
from wowd.errors import ConflictError
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
    DomainEvent,
    LogBatch,
    LogEntry,
    Position,
    partition,
)
from wowd.stores.base import OwnerProbe

pytestmark = pytest.mark.anyio

ORDER = AggregateType(context=CONTEXT, aggregate="order")
CART = AggregateType(context=CONTEXT, aggregate="cart")


def ids_in(p: int, count: int, prefix: str = "agg") -> list[str]:
    """Aggregate ids whose partition is ``p``."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        candidate = f"{prefix}-{i}"
        if partition(candidate, PARTITIONS) == p:
            found.append(candidate)
        i += 1
    return found


def commit(
    agg_id: str, version: int = 1, *, request_id: str | None = None, type: AggregateType = ORDER, **kw: Any
) -> Commit:
    return Commit(
        ref=AggregateRef(context=type.context, aggregate=type.aggregate, id=agg_id, tenant_id="t1"),
        version=version,
        command_id=f"cmd-{agg_id}-{version}",
        request_id=request_id or f"req-{agg_id}-{version}",
        create_time=1_700_000_000_000 + version,
        events=kw.pop("events", (DomainEvent(id=f"ev-{agg_id}-{version}", name="OrderChanged", body={"n": version}),)),
        header={"source": "test"},
        access={"owner_id": "u1", "space_id": "s1", "tags": ["a"]},
        access_version=version,
        **kw,
    )


async def read_all(log: Any, positions: dict[int, Position | None], batch_size: int = 500) -> list[LogBatch]:
    batches: list[LogBatch] = []
    with anyio.fail_after(10):
        async for batch in log.read(positions, batch_size=batch_size, follow=False):
            batches.append(batch)
    return batches


def entries(batches: Sequence[LogBatch]) -> list[LogEntry]:
    return [e for b in batches for e in b.entries]


# --------------------------------------------------------------------------- append


async def test_append_is_idempotent_by_request_id(log: Any) -> None:
    c = commit("o-1")
    assert await log.append(c) == "appended"
    assert await log.append(c) == "duplicate"
    found = entries(await read_all(log, {c.partition(PARTITIONS): None}))
    assert [e.commit for e in found] == [c]


async def test_append_conflicts_on_a_taken_version(log: Any) -> None:
    await log.append(commit("o-1", 1))
    with pytest.raises(ConflictError):
        await log.append(commit("o-1", 1, request_id="another-request"))
    assert await log.append(commit("o-1", 2)) == "appended"


async def test_append_many_answers_per_commit(log: Any) -> None:
    await log.append(commit("o-1", 1))
    outcomes = await log.append_many(
        [commit("o-2", 1), commit("o-1", 1), commit("o-1", 1, request_id="other"), commit("o-1", 2)]
    )
    assert outcomes == ["appended", "duplicate", "conflict", "appended"]
    assert await log.append_many([]) == []


async def test_last_version_is_the_highest_of_that_aggregate_alone(log: Any) -> None:
    ref = commit("o-1").ref
    assert await log.last_version(ref) == 0
    assert (
        await log.append_many([commit("o-1", 1), commit("o-1", 2), commit("o-1", 3), commit("o-2", 7)])
        == ["appended"] * 4
    )
    assert await log.last_version(ref) == 3
    assert await log.last_version(commit("o-2").ref) == 7
    assert await log.last_version(AggregateRef(context=CONTEXT, aggregate="order", id="o-1", tenant_id="t2")) == 0
    assert await log.last_version(commit("o-1", type=CART).ref) == 0


async def test_committed_after_answers_the_probes_a_later_commit_may_change(log: Any) -> None:
    """The log check at a due time: a probe whose aggregate has a commit above its version that
    cancels or schedules its key, or deletes the aggregate, is answered; one with no commit above
    its version never is (a backend may also answer one whose later commits touch other keys)."""
    cancel = DomainEvent(id="ev-cancel", name="TimerCancelled", body={"key": "k"})
    put_other = DomainEvent(id="ev-put", name="TimerScheduled", body={"key": "other", "due_at": 1})
    await log.append_many(
        [
            commit("o-1", 1),
            commit("o-1", 2, events=(cancel,)),  # cancels k of o-1 at version 2
            commit("o-2", 1),
            commit("o-3", 1),
            commit("o-3", 2, deleted=True),
            commit("o-4", 1),
            commit("o-4", 2, events=(put_other,)),
            commit("c-1", 1, type=CART),
            commit("c-1", 2, type=CART, events=(cancel,)),
        ]
    )

    def probe(agg_id: str, version: int, key: str | None = "k", type: AggregateType = ORDER) -> OwnerProbe:
        return OwnerProbe(
            AggregateRef(context=CONTEXT, aggregate=type.aggregate, id=agg_id, tenant_id="t1"), version, key
        )

    probes = [
        probe("o-1", 1),  # 0: the cancel of v2
        probe("o-1", 2),  # 1: nothing above v2
        probe("o-2", 1),  # 2: nothing above v1
        probe("o-3", 1),  # 3: deleted at v2
        probe("o-9", 0),  # 4: no commit at all
        probe("c-1", 1, type=CART),  # 5: another type, its own collection
        probe("o-2", 0, key=None),  # 6: any commit above v0
        probe("o-1", 1, key="other"),  # 7: the cancel of k does not change "other" (a backend may answer it)
        probe("o-4", 1),  # 8: v2 schedules another key (a backend may answer it)
    ]
    found = await log.committed_after(probes)
    assert found - {7, 8} == {0, 3, 5, 6}
    assert await log.committed_after([]) == set()


async def test_aggregate_types_lists_the_types_with_commits(log: Any) -> None:
    await log.append(commit("o-1"))
    await log.append(commit("c-1", type=CART))
    assert sorted(await log.aggregate_types()) == [CART, ORDER]


async def test_ping_and_prepare_again(log: Any) -> None:
    await log.ping()
    await log.prepare()  # idempotent
    assert await log.append(commit("o-1")) == "appended"


# --------------------------------------------------------------------------- read


async def test_read_yields_commits_in_log_order_with_partition_and_type(log: Any) -> None:
    (a,) = ids_in(3, 1)
    commits = [commit(a, v) for v in (1, 2, 3)]
    for c in commits:
        await log.append(c)
    found = entries(await read_all(log, {3: None}))
    assert [e.commit for e in found] == commits
    assert all(e.partition == 3 and e.aggregate == ORDER and e.error is None for e in found)
    assert found[0].raw["aggregate_id"] == a and found[0].raw["version"] == 1


async def test_read_only_the_given_partitions(log: Any) -> None:
    (a,), (b,), (c,) = ids_in(1, 1), ids_in(2, 1), ids_in(5, 1)
    for agg_id in (a, b, c):
        await log.append(commit(agg_id))
    found = entries(await read_all(log, {1: None, 5: None}))
    assert sorted(e.commit.ref.id for e in found if e.commit) == sorted([a, c])
    assert {e.partition for e in found} == {1, 5}


async def test_read_after_a_position_per_partition(log: Any) -> None:
    (a,), (b,) = ids_in(1, 1), ids_in(2, 1)
    for v in (1, 2, 3):
        await log.append(commit(a, v))
        await log.append(commit(b, v))
    everything = entries(await read_all(log, {1: None, 2: None}))
    pos_a2 = next(e.position for e in everything if e.commit and e.commit.ref.id == a and e.commit.version == 2)
    pos_b1 = next(e.position for e in everything if e.commit and e.commit.ref.id == b and e.commit.version == 1)
    found = entries(await read_all(log, {1: pos_a2, 2: pos_b1}))
    assert [(e.commit.ref.id, e.commit.version) for e in found if e.commit and e.commit.ref.id == a] == [(a, 3)]
    assert [(e.commit.ref.id, e.commit.version) for e in found if e.commit and e.commit.ref.id == b] == [
        (b, 2),
        (b, 3),
    ]


async def test_read_batches_carry_each_partitions_last_position(log: Any) -> None:
    (a,), (b,) = ids_in(1, 1), ids_in(2, 1)
    for v in (1, 2, 3):
        await log.append(commit(a, v))
        await log.append(commit(b, v))
    batches = await read_all(log, {1: None, 2: None}, batch_size=4)
    assert all(len(batch.entries) <= 4 for batch in batches)
    assert len(entries(batches)) == 6
    for batch in batches:
        for p, position in batch.positions.items():
            assert position == [e.position for e in batch.entries if e.partition == p][-1]
    # resuming from the last batch's positions finds nothing more
    last: dict[int, Position | None] = {}
    for batch in batches:
        last.update(batch.positions)
    assert entries(await read_all(log, last)) == []


async def test_read_follow_wakes_on_a_new_append(log: Any) -> None:
    (a,) = ids_in(4, 1)
    await log.append(commit(a, 1))
    seen: list[Commit] = []
    got_first, got_second = anyio.Event(), anyio.Event()

    async def tail() -> None:
        async for batch in log.read({4: None}, follow=True):
            seen.extend(e.commit for e in batch.entries if e.commit)
            if len(seen) >= 1:
                got_first.set()
            if len(seen) >= 2:
                got_second.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(tail)
        with anyio.fail_after(5):
            await got_first.wait()  # the reader is caught up and tailing now
        await log.append(commit(a, 2))
        with anyio.fail_after(5):
            await got_second.wait()
        tg.cancel_scope.cancel()
    assert [c.version for c in seen] == [1, 2]


async def test_malformed_documents_come_as_entries_naming_the_field(log: Any) -> None:
    (a,) = ids_in(6, 1)
    p = partition(a, PARTITIONS)
    bad_version = {
        "aggregate_id": a,
        "tenant_id": "t1",
        "partition": p,
        "version": "one",
        "request_id": "r-bad",
        "create_time": 1,
        "events": [],
    }
    no_events = {
        "aggregate_id": a,
        "tenant_id": "t1",
        "partition": p,
        "version": 7,
        "request_id": "r-x",
        "create_time": 1,
    }
    await log.insert_raw(ORDER, bad_version)
    await log.insert_raw(ORDER, no_events)
    await log.append(commit(a, 1))
    found = entries(await read_all(log, {p: None}))
    assert len(found) == 3
    # a partition read from the start may come in (aggregate_id, version) order (a collection
    # scan) or in append order (a log position): the entries, not their order, are the contract
    by_request = {e.raw["request_id"]: e for e in found}
    first, second, good = by_request["r-bad"], by_request["r-x"], by_request[commit(a, 1).request_id]
    assert first.commit is None and first.error and "version" in first.error
    assert first.raw["version"] == "one"
    assert second.commit is None and second.error and "events" in second.error
    assert good.commit is not None and good.error is None
    assert first.partition == p and first.aggregate == ORDER


def schema_minimal(agg_id: str, version: int, *events: dict[str, Any]) -> dict[str, Any]:
    """A commit as the published schema allows it at its least: no ``tenant_id`` (the default
    tenant), no ``partition`` (its aggregate id's), no ``_id``."""
    return {
        "aggregate_id": agg_id,
        "version": version,
        "request_id": f"req-{agg_id}-{version}",
        "create_time": 1_700_000_000_000 + version,
        "events": list(events),
    }


async def test_a_commit_without_tenant_or_partition_is_read_checked_and_counted(log: Any) -> None:
    """The schema requires neither ``tenant_id`` (absent: the default tenant) nor ``partition``
    (absent: its aggregate id's): such a commit is read in its aggregate id's partition as one of
    the default tenant, by a read from the start and by a following read; the log check and
    ``last_version`` see it."""
    (a,) = ids_in(3, 1, prefix="bare")
    ref = AggregateRef(context=CONTEXT, aggregate="order", id=a)  # the default tenant
    scheduled = {"name": "TimerScheduled", "body": {"key": "k", "due_at": 1, "target": {}, "command": {"name": "c"}}}
    await log.insert_raw(ORDER, schema_minimal(a, 1, scheduled))
    await log.insert_raw(ORDER, schema_minimal(commit("other").ref.id, 1))  # another partition's
    assert await log.last_version(ref) == 1
    async with tailing(log, {3: None}) as tail:
        await tail.until(lambda t: len(t.entries) >= 1)  # read from the start; tailing now
        await log.insert_raw(ORDER, schema_minimal(a, 2, {"name": "TimerCancelled", "body": {"key": "k"}}))
        await tail.until(lambda t: len(t.entries) >= 2)
    seen = tail.entries
    assert [(e.partition, e.error, e.commit and (e.commit.ref, e.commit.version)) for e in seen] == [
        (3, None, (ref, 1)),
        (3, None, (ref, 2)),
    ]
    assert await log.last_version(ref) == 2
    assert await log.committed_after([OwnerProbe(ref, 1, "k"), OwnerProbe(ref, 2, "k")]) == {0}


async def test_a_raw_document_colliding_with_a_stored_commit_is_a_conflict(log: Any) -> None:
    """A writer that retries an insert whose reply it lost finds its own document: a conflict it
    can tell from an outage, on every backend."""
    (a,) = ids_in(2, 1, prefix="raw")
    await log.insert_raw(ORDER, schema_minimal(a, 1))
    with pytest.raises(ConflictError):
        await log.insert_raw(ORDER, schema_minimal(a, 1))
