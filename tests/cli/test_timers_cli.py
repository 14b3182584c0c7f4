"""``wowd timers``: schedule, show, list (what each status needs), cancel, resume."""

from __future__ import annotations

import io
import itertools
import json
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import anyio
import pytest

from tests.cli.conftest import CONTEXT, PARTITIONS, Run
from wowd.backends import opened_backend
from wowd.cli import output
from wowd.client import schedule_stream
from wowd.config import TimerSettings, load_settings
from wowd.daemon.timer_plan import outcome_changes
from wowd.delivery import Park, Retry
from wowd.fmt import iso_ms
from wowd.model import AggregateRef, Timer, TimerChange, TimerScheduled, TimerStatus, timer_event_from, timer_from_event

ORDER = AggregateRef(context=CONTEXT, aggregate="order", id="o-1")


def _settle(kind: str, key: str, reason: str = "") -> None:
    """Claims the timer ``key`` of o-1 and settles one delivery outcome, as the timer loop does
    (``reason``: the park's, instead of a 404's)."""

    async def go() -> None:
        async with opened_backend(load_settings()) as backend:
            t = await backend.timer_queries.find(schedule_stream(ORDER), key)
            assert t is not None
            now = int(time.time() * 1000)
            claim = TimerChange.claim(t, owner_key="replica-a", fence=1, until=now + 30_000)
            assert await backend.firing.settle([claim]) == 1
            claimed = claim.applied()
            assert claimed is not None
            if kind == "claim":
                return
            outcome = Retry(reason="HTTP 503") if kind == "retry" else Park(reason=reason or "HTTP 404: no such order")
            changes = outcome_changes([(claimed, outcome, now)], 1, TimerSettings(max_attempts=3))
            assert await backend.firing.settle(changes) == 1

    anyio.run(go)


def _find(key: str) -> Timer:
    async def go() -> Timer | None:
        async with opened_backend(load_settings()) as backend:
            return await backend.timer_queries.find(schedule_stream(ORDER), key)

    t = anyio.run(go)
    assert t is not None
    return t


def test_schedule_show_list_and_cancel(wowd: Run, created: Path) -> None:
    code, out, err = wowd(
        "timers",
        "schedule",
        "order/o-1",
        "expire",
        "--command",
        "expire-order",
        "--body",
        '{"why": "late"}',
        "--in",
        "60",
    )
    assert code == 0, err
    assert "timer 'expire' of demo.order/(0)/o-1 scheduled in demo.wowd_schedule/(0)/order/o-1 at version 1" in out
    code, out, err = wowd("timers", "cancel", "order/o-1", "expire", "--force")  # not fed into the view
    assert code == 0 and "appended to demo.wowd_schedule/(0)/order/o-1 at version 2" in out


def test_a_one_shot_schedule_says_when_it_is_due_or_asks_for_now(wowd: Run, created: Path) -> None:
    """With neither ``--at`` nor ``--in`` a one-shot timer would fire at once: that takes ``--now``."""
    code, out, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x")
    assert code == 2 and out == "" and "when is it due? --at TIME, --in SECONDS, or --now" in err
    code, out, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--now")
    assert code == 0 and " at version 1: x to demo.order/(0)/o-1 due " in out, err
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--now", "--in", "5")
    assert code == 2 and "not allowed with argument" in err


def test_schedule_takes_a_misfire_grace(wowd: Run, created: Path) -> None:
    code, out, err = wowd(
        "timers", "schedule", "order/o-1", "remind", "--command", "remind", "--every-ms", "60000",
        "--misfire-grace-ms", "5000",
    )  # fmt: skip
    assert code == 0, err
    code, _, err = wowd("timers", "schedule", "order/o-1", "x", "--command", "x", "--misfire-grace-ms", "-1")
    assert code == 2 and "--misfire-grace-ms" in err


def test_schedule_refuses_bad_input_naming_the_field(wowd: Run, created: Path) -> None:
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--at", "99999999999999999")
    assert code == 2 and err.startswith("wowd: --at/--in: ") and "(body.due_at)" in err
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "not cron")
    assert code == 2 and err.startswith("wowd: --cron: 'not cron' has 2 fields: give five (minute hour ")
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "not a cron rule at all")
    assert code == 2 and err == "wowd: --cron: second 'not': 'not' is not a value of the field (rule.expression)\n"
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "0 0 25 * * ?")
    assert code == 2 and err.startswith("wowd: --cron: '0 0 25 * * ?' is not a valid cron expression"), err
    code, _, err = wowd("timers", "schedule", "orders-without-id", "k", "--command", "x")
    assert code == 2 and "AGGREGATE/ID expected" in err
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--every-ms", "1")
    assert code == 2 and err.startswith("wowd: --every-ms: 1 ms is below the shortest interval, 1000 ms ")
    assert "WOWD_TIMERS__MIN_INTERVAL_MS" in err


def test_schedule_reads_six_cron_fields_seconds_first_and_shows_the_next_occurrences(wowd: Run, created: Path) -> None:
    """``*/10 * * * * *`` is every ten seconds, as Quartz, Spring, db-scheduler and Wow read it
    (croniter reads the sixth field as the seconds of every tenth minute); the rule written names
    its dialect; five fields read as Vixie cron; seven, and what the dialects read differently,
    are refused naming the flag."""
    code, out, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "*/10 * * * * *")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("next occurrences (jvm: '*/10 * * * * *'): "))
    shown = [datetime.fromisoformat(t) for t in line.split("): ", 1)[1].split(", ")]
    assert len(shown) == 3 and all(b - a == timedelta(seconds=10) for a, b in itertools.pairwise(shown)), line
    code, out, err = wowd("timers", "schedule", "order/o-1", "j", "--command", "x", "--cron", "*/10 * * * *")
    assert code == 0 and "next occurrences (unix: '*/10 * * * *'): " in out, err

    async def rules() -> list[dict[str, object]]:
        async with opened_backend(load_settings()) as backend:
            return [
                dict(e.commit.events[0].body["rule"])
                async for batch in backend.log.read(dict.fromkeys(range(PARTITIONS)), follow=False)
                for e in batch.entries
                if e.commit is not None
            ]

    assert [(r["expression"], r["dialect"]) for r in anyio.run(rules)] == [
        ("*/10 * * * * *", "jvm"),
        ("*/10 * * * *", "unix"),
    ]
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "*/10 * * * * * 2026")
    assert code == 2 and err.startswith("wowd: --cron: '*/10 * * * * * 2026' has 7 fields: give five"), err
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "0 0 9 * * 1")
    assert code == 2 and "1 is Sunday in Quartz, Monday in Spring" in err, err
    code, _, err = wowd(
        "timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "0 9 * * *", "--cron-dialect", "jvm"
    )
    assert code == 2 and err.startswith("wowd: --cron: '0 9 * * *' has 5 fields; the jvm dialect reads six"), err


def test_list_has_a_header_takes_a_status_in_any_case_and_says_when_cut(wowd: Run, feed_once: None) -> None:
    code, out, _ = wowd("timers", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["timer_id", "status", "partition"]
    assert lines[-1] == "3 timer(s)"
    code, out, _ = wowd("timers", "list", "--status", "pending", "--limit", "2")
    assert code == 0 and len(out.splitlines()) == 1 + 2 + 1
    assert out.splitlines()[-1].startswith("2 timer(s) shown; next: --after ")
    code, _, err = wowd("timers", "list", "--limit", "-5")
    assert code == 2 and "--limit: must be >= 1, got -5" in err
    code, _, err = wowd("timers", "list", "--status", "asleep")
    assert code == 2 and "'asleep' is not a timer status" in err


def test_list_shows_what_each_status_needs_with_attempts_as_the_metrics_count(wowd: Run, feed_once: None) -> None:
    for _ in range(3):  # three deliveries answered 503 with max_attempts=3: the third fails it
        _settle("retry", "k1")
    assert _find("k1").status is TimerStatus.FAILED
    _settle("park", "k2")
    _settle("claim", "k3")
    code, out, _ = wowd("timers", "list")
    assert code == 0
    rows = {line.split()[1]: line for line in out.splitlines()[1:-1]}
    assert set(rows) == {"FAILED", "PARKED", "FIRING"}
    failed, parked, firing = rows["FAILED"], rows["PARKED"], rows["FIRING"]
    assert " 3  failed: retry budget spent after 3 attempts: HTTP 503" in failed  # attempts = deliveries = 3
    since = _find("k2").due_at  # a parked timer's due time is when it was parked
    assert abs(since - time.time() * 1000) < 60_000
    assert f" 1  parked since {iso_ms(since)} (" in parked and " ago): HTTP 404: no such order" in parked
    assert " 0  claimed by replica-a until " in firing
    code, out, _ = wowd("timers", "list", "--status", "FAILED", "--json")
    assert '"attempts": 3' in out


def test_list_and_show_mask_secrets_and_escape_control_characters(
    wowd: Run, feed_once: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A last error stored with a token in it (a target echoed it) and a line break and a
    terminal escape: the table and ``show`` print the token masked, as the logs and the page do,
    and the row on one line, the escape spelled out."""
    token = "planted-gw-token-0042"
    _settle("park", "k2", reason=f"HTTP 401: bad token {token}\n\x1b[2Jforged line")
    monkeypatch.setenv("WOWD_GATEWAY__TOKEN", token)
    parked = _find("k2")
    shows = (("timers", "show", parked.timer_id), ("timers", "show", "--json", parked.timer_id))
    for args in (("timers", "list"), *shows):
        code, out, _ = wowd(*args)
        assert code == 0 and token not in out and "**********" in out, out
        assert "\x1b" not in out and "forged line" in out
    code, out, _ = wowd("timers", "list")
    (row,) = [line for line in out.splitlines() if "PARKED" in line]
    assert row.endswith("bad token **********\\n\\x1b[2Jforged line"), row
    code, out, _ = wowd("timers", "show", parked.timer_id)
    assert "last_error:   HTTP 401: bad token **********\\n\\x1b[2Jforged line" in out.splitlines()


def test_resume_and_retry_name_an_unknown_timer(wowd: Run, feed_once: None) -> None:
    _settle("park", "k2")
    parked = _find("k2")
    code, out, err = wowd("timers", "resume", "no-such-id")
    assert code == 1 and "wowd: no such timer: no-such-id" in err
    code, out, err = wowd("timers", "retry", parked.timer_id)
    assert code == 1 and f"timer {parked.timer_id} is PARKED, not FAILED" in err
    code, out, err = wowd("timers", "resume", parked.timer_id)
    assert code == 0 and out.startswith("1 timer(s) back to PENDING")
    assert _find("k2").status is TimerStatus.PENDING


def test_show_prints_one_timer_or_says_there_is_none(wowd: Run, feed_once: None) -> None:
    code, out, _ = wowd("timers", "show", "order/o-1", "k1")
    assert code == 0 and "status:       PENDING" in out and "detail:       due " in out
    code, _, err = wowd("timers", "show", "order/o-1", "nope")
    assert code == 1 and "no timer 'nope' of demo.order/(0)/o-1" in err


@pytest.fixture
def feed_once(wowd: Run, created: Path) -> None:
    """Three timers of o-1 scheduled with the CLI, put into the timer view as the feed does."""
    for key in ("k1", "k2", "k3"):
        code, _, err = wowd(
            "timers", "schedule", "order/o-1", key, "--command", "expire-order", "--in", "-1", "--allow-past"
        )
        assert code == 0, err

    async def feed() -> None:
        async with opened_backend(load_settings()) as backend:
            async for batch in backend.log.read(dict.fromkeys(range(PARTITIONS)), follow=False):
                for entry in batch.entries:
                    assert entry.commit is not None
                    for ev in entry.commit.events:
                        te = timer_event_from(ev)
                        assert isinstance(te, TimerScheduled)
                        assert await backend.timers.put(timer_from_event(entry.commit, te, PARTITIONS))

    anyio.run(feed)


def test_a_timer_is_named_by_its_id_or_by_owner_and_key_everywhere(wowd: Run, feed_once: None) -> None:
    _settle("park", "k2")
    k2 = _find("k2")
    by_id, by_key = wowd("timers", "show", k2.timer_id, "--json"), wowd("timers", "show", "order/o-1", "k2", "--json")
    assert by_id[0] == by_key[0] == 0 and by_id[1] == by_key[1] and json.loads(by_id[1])["timer_id"] == k2.timer_id
    code, _, err = wowd("timers", "show", "nope")
    assert code == 1 and "wowd: no timer nope" in err
    code, out, err = wowd("timers", "resume", "order/o-1", "k2")
    assert code == 0 and out.startswith("1 timer(s) back to PENDING"), err
    code, _, err = wowd("timers", "retry", "order/o-1", "k1")
    assert code == 1 and "wowd: timer 'k1' of demo.order/(0)/o-1 is PENDING, not FAILED" in err


def test_bulk_resume_counts_confirms_and_filters_by_target(
    wowd: Run, feed_once: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("k1", "k2", "k3"):
        _settle("park", key)
    code, _, err = wowd("timers", "resume")
    assert code == 2 and "give timer ids (or AGGREGATE/ID KEY), --all or --target" in err
    monkeypatch.setattr(output, "interactive", lambda: True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("no\n"))
    code, _, err = wowd("timers", "resume", "--all-parked")
    assert code == 1 and "resume 3 PARKED timer(s)? [y/N]" in err
    assert {_find(k).status for k in ("k1", "k2", "k3")} == {TimerStatus.PARKED}
    code, out, err = wowd("timers", "resume", "--target", "order/o-2", "--yes")
    assert (code, out) == (0, "0 timer(s) back to PENDING\n"), err
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = wowd("timers", "resume", "--target", "order/o-1")
    assert code == 0 and out == "3 timer(s) back to PENDING\n" and "resume 3 PARKED timer(s) of target" in err
    assert {_find(k).status for k in ("k1", "k2", "k3")} == {TimerStatus.PENDING}


def test_list_pages_with_after_and_filters_by_target(wowd: Run, feed_once: None, tmp_path: Path) -> None:
    config = tmp_path / "wowd.toml"
    config.write_text('log_format = "text"\n')
    seen: list[str] = []
    after: list[str] = []
    while True:
        code, out, err = wowd("timers", "list", "--limit", "2", "--json", *after, "--config", str(config))
        assert code == 0, err
        doc = json.loads(out)
        seen += [t["key"] for t in doc["timers"]]
        if doc["next"] is None:
            break
        after = ["--after", doc["next"]]
    assert sorted(seen) == ["k1", "k2", "k3"]
    code, out, _ = wowd("timers", "list", "--target", "order/o-2")
    assert code == 0 and out.splitlines()[-1] == "0 timer(s)"
    code, out, _ = wowd("timers", "list", "--target", "order/o-1")
    assert code == 0 and out.splitlines()[-1] == "3 timer(s)"
    code, _, err = wowd("timers", "list", "--after", "nope")
    assert code == 2 and "not a cursor of 'timers list'" in err


def test_json_holds_json_and_epoch_ms_while_tables_show_iso_times(wowd: Run, feed_once: None) -> None:
    code, out, _ = wowd("timers", "show", "order/o-1", "k1", "--json")
    doc = json.loads(out)
    assert doc["command"] == {"name": "expire-order", "body": {}} and isinstance(doc["due_at"], int)
    assert doc["rule"] == {"type": "once"}
    code, out, _ = wowd("timers", "show", "order/o-1", "k1")
    due = next(line for line in out.splitlines() if line.startswith("due_at:"))
    assert due == f"due_at:       {iso_ms(doc['due_at'])} ({due.split('(', 1)[1]}" and due.endswith(" ago)")


def test_schedule_errors_name_the_flag_or_the_setting(
    wowd: Run, created: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, out, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--cron", "0 0 30 2 *")
    assert (code, out) == (2, "")
    assert err == "wowd: --cron: '0 0 30 2 *' has no occurrence after now (in zone UTC) (rule.expression)\n"
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--in", "-3600")
    assert code == 2 and err.startswith("wowd: --in: the due time ") and "in the past" in err and "--allow-past" in err
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--at", "2020-01-01T00:00:00Z")
    assert code == 2 and err.startswith("wowd: --at: the due time 2020-01-01T00:00:00.000+00:00 is in the past")
    big = tmp_path / "body.json"
    big.write_text(json.dumps({"note": "x" * 200}))
    monkeypatch.setenv("WOWD_TIMERS__MAX_BODY_BYTES", "100")
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--in", "60", "--body", f"@{big}")
    assert (
        code == 2
        and err.startswith("wowd: --body: is ")
        and "over the limit of 100 (WOWD_TIMERS__MAX_BODY_BYTES)" in err
    )
    code, _, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--body", f"@{tmp_path / 'none'}")
    assert code == 2 and "--body: cannot read" in err
    monkeypatch.delenv("WOWD_TIMERS__MAX_BODY_BYTES")
    code, out, err = wowd("timers", "schedule", "order/o-1", "k", "--command", "x", "--in", "60", "--body", f"@{big}")
    assert code == 0, err
    code, out, _ = wowd("timers", "schedule", "order/o-1", "k2", "--command", "x", "--in", "-5", "--allow-past")
    assert code == 0 and " at version 2: " in out


def test_cancel_refuses_a_timer_that_does_not_exist_unless_forced(wowd: Run, feed_once: None) -> None:
    code, out, err = wowd("timers", "cancel", "order/never-existed", "nokey")
    assert (code, out) == (1, "") and "wowd: no timer 'nokey' of demo.wowd_schedule/(0)/order/never-existed" in err

    async def versions() -> tuple[int, int]:
        async with opened_backend(load_settings()) as backend:
            gone = AggregateRef(context=CONTEXT, aggregate="order", id="never-existed")
            return await backend.log.last_version(gone), await backend.log.last_version(schedule_stream(gone))

    assert anyio.run(versions) == (0, 0)  # no stream was created
    code, out, err = wowd("timers", "cancel", "order/o-1", "k1")  # it exists: appended to wowd's stream
    assert code == 0 and "appended to demo.wowd_schedule/(0)/order/o-1 at version 4" in out, err
    code, out, err = wowd("timers", "cancel", "order/never-existed", "nokey", "--force", "--in-owner-stream")
    assert code == 0 and "appended to demo.order/(0)/never-existed at version 1" in out, err


def test_cancel_takes_a_timer_id_as_show_retry_and_resume_do(wowd: Run, feed_once: None) -> None:
    """A timer named by its id is cancelled in the stream that holds it."""
    k2 = _find("k2")
    code, out, err = wowd("timers", "cancel", k2.timer_id)
    assert code == 0 and out == "cancel of timer 'k2' of demo.wowd_schedule/(0)/order/o-1 appended to " \
        "demo.wowd_schedule/(0)/order/o-1 at version 4\n", err  # fmt: skip
    code, out, err = wowd("timers", "cancel", "0" * 32)
    assert (code, out) == (1, "") and f"wowd: no live timer {'0' * 32}" in err
    code, _, err = wowd("timers", "cancel", k2.timer_id, "--force")
    assert code == 2 and "in its own stream" in err
