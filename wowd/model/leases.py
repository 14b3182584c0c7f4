"""Slot leases: owners, leases, acquire results, slot states; the presence of each replica beside
them and the clock reading of a store whose clock is each process's own."""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockReading:
    """This process's clock set beside the times a store whose clock is each process's own (the
    embedded backend's file) holds; every time in ms since the epoch.

    ``before`` and ``after`` are this process's clock around a write of the file, and
    ``file_written`` the file's modification time just after it, stamped by the host the file is
    on: with this process's clock right, ``before <= file_written <= after``. ``file_coarse``: that
    time is a whole second (a file system that keeps no finer ones). ``latest``: the latest time a
    lease or presence record was written at by the clock of the process that wrote it, with
    ``latest_by`` (its owner key) and ``latest_what``; never later than ``after`` while that
    process's clock and this one agree."""

    path: str
    before: int
    after: int
    file_written: int | None = None
    file_coarse: bool = False
    latest: int | None = None
    latest_by: str = ""
    latest_what: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaInfo:
    """What a replica says of itself in its presence record (:meth:`~wowd.stores.base.SlotLeaseStore.heartbeat`).

    ``instance`` names the process (random at each start): a record written by another instance
    of the same owner key (a restart) gets a new ``started_at``. ``slots``: the slots it holds
    now, ascending; none makes it a standby."""

    instance: str
    host: str
    pid: int
    version: str
    slots: tuple[int, ...] = ()

    @property
    def state(self) -> Literal["holding", "standby"]:
        return "holding" if self.slots else "standby"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaState:
    """One presence record as ``wowd status`` shows it. Times are store-clock milliseconds since
    the epoch: ``started_at`` the instance's first heartbeat, ``seen_at`` its last one,
    ``expires_at = seen_at + ttl``, ``store_now`` the store's now when it answered."""

    namespace: str
    owner_key: str
    instance: str
    host: str
    pid: int
    version: str
    state: Literal["holding", "standby"]
    slots: tuple[int, ...]
    started_at: int
    seen_at: int
    expires_at: int
    store_now: int

    @property
    def live(self) -> bool:
        """False for a replica that stopped heartbeating without leaving (killed, hung, cut off)."""
        return self.expires_at > self.store_now
