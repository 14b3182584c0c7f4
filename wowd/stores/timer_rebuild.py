"""What a rebuild of the timer view shares on every backend (``wowd timers rebuild``;
docs/operations.md, "Recovery"): its lock owner's name, the refusal of a second rebuild, the
expired timers' reason and what the finish found."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from wowd.errors import StorageError

__all__ = [
    "EXPIRED_LISTED",
    "EXPIRED_REASON",
    "Expired",
    "Finished",
    "RebuildRunning",
    "SlotsNotReleased",
    "lock_gone",
    "lock_owner",
]

EXPIRED_REASON = (
    "expired, state unknown: due before the tombstone retention, with no tombstone and no row in the old view "
    "(timer view rebuild); not fired: wowd timers retry fires it"
)
"""The ``last_error`` of a FAILED timer a rebuild could not tell fired or not."""
EXPIRED_LISTED = 50
"""Expired timers named in the summary (all of them are counted)."""


class RebuildRunning(StorageError):
    """Another rebuild of the same timer view runs (its owner holds the lock)."""


class SlotsNotReleased(StorageError):
    """A replica did not release its slot for the swap (a version that knows no hold)."""


def lock_owner() -> str:
    """This process's name in the lock: host, process id and a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def lock_gone(owner: str) -> bool:
    """Whether ``owner`` (:func:`lock_owner`) is a process of this host that no longer runs (a
    rebuild killed holds nothing)."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclass(frozen=True, slots=True)
class Expired:
    """A one-shot timer the rebuild could not tell fired or not (not fired unless asked)."""

    timer_id: str
    owner: str
    key: str
    due_at: int


@dataclass(slots=True)
class Finished:
    """What the finish of a rebuild found and did."""

    caught_up: int = 0
    """Commits read in the finish (applied by the feed since the replay read them)."""
    statuses: dict[str, int] = field(default_factory=dict)
    """Timers of the new view per status (tombstones as DONE and CANCELLED)."""
    carried: int = 0
    """Timers taken from the old view (the same or a later version of their key)."""
    unreadable: list[int] = field(default_factory=list)
    """Partitions of the old view that could not be read (nothing carried from them)."""
    old_view: bool = True
    """The old view existed."""
    fired_in_outbox: int = 0
    """One-shot timers found in the outbox (DONE tombstones)."""
    expired: int = 0
    expired_listed: list[Expired] = field(default_factory=list)
    swapped: bool = False
    checkpoints: dict[int, int] = field(default_factory=dict)
    """The timer view's checkpoint (``seq``) of each partition the new view is consistent with
    (the embedded file)."""
