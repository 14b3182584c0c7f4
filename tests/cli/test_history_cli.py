"""``wowd timers show`` of a timer that fired or was cancelled: its history, found by owner and
key, by timer id and by the request id a target logged. A replica (assembled as ``wowd run``
does) fires over the ``http`` gateway to a local target that answers 503 once, then 200."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from tests.cli.conftest import Run
from tests.delivery.conftest import serving
from tests.factories import eventually
from wowd.backends import opened_backend
from wowd.client import schedule_stream
from wowd.config import load_settings
from wowd.daemon.replica import open_replica
from wowd.model import AggregateRef, HistoryKind

ORDER = AggregateRef(context="demo", aggregate="order", id="o-77")


def busy_once(answered: list[str]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A target answering the first command 503 ``{"errorMsg": "busy"}``, the next ones 200
    ``{"ok": true}``; the request ids it was sent go to ``answered``, in order."""

    async def handle(request: web.Request) -> web.StreamResponse:
        answered.append(request.headers["command-request-id"])
        if len(answered) == 1:
            return web.json_response({"errorMsg": "busy"}, status=503)
        return web.json_response({"ok": True})

    return handle


def _fire_until_delivered(answered: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs a replica until the history holds the delivery of ``deadline`` and the feed applied
    the cancel of ``reminder``."""

    async def run() -> None:
        served = serving(busy_once(answered))
        _target, url = await served.__aenter__()
        monkeypatch.setenv("WOWD_GATEWAY__KIND", "http")
        monkeypatch.setenv("WOWD_GATEWAY__URL", url)
        monkeypatch.setenv("WOWD_HTTP__HOST", "127.0.0.1")
        monkeypatch.setenv("WOWD_HTTP__PORT", "0")
        monkeypatch.setenv("WOWD_TIMERS__BACKOFF_BASE_S", "0.05")
        monkeypatch.setenv("WOWD_TIMERS__BACKOFF_MAX_S", "0.1")
        settings = load_settings()
        stream = schedule_stream(ORDER)
        try:
            async with opened_backend(settings) as probe, open_replica(settings) as replica:
                assert probe.history is not None
                async with anyio.create_task_group() as tg:
                    await tg.start(replica.run)

                    async def delivered_and_cancelled() -> bool:
                        records = await probe.history.of_key(stream, "deadline")
                        cancels = await probe.history.of_key(stream, "reminder")
                        return any(r.outcome == "delivered" for r in records) and any(
                            r.kind is HistoryKind.CANCELLED for r in cancels
                        )

                    await eventually(delivered_and_cancelled, 20, "deadline delivered and reminder cancelled")
                    replica.stop()
        finally:
            await served.__aexit__(None, None, None)

    anyio.run(run)


def test_show_answers_the_history_of_a_fired_or_cancelled_timer(
    wowd: Run, created: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = wowd("timers", "schedule", "order/o-77", "deadline", "--command", "expire-order", "--in", "0")
    assert code == 0, err
    code, _, err = wowd("timers", "schedule", "order/o-77", "reminder", "--command", "remind", "--in", "3600")
    assert code == 0, err
    code, _, err = wowd("timers", "cancel", "order/o-77", "reminder", "--force")
    assert code == 0, err
    answered: list[str] = []
    _fire_until_delivered(answered, monkeypatch)
    retried, delivered = answered[:2]
    assert retried == delivered  # a retry carries the same request id

    code, out, err = wowd("timers", "show", "order/o-77", "deadline")
    assert code == 0, err
    assert "status:       DONE" in out
    lines = out.splitlines()
    history = lines[lines.index(next(x for x in lines if x.startswith("history:"))) + 1 :]
    assert [re.sub(r" in [0-9.]+ ms", "", x.split("  ")[2].split(" (")[0].split(":")[0]) for x in history] == [
        "scheduled by demo.wowd_schedule/(0)/order/o-77 v1",
        "attempt retry HTTP 503",
        "attempt delivered HTTP 200",
    ], history
    assert f"HTTP 503: busy (request id {retried}" in history[1] and 'answered {"errorMsg": "busy"}' in history[1]
    assert f"(request id {delivered}" in history[2] and 'answered {"ok": true}' in history[2]
    assert "log position" in history[0]

    code, out, err = wowd("timers", "show", "order/o-77", "deadline", "--json")
    by_key = json.loads(out)
    assert code == 0 and by_key["status"] == "DONE", err
    assert [(h["kind"], h.get("outcome"), h.get("status")) for h in by_key["history"]] == [
        ("scheduled", None, None),
        ("attempt", "retry", 503),
        ("attempt", "delivered", 200),
    ]
    assert all(h["latency_ms"] >= 0 for h in by_key["history"][1:])
    # the same by the timer's id and by the request id the target logged
    by_id = json.loads(wowd("timers", "show", by_key["timer_id"], "--json")[1])
    by_request = json.loads(wowd("timers", "show", "--request-id", delivered, "--json")[1])
    assert by_id == by_request == by_key

    code, out, err = wowd("timers", "show", "order/o-77", "reminder")
    assert code == 0, err
    assert "status:       CANCELLED" in out and "cancelled by demo.wowd_schedule/(0)/order/o-77 v3" in out

    code, _, err = wowd("timers", "show", "--request-id", "0" * 32)
    assert code == 1 and "wowd: no timer with request id 000" in err
