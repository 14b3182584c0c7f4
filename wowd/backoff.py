"""Exponential backoff for every retry of wowd, from tenacity's wait strategies."""

from __future__ import annotations

from tenacity import RetryCallState, Retrying, wait_exponential, wait_random_exponential
from tenacity.wait import wait_base

__all__ = ["Backoff"]

_RETRYING = Retrying()


class Backoff:
    """The pause before a retry: ``base_s * 2**attempt`` capped at ``cap_s`` (``attempt`` 0 is the
    first retry); with ``jitter``, scaled by a random factor in [0.5, 1]."""

    def __init__(self, base_s: float, cap_s: float, *, jitter: bool = False) -> None:
        self._wait: wait_base
        if jitter:  # half steady, half uniform: uniform(x / 2, x)
            half_s, half_cap = base_s / 2, cap_s / 2
            self._wait = wait_exponential(multiplier=half_s, max=half_cap) + wait_random_exponential(
                multiplier=half_s, max=half_cap
            )
        else:
            self._wait = wait_exponential(multiplier=base_s, max=cap_s)

    def __call__(self, attempt: int) -> float:
        state = RetryCallState(_RETRYING, None, (), {})
        state.attempt_number = attempt + 1
        return float(self._wait(state))
