"""A target's ``Retry-After`` through a replica's own retry (docs/delivery.md, "Retries"): a 503
that asks for two minutes is tried again two minutes later, not after the backoff's second; one
that asks for two hours is tried again after an hour, the cap; an HTTP date (not seconds) is no
hint and leaves the backoff. In-process: one replica (assembled as ``wowd run`` does, :mod:`wowd.daemon.replica`)
on an embedded file, delivering over the ``http`` gateway to a local target that answers 503."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from tests.delivery.conftest import serving
from tests.factories import embedded_settings, eventually, ref, timer
from wowd.backends import opened_backend
from wowd.clock import now_ms
from wowd.config import GatewaySettings, HttpSettings, LeaseSettings, TimerSettings, WowdSettings
from wowd.daemon.replica import delivery, replica_of
from wowd.model import Timer, TimerStatus
from wowd.stores.base import Backend

pytestmark = pytest.mark.anyio

PARTS = 8
HINTS = {"minutes": "120", "hours": "7200", "date": "Wed, 21 Oct 2015 07:28:00 GMT"}
"""The ``Retry-After`` each target aggregate answers its 503 with."""
HOUR_MS = 3_600_000
SLACK_MS = 2_000
"""From the request's arrival to the settle that writes the retry's due time, on a loaded machine."""


class Target:
    """Answers every command 503 with its aggregate's ``Retry-After``; notes when each arrived."""

    def __init__(self) -> None:
        self.arrived: dict[str, int] = {}
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        aggregate = request.path.split("/")[-3]  # .../{aggregate}/{id}/{command}
        self.arrived.setdefault(aggregate, now_ms())
        return web.Response(status=503, headers={"Retry-After": HINTS[aggregate]})


def settings(tmp_path: Path, url: str) -> WowdSettings:
    return embedded_settings(
        tmp_path,
        PARTS,
        lease=LeaseSettings(limit=1, ttl_s=30, tolerance_s=1),
        http=HttpSettings(host="127.0.0.1", port=0),
        gateway=GatewaySettings(kind="http", url=url, timeout_s=5),
        timers=TimerSettings(backoff_base_s=10.0, backoff_max_s=300.0),  # a first backoff of 5 to 10 s
    )


def aimed_at(aggregate: str) -> Timer:
    """Order ``o-AGGREGATE``'s timer, due now, sent to ``t-1`` of ``aggregate``."""
    return timer(f"o-{aggregate}", now_ms(), partitions=PARTS, target=ref("t-1", aggregate=aggregate))


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    t = Target()
    async with serving(t.handle) as (_srv, t.url):
        yield t


async def test_a_retry_after_is_honoured_up_to_an_hour_and_a_date_is_no_hint(tmp_path: Path, target: Target) -> None:
    s = settings(tmp_path, target.url)
    async with opened_backend(s) as backend:
        await retried_once(s, backend, target)
        delay = {}
        for aggregate in HINTS:
            t = await backend.timer_queries.find(aimed_at(aggregate).owner, "k")
            assert t is not None and t.status is TimerStatus.PENDING and t.attempts == 1, t
            assert t.last_error is not None and "503" in t.last_error
            delay[aggregate] = t.due_at - target.arrived[aggregate]
    assert 120_000 <= delay["minutes"] <= 120_000 + SLACK_MS, delay  # honoured: over the backoff's 5-10 s
    assert HOUR_MS <= delay["hours"] <= HOUR_MS + SLACK_MS, delay  # two hours asked, the hour's cap
    assert 5_000 <= delay["date"] <= 10_000 + SLACK_MS, delay  # no hint: the first backoff


async def retried_once(s: WowdSettings, backend: Backend, target: Target) -> None:
    """Runs a replica until each target's 503 is settled as a retry."""
    for aggregate in HINTS:
        assert await backend.timers.put(aimed_at(aggregate))

    async def settled() -> bool:
        found = [await backend.timer_queries.find(aimed_at(a).owner, "k") for a in HINTS]
        return all(t is not None and t.attempts == 1 and t.status is TimerStatus.PENDING for t in found)

    deliveries = delivery(s, backend)
    try:
        sup = replica_of(s, backend, deliveries)
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await eventually(settled, 15, "each 503 settled as a retry")
            sup.stop()
    finally:
        await deliveries.gateway.aclose()
