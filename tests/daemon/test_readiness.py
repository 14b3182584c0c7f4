"""``/readyz`` means "this replica is functioning" (a holder or a healthy standby);
``/readyz?holding=1`` also asks for a slot. The supervisor's answers, in-process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from wowd import metrics
from wowd.config import EmbeddedSettings, WowdSettings
from wowd.daemon.feed import Feeder
from wowd.daemon.leases import HeldSlot, SlotKeeper
from wowd.daemon.replica import delivery, replica_of
from wowd.daemon.stall import Stall
from wowd.errors import StorageFull, StorageUnavailable
from wowd.stores.base import Backend
from wowd.views import view_named

pytestmark = pytest.mark.anyio


def ready_gauge() -> float | None:
    """``wowd_ready`` as a scrape reads it."""
    return REGISTRY.get_sample_value("wowd_ready")


@pytest.fixture
def replica_settings(tmp_path: Path) -> WowdSettings:
    return WowdSettings(embedded=EmbeddedSettings(path=tmp_path / "wowd.db"))


async def test_a_standby_is_ready_until_its_stores_stop_answering(
    replica_settings: WowdSettings, backend: Backend
) -> None:
    sup = replica_of(replica_settings, backend, delivery(replica_settings, backend))
    await sup._ping()
    assert sup.readiness(False) == (True, "standby: no free slot in wowd.demo")
    assert sup.readiness(True) == (False, "standby: no free slot in wowd.demo")
    assert ready_gauge() == 1

    async def down() -> None:
        raise StorageUnavailable("sqlite wowd.db: unable to open database file")

    backend.log.ping = down  # type: ignore[method-assign]
    await sup._ping()
    assert sup.readiness(False) == (False, "the stores do not answer")
    assert ready_gauge() == 0


async def test_a_stalled_slot_makes_its_replica_not_ready_and_says_which(
    replica_settings: WowdSettings, backend: Backend
) -> None:
    sup = replica_of(replica_settings, backend, delivery(replica_settings, backend))
    await sup._ping()
    feeder = Feeder(replica_settings, backend)
    stalls = feeder.stalls_of(3)
    sup._feeders[3] = feeder
    logx = logging.LoggerAdapter(log)
    # another view's stall: still ready (it fires timers), and it says which view
    stalls[view_named("index")].stall("sink: StoreRefused: index_closed_exception", logx)
    ok, why = sup.readiness(False)
    assert ok and why.endswith("; index view of slot 3 stalled: sink: StoreRefused: index_closed_exception")
    assert ready_gauge() == 1
    # the timer view's stall: not ready, at once
    stalls[view_named("timers")].stall("sink: StorageError: database or disk is full", logx)
    assert sup.readiness(False) == (False, "slot 3 stalled: timers view: sink: StorageError: database or disk is full")
    assert ready_gauge() == 0  # at once, not at the next health check
    stalls[view_named("timers")].progressed(logx)
    assert sup.readiness(False)[0] is True
    assert ready_gauge() == 1


FULL = StorageFull("sqlite wowd.db: database or disk is full")
log = logging.getLogger("test.readiness")


async def test_a_stalled_timer_loop_makes_its_replica_not_ready_and_says_which(
    replica_settings: WowdSettings, backend: Backend
) -> None:
    sup = replica_of(replica_settings, backend, delivery(replica_settings, backend))
    await sup._ping()
    loop = sup.firing.loop()
    loop.stall = Stall("timer loop of slot 3", metrics.TIMERS_STALLED.labels(slot="3"))
    sup._loops[3] = loop
    assert sup.readiness(False)[0] is True
    loop.stall.failed("timer round", FULL, log)
    why = "slot 3 stalled: timer loop: timer round: StorageFull: sqlite wowd.db: database or disk is full"
    assert sup.readiness(False) == (False, why)
    assert ready_gauge() == 0
    loop.stall.progressed(log, "timer round")
    assert sup.readiness(False)[0] is True
    assert ready_gauge() == 1


async def test_a_keeper_whose_lease_writes_find_the_disk_full_makes_its_replica_not_ready(
    replica_settings: WowdSettings, backend: Backend
) -> None:
    """Between slots too: its lease lapsed and it cannot take one back, which no healthy standby
    is."""
    sup = replica_of(replica_settings, backend, delivery(replica_settings, backend))
    await sup._ping()

    async def work(held: HeldSlot) -> None:
        return None

    keeper = SlotKeeper(0, replica_settings, backend.leases, work, owner_key="a")
    sup._keepers = [keeper]
    keeper.stall.failed("lease acquire", FULL, log)
    assert sup.readiness(False) == (
        False,
        "slot keeper a: lease acquire: StorageFull: sqlite wowd.db: database or disk is full",
    )
    keeper.stall.progressed(log)
    assert sup.readiness(False) == (True, "standby: no free slot in wowd.demo")
