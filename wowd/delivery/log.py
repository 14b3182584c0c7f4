"""The delivery log: outcomes other than Delivered, at most one line per target and kind every
10 s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from wowd.delivery.outcomes import Fail, Outcome, Park, Retry
from wowd.model import Timer

__all__ = ["DeliveryLog", "delivery_log", "timer_named"]

log = logging.getLogger(__name__)


class DeliveryLog:
    """Logs delivery outcomes other than Delivered: WARNING for a Retry, ERROR for a Fail, INFO
    for a Park, with the target, the reason (status or error) and the timer (its id, owner and
    key) with the request id the target saw (:func:`timer_named`).

    At most one line per target and kind every ``every_s``; the next line written says how many
    were left out since the previous one. A Fail is never hidden by a burst of Retries of the same
    target (each kind has its own window). The http gateway logs through :data:`delivery_log`;
    a caller deciding an outcome itself (e.g. a spent retry budget) can log it there too.
    """

    _LEVELS: dict[type[Any], tuple[int, str]] = {
        Retry: (logging.WARNING, "delivery to %s will be retried: %s (%s)%s"),
        Fail: (logging.ERROR, "delivery to %s failed for good: %s (%s)%s"),
        Park: (logging.INFO, "delivery to %s parked: %s (%s)%s"),
    }

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger or log
        self._every = every_s
        self._clock = clock
        self._windows: dict[tuple[str, type[Any]], list[float]] = {}  # [last line at, left out since]

    def outcome(self, target: str, outcome: Outcome, timer: Timer) -> None:
        """Logs ``outcome`` of a delivery of ``timer`` to ``target`` (nothing for Delivered),
        rate-limited."""
        kind = type(outcome)
        spec = self._LEVELS.get(kind)
        if spec is None or not self._log.isEnabledFor(spec[0]):
            return
        now = self._clock()
        window = self._windows.get((target, kind))
        if window is not None and now - window[0] < self._every:
            window[1] += 1
            return
        left_out = int(window[1]) if window is not None else 0
        self._windows[(target, kind)] = [now, 0]
        more = f"; {left_out} more like it left out of the log in the last {self._every:g}s" if left_out else ""
        level, msg = spec
        self._log.log(level, msg, target, getattr(outcome, "reason", ""), timer_named(timer), more)


def timer_named(t: Timer) -> str:
    """How a log line names a timer: ``timer <id> of <owner> key <key>, request id <id>`` (a
    line found by the id a target logged leads to the timer: ``wowd timers show``)."""
    return f"timer {t.timer_id} of {t.owner} key {t.key!r}, request id {t.request_id}"


delivery_log = DeliveryLog()
"""The process's delivery log (one window per target and kind for every caller)."""
