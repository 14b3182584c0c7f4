"""The presence records of the SlotLeaseStore (heartbeat, replicas, leave): every implementation
passes these.

Times are the store's: the tests compare what the store answers with its own ``store_now`` and
wait by polling its answers inside ``anyio.fail_after``; nothing here reads a client clock.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests.factories import eventually
from wowd.model import Owner
from wowd.stores.base import PRESENCE_RETENTION, ReplicaInfo, ReplicaState

pytestmark = pytest.mark.anyio

NS = "wowd.test"
LONG = timedelta(seconds=60)
SHORT = timedelta(milliseconds=200)


def info(instance: str = "i-1", slots: tuple[int, ...] = (), **kw: Any) -> ReplicaInfo:
    return ReplicaInfo(
        instance=instance, host=kw.get("host", "host-a"), pid=kw.get("pid", 41), version="1.2.3", slots=slots
    )


async def only(store: Any, namespace: str = NS) -> ReplicaState:
    (record,) = await store.replicas(namespace)
    assert isinstance(record, ReplicaState)
    return record


async def store_clock_after(store: Any, ms: int) -> None:
    """Waits until the store's clock (as its answers carry it) is past ``ms``."""

    async def check() -> bool:
        return bool((await only(store)).store_now > ms)

    await eventually(check, 5, f"the store's clock past {ms}", every=0.01)


async def test_a_heartbeat_writes_the_record_on_the_store_clock(lease_store: Any) -> None:
    await lease_store.heartbeat(NS, "host-a:41:aa", info(slots=(1, 0)), LONG)
    r = await only(lease_store)
    assert (r.namespace, r.owner_key, r.instance, r.host, r.pid, r.version) == (
        NS,
        "host-a:41:aa",
        "i-1",
        "host-a",
        41,
        "1.2.3",
    )
    assert r.state == "holding" and r.slots == (0, 1)
    assert r.started_at == r.seen_at <= r.store_now
    assert r.expires_at - r.seen_at == 60_000
    assert r.live


async def test_a_standby_is_recorded_with_no_slot(lease_store: Any) -> None:
    await lease_store.heartbeat(NS, "b", info(), LONG)
    r = await only(lease_store)
    assert (r.state, r.slots, r.live) == ("standby", (), True)


async def test_a_heartbeat_refreshes_the_one_record_and_keeps_the_instance_start(lease_store: Any) -> None:
    await lease_store.heartbeat(NS, "a", info(), LONG)
    first = await only(lease_store)
    await store_clock_after(lease_store, first.seen_at)
    await lease_store.heartbeat(NS, "a", info(slots=(3,)), LONG)
    again = await only(lease_store)
    assert again.started_at == first.started_at
    assert again.seen_at > first.seen_at and again.expires_at == again.seen_at + 60_000
    assert (again.state, again.slots) == ("holding", (3,))


async def test_another_instance_of_the_owner_key_starts_again(lease_store: Any) -> None:
    """A restart under a fixed owner key: the record is the same, its start is the new process's."""
    await lease_store.heartbeat(NS, "a", info("i-1", pid=41), LONG)
    first = await only(lease_store)
    await store_clock_after(lease_store, first.seen_at)
    await lease_store.heartbeat(NS, "a", info("i-2", pid=42), LONG)
    restarted = await only(lease_store)
    assert restarted.instance == "i-2" and restarted.pid == 42
    assert restarted.started_at == restarted.seen_at > first.started_at


async def test_replicas_lists_a_namespace_by_owner_key(lease_store: Any) -> None:
    for key in ("c", "a", "b"):
        await lease_store.heartbeat(NS, key, info(), LONG)
    await lease_store.heartbeat("wowd.other", "z", info(), LONG)
    assert [r.owner_key for r in await lease_store.replicas(NS)] == ["a", "b", "c"]
    assert [r.owner_key for r in await lease_store.replicas("wowd.other")] == ["z"]
    assert await lease_store.replicas("wowd.none") == []


async def test_an_expired_record_is_listed_as_not_live(lease_store: Any) -> None:
    """A replica that stopped heartbeating without leaving (killed) stays listed, not live, for
    the retention; another replica's heartbeat does not refresh it."""
    await lease_store.heartbeat(NS, "killed", info(), SHORT)
    await lease_store.heartbeat(NS, "alive", info(), LONG)
    killed = next(r for r in await lease_store.replicas(NS) if r.owner_key == "killed")

    async def expired() -> bool:
        states = {r.owner_key: r for r in await lease_store.replicas(NS)}
        return states["killed"].store_now >= killed.expires_at

    await eventually(expired, 5, "the killed replica's record expired", every=0.01)
    states = {r.owner_key: r for r in await lease_store.replicas(NS)}
    assert not states["killed"].live and states["killed"].seen_at == killed.seen_at
    assert states["alive"].live
    assert states["killed"].expires_at + PRESENCE_RETENTION // timedelta(milliseconds=1) > states["killed"].store_now


async def test_leave_deletes_the_record_once(lease_store: Any) -> None:
    await lease_store.heartbeat(NS, "a", info(), LONG)
    await lease_store.heartbeat(NS, "b", info(), LONG)
    assert await lease_store.leave(NS, "a") is True
    assert [r.owner_key for r in await lease_store.replicas(NS)] == ["b"]
    assert await lease_store.leave(NS, "a") is False
    assert await lease_store.leave("wowd.other", "b") is False  # another namespace's key
    assert [r.owner_key for r in await lease_store.replicas(NS)] == ["b"]


async def test_presence_never_touches_a_slot(lease_store: Any) -> None:
    held = await lease_store.acquire(NS, Owner(key="a"), 1, LONG, timedelta(0))
    assert held.acquired
    before = await lease_store.slots(NS)
    await lease_store.heartbeat(NS, "b", info(), LONG)
    await lease_store.heartbeat(NS, "a", info(slots=(0,)), LONG)
    assert await lease_store.leave(NS, "a")
    after = await lease_store.slots(NS)
    assert [(s.owner_key, s.fence, s.expires_at) for s in after] == [
        (s.owner_key, s.fence, s.expires_at) for s in before
    ]
    assert (await lease_store.acquire(NS, Owner(key="b"), 1, LONG, timedelta(0))).status == "exhausted"
