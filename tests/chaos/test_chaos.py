"""A short chaos schedule in ``make test``: every fault kind at least once (rebuilds of the timer
view among them, one killed partway), nothing lost, no cancelled timer delivered, no duplicate but
the deliveries in flight at a kill or a pause."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import ChaosConfig, run_chaos

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(180)]


async def test_replicas_under_kills_pauses_restarts_and_rebuilds_lose_nothing(tmp_path: Path) -> None:
    # faults close together and a brisk producer: every kind of fault, timer view rebuilds (one
    # SIGKILLed partway, then at least one more), about 300 commits and over 15 malformed inputs in
    # 5 s of writing, timers due within 1.5 s; faults begin in the first 3 s (and go on until each
    # kind has happened once), so that the last pause past the ttl ends while the producer still
    # writes
    config = ChaosConfig(
        seed=20261129,
        duration_s=5.0,
        faults_for_s=3.0,
        due_in_ms=(100, 1500),
        drain_s=60.0,
        rate_per_s=60.0,
        malformed_every=15,
        fault_gap_s=(0.2, 0.6),
        rebuild_gap_s=(1.0, 2.0),
        rebuild_kill_first=True,
    )
    report = await run_chaos(config, tmp_path)
    assert not report.violations(), report.summary() + "\n" + "\n".join(report.violations())
    assert set(report.faults) == {"kill", "stop", "restart", "join", "rebuild"}, report.faults
    # the timer view rebuilt while the replicas ran, one rebuild SIGKILLed partway: the next ones
    # (and the replicas) work on the live view it left
    assert report.rebuilds_killed >= 1 and not report.rebuild_failures, [r.text() for r in report.rebuilds]
    assert [r.exit_code for r in report.rebuilds if not r.killed].count(0) >= 1, [r.text() for r in report.rebuilds]
    assert report.paused_holders >= 1, "a slot holder was paused longer than the ttl"
    assert report.timers_fired == report.timers_expected > 100
    assert report.commits_fed == report.commits_expected > 100
    assert report.malformed_injected >= 8 and report.quarantined == report.malformed_injected
    # the checkpoints were sampled all along (every 0.25 s, later when a sample waits on a busy
    # file: 27-33 samples on an idle machine, under 20 on a loaded one)
    assert report.checkpoint_samples > 10
    # the HTTP target and the outbox both took deliveries; some targets were slower than a claim
    assert report.http_deliveries > 50 and report.deliveries > report.http_deliveries
    assert report.slow_deliveries > 0 and config.slow_latency_s > config.claim_ttl_s
    assert report.cancelled_in_time > 10 and not report.cancelled_delivered
    assert report.duplicates_beyond_n == 0 and report.duplicates == report.duplicates_allowed
