"""``wowd demo`` spreads its commits over the orders asked for, however many chunks it appends."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from wowd.cli.backend import opened_backend
from wowd.config import EmbeddedSettings, WowdSettings
from wowd.demo import produce

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("orders", "versions"), [(1200, 1), (100, 12)])
async def test_the_commits_are_spread_over_every_order_across_chunks(
    tmp_path: Path, orders: int, versions: int
) -> None:
    s = WowdSettings(context="demo", partitions=4, embedded=EmbeddedSettings(path=tmp_path / "wowd.db"))
    async with opened_backend(s) as b:
        stats = await produce(b.log, commits=1200, timers=1200, due_in_ms=0, aggregates=orders, chunk=500)
        per_order: Counter[str] = Counter()
        async for batch in b.log.read({p: None for p in range(4)}, follow=False):
            for e in batch.entries:
                assert e.commit is not None
                per_order[e.commit.ref.id] += 1
    assert stats.commits == 1200 and stats.timers == 1200
    assert len(per_order) == orders
    assert set(per_order.values()) == {versions}
