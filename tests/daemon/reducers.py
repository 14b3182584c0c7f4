"""A reducer the rebuild tests name in their settings (``tests.daemon.reducers:reducer_v2``): a
module of its own, so that a ``wowd`` command loading it imports neither pytest nor the replica."""

from __future__ import annotations

from typing import Any

from wowd.model import DomainEvent


class CountingReducer:
    """State revision 2: a state the demo reducer (revision 1) does not write."""

    state_revision = 2

    def fold(self, state: dict[str, Any], event: DomainEvent) -> dict[str, Any]:
        return {"seen": int(state.get("seen", 0)) + 1, "last": event.name}


reducer_v2 = CountingReducer()


class ExplodingReducer:
    """A reducer with a bug: it raises on an ``Explode`` event (and folds the others as
    :data:`reducer_v2` does)."""

    def __init__(self, state_revision: int) -> None:
        self.state_revision = state_revision

    def fold(self, state: dict[str, Any], event: DomainEvent) -> dict[str, Any]:
        if event.name == "Explode":
            raise RuntimeError("reducer exploded")
        return reducer_v2.fold(state, event)


reducer_exploding = ExplodingReducer(3)
