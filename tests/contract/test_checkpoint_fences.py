"""Log contract, checkpoints against a holder one fence behind (docs/concepts.md, "Fence").

A takeover raises the slot's fence by exactly one, so the stale writer a checkpoint meets is the
previous holder at ``fence - 1``: its late checkpoints, written one at a time or several
partitions (and several views' consumers) at once, are refused whole and change no stored
position; the successor's, at ``fence + 1``, are admitted.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.contract.test_log import commit, entries, ids_in, read_all
from wowd.model import Position

pytestmark = pytest.mark.anyio

PARTS = [0, 1, 2, 5]
CONSUMERS = ["timers", "index"]
FENCE = 8


async def two_positions(log: Any) -> tuple[dict[int, Position], dict[int, Position]]:
    """Two commits in each of :data:`PARTS`: the positions of the first ones and of the second."""
    for p in PARTS:
        (a,) = ids_in(p, 1)
        await log.append_many([commit(a, 1), commit(a, 2)])
    first: dict[int, Position] = {}
    second: dict[int, Position] = {}
    for e in entries(await read_all(log, dict.fromkeys(PARTS))):
        (second if e.partition in first else first)[e.partition] = e.position
    assert first.keys() == second.keys() == set(PARTS)
    return first, second


async def stored(log: Any, consumer: str) -> dict[int, tuple[Position, int]]:
    return {p: (c.position, c.fence) for p, c in (await log.checkpoints(consumer, PARTS)).items()}


async def test_a_holder_one_fence_behind_overwrites_no_checkpoint_of_several_partitions(log: Any) -> None:
    early, late = await two_positions(log)
    assert await log.save_checkpoints(CONSUMERS, late, FENCE) is True
    held = {p: (late[p], FENCE) for p in PARTS}
    for consumer in CONSUMERS:
        assert await stored(log, consumer) == held

    # the previous holder, one fence behind, writes what it had read: all partitions, both views
    assert await log.save_checkpoints(CONSUMERS, early, FENCE - 1) is False
    assert await log.save_checkpoints(CONSUMERS[0], early, FENCE - 1) is False
    for consumer in CONSUMERS:
        assert await stored(log, consumer) == held, "a stale holder moved a checkpoint back"


async def test_a_holder_one_fence_behind_overwrites_no_single_checkpoint(log: Any) -> None:
    early, late = await two_positions(log)
    assert await log.save_checkpoints(CONSUMERS[0], late, FENCE) is True
    for p in PARTS:
        assert await log.save_checkpoint(CONSUMERS[0], p, early[p], FENCE - 1) is False
    assert await stored(log, CONSUMERS[0]) == {p: (late[p], FENCE) for p in PARTS}


async def test_the_successor_one_fence_ahead_writes_every_checkpoint(log: Any) -> None:
    early, late = await two_positions(log)
    assert await log.save_checkpoints(CONSUMERS, early, FENCE) is True
    assert await log.save_checkpoints(CONSUMERS, late, FENCE + 1) is True
    for consumer in CONSUMERS:
        assert await stored(log, consumer) == {p: (late[p], FENCE + 1) for p in PARTS}
    assert await log.save_checkpoint(CONSUMERS[0], 0, early[0], FENCE + 2) is True
    assert (await stored(log, CONSUMERS[0]))[0] == (early[0], FENCE + 2)
