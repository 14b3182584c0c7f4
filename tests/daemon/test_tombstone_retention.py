"""A replica forgets the timers it fired or cancelled ``timers.tombstone_retention_s`` after it
did (docs/concepts.md, "Tombstones"), and not before: on the embedded backend its timer loop sweeps
the tombstones older than the retention and keeps the younger ones, which still refuse a replayed
put (a replay of the log within the retention fires nothing twice).

In-process: one replica (assembled as ``wowd run`` does, :mod:`wowd.daemon.replica`) on an embedded file whose
tombstones the test ages (their ``due_at`` is when they were made), one past the retention and
one well within it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import pytest

from tests.contract.test_timer_view import timer
from tests.factories import CONTEXT, embedded_settings, eventually
from wowd.clock import now_ms
from wowd.config import HttpSettings, LeaseSettings, TimerSettings, WowdSettings
from wowd.daemon.replica import delivery, replica_of
from wowd.model import AggregateRef
from wowd.stores.base import Backend

pytestmark = pytest.mark.anyio

PARTS = 8
RETENTION_S = 60
FAR = 10**13
"""A due time no test reaches: a put the sweep let through is never fired."""


def settings(tmp_path: Path) -> WowdSettings:
    return embedded_settings(
        tmp_path,
        PARTS,
        lease=LeaseSettings(limit=1, ttl_s=30, tolerance_s=1),
        http=HttpSettings(host="127.0.0.1", port=0),
        timers=TimerSettings(tombstone_retention_s=RETENTION_S),
    )


def owner(id: str) -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate="order", id=id, tenant_id="t1")


def age(db: Path, owner_id: str, made_at: int) -> None:
    """Dates the tombstones of ``owner_id`` back to ``made_at`` (ms)."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            n = conn.execute(
                f"UPDATE wow_timer__{CONTEXT} SET due_at = ? WHERE owner_id = ? AND status IN ('DONE', 'CANCELLED')",
                (made_at, owner_id),
            ).rowcount
        assert n == 1
    finally:
        conn.close()


async def test_the_loop_sweeps_the_tombstones_past_the_retention_and_keeps_the_younger(
    tmp_path: Path, backend: Backend
) -> None:
    old, young = owner("o-old"), owner("o-young")
    for ref in (old, young):
        assert await backend.timers.cancel(ref, "k", 1) is False  # a tombstone at version 1
    now = now_ms()
    age(tmp_path / "wowd.db", old.id, now - (RETENTION_S + 10) * 1000)
    age(tmp_path / "wowd.db", young.id, now - (RETENTION_S - 20) * 1000)

    async def old_forgotten() -> bool:
        # refused (writing nothing) while its tombstone is there
        return bool(await backend.timers.put(timer(old, "k", version=1, due_at=FAR)))

    sup = replica_of(settings(tmp_path), backend, delivery(settings(tmp_path), backend))
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await eventually(old_forgotten, 15, "the tombstone past the retention swept")
        sup.stop()
    # the same sweep's cut-off (now less the retention) kept the tombstone 20 s younger than it
    assert await backend.timers.put(timer(young, "k", version=1, due_at=FAR)) is False
