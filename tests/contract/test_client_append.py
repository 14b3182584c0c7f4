"""``WowdClient.append`` over every log: an application's own commit, of the log's schema, at an
expected version, idempotent by request id; refused as the feed would refuse it."""

from __future__ import annotations

from typing import Any

import pytest

from wowd.client import WowdClient
from wowd.errors import ConflictError, InvalidInput
from wowd.model import AggregateRef
from wowd.stores.base import Log

pytestmark = pytest.mark.anyio

ORDER = AggregateRef(context="ctx", aggregate="order", id="o-1")


def placed(request_id: str, **extra: Any) -> dict[str, Any]:
    """A commit as the schema writes it (no version: the client's to give)."""
    return {
        "aggregate_id": "o-1",
        "request_id": request_id,
        "events": [{"id": f"e-{request_id}", "name": "OrderPlaced", "body": {"total": 12}}],
        **extra,
    }


async def test_append_at_the_expected_version_is_idempotent_by_request_id(log: Log) -> None:
    client = WowdClient(log)
    first = await client.append("order", placed("r1"), expected_version=0)
    assert first.outcome == "appended" and first.commit.version == 1 and first.commit.ref == ORDER
    again = await client.append("order", placed("r1"), expected_version=0)  # a retry after a lost answer
    assert again.outcome == "duplicate"
    assert await log.last_version(ORDER) == 1
    with pytest.raises(ConflictError):  # the stream moved on: another request id holds version 1
        await client.append("order", placed("r2"), expected_version=0)
    second = await client.append("order", placed("r2"))  # no expected version: the next one
    assert second.outcome == "appended" and second.commit.version == 2
    third = await client.append("order", placed("r3", version=3, create_time=1_700_000_000_000))
    assert third.commit.version == 3 and third.commit.create_time == 1_700_000_000_000
    assert await log.last_version(ORDER) == 3
    # read back as the feed reads it
    read = [e.commit async for batch in log.read(dict.fromkeys(range(log.partitions)), follow=False)
            for e in batch.entries]  # fmt: skip
    assert [(c.version, c.request_id, c.events[0].name) for c in read if c is not None] == [
        (1, "r1", "OrderPlaced"),
        (2, "r2", "OrderPlaced"),
        (3, "r3", "OrderPlaced"),
    ]


async def test_append_refuses_what_the_feed_would_refuse_and_appends_nothing(log: Log) -> None:
    client = WowdClient(log)
    bad_timer = placed("r1", events=[{"id": "e", "name": "TimerScheduled", "body": {"key": "k", "due_at": "soon"}}])
    cases = [
        ({"aggregate_id": "o-1", "events": []}, "request_id"),
        (placed("r1", version=0), "version"),
        (bad_timer, "events[0].body.due_at"),
        (placed("r1", tenant_id=""), "tenant_id"),
    ]
    for doc, field in cases:
        with pytest.raises(InvalidInput) as caught:
            await client.append("order", doc)
        assert caught.value.field == field, (doc, caught.value)
    with pytest.raises(InvalidInput) as caught:
        await client.append("order", placed("r1", version=5), expected_version=1)
    assert caught.value.field == "version"
    with pytest.raises(InvalidInput) as caught:
        await client.append("Not A Name", placed("r1"))
    assert caught.value.field == "aggregate"
    assert await log.last_version(ORDER) == 0
