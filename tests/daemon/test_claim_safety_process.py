"""Claims and poison rows, black-box (docs/concepts.md): real ``wowd run`` processes with the
http gateway against a local target.

- A target slower than ``claim_ttl_s``: the replica never re-sends a timer it is still delivering;
  each request id is sent once before its backoff.
- A stored timer whose rule no longer decodes: set FAILED with its reason; the replica stays up and
  its batch-mates are delivered.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from tests.delivery.conftest import serving
from tests.factories import CONTEXT, commit, eventually, ref, scheduled, timer_commit
from tests.processes import Replica, base_env
from wowd.model import TimerStatus
from wowd.stores.base import Backend
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.slow]


class Target:
    """Answers every command after ``delay_s`` with ``status``; counts each request id."""

    def __init__(self, status: int, delay_s: float) -> None:
        self.status = status
        self.delay_s = delay_s
        self.sent: Counter[str] = Counter()
        self.times: dict[str, list[float]] = {}

    async def handle(self, request: web.Request) -> web.Response:
        rid = request.headers["Command-Request-Id"]
        self.sent[rid] += 1
        self.times.setdefault(rid, []).append(time.monotonic())
        await anyio.sleep(self.delay_s)
        return web.Response(status=self.status)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Target], Awaitable[str]]]:
    """Starts a target on a local port for the test; answers its URL."""
    async with AsyncExitStack() as started:

        async def start(target: Target) -> str:
            _srv, url = await started.enter_async_context(serving(target.handle))
            return url

        yield start


async def test_a_target_slower_than_the_claim_gets_each_request_once_before_its_backoff(
    db: Path, stores: Backend, spawn: Callable[..., Replica], serve: Callable[[Target], Awaitable[str]]
) -> None:
    target = Target(status=503, delay_s=0.3)
    env = base_env(
        db, WOWD_LEASE__LIMIT=1, WOWD_GATEWAY__KIND="http", WOWD_GATEWAY__URL=await serve(target),
        WOWD_TIMERS__CLAIM_TTL_S=0.5, WOWD_TIMERS__BATCH=2, WOWD_TIMERS__BACKOFF_BASE_S=30,
        WOWD_GATEWAY__CONCURRENCY=1, WOWD_TIMERS__LOOKAHEAD_MS=0, WOWD_GATEWAY__BREAKER_FAILURES=100,
    )  # fmt: skip
    await stores.log.append_many([timer_commit(f"s-{i}", 1, ["k"]) for i in range(4)])
    # (the breaker is set out of reach: every answer is a 503, and this test is about the claims)
    r = spawn("slow", env)
    # four timers, one at a time, 0.3 s each: all sent once within ~1.2 s; claims of 0.5 s expire
    # meanwhile (a timer waits behind its batch-mate, batches wait for room) and the next retry is
    # 15-30 s away (backoff 30 s, jitter [0.5, 1]); a second send of a timer whose claim expired
    # comes within a delivery or two of the first, so a second after the fourth shows none
    await eventually(lambda: _all_sent(target, 4), 20, "four timers sent")
    settled_by = time.monotonic() + 1.0
    while time.monotonic() < settled_by:
        assert r.proc.poll() is None
        await anyio.sleep(0.2)
    assert len(target.sent) == 4
    assert all(n == 1 for n in target.sent.values()), target.sent


async def _all_sent(target: Target, n: int) -> bool:
    return len(target.sent) >= n


async def test_an_undecodable_timer_is_failed_and_its_batch_mates_are_delivered(
    db: Path, stores: Backend, spawn: Callable[..., Replica], serve: Callable[[Target], Awaitable[str]]
) -> None:
    target = Target(status=200, delay_s=0.0)
    due = int(time.time() * 1000) + 3_600_000  # brought forward once the row is edited
    commits = [timer_commit(f"g-{i}", 1, ["k"], due_at=due) for i in range(4)]
    every_minute = {"type": "cron", "expression": "* * * * *", "zone": "UTC"}
    ev = scheduled("k", due, target=ref("bad"), command={"name": "go"}, rule=every_minute)
    await stores.log.append_many([*commits, commit("bad", 1, ev, create_time=due)])
    env = base_env(db, WOWD_LEASE__LIMIT=1, WOWD_GATEWAY__KIND="http", WOWD_GATEWAY__URL=await serve(target))
    r = spawn("poison", env)
    await r.wait_ready()

    async def fed() -> bool:
        with sqlite3.connect(db) as conn:
            return bool(conn.execute(f"SELECT COUNT(*) FROM wow_timer__{CONTEXT}").fetchone()[0] == 5)

    await eventually(fed, 10, "five timers in the view")
    # the zone disappears from the replica's time zone database, and the five come due at once
    with sqlite3.connect(db) as conn:
        now = int(time.time() * 1000)
        conn.execute(
            f"UPDATE wow_timer__{CONTEXT} SET rule = CASE WHEN owner_id = 'bad' THEN ? ELSE rule END,"
            " due_at = ?, scheduled_at = ?",
            ('{"expression":"* * * * *","type":"cron","zone":"Europe/Gone"}', now, now),
        )
    await eventually(lambda: _all_sent(target, 4), 20, "the four good timers delivered")

    async def failed() -> bool:
        with sqlite3.connect(db) as conn:
            row = conn.execute(f"SELECT status, last_error FROM wow_timer__{CONTEXT} WHERE owner_id = 'bad'").fetchone()
        return bool(row and row[0] == TimerStatus.FAILED.value and "Europe/Gone" in row[1])

    await eventually(failed, 10, "the undecodable timer FAILED with its reason")
    assert r.proc.poll() is None  # alive
    assert "undecodable timer" in r.log()
