"""The chaos harness's duplicate allowance: a repeat is allowed only for a delivery in flight at a
fault of the replica that had it claimed, a repeat by the same process only across its own pause."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.harness import ChaosConfig, FaultMark, Harness
from tests.chaos.target import Delivery


def _harness(tmp_path: Path, sends: list[tuple[str, float]], marks: list[FaultMark]) -> Harness:
    h = Harness(ChaosConfig(), tmp_path)
    h._t0 = 0.0
    for tag, at in sends:
        d = Delivery(request_id="rid", tag=tag, target_id="order-1", at=at)
        h.target.deliveries.append(d)
        h.target.by_request.setdefault("rid", []).append(d)
    h.marks = marks
    return h


def _pause(tag: str, at: float, unsettled: frozenset[str] = frozenset({"rid"})) -> FaultMark:
    return FaultMark(kind="stop", replica=tag.split(".")[0], tag=tag, at=at, unsettled=unsettled)


def test_a_process_resending_across_its_own_pause_with_the_timer_unsettled_is_allowed(tmp_path: Path) -> None:
    # sent, the process paused with it claimed and unsettled, sent again once it held the slot again
    h = _harness(tmp_path, [("r2.3", 34.3), ("r2.3", 67.1)], [_pause("r2.3", 35.6)])
    h._duplicates(set())
    assert (h.report.duplicates, h.report.duplicates_allowed, h.report.duplicates_beyond_n) == (1, 1, 0)


def test_a_process_resending_with_no_pause_of_its_own_in_between_is_beyond(tmp_path: Path) -> None:
    for marks in (
        [],
        [_pause("r2.3", 70.0)],  # after both sends
        [_pause("r1.2", 40.0)],  # another process's pause
        [_pause("r2.3", 40.0, frozenset({"other"}))],  # a pause with other timers unsettled
    ):
        h = _harness(tmp_path, [("r2.3", 34.3), ("r2.3", 67.1)], marks)
        h._duplicates(set())
        assert h.report.duplicates_beyond_n == 1, marks
    # one pause allows one repeat, not two
    h = _harness(tmp_path, [("r2.3", 34.3), ("r2.3", 50.0), ("r2.3", 67.1)], [_pause("r2.3", 40.0)])
    h._duplicates(set())
    assert (h.report.duplicates, h.report.duplicates_beyond_n) == (2, 1)


def test_a_lease_lost_on_its_own_with_the_timer_unsettled_allows_one_repeat_by_the_next_holder(tmp_path: Path) -> None:
    # r1 delivered it into the outbox and lost its lease before the settle landed (a slow store):
    # the next holder, r2, sends it again
    lapse = FaultMark(kind="lapse", replica="r1", tag="r1.2", at=40.0, unsettled=frozenset({"rid"}))
    h = _harness(tmp_path, [("r2.3", 67.1)], [lapse])
    h._duplicates({"rid"})
    assert (h.report.duplicates, h.report.duplicates_allowed, h.report.duplicates_beyond_n) == (1, 1, 0)
    h = _harness(tmp_path, [("r2.3", 67.1)], [])  # no lapse, no fault: beyond
    h._duplicates({"rid"})
    assert h.report.duplicates_beyond_n == 1


def test_a_process_resending_after_it_lost_its_lease_on_its_own_is_allowed(tmp_path: Path) -> None:
    lapse = FaultMark(kind="lapse", replica="joined-1", tag="joined-1.37", at=306.4, unsettled=frozenset({"rid"}))
    h = _harness(tmp_path, [("joined-1.37", 304.1), ("joined-1.37", 308.2)], [lapse])
    h._duplicates(set())
    assert (h.report.duplicates, h.report.duplicates_beyond_n) == (1, 0)
