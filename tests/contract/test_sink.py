"""EventSink contract: every implementation passes these.

Refs are built from ``sink.type`` (the Elasticsearch fixture uses a fresh context per test).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from wowd.errors import InvalidInput, SinkWriteError
from wowd.model import MAX_COMMIT_DOCUMENT_BYTES, MAX_COMMIT_EVENTS, AccessStamp, AggregateRef, Commit, DomainEvent

pytestmark = pytest.mark.anyio

A = {"owner_id": "u-1", "space_id": "s-1", "tags": ["a"]}
B = {"owner_id": "u-2", "space_id": "s-1", "tags": ["a"]}
C = {"owner_id": "u-3", "space_id": "s-2", "tags": []}


def ref(sink: Any, id: str = "o-1", tenant: str = "t1") -> AggregateRef:
    return AggregateRef(context=sink.type.context, aggregate=sink.type.aggregate, id=id, tenant_id=tenant)


def commit(r: AggregateRef, version: int, access: Mapping[str, Any] = A, access_version: int = 1) -> Commit:
    return Commit(
        ref=r,
        version=version,
        command_id=f"cmd-{r.id}-{version}",
        request_id=f"req-{r.id}-{version}",
        create_time=1_700_000_000_000 + version,
        events=(DomainEvent(id=f"e-{version}", name="OrderChanged", body={"n": version}),),
        access=access,
        access_version=access_version,
    )


async def access_of(sink: Any, r: AggregateRef) -> list[tuple[int, Any, Any]]:
    return [(d["version"], d["access"], d["access_version"]) for d in await sink.documents(r)]


async def test_writing_the_same_records_twice_leaves_one_document_each(sink: Any) -> None:
    r1, r2 = ref(sink, "o-1"), ref(sink, "o-2", tenant="t2")
    records = [commit(r1, 1), commit(r1, 2), commit(r2, 1)]
    await sink.write(records)
    await sink.write(records)  # a retry or a replay: counts as written
    await sink.write([commit(r1, 2), commit(r1, 3)])  # overlapping
    docs = await sink.documents(r1)
    assert [d["version"] for d in docs] == [1, 2, 3]
    assert [d["request_id"] for d in docs] == ["req-o-1-1", "req-o-1-2", "req-o-1-3"]
    assert [d["version"] for d in await sink.documents(r2)] == [1]
    assert await sink.documents(ref(sink, "o-3")) == []
    await sink.write([])


async def test_a_document_holds_its_records_access_attributes(sink: Any) -> None:
    r = ref(sink)
    await sink.write([commit(r, 1, A, 1)])
    (doc,) = await sink.documents(r)
    assert doc["access"] == A and doc["access_version"] == 1


async def test_stamp_guard(sink: Any) -> None:
    r = ref(sink)
    await sink.write([commit(r, v, A, 1) for v in (1, 2, 3, 4)])
    # versions [1, 3]: access_version 1 is below 3
    assert await sink.stamp(r, B, 3, 1, 3) == 3
    assert await access_of(sink, r) == [(1, B, 3), (2, B, 3), (3, B, 3), (4, A, 1)]
    # the same stamp again: equal version and attributes, nothing to write
    assert await sink.stamp(r, B, 3, 1, 3) == 0
    # the same access version with other attributes (a new model's) is written
    assert await sink.stamp(r, C, 3, 2, 3) == 2
    assert await access_of(sink, r) == [(1, B, 3), (2, C, 3), (3, C, 3), (4, A, 1)]
    # an older stamp only reaches documents older than it
    assert await sink.stamp(r, A, 2, 1, 4) == 1
    assert await access_of(sink, r) == [(1, B, 3), (2, C, 3), (3, C, 3), (4, A, 2)]
    # another aggregate's documents are untouched
    other = ref(sink, "o-9")
    await sink.write([commit(other, 1, A, 1)])
    assert await sink.stamp(r, B, 9, 1, 9) == 4
    assert await access_of(sink, other) == [(1, A, 1)]


async def test_the_later_of_two_stamps_wins_whatever_their_order(sink: Any) -> None:
    r1, r2 = ref(sink, "o-1"), ref(sink, "o-2")
    await sink.write([commit(r, v, A, 1) for r in (r1, r2) for v in (1, 2, 3)])
    assert await sink.stamp(r1, B, 4, 1, 3) == 3
    assert await sink.stamp(r1, C, 5, 1, 3) == 3
    assert await sink.stamp(r2, C, 5, 1, 3) == 3
    assert await sink.stamp(r2, B, 4, 1, 3) == 0
    assert await access_of(sink, r1) == await access_of(sink, r2) == [(v, C, 5) for v in (1, 2, 3)]


async def test_stamp_all_applies_each_stamp_under_its_own_guard(sink: Any) -> None:
    r1, r2 = ref(sink, "o-1"), ref(sink, "o-2")
    await sink.write([commit(r, v, A, 1) for r in (r1, r2) for v in (1, 2, 3)])
    page = [
        AccessStamp(ref=r1, access=B, as_of=2, from_=1, until=2),
        AccessStamp(ref=r2, access=C, as_of=3, from_=2, until=3),
        AccessStamp(ref=r2, access=C, as_of=3, from_=1, until=1),
    ]
    assert await sink.stamp_all(page) == 5
    assert await sink.stamp_all(page) == 0
    assert await access_of(sink, r1) == [(1, B, 2), (2, B, 2), (3, A, 1)]
    assert await access_of(sink, r2) == [(1, C, 3), (2, C, 3), (3, C, 3)]
    # stamps of one aggregate in one page, in either order: each document ends with the later
    await sink.stamp_all(
        [
            AccessStamp(ref=r1, access=C, as_of=3, from_=2, until=3),
            AccessStamp(ref=r1, access=A, as_of=1, from_=1, until=3),  # older than all: no effect
            AccessStamp(ref=r2, access=B, as_of=2, from_=1, until=3),  # older than r2's: no effect
        ]
    )
    assert await access_of(sink, r1) == [(1, B, 2), (2, C, 3), (3, C, 3)]
    assert await access_of(sink, r2) == [(1, C, 3), (2, C, 3), (3, C, 3)]
    assert await sink.stamp_all([]) == 0


async def test_write_stamps_a_changed_access_over_the_earlier_documents(sink: Any) -> None:
    r = ref(sink)
    await sink.write([commit(r, 1, A, 1), commit(r, 2, A, 1)])
    assert await access_of(sink, r) == [(1, A, 1), (2, A, 1)]
    # the aggregate's attributes change at version 3 (a later write than the earlier documents)
    await sink.write([commit(r, 3, B, 3), commit(r, 4, B, 3)])
    assert await access_of(sink, r) == [(v, B, 3) for v in (1, 2, 3, 4)]


async def test_write_stamps_the_last_change_of_each_aggregate_in_one_write(sink: Any) -> None:
    r1, r2, r3 = ref(sink, "o-1"), ref(sink, "o-2"), ref(sink, "o-3")
    await sink.write(
        [
            commit(r1, 1, A, 1),
            commit(r2, 1, A, 1),
            commit(r1, 2, B, 2),
            commit(r3, 1, A, 1),
            commit(r1, 3, C, 3),
            commit(r2, 2, A, 1),
            commit(r1, 4, C, 3),
        ]
    )
    assert await access_of(sink, r1) == [(v, C, 3) for v in (1, 2, 3, 4)]
    assert await access_of(sink, r2) == [(1, A, 1), (2, A, 1)]  # no change, no stamp
    assert await access_of(sink, r3) == [(1, A, 1)]


@pytest.mark.parametrize("over", ["events", "bytes"])
async def test_a_commit_over_the_event_index_caps_is_refused_on_every_backend(sink: Any, over: str) -> None:
    """The same commit has the same fate on every backend: over the events or the bytes an
    event-index document may hold, each sink refuses it, naming the cap (the feed quarantines it)."""
    r = ref(sink, "o-big")
    base = commit(r, 1)
    if over == "events":
        events = tuple(DomainEvent(id=f"e-{i}", name="OrderChanged", body={}) for i in range(MAX_COMMIT_EVENTS + 1))
    else:
        events = (DomainEvent(id="e-1", name="OrderChanged", body={"blob": "x" * MAX_COMMIT_DOCUMENT_BYTES}),)
    with pytest.raises((InvalidInput, SinkWriteError)) as info:
        await sink.write([replace(base, events=events)])
    assert "cap" in str(info.value)
    assert await sink.documents(r) == []
