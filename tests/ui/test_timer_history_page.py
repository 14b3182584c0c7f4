"""A timer's history on the status page and its API: a timer that fired or was cancelled is
shown (``/ui/timer``, ``/api/v1/timer``) by owner and key, by timer id and by request id, and
``/api/v1/timers?request_id=`` answers that timer alone. What a target answered is masked."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlencode

import pytest

from tests.factories import commit, ref, timer
from tests.processes import SECRET_TOKEN
from tests.ui.conftest import UI_TOKEN, Page, fill, serve
from wowd.model import (
    Command,
    OnceRule,
    TimerCancelled,
    TimerScheduled,
    attempt_record,
    commit_records,
    deterministic_timer_id,
)

pytestmark = pytest.mark.anyio

DAY = 86_400_000


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[Page]:
    """The status page over the store of the status page's tests, and the history of two timers
    of order o-77 that the view no longer holds: ``deadline`` (a 503, then delivered) and
    ``reminder`` (cancelled)."""
    async for p in serve(tmp_path / "wowd.db", UI_TOKEN):
        p.now = await fill(p.backend)
        await _history(p)
        yield p


async def _history(p: Page) -> None:
    assert p.backend.history is not None
    now = p.now
    owner = ref("o-77")
    go = Command(name="expire-order")
    scheduled = [
        TimerScheduled(key=k, due_at=now - 5000, rule=OnceRule(), target=owner, command=go)
        for k in ("deadline", "reminder")
    ]
    records = commit_records(
        commit("o-77", 1, create_time=now - 9000, request_id="commit-1"), scheduled, DAY, position=12
    )
    deadline = timer("o-77", now - 5000, key="deadline", command=go, revision=1)
    refused = f'{{"errorMsg": "busy", "echo": "Bearer {SECRET_TOKEN}"}}'
    records += [
        attempt_record(
            deadline, "retry", now - 4900, DAY, status=503, latency_ms=4.2, reason="HTTP 503: busy", answer=refused
        ),  # fmt: skip
        attempt_record(
            replace(deadline, revision=3),
            "delivered",
            now - 3000,
            DAY,
            status=200,
            latency_ms=1.5,
            answer='{"ok": true}',
        ),  # fmt: skip
    ]
    records += commit_records(
        commit("o-77", 2, create_time=now - 2000, request_id="commit-2"), [TimerCancelled(key="reminder")], DAY
    )
    await p.backend.history.append(records)


async def test_a_fired_timer_s_history_by_key_by_id_and_by_request_id(page: Page) -> None:
    html = await page.html("/ui/timer?" + urlencode({"owner": "order/o-77", "key": "deadline"}))
    assert 'id="timer-status">DONE<' in html
    assert html.count('<tr data-kind="attempt">') == 2 and html.count('<tr data-kind="scheduled">') == 1
    assert "HTTP 503: busy" in html and "4.2 ms" in html and "log position 12" in html
    assert SECRET_TOKEN not in html and "**********" in html  # what the target echoed, masked

    timer_id = deterministic_timer_id(ref("o-77"), "deadline", 1)
    by_id = await page.api("/api/v1/timer?" + urlencode({"timer_id": timer_id}))
    assert by_id["status"] == "DONE" and by_id["key"] == "deadline"
    assert [(h["kind"], h.get("outcome"), h.get("status")) for h in by_id["history"]] == [
        ("scheduled", None, None),
        ("attempt", "retry", 503),
        ("attempt", "delivered", 200),
    ]
    request_id = by_id["history"][-1]["request_id"]
    assert await page.api("/api/v1/timer?" + urlencode({"request_id": request_id})) == by_id

    cancelled = await page.api("/api/v1/timer?" + urlencode({"owner": "order/o-77", "key": "reminder"}))
    assert cancelled["status"] == "CANCELLED"
    assert [h["kind"] for h in cancelled["history"]] == ["scheduled", "cancelled"]


async def test_the_timer_search_by_request_id_answers_that_timer_alone(page: Page) -> None:
    everything = await page.api("/api/v1/timers")
    assert len(everything["timers"]) == 5  # the live timers of the store
    timer_id = deterministic_timer_id(ref("o-77"), "deadline", 1)
    request_id = (await page.api("/api/v1/timer?" + urlencode({"timer_id": timer_id})))["history"][-1]["request_id"]
    found = await page.api("/api/v1/timers?" + urlencode({"request_id": request_id}))
    assert [(t["timer_id"], t["status"]) for t in found["timers"]] == [(timer_id, "DONE")]
    assert {h["request_id"] for h in found["history"] if h["kind"] == "attempt"} == {request_id}
    assert (await page.api("/api/v1/timers?request_id=nothing-sent"))["timers"] == []
    html = await page.html("/ui/timers?" + urlencode({"request_id": request_id}))
    assert f"/ui/timer?timer_id={timer_id}" in html
    # a live timer is found by the request id of its next delivery
    live = (await page.api("/api/v1/timers?owner=order/o-2"))["timers"][0]
    assert time.time() > 0 and live["request_id"]
    await page.html("/ui/timer?" + urlencode({"request_id": "nothing-sent"}), status=404)
