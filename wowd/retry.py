"""The one retry helper of wowd: how long to wait before trying again, and the waiting.

- :class:`Backoff`: ``base_s * 2**attempt`` capped, optionally jittered into ``[x/2, x]``.
- :func:`retrying`: ``async for attempt in retrying(...): with attempt: ...`` (tenacity's
  ``AsyncRetrying``) retries what raises :class:`~wowd.errors.StorageUnavailable` after the
  backoff, logging each failure, until it succeeds; when the ``stop`` event is set while it waits,
  it raises :class:`RetryStopped`.
- :func:`retrying_blocking`: the same for a worker thread's blocking call, within a deadline.
- :class:`Pauses`: the same backoff for a long-running loop that goes on after a failure (the
  feed, the timer loop): ``await pauses.pause()`` after a failure, ``pauses.reset()`` after
  progress.
- :class:`Holdoff`: the same backoff for a call that several callers share and none waits for
  (a store's preparation of an index): after a failure, the calls within the backoff fail at
  once instead of asking the store again.

Nothing else in wowd sleeps to retry (a test looks for it).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import anyio
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
)

from wowd.errors import StorageUnavailable

__all__ = ["Backoff", "Holdoff", "Pauses", "RetryStopped", "retrying", "retrying_blocking"]

log = logging.getLogger(__name__)

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


class Backoff:
    """The pause before a retry: ``base_s * 2**attempt`` capped at ``cap_s`` (``attempt`` 0 is the
    first retry); with ``jitter``, scaled by a random factor in [0.5, 1]."""

    def __init__(self, base_s: float, cap_s: float, *, jitter: bool = False) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.jitter = jitter

    def __call__(self, attempt: int) -> float:
        # 2**attempt grows past any cap within a few dozen attempts: no overflow however many
        x = self.cap_s if attempt >= 64 else min(self.cap_s, self.base_s * 2**attempt)
        return x * random.uniform(0.5, 1.0) if self.jitter else x

    def wait(self, state: RetryCallState) -> float:
        """As a tenacity wait strategy (its first retry follows attempt number 1)."""
        return self(state.attempt_number - 1)


class RetryStopped(Exception):
    """The stop event was set while :func:`retrying` waited to try again."""


def retrying(
    what: str,
    *,
    backoff: Backoff,
    stop: anyio.Event | None = None,
    logger: Logger | None = log,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = StorageUnavailable,
    on_failure: Callable[[BaseException], None] | None = None,
) -> AsyncRetrying:
    """Retries the attempts of ``what`` that raise ``retry_on`` after ``backoff``, for ever,
    logging each failure at WARNING ("``what`` failed (will retry): ..."; ``logger=None``: not
    logged) and telling ``on_failure``; any other error is raised at once. Raises :class:`RetryStopped` when ``stop``
    is set while it waits."""

    async def sleep(seconds: float) -> None:
        if stop is None:
            await anyio.sleep(seconds)
            return
        with anyio.move_on_after(seconds):
            await stop.wait()
        if stop.is_set():
            raise RetryStopped(what)

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is not None:
            if logger is not None:
                logger.warning("%s failed (will retry): %s", what, exc)
            if on_failure is not None:
                on_failure(exc)

    return AsyncRetrying(
        retry=retry_if_exception_type(retry_on),
        wait=backoff.wait,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )


def retrying_blocking(*, backoff: Backoff, within_s: float, retry_if: Callable[[BaseException], bool]) -> Retrying:
    """``for attempt in retrying_blocking(...): with attempt: ...`` in a worker thread: retries
    what raises an error ``retry_if`` accepts after ``backoff`` (``time.sleep``), for
    ``within_s`` at most, then raises the last error."""
    return Retrying(
        retry=retry_if_exception(retry_if),
        wait=backoff.wait,
        stop=stop_after_delay(within_s),
        reraise=True,
    )


class Pauses:
    """The backoff of a loop that goes on after failures: :meth:`pause` waits ``backoff`` of the
    failures since the last :meth:`reset` (or the ``stop`` event, whichever comes first)."""

    def __init__(self, backoff: Backoff, stop: anyio.Event | None = None) -> None:
        self._backoff = backoff
        self._stop = stop
        self.failures = 0

    def reset(self) -> None:
        self.failures = 0

    async def pause(self, backoff: Backoff | None = None) -> None:
        """Waits after one more failure; returns early when ``stop`` is set."""
        delay = (backoff or self._backoff)(self.failures)
        self.failures += 1
        if self._stop is None:
            await anyio.sleep(delay)
            return
        with anyio.move_on_after(delay):
            await self._stop.wait()


class Holdoff:
    """The backoff of a call shared by callers that do not wait for it: :meth:`failed` after a
    failure holds the call off for ``backoff`` of the failures since the last :meth:`reset`;
    :meth:`remaining` says how long it is held off still (0: try it). Times are anyio's clock."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
        self.failures = 0
        self._until = float("-inf")

    def failed(self) -> float:
        """One more failure: answers the time the call is held off."""
        delay = self._backoff(self.failures)
        self.failures += 1
        self._until = anyio.current_time() + delay
        return delay

    def remaining(self) -> float:
        return max(0.0, self._until - anyio.current_time())

    def reset(self) -> None:
        self.failures = 0
        self._until = float("-inf")
