"""A work's :class:`Stall`: stalled at once by a full disk or a store that refuses, after a while of
transient failures; stalled until the failing step succeeds; its gauge says so; one ERROR line per
period however often it retries."""

from __future__ import annotations

import logging

import pytest

from wowd.daemon.stall import Stall
from wowd.errors import StorageError, StorageFull, StorageUnavailable

log = logging.getLogger("test.stall")

FULL = StorageFull("sqlite wowd.db: database or disk is full")


class Gauge:
    def __init__(self) -> None:
        self.value: float | None = None

    def set(self, value: float) -> None:
        self.value = value


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stall(after_unavailable_s: float = 60.0) -> tuple[Stall, Gauge, Clock]:
    gauge, clock = Gauge(), Clock()
    s = Stall("timer loop of slot 0", gauge, after_unavailable_s=after_unavailable_s, log_every_s=60, clock=clock)
    return s, gauge, clock


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_full_disk_stalls_at_once_and_a_success_of_the_step_ends_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "test.stall")
    s, gauge, clock = stall()
    assert gauge.value == 0 and not s.stalled
    s.failed("timer round", FULL, log)
    assert s.stalled and gauge.value == 1
    assert s.reason == "timer round: StorageFull: sqlite wowd.db: database or disk is full"
    assert lines(caplog, logging.ERROR) == [f"timer loop of slot 0 stalled (retrying): {s.reason}"]
    clock.t += 30
    s.progressed(log)
    assert not s.stalled and gauge.value == 0 and s.reason is None
    assert lines(caplog, logging.INFO) == ["timer loop of slot 0 progresses again (stalled 30 s)"]


def test_a_store_that_refuses_stalls_at_once() -> None:
    s, gauge, _clock = stall()
    s.failed("timer round", StorageError("sqlite wowd.db: database disk image is malformed"), log)
    assert s.stalled and gauge.value == 1 and "malformed" in (s.reason or "")


def test_transient_failures_stall_only_after_a_while(caplog: pytest.LogCaptureFixture) -> None:
    s, gauge, clock = stall(after_unavailable_s=60)
    busy = StorageUnavailable("sqlite wowd.db: database is locked")
    s.failed("timer round", busy, log)
    clock.t += 59
    s.failed("timer round", busy, log)
    assert not s.stalled and gauge.value == 0
    assert len(lines(caplog, logging.WARNING)) == 2  # each transient failure, before a stall
    s.progressed(log, "timer round")
    clock.t += 30
    s.failed("timer round", busy, log)  # failing anew: counted from here
    assert not s.stalled
    clock.t += 60
    s.failed("timer round", busy, log)
    assert s.stalled and gauge.value == 1


def test_one_error_line_a_minute_however_often_it_retries_and_across_stalls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, _gauge, clock = stall()
    for _ in range(100):
        s.failed("timer round", FULL, log)
        clock.t += 0.5  # 50 s of retries
    s.progressed(log)
    s.failed("timer round", FULL, log)  # stalled again within the minute: no second line yet
    assert len(lines(caplog, logging.ERROR)) == 1
    clock.t += 10
    s.failed("timer round", FULL, log)
    assert len(lines(caplog, logging.ERROR)) == 2


def test_the_work_is_stalled_until_every_failing_step_succeeds() -> None:
    s, gauge, _clock = stall()
    s.failed("settle", FULL, log)
    s.progressed(log, "timer round")  # a round that wrote nothing says nothing of the settle
    assert s.stalled and gauge.value == 1 and (s.reason or "").startswith("settle: StorageFull")
    s.failed("timer round", FULL, log)
    s.progressed(log, "settle")
    assert s.stalled and (s.reason or "").startswith("timer round: StorageFull")
    s.progressed(log, "timer round")
    assert not s.stalled and gauge.value == 0


def test_a_stall_without_a_gauge_and_a_gauge_pointed_elsewhere() -> None:
    s = Stall("slot keeper a")
    s.failed("lease acquire", FULL, log)
    assert s.stalled
    gauge = Gauge()
    s.gauge = gauge
    s.failed("lease acquire", FULL, log)
    assert gauge.value == 1
    s.progressed(log)
    assert gauge.value == 0
