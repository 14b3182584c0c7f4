"""The delivery stream's lanes, window and settle groups, without a store or a clock: a target
that hangs holds only its own lane, the window bounds what is sent and not settled, the settler
writes a full group at once and a partial one after its linger."""

from __future__ import annotations

import anyio
import pytest

from tests.factories import Recorder, ref, timer
from wowd.daemon.stream import SETTLE_GROUP, DeliveryStream, Lane, Limits, Settler
from wowd.delivery import Outcome
from wowd.model import Timer, TimerChange


def sent(i: int, aggregate: str) -> Timer:
    """Order ``o-I``'s timer, sent to ``t-I`` of ``aggregate``."""
    return timer(f"o-{i}", target=ref(f"t-{i}", aggregate=aggregate))


def lanes(limit: int, concurrency: int) -> Limits:
    """A lane per target aggregate of ``limit`` calls at once, ``concurrency`` in all."""
    return Limits(concurrency=concurrency, lane_of=lambda t: Lane(t.target.aggregate, limit))


@pytest.mark.anyio
async def test_a_hanging_target_holds_only_its_own_slots() -> None:
    gw = Recorder()
    release = gw.hold("hang")
    done: list[Timer] = []

    def record(t: Timer, _outcome: Outcome) -> None:
        done.append(t)
        stream.settled(1)  # written at once: the window never fills

    stream = DeliveryStream(gw, lanes(4, 8), record, stopped=lambda: False)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            stream.bind(tg)
            stream.put([sent(i, "hang") for i in range(10)])
            stream.put([sent(100 + i, "ok") for i in range(200)])
            while len(done) < 200:
                await anyio.wait_all_tasks_blocked()
            # every healthy one delivered while the hanging target holds its 4 slots, no more
            assert gw.in_flight["hang"] == 4 and gw.peak["hang"] == 4
            assert gw.peak["ok"] <= 4
            assert stream.queued == 6
            release.set()
    assert len(done) == 210


@pytest.mark.anyio
async def test_the_window_bounds_what_is_sent_and_not_settled() -> None:
    gw = Recorder()
    recorded: list[Timer] = []
    limits = lanes(64, 16)
    window = limits.window
    assert window == 16 + SETTLE_GROUP
    stream = DeliveryStream(gw, limits, lambda t, _o: recorded.append(t), stopped=lambda: False)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            stream.bind(tg)
            stream.put([sent(i, "ok") for i in range(window + 100)])
            await anyio.wait_all_tasks_blocked()
            assert len(recorded) == window and stream.open == window  # nothing settled: the window is full
            stream.settled(15)
            await anyio.wait_all_tasks_blocked()
            assert len(recorded) == window + 15 and stream.open == window
            stream.settled(window + 100)
            await anyio.wait_all_tasks_blocked()
    assert len(recorded) == window + 100


def change(i: int) -> TimerChange:
    return TimerChange.fired(sent(i, "ok"), fence=1, next_due=None)


@pytest.mark.anyio
async def test_the_settler_writes_a_full_group_at_once_and_a_partial_one_after_its_linger() -> None:
    writes: list[int] = []
    written = anyio.Event()

    async def write(changes: list[TimerChange]) -> int:
        writes.append(len(changes))
        written.set()
        return len(changes)

    settler = Settler(write, lambda _c, _n: None, group=10, linger_s=30.0)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(settler.run)
            settler.add([change(i) for i in range(10)])
            await written.wait()
            assert writes == [10]  # a full group does not wait for the linger
            settler.add([change(i) for i in range(3)])
            await anyio.wait_all_tasks_blocked()
            assert writes == [10]  # a partial one waits (30 s here)
            tg.cancel_scope.cancel()
    await settler.drain(1.0)
    assert writes == [10, 3]
