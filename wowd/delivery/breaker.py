"""A target's circuit breaker."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from wowd import metrics

log = logging.getLogger(__name__)


class Admission(enum.Enum):
    SEND = "send"
    TRIAL = "trial"
    REFUSE = "refuse"


class CircuitBreaker:
    """One target's circuit: closed (requests go out) -> open after ``failures`` consecutive
    failures (each send answers Retry without a request for ``open_s``) -> half-open (one trial
    request; the others still answer Retry) -> closed when the trial succeeds, open again for
    ``open_s`` when it fails. Outcomes of requests sent before the circuit opened do not change
    an open circuit. One event loop: no locks."""

    def __init__(
        self, target: str, *, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.target = target
        self._limit = failures
        self._open_s = open_s
        self._clock = clock
        self._consecutive = 0
        self._open_until: float | None = None
        self._trial = False

    @property
    def is_open(self) -> bool:
        """Open or half-open (not every send goes out)."""
        return self._open_until is not None

    def refusing(self) -> float | None:
        """Without changing the state: ``None`` when a send may go out now, else the seconds
        until a trial may (0 while a trial is in flight)."""
        if self._open_until is None:
            return None
        if self._trial:
            return 0.0
        left = self._open_until - self._clock()
        return left if left > 0 else None

    def admit(self) -> Admission:
        """Whether a send goes out now: SEND (closed), TRIAL (this send is the half-open trial;
        report it with ``trial=True``) or REFUSE."""
        if self._open_until is None:
            return Admission.SEND
        if self._trial or self._clock() < self._open_until:
            return Admission.REFUSE
        self._trial = True
        return Admission.TRIAL

    def record(self, ok: bool, *, trial: bool = False) -> None:
        """The outcome of an admitted send: ``ok`` unless it timed out, met a transport error or
        a status counting against the target (408, 429, 5xx)."""
        if trial:
            self._trial = False
            if ok:
                self._close()
            else:
                self._open("its trial request failed")
            return
        if self._open_until is not None:
            return
        if ok:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._consecutive >= self._limit:
            self._open(f"{self._consecutive} consecutive failures")

    def abandon_trial(self) -> None:
        """The trial request was cancelled: the next send after this one may be the trial."""
        self._trial = False

    def _open(self, why: str) -> None:
        self._open_until = self._clock() + self._open_s
        self._consecutive = 0
        metrics.GATEWAY_CIRCUIT_OPEN.labels(target=self.target).set(1)
        log.warning(
            "circuit of %s opened (%s): its deliveries answer Retry without a request for %gs",
            self.target,
            why,
            self._open_s,
        )

    def _close(self) -> None:
        self._open_until = None
        self._consecutive = 0
        metrics.GATEWAY_CIRCUIT_OPEN.labels(target=self.target).set(0)
        log.info("circuit of %s closed: its trial request succeeded", self.target)
