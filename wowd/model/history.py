"""A timer's history: the commits that scheduled and cancelled it and each delivery attempt, kept
beside its tombstone (never in it: a tombstone stays small) for as long as tombstones are.

A record is named by ``(timer_id, slot)``: :data:`SCHEDULED` and :data:`CANCELLED` for the
commits (one each per timer id: a timer id is its owner, key and version), and for an attempt
the timer's revision modulo :data:`HISTORY_ATTEMPTS` (each attempt settles a new revision), so
that a timer keeps its last :data:`HISTORY_ATTEMPTS` attempts at most and writing a record twice
(a replay, a retried write) changes nothing. A record's size is bounded too: the reason and the
answer's first bytes are cut (:data:`REASON_CHARS`, :data:`ANSWER_CHARS`), and what a target
answered is masked by the gateway that read it, as its log lines are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from wowd.errors import InvalidInput
from wowd.model.commits import Commit
from wowd.model.ids import AggregateRef
from wowd.model.timers import Timer, TimerCancelled, TimerScheduled, deterministic_timer_id

__all__ = [
    "ANSWER_CHARS",
    "CANCELLED",
    "HISTORY_ATTEMPTS",
    "REASON_CHARS",
    "SCHEDULED",
    "HistoryKind",
    "HistoryRecord",
    "attempt_record",
    "check_context",
    "commit_records",
    "timer_segment",
]

HISTORY_ATTEMPTS = 32
"""Attempt records kept per timer (the latest; a recurring timer's older ones are replaced)."""
ANSWER_CHARS = 256
"""The characters of a target's answer a record keeps (its first ones)."""
REASON_CHARS = 300
"""The characters of a reason a record keeps."""
SCHEDULED = -1
"""The slot of the record of the commit that scheduled a timer."""
CANCELLED = -2
"""The slot of the record of the commit that cancelled a key (or, key ``""``, every key of an
owner: a commit that deleted its aggregate)."""


class HistoryKind(StrEnum):
    SCHEDULED = "scheduled"
    CANCELLED = "cancelled"
    ATTEMPT = "attempt"


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryRecord:
    """One entry of a timer's history.

    ``at``: when (ms; a commit's create time, an attempt's end). ``version``: the commit's
    version (scheduled, cancelled) or the timer's (attempt). ``request_id``: the commit's
    request id, or the attempt's ``Command-Request-Id`` (what the target's log shows).
    ``scheduled_at``: the first due time (scheduled) or the occurrence attempted. ``position``:
    the commit's log position where the log numbers its entries (the embedded log). An attempt's
    ``outcome`` is what was settled (``delivered``, ``retry``, ``park``, ``fail``, ``misfired``:
    skipped past its misfire grace), with the HTTP ``status``, the ``latency_ms`` and the
    ``answer``'s first characters where the gateway has them, and the ``reason``.
    ``expires_at``: when the record may be deleted (ms); ``None``: while the timer lives (the
    schedule of a recurring timer, ended by a later record of its key, see
    :meth:`~wowd.stores.base.TimerHistory.append`)."""

    timer_id: str
    slot: int
    kind: HistoryKind
    owner: AggregateRef
    key: str
    at: int
    version: int
    request_id: str
    expires_at: int | None
    scheduled_at: int | None = None
    position: int | None = None
    outcome: str | None = None
    status: int | None = None
    latency_ms: float | None = None
    reason: str | None = None
    answer: str | None = None


def check_context(records: Iterable[HistoryRecord], context: str) -> None:
    """Raises :class:`~wowd.errors.InvalidInput` (field ``owner.context``) for a record of
    another context than a history store's."""
    for r in records:
        if r.owner.context != context:
            raise InvalidInput(f"{r.owner} is not of this store's context {context!r}", field="owner.context")


def _cut(text: str | None, n: int) -> str | None:
    return text if text is None or len(text) <= n else text[: n - 1] + "…"


EXPIRY_MAX_MS = 253_402_300_799_999
"""The latest expiry a record is given: the last millisecond of year 9999, the latest time the
published schema allows and a MongoDB TTL index's date can be read back as (a due time near it
plus the retention would leave both behind)."""


def expiry(at: int, retention_ms: int) -> int:
    """When a record made at ``at`` (or of a timer due then) may be deleted, at most
    :data:`EXPIRY_MAX_MS`."""
    return min(at + retention_ms, EXPIRY_MAX_MS)


def attempt_record(
    t: Timer,
    outcome: str,
    at: int,
    retention_ms: int,
    *,
    status: int | None = None,
    latency_ms: float | None = None,
    reason: str | None = None,
    answer: str | None = None,
) -> HistoryRecord:
    """The record of an attempt of ``t`` (as claimed, or as read to fire) that ended at ``at``
    as ``outcome``."""
    return HistoryRecord(
        timer_id=t.timer_id,
        slot=t.revision % HISTORY_ATTEMPTS,
        kind=HistoryKind.ATTEMPT,
        owner=t.owner,
        key=t.key,
        at=at,
        version=t.version,
        request_id=t.request_id,
        expires_at=expiry(at, retention_ms),
        scheduled_at=t.scheduled_at,
        outcome=outcome,
        status=status,
        latency_ms=None if latency_ms is None else round(latency_ms, 3),
        reason=_cut(reason, REASON_CHARS),
        answer=_cut(answer, ANSWER_CHARS),
    )


def commit_records(
    commit: Commit,
    events: Iterable[TimerScheduled | TimerCancelled],
    retention_ms: int,
    *,
    position: int | None = None,
) -> list[HistoryRecord]:
    """The records of a commit's timer events (and of its delete: a cancel of every key). A
    schedule of a recurring timer stays while the timer lives (``expires_at`` ``None``); a
    one-shot one until the retention after its due time."""
    owner, version, at, rid = commit.ref, commit.version, commit.create_time, commit.request_id
    out: list[HistoryRecord] = []
    for ev in events:
        if isinstance(ev, TimerScheduled):
            once = ev.rule.type == "once"
            out.append(
                HistoryRecord(
                    timer_id=deterministic_timer_id(owner, ev.key, version),
                    slot=SCHEDULED,
                    kind=HistoryKind.SCHEDULED,
                    owner=owner,
                    key=ev.key,
                    at=at,
                    version=version,
                    request_id=rid,
                    expires_at=expiry(max(at, ev.due_at), retention_ms) if once else None,
                    scheduled_at=ev.due_at,
                    position=position,
                )
            )
        else:
            out.append(_cancelled(owner, ev.key, version, at, rid, retention_ms, position))
    if commit.deleted:
        out.append(_cancelled(owner, "", version, at, rid, retention_ms, position))
    return out


def _cancelled(
    owner: AggregateRef, key: str, version: int, at: int, rid: str, retention_ms: int, position: int | None
) -> HistoryRecord:
    return HistoryRecord(
        timer_id=deterministic_timer_id(owner, key, version),
        slot=CANCELLED,
        kind=HistoryKind.CANCELLED,
        owner=owner,
        key=key,
        at=at,
        version=version,
        request_id=rid,
        expires_at=expiry(at, retention_ms),
        position=position,
    )


def timer_segment(records: Sequence[HistoryRecord], timer_id: str) -> list[HistoryRecord]:
    """Of the history of one key (``records``, of one owner), what concerns the timer
    ``timer_id``: its own records, and the cancels of its key (or of every key of its owner) from
    its version on, before the next schedule of the key. By ``(at, version, slot)``."""
    own = [r for r in records if r.timer_id == timer_id]
    scheduled = next((r for r in own if r.kind is HistoryKind.SCHEDULED), None)
    if scheduled is None:
        return sorted(own, key=_order)
    later = [r.version for r in records if r.kind is HistoryKind.SCHEDULED and r.version > scheduled.version]
    until = min(later, default=None)
    ended = [
        r
        for r in records
        if r.kind is HistoryKind.CANCELLED
        and r.timer_id != timer_id
        and r.key in (scheduled.key, "")
        and r.version >= scheduled.version
        and (until is None or r.version < until)
    ]
    return sorted([*own, *ended], key=_order)


_SLOT_ORDER = {SCHEDULED: 0, CANCELLED: 2}
"""At one time: the schedule, then the attempts, then the cancel."""


def _order(r: HistoryRecord) -> tuple[int, int, int]:
    return (r.at, r.version, _SLOT_ORDER.get(r.slot, 1))
