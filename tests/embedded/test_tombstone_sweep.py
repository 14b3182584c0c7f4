"""The embedded timer store's tombstone sweep (``TimerFiring.sweep``): it deletes the tombstones
made before its cut, oldest first and at most its limit, and no other; a put the deleted
tombstone refused is then written again (the store forgot the fired or cancelled timer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.contract.test_timer_view import owner, timer
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.clock import now_ms

pytestmark = pytest.mark.anyio

CONTEXT = "ctx"
CLOCK_SLACK_MS = 5
"""SQLite's ``now`` and Python's clock, each rounded to the millisecond, may differ by one."""


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[EmbeddedTimers]:
    s = embedded_timers(db_path, context=CONTEXT, partitions=8)
    await s.prepare()
    try:
        yield s
    finally:
        await s.close()


async def past(mark: int) -> int:
    """Now, once the clock is past ``mark`` by more than the slack (a few milliseconds)."""
    await anyio.sleep(max(0, mark + CLOCK_SLACK_MS + 2 - now_ms()) / 1000)  # time passing, nothing waited for
    now = now_ms()
    assert now > mark + CLOCK_SLACK_MS
    return now


async def test_the_sweep_deletes_the_tombstones_made_before_its_cut_and_no_other(store: EmbeddedTimers) -> None:
    ref = owner("o-1")
    first = now_ms() - CLOCK_SLACK_MS
    for key in ("old-1", "old-2", "old-3"):
        assert await store.view.cancel(ref, key, 1) is False  # a tombstone of a timer never put
    cut = await past(now_ms())
    await past(cut)
    assert await store.view.cancel(ref, "new", 1) is False
    assert await store.view.put(timer(ref, "live", version=1)) is True

    assert await store.firing.sweep(first, 100) == 0  # none made before the first one
    assert await store.firing.sweep(cut, 2) == 2  # the limit
    assert await store.firing.sweep(cut, 100) == 1
    assert await store.firing.sweep(cut, 100) == 0
    for key in ("old-1", "old-2", "old-3"):
        assert await store.view.put(timer(ref, key, version=1)) is True, f"{key}'s tombstone was not deleted"
    assert await store.view.put(timer(ref, "new", version=1)) is False, "a tombstone made after the cut was deleted"
    assert await store.queries.find(ref, "live") is not None


async def test_a_fired_timers_tombstone_is_swept_like_a_cancelled_ones(store: EmbeddedTimers) -> None:
    from wowd.model import TimerChange

    ref = owner("o-2")
    t = timer(ref, "once", version=1, due_at=now_ms() - 1000)
    assert await store.view.put(t) is True
    [claimed] = await store.firing.claim_due(
        frozenset(range(8)), now_ms(), 10, owner_key="k", fence=1, claim_until=now_ms() + 60_000
    )
    assert await store.firing.settle([TimerChange.fired(claimed, fence=1, next_due=None)]) == 1
    assert await store.view.put(t) is False  # fired: the replayed put is refused
    assert await store.firing.sweep(await past(now_ms()), 100) == 1
    assert await store.view.put(t) is True
