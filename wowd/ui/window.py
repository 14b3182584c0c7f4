"""This process's delivery metrics over the last minutes, for the status page: the fire lag's
p50 and p99 and the deliveries by outcome, from the differences of the Prometheus counters and
histogram buckets between now and a sample taken about :data:`WINDOW_S` ago.

A sample is taken at each read (and one when the window is made, at start-up): the window spans
from the latest sample at least :data:`WINDOW_S` old (else the oldest, the process's first
minutes) to now. Open circuits are read as they are now.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from wowd import metrics

__all__ = ["OUTCOMES", "WINDOW_S", "MetricWindow", "beyond_top", "quantile"]

WINDOW_S = 300.0
"""The span the rates are computed over (s)."""
MIN_SPACING_S = 1.0
"""Reads closer than this to the last sample kept add no sample (the samples stay few)."""

OUTCOMES: dict[str, MetricWrapperBase] = {
    "fired": metrics.TIMERS_FIRED,
    "retried": metrics.TIMERS_RETRIED,
    "parked": metrics.TIMERS_PARKED,
    "failed": metrics.TIMERS_FAILED,
    "misfired": metrics.TIMERS_MISFIRED,
}
"""The deliveries counted, by outcome (each counter summed over its labels)."""


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    buckets: tuple[tuple[float, float], ...]
    """The fire lag's cumulative bucket counts, by upper bound (``inf`` last)."""
    outcomes: dict[str, float]


def _values(metric: MetricWrapperBase, suffix: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in metric.collect() for s in family.samples if s.name.endswith(suffix)]


def _take(at: float) -> _Sample:
    buckets: dict[float, float] = {}
    for labels, value in _values(metrics.FIRE_LAG, "_bucket"):
        le = float(labels["le"])
        buckets[le] = buckets.get(le, 0.0) + value
    outcomes = {name: sum(v for _, v in _values(counter, "_total")) for name, counter in OUTCOMES.items()}
    return _Sample(at, tuple(sorted(buckets.items())), outcomes)


def beyond_top(q: float, buckets: Iterable[tuple[float, float]]) -> bool:
    """Whether the ``q`` quantile lies in the ``+Inf`` bucket: :func:`quantile` answers the
    largest finite bound, and the value is beyond it (shown ``> 60 s``)."""
    bs = list(buckets)
    if len(bs) < 2 or bs[-1][1] <= 0:
        return False
    return bs[-2][1] < q * bs[-1][1]


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative histogram buckets ``(upper bound, count)`` (ascending,
    ``inf`` last), interpolated linearly within its bucket as Prometheus' ``histogram_quantile``
    does; ``None`` without observations. A quantile in the ``+Inf`` bucket is the largest finite
    bound."""
    bs = list(buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in bs:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


class MetricWindow:
    """The window's samples (``clock``: monotonic seconds)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self._clock = clock
        self._window_s = window_s
        self._samples: deque[_Sample] = deque([_take(clock())])

    def read(self) -> dict[str, Any]:
        """``{window_s, fire_lag_p50_s, fire_lag_p99_s, fire_lag_p50_beyond, fire_lag_p99_beyond,
        deliveries: {outcome: n}, open_circuits}`` over the window ending now (``window_s``: its
        actual span; ``..._beyond``: the quantile is past the histogram's top bound, which it
        reads as)."""
        now = _take(self._clock())
        while len(self._samples) > 1 and now.at - self._samples[1].at >= self._window_s:
            self._samples.popleft()
        base = self._samples[0]
        if now.at - self._samples[-1].at >= MIN_SPACING_S:
            self._samples.append(now)
        old = dict(base.buckets)
        delta = [(bound, count - old.get(bound, 0.0)) for bound, count in now.buckets]
        p50, p99 = quantile(0.5, delta), quantile(0.99, delta)
        open_circuits = sorted(labels["target"] for labels, v in _values(metrics.GATEWAY_CIRCUIT_OPEN, "") if v >= 1)
        return {
            "window_s": round(now.at - base.at, 1),
            "fire_lag_p50_s": p50,
            "fire_lag_p99_s": p99,
            "fire_lag_p50_beyond": beyond_top(0.5, delta),
            "fire_lag_p99_beyond": beyond_top(0.99, delta),
            "deliveries": {k: int(now.outcomes[k] - base.outcomes.get(k, 0.0)) for k in OUTCOMES},
            "open_circuits": open_circuits,
        }
