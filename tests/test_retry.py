"""The one backoff of wowd's retries: exponential, capped, optionally jittered into [x/2, x]."""

from __future__ import annotations

from wowd.retry import Backoff


def test_steady_backoff_doubles_from_its_base_up_to_its_cap() -> None:
    b = Backoff(0.1, 1.0)
    assert [round(b(a), 6) for a in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b(10**6) == 1.0  # no overflow however many attempts


def test_jittered_backoff_stays_within_half_and_whole_of_the_steady_one() -> None:
    steady, jittered = Backoff(1.0, 30.0), Backoff(1.0, 30.0, jitter=True)
    for attempt in (0, 3, 8, 10**6):
        waits = [jittered(attempt) for _ in range(500)]
        x = steady(attempt)
        assert all(x / 2 <= w <= x for w in waits)
        assert max(waits) - min(waits) > x / 4  # spread, not a constant
