"""Slot leases: owners, leases, acquire results, slot states."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wowd.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Owner:
    """A lease owner: ``key`` identifies the process (host:pid plus a random suffix by default)."""

    key: str

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or len(self.key) > 256:
            raise ConfigError("lease owner key: must be a non-empty string of at most 256 characters")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotLease:
    """A held slot. Times are store-clock milliseconds since the epoch.

    ``store_now``: the store's now when it answered with this lease; ``None`` means the answer
    is the write that stamped ``written_at`` (a take or a renewal). An idempotent acquire
    answers the stored lease unchanged, read at a later ``store_now``. Not part of equality: it
    says when the lease was seen, not what it is.
    """

    namespace: str
    slot: int
    owner_key: str
    incarnation: int
    fence: int
    expires_at: int
    floor: int
    ceiling: int
    written_at: int
    store_now: int | None = field(default=None, compare=False)
    held_by: str | None = field(default=None, compare=False)
    """Who holds the slot's namespace paused (a timer view rebuild), as the store saw it when it
    answered: the holder drains the slot's work and releases it (docs/operations.md, "Recovery").
    Not part of equality: a hold is asked of the lease, it is not the lease."""

    @property
    def remaining_ms(self) -> int:
        """The lease's remaining time on the store clock when the store answered:
        ``expires_at - store_now`` (``written_at`` for the answer of a write)."""
        return self.expires_at - (self.written_at if self.store_now is None else self.store_now)


@dataclass(frozen=True, slots=True, kw_only=True)
class AcquireResult:
    status: Literal["acquired", "exhausted", "refused"]
    lease: SlotLease | None = None
    reason: str | None = None

    @property
    def acquired(self) -> bool:
        return self.status == "acquired"


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotState:
    """One slot document as ``wowd status`` shows it (store-clock times)."""

    namespace: str
    slot: int
    owner_key: str | None
    last_owner_key: str | None
    incarnation: int
    fence: int
    expires_at: int
    next_floor: int
    store_now: int
    held_by: str | None = None
    """Who holds the slot paused until ``held_until`` (store clock), when that is later than ``store_now``."""
    held_until: int = 0

    @property
    def held(self) -> bool:
        """Whether a live hold keeps the slot from being taken."""
        return self.held_by is not None and self.held_until > self.store_now

    @property
    def live(self) -> bool:
        return self.owner_key is not None and self.expires_at > self.store_now
