"""The MongoDB timer store on the simulator: what its documents hold once written (tombstones),
beside the wire tests that assert the commands."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient

from tests.contract.test_timer_view import T0, owner, timer
from tests.timer_stores import mongo_timers
from wowd.model import TimerChange

pytestmark = pytest.mark.anyio

ALL = frozenset(range(8))


async def test_a_tombstone_after_a_fire_or_a_cancel_keeps_no_command_target_or_rule(
    sim_client: AsyncMongoClient[Any],
) -> None:
    """A tombstone answers for its key and version over the retention (7 days): the command's
    body (up to 64 KiB), the target, the rule and the claim are not kept with it."""
    client = sim_client
    store = mongo_timers(client, "tombstones", context="ctx", partitions=8)
    await store.prepare()
    fired, cancelled = timer(owner("o-1")), timer(owner("o-2"))
    assert await store.view.put(fired) and await store.view.put(cancelled)
    claimed_all = await store.firing.claim_due(ALL, T0 + 10, 10, owner_key="k", fence=1, claim_until=T0 + 10**9)
    [claimed] = [t for t in claimed_all if t.timer_id == fired.timer_id]
    assert await store.firing.settle([TimerChange.fired(claimed, fence=1, next_due=None)]) == 1
    assert await store.view.cancel(cancelled.owner, cancelled.key, cancelled.version + 1)
    docs = await client["tombstones"][store.view.collection_name("order")].find({}, {"_id": 0}).to_list(None)
    assert sorted(d["status"] for d in docs) == ["CANCELLED", "DONE"]
    for d in docs:
        assert not {"body", "target", "rule", "claim", "last_error"} & set(d), d
        assert {"partition", "owner", "key", "version", "expires_at", "revision"} <= set(d)
    await store.close()
