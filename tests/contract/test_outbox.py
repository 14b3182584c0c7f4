"""Outbox contract: unique on the request id, entries by insertion order, taken under a lease."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from wowd.model import AggregateRef, Command, OutboxEntry

pytestmark = pytest.mark.anyio

TARGET = AggregateRef(context="ctx", aggregate="order", id="o-1", tenant_id="t1")


def entry(request_id: str, **kw: Any) -> OutboxEntry:
    values: dict[str, Any] = {
        "request_id": request_id,
        "timer_id": f"timer-{request_id}",
        "target": TARGET,
        "command": Command(name="Expire", body={"reason": request_id}).to_json(),
        "scheduled_at": 1_700_000_000_000,
        "fence": 3,
        "owner_key": "host-a:1:aa",
        "created_at": 1_700_000_000_123,
    }
    values.update(kw)
    return OutboxEntry(**values)


async def test_put_deduplicates_by_request_id(outbox: Any) -> None:
    first = entry("r-1")
    assert await outbox.put(first) is True
    # a re-fire (same request id, even from another holder) is not a second delivery
    assert await outbox.put(entry("r-1", fence=4, owner_key="host-b:2:bb", created_at=1)) is False
    assert await outbox.count() == 1
    assert await outbox.entries() == [first]


async def test_entries_by_insertion_order_with_limit_and_after(outbox: Any) -> None:
    puts = [entry(f"r-{n}") for n in (5, 1, 4, 2, 3)]
    for e in puts:
        assert await outbox.put(e)
    assert await outbox.count() == 5
    assert await outbox.entries() == puts
    assert await outbox.entries(limit=2) == puts[:2]
    assert await outbox.entries(limit=2, after=2) == puts[2:4]
    assert await outbox.entries(after=5) == []


async def test_empty_outbox(outbox: Any) -> None:
    assert await outbox.count() == 0
    assert await outbox.entries() == []


async def test_put_many_answers_per_entry_and_keeps_the_first_delivery(outbox: Any) -> None:
    assert await outbox.put(entry("r-1"))
    batch = [entry("r-2"), entry("r-1", fence=9), entry("r-3"), entry("r-2", fence=9)]
    # r-1 was there; the second r-2 of the batch is a repeat of the first one
    assert await outbox.put_many(batch) == [True, False, True, False]
    assert [e.request_id for e in await outbox.entries()] == ["r-1", "r-2", "r-3"]
    assert all(e.fence == 3 for e in await outbox.entries())
    assert await outbox.put_many([]) == []


async def test_take_leases_the_oldest_free_entries_and_ack_removes(outbox: Any) -> None:
    puts = [entry(f"r-{n}") for n in (5, 1, 4, 2, 3)]
    assert await outbox.put_many(puts) == [True] * 5
    first = await outbox.take(limit=2)
    assert list(first.entries) == puts[:2] and first.cursor is not None
    rest = await outbox.take(limit=10)  # the first two are held by the first take's lease
    assert list(rest.entries) == puts[2:] and rest.cursor not in (None, first.cursor)
    end = await outbox.take(limit=10)
    assert end.entries == () and end.cursor is None  # every entry is held
    assert await outbox.ack(["r-5", "r-1", "r-9"]) == 2  # r-9 is not there
    assert await outbox.ack(["r-5"]) == 0  # idempotent
    assert await outbox.count() == 3
    assert await outbox.put(entry("r-6"))  # written after the takes: the next take gets it
    assert [e.request_id for e in (await outbox.take()).entries] == ["r-6"]
    assert await outbox.ack(["r-6"]) == 1
    assert await outbox.put(entry("r-6", fence=4))  # fired again after its ack: a new entry, free
    assert [e.request_id for e in (await outbox.take()).entries] == ["r-6"]


async def test_an_entry_not_acknowledged_within_its_lease_is_taken_again(outbox: Any) -> None:
    import anyio

    await outbox.put_many([entry("r-1"), entry("r-2")])
    held = await outbox.take(limit=1, lease=timedelta(minutes=5))
    assert [e.request_id for e in held.entries] == ["r-1"]
    assert [e.request_id for e in (await outbox.take(limit=1, lease=timedelta(milliseconds=1))).entries] == ["r-2"]
    with anyio.fail_after(5):
        # nothing to wait on but the store's clock passing the 1 ms lease
        while not (again := await outbox.take()).entries:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert [e.request_id for e in again.entries] == ["r-2"]  # r-1 is still held


async def test_take_refuses_a_lease_under_a_millisecond(outbox: Any) -> None:
    from wowd.errors import InvalidInput

    with pytest.raises(InvalidInput, match="the lease of a take must be at least 1 ms") as refused:
        await outbox.take(lease=timedelta(0))
    assert refused.value.field == "lease"


async def test_a_take_of_nothing_is_an_empty_batch_and_an_ack_of_nothing_removes_nothing(outbox: Any) -> None:
    await outbox.put(entry("r-1"))
    batch = await outbox.take(limit=0)
    assert (tuple(batch.entries), batch.cursor) == ((), None)
    assert await outbox.ack([]) == 0
    assert [e.request_id for e in await outbox.entries()] == ["r-1"]


async def test_an_ack_of_many_removes_each_once_and_counts_them(outbox: Any) -> None:
    """An acknowledgement of more entries than one statement takes (a consumer that drained a
    backlog) removes every one and answers how many; ids given twice count once."""
    ids = [f"r-{i}" for i in range(1_200)]
    assert all(await outbox.put_many([entry(i) for i in ids]))
    assert await outbox.ack([*ids, *ids[:10]]) == 1_200
    assert await outbox.entries() == [] and await outbox.count() == 0


async def test_trim_removes_the_entries_created_before(outbox: Any) -> None:
    old, edge, new = (
        entry("r-old", created_at=1_000),
        entry("r-edge", created_at=2_000),
        entry("r-new", created_at=3_000),
    )
    await outbox.put_many([old, edge, new])
    assert await outbox.trim(2_000) == 1
    assert await outbox.entries() == [edge, new]
    assert await outbox.trim(2_000) == 0
