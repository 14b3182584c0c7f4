"""The status page served in-process over an embedded store holding a bit of everything (a
FAILED, a PARKED and two PENDING timers of order o-1, one PENDING of o-2, a quarantined commit,
two outbox entries), and the client a test reads it with."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.factories import CONTEXT, PARTITIONS, commit, outbox_entry, ref, timer
from tests.processes import SECRET_MONGO_PW, SECRET_TOKEN
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.daemon.http import HttpServer
from wowd.model import AggregateType, Command, Timer, TimerChange, commit_to_doc, partition
from wowd.stores.base import Backend
from wowd.ui import StatusPage

UI_TOKEN = "ui-token-5521-0123456789"
ORDER = AggregateType(context=CONTEXT, aggregate="order")


def order_timer(agg_id: str, key: str, due_at: int) -> Timer:
    """The timer ``key`` of order ``agg_id``, due at ``due_at``, sending ``expire-order``."""
    return timer(agg_id, due_at, key=key, command=Command(name="expire-order", body={"key": key}))


def settings(db: Path, token: str | None) -> WowdSettings:
    return WowdSettings(
        context=CONTEXT,
        partitions=PARTITIONS,
        embedded=EmbeddedSettings(path=db),
        lease=LeaseSettings(limit=2),
        ui={"token": token},
        gateway={"token": SECRET_TOKEN},
        mongodb={"uri": f"mongodb://wowd:{SECRET_MONGO_PW}@127.0.0.1:1/"},
    )


@dataclass
class Page:
    client: httpx.AsyncClient
    backend: Backend
    settings: WowdSettings
    now: int = 0
    """When the store was filled (ms): the timers' due times are relative to it."""

    async def html(self, path: str, status: int = 200) -> str:
        r = await self.client.get(path)
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("text/html")
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        return r.text

    async def api(self, path: str, status: int = 200) -> Any:
        r = await self.client.get(path)
        assert r.status_code == status, r.text
        assert r.headers["content-type"] == "application/json"
        return r.json()

    async def form_key(self, path: str) -> str:
        m = re.search(r'name="form_key" value="([0-9a-f]+)"', await self.html(path))
        assert m is not None, "the page has no action form"
        return m.group(1)


async def serve(db: Path, token: str | None) -> AsyncIterator[Page]:
    """The status page of a replica on ``db`` (``token``: its UI token), served in-process."""
    from wowd.stores.embedded import open_embedded

    s = settings(db, token)
    backend = await open_embedded(s)
    app = StatusPage(s, backend, local=lambda: {0: None, 1: "timers view: disk full"})
    server = HttpServer("127.0.0.1", 0, lambda holding: (True, "ok"), app=app)
    try:
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                yield Page(client, backend, s)
            tg.cancel_scope.cancel()
    finally:
        await backend.close()


@pytest.fixture
async def page(db: Path) -> AsyncIterator[Page]:
    """The page with actions (the token set) over a store holding: a FAILED, a PARKED and two
    PENDING timers of order o-1, one PENDING of o-2, a quarantined commit, two outbox entries."""
    async for p in serve(db, UI_TOKEN):
        p.now = await fill(p.backend)
        yield p


@pytest.fixture
async def read_only(db: Path) -> AsyncIterator[Page]:
    async for p in serve(db, None):
        p.now = await fill(p.backend)
        yield p


async def fill(b: Backend) -> int:
    """Fills the store; answers its now (ms)."""
    now = int(time.time() * 1000)
    await b.timers.prepare()
    ts = [
        order_timer("o-1", "failed", now - 3000),
        order_timer("o-1", "parked", now - 2000),
        order_timer("o-1", "later", now + 3_600_000),
        order_timer("o-1", "due", now - 1000),
        order_timer("o-2", "expire", now + 60_000),
    ]
    for t in ts:
        assert await b.timers.put(t)
    failed = await b.timer_queries.find(ref("o-1"), "failed")
    parked = await b.timer_queries.find(ref("o-1"), "parked")
    assert failed is not None and parked is not None
    reason = f"http 400 from the target (token {SECRET_TOKEN} refused)"
    await b.firing.settle([TimerChange.fail(failed, fence=1, reason=reason)])
    await b.firing.settle([TimerChange.park(parked, fence=1, reason="http 404: order o-1 not found")])
    raw = commit_to_doc(commit("o-9", create_time=now), PARTITIONS)
    await b.quarantine.put(
        "wowd", partition("o-9", PARTITIONS), ORDER, raw, "timers refused it: StorageFull: disk full"
    )
    for i in range(2):
        command = Command(name="expire-order").to_json()
        entry = outbox_entry(
            f"req-{i}", now - 10_000 + i, timer_id=f"t-{i}", command=command, scheduled_at=now, owner_key="a"
        )
        assert await b.outbox.put(entry)
    return now
