"""Small helpers shared by test modules."""

from __future__ import annotations

from wowd.daemon.waker import Waker
from wowd.model import AggregateRef, Command, Timer, deterministic_timer_id, partition

FAR_FUTURE_MS = 2**62


def caught_up_waker() -> Waker:
    """A waker whose feed has applied every commit (a timer loop tested without its feed)."""
    waker = Waker()
    waker.advance(FAR_FUTURE_MS)
    return waker


def once_timer(context: str, id: str, partitions: int, due_at: int) -> Timer:
    """The one-shot timer ``k`` (version 1) of order ``id``, due at ``due_at``, aimed at itself."""
    owner = AggregateRef(context=context, aggregate="order", id=id)
    return Timer(
        timer_id=deterministic_timer_id(owner, "k", 1),
        partition=partition(id, partitions),
        owner=owner,
        key="k",
        version=1,
        due_at=due_at,
        scheduled_at=due_at,
        target=owner,
        body=Command(name="go").to_json(),
    )
