"""The embedded event sink: access stamps against the stream's latest document, item counts,
refused items. The protocol behaviour is in tests/contract/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wowd.errors import SinkWriteError
from wowd.metrics import REGISTRY
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
)
from wowd.stores.embedded.sink import AccessMemory, EmbeddedEventSink

pytestmark = pytest.mark.anyio

CTX = "ctx"
T0 = 1_700_000_000_000


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


async def test_a_streams_first_document_is_written_without_reading_the_stream(db_path: Path) -> None:
    """Version 1 has no document before it: the write reads nothing of the stream (a new
    aggregate costs its insert alone); a later version unknown to the sink reads its latest."""
    sink = EmbeddedEventSink(db_path, TYPE, capacity=0)
    await sink.prepare()
    statements: list[str] = []

    def trace(conn: Any) -> None:
        conn.set_trace_callback(statements.append)

    await sink._db.run(trace)
    try:
        await sink.write([commit("new", 1, A, 1)])
        assert not [s for s in statements if s.lstrip().upper().startswith("SELECT")], statements
        await sink.write([commit("new", 2, B, 2)])  # capacity 0: nothing remembered
        assert [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    finally:
        await sink._db.run(lambda conn: conn.set_trace_callback(None))
        await sink.close()
    reader = EmbeddedEventSink(db_path, TYPE)
    try:
        docs = await reader.documents(commit("new", 1, A, 1).ref)
    finally:
        await reader.close()
    assert [(d["version"], d["access"]) for d in docs] == [(1, B), (2, B)]


async def test_the_sinks_of_every_type_share_one_connection_and_a_bounded_memory(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sinks of 300 aggregate types, each written once: no thread, no descriptor and no
    sink kept per type, and the attributes remembered bounded for all types together (each type
    kept a connection, a thread and two descriptors forever; 600 types under 1,024 descriptors
    stalled the feed, then crashed the replica)."""
    import os
    import threading

    from wowd.config import EmbeddedSettings, WowdSettings
    from wowd.stores import base
    from wowd.stores.embedded import open_embedded

    monkeypatch.setattr(base, "SINKS_KEPT", 16)
    backend = await open_embedded(WowdSettings(context=CTX, partitions=8, embedded=EmbeddedSettings(path=db_path)))
    try:
        types = [AggregateType(context=CTX, aggregate=f"type-{i}") for i in range(300)]
        await backend.sink(types[0]).write([_of(types[0], "a-0")])
        threads, descriptors = threading.active_count(), len(os.listdir("/proc/self/fd"))
        for i, t in enumerate(types):
            await backend.sink(t).write([_of(t, f"a-{i}")])
        # none per type (300 types would be 300 threads and 600 descriptors more); a few of the
        # process's own may open or close meanwhile (a test worker's other resources)
        assert threading.active_count() <= threads + 2 and len(os.listdir("/proc/self/fd")) <= descriptors + 8
        assert len(backend._sinks) == 16
        for i, t in enumerate(types[:3]):  # made again after it was dropped: the same documents
            assert [d["aggregate_id"] for d in await backend.sink(t).documents(_of(t, f"a-{i}").ref)] == [f"a-{i}"]
    finally:
        await backend.close()


def _of(t: AggregateType, agg_id: str) -> Commit:
    return Commit(
        ref=AggregateRef(context=t.context, aggregate=t.aggregate, id=agg_id),
        version=1,
        command_id="c",
        request_id=f"r-{agg_id}",
        create_time=T0,
        access=A,
        access_version=1,
    )


def test_the_memory_of_written_attributes_is_bounded_for_every_type_together() -> None:
    memory = AccessMemory(capacity=100)
    for i in range(1000):
        memory.put(("ctx", f"type-{i % 50}", "(0)", f"a-{i}"), 1, "{}")
    assert len(memory) == 100 and memory.get(("ctx", "type-49", "(0)", "a-999")) == (1, "{}")
    memory.put(("ctx", "type-49", "(0)", "a-999"), 0, "{old}")  # an older record never replaces it
    assert memory.get(("ctx", "type-49", "(0)", "a-999")) == (1, "{}")
