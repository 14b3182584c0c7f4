"""Small helpers shared by test modules."""

from __future__ import annotations

from wowd.daemon.waker import Waker

FAR_FUTURE_MS = 2**62


def caught_up_waker() -> Waker:
    """A waker whose feed has applied every commit (a timer loop tested without its feed)."""
    waker = Waker()
    waker.advance(FAR_FUTURE_MS)
    return waker
