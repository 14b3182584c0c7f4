"""A cancel the feed reads in its very first batch after the loop claimed the timer ahead of its
due time still wins (docs/architecture.md, "Firing"): the claimed copy is settled back, never
delivered. In-process on the embedded backend, the loop claiming ahead (claim, deliver, settle;
no log check), the feed's reads held by the test so that the batch holding the cancel is the first
the feed reads after the claim, every time."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.factories import cancelled, commit, embedded_settings, eventually, timer_commit
from tests.helpers import HeldReads, hold_slot, timer_loop
from wowd.backends import opened_backend
from wowd.config import TimerSettings
from wowd.daemon.feed import Feeder
from wowd.daemon.waker import Waker
from wowd.delivery import OutboxGateway
from wowd.model import TimerStatus
from wowd.stores.base import Backend

pytestmark = pytest.mark.anyio

PARTS = 4
OWNERS = [f"o-{i}" for i in range(6)]
CANCELLED = {"o-0", "o-3"}


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async with opened_backend(embedded_settings(tmp_path, PARTS, sink="none")) as b:
        yield b


async def test_a_cancel_in_the_first_batch_read_after_the_claim_wins(tmp_path: Path, backend: Backend) -> None:
    reads = HeldReads(backend.log.read, hold_after_first=True)
    backend.log.read = reads  # type: ignore[method-assign]
    due = int(time.time() * 1000) + 800
    await backend.log.append_many([timer_commit(o, 1, ["k"], due_at=due) for o in OWNERS])
    held = await hold_slot(backend, PARTS, "a")
    waker = Waker()
    loop = timer_loop(backend.firing, OutboxGateway(backend.outbox), TimerSettings(batch=100, lookahead_ms=2_000),
        nudge=backend.log.nudge,
    )  # fmt: skip

    async def all_claimed() -> bool:
        return len(await backend.timer_queries.scan(status=TimerStatus.FIRING, limit=20)) == len(OWNERS)

    async def all_settled() -> bool:
        # each timer fired (delivered, then gone from the view) or cancelled (gone)
        return await backend.outbox.count() >= len(OWNERS) - len(CANCELLED) and not await backend.timer_queries.scan(
            limit=20
        )

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            await tg.start(Feeder(embedded_settings(tmp_path, PARTS, sink="none"), backend).run, held, waker)
            await reads.first_read.wait()
            await eventually(all_claimed, 5, "every timer claimed ahead of its due time")
            assert int(time.time() * 1000) < due - 200, "claimed too late for the test to say anything"
            await backend.log.append_many([commit(o, 2, cancelled()) for o in sorted(CANCELLED)])
            reads.release()  # the feed's next batch: the cancels
            await eventually(all_settled, 10, "the others delivered, the view empty")
            held.request_stop()
    delivered = sorted(e.target.id for e in await backend.outbox.entries())
    assert delivered == sorted(set(OWNERS) - CANCELLED)
