"""Checkpoints contract: a consumer's position per partition, fenced (a checkpoint written under
fence f is never overwritten under a fence below f). Positions are the log's: a test passes back
positions the log gave it.

Against a holder one fence behind (docs/concepts.md, "Fence"): a takeover raises the slot's
fence by exactly one, so the stale writer a checkpoint meets is the previous holder at
``fence - 1``: its late checkpoints, written one at a time or several partitions (and several
views' consumers) at once, are refused whole and change no stored position; the successor's, at
``fence + 1``, are admitted.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.contract.test_log import commit, entries, ids_in, read_all
from wowd.model import Position
from wowd.stores.base import Checkpoints

pytestmark = pytest.mark.anyio


async def test_checkpoint_fence_guard(log: Any, checkpoints: Checkpoints) -> None:
    (a,) = ids_in(2, 1)
    await log.append(commit(a, 1))
    await log.append(commit(a, 2))
    pos1, pos2 = (e.position for e in entries(await read_all(log, {2: None})))
    assert await checkpoints.save("feed", 2, pos1, 5) is True
    assert await checkpoints.save("feed", 2, pos2, 4) is False  # lower fence refused
    stored = (await checkpoints.read("feed", [2]))[2]
    assert stored.position == pos1 and stored.fence == 5 and stored.consumer == "feed" and stored.partition == 2
    assert await checkpoints.save("feed", 2, pos2, 5) is True  # same fence admitted
    assert (await checkpoints.read("feed", [2]))[2].position == pos2
    assert await checkpoints.save("feed", 2, pos1, 6) is True  # higher fence admitted
    assert (await checkpoints.read("feed", [2]))[2].fence == 6


async def test_checkpoints_of_several_partitions_in_one_write_are_each_fenced(
    log: Any, checkpoints: Checkpoints
) -> None:
    parts = [0, 1, 2, 5]
    for p in parts:
        (a,) = ids_in(p, 1)
        await log.append(commit(a, 1))
    positions = {e.partition: e.position for e in entries(await read_all(log, {p: None for p in parts}))}
    assert await checkpoints.save_all("feed", positions, 3) is True
    stored = await checkpoints.read("feed", parts)
    assert {p: (c.position, c.fence, c.partition) for p, c in stored.items()} == {
        p: (positions[p], 3, p) for p in parts
    }
    assert all(c.written_at > 0 for c in stored.values())
    # a higher fence wrote partition 1: the others are written, the write answers False
    assert await checkpoints.save("feed", 1, positions[1], 9) is True
    assert await checkpoints.save_all("feed", positions, 4) is False
    fences = {p: c.fence for p, c in (await checkpoints.read("feed", parts)).items()}
    assert fences == {0: 4, 1: 9, 2: 4, 5: 4}
    assert await checkpoints.save_all("feed", {p: positions[p] for p in (0, 2)}, 4) is True


async def test_checkpoints_are_per_consumer_and_partition(log: Any, checkpoints: Checkpoints) -> None:
    (a,) = ids_in(0, 1)
    await log.append(commit(a, 1))
    (pos,) = (e.position for e in entries(await read_all(log, {0: None})))
    assert await checkpoints.save("feed", 0, pos, 1)
    assert await checkpoints.read("feed", [0, 1]) == {0: (await checkpoints.read("feed", [0]))[0]}
    assert await checkpoints.read("other", [0]) == {}
    # a checkpoint resumes the read after it
    checkpoint = (await checkpoints.read("feed", [0]))[0]
    assert entries(await read_all(log, {0: checkpoint.position})) == []


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


async def stored(checkpoints: Checkpoints, consumer: str) -> dict[int, tuple[Position, int]]:
    return {p: (c.position, c.fence) for p, c in (await checkpoints.read(consumer, PARTS)).items()}


async def test_a_holder_one_fence_behind_overwrites_no_checkpoint_of_several_partitions(
    log: Any, checkpoints: Checkpoints
) -> None:
    early, late = await two_positions(log)
    assert await checkpoints.save_all(CONSUMERS, late, FENCE) is True
    held = {p: (late[p], FENCE) for p in PARTS}
    for consumer in CONSUMERS:
        assert await stored(checkpoints, consumer) == held

    # the previous holder, one fence behind, writes what it had read: all partitions, both views
    assert await checkpoints.save_all(CONSUMERS, early, FENCE - 1) is False
    assert await checkpoints.save_all(CONSUMERS[0], early, FENCE - 1) is False
    for consumer in CONSUMERS:
        assert await stored(checkpoints, consumer) == held, "a stale holder moved a checkpoint back"


async def test_a_holder_one_fence_behind_overwrites_no_single_checkpoint(log: Any, checkpoints: Checkpoints) -> None:
    early, late = await two_positions(log)
    assert await checkpoints.save_all(CONSUMERS[0], late, FENCE) is True
    for p in PARTS:
        assert await checkpoints.save(CONSUMERS[0], p, early[p], FENCE - 1) is False
    assert await stored(checkpoints, CONSUMERS[0]) == {p: (late[p], FENCE) for p in PARTS}


async def test_the_successor_one_fence_ahead_writes_every_checkpoint(log: Any, checkpoints: Checkpoints) -> None:
    early, late = await two_positions(log)
    assert await checkpoints.save_all(CONSUMERS, early, FENCE) is True
    assert await checkpoints.save_all(CONSUMERS, late, FENCE + 1) is True
    for consumer in CONSUMERS:
        assert await stored(checkpoints, consumer) == {p: (late[p], FENCE + 1) for p in PARTS}
    assert await checkpoints.save(CONSUMERS[0], 0, early[0], FENCE + 2) is True
    assert (await stored(checkpoints, CONSUMERS[0]))[0] == (early[0], FENCE + 2)


async def test_a_write_of_one_partition_is_fenced_as_a_write_of_several(log: Any, checkpoints: Checkpoints) -> None:
    early, late = await two_positions(log)
    assert await checkpoints.save_all(CONSUMERS[0], {2: late[2]}, FENCE) is True
    assert await stored(checkpoints, CONSUMERS[0]) == {2: (late[2], FENCE)}
    assert await checkpoints.save_all(CONSUMERS[0], {2: early[2]}, FENCE - 1) is False
    assert await stored(checkpoints, CONSUMERS[0]) == {2: (late[2], FENCE)}


async def test_a_write_of_no_positions_writes_nothing_and_is_not_refused(log: Any, checkpoints: Checkpoints) -> None:
    assert await checkpoints.save_all(CONSUMERS, {}, FENCE) is True
    assert await stored(checkpoints, CONSUMERS[0]) == {}


async def test_a_write_naming_no_consumer_writes_nothing_and_is_not_refused(log: Any, checkpoints: Checkpoints) -> None:
    assert await checkpoints.save_all([], {0: {"seq": 3}, 1: {"seq": 4}}, FENCE) is True
    assert await stored(checkpoints, CONSUMERS[0]) == {}
