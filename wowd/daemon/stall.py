"""Whether a slot's work cannot progress because its store refuses (a full disk, a corrupted file,
a store unavailable for a minute): the state that readiness, a ``*_stalled`` gauge and a rate-
limited ERROR line report.

A work loop tells its :class:`Stall` of each failure (:meth:`Stall.failed`) and of each step that
succeeded (:meth:`Stall.progressed`), and pauses between tries as it would anyway (a capped
backoff). A failure stalls the work at once when retrying will not fix it soon: a full disk
(:class:`~wowd.errors.StorageFull`, which resolves only once an operator frees space) or a store
that refuses (:class:`~wowd.errors.StorageError` that is not transient); a transient failure
(:class:`~wowd.errors.StorageUnavailable`) stalls it once the store has been failing for
``after_unavailable_s``. While stalled, one ERROR line comes at most every ``log_every_s`` (the
other failures are logged at DEBUG); before, each transient failure is a WARNING.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from wowd.errors import StorageError, StorageFull, StorageUnavailable

__all__ = ["LOG_EVERY_S", "STALL_AFTER_UNAVAILABLE_S", "Stall"]

LOG_EVERY_S = 60.0
"""A stalled work's ERROR line comes at most this often."""
STALL_AFTER_UNAVAILABLE_S = 60.0
"""A store unavailable this long (failing with no success in between) stalls the work."""


_Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class Stall:
    """The stall state of one piece of work (``what``: ``"timer loop of slot 3"``), set in
    ``gauge`` when given (1 while stalled, else 0). ``reason`` is ``None`` while the work
    progresses."""

    def __init__(
        self,
        what: str,
        gauge: _Gauge | None = None,
        *,
        after_unavailable_s: float = STALL_AFTER_UNAVAILABLE_S,
        log_every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.gauge = gauge
        """Set to 1 while stalled, else 0 (the caller may point it elsewhere between stalls)."""
        self._after_unavailable_s = after_unavailable_s
        self._log_every_s = log_every_s
        self._clock = clock
        self.reason: str | None = None
        """Why the work cannot progress now (``None``: it does)."""
        self.since = 0.0
        """When it stalled (``clock``), while it is."""
        self._failing_since: float | None = None
        self._logged_at = float("-inf")
        self._set(0)

    @property
    def stalled(self) -> bool:
        return self.reason is not None

    def failed(self, step: str, exc: StorageError, logger: _Logger) -> None:
        """Records that ``step`` failed with ``exc`` (retried by the caller) and logs it: a
        WARNING while the work is not stalled, one ERROR line per ``log_every_s`` while it is
        (DEBUG for the failures in between)."""
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
        reason = f"{step}: {type(exc).__name__}: {exc}"
        transient = isinstance(exc, StorageUnavailable) and not isinstance(exc, StorageFull)
        stalls = not transient or now - self._failing_since >= self._after_unavailable_s
        if stalls and self.reason is None:
            self.since = now
        if stalls or self.reason is not None:  # stalled until a step succeeds: the latest reason
            self.reason = reason
            self._set(1)
        if self.reason is None:
            logger.warning("%s: %s failed (will retry): %s", self.what, step, exc)
        elif now - self._logged_at >= self._log_every_s:
            self._logged_at = now
            logger.error("%s stalled (retrying): %s", self.what, reason)
        else:
            logger.debug("%s stalled (retrying): %s", self.what, reason)

    def progressed(self, logger: _Logger) -> None:
        """Records a step that succeeded: the work is no longer stalled (an INFO line says so
        when it was). The ERROR line's rate limit holds across stalls."""
        self._failing_since = None
        if self.reason is not None:
            logger.info("%s progresses again (stalled %.0f s)", self.what, self._clock() - self.since)
            self.reason = None
            self._set(0)

    def _set(self, value: float) -> None:
        if self.gauge is not None:
            self.gauge.set(value)
