"""The status page (``/ui``) and its JSON (``/api/v1``) on the embedded backend, served by the
HTTP listener in-process: every page and route, the search over the timer indexes, the actions
behind the token and the cross-site checks, and no secret in any answer."""

from __future__ import annotations

import json
import logging
import re
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from tests.factories import ref
from tests.processes import SECRET_MONGO_PW, SECRET_TOKEN
from tests.ui.conftest import ORDER, UI_TOKEN, Page, order_timer
from wowd.config import UiSettings
from wowd.metrics import UI_REFUSED
from wowd.model import (
    TimerStatus,
)
from wowd.operator import read_status
from wowd.ui import StatusPage
from wowd.ui.access import sign_notice
from wowd.ui.http import HttpRequest, HttpResponse

pytestmark = pytest.mark.anyio


def _stable(doc: dict[str, Any]) -> dict[str, Any]:
    """A status document without the fields that move with the clock."""
    out = json.loads(json.dumps(doc))
    out.pop("store_now", None)
    for r in out["slots"]:
        r.pop("expires_in_ms", None)
    for r in out["replicas"]:
        r.pop("seen_ms_ago", None)
        r.pop("up_ms", None)
    return out


# --------------------------------------------------------------------------- overview


async def test_the_status_route_answers_what_wowd_status_json_prints(page: Page) -> None:
    doc = await page.api("/api/v1/status")
    assert _stable(doc) == _stable(await read_status(page.settings, page.backend))
    assert doc["quarantined"] == 1 and doc["outbox"]["depth"] == 2
    assert doc["outbox"]["oldest"]["request_id"] == "req-0"
    due = {r["slot"]: r["due_backlog"] for r in doc["slots"]}
    assert sum(due.values()) == 1, "one PENDING timer is due now (the failed and parked ones are not due)"


async def test_the_overview_shows_the_stores_and_this_process_and_refreshes_itself(page: Page) -> None:
    html = await page.html("/ui")
    assert '<meta http-equiv="refresh" content="10">' in html
    assert re.search(r'id="quarantined"><a href="/ui/quarantine">1</a>', html)
    assert re.search(r'id="outbox-depth"><a href="/ui/outbox">2</a>', html)
    assert re.search(r'id="due-backlog">1<', html)
    # timers FAILED and PARKED in the store (every replica's), linked to their list; what this
    # replica delivered lately is said to be that
    assert re.search(r'id="timers-failed"><a href="/ui/timers\?status=FAILED">1</a>', html)
    assert re.search(r'id="timers-parked"><a href="/ui/timers\?status=PARKED">1</a>', html)
    assert ">deliveries failed here<" in html
    assert "stalled: timers view: disk full" in html, "the slot this process holds stalled says why"
    assert "<script" not in html
    assert re.search(r'<span class="ok">timers current</span>', html)
    doc = await page.api("/api/v1/overview")
    slots = doc["process"]["slots"]
    assert {k: v["stalled"] for k, v in slots.items()} == {"0": None, "1": "timers view: disk full"}
    assert set(slots["0"]) == {"feed_lag_s", "watermark_age_s", "stalled"}
    assert set(doc["process"]["deliveries"]) == {"fired", "retried", "parked", "failed", "misfired"}
    assert (await page.client.get("/ui/static/style.css")).status_code == 200


# --------------------------------------------------------------------------- timers


async def test_the_timer_search_filters_pages_and_links_each_timer(page: Page) -> None:
    every = await page.api("/api/v1/timers")
    assert [t["key"] for t in every["timers"]] == ["failed", "parked", "due", "expire", "later"]
    failed = await page.api("/api/v1/timers?status=failed")
    assert [t["key"] for t in failed["timers"]] == ["failed"]
    mine = await page.api("/api/v1/timers?owner=order/o-2")
    assert [t["key"] for t in mine["timers"]] == ["expire"]
    stuck = await page.api("/api/v1/timers?target=order/o-1")
    assert [t["key"] for t in stuck["timers"]] == ["failed", "parked"]
    window = await page.api(f"/api/v1/timers?due_from={page.now - 1500}&due_until={page.now + 120_000}")
    assert [t["key"] for t in window["timers"]] == ["due", "expire"]
    html = await page.html("/ui/timers?status=PARKED")
    assert "http 404: order o-1 not found" in html
    assert 'href="/ui/timer?owner=demo.order%2Fo-1&amp;key=parked"' in html


async def test_the_timer_list_pages_by_cursor(page: Page) -> None:
    from wowd.ui import app

    for i in range(app.PAGE + 5):
        await page.backend.timers.put(order_timer(f"bulk-{i}", "k", page.now + 10_000_000 + i))
    first = await page.api("/api/v1/timers")
    assert len(first["timers"]) == app.PAGE and first["next"]
    second = await page.api(f"/api/v1/timers?after={first['next']}")
    assert len(second["timers"]) == 10 and second["next"] is None
    html = await page.html("/ui/timers")
    assert 'id="next"' in html


async def test_a_bad_search_is_answered_400_with_the_reason_and_counted(page: Page) -> None:
    before = UI_REFUSED.labels(reason="bad input")._value.get()
    doc = await page.api("/api/v1/timers?status=asleep", 400)
    assert "'asleep' is not a timer status" in doc["error"]
    doc = await page.api("/api/v1/timers?target=order/o-1&status=pending", 400)
    assert "a target search lists PARKED and FAILED timers" in doc["error"]
    html = await page.html("/ui/timers?after=nope", 400)
    assert "is not a cursor" in html
    doc = await page.api("/api/v1/timers?key=expire", 400)
    assert "give the owner too" in doc["error"]
    assert UI_REFUSED.labels(reason="bad input")._value.get() == before + 4


@pytest.mark.parametrize(
    "target",
    [
        "/api/v1/timers?due_from=%C2%B2",  # a digit int() does not read
        "/api/v1/timers?due_until=" + "9" * 30,  # beyond SQLite's integers
        "/api/v1/timers?due_from=-" + "9" * 30,
        "/api/v1/timers?due_from=%2B275760-09-13",  # an ISO time beyond datetime's years
        "/api/v1/timers?after=%C2%B2:x",
        "/api/v1/timers?after=" + "9" * 30 + ":x",
        "/api/v1/outbox?offset=%C2%B2",
        "/api/v1/outbox?offset=" + "9" * 30,
        "/api/v1/outbox/entry?request_id=r&offset=" + "9" * 30,
        "/api/v1/quarantine?after=" + "9" * 30,
        "/ui/quarantine/" + "9" * 30,
        "/api/v1/timers?owner=order/o%00x",
        "/api/v1/timer?owner=order/o-1&key=k&tenant=%1B%5B2J",
    ],
)
async def test_a_bad_query_value_is_answered_400_or_404_never_500(page: Page, target: str) -> None:
    """What an anonymous client may put in a query: an answer naming the value, never a 500 (and
    its traceback in the log)."""
    r = await page.client.get(target)
    assert r.status_code in (400, 404), (r.status_code, r.text)


async def test_a_timer_page_says_why_it_did_not_fire(page: Page) -> None:
    parked = await page.html("/ui/timer?owner=order/o-1&key=parked")
    assert "PARKED" in parked and "http 404: order o-1 not found" in parked
    failed = await page.api("/api/v1/timer?owner=order/o-1&key=failed")
    assert failed["status"] == "FAILED" and failed["attempts"] == 1
    # a FAILED timer is due at no time (the store keeps its claim's expiry, a time to come)
    assert failed["due_at"] is None
    assert "- (not due: retry it to make it due now)" in await page.html("/ui/timer?owner=order/o-1&key=failed")
    assert failed["request_id"] and failed["rule"] == {"type": "once"}
    later = await page.html("/ui/timer?owner=demo.order/o-1&key=later")
    assert "due " in later and ("(in 59 min)" in later or "(in 1.0 h)" in later)
    slot = failed["partition"] % 2
    stalled = "timers view: disk full" if slot == 1 else None  # as this process says of its slot 1
    assert failed["slot"] == {"slot": slot, "holder": None, "fence": 0, "stalled": stalled}
    assert "has no live holder: nothing feeds or fires its partitions" in later
    gone = await page.html("/ui/timer?owner=order/o-1&key=never", 404)
    assert "of demo.order/(0)/o-1: none is live, and none fired or was cancelled" in gone and 'id="done"' not in gone
    # back from a retry whose timer fired before the page was asked for: the action's notice stays
    key = await page.form_key("/ui/timer?owner=order/o-1&key=failed")
    notice = urlencode({"done": "retried: back to PENDING", "sig": sign_notice(key, "retried: back to PENDING")})
    fired = await page.html(f"/ui/timer?owner=order/o-1&key=never&{notice}", 404)
    assert '<div class="notice" id="done">retried: back to PENDING</div>' in fired and "none is live" in fired
    # a notice this process did not write is not shown: a link cannot make the page say anything
    forged = await page.html("/ui/timer?owner=order/o-1&key=never&done=Session+expired:+call+555&sig=0", 404)
    assert "555" not in forged and 'id="done"' not in forged


async def test_no_secret_is_ever_shown(page: Page) -> None:
    for path in ("/ui/timer?owner=order/o-1&key=failed", "/api/v1/timer?owner=order/o-1&key=failed", "/ui/timers"):
        text = (await page.client.get(path)).text
        assert "token **********" in text
        assert SECRET_TOKEN not in text and SECRET_MONGO_PW not in text and UI_TOKEN not in text


# --------------------------------------------------------------------------- actions


async def test_a_failed_timer_is_retried_with_the_token_from_its_page(page: Page) -> None:
    key = await page.form_key("/ui/timer?owner=order/o-1&key=failed")
    r = await page.client.post(
        "/ui/timer/retry",
        data={"owner": "demo.order/o-1", "tenant": "", "key": "failed", "token": UI_TOKEN, "form_key": key},
        headers={"origin": str(page.client.base_url).rstrip("/"), "sec-fetch-site": "same-origin"},
    )
    assert r.status_code == 303
    html = await page.html(r.headers["location"])
    assert "retried: back to PENDING, due now" in html and 'id="timer-status">PENDING' in html
    t = await page.backend.timer_queries.find(ref("o-1"), "failed")
    assert t is not None and t.status is TimerStatus.PENDING and t.due_at >= page.now


async def test_a_parked_timer_is_resumed_through_the_api_with_the_bearer_token(page: Page) -> None:
    r = await page.client.post(
        "/api/v1/timer/resume?owner=order/o-1&key=parked", headers={"authorization": f"Bearer {UI_TOKEN}"}
    )
    assert r.status_code == 200 and r.json()["written"] == 1
    assert r.json()["timer"]["status"] == "PENDING"  # the timer as it is now, not as it was
    t = await page.backend.timer_queries.find(ref("o-1"), "parked")
    assert t is not None and t.status is TimerStatus.PENDING
    again = await page.client.post(
        "/api/v1/timer/resume?owner=order/o-1&key=parked", headers={"authorization": f"Bearer {UI_TOKEN}"}
    )
    assert again.status_code == 400 and "is PENDING, not PARKED" in again.json()["error"]
    wrong = await page.client.post(
        "/api/v1/timer/retry?owner=order/o-1&key=due", headers={"authorization": f"Bearer {UI_TOKEN}"}
    )
    assert wrong.status_code == 400 and "is PENDING, not FAILED" in wrong.json()["error"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"token": "wrong"}, "token"),
        ({"form_key": "0" * 64}, "form key"),
        ({"headers": {"origin": "http://evil.example"}}, "cross-site"),
        ({"headers": {"sec-fetch-site": "cross-site"}}, "cross-site"),
        ({"headers": {"origin": "null"}}, "cross-site"),
    ],
)
async def test_an_action_without_the_token_form_key_or_from_another_site_is_refused(
    page: Page, change: dict[str, Any], reason: str
) -> None:
    key = await page.form_key("/ui/timer?owner=order/o-1&key=failed")
    data = {"owner": "order/o-1", "key": "failed", "token": UI_TOKEN, "form_key": key}
    data.update({k: v for k, v in change.items() if k != "headers"})
    before = UI_REFUSED.labels(reason=reason)._value.get()
    r = await page.client.post("/ui/timer/retry", data=data, headers=change.get("headers", {}))
    assert r.status_code == 403 and "refused" in r.text
    assert UI_REFUSED.labels(reason=reason)._value.get() == before + 1
    t = await page.backend.timer_queries.find(ref("o-1"), "failed")
    assert t is not None and t.status is TimerStatus.FAILED


async def test_without_a_token_the_page_is_read_only(read_only: Page) -> None:
    html = await read_only.html("/ui/timer?owner=order/o-1&key=failed")
    assert '<form class="action"' not in html and "Read-only: set WOWD_UI__TOKEN" in html
    r = await read_only.client.post("/ui/timer/retry", data={"owner": "order/o-1", "key": "failed", "token": ""})
    assert r.status_code == 403 and "read-only" in r.text
    r = await read_only.client.post("/api/v1/outbox/ack", json={"request_ids": ["req-0"]})
    assert r.status_code == 403
    assert await read_only.backend.outbox.count() == 2
    t = await read_only.backend.timer_queries.find(ref("o-1"), "failed")
    assert t is not None and t.status is TimerStatus.FAILED


# --------------------------------------------------------------------------- command bodies and the token


async def test_command_bodies_are_shown_only_to_a_request_with_the_token(page: Page) -> None:
    """A command's body (a card number, say) and a quarantined commit's events: hidden from an
    anonymous reader, shown with ``Authorization: Bearer`` or, in a browser, after ``/ui/login``
    asked for the token (HTTP Basic)."""
    bearer = {"authorization": f"Bearer {UI_TOKEN}"}
    anon = await page.api("/api/v1/timer?owner=order/o-1&key=failed")
    assert anon["command"] == {"name": "expire-order", "body": None, "body_hidden": True}
    r = await page.client.get("/api/v1/timer?owner=order/o-1&key=failed", headers=bearer)
    assert r.status_code == 200 and r.json()["command"]["body"] == {"key": "failed"}
    listed = await page.api("/api/v1/timers?owner=order/o-1")
    assert listed["timers"] and all(t["command"]["body"] is None for t in listed["timers"])
    entries = (await page.api("/api/v1/outbox"))["entries"]
    assert entries and all(e["command"] == {"name": "expire-order", "body": None, "body_hidden": True} for e in entries)
    item = (await page.api("/api/v1/quarantine"))["items"][0]
    assert item["raw"]["aggregate_id"] == "o-9" and item["raw"]["events"][0]["body"] is None
    r = await page.client.get("/api/v1/quarantine", headers=bearer)
    assert r.json()["items"][0]["raw"]["events"][0]["body"] == {"n": 1}

    html = await page.html("/ui/timer?owner=order/o-1&key=failed")
    assert '"body": null' in html and '"key": "failed"' not in html and 'id="sign-in"' in html
    login = "/ui/login?next=" + quote("/ui/timer?owner=order/o-1&key=failed", safe="")
    r = await page.client.get(login)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic realm=")
    r = await page.client.get(login, auth=("anyone", UI_TOKEN))
    assert r.status_code == 303 and r.headers["location"] == "/ui/timer?owner=order/o-1&key=failed"
    r = await page.client.get(r.headers["location"], auth=("anyone", UI_TOKEN))
    assert r.status_code == 200 and '"key": "failed"' in r.text and 'id="sign-in"' not in r.text
    r = await page.client.get("/ui/login?next=https://evil.example/", auth=("anyone", UI_TOKEN))
    assert r.headers["location"] == "/ui"  # never leads off the status page
    r = await page.client.get("/api/v1/timer?owner=order/o-1&key=failed", headers={"authorization": "Bearer nope"})
    assert r.status_code == 403 and "body" not in r.text


async def test_without_a_token_nobody_reads_bodies_unless_the_settings_open_them(read_only: Page) -> None:
    r = await read_only.client.get("/api/v1/outbox", headers={"authorization": f"Bearer {UI_TOKEN}"})
    assert r.status_code == 200 and r.json()["entries"][0]["command"]["body"] is None
    r = await read_only.client.get("/ui/login", auth=("anyone", UI_TOKEN))
    assert r.status_code == 403 and "no token is set" in r.text
    opened = read_only.settings.model_copy(update={"ui": UiSettings(open_bodies=True)})
    answer = await StatusPage(opened, read_only.backend)(HttpRequest("GET", "/api/v1/outbox", {}, b"", "10.0.0.1"))
    assert json.loads(answer.body)["entries"][0]["command"] == {"name": "expire-order", "body": {}}


async def test_token_guessing_is_slowed_down_per_client_and_logged_in_a_few_lines(
    page: Page, caplog: pytest.LogCaptureFixture
) -> None:
    """A client offering wrong tokens gets 10 tries, then one every 2 s (429, ``Retry-After``),
    whatever token it offers; another client is not held up; the log says it in a line or two,
    not one per try (the metric counts each)."""
    app = StatusPage(page.settings, page.backend)

    async def get(client: str, token: str) -> HttpResponse:
        headers = {"authorization": f"Bearer {token}"}
        return await app(HttpRequest("GET", "/api/v1/timer?owner=order/o-1&key=failed", headers, b"", client))

    refused = UI_REFUSED.labels(reason="too many tries")._value.get()
    with caplog.at_level(logging.WARNING, logger="wowd.ui.app"):
        answers = [await get("10.0.0.1", f"guess-{i:04d}-0123456789") for i in range(200)]
        right_but_late = await get("10.0.0.1", UI_TOKEN)
        other = await get("10.0.0.2", UI_TOKEN)
    assert [a.status for a in answers[:10]] == [403] * 10 and {a.status for a in answers[10:]} == {429}
    assert dict(answers[-1].headers)["retry-after"] == "2"
    assert right_but_late.status == 429  # refused before the token is compared
    assert other.status == 200 and json.loads(other.body)["command"]["body"] == {"key": "failed"}
    assert UI_REFUSED.labels(reason="too many tries")._value.get() == refused + 191
    assert len([r for r in caplog.records if r.name == "wowd.ui.app"]) <= 2, caplog.text


# --------------------------------------------------------------------------- quarantine and outbox


async def test_the_quarantine_lists_shows_and_refeeds_an_item(page: Page) -> None:
    listed = await page.api("/api/v1/quarantine")
    (item,) = listed["items"]
    html = await page.html("/ui/quarantine")
    assert "timers refused it: StorageFull: disk full" in html and "o-9 v1" in html
    shown = await page.html(f"/ui/quarantine/{item['id']}")
    assert "timers, snapshots, parked" in shown and "ItemAdded" in shown
    assert (await page.api(f"/api/v1/quarantine/{item['id']}"))["reason"].startswith("timers refused it")
    key = await page.form_key(f"/ui/quarantine/{item['id']}")
    r = await page.client.post(f"/ui/quarantine/{item['id']}/refeed", data={"token": UI_TOKEN, "form_key": key})
    assert r.status_code == 303 and "released" in (await page.html(r.headers["location"]))
    assert (await page.api("/api/v1/quarantine"))["items"] == []
    await page.api(f"/api/v1/quarantine/{item['id']}", 404)


async def test_a_quarantined_item_dismissed_on_the_page_leaves_the_listing_and_is_shown_with_who_and_why(
    page: Page, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wowd.ui.app")
    (item,) = (await page.api("/api/v1/quarantine"))["items"]
    assert "/dismiss" in await page.html(f"/ui/quarantine/{item['id']}")
    key = await page.form_key(f"/ui/quarantine/{item['id']}")
    form = {"token": UI_TOKEN, "form_key": key, "reason": "test data: the order was deleted"}
    r = await page.client.post(f"/ui/quarantine/{item['id']}/dismiss", data=form)
    assert r.status_code == 303
    assert "dismissed: test data: the order was deleted" in await page.html(r.headers["location"])
    assert (await page.api("/api/v1/quarantine"))["items"] == []
    [kept] = (await page.api("/api/v1/quarantine?dismissed=1"))["items"]
    assert kept["id"] == item["id"] and kept["dismissed"]["reason"] == "test data: the order was deleted"
    assert kept["dismissed"]["by"] == "the token holder at 127.0.0.1"
    listing = await page.html("/ui/quarantine?dismissed=1")
    assert item["id"] in listing and "test data: the order was deleted" in listing
    shown = await page.html(f"/ui/quarantine/{item['id']}")
    assert "the token holder at 127.0.0.1: test data: the order was deleted" in shown and "/dismiss" not in shown
    assert any(
        f"quarantined item {item['id']} dismissed by the token holder at 127.0.0.1" in m.getMessage()
        for m in caplog.records
    )
    # dismissed already: 409 and nothing changes; a blank reason: 400; an unknown id: 404
    bearer = {"authorization": f"Bearer {UI_TOKEN}"}
    r = await page.client.post(f"/api/v1/quarantine/{item['id']}/dismiss", json={"reason": "again"}, headers=bearer)
    assert r.status_code == 409 and "dismissed already" in r.json()["reason"]
    await page.backend.quarantine.put("wowd", 0, ORDER, {"aggregate_id": "o-8", "version": "x"}, "version: bad")
    (other,) = (await page.api("/api/v1/quarantine"))["items"]
    r = await page.client.post(f"/api/v1/quarantine/{other['id']}/dismiss", json={"reason": " "}, headers=bearer)
    assert r.status_code == 400 and "reason" in r.json()["error"]
    r = await page.client.post("/api/v1/quarantine/999999/dismiss", json={"reason": "x"}, headers=bearer)
    assert r.status_code == 404
    r = await page.client.post(f"/api/v1/quarantine/{other['id']}/dismiss", json={"reason": "bad data"}, headers=bearer)
    assert r.status_code == 200 and r.json()["dismissed"] is True
    assert [i["id"] for i in (await page.api("/api/v1/quarantine?dismissed=1"))["items"]] == [item["id"], other["id"]]


async def test_the_outbox_lists_shows_and_acknowledges_entries_without_taking_them(page: Page) -> None:
    doc = await page.api("/api/v1/outbox")
    assert [e["request_id"] for e in doc["entries"]] == ["req-0", "req-1"] and doc["depth"] == 2
    entry = await page.html("/ui/outbox/entry?request_id=req-1&offset=1")
    assert "expire-order" in entry and "t-1" in entry
    taken = await page.backend.outbox.take(10)
    assert len(taken.entries) == 2, "listing took nothing from the consumer"
    key = await page.form_key("/ui/outbox")
    r = await page.client.post("/ui/outbox/ack", data={"request_id": ["req-0"], "token": UI_TOKEN, "form_key": key})
    assert r.status_code == 303
    assert "1 of 1 entries acknowledged" in await page.html(r.headers["location"])
    assert [e.request_id for e in await page.backend.outbox.entries()] == ["req-1"]


async def test_unknown_pages_and_methods(page: Page) -> None:
    await page.html("/ui/nope", 404)
    assert (await page.client.put("/ui")).status_code == 405
    assert (await page.client.post("/api/v1/nope", headers={"authorization": f"Bearer {UI_TOKEN}"})).status_code == 405
    assert (await page.client.get("/metrics")).status_code == 200


# --------------------------------------------------------------------------- this process's window


def test_a_quantile_is_interpolated_within_its_bucket_as_prometheus_does() -> None:
    from wowd.ui.window import quantile

    inf = float("inf")
    assert quantile(0.5, [(0.1, 0.0), (0.25, 10.0), (inf, 10.0)]) == pytest.approx(0.175)
    assert quantile(0.99, [(1.0, 5.0), (inf, 10.0)]) == 1.0, "in +Inf: the largest finite bound"
    assert quantile(0.5, [(1.0, 0.0), (inf, 0.0)]) is None
    from wowd.ui.window import beyond_top

    assert beyond_top(0.99, [(1.0, 5.0), (inf, 10.0)]) and not beyond_top(0.5, [(1.0, 5.0), (inf, 10.0)])


def test_the_window_counts_what_this_process_delivered_over_its_last_minutes() -> None:
    from wowd.metrics import FIRE_LAG, TIMERS_FIRED, TIMERS_PARKED
    from wowd.ui.window import MetricWindow

    now = [0.0]
    window = MetricWindow(clock=lambda: now[0], window_s=60)
    FIRE_LAG.observe_many([0.02] * 98 + [4.0] * 2)
    TIMERS_FIRED.labels(target="window.test").inc(98)
    TIMERS_PARKED.labels(target="window.test").inc(2)
    now[0] = 10.0
    doc = window.read()
    assert doc["deliveries"]["fired"] == 98 and doc["deliveries"]["parked"] == 2 and doc["window_s"] == 10.0
    assert 0.01 < doc["fire_lag_p50_s"] <= 0.025 and 2.5 < doc["fire_lag_p99_s"] <= 5.0
    assert not doc["fire_lag_p99_beyond"]
    now[0] = 100.0
    later = window.read()
    assert later["deliveries"]["fired"] == 0 and later["fire_lag_p50_s"] is None, "older than the window"
    FIRE_LAG.observe_many([420.0] * 10)  # a backlog of seven minutes: past the top bucket (60 s)
    now[0] = 110.0
    backlog = window.read()
    assert backlog["fire_lag_p99_s"] == 60.0 and backlog["fire_lag_p99_beyond"] is True


async def test_the_api_refeeds_and_acknowledges_with_the_bearer_token(
    page: Page, caplog: pytest.LogCaptureFixture
) -> None:
    """Answered as the command line answers: 200 when done, 409 when not (its exit 1); each
    action's log line names who acted."""
    caplog.set_level(logging.INFO, logger="wowd.ui.app")
    bearer = {"authorization": f"Bearer {UI_TOKEN}"}
    (item,) = (await page.api("/api/v1/quarantine"))["items"]
    r = await page.client.post(f"/api/v1/quarantine/{item['id']}/refeed", headers=bearer)
    assert r.status_code == 200 and r.json()["reason"] is None
    assert r.json()["done"] == ["timers", "snapshots", "parked"]
    assert any("re-fed by the token holder at 127.0.0.1" in m.getMessage() for m in caplog.records)
    await page.backend.quarantine.put("wowd", 0, ORDER, {"aggregate_id": "o-8", "version": "x"}, "version: bad")
    (bad,) = (await page.api("/api/v1/quarantine"))["items"]
    r = await page.client.post(f"/api/v1/quarantine/{bad['id']}/refeed", headers=bearer)
    assert r.status_code == 409 and r.json()["reason"] and r.json()["done"] == []  # still quarantined
    entry = await page.api("/api/v1/outbox/entry?request_id=req-1&offset=0")
    assert entry["timer_id"] == "t-1" and entry["offset"] == 1
    r = await page.client.post("/api/v1/outbox/ack", json={"request_ids": ["req-0", "req-1"]}, headers=bearer)
    assert r.status_code == 200 and r.json()["removed"] == 2
    assert await page.backend.outbox.count() == 0
    r = await page.client.post("/api/v1/outbox/ack", json={"request_ids": ["req-0"]}, headers=bearer)
    assert r.status_code == 409 and r.json()["removed"] == 0 and r.json()["asked"] == 1
    r = await page.client.post(
        "/api/v1/outbox/ack", json={"request_ids": ["req-0"]}, headers={"authorization": "Bearer x"}
    )
    assert r.status_code == 403 and r.json()["error"] == "refused: wrong or missing token"
