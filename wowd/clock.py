"""The wall clock as the stores and the log count it: milliseconds since the epoch."""

from __future__ import annotations

import time

__all__ = ["now_ms"]


def now_ms() -> int:
    """Now on the wall clock, in whole milliseconds since the epoch."""
    return int(time.time() * 1000)
