"""Log lines of what a client can repeat at will (a refused request, a failed accept): at most one
line per kind every ``every_s``, the next one saying how many were left out, so that a flood of
requests neither floods the log nor hides that it happens."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """One line per ``kind`` every ``every_s`` on ``logger``; the lines between are counted and
    the next line written says how many. At most ``kinds`` kinds are remembered (the least
    recently logged is forgotten first), whatever a client makes up."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = 60.0,
        kinds: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._every = every_s
        self._kinds = kinds
        self._clock = clock
        self._windows: OrderedDict[str, list[float]] = OrderedDict()  # kind -> [last line at, left out]

    def log(self, kind: str, level: int, msg: str, *args: object) -> bool:
        """Logs ``msg % args`` unless a line of ``kind`` was written in the last ``every_s``
        (then counts it); True when written."""
        if not self._log.isEnabledFor(level):
            return False
        now = self._clock()
        window = self._windows.get(kind)
        if window is not None and now - window[0] < self._every:
            window[1] += 1
            return False
        left_out = int(window[1]) if window is not None else 0
        self._windows[kind] = [now, 0]
        self._windows.move_to_end(kind)
        while len(self._windows) > self._kinds:
            self._windows.popitem(last=False)
        if left_out:
            msg += f" ({left_out} more like it since the last such line)"
        self._log.log(level, msg, *args)
        return True
