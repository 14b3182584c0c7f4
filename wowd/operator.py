"""The operator's reads and repairs of the stores, one source for the command line (``wowd
status``, ``wowd timers``, ``wowd quarantine``, ``wowd outbox``) and the status page (``/ui``
and ``/api/v1``): the documents both show and the changes both make.

The quarantine's re-feed: the feed quarantines a document it cannot read (the reason names the
field), a commit with a timer event it rejects (``rejected timer event: ...``) and a commit a
step refuses (``<step> refused it: <error class>: <message>``). :func:`retry_item` reads the
document again and re-runs the steps its reason says it still needs, each idempotent (what was
done before counts as done):

- ``sink``: the commit written to its type's event sink;
- ``timers``: its timer events projected into the timer store (the net effect of the commit, as
  the feed writes it; a later version already stored wins);
- ``snapshots``: where a reducer is configured for its type and the stored snapshot is behind
  the commit, the snapshot marked stale (a rebuild folds it again);
- ``parked``: the parked timers whose target is its aggregate resumed (it committed).

A document that still does not read, or a step that still refuses, keeps the item quarantined
under its id with the new reason; otherwise the item is released (deleted).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wowd.client import schedule_stream
from wowd.config import WowdSettings, url_shown
from wowd.errors import ConfigError, InvalidInput, StorageUnavailable, WowdError
from wowd.fmt import at, iso_ms, one_line
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    AggregateType,
    Commit,
    HistoryKind,
    HistoryRecord,
    OutboxEntry,
    SlotState,
    Timer,
    TimerCancelled,
    TimerChange,
    TimerScheduled,
    TimerStatus,
    TimerWrite,
    commit_from_doc,
    commit_records,
    net_writes,
    partition,
    timer_event_from,
    timer_from_event,
    timer_segment,
)
from wowd.stores.base import (
    Backend,
    Outbox,
    Quarantine,
    ReplicaState,
    TimerFiring,
    TimerHistory,
    TimerQueries,
    TimerSearch,
    dismissal,
)
from wowd.views import views_status

__all__ = [
    "BACKLOG_CAP",
    "QUARANTINE_CAP",
    "ENDED",
    "ENDED_DETAIL",
    "STEPS",
    "TIMER_SCAN_LIMIT",
    "RetryOutcome",
    "TimerHistoryView",
    "TimerPage",
    "cursor_of",
    "deliveries",
    "delivery_doc",
    "detail",
    "NotDismissed",
    "dismiss_item",
    "find_timer",
    "history_doc",
    "history_line",
    "live_partitions",
    "outbox_entry_doc",
    "outbox_page",
    "parse_cursor",
    "parse_ref",
    "quarantine_page",
    "quarantined_item",
    "read_commit",
    "read_status",
    "record_of",
    "repair_timers",
    "replica_rows",
    "retry_item",
    "search_timers",
    "status_doc",
    "steps_needed",
    "timer_doc",
    "timer_history",
]

BACKLOG_CAP = 1000
"""Due timers counted per slot for the status (a larger backlog shows as this many)."""
QUARANTINE_CAP = 100
"""Quarantined items counted for the status (more show as this many): each is read whole."""


def _now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- status


def live_partitions(settings: WowdSettings, states: Iterable[SlotState]) -> set[int]:
    """The partitions whose slot has a live holder now (by the store's clock)."""
    out_: set[int] = set()
    lo, hi = settings.lease.slot_offset, settings.lease.slot_offset + settings.lease.limit
    for st in states:
        if st.live and lo <= st.slot < hi:
            out_.update(settings.partitions_of_slot(st.slot))
    return out_


def replica_rows(replicas: Iterable[ReplicaState]) -> list[dict[str, Any]]:
    """One row per presence record: ``state`` is ``holding``, ``standby``, or ``gone`` (expired
    without leaving: killed, hung or cut off from the store); times on the store clock."""
    return [
        {
            "owner_key": r.owner_key,
            "state": r.state if r.live else "gone",
            "slots": list(r.slots),
            "host": r.host,
            "pid": r.pid,
            "version": r.version,
            "instance": r.instance,
            "started_at": r.started_at,
            "seen_at": r.seen_at,
            "expires_at": r.expires_at,
            "seen_ms_ago": r.store_now - r.seen_at,
            "up_ms": (r.store_now if r.live else r.seen_at) - r.started_at,
        }
        for r in replicas
    ]


def status_doc(
    settings: WowdSettings,
    states: list[SlotState],
    replicas: list[ReplicaState],
    *,
    backlog: Mapping[int, int] | None = None,
    quarantined: int | None = None,
    outbox: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``wowd status --json`` prints and ``/api/v1/status`` answers: the replicas, the slot
    table (with each slot's ``due_backlog``: PENDING or FIRING timers due now, at most
    :data:`BACKLOG_CAP`), the quarantine's count (at most :data:`QUARANTINE_CAP`) and the
    outbox's depth and oldest entry (``None`` when empty)."""
    lo, hi = settings.lease.slot_offset, settings.lease.slot_offset + settings.lease.limit
    by_slot = {s.slot: s for s in states}
    rows: list[dict[str, Any]] = []
    for slot in range(lo, hi):
        st = by_slot.get(slot)
        rows.append(
            {
                "slot": slot,
                "holder": st.owner_key if st is not None else None,
                "last_holder": st.last_owner_key if st is not None else None,
                "fence": st.fence if st is not None else 0,
                "incarnation": st.incarnation if st is not None else 0,
                "expires_at": st.expires_at if st is not None else None,
                "expires_in_ms": (st.expires_at - st.store_now) if st is not None else None,
                "live": st is not None and st.live,
                "held_by": st.held_by if st is not None and st.held else None,
                "partitions": len(settings.partitions_of_slot(slot)),
                "due_backlog": (backlog or {}).get(slot, 0),
            }
        )
    live = live_partitions(settings, states)
    present = replica_rows(replicas)
    store_now = states[0].store_now if states else (replicas[0].store_now if replicas else None)
    return {
        "namespace": settings.lease_namespace,
        "limit": settings.lease.limit,
        "store_now": store_now,
        "replicas": present,
        "slots": rows,
        "holders": sorted({r["holder"] for r in rows if r["live"]}),
        "standbys": [r["owner_key"] for r in present if r["state"] == "standby"],
        "partitions_without_live_holder": sorted(set(range(settings.partitions)) - live),
        "backlog_cap": BACKLOG_CAP,
        "quarantined": quarantined or 0,
        "quarantine_cap": QUARANTINE_CAP,
        "outbox": dict(outbox) if outbox is not None else {"depth": 0, "oldest": None},
    }


async def read_status(settings: WowdSettings, backend: Backend) -> dict[str, Any]:
    """:func:`status_doc` of the stores now: the lease store's slots and presence records, each
    slot's due backlog (one read of the due index per slot), the quarantine and the outbox; the
    FAILED and PARKED timers of every partition (``timers_failed``, ``timers_parked``, at most
    :data:`BACKLOG_CAP` each); and ``views``: each view kept and the partitions where it is behind
    the timer view (:func:`~wowd.views.views_status`)."""
    states = await backend.leases.slots(settings.lease_namespace)
    replicas = await backend.leases.replicas(settings.lease_namespace)
    now = states[0].store_now if states else _now_ms()
    lo = settings.lease.slot_offset
    backlog: dict[int, int] = {}
    for slot in range(lo, lo + settings.lease.limit):
        parts = frozenset(settings.partitions_of_slot(slot))
        backlog[slot] = len(await backend.firing.due(parts, now, BACKLOG_CAP)) if parts else 0
    quarantined = len(await backend.quarantine.items(limit=QUARANTINE_CAP))
    depth = await backend.outbox.count()
    first = await backend.outbox.entries(limit=1) if depth else []
    oldest = None
    if first:
        e = first[0]
        oldest = {
            "request_id": e.request_id,
            "timer_id": e.timer_id,
            "target": str(e.target),
            "created_at": e.created_at,
        }
    doc = status_doc(
        settings, states, replicas, backlog=backlog, quarantined=quarantined, outbox={"depth": depth, "oldest": oldest}
    )
    for status in (TimerStatus.FAILED, TimerStatus.PARKED):  # over the index of those two statuses
        found = await backend.timer_queries.search(TimerSearch(status=status), BACKLOG_CAP)
        doc[f"timers_{status.value.lower()}"] = len(found)
    doc["views"] = await views_status(settings, backend.checkpoints, settings.reducers)
    return doc


def delivery_doc(settings: WowdSettings) -> dict[str, Any]:
    """Where a replica of ``settings`` sends fired commands (the status page's "Delivery"): the
    gateway, and for ``http`` each route in the order they match, then the fallback URL, with
    the limits and whether a credential, signing and client certificate are set (never their
    values; a URL without the credentials it may hold)."""
    g = settings.gateway
    doc: dict[str, Any] = {"kind": g.kind, "concurrency": g.concurrency}
    if g.kind == "outbox":
        doc["outbox"] = settings.outbox.model_dump()
        return doc
    signed = bool(g.signing_secrets)
    routes = [
        {
            "match": r.match,
            "url": url_shown(r.url),
            "timeout_s": r.timeout_s or g.timeout_s,
            "per_target_concurrency": r.per_target_concurrency or g.per_target_concurrency,
            "credential": "token" if r.token is not None else "none",
            "signed": bool(r.signing_secrets) if r.signing_secrets is not None else signed,
            "client_cert": (r.client_cert or g.client_cert) is not None,
        }
        for r in g.routes
    ]
    if g.url:
        routes.append(
            {
                "match": "*",
                "url": url_shown(g.url),
                "timeout_s": g.timeout_s,
                "per_target_concurrency": g.per_target_concurrency,
                "credential": "token" if g.token is not None else "none",
                "signed": signed,
                "client_cert": g.client_cert is not None,
            }
        )
    doc.update(
        routes=routes,
        verify_certs=g.verify_certs,
        breaker={"failures": g.breaker_failures, "open_s": g.breaker_open_s},
        unrouted="FAILED at once: no route and no gateway.url" if not g.url else None,
    )
    return doc


# --------------------------------------------------------------------------- timers


def deliveries(t: Timer) -> int:
    """Deliveries made of the current occurrence, as the metrics count them (each delivery is one
    of fired, retried, parked or failed): the store's ``attempts`` counts the retries, and a
    PARKED or FAILED timer also had the delivery that parked or failed it."""
    return t.attempts + (1 if t.status in (TimerStatus.PARKED, TimerStatus.FAILED) else 0)


def detail(t: Timer, now_ms: int | None = None) -> str:
    """What an operator needs of a timer in its status (times in ISO 8601, UTC, and relative)."""
    now = _now_ms() if now_ms is None else now_ms
    if t.status is TimerStatus.PENDING:
        text = f"due {at(t.due_at, now)}"
        return text + (f" (retry; last error: {t.last_error})" if t.last_error else "")
    if t.status is TimerStatus.FIRING:
        who = t.claim.owner_key if t.claim is not None else "?"
        return f"claimed by {who} until {at(t.due_at, now)}"
    if t.status is TimerStatus.PARKED:
        return f"parked since {at(t.due_at, now)}: {t.last_error or '-'}"
    return f"failed: {t.last_error or '-'}"


def timer_doc(t: Timer) -> dict[str, Any]:
    """A timer as ``wowd timers show --json`` prints it and ``/api/v1/timer`` answers it
    (``version``: the owner's commit that scheduled it; ``request_id``: the next delivery's;
    ``due_at``: ``None`` for a FAILED timer, which is not due until retried)."""
    doc: dict[str, Any] = {
        "timer_id": t.timer_id,
        "status": t.status.value,
        "partition": t.partition,
        "owner": str(t.owner),
        "key": t.key,
        "version": t.version,
        "due_at": None if t.status is TimerStatus.FAILED else t.due_at,
        "scheduled_at": t.scheduled_at,
        "target": str(t.target),
        "rule": t.rule.to_doc(),
        "command": json.loads(t.body),
        "attempts": deliveries(t),
        "fired": t.fired,
        "last_error": t.last_error,
        "request_id": t.request_id,
        "claim": None,
    }
    if t.claim is not None:
        doc["claim"] = {"owner_key": t.claim.owner_key, "fence": t.claim.fence, "until": t.claim.until}
    return doc


def cursor_of(t: Timer) -> str:
    """The cursor after a listed timer: its place in the order of the listing."""
    return f"{t.due_at}:{t.timer_id}"


def parse_cursor(text: str) -> tuple[int, str]:
    """A cursor of :func:`cursor_of`; :class:`InvalidInput` (field ``after``) otherwise."""
    due, sep, tid = text.partition(":")
    digits = due.removeprefix("-")
    if not sep or not (digits.isascii() and digits.isdigit()) or len(digits) > 18 or not tid:
        raise InvalidInput(f"{text!r} is not a cursor of a timer list (DUE_AT:TIMER_ID)", field="after")
    return int(due), tid


def parse_ref(text: str, *, context: str, tenant: str | None = None) -> AggregateRef:
    """``AGGREGATE/ID`` or ``CONTEXT.AGGREGATE/ID`` (the id may hold ``/``) in ``tenant``."""
    head, sep, agg_id = text.partition("/")
    if not sep or not head or not agg_id:
        raise ConfigError(f"{text!r}: AGGREGATE/ID expected (e.g. order/o-1)")
    ctx, dot, aggregate = head.rpartition(".")
    try:
        return AggregateRef(
            context=ctx if dot else context, aggregate=aggregate, id=agg_id, tenant_id=tenant or DEFAULT_TENANT
        )
    except InvalidInput as exc:
        raise ConfigError(f"{text!r}: {exc}") from exc


def owner_streams(owner: AggregateRef) -> tuple[AggregateRef, ...]:
    """Where an owner's timers are kept: wowd's stream of it and its own stream."""
    stream = schedule_stream(owner)
    return (stream,) if stream == owner else (stream, owner)


@dataclass(frozen=True, slots=True)
class TimerPage:
    """One page of a timer search; ``next`` the cursor of the page after it (``None``: last)."""

    timers: list[Timer]
    next: str | None


async def search_timers(store: TimerQueries, query: TimerSearch, limit: int) -> TimerPage:
    """A page of :meth:`TimerQueries.search` (one more read to know whether a next page exists)."""
    found = await store.search(query, limit + 1)
    shown = found[:limit]
    return TimerPage(shown, cursor_of(shown[-1]) if len(found) > limit else None)


async def find_timer(store: TimerQueries, owner: AggregateRef, key: str) -> Timer | None:
    """The live timer ``key`` of ``owner`` (in wowd's stream of the owner, else its own)."""
    for stream in owner_streams(owner):
        found = await store.find(stream, key)
        if found is not None:
            return found
    return None


async def repair_timers(store: TimerFiring, timers: Sequence[Timer], now_ms: int | None = None) -> int:
    """FAILED or PARKED timers (as loaded) back to PENDING, due now; answers how many were
    written (a timer that moved on since it was loaded is skipped)."""
    now = _now_ms() if now_ms is None else now_ms
    return await store.settle([TimerChange.resume(t, due_at=now) for t in timers]) if timers else 0


# --------------------------------------------------------------------------- a timer's history


ENDED = ("DONE", "CANCELLED", "REPLACED", "ENDED")
"""The states of a timer the view no longer holds, as its history tells them: delivered (or its
last occurrence skipped), cancelled (by its key's cancel or its owner's delete), replaced (by a
later schedule of its key), or ended otherwise (its tombstone and last records expired)."""


ENDED_DETAIL = {
    "DONE": "fired: it left the timer view (its tombstone and history are kept for the tombstone retention)",
    "CANCELLED": "cancelled before it fired (or before its next occurrence)",
    "REPLACED": "replaced by a later schedule of its key (wowd timers show OWNER KEY shows that one)",
    "ENDED": "no longer in the timer view",
}
"""What an ended timer's state means (:data:`~wowd.operator.ENDED`)."""


@dataclass(frozen=True, slots=True)
class TimerHistoryView:
    """What is known of one timer: the live timer (``None`` once it fired, was cancelled or
    replaced), its ``state`` (its status while live, else one of :data:`ENDED`) and its history,
    oldest first."""

    timer_id: str
    owner: AggregateRef
    key: str
    state: str
    timer: Timer | None
    records: list[HistoryRecord]


def history_doc(r: HistoryRecord) -> dict[str, Any]:
    """A history record as ``wowd timers show --json`` prints it and ``/api/v1`` answers it."""
    doc: dict[str, Any] = {
        "at": r.at,
        "kind": r.kind.value,
        "timer_id": r.timer_id,
        "owner": str(r.owner),
        "key": r.key,
        "version": r.version,
        "request_id": r.request_id,
    }
    for name in ("scheduled_at", "position", "outcome", "status", "latency_ms", "reason", "answer", "expires_at"):
        value = getattr(r, name)
        if value is not None:
            doc[name] = value
    return doc


def history_line(r: HistoryRecord) -> str:
    """A history record in one line (times in ISO 8601, UTC)."""
    when = iso_ms(r.at)
    if r.kind is HistoryKind.SCHEDULED:
        where = f", log position {r.position}" if r.position is not None else ""
        due = f", due {iso_ms(r.scheduled_at)}" if r.scheduled_at is not None else ""
        return f"{when}  scheduled by {r.owner} v{r.version} (request id {r.request_id}{where}){due}"
    if r.kind is HistoryKind.CANCELLED:
        what = "cancelled" if r.key else "cancelled with every timer of its owner (the aggregate was deleted)"
        where = f", log position {r.position}" if r.position is not None else ""
        return f"{when}  {what} by {r.owner} v{r.version} (request id {r.request_id}{where})"
    parts = [f"{when}  attempt {r.outcome}"]
    if r.status is not None:
        parts.append(f"HTTP {r.status}")
    if r.latency_ms is not None:
        parts.append(f"in {r.latency_ms:.1f} ms")
    text = " ".join(parts)
    if r.reason:
        text += f": {r.reason}"
    text += f" (request id {r.request_id}"
    if r.scheduled_at is not None:
        text += f", occurrence {iso_ms(r.scheduled_at)}"
    text += ")"
    if r.answer:
        text += f"; answered {r.answer}"
    return one_line(text)


def _ended_state(records: Sequence[HistoryRecord], key_records: Sequence[HistoryRecord], timer_id: str) -> str:
    """The state of a timer the view no longer holds (:data:`ENDED`), from its history."""
    mine = [r for r in records if r.timer_id == timer_id or r.kind is HistoryKind.CANCELLED]
    if mine and mine[-1].kind is HistoryKind.CANCELLED:
        return "CANCELLED"
    own = next((r for r in records if r.timer_id == timer_id and r.kind is HistoryKind.SCHEDULED), None)
    if own is not None and any(
        r.kind is HistoryKind.SCHEDULED and r.version > own.version for r in key_records if r.key == own.key
    ):
        return "REPLACED"
    attempts = [r for r in records if r.kind is HistoryKind.ATTEMPT]
    if attempts and attempts[-1].outcome in ("delivered", "misfired"):
        return "DONE"
    return "ENDED"


async def _of_key(history: TimerHistory, owner: AggregateRef, key: str) -> list[HistoryRecord]:
    """The history of ``key`` in wowd's stream of ``owner`` and in its own, oldest first."""
    found = [r for stream in owner_streams(owner) for r in await history.of_key(stream, key)]
    return sorted(found, key=lambda r: (r.at, r.version))


async def timer_history(
    backend: Backend,
    *,
    owner: AggregateRef | None = None,
    key: str | None = None,
    timer_id: str | None = None,
    request_id: str | None = None,
) -> TimerHistoryView | None:
    """One timer and its history, named by its owner and key (the timer of that key now, live
    or last), by its id, or by a request id (a delivery's, what the target's log shows, or that
    of a commit that scheduled or cancelled it); ``None`` when nothing is known of it (never
    scheduled, or its records expired)."""
    history = backend.history
    if request_id is not None:
        if history is None:
            return None
        by_request = await history.of_request(request_id)
        named = next((r for r in by_request if r.kind is not HistoryKind.CANCELLED), None)
        if named is None:
            return None if not by_request else _view(by_request[-1], by_request, by_request, None)
        timer_id = named.timer_id
    if timer_id is not None:
        own = await history.of_timer(timer_id) if history is not None else []
        if not own:
            live = await _live_by_id(backend.timer_queries, timer_id)
            if live is None:
                return None
            owner, key = live.owner, live.key
        else:
            owner, key = own[0].owner, own[0].key
    if owner is None or key is None:
        raise InvalidInput("a timer is named by its id, its owner and key, or a request id", field="timer")
    live = await find_timer(backend.timer_queries, owner, key)
    key_records = await _of_key(history, owner, key) if history is not None else []
    if timer_id is None:
        if live is not None:
            timer_id = live.timer_id
        else:
            last = next((r for r in reversed(key_records) if r.kind is HistoryKind.SCHEDULED and r.key == key), None)
            if last is None:
                return None if not key_records else _view(key_records[-1], key_records, key_records, None)
            timer_id = last.timer_id
    if live is not None and live.timer_id != timer_id:
        live = None
    segment = timer_segment(key_records, timer_id)
    if history is not None and not any(r.timer_id == timer_id for r in segment):
        # attempts of a timer whose schedule has no record (it expired, or was fed before the
        # history was kept): found by the timer's id
        segment = sorted([*segment, *await history.of_timer(timer_id)], key=lambda r: (r.at, r.version))
    if live is None and not segment:
        return None
    first = segment[0] if segment else None
    if live is not None:
        return TimerHistoryView(timer_id, live.owner, live.key, live.status.value, live, segment)
    assert first is not None
    return _view(first, segment, key_records, None, timer_id=timer_id)


def _view(
    first: HistoryRecord,
    records: list[HistoryRecord],
    key_records: Sequence[HistoryRecord],
    live: Timer | None,
    *,
    timer_id: str | None = None,
) -> TimerHistoryView:
    tid = timer_id or first.timer_id
    return TimerHistoryView(tid, first.owner, first.key, _ended_state(records, key_records, tid), live, records)


async def _live_by_id(store: TimerQueries, timer_id: str) -> Timer | None:
    """The live timer ``timer_id`` (a read of the view: one with no history kept)."""
    return next((t for t in await store.scan(limit=TIMER_SCAN_LIMIT) if t.timer_id == timer_id), None)


TIMER_SCAN_LIMIT = 100_000
"""Timers read to find one named by its id that has no history (the store lists timers from the
first due only)."""


# --------------------------------------------------------------------------- quarantine

STEPS = ("sink", "timers", "snapshots", "parked")
"""The feed's steps a quarantined commit may still need, in the order the feed runs them."""

_REFUSED = re.compile(r"^(\w+) refused it: ")
_REJECTED_TIMER_EVENT = "rejected timer event: "


async def quarantine_page(
    quarantine: Quarantine, after: str | None, limit: int, *, dismissed: bool = False
) -> tuple[list[dict[str, Any]], str | None]:
    """A page of quarantined items (``dismissed``: of the dismissed ones), oldest first, and the
    id to page on from (``None``: last)."""
    items = await quarantine.items(limit=limit, after=after, dismissed=dismissed)
    return items, (items[-1]["id"] if len(items) == limit else None)


@dataclass(frozen=True, slots=True)
class NotDismissed:
    """Why :func:`dismiss_item` dismissed nothing: ``found`` False when no such item is kept."""

    found: bool
    why: str


async def dismiss_item(quarantine: Quarantine, item_id: str, reason: str, by: str) -> NotDismissed | None:
    """Dismisses one quarantined item (:meth:`~wowd.stores.base.Quarantine.dismiss`); answers
    why it was not (no such item, dismissed already), ``None`` when it was. A blank reason or
    author is refused first (:class:`~wowd.errors.InvalidInput`)."""
    reason, by = dismissal(reason, by)
    item = await quarantined_item(quarantine, item_id)
    if item is None:
        return NotDismissed(False, f"no quarantined item {item_id} (released, or never quarantined)")
    mark = item.get("dismissed")
    if mark is not None:
        when = iso_ms(mark["at"])
        return NotDismissed(True, f"{item_id} was dismissed already, {when} by {mark['by']}: {mark['reason']}")
    if await quarantine.dismiss([item_id], reason, by) == 0:
        return NotDismissed(True, f"{item_id} was released or dismissed meanwhile")
    return None


async def quarantined_item(quarantine: Quarantine, item_id: str) -> dict[str, Any] | None:
    found = await quarantine.items(limit=1, ids=[item_id])
    return found[0] if found else None


def record_of(item: Mapping[str, Any]) -> str:
    """``<aggregate id> v<version>`` of a quarantined document, ``-`` when it does not say."""
    raw = item.get("raw")
    if not isinstance(raw, Mapping):
        return "-"
    agg_id, version = raw.get("aggregate_id"), raw.get("version")
    return f"{agg_id} v{version}" if agg_id is not None else "-"


def steps_needed(reason: str) -> tuple[str, ...]:
    """The steps a quarantined commit still needs, from its reason: a step that refused it and
    the ones after it; the timer projection for a rejected timer event; every step otherwise (a
    document that did not read, a quarantine or checkpoint step that refused it)."""
    m = _REFUSED.match(reason)
    if m is not None and m.group(1) in STEPS:
        return STEPS[STEPS.index(m.group(1)) :]
    if reason.startswith(_REJECTED_TIMER_EVENT):
        return ("timers",)
    return STEPS


def read_commit(item: Mapping[str, Any], context: str, partitions: int) -> Commit:
    """The quarantined document read as a commit, as the log reads it; :class:`InvalidInput`
    naming the field when it still does not read."""
    raw = item.get("raw")
    if not isinstance(raw, Mapping):
        raise InvalidInput("a commit must be a document", field="commit")
    try:
        type_ = AggregateType(context=context, aggregate=str(item.get("aggregate")))
    except ConfigError as exc:
        raise InvalidInput(str(exc), field="aggregate") from exc
    commit = commit_from_doc(type_, raw)
    expected = partition(commit.ref.id, partitions)
    stored = raw.get("partition", expected)
    if stored != expected:
        raise InvalidInput(
            f"is {stored}, but the aggregate id belongs to partition {expected} of {partitions}", field="partition"
        )
    return commit


@dataclass(slots=True)
class RetryOutcome:
    """What a retry did to one item: ``done`` the steps run, ``reason`` why it stays (``None``:
    fed and released)."""

    item_id: str
    record: str
    done: list[str] = field(default_factory=list)
    reason: str | None = None


async def retry_item(settings: WowdSettings, backend: Backend, item: Mapping[str, Any]) -> RetryOutcome:
    """Re-runs the steps ``item`` still needs; releases it when they all pass, else quarantines it
    again (same id) with the new reason. A transient failure (:class:`StorageUnavailable`) is
    raised and leaves the item as it was."""
    outcome = RetryOutcome(item_id=str(item["id"]), record=record_of(item))
    try:
        commit = read_commit(item, settings.context, settings.partitions)
    except (InvalidInput, ConfigError) as exc:
        outcome.reason = str(exc)
    else:
        outcome.record = f"{commit.ref} v{commit.version}"
        outcome.reason = await _feed(settings, backend, commit, steps_needed(str(item.get("reason", ""))), outcome)
    if outcome.reason is None:
        await backend.quarantine.release([outcome.item_id])
    else:
        type_ = AggregateType(context=settings.context, aggregate=str(item["aggregate"]))
        await backend.quarantine.put(str(item["consumer"]), int(item["partition"]), type_, item["raw"], outcome.reason)
    return outcome


async def _feed(
    settings: WowdSettings, backend: Backend, commit: Commit, steps: tuple[str, ...], outcome: RetryOutcome
) -> str | None:
    """Runs ``steps`` for ``commit`` in order; the reason it stays quarantined (``None``: fed)."""
    rejected: InvalidInput | None = None
    for step in steps:
        try:
            if step == "sink":
                if not backend.has_sink:  # no event index kept: nothing to write
                    outcome.done.append(step)
                    continue
                sink = backend.sink(commit.ref.type)
                await sink.prepare()
                await sink.write([commit])
            elif step == "timers":
                writes, rejected, events = _timer_writes(settings, commit)
                if writes:
                    await backend.timers.write(net_writes(writes))
                if backend.history is not None and (events or commit.deleted):
                    retention_ms = settings.timers.tombstone_retention_s * 1000
                    await backend.history.append(commit_records(commit, events, retention_ms))
            elif step == "snapshots":
                if commit.ref.aggregate in settings.reducers:
                    current = await backend.snapshots.load(commit.ref)
                    if current is not None and current.version < commit.version:
                        await backend.snapshots.mark_stale(commit.ref)
            elif step == "parked":
                parked = await backend.timer_queries.parked(commit.ref)
                if parked:
                    now = int(time.time() * 1000)
                    await backend.firing.settle([TimerChange.resume(t, due_at=now) for t in parked])
        except StorageUnavailable:
            raise
        except WowdError as exc:
            return f"{step} refused it: {type(exc).__name__}: {exc}"
        outcome.done.append(step)
    return f"{_REJECTED_TIMER_EVENT}{rejected}" if rejected is not None else None


def _timer_writes(
    settings: WowdSettings, commit: Commit
) -> tuple[list[TimerWrite], InvalidInput | None, list[TimerScheduled | TimerCancelled]]:
    """The timer writes of ``commit`` as the feed makes them, the first event it rejects, and the
    timer events it takes (their history records)."""
    writes: list[TimerWrite] = []
    events: list[TimerScheduled | TimerCancelled] = []
    rejected: InvalidInput | None = None
    for ev in commit.events:
        try:
            te = timer_event_from(
                ev, max_body_bytes=settings.timers.max_body_bytes, min_interval_ms=settings.timers.min_interval_ms
            )
        except InvalidInput as exc:
            rejected = rejected or exc
            continue
        if isinstance(te, TimerScheduled):
            writes.append(TimerWrite.put(timer_from_event(commit, te, settings.partitions)))
            events.append(te)
        elif isinstance(te, TimerCancelled):
            writes.append(TimerWrite.cancel(commit.ref, te.key, commit.version))
            events.append(te)
    if commit.deleted:
        writes.append(TimerWrite.cancel_all(commit.ref, commit.version))
    return writes, rejected, events


# --------------------------------------------------------------------------- outbox


def outbox_entry_doc(e: OutboxEntry) -> dict[str, Any]:
    """An outbox entry as ``wowd outbox list --json`` prints it and ``/api/v1/outbox`` answers."""
    return {
        "request_id": e.request_id,
        "timer_id": e.timer_id,
        "target": str(e.target),
        "command": json.loads(e.command),
        "scheduled_at": e.scheduled_at,
        "created_at": e.created_at,
        "fence": e.fence,
        "owner_key": e.owner_key,
    }


async def outbox_page(box: Outbox, offset: int, limit: int) -> tuple[list[OutboxEntry], int | None]:
    """A page of the outbox in insertion order, read without taking anything (a consumer's
    takes are unaffected), and the offset of the next page (``None``: last)."""
    entries = await box.entries(limit=limit + 1, after=offset)
    return entries[:limit], (offset + limit if len(entries) > limit else None)
