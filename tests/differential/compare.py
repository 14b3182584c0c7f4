"""What the backends hold, compared with the embedded backend's (the oracle), aspect by aspect.

Each function answers the differences as lines (none: they agree). Where the backends differ by
design, the rule applied is in the function's docstring:

- the event index: an embedded document carries its row's keys (context, aggregate type, stream
  id), an Elasticsearch document has them as its index and ``_id``: they are checked, then left
  out;

- the quarantine: an item is the stream's document it holds (matched by its fields, or by
  aggregate, version and request id: the timer view quarantines a commit with a rejected timer
  event as its own document, written back) and the field its reason names; not the partition it
  was filed under (the embedded log files a document without a string aggregate id under 0);
- the fire decision: a log may hold back a timer whose aggregate has a commit above the timer's
  version that does not touch its key, fed or not (:meth:`~wowd.stores.base.Log.committed_after`:
  "a backend may answer more (any commit above the version), never fewer"), so ``held`` against
  ``fire`` or ``skip`` is no difference there; a timer that a commit not fed yet schedules,
  cancels or deletes is held by every backend, and one whose aggregate has nothing above its
  version by none.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tests.differential.backends import EMBEDDED, Holdings, OwnerKey, TimerKey
from tests.differential.schema_draw import CONTEXT, Stream
from wowd.daemon.feed_batch import field_of
from wowd.errors import InvalidInput
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    AggregateType,
    DomainEvent,
    SnapshotRecord,
    Timer,
    TimerScheduled,
    commit_from_doc,
    stream_id,
    timer_event_from,
)

TIMER_EVENTS = ("TimerScheduled", "TimerCancelled")
Held = Mapping[str, Holdings]
"""What each backend holds, by name."""


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


def _where(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any]:
    """The first place two JSON values differ, and the values there."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=repr):
            if k not in a or k not in b or _json(a[k]) != _json(b[k]):
                return _where(a.get(k, "(none)"), b.get(k, "(none)"), f"{path}.{k}" if path else str(k))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if _json(x) != _json(y):
                return _where(x, y, f"{path}[{i}]")
    return path, a, b


def _short(value: Any, limit: int = 300) -> str:
    text = _json(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _differences(aspect: str, ours: Mapping[Any, Any], theirs: Mapping[Any, Any], name: str) -> list[str]:
    out = []
    for k in sorted(set(ours) | set(theirs), key=repr):
        a, b = json.loads(_json(ours.get(k))), json.loads(_json(theirs.get(k)))
        if a != b:
            where, x, y = _where(a, b)
            out.append(f"{aspect} {k!r} at {where or '.'}: {EMBEDDED} holds {_short(x)}, {name} holds {_short(y)}")
    return out


def timer_view(t: Timer) -> dict[str, Any]:
    """A timer as the view holds it: status, due times, version, rule, target, command, and the
    rest of its state."""
    return {
        "id": t.timer_id, "partition": t.partition, "version": t.version, "status": t.status.value,
        "due_at": t.due_at, "scheduled_at": t.scheduled_at, "rule": t.rule.to_doc(), "target": str(t.target),
        "command": t.body, "attempts": t.attempts, "fired": t.fired, "claim": t.claim, "error": t.last_error,
    }  # fmt: skip


def _against_oracle(held: Held, aspect: str, of: Callable[[Holdings], Mapping[Any, Any]]) -> list[str]:
    """The differences of what each backend holds of an ``aspect`` (``of``) from the oracle's."""
    ours = of(held[EMBEDDED])
    return [line for name, h in held.items() if name != EMBEDDED for line in _differences(aspect, ours, of(h), name)]


def timers(held: Held) -> list[str]:
    """The timer views."""
    return _against_oracle(held, "timer", lambda h: {k: timer_view(t) for k, t in h.timers.items()})


def last_versions(stream: Stream, held: Held) -> list[str]:
    """Each aggregate's last version (what a writer appends after), on every backend at least the
    highest version of its documents that are commits, and at most the highest integer version
    stored: a document the feed sets aside may count on one log and not on the other (the
    embedded log keeps every integer version under its unique key; a MongoDB log, the
    documents its filter by partition and tenant finds, where a ``null`` tenant is a missing
    one)."""
    commits: dict[OwnerKey, int] = {}
    stored: dict[OwnerKey, int] = {}
    for a in stream.appends:
        d = a.doc
        k = (a.aggregate, d.get("tenant_id") or DEFAULT_TENANT, d.get("aggregate_id"))
        v = d.get("version")
        if not isinstance(v, int) or isinstance(v, bool):
            continue
        stored[k] = max(stored.get(k, 0), v)  # type: ignore[index]
        try:
            commit_from_doc(AggregateType(context=CONTEXT, aggregate=a.aggregate), d)
        except InvalidInput:
            continue
        commits[k] = max(commits.get(k, 0), v)  # type: ignore[index]
    out: list[str] = []
    for name, h in held.items():
        for k, v in sorted(h.last_versions.items()):
            low, high = commits.get(k, 0), stored.get(k, 0)
            if not low <= v <= high:
                out.append(f"last version of {k!r}: {name} answers {v}, the stream's commits give {low} to {high}")
    return out


def snapshot_view(s: SnapshotRecord | None) -> Any:
    """A snapshot as its store holds it (``None``: none)."""
    if s is None:
        return None
    return {
        "version": s.version, "revision": s.state_revision, "state": json.loads(_json(s.state)),
        "owner": s.owner_id, "space": s.space_id, "tags": list(s.tags), "access_version": s.access_version,
        "deleted": s.deleted, "event_time": s.event_time, "stale": s.stale_version,
    }  # fmt: skip


def snapshots(held: Held) -> list[str]:
    """The snapshots of each aggregate of the stream."""
    return _against_oracle(held, "snapshot of", lambda h: {k: snapshot_view(s) for k, s in h.snapshots.items()})


def _row_keys(key: OwnerKey, docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The embedded index's documents less the keys of their table's row (``context``,
    ``aggregate``, the stream ``id``: an Elasticsearch document has them as its index and id),
    and what is wrong with those."""
    type_, tenant, agg_id = key
    ref = AggregateRef(context=CONTEXT, aggregate=type_, tenant_id=tenant, id=agg_id)
    out, wrong = [], []
    for d in docs:
        row = {k: d.get(k) for k in ("context", "aggregate", "id")}
        expected = {"context": CONTEXT, "aggregate": type_, "id": stream_id(ref, d.get("version", 0))}
        if row != expected:
            wrong.append(f"document {key!r} v{d.get('version')}: the embedded index keys it {row}, not {expected}")
        out.append({k: v for k, v in d.items() if k not in row})
    return out, wrong


def index(held: Held) -> list[str]:
    """The event index's documents of each aggregate, access attributes as stamped."""
    out: list[str] = []
    ours: dict[OwnerKey, list[dict[str, Any]]] = {}
    for k, docs in held[EMBEDDED].index.items():
        ours[k], wrong = _row_keys(k, docs)
        out += wrong
    for name, h in held.items():
        if name != EMBEDDED:
            out += _differences("documents of", ours, h.index, name)
    return out


def named_field(reason: str) -> str:
    """The field a quarantine reason names (``<step>:<field>`` for a step that refused it)."""
    reason = reason.removeprefix("rejected timer event: ")
    m = re.match(r"(\w+) refused it: \w+: (.*)", reason, re.S)
    return f"{m.group(1)}:{field_of(m.group(2))}" if m else field_of(reason)


def _same_document(raw: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    kept = {k: v for k, v in raw.items() if k in doc}  # less the _id a MongoDB log gave it
    return _json(kept) == _json(doc) and set(raw) - set(doc) <= {"_id"}


def _same_commit(raw: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    if raw.get("tenant_id", DEFAULT_TENANT) != doc.get("tenant_id", DEFAULT_TENANT):
        return False
    return all(raw.get(k) == doc.get(k) for k in ("aggregate_id", "version", "request_id"))


def document_of(stream: Stream, raw: Mapping[str, Any]) -> int | None:
    """The index in ``stream`` of the document a quarantined ``raw`` is."""
    for i, a in enumerate(stream.appends):
        if _same_document(raw, a.doc):
            return i
    for i, a in enumerate(stream.appends):
        if _same_commit(raw, a.doc):
            return i
    return None


def quarantine_view(stream: Stream, h: Holdings) -> Counter[tuple[Any, ...]]:
    """``(aggregate, document index, field named)`` of each item of ``h``'s quarantine."""
    return Counter(
        (q.get("aggregate"), document_of(stream, q.get("raw") or {}), named_field(str(q.get("reason"))))
        for q in h.quarantined
    )


def quarantine(stream: Stream, held: Held) -> list[str]:
    """What each backend set aside and the field each names."""
    ours = quarantine_view(stream, held[EMBEDDED])
    out: list[str] = []
    for name, h in held.items():
        if name == EMBEDDED:
            continue
        theirs = quarantine_view(stream, h)
        for item in sorted(set(ours) | set(theirs), key=repr):
            if ours[item] != theirs[item]:
                out.append(f"quarantine {item!r}: {EMBEDDED} holds {ours[item]}, {name} holds {theirs[item]}")
    return out


def later_commits(stream: Stream, key: TimerKey, version: int) -> tuple[bool, bool]:
    """Whether the log may hold ``key`` back, and whether it must, at the decision: it may when it
    holds a document of the timer's aggregate above ``version`` (fed or not: the log check may
    answer any commit above the version; a ``null`` tenant is a missing one on MongoDB), it must
    when a document not fed yet schedules or cancels the key or deletes the aggregate."""
    type_, tenant, agg_id, timer = key
    may = must = False
    fed = len(stream.prefix)
    for n, a in enumerate(stream.appends):
        d = a.doc
        v = d.get("version")
        if (
            a.aggregate != type_
            or (d.get("tenant_id") or DEFAULT_TENANT) != tenant
            or d.get("aggregate_id") != agg_id
            or not isinstance(v, int)
            or isinstance(v, bool)
            or v <= version
        ):
            continue
        may = True
        if n < fed or d.get("tenant_id", DEFAULT_TENANT) != tenant:
            continue
        events = d.get("events") if isinstance(d.get("events"), list) else []
        must = must or d.get("deleted") is True or any(_touches(e, timer) for e in events)
    return may, must


def _touches(event: Any, key: str) -> bool:
    return (
        isinstance(event, dict)
        and event.get("name") in TIMER_EVENTS
        and isinstance(event.get("body"), dict)
        and event["body"].get("key") == key
    )


def decisions(stream: Stream, held: Held) -> list[str]:
    """The fire decisions at ``stream.at``: the same for each due timer, within the latitude of
    the module's rule; and as the documents not fed require (held where one touches the timer,
    never held with no later commit)."""
    oracle = held[EMBEDDED]
    out: list[str] = []
    for name, h in held.items():
        versions = {k: t.version for k, t in h.timers.items()}
        for k, decision in sorted(h.decisions.items()):
            may, must = later_commits(stream, k, versions.get(k, 0))
            if must and decision != "held":
                out.append(f"decision {k!r}: {name} answers {decision}, but a commit not fed changes it")
            if not may and decision == "held":
                out.append(f"decision {k!r}: {name} holds it back, but no later commit of its aggregate exists")
        if name == EMBEDDED:
            continue
        for k in sorted(set(oracle.decisions) | set(h.decisions)):
            a, b = oracle.decisions.get(k), h.decisions.get(k)
            if a == b:
                continue
            may, must = later_commits(stream, k, oracle.timers[k].version if k in oracle.timers else 0)
            if a is not None and b is not None and "held" in (a, b) and may and not must:
                continue  # the latitude of the log check
            out.append(f"decision {k!r}: {EMBEDDED} answers {a}, {name} answers {b}")
    for k in sorted({k for h in held.values() for k in h.decisions}):
        let_go = {name: h.decisions[k] for name, h in held.items() if h.decisions.get(k, "held") != "held"}
        if len(set(let_go.values())) > 1:  # those that let it go fire it or skip it alike
            out += [f"decision {k!r}: {name} answers {d}, where {let_go}" for name, d in let_go.items()]
    return out


def expected_timers(stream: Stream, accepted: Iterable[int]) -> dict[TimerKey, tuple[int, int]]:
    """The live timers the schema's text gives the fed documents ``accepted`` (those read as
    commits), as ``(version, due_at)``: per aggregate in version order, each commit's timer
    events in order (a schedule puts its key, a cancel removes it), then its deletion removes
    every key; a timer event the feed rejects is skipped (docs/schema.md, "Timer events")."""
    by_owner: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for i in accepted:
        a = stream.appends[i]
        d = a.doc
        by_owner.setdefault((a.aggregate, d.get("tenant_id", DEFAULT_TENANT), d["aggregate_id"]), []).append(d)
    live: dict[TimerKey, tuple[int, int]] = {}
    for owner, docs in by_owner.items():
        for d in sorted(docs, key=lambda d: d["version"]):
            for e in d["events"]:
                if e["name"] not in TIMER_EVENTS:
                    continue
                try:
                    te = timer_event_from(DomainEvent(id="", name=e["name"], body=e.get("body", {})))
                except InvalidInput:
                    continue
                assert te is not None
                k = (*owner, te.key)
                if isinstance(te, TimerScheduled):
                    live[k] = (d["version"], te.due_at)
                else:
                    live.pop(k, None)
            if d.get("deleted") is True:
                for k in [k for k in live if k[:3] == owner]:
                    del live[k]
    return live
