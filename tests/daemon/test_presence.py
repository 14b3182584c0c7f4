"""The replica's presence record: heartbeats at start, every ttl/3 and after a change, deleted on a
graceful stop; a failed heartbeat is counted and warned about, and changes nothing else. Against a
scripted store, then a whole supervisor on the embedded store (a standby, then a holder)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from tests.factories import eventually
from tests.helpers import held_slot
from wowd import __version__, metrics
from wowd.config import EmbeddedSettings, HttpSettings, LeaseSettings, WowdSettings
from wowd.daemon.leases import HeldSlot, Presence
from wowd.daemon.replica import delivery, replica_of
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import Owner
from wowd.stores.base import Backend, ReplicaInfo, ReplicaState

pytestmark = pytest.mark.anyio


class ScriptedPresence:
    """Records every heartbeat and leave (monotonic time, what was written); ``fail`` makes the
    heartbeats raise it, ``hang`` makes them wait forever."""

    def __init__(self) -> None:
        self.beats: list[tuple[float, str, str, ReplicaInfo, timedelta]] = []
        self.left: list[tuple[float, str, str]] = []
        self.fail: Exception | None = None
        self.hang = False
        self.attempts = 0
        self._changed = anyio.Event()

    async def wait(self, attempts: int) -> None:
        with anyio.fail_after(5):
            while self.attempts < attempts:
                await self._changed.wait()

    async def heartbeat(self, namespace: str, owner_key: str, info: ReplicaInfo, ttl: timedelta) -> None:
        self.attempts += 1
        self._changed.set()
        self._changed = anyio.Event()
        if self.hang:
            await anyio.sleep_forever()
        if self.fail is not None:
            raise self.fail
        self.beats.append((anyio.current_time(), namespace, owner_key, info, ttl))

    async def leave(self, namespace: str, owner_key: str) -> bool:
        self.left.append((anyio.current_time(), namespace, owner_key))
        return True


def settings(ttl: float = 0.6, tolerance: float = 0.2) -> WowdSettings:
    return WowdSettings(partitions=8, lease=LeaseSettings(limit=2, ttl_s=ttl, tolerance_s=tolerance))


def failures(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("wowd_lease_heartbeat_failures_total", {"reason": reason}) or 0.0


async def test_a_standby_heartbeats_at_once_then_every_third_of_the_ttl() -> None:
    store = ScriptedPresence()
    presence = Presence(settings(ttl=0.9, tolerance=0.3), store, list, owner_key="me", host="h", pid=7)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        started = anyio.current_time()
        await tg.start(presence.run)
        await store.wait(3)
        presence.stop()
    (t0, ns, key, info, ttl), (t1, *_), (t2, *_) = store.beats[:3]
    assert t0 - started < 0.15  # at once, not a period later
    assert 0.27 <= t1 - t0 <= 0.6 and 0.27 <= t2 - t1 <= 0.6  # every ttl/3 = 0.3 s
    assert (ns, key, ttl) == ("wowd.demo", "me", timedelta(seconds=0.9))
    assert (info.host, info.pid, info.version, info.slots, info.state) == ("h", 7, __version__, (), "standby")
    assert [(ns_, key_) for _, ns_, key_ in store.left] == [("wowd.demo", "me")]
    assert store.left[0][0] >= store.beats[-1][0]  # deleted after the last heartbeat


async def test_a_change_heartbeats_at_once_with_the_slots_held_validly() -> None:
    store = ScriptedPresence()
    held: list[HeldSlot] = []
    presence = Presence(settings(ttl=30, tolerance=1), store, lambda: held, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(presence.run)
        await store.wait(1)
        held.extend(
            [held_slot(0, slot=3), held_slot(0, slot=1), held_slot(0, slot=2, valid_for=-1)]
        )  # slot 2: lease no longer valid
        changed = anyio.current_time()
        presence.changed()
        await store.wait(2)
        assert anyio.current_time() - changed < 1  # not the 10 s period
        presence.stop()
    assert [(b[3].state, b[3].slots) for b in store.beats] == [("standby", ()), ("holding", (1, 3))]
    assert len({b[3].instance for b in store.beats}) == 1  # one process, one instance


async def test_failed_heartbeats_are_counted_warned_once_a_minute_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ScriptedPresence()
    store.fail = StorageUnavailable("sqlite wowd.db: database is locked")
    presence = Presence(settings(ttl=0.3, tolerance=0.1), store, list, owner_key="me")  # type: ignore[arg-type]
    unavailable, error = failures("unavailable"), failures("error")
    caplog.set_level(logging.WARNING, logger="wowd.daemon.leases")
    async with anyio.create_task_group() as tg:
        await tg.start(presence.run)
        await store.wait(3)
        store.fail = StorageError("sqlite wowd.db: no such table: cosid_replica")
        await store.wait(5)
        store.fail = None
        await store.wait(7)
        presence.stop()
    assert failures("unavailable") - unavailable >= 3 and failures("error") - error >= 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert (
        "presence heartbeat of me failed" in warnings[0].getMessage()
        and "leases unaffected" in warnings[0].getMessage()
    )
    assert store.beats and store.left  # written again once the store answered, then deleted


async def test_a_hung_heartbeat_is_a_failed_one_and_the_next_is_sent() -> None:
    store = ScriptedPresence()
    store.hang = True
    presence = Presence(settings(ttl=0.3, tolerance=0.1), store, list, owner_key="me")  # type: ignore[arg-type]
    before = failures("unavailable")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(presence.run)
            await store.wait(2)  # the first one given up after the ttl
            presence.stop()
            store.hang = False
    assert failures("unavailable") - before >= 1 and store.left


# --------------------------------------------------------------------------- a whole replica


@pytest.fixture
def replica_settings(tmp_path: Path) -> WowdSettings:
    return WowdSettings(
        partitions=4,
        embedded=EmbeddedSettings(path=tmp_path / "wowd.db"),
        lease=LeaseSettings(limit=1, ttl_s=3, tolerance_s=0.5, owner_key="replica-b"),
        http=HttpSettings(host="127.0.0.1", port=0),
    )


async def records(backend: Backend) -> dict[str, ReplicaState]:
    return {r.owner_key: r for r in await backend.leases.replicas("wowd.demo")}


async def until(backend: Backend, check: Callable[[dict[str, ReplicaState]], bool]) -> dict[str, ReplicaState]:
    """The presence records, once ``check`` holds of them."""
    found: dict[str, ReplicaState] = {}

    async def holds() -> bool:
        nonlocal found
        found = await records(backend)
        return check(found)

    await eventually(holds, 10, "the presence records", every=0.02)
    return found


async def test_a_standby_replica_is_recorded_then_holds_then_leaves_on_a_graceful_stop(
    replica_settings: WowdSettings, backend: Backend
) -> None:
    blocker = await backend.leases.acquire("wowd.demo", Owner(key="replica-a"), 1, timedelta(seconds=60), timedelta(0))
    assert blocker.lease is not None
    sup = replica_of(replica_settings, backend, delivery(replica_settings, backend))
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        found = await until(backend, lambda f: "replica-b" in f)
        b = found["replica-b"]
        assert (b.state, b.slots, b.live, b.version) == ("standby", (), True, __version__)
        assert b.expires_at - b.seen_at == 3000  # the lease ttl, on the store clock

        assert await backend.leases.release(blocker.lease, 0)
        found = await until(backend, lambda f: f["replica-b"].state == "holding")
        assert found["replica-b"].slots == (0,) and found["replica-b"].started_at == b.started_at
        sup.stop()
    assert await records(backend) == {}  # left: deleted after its lease was released
    (slot,) = await backend.leases.slots("wowd.demo")
    assert slot.owner_key is None and slot.last_owner_key == "replica-b"


async def test_a_stop_ends_a_heartbeat_that_hangs_and_deletes_the_record() -> None:
    """A SIGTERM while the store does not answer a heartbeat: the heartbeat in flight is given up
    at once (not after the ttl) and the record's deletion is still sent."""
    store = ScriptedPresence()
    store.hang = True
    presence = Presence(settings(ttl=30, tolerance=1), store, list, owner_key="me")  # type: ignore[arg-type]
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            await tg.start(presence.run)
            await store.wait(1)
            presence.stop()
    assert [owner for _at, _ns, owner in store.left] == ["me"]


async def test_a_presence_stopped_before_it_runs_writes_nothing_and_deletes_the_record() -> None:
    """A SIGTERM during the start, before the presence loop runs: no heartbeat, the record's
    deletion still sent."""
    store = ScriptedPresence()
    presence = Presence(settings(), store, list, owner_key="me")  # type: ignore[arg-type]
    presence.stop()
    with anyio.fail_after(1):
        await presence.run()
    assert store.attempts == 0
    assert [owner for _at, _ns, owner in store.left] == ["me"]
