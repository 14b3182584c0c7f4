"""The store protocols: every backend (embedded SQLite, MongoDB, Elasticsearch) implements these.

Each method's docstring is its contract: what it guarantees, what it raises, and whether it is
idempotent. The contract suites in ``tests/contract/`` hold every implementation to it.

Common to all: a transient failure (network, timeout, election, busy file, 429/5xx) raises
:class:`~wowd.errors.StorageUnavailable` and may be retried; any other store failure raises
another :class:`~wowd.errors.StorageError`. No driver exception crosses these methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar, cast, runtime_checkable

from wowd.errors import ConfigError, InvalidInput
from wowd.model import (
    AccessStamp,
    AcquireResult,
    AggregateRef,
    AggregateType,
    Checkpoint,
    ClockReading,
    Commit,
    HistoryRecord,
    LogBatch,
    LogEntry,
    OutboxBatch,
    OutboxEntry,
    Owner,
    Position,
    ReplicaInfo,
    ReplicaState,
    SlotLease,
    SlotState,
    SnapshotRecord,
    SnapshotSaveOutcome,
    SnapshotTable,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
)
from wowd.stores.formats import StoreFormat
from wowd.stores.timer_rebuild import Finished

__all__ = [
    "AppendOutcome",
    "Backend",
    "BackupDone",
    "CHUNK_PREPARATION",
    "Capability",
    "CheckLine",
    "Checkpoints",
    "ChunkPreparation",
    "ClockReading",
    "DISMISSAL_TEXT_MAX",
    "Ddl",
    "EventSink",
    "FEED_TRANSACTION",
    "FeedApplied",
    "FeedWriter",
    "FiredTimer",
    "HISTORY_READ_LIMIT",
    "Log",
    "ONLINE_BACKUP",
    "OUTBOX_SHORTCUT",
    "OUTBOX_TAKE_LEASE",
    "Offers",
    "OnlineBackup",
    "Operations",
    "Outbox",
    "OutboxFired",
    "OutboxRound",
    "OutboxShortcut",
    "OwnerProbe",
    "PRESENCE_RETENTION",
    "PROCESS_CLOCK",
    "Preflight",
    "Probe",
    "ProcessClock",
    "Projection",
    "Quarantine",
    "ReplicaInfo",
    "ReplicaState",
    "SERVER_CHECKS",
    "SLOT_HOLD",
    "ServerChecks",
    "SlotHold",
    "SlotLeaseStore",
    "SnapshotRebuildStore",
    "SnapshotStore",
    "TIMER_VIEW_REBUILD",
    "TimerFiring",
    "TimerHistory",
    "TimerQueries",
    "TimerSearch",
    "TimerView",
    "TimerViewRebuild",
    "TimerViewRebuilds",
    "consumers_of",
    "dismissal",
]


C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class Capability(Generic[C]):
    """What only some backends can do (a protocol of this module), as :meth:`Backend.capability`
    is asked for it; a store implementing it names it in its class's ``CAPABILITIES``."""

    name: str


class Ddl(StrEnum):
    """What a store does about its collections/tables/indexes before first use."""

    AUTO = "auto"
    """Create what is missing."""
    VALIDATE = "validate"
    """Require it to exist (and match); raise :class:`~wowd.errors.FormatError` otherwise."""
    NONE = "none"
    """Assume it exists."""


AppendOutcome = Literal["appended", "duplicate", "conflict"]
"""``appended``: written; ``duplicate``: a commit with this (aggregate id, request id) exists
(idempotent success); ``conflict``: another commit holds this version."""


class OwnerProbe(NamedTuple):
    """What :meth:`Log.committed_after` asks of one aggregate: a commit above ``version`` that
    may change its timer ``key`` (``None``: any commit above ``version``)."""

    ref: AggregateRef
    version: int
    key: str | None = None


@runtime_checkable
class Log(Protocol):
    """The context's log of commits (docs/schema.md)."""

    context: str
    partitions: int

    async def append(self, commit: Commit) -> AppendOutcome:
        """Appends one commit. Idempotent on ``(aggregate_id, request_id)``: a repeat answers
        ``duplicate``. Raises :class:`~wowd.errors.ConflictError` when another commit holds the
        version (a different request id)."""
        ...

    async def append_many(self, commits: Sequence[Commit]) -> list[AppendOutcome]:
        """Appends unordered; one outcome per commit, in order (no exception for a conflict)."""
        ...

    async def last_version(self, ref: AggregateRef) -> int:
        """The highest version stored for the aggregate ``ref``; 0 when it has no commit.
        Read-only; one indexed read. A writer appends at this version + 1 and reads again on
        :class:`~wowd.errors.ConflictError` (another writer took it)."""
        ...

    async def committed_after(self, probes: Sequence[OwnerProbe]) -> set[int]:
        """The indexes in ``probes`` of those whose aggregate the log holds a commit of above
        the probe's ``version`` that may change the timer ``key``: one that schedules or cancels
        that key, or deletes the aggregate (with ``key`` ``None``: any commit). A backend may
        answer more (any commit above the version), never fewer.

        Every commit acknowledged before the call began is seen: the embedded file's last
        committed state; on MongoDB one read per aggregate type on the primary with ``majority``
        read concern, filtered by partition (a commit acknowledged with ``w: majority`` is in
        the majority-committed state such a read returns). The timer loop asks it at a due time
        instead of waiting for the feed's watermark. Read-only."""
        ...

    async def insert_raw(self, aggregate: AggregateType, document: Mapping[str, Any]) -> None:
        """Writes ``document`` as is, without validation (tools and tests inject bad input)."""
        ...

    def read(
        self, positions: Mapping[int, Position | None], *, batch_size: int = 500, follow: bool = True
    ) -> AsyncIterator[LogBatch]:
        """Yields batches of the given partitions' entries after each one's position (``None``:
        from the start), in log order per aggregate. Malformed documents come as entries with
        ``commit=None`` and ``error`` set, never raised. With ``follow`` it tails forever
        (waiting without a busy poll); otherwise it stops when caught up, or once it has read
        every commit acknowledged before it began (a log that keeps receiving commits is never
        caught up). The iterator is closed
        by ``aclose()``/cancellation.

        A batch's ``watermark`` (store time, ms) says that every commit of these partitions
        appended before it has been yielded; while following and caught up, the read yields an
        empty batch whenever the watermark moves on (at least once per poll or stream answer),
        and soon after :meth:`nudge`. A batch whose ``covers`` is set holds its watermark for
        those partitions only (the others have not been read up to their head yet)."""
        ...

    def nudge(self) -> None:
        """Asks this process's following reads to look at the log's head now (the timer loop
        waits for the watermark to pass a due time). Cheap; never blocks."""
        ...

    async def aggregate_types(self) -> list[AggregateType]:
        """The aggregate types that have a log collection/table."""
        ...

    async def prepare(self) -> None:
        """Creates what the store needs as its DDL mode says (idempotent)."""
        ...

    async def ping(self) -> None:
        """Raises :class:`~wowd.errors.StorageUnavailable` if the store does not answer."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Checkpoints(Protocol):
    """How far each consumer of the log (a view, a rebuild) has read each partition, fenced."""

    async def prepare(self) -> None:
        """Creates what the store needs as its DDL mode says (idempotent)."""
        ...

    async def read(self, consumer: str, partitions: Sequence[int]) -> dict[int, Checkpoint]:
        """The stored checkpoints of ``consumer`` for ``partitions`` (missing ones absent)."""
        ...

    async def save(self, consumer: str, partition: int, position: Position, fence: int) -> bool:
        """Stores a checkpoint, admitted only when the stored one's fence is the same or lower:
        a checkpoint written under fence f is never overwritten under a fence below f.
        Answers False when refused. Idempotent."""
        ...

    async def save_all(self, consumer: str | Sequence[str], positions: Mapping[int, Position], fence: int) -> bool:
        """:meth:`save` of several partitions, for one consumer or several (the views a feed
        batch was applied to), in one write. False when any was refused (the others may be
        written: each is fenced on its own)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Quarantine(Protocol):
    """Documents of the log the feed cannot read or apply, kept with the reason."""

    async def prepare(self) -> None:
        """Creates what the store needs as its DDL mode says (idempotent)."""
        ...

    async def put(
        self, consumer: str, partition: int, aggregate: AggregateType, raw: Mapping[str, Any], reason: str
    ) -> None:
        """Keeps a document the feed cannot read or apply, with the reason. Idempotent per
        document (``consumer``, ``aggregate`` and the document): quarantining it again keeps its
        id and replaces its reason with ``reason``."""
        ...

    async def items(
        self,
        limit: int = 1000,
        after: str | None = None,
        *,
        ids: Collection[str] | None = None,
        dismissed: bool = False,
    ) -> list[dict[str, Any]]:
        """The quarantined items, oldest first (in the order of their ids): ``{id, created_at,
        consumer, partition, aggregate, raw, reason, dismissed}``. ``id`` is a string that names
        the item for as long as it is kept (embedded: the row id; MongoDB: the hex of the
        document's ``seq`` ObjectId), ``created_at`` when it was first quarantined (ms since the
        epoch), ``dismissed`` ``None`` or ``{at, reason, by}`` (:meth:`dismiss`). A listing
        holds the items not dismissed, or with ``dismissed`` the dismissed ones only; ``after``:
        only items after this id (the last id of a previous page); ``ids``: only these, dismissed
        or not (ids that name nothing are skipped). Read-only. Ids are given in commit order
        (embedded: one writer at a time; MongoDB: ``seq`` is drawn in the transaction that
        inserts the item), so paging by ``after`` never passes an item quarantined later."""
        ...

    async def dismiss(self, ids: Collection[str], reason: str, by: str) -> int:
        """Marks the items ``ids`` not dismissed yet as dismissed: an operator's verdict that the
        commit will never apply, with ``reason`` and who gave it (``by``), at the store's or the
        client's time. A dismissed item leaves the listing, the quarantine's count and ``retry
        --all``, and is kept for audit (listed with ``dismissed``, read by id) until released;
        quarantining its document again keeps it dismissed (and replaces its reason). Answers how
        many were dismissed (ids that name nothing or an item dismissed already are skipped);
        a blank ``reason`` or ``by`` is refused (:func:`dismissal`)."""
        ...

    async def release(self, ids: Collection[str]) -> int:
        """Deletes the quarantined items ``ids`` (ids that name nothing are skipped); answers how
        many were deleted. Idempotent."""
        ...

    async def close(self) -> None: ...


DISMISSAL_TEXT_MAX = 1000
"""The most characters of a dismissal's reason and of who gave it."""


def dismissal(reason: str, by: str) -> tuple[str, str]:
    """A dismissal's reason and author, stripped; :class:`~wowd.errors.InvalidInput` naming the
    field when one is blank or longer than :data:`DISMISSAL_TEXT_MAX` characters."""
    out = []
    for name, value, need in (("reason", reason, ": say why the commit will never apply"), ("by", by, "")):
        text = value.strip() if isinstance(value, str) else ""
        if not text:
            raise InvalidInput(f"is required{need}", field=name)
        if len(text) > DISMISSAL_TEXT_MAX:
            raise InvalidInput(f"is longer than {DISMISSAL_TEXT_MAX} characters", field=name)
        out.append(text)
    return out[0], out[1]


PRESENCE_RETENTION = timedelta(minutes=5)
"""How long a presence record is kept after it expired (listed as gone by
:meth:`SlotLeaseStore.replicas`), then deleted: by the next heartbeat of the namespace (embedded)
or by the TTL index (MongoDB)."""


@runtime_checkable
class SlotLeaseStore(Protocol):
    """CosId-style slot leases (docs/concepts.md), decided on the store's clock, and the
    presence record of each replica beside them (holders and standbys alike, for ``wowd
    status``): :meth:`heartbeat`, :meth:`replicas`, :meth:`leave`. Presence is information
    only: no lease decision reads it."""

    async def acquire(
        self,
        namespace: str,
        owner: Owner,
        limit: int,
        ttl: timedelta,
        tolerance: timedelta,
        slot_offset: int = 0,
        preferred_slot: int | None = None,
    ) -> AcquireResult:
        """Acquires a slot in ``[slot_offset, slot_offset + limit)``.

        Idempotent: an owner key holding a live slot gets that lease back unchanged, with the
        store's now of the read as ``store_now`` (the holder counts only ``remaining_ms``; a take
        answers ``store_now=None``: its own ``written_at``). Otherwise,
        in order: its last slot (sticky), ``preferred_slot``, then the first free slot, where free
        means no owner or ``expires_at + tolerance < store now``. Each take increments
        ``incarnation``; ``fence`` increments when the slot changes hands. ``exhausted`` when all
        slots are live; ``refused`` when the namespace is recorded with another limit or offset.
        A live slot is never handed to another owner."""
        ...

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        """Extends a lease that matches (namespace, slot, owner key, incarnation, fence) and has
        not expired by the store clock. ``None``: the lease is lost (expired, taken, or the
        owner key re-acquired in a newer incarnation)."""
        ...

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        """Clears the owner of a matching lease, keeps ``last_owner_key`` (sticky), and sets
        ``next_floor = max(last_issued + 1, floor)``. False when the lease did not match."""
        ...

    async def slots(self, namespace: str) -> list[SlotState]:
        """Every slot document of the namespace with the store's now (for ``wowd status``)."""
        ...

    async def heartbeat(self, namespace: str, owner_key: str, info: ReplicaInfo, ttl: timedelta) -> None:
        """Writes or refreshes the presence record of ``owner_key`` in ``namespace`` (one per
        replica): ``info``, ``seen_at`` = the store's now and ``expires_at = seen_at + ttl``, both
        from the store clock in the same write; ``started_at`` = the store's now of the first
        heartbeat of ``info.instance``, kept while the instance stays the same. One single-record
        upsert; idempotent (a repeat moves ``seen_at`` and ``expires_at`` on). Touches no slot.
        Records expired more than :data:`PRESENCE_RETENTION` ago are deleted (embedded: by this
        write, for the namespace; MongoDB: by the TTL index on ``expiresAt``)."""
        ...

    async def replicas(self, namespace: str) -> list[ReplicaState]:
        """The presence records of ``namespace`` by owner key, each with the store's now: the
        live ones and those expired within :data:`PRESENCE_RETENTION` (``live`` False: a replica
        that stopped without :meth:`leave`). Read-only."""
        ...

    async def leave(self, namespace: str, owner_key: str) -> bool:
        """Deletes the presence record of ``owner_key`` (a graceful stop); False when there was
        none. Idempotent."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerSearch:
    """What :meth:`TimerQueries.search` lists: the live timers matching every field given.

    ``owners``: of any of these owners (an owner's own stream and wowd's stream of it), with
    ``key`` only that key; ``status``: in that status; ``target``: whose command goes there, a
    search of the PARKED and FAILED timers only (``status`` one of those or unset), as the
    indexes serve it; ``due_from``/``due_until``: ``due_at`` in that range (inclusive);
    ``after``: after this ``(due_at, timer_id)`` (the last of a previous page)."""

    owners: tuple[AggregateRef, ...] = ()
    key: str | None = None
    status: TimerStatus | None = None
    target: AggregateRef | None = None
    due_from: int | None = None
    due_until: int | None = None
    after: tuple[int, str] | None = None

    def statuses(self) -> tuple[TimerStatus, ...]:
        """The statuses searched; raises :class:`~wowd.errors.InvalidInput` (field ``target``)
        for a target search of PENDING or FIRING timers."""
        if self.target is None:
            return (self.status,) if self.status is not None else tuple(TimerStatus)
        stuck = (TimerStatus.PARKED, TimerStatus.FAILED)
        if self.status is None:
            return stuck
        if self.status not in stuck:
            raise InvalidInput(
                f"a target search lists PARKED and FAILED timers, not {self.status.value} ones (search those by owner)",
                field="target",
            )
        return (self.status,)


@runtime_checkable
class TimerView(Protocol):
    """The timers of one context as the feed writes them from the log (docs/concepts.md): puts,
    cancels and tombstones, the parked timers a commit of their target resumes."""

    async def prepare(self) -> None:
        """Claims the registry's format (refuses another one) as the DDL mode says."""
        ...

    def collection_name(self, aggregate: str) -> str:
        """``wow_timer__<context>__<aggregate>``."""
        ...

    async def put(self, timer: Timer) -> bool:
        """Writes ``timer`` unless the same key holds a later version or a tombstone at the same
        or a later version (False). A later version replaces a stored timer or tombstone; the
        same version over a stored live timer changes nothing (a replay never resets FIRING,
        FAILED, PARKED or attempts) and answers True. Idempotent."""
        ...

    async def cancel(self, owner: AggregateRef, key: str, version: int) -> bool:
        """Cancels the timer ``key`` of ``owner`` at or below ``version``: it becomes a CANCELLED
        tombstone at ``version`` (written also when no timer is stored, so that a later replay of
        an earlier put is refused). True when a live timer was cancelled. Idempotent."""
        ...

    async def cancel_all(self, owner: AggregateRef, version: int) -> int:
        """Cancels every live timer of ``owner`` at or below ``version`` (each a CANCELLED
        tombstone at ``version``); answers how many. Idempotent."""
        ...

    async def write(self, writes: Sequence[TimerWrite]) -> list[int]:
        """Applies a batch of timer writes with the semantics of :meth:`put`, :meth:`cancel` and
        :meth:`cancel_all` each, as if in order (the feed passes the net effect of a log batch,
        :func:`~wowd.model.net_writes`, whose writes commute). Those per-write rules cannot tell
        two writes of one commit from a replay (a tombstone at a version refuses a put at it), so
        the writes of a commit go through :func:`~wowd.model.net_writes`, which applies them in
        their order, before they come here. One answer per write: 1/0 for a
        put (written) or a cancel (a live timer cancelled), the count for a ``cancel_all``.
        Embedded: one transaction; MongoDB: one unordered bulk write per collection. Idempotent."""
        ...

    async def parked_many(self, targets: Sequence[AggregateRef]) -> list[Timer]:
        """The PARKED timers whose target is any of ``targets`` (every partition, every owner
        type), each once, ordered by ``(due_at, timer_id)``: what :meth:`TimerQueries.parked`
        answers for each target, together. ``[]`` for no targets. Read-only.

        One read over the parked index whatever the number of targets (a feed batch's committed
        aggregates): embedded one statement, split only where the targets exceed SQLite's
        variable limit (the statements in one read transaction); MongoDB one aggregation on the
        registry, split only where its command would exceed 16 MiB."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class TimerFiring(Protocol):
    """The due timers of one context as the timer loop takes and settles them (docs/concepts.md):
    claims under a slot's fence, the outcomes settled, the next due time it sleeps until."""

    async def prepare(self) -> None:
        """Claims the registry's format (refuses another one) as the DDL mode says."""
        ...

    async def due(self, partitions: set[int] | frozenset[int], until: int, limit: int) -> list[Timer]:
        """Read-only. The first ``limit`` PENDING or FIRING timers of ``partitions`` with ``due_at <= until``,
        across every aggregate type, ordered by ``(due_at, timer_id)``. A FIRING timer whose
        claim expired is due again."""
        ...

    async def next_due(self, partitions: set[int] | frozenset[int], after: int) -> int | None:
        """The earliest ``due_at`` above ``after`` of the PENDING or FIRING timers of
        ``partitions``, across every aggregate type (a FIRING timer counts at its claim's expiry,
        when it is due again); ``None`` when there is none. One read over the due index, whatever
        the number of timers stored: the timer loop sleeps until then. Read-only."""
        ...

    async def claim_due(
        self,
        partitions: set[int] | frozenset[int],
        until: int,
        limit: int,
        *,
        owner_key: str,
        fence: int,
        claim_until: int,
        exclude: Collection[str] = (),
    ) -> list[Timer]:
        """Claims the first ``limit`` timers :meth:`due` would answer (timers whose id is in
        ``exclude``, this holder's deliveries in flight, are neither claimed nor counted), each as
        ``TimerChange.claim(t, owner_key=owner_key, fence=fence, until=claim_until)`` writes it;
        answers the timers as claimed, in due order. A stored timer that cannot be decoded (a rule
        a newer library refuses, a removed time zone) is set FAILED with the reason instead and is
        not answered; it never fails the call."""
        ...

    async def reclaim(self, partitions: set[int] | frozenset[int], fence: int) -> int:
        """Sets back to PENDING, due at their scheduled time, the FIRING timers of ``partitions``
        claimed under a fence below ``fence`` (a previous holder's claims, expired at once by a
        takeover); attempts unchanged. Answers how many."""
        ...

    async def settle(self, changes: Sequence[TimerChange]) -> int:
        """Applies each change (see :class:`~wowd.model.TimerChange`) to the document as loaded
        (``timer_id`` + ``revision``), one unordered bulk write per collection. A change whose
        document moved on is skipped. Answers how many were written."""
        ...

    async def sweep(self, before: int, limit: int) -> int:
        """Deletes at most ``limit`` tombstones made before ``before`` (ms); answers how many
        (0 where the store expires them itself, e.g. a TTL index)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class TimerQueries(Protocol):
    """The timers of one context as the operator's tools read them (``wowd timers``, ``wowd
    status``, the status page): by key, by target, by status, by search. Read-only."""

    async def prepare(self) -> None:
        """Claims the registry's format (refuses another one) as the DDL mode says."""
        ...

    async def find(self, owner: AggregateRef, key: str) -> Timer | None:
        """The live timer ``key`` of ``owner`` (no tombstone), or ``None``."""
        ...

    async def parked(self, target: AggregateRef) -> list[Timer]:
        """The PARKED timers whose target is ``target`` (every partition)."""
        ...

    async def scan(
        self, *, status: TimerStatus | None = None, limit: int = 100, partitions: set[int] | None = None
    ) -> list[Timer]:
        """Timers for the operator's tools, by ``(due_at, timer_id)`` (not on a hot path)."""
        ...

    async def search(self, query: TimerSearch, limit: int) -> list[Timer]:
        """The first ``limit`` live timers matching ``query``, by ``(due_at, timer_id)``, for the
        operator's tools (the status page, ``wowd timers list``). Read-only. Served by indexes:
        an owner's by the owner key, PENDING and FIRING ones by the due index (a read per
        partition, merged), PARKED and FAILED ones by the index of those statuses; raises
        :class:`~wowd.errors.InvalidInput` (field ``target``) for a target search of PENDING or
        FIRING timers, which no index serves."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class SnapshotStore(Protocol):
    """Snapshots of one context."""

    async def prepare(self) -> None: ...

    async def create_collection(self, aggregate: str) -> None:
        """Creates the type's collection/table, key and indexes when missing; refuses one
        recorded in another format (:class:`~wowd.errors.FormatError`)."""
        ...

    async def load(self, ref: AggregateRef) -> SnapshotRecord | None: ...

    async def load_many(self, refs: Sequence[AggregateRef]) -> dict[AggregateRef, SnapshotRecord]:
        """The stored snapshots of ``refs``, each as :meth:`load` answers it, by ref; a ref with
        no snapshot is absent, a ref given twice is read once. ``{}`` for no refs. Read-only.
        Raises :class:`~wowd.errors.InvalidInput` for a ref of another context (nothing read).

        One read per aggregate type whatever the number of refs (a feed batch's aggregates):
        embedded one ``SELECT`` per type, split only where the refs exceed SQLite's variable
        limit; MongoDB one ``find`` per type with ``$in`` on ``_id``, split only where its
        command would exceed 16 MiB, its cursor read to the end."""
        ...

    async def save(self, snapshot: SnapshotRecord) -> bool:
        """One conditional upsert: written when the stored version is below the new one and the
        stored state revision is not above the new one. A save refused for a higher stored
        state revision marks the stored snapshot stale (``stale_version``). Concurrent saves
        leave the highest version. True when written."""
        ...

    async def save_all(self, snapshots: Sequence[SnapshotRecord]) -> list[SnapshotSaveOutcome]:
        """Saves in :meth:`SnapshotSaveOutcome.rounds`, one bulk per type per round, each item
        guarded as :meth:`save`; one outcome per snapshot in order. A failing item is ``failed``
        alone."""
        ...

    async def mark_stale(self, ref: AggregateRef) -> bool:
        """Marks the stored snapshot stale (its ``stale_version`` set to its version + 1 unless
        already later). False when there is none."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class SnapshotRebuildStore(Protocol):
    """The rebuild control plane of snapshots."""

    async def claim(self, type: AggregateType, revision: int, lower: bool = False) -> SnapshotTable:
        """Records ``revision`` as the type's claimed state revision when it is higher than the
        stored one (or lower, with ``lower``); answers the table as stored after the call."""
        ...

    async def mark(
        self, type: AggregateType, revision: int, rebuilding: bool | None = None, backfilled: bool | None = None
    ) -> SnapshotTable | None:
        """Sets the flags given when the claimed revision is ``revision``; None otherwise."""
        ...

    async def table(self, type: AggregateType) -> SnapshotTable | None: ...

    async def pending(
        self, type: AggregateType, revision: int, after: AggregateRef | None, limit: int
    ) -> list[AggregateRef]:
        """Snapshots whose state revision is below ``revision``, in key order (tenant, id),
        after ``after``, at most ``limit``."""
        ...

    async def rewrite(self, snapshot: SnapshotRecord) -> bool:
        """Writes a rebuilt snapshot in place: admitted when the stored state revision is below
        the new one and the stored version not above it (or same revision, lower version);
        clears a stale mark. True when written."""
        ...


@runtime_checkable
class EventSink(Protocol):
    """The event index of one aggregate type: one document per commit."""

    type: AggregateType

    async def prepare(self) -> None:
        """Makes sure of the index, once, as the DDL mode says."""
        ...

    async def write(self, records: Sequence[Commit]) -> None:
        """Writes each commit as one document whose id is its stream id. Idempotent: a document
        written before counts as written. Durable on return. Raises
        :class:`~wowd.errors.StorageUnavailable` for a transient failure (429, 502-504,
        connection), :class:`~wowd.errors.SinkWriteError` naming the item for another; the items
        written stay. Then stamps changed access attributes over the aggregate's earlier
        documents (see :meth:`stamp`)."""
        ...

    async def stamp(self, ref: AggregateRef, access: Mapping[str, Any], as_of: int, from_: int, until: int) -> int:
        """Writes ``access`` over the documents of ``ref`` with versions in ``[from_, until]`` whose
        ``access_version`` is absent, below ``as_of``, or ``as_of`` with other attributes. The
        later of two stamps wins whatever their order. Answers how many documents changed."""
        ...

    async def stamp_all(self, stamps: Sequence[AccessStamp]) -> int:
        """Applies a page of stamps, each document under its own stamp's guard."""
        ...

    async def documents(self, ref: AggregateRef) -> list[dict[str, Any]]:
        """The stored documents of ``ref`` by version (tools and tests)."""
        ...

    async def close(self) -> None: ...


OUTBOX_TAKE_LEASE = timedelta(seconds=60)
"""How long a take holds its entries by default (:meth:`Outbox.take`)."""


@runtime_checkable
class Outbox(Protocol):
    """Where the ``outbox`` gateway delivers commands: unique on the request id."""

    async def put(self, entry: OutboxEntry) -> bool:
        """Inserts; False when the request id is there already (a re-fire: idempotent)."""
        ...

    async def put_many(self, entries: Sequence[OutboxEntry]) -> list[bool]:
        """Inserts a batch (one round trip); per entry, False when its request id was there."""
        ...

    async def entries(self, limit: int = 1000, after: int = 0) -> list[OutboxEntry]:
        """At most ``limit`` entries in insertion order, skipping the first ``after`` (tools)."""
        ...

    async def take(self, limit: int = 100, *, lease: timedelta = OUTBOX_TAKE_LEASE) -> OutboxBatch:
        """The consumer's read: the oldest (insertion order) at most ``limit`` entries that are
        not acknowledged and that no live take holds, each now held by this take for ``lease``
        (on the store's clock); the batch's ``cursor`` names the take (``None`` when empty).

        No cursor to pass: an entry whose writer committed it late (another replica's, a
        concurrent batch's, ordered before entries taken already) is taken by the next take all
        the same. While a take's lease holds, no other take gets its entries; an entry not
        acknowledged when its lease runs out is taken again (at-least-once: acknowledge within
        the lease). An entry stays until acknowledged or trimmed. Raises
        :class:`~wowd.errors.InvalidInput` (field ``lease``) for a lease under 1 ms."""
        ...

    async def ack(self, request_ids: Sequence[str]) -> int:
        """Removes the entries of ``request_ids`` (consumed); answers how many were there.
        Idempotent. A request id fired again after its ack is a new entry (at-least-once)."""
        ...

    async def trim(self, before: int) -> int:
        """Removes the entries created before ``before`` (ms), acknowledged or not (the
        retention); answers how many."""
        ...

    async def count(self) -> int:
        """The entries in the outbox: those not acknowledged (an ack removes its entries) nor
        trimmed yet, the outbox's depth. Cheap enough to be called at every metrics scrape."""
        ...

    async def close(self) -> None: ...


HISTORY_READ_LIMIT = 200
"""The records a history read answers at most by default (the latest)."""


@runtime_checkable
class TimerHistory(Protocol):
    """The history of the context's timers (:class:`~wowd.model.HistoryRecord`): what scheduled
    and cancelled each (the feed's records of the commits) and each delivery attempt (the firing
    path's, with each group of outcomes it settles). Kept beside the timers, for as long as
    tombstones are (each record's ``expires_at``)."""

    async def prepare(self) -> None:
        """Creates what the store needs as its DDL mode says (idempotent)."""
        ...

    async def append(self, records: Sequence[HistoryRecord]) -> None:
        """Writes ``records`` in one write: each replaces the record of its ``(timer_id, slot)``
        (idempotent: a replay or a retried write changes nothing; an attempt's slot is a ring
        of the timer's last attempts). A ``scheduled`` or ``cancelled`` record also ends the
        schedules of its key (of every key of its owner, for key ``""``) at lower versions that
        have no expiry (a recurring timer's, kept while it lived): they expire with it. No
        record: nothing written."""
        ...

    async def of_timer(self, timer_id: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        """The records of ``timer_id``, oldest first (the latest ``limit``). Read-only; over
        the records' key."""
        ...

    async def of_key(self, owner: AggregateRef, key: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        """The records of the timers ``key`` of ``owner`` (every version), and the cancels of
        all its keys (key ``""``), oldest first (the latest ``limit``). Read-only; over an index."""
        ...

    async def of_request(self, request_id: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        """The records of ``request_id``: the attempts that sent it (a re-fire sends it again),
        or the records of the commit appended with it. Oldest first. Read-only; over an index."""
        ...

    async def sweep(self, before: int, limit: int) -> int:
        """Deletes at most ``limit`` records that expired before ``before`` (ms); answers how
        many (0 where the store expires them itself, a TTL index)."""
        ...

    async def close(self) -> None: ...


class FiredTimer(NamedTuple):
    """A timer :meth:`OutboxShortcut.fire_into_outbox` fired (a tuple: one per timer on the hot
    path, where a frozen dataclass would cost more than the rest of its handling)."""

    timer_id: str
    target: str
    """Its target, ``context.aggregate`` (the label of its metrics)."""
    scheduled_at: int
    """The occurrence fired (its outbox entry's)."""
    next_due: int | None
    """Its next occurrence, at which it is PENDING now; None: a DONE tombstone."""
    misfired: bool = False
    """Past its rule's misfire grace: settled, not delivered (no outbox entry)."""
    timer: Timer | None = None
    """The timer as read, for a misfired one (its skip is logged naming it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxRound:
    """One round of :meth:`OutboxShortcut.fire_into_outbox`: fire, under ``fence`` and
    ``owner_key`` at ``at`` (the fire time, ms), the first ``limit`` timers of ``partitions`` due
    by ``at``, none of ``exclude``, by the fire rule: a timer due by ``read_to`` (every commit of
    these partitions appended before it is applied to the timer view) fires; one due after it
    fires only when the log holds no commit of its owner above the timer's version
    (:meth:`Log.committed_after`, asked in the same transaction, which begins after ``at``: it
    sees every commit appended before the timer's due time); else it is left for the feed.
    ``next_due(timer, at)`` is a recurring timer's next occurrence."""

    partitions: frozenset[int]
    at: int
    read_to: int
    limit: int
    owner_key: str
    fence: int
    next_due: Callable[[Timer, int], int | None]
    exclude: Collection[str] = ()
    deadline: float | None = None
    """The lease's validity on ``time.monotonic()``'s clock: nothing is committed after it."""
    history_retention_ms: int | None = None
    """Each timer fired (or skipped past its misfire grace) recorded in the timer history of the
    store's file, in the same transaction, its record kept this long; ``None``: not recorded."""


@dataclass(frozen=True, slots=True)
class OutboxFired:
    """What :meth:`OutboxShortcut.fire_into_outbox` did: the timers fired, in due order, and how
    many due timers it left because the log holds a commit of their owner the feed has not
    applied yet (taken again once it has)."""

    fired: list[FiredTimer]
    left: int = 0


class OutboxShortcut(Protocol):
    """A capability (:meth:`Backend.capability`) of a backend whose timers, log and outbox share
    one transaction (the embedded file): the outbox gateway's round in one write, with no claim
    (the claim, the outbox insert and the settle of the claim, deliver and settle path, at
    once)."""

    async def fire_into_outbox(self, round: OutboxRound) -> OutboxFired:
        """In one write transaction: reads the timers :meth:`TimerFiring.claim_due` would claim
        (the first ``round.limit`` due by ``round.at`` of its partitions, in due order, none of
        ``round.exclude``; a timer claimed by anyone is due only once its claim expired), leaves
        those the fire rule does not fire yet (:class:`OutboxRound`), inserts the outbox entry of
        each other one (request id, timer, target, command, scheduled time, the round's ``fence``
        and ``owner_key``, created ``at``; a request id there already is recorded as a
        re-delivery, as :meth:`Outbox.put_many` does) and settles each as
        ``TimerChange.fired(timer, fence=fence, next_due=round.next_due(timer, at))`` writes it
        (asked of recurring timers only); an occurrence past its rule's ``misfire_grace_ms`` at
        ``at`` is settled the same way with no outbox entry (``FiredTimer.misfired``). With
        ``round.history_retention_ms``, the attempt of each (``delivered``, or ``misfired``) is
        recorded in the timer history of the same file (:meth:`TimerHistory.append`). All of it is
        written or nothing: with a ``deadline`` (``time.monotonic()``), the transaction rolls back
        and raises :class:`~wowd.errors.LeaseLost` when it would commit after it. A timer whose
        rule or next occurrence cannot be computed is set FAILED as ``claim_due`` does."""
        ...


OUTBOX_SHORTCUT: Capability[OutboxShortcut] = Capability("outbox shortcut")
"""The capability :class:`OutboxShortcut`."""


@dataclass(frozen=True, slots=True)
class FeedApplied:
    """What :meth:`FeedWriter.apply` did: each timer write's answer (as :meth:`TimerView.write`
    gives them), the PARKED timers it resumed, and whether the checkpoints were admitted (when
    not, nothing was written)."""

    timer_answers: list[int]
    resumed: list[Timer]
    saved: bool


class FeedWriter(Protocol):
    """A capability (:data:`FEED_TRANSACTION`) of a backend whose stores share one transaction
    (the embedded file): a feed batch applied in it, the event sink's documents, the timer
    writes, the resumption of the PARKED timers of the batch's aggregates and the checkpoints
    under the slot's fence, all or nothing."""

    async def plan(
        self, records: Sequence[tuple[EventSink, Sequence[Commit]]], timer_writes: Sequence[TimerWrite]
    ) -> object | None:
        """What :meth:`apply` of this batch needs made ready (documents encoded, writes checked):
        pure work the feed does while the batch before is written, given to :meth:`apply` as
        ``planned`` (and again to a retry of it). ``None`` when this writer does not take the
        batch whole."""
        ...

    async def apply(
        self,
        records: Sequence[tuple[EventSink, Sequence[Commit]]],
        timer_writes: Sequence[TimerWrite],
        consumer: str | Sequence[str],
        positions: Mapping[int, Position],
        fence: int,
        *,
        now: int,
        planned: object = None,
        history: Sequence[HistoryRecord] = (),
    ) -> FeedApplied | None:
        """Writes the batch in one transaction: ``records`` each to its sink (prepared), the timer
        writes in order and the ``history`` of their commits (as :meth:`TimerHistory.append`
        writes it), the PARKED timers of the records' aggregates resumed due at ``now``,
        and the checkpoints of ``consumer`` (one, or each of several);
        ``None``, having written nothing, when it cannot take this batch whole (a record a step
        would refuse, more timer writes than a transaction should hold): the caller then
        applies it step by step, which names what is refused. ``planned``: :meth:`plan` of these
        records and writes (made here when not given). Raises as the stores do."""
        ...


FEED_TRANSACTION: Capability[FeedWriter] = Capability("feed transaction")
"""The capability :class:`FeedWriter`."""


class ProcessClock(Protocol):
    """A capability (:data:`PROCESS_CLOCK`) of a backend whose store clock is each replica
    process's own (the embedded file's): how this process's clock compares with the store's last
    writes, which a replica checks before it takes a slot."""

    async def clock_reading(self, owner_key: str) -> ClockReading:
        """This process's clock beside the store's last writes (:class:`ClockReading`), written
        under ``owner_key`` (the replica's)."""
        ...


PROCESS_CLOCK: Capability[ProcessClock] = Capability("process clock")
"""The capability :class:`ProcessClock`."""


class SlotHold(Protocol):
    """A capability (:data:`SLOT_HOLD`) of a lease store: every slot of a namespace held paused
    for a while (a rebuild of the timer view swaps it in while no replica works)."""

    async def hold(self, namespace: str, by: str, ttl: timedelta) -> list[SlotState]:
        """Holds every slot of ``namespace`` paused for ``by`` until the store's now + ``ttl``
        (renewed by calling it again): no acquire takes a held slot, and each holder learns of
        the hold at its next renewal and releases its slot once its work has drained. Answers the
        namespace's slots after the write; raises :class:`~wowd.errors.StorageError` when another
        holder's live hold is on any of them."""
        ...

    async def lift(self, namespace: str, by: str) -> int:
        """Ends the hold of ``by`` on the slots of ``namespace``; answers how many it held."""
        ...


SLOT_HOLD: Capability[SlotHold] = Capability("slot hold")
"""The capability :class:`SlotHold`."""


Projection = Callable[[Sequence[LogEntry]], list[TimerWrite]]
"""The feed's projection of log entries into the timer view's writes (a rebuild replays the log
through it)."""


class TimerViewRebuild(Protocol):
    """One rebuild of the context's timer view from the log (``wowd timers rebuild``;
    docs/operations.md, "Recovery"): a shadow of the view beside the live one, replayed from the
    log, what the old view holds carried over, swapped in. The daemon's rebuilder drives it: the
    lock, the replay (with progress), the carry-over, the pause (:attr:`holds_slots`), the
    finish. Interrupted anywhere, it leaves the live view as it was."""

    owner: str
    """Who holds the rebuild's lock (host, process and a random tag)."""
    shadow: str
    """Where the replay writes, as a progress line names it."""
    holds_slots: bool
    """Whether the swap needs every slot of the replicas held (:data:`SLOT_HOLD`) while it runs;
    otherwise it pauses what it must itself (:attr:`pause`)."""
    pause: str
    """What the swap holds while it runs, as the summary names it."""

    async def acquire(self, ttl_s: float) -> None:
        """Takes the context's rebuild lock for ``ttl_s``; raises
        :class:`~wowd.stores.timer_rebuild.RebuildRunning` naming the holder when another live
        rebuild holds it (one of this host whose process is gone holds nothing)."""
        ...

    async def renew(self, ttl_s: float) -> None:
        """Extends the lock; raises :class:`~wowd.errors.LeaseLost` when another rebuild took it."""
        ...

    async def release(self) -> None:
        """Drops the lock if this rebuild holds it."""
        ...

    async def begin(self) -> int | None:
        """A new, empty shadow (a leftover of an interrupted rebuild is dropped); answers the
        commits the replay reads when the store can count them at once (``None`` otherwise)."""
        ...

    def replay(self, *, batch_size: int | None = None, workers: int | None = None) -> AsyncIterator[int]:
        """The log from its start into the shadow, through the projection, in log order per
        aggregate; yields the commits read after each batch is written (``batch_size`` commits
        at most; ``None``: the store's). ``workers``: processes that decode and project ranges of
        the log meanwhile where the store can use them (``None``: as many as fit; 0: none)."""
        ...

    async def live_count(self) -> int:
        """Live timers in the shadow so far (for the progress lines)."""
        ...

    def finishing(self, *, expired_before: int | None, result: Finished) -> AbstractAsyncContextManager[None]:
        """What is done before the pause, the replicas' writes going on: one-shot timers the
        outbox holds become DONE tombstones, one-shot timers due before ``expired_before``
        (epoch ms; ``None``: none) FAILED as "expired, state unknown", and what the old view
        holds is carried over (tombstones, attempts, PARKED, FAILED and their reasons, claims);
        until the block ends, what the old view is written meanwhile is recorded for
        :meth:`finish` to carry again. ``result`` records what was found."""
        ...

    async def finish(self, *, swap: bool, result: Finished, tick: Callable[[], Awaitable[None]]) -> None:
        """Within :meth:`finishing`, paused (:attr:`holds_slots`): the shadow catches up to what
        the feed applied since the replay, what the old view was written meanwhile is carried
        again, the new view counted into ``result``, and the shadow replaces the live view; with
        ``swap`` false (a dry run) everything is counted and nothing changed (the shadow dropped).
        ``tick`` is awaited between the catch-up's batches (the caller renews what it holds)."""
        ...

    async def abort(self) -> None:
        """Drops the shadow (the live view is left as it is), unless another rebuild holds the
        lock now."""
        ...

    async def close(self) -> None: ...


class TimerViewRebuilds(Protocol):
    """A capability (:data:`TIMER_VIEW_REBUILD`): rebuilds of the context's timer view."""

    def rebuild(self, *, project: Projection, consumer: str, aggregate: str | None) -> TimerViewRebuild:
        """A rebuild replaying the log through ``project`` (picklable: a store may project in
        processes of its own), the view's checkpoints those of ``consumer``; only ``aggregate``'s
        timers when given (the old view's other timers are kept as they are)."""
        ...


TIMER_VIEW_REBUILD: Capability[TimerViewRebuilds] = Capability("timer view rebuild")
"""The capability :class:`TimerViewRebuilds`."""


@dataclass(frozen=True, slots=True)
class BackupDone:
    """What :meth:`OnlineBackup.backup` did: ``written`` (the copy passed its check and is at
    its path; else nothing is) and one line saying what was copied, or why not."""

    written: bool
    text: str


class OnlineBackup(Protocol):
    """A capability (:data:`ONLINE_BACKUP`) of the operations of a backend whose stores can be
    copied while replicas run (``wowd backup``)."""

    async def backup(
        self, target: Path, *, force: bool, step_pages: int, progress: Callable[[str], None]
    ) -> BackupDone:
        """A consistent copy of the stores at ``target`` (replaced with ``force``), checked before
        it is put there, with progress lines; raises :class:`~wowd.errors.ConfigError` for a
        target it must not write (the stores themselves, a directory, one that exists without
        ``force``) or stores that do not exist."""
        ...


ONLINE_BACKUP: Capability[OnlineBackup] = Capability("online backup")
"""The capability :class:`OnlineBackup`."""


class Probe(NamedTuple):
    """One check of ``wowd check``: ``run`` answers (a text is shown after the name) or raises
    :class:`~wowd.errors.WowdError` naming what is wrong."""

    name: str
    run: Callable[[], Awaitable[object]]


class ServerChecks(Protocol):
    """A capability (:data:`SERVER_CHECKS`) of the operations of a backend on servers: the
    privileges and versions ``wowd check`` asks them for beyond what the stores answer."""

    def probes(self) -> list[Probe]:
        """The checks of the servers (privileges, versions, settings that matter to the leases)."""
        ...

    def type_probes(self, type: AggregateType) -> list[Probe]:
        """The checks of what one aggregate type uses on the servers (its event index's privileges)."""
        ...


SERVER_CHECKS: Capability[ServerChecks] = Capability("server checks")
"""The capability :class:`ServerChecks`."""


class ChunkPreparation(Protocol):
    """A capability (:data:`CHUNK_PREPARATION`) of the operations of a backend that can spread a
    new collection's chunks over its shards, a one-off it leaves off the feed's path (``wowd
    check --prepare``)."""

    async def prepare_chunks(self) -> dict[str, str]:
        """Spreads the chunks of each timer collection that needs it (bounded in time); answers
        what it did per collection (none: nothing to spread)."""
        ...


CHUNK_PREPARATION: Capability[ChunkPreparation] = Capability("chunk preparation")
"""The capability :class:`ChunkPreparation`."""


class CheckLine(NamedTuple):
    """A line of ``wowd check``: ``ok`` or not, and what was found."""

    ok: bool
    text: str


@dataclass(slots=True)
class Preflight:
    """What ``wowd check`` reads of a backend before it opens it (nothing created or changed):
    a line per server or file reached, and the formats its stores recorded (``None``: not read,
    with the line that says why; the stores are not opened then)."""

    lines: list[CheckLine] = field(default_factory=list)
    formats: list[StoreFormat] | None = None


class Operations(Protocol):
    """One backend's operations object, made from the settings alone (nothing opened): it opens
    the backend (:meth:`open`) and does what the backend does besides its stores' protocols,
    each a capability it offers or not (:meth:`capability`; the opened :class:`Backend` offers
    them too). A backend package gives one (docs/architecture.md, "Adding a backend")."""

    name: str
    """The backend's name (``WOWD_BACKEND``)."""
    recovery: str
    """How the backend's stores are backed up and restored (docs/operations.md, "Recovery"), for
    a command that cannot do it itself."""

    def where(self) -> str:
        """Where the stores are, in a sentence (``embedded file ./wowd.db``)."""
        ...

    def outbox_where(self) -> str:
        """Where the ``outbox`` gateway writes, in a sentence."""
        ...

    def absent(self, how_to_create: str) -> ConfigError | None:
        """The error of opening the stores without creating them when they do not exist (a
        mistyped path), naming the setting and ``how_to_create`` them; ``None`` when they exist
        or a backend's stores are created elsewhere (a server)."""
        ...

    async def preflight(self) -> Preflight:
        """What ``wowd check`` reads before opening the stores: the servers or the file reached,
        the formats recorded and a rebuild of the timer view running or interrupted."""
        ...

    async def open(self) -> Backend:
        """Opens and prepares every store (:class:`Backend`); imports the backend's drivers only now."""
        ...

    def capability(self, kind: Capability[C]) -> C | None:
        """This object, when its class names ``kind`` in ``CAPABILITIES``; else ``None``."""
        ...


class Offers:
    """What offers capabilities: its class names them in ``CAPABILITIES``."""

    CAPABILITIES: tuple[Capability[Any], ...] = ()

    def capability(self, kind: Capability[C]) -> C | None:
        return cast(C, self) if kind in type(self).CAPABILITIES else None


SINKS_KEPT = 256
"""Event sinks a :class:`Backend` keeps made (the types used last); another is made again when
its type comes back."""


@dataclass(kw_only=True)
class Backend:
    """The stores of one context, as a backend opened them, one per protocol; ``sink(type)`` gives
    the event sink of a type, keeping the :data:`SINKS_KEPT` used last (a sink holds nothing of
    its own: the connections, clients and caches are the backend's, shared by the sinks of every
    type, so that nothing grows with the number of types). ``close`` closes the sinks kept, then
    ``resources`` (the stores and clients the backend opened, in reverse order of opening)."""

    name: str
    log: Log
    checkpoints: Checkpoints
    quarantine: Quarantine
    leases: SlotLeaseStore
    timers: TimerView
    firing: TimerFiring
    timer_queries: TimerQueries
    snapshots: SnapshotStore
    rebuilds: SnapshotRebuildStore
    outbox: Outbox
    sink_factory: Callable[[AggregateType], EventSink] | None
    """``None``: no event index (``sink = "none"``). A sink it makes uses the backend's
    resources only: one dropped from the sinks kept needs no closing."""
    history: TimerHistory | None = None
    """The timers' history (``None``: none kept)."""
    offers: tuple[object, ...] = ()
    """What the backend can do beyond the protocols every backend has (:meth:`capability`): its
    stores that implement a capability and its operations object, each naming the capabilities
    it implements in its class's ``CAPABILITIES``."""
    resources: AsyncExitStack = field(default_factory=AsyncExitStack)
    _sinks: OrderedDict[AggregateType, EventSink] = field(default_factory=OrderedDict)

    def capability(self, kind: Capability[C]) -> C | None:
        """The store (or the operations object) of this backend that offers the capability
        ``kind``, or ``None``: this backend does not offer it."""
        for store in self.offers:
            if kind in getattr(type(store), "CAPABILITIES", ()):
                return cast(C, store)
        return None

    @property
    def has_sink(self) -> bool:
        return self.sink_factory is not None

    def sink(self, type: AggregateType) -> EventSink:
        """The event sink of ``type``; a :class:`ConfigError` when there is no event index."""
        sinks = self._sinks
        s = sinks.get(type)
        if s is None:
            if self.sink_factory is None:
                raise ConfigError('no event index: sink = "none"')
            s = sinks[type] = self.sink_factory(type)
            if len(sinks) > SINKS_KEPT:
                sinks.popitem(last=False)
        else:
            sinks.move_to_end(type)
        return s

    async def close(self) -> None:
        for s in self._sinks.values():
            await s.close()
        await self.resources.aclose()


def consumers_of(consumer: str | Sequence[str]) -> tuple[str, ...]:
    """The consumers a checkpoint write names (one, or several)."""
    return (consumer,) if isinstance(consumer, str) else tuple(consumer)
