"""A smoke run of every benchmark in ``bench/`` with tiny sizes, so that they cannot rot.

The numbers are not asserted against targets (that is ``make bench``'s report); asserted is what
the report relies on: every timer put is fired exactly once into the outbox, the lag and rate
figures are computed from those rows, the wire counts come from the black-pipe server, and the
report renders a table per benchmark.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import ceiling, peer_aps3, wowd_timers
from bench.__main__ import APS4_PYTHON, HERE, Config, render, section_growth, section_http, section_sink, targets
from bench.common import lag_stats, run_worker, timer_rows
from bench.failover import failover_once

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def forked_wowd(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' processes (``wowd`` and the measurement workers) forked from the tests'
    fork server (:mod:`tests.forkserver`): the smoke run asserts what the benchmarks count, not
    their times, which include a process's start."""
    from bench import common
    from tests import forkserver

    monkeypatch.setattr(common, "POPEN", forkserver.popen)


TINY = Config(
    burst_sizes=(200,),
    burst_lead_ms=100,
    runs=1,
    aps3_default_n=50,
    aps4_n=5,
    steady_rates=(50,),
    steady_seconds=0.2,
    growth_sizes=(100, 1000),
    growth_types=(1, 3),
    sink_n=300,
    sink_batches=(100,),
    sink_refresh_interval_s=0.05,
    failover_ttls=(1.5,),
    http_n=100,
    http_concurrency=(4,),
    http_steady_rate=50,
    http_steady_delay_ms=300,
)


def test_lag_stats_are_nearest_rank_percentiles() -> None:
    lags = lag_stats(list(range(1, 101)))
    assert (lags.p50, lags.p99, lags.max) == (51.0, 99.0, 100.0)


def test_timer_rows_are_the_stores_partitioning() -> None:
    from wowd.model import partition

    rows = list(timer_rows(5, due_at=7, partitions=64))
    assert [r[1] for r in rows] == [partition(r[4], 64) for r in rows]
    assert len({r[0] for r in rows}) == 5 and all(r[8] == r[9] == 7 for r in rows)


def assert_lags(r: dict[str, float], within_ms: float = 30_000) -> None:
    """Fire lags measured from the due times: ordered, none before its due time, some lag (a
    run that fires hundreds takes milliseconds), none past the run's length (a lag measured from
    another origin than the due time)."""
    assert 0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] < within_ms, r
    assert r["max_ms"] > 0, r


def test_bare_loop_fires_every_timer_once() -> None:
    r = ceiling.run_burst({"n": 300})
    assert r["fired"] == 300 and r["fired_per_s"] > 0
    assert_lags(r)


def test_store_path_fires_every_timer_through_the_outbox_gateway() -> None:
    r = wowd_timers.run_store_path({"n": 300})
    assert r["fired"] == 300 and r["fired_per_s"] > 0
    assert_lags(r)


def test_apscheduler3_burst_and_steady() -> None:
    burst = peer_aps3.run_burst({"n": 50, "lead_ms": 100})
    assert burst["fired"] == 50 and burst["fired_per_s"] > 0
    assert_lags(burst)
    steady = peer_aps3.run_steady({"rate": 50, "seconds": 0.2, "delay_ms": 200, "drain_s": 10})
    assert steady["added"] > 0 and steady["fired"] == steady["added"]


@pytest.mark.skipif(not Path(APS4_PYTHON).exists(), reason="no APScheduler 4 interpreter")
def test_apscheduler4_burst() -> None:
    r = run_worker("aps4", {"n": 5}, python=APS4_PYTHON, script=HERE / "peer_aps4.py", timeout=60)
    assert r["fired"] == 5


@pytest.mark.process
def test_failover_measures_the_standbys_first_fire() -> None:
    r = failover_once(1.0, warm_s=0.3)
    assert 0 < r["failover_ms"] < 20_000 and r["bound_ms"] > 1000


@pytest.mark.process
def test_http_delivery_fires_every_timer_over_http_beside_the_bare_loop() -> None:
    section = section_http(TINY)
    rows = section.data["rows"]
    systems = {(r["system"], r["concurrency"]) for r in rows}
    # one concurrency (each more is two process starts more: the bare loop's and wowd's)
    assert systems == {
        ("bare aiohttp loop", 4),
        ("wowd run, http gateway", 4),
        ("wowd run, http gateway, signed", 4),
        ("wowd run, outbox gateway (reference)", "-"),
    }
    assert all(r["fired"] == TINY.http_n for r in rows), "every command reached the target (or the outbox) once"
    assert all(0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] and r["fired_per_s"] > 0 for r in rows)
    steady = section.data["steady"]
    assert steady["added"] > 0 and steady["fired"] == steady["added"]
    bare_steady = section.data["bare_steady"]
    assert bare_steady["added"] > 0 and bare_steady["fired"] == bare_steady["added"]
    assert 0 <= bare_steady["p50_ms"] <= bare_steady["p99_ms"]
    text = render([section], cfg=TINY, command="python -m bench --quick --only http", quick=True, total_s=1.0)
    assert "## HTTP delivery" in text and "| bare aiohttp loop | 4 |" in text
    assert "http gateway >= 0.5x the bare aiohttp loop (concurrency 4)" in targets({"http": section})


def test_growth_and_sink_sections_render_with_their_targets(tmp_path: Path) -> None:
    sections = [section_growth(TINY), section_sink(TINY)]
    growth, sink = sections
    assert [r["due_commands"] for r in growth.data["mongo"]["rows"]] == [1, 1]
    assert all(r["batch_commands"] == 3 for r in growth.data["mongo"]["rows"])
    assert {r["variant"] for r in sink.data["rows"]} == {
        "wowd sink",
        "async_bulk (prebuilt)",
        "async_bulk (from commits)",
    }
    text = render(sections, cfg=TINY, command="python -m bench --quick", quick=True, total_s=1.0)
    assert "## Growth" in text and "## Sink" in text and "| aggregate types |" in text
    assert "one MongoDB due-read command per poll" in targets({s.key: s for s in sections})


@pytest.mark.process
def test_end_to_end_section_feeds_and_fires_what_the_log_schedules() -> None:
    from dataclasses import replace

    from bench.__main__ import section_e2e
    from bench.e2e import E2eConfig

    cfg = replace(
        TINY,
        e2e=E2eConfig(
            catch_up_commits=200,
            catch_up_orders=20,
            scheduled_timers=1_000,
            scheduled_commits=10,
            scheduled_due_in_ms=1_000,
            firing_sizes=(300,),
            steady_rates=(50,),
            steady_seconds=0.2,
            steady_delay_ms=300,
        ),
    )
    section = section_e2e(cfg)
    med = section.data["medians"]
    # every live timer the log scheduled fires once; the demo's cancelled ones never do
    assert med["catch_up"]["commits"] == 200 and med["catch_up"]["fired"] == med["catch_up"]["expected"] == 200
    few = med["catch_up_orders"]  # 20 orders of 10 commits: every fifth order's second commit cancels a timer
    assert few["commits"] == 200 and few["fired"] == few["expected"] == 196
    scheduled = med["scheduled"]
    assert scheduled["fired"] == scheduled["expected"] == 1_000 and scheduled["fed_before_due"]
    assert 0 <= scheduled["p50_ms"] <= scheduled["p99_ms"] <= scheduled["max_ms"]
    # the firing path alone: ``wowd run`` fires every timer put into its table into the outbox
    assert med["alone 300"]["fired"] == med["bare 300"]["fired"] == 300 and med["alone 300"]["peak_rss_mb"] > 0
    for key in ("log steady 50", "alone steady 50"):  # log steady: ``wowd run`` fires what the log schedules
        assert med[key]["added"] > 0 and med[key]["fired"] == med[key]["added"]
    assert med["catch_up"]["cpu_s"] > 0 and med["catch_up"]["peak_rss_mb"] > 0
    text = render([section], cfg=cfg, command="python -m bench --quick --only e2e", quick=True, total_s=1.0)
    assert "## End to end through the log" in text and "catch-up >= 10,000 commits/s" in text


def test_feed_profile_reports_the_feed_steps() -> None:
    from bench.profile_feed import feed_once, report

    result = feed_once(300)
    assert result["partitions_checkpointed"] == result["partitions_in_log"] > 0
    text = report(result, top=5)
    assert "| the batch's transaction |" in text and "| - timer view rows |" in text and "| - checkpoints |" in text


@pytest.mark.process
def test_http_profile_fires_every_command_through_the_timer_loop_and_reports_its_steps() -> None:
    from bench.profile_http import fire_once, report

    result = fire_once(200, 8, profile=True)
    assert result["seen"] == result["n"] == 200, "the target saw each command once"
    text = report(result, top=5)
    # every step of the path is found in the profile under the name the table gives it
    for step in ("claim_due (store)", "settle (store)", "outcome_changes", "count_outcomes (metrics)", "gateway send"):
        assert f"| {step} |" in text, step
