"""The status page's actions beyond one timer's retry and resume: a live timer cancelled from its
page (a cancel appended to the stream that holds it), and every FAILED or PARKED timer of a
target retried or resumed at once; each action's log line names who acted."""

from __future__ import annotations

import logging

import pytest

from tests.factories import ref
from tests.ui.conftest import UI_TOKEN, Page
from wowd.model import TimerStatus

pytestmark = pytest.mark.anyio

BEARER = {"authorization": f"Bearer {UI_TOKEN}"}


async def test_a_timer_is_cancelled_from_its_page(page: Page, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wowd.ui.app")
    html = await page.html("/ui/timer?owner=order/o-2&key=expire")
    assert 'action="/ui/timer/cancel"' in html
    key = await page.form_key("/ui/timer?owner=order/o-2&key=expire")
    form = {"owner": "demo.order/o-2", "tenant": "", "key": "expire", "token": UI_TOKEN, "form_key": key}
    r = await page.client.post("/ui/timer/cancel", data=form)
    assert r.status_code == 303 and "cancel+appended" in r.headers["location"]
    # appended to the stream that holds the timer (the order's own, where it was scheduled)
    assert await page.backend.log.last_version(ref("o-2")) == 1
    assert any("cancelled by the token holder at 127.0.0.1" in m.getMessage() for m in caplog.records)


async def test_every_failed_timer_of_a_target_is_retried_at_once(page: Page) -> None:
    listed = await page.html("/ui/timers?status=FAILED&target=order/o-1")
    assert 'action="/ui/timers/retry"' in listed and "retry all" in listed
    r = await page.client.post("/api/v1/timers/retry?target=order/o-1", headers=BEARER)
    assert r.status_code == 200 and r.json()["written"] == 1 and r.json()["more"] is False
    t = await page.backend.timer_queries.find(ref("o-1"), "failed")
    assert t is not None and t.status is TimerStatus.PENDING
    r = await page.client.post("/api/v1/timers/resume?target=order/o-1", headers=BEARER)
    assert r.status_code == 200 and r.json()["written"] == 1
    none_left = await page.client.post("/api/v1/timers/resume?target=order/o-1", headers=BEARER)
    assert none_left.status_code == 200 and none_left.json()["written"] == 0
