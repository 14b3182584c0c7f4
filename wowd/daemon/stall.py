"""Whether a piece of a replica's work (a slot's timer loop, a slot keeper) cannot progress
because its store refuses (a full disk, a corrupted file, a store unavailable for a minute): the
state that readiness, a ``*_stalled`` gauge and a rate-limited ERROR line report.

A work loop tells its :class:`Stall` of each failure of a step (:meth:`Stall.failed`) and of each
step that succeeded (:meth:`Stall.progressed`), and pauses between tries as it would anyway (a
capped backoff). The work is stalled while any of its steps is; a step is stalled until it
succeeds again (another step's success, such as a read that wrote nothing, says nothing of a
write that fails). A failure stalls its step at once when retrying will not fix it soon: a full disk
(:class:`~wowd.errors.StorageFull`, which resolves only once an operator frees space) or a store
that refuses (:class:`~wowd.errors.StorageError` that is not transient); a transient failure
(:class:`~wowd.errors.StorageUnavailable`) stalls it once the step has been failing for
``after_unavailable_s``. While stalled, one ERROR line comes at most every ``log_every_s`` (the
other failures are logged at DEBUG); before, each transient failure is a WARNING.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from wowd import metrics
from wowd.errors import SlotStalled, StorageError, StorageFull, StorageUnavailable
from wowd.views import View

__all__ = ["LOG_EVERY_S", "STALL_AFTER_UNAVAILABLE_S", "Stall", "ViewStall"]

LOG_EVERY_S = 60.0
"""A stalled work's ERROR line comes at most this often."""
STALL_AFTER_UNAVAILABLE_S = 60.0
"""A step failing this long for a transient reason (no success in between) stalls the work."""


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
        """Why the work cannot progress now, its latest failure (``None``: it does)."""
        self.since = 0.0
        """When it stalled (``clock``), while it is."""
        self._failing_since: dict[str, float] = {}
        """Each failing step: since when (no success in between)."""
        self._stalled: dict[str, str] = {}
        """Each stalled step: its latest failure."""
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
        since = self._failing_since.setdefault(step, now)
        reason = f"{step}: {type(exc).__name__}: {exc}"
        transient = isinstance(exc, StorageUnavailable) and not isinstance(exc, StorageFull)
        if step in self._stalled or not transient or now - since >= self._after_unavailable_s:
            if self.reason is None:
                self.since = now
            self._stalled[step] = self.reason = reason
            self._set(1)
        if self.reason is None:
            logger.warning("%s: %s failed (will retry): %s", self.what, step, exc)
        elif now - self._logged_at >= self._log_every_s:
            self._logged_at = now
            logger.error("%s stalled (retrying): %s", self.what, self.reason)
        else:
            logger.debug("%s stalled (retrying): %s", self.what, reason)

    def progressed(self, logger: _Logger, step: str | None = None) -> None:
        """Records that ``step`` succeeded (``None``: the work as a whole, every step): the work is
        no longer stalled once none of its steps is (an INFO line says so). The ERROR line's rate
        limit holds across stalls."""
        if step is None:
            self._failing_since.clear()
            self._stalled.clear()
        else:
            self._failing_since.pop(step, None)
            self._stalled.pop(step, None)
        if self.reason is None:
            return
        if self._stalled:
            self.reason = next(reversed(self._stalled.values()))
            return
        logger.info("%s progresses again (stalled %.0f s)", self.what, self._clock() - self.since)
        self.reason = None
        self._set(0)

    def _set(self, value: float) -> None:
        if self.gauge is not None:
            self.gauge.set(value)


class ViewStall:
    """Whether one view of a slot can progress: ``reason`` is ``None`` while it does.
    ``wowd_feed_stalled{slot,view}`` is 1 while it cannot; an ERROR line comes at most once a
    minute. Only the slot's lead view (the timer view) gives the slot up after
    ``feed.stall_release_s`` (:class:`SlotStalled`): the others retry until their store takes
    their batch, each from its own checkpoint."""

    def __init__(self, slot: int, view: View, *, release_s: float | None) -> None:
        self.view = view
        self.reason: str | None = None
        self.since = 0.0
        self._release_s = release_s
        self._logged_at = float("-inf")
        self._unavailable_since: float | None = None
        self._gauge = metrics.FEED_STALLED.labels(slot=str(slot), view=view.name)
        self._lag = metrics.FEED_LAG.labels(slot=str(slot), view=view.name)

    def lag(self, seconds: float) -> None:
        self._lag.set(seconds)

    def unavailable(self, reason: str, logx: logging.LoggerAdapter[logging.Logger], *, full: bool = False) -> None:
        """A transient failure: stalled once the store has been unavailable for
        :data:`STALL_AFTER_UNAVAILABLE_S`, at once when it is ``full`` (:class:`StorageFull`: a
        full disk is freed by an operator, not in seconds). Nothing is quarantined for it: the
        batch is retried whole until the store takes it."""
        now = time.monotonic()
        if self._unavailable_since is None:
            self._unavailable_since = now
        if full or now - self._unavailable_since >= STALL_AFTER_UNAVAILABLE_S:
            self.stall(reason, logx)

    def stall(self, reason: str, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        now = time.monotonic()
        if self.reason is None:
            self.since = now
        self.reason = reason
        self._gauge.set(1)
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            logx.error("%s view stalled (retrying): %s", self.view.name, reason)
        if self._release_s is not None and now - self.since >= self._release_s:
            raise SlotStalled(f"{self.view.name} view stalled for {now - self.since:.0f} s: {reason}")

    def retrying(self, msg: str, exc: Exception, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        """A transient failure's line: WARNING, DEBUG while stalled (the stall's ERROR line says it)."""
        logx.log(logging.DEBUG if self.reason is not None else logging.WARNING, msg, exc)

    def progressed(self, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        self._unavailable_since = None
        if self.reason is not None:
            logx.info("%s view progresses again (stalled %.0f s)", self.view.name, time.monotonic() - self.since)
            self.reason = None
            self._logged_at = float("-inf")
        self._gauge.set(0)
