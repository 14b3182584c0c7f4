"""Timers: commands, the timer as stored, its settle changes and writes (with the net effect of
a batch), and the timer events of a commit."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

import orjson

from wowd.errors import ConfigError, InvalidInput
from wowd.model.commits import Commit, DomainEvent, _is_doc, _shared_ref, unchecked
from wowd.model.ids import DEFAULT_TENANT, MAX_BODY_BYTES, AggregateRef, partition, refuse_controls
from wowd.model.rules import _MAX_MS, MIN_INTERVAL_MS, IntervalRule, OnceRule, Rule, parse_rule

_SORTED_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)
"""``json.dumps(doc, separators=(",", ":"), sort_keys=True)`` without building an encoder per call."""
_SORTED_UNICODE_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False)
"""The same with ``ensure_ascii=False``."""

_MAX_PLAIN_DEPTH = 64
"""How deep :func:`_plain_json` looks (orjson refuses documents nested past 255 levels)."""


def _plain_json(value: Any, depth: int = 0) -> bool:
    """Whether orjson writes ``value`` byte for byte as Python's encoder does (sorted keys,
    compact, non-ASCII as is): documents of string keys, lists, strings, 64-bit integers,
    booleans and nulls. Not floats (the two format some differently), subclasses, integers
    past 64 bits or what is nested past :data:`_MAX_PLAIN_DEPTH`."""
    cls = value.__class__
    if cls is dict:
        if depth >= _MAX_PLAIN_DEPTH:
            return False
        for k, v in value.items():
            if k.__class__ is not str or (v.__class__ is not str and not _plain_json(v, depth + 1)):
                return False
        return True
    if cls is str or cls is bool or value is None:
        return True
    if cls is int:
        return bool(-(1 << 63) <= value < (1 << 64))
    if cls is list:
        return depth < _MAX_PLAIN_DEPTH and all(_plain_json(v, depth + 1) for v in value)
    return False


def sorted_json(doc: dict[str, Any], *, ascii: bool) -> str:
    """``json.dumps(doc, separators=(",", ":"), sort_keys=True, ensure_ascii=ascii)``, the same
    text; written by orjson where it writes the same (:func:`_plain_json`; with ``ascii``, an
    ASCII text), which is several times faster. Raises as ``json.dumps``."""
    if _plain_json(doc):
        out = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
        if not ascii or (out.isascii() and b"\x7f" not in out):  # json escapes DEL as well with ensure_ascii
            return out.decode()
    return (_SORTED_JSON if ascii else _SORTED_UNICODE_JSON).encode(doc)


class TimerStatus(StrEnum):
    PENDING = "PENDING"
    FIRING = "FIRING"
    PARKED = "PARKED"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    name: str
    body: Mapping[str, Any] = field(default_factory=dict)
    body_type: str | None = None

    def to_json(self) -> str:
        doc: dict[str, Any] = {"name": self.name, "body": dict(self.body)}
        if self.body_type is not None:
            doc["body_type"] = self.body_type
        return sorted_json(doc, ascii=True)

    @staticmethod
    def from_json(text: str) -> Command:
        doc = json.loads(text)
        return Command(name=doc["name"], body=doc.get("body", {}), body_type=doc.get("body_type"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    owner_key: str
    fence: int
    until: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Timer:
    """A timer as stored (docs/concepts.md).

    ``scheduled_at`` is the nominal due time of the current occurrence; ``due_at`` equals it
    while PENDING and is the claim's expiry while FIRING (an abandoned claim comes due again).
    """

    timer_id: str
    partition: int
    owner: AggregateRef
    key: str
    version: int
    due_at: int
    scheduled_at: int
    target: AggregateRef
    body: str
    """The command's JSON text (``{name, body_type?, body}``)."""
    rule: Rule = field(default_factory=OnceRule)
    status: TimerStatus = TimerStatus.PENDING
    attempts: int = 0
    fired: int = 0
    claim: Claim | None = None
    last_error: str | None = None
    revision: int = 0

    @property
    def command(self) -> Command:
        return Command.from_json(self.body)

    @property
    def request_id(self) -> str:
        return request_id_for(self.timer_id, self.scheduled_at)


def deterministic_timer_id(owner: AggregateRef, key: str, version: int) -> str:
    """A timer id from owner, key and version: a view rebuilt from the log has the same ids."""
    raw = "\x1f".join((owner.context, owner.aggregate, owner.tenant_id, owner.id, key, str(version)))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def request_id_for(timer_id: str, scheduled_at: int) -> str:
    """The ``Command-Request-Id`` of one occurrence of a timer: the same on every re-fire."""
    return hashlib.sha256(f"{timer_id}:{scheduled_at}".encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerChange:
    """One outcome to settle, made against the timer *as loaded* (``timer_id`` + ``revision``).

    ``kind``:
      - ``claim``: FIRING, ``claim = {owner_key, fence, until}``, ``due_at = until``.
      - ``fired``: delivered; deleted when ``next_due`` is None, else PENDING at ``next_due``
        (``scheduled_at = due_at = next_due``, ``fired + 1``, attempts reset).
      - ``retry``: PENDING at ``due_at``, ``attempts + 1``, ``last_error``.
      - ``release``: claimed but never sent (the replica stopped): PENDING at ``due_at``, the
        attempts unchanged, ``last_error``.
      - ``park``: PARKED (out of the due index), ``last_error``; ``due_at`` = when it was parked
        (given ``at``; a PARKED timer is never due, so its ``due_at`` says since when).
      - ``resume``: PENDING at ``due_at`` (attempts reset), from PARKED or FAILED.
      - ``fail``: FAILED, ``last_error``.
    Every change bumps ``revision``; ``fence`` is the slot fence of the writer.
    """

    kind: Literal["claim", "fired", "retry", "release", "park", "resume", "fail"]
    timer: Timer
    fence: int = 0
    owner_key: str = ""
    due_at: int | None = None
    """claim: the claim's expiry; retry/resume: the new due time."""
    next_due: int | None = None
    """fired: the next occurrence of a recurring rule, or None to delete."""
    error: str | None = None

    @staticmethod
    def claim(timer: Timer, *, owner_key: str, fence: int, until: int) -> TimerChange:
        return TimerChange(kind="claim", timer=timer, owner_key=owner_key, fence=fence, due_at=until)

    @staticmethod
    def fired(timer: Timer, *, fence: int, next_due: int | None) -> TimerChange:
        return TimerChange(kind="fired", timer=timer, fence=fence, next_due=next_due)

    @staticmethod
    def retry(timer: Timer, *, fence: int, due_at: int, error: str) -> TimerChange:
        return TimerChange(kind="retry", timer=timer, fence=fence, due_at=due_at, error=error)

    @staticmethod
    def release(timer: Timer, *, fence: int, due_at: int, reason: str) -> TimerChange:
        return TimerChange(kind="release", timer=timer, fence=fence, due_at=due_at, error=reason)

    @staticmethod
    def park(timer: Timer, *, fence: int, reason: str, at: int | None = None) -> TimerChange:
        return TimerChange(kind="park", timer=timer, fence=fence, error=reason, due_at=at)

    @staticmethod
    def resume(timer: Timer, *, due_at: int) -> TimerChange:
        return TimerChange(kind="resume", timer=timer, due_at=due_at)

    @staticmethod
    def fail(timer: Timer, *, fence: int, reason: str) -> TimerChange:
        return TimerChange(kind="fail", timer=timer, fence=fence, error=reason)

    def applied(self) -> Timer | None:
        """The timer after this change (``None``: deleted). Stores write exactly this."""
        t = self.timer
        rev = t.revision + 1
        if self.kind == "claim":
            assert self.due_at is not None
            return replace(
                t,
                status=TimerStatus.FIRING,
                due_at=self.due_at,
                claim=Claim(owner_key=self.owner_key, fence=self.fence, until=self.due_at),
                revision=rev,
            )
        if self.kind == "fired":
            if self.next_due is None:
                return None
            return replace(
                t,
                status=TimerStatus.PENDING,
                due_at=self.next_due,
                scheduled_at=self.next_due,
                fired=t.fired + 1,
                attempts=0,
                claim=None,
                last_error=None,
                revision=rev,
            )
        if self.kind == "retry":
            assert self.due_at is not None
            return replace(
                t,
                status=TimerStatus.PENDING,
                due_at=self.due_at,
                attempts=t.attempts + 1,
                claim=None,
                last_error=self.error,
                revision=rev,
            )
        if self.kind == "release":
            assert self.due_at is not None
            return replace(
                t, status=TimerStatus.PENDING, due_at=self.due_at, claim=None, last_error=self.error, revision=rev
            )
        if self.kind == "park":
            due = t.due_at if self.due_at is None else self.due_at
            return replace(t, status=TimerStatus.PARKED, due_at=due, claim=None, last_error=self.error, revision=rev)
        if self.kind == "resume":
            assert self.due_at is not None
            return replace(t, status=TimerStatus.PENDING, due_at=self.due_at, attempts=0, claim=None, revision=rev)
        return replace(t, status=TimerStatus.FAILED, claim=None, last_error=self.error, revision=rev)


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerWrite:
    """One timer event of the log as the timer store writes it (:meth:`TimerStore.write`).

    ``put``: ``timer`` at its owner's ``version``; ``cancel``: the timer ``key`` of ``owner`` at
    or below ``version``; ``cancel_all``: every timer of ``owner`` at or below ``version``.
    """

    kind: Literal["put", "cancel", "cancel_all"]
    owner: AggregateRef
    version: int
    key: str = ""
    timer: Timer | None = None

    @staticmethod
    def put(timer: Timer) -> TimerWrite:
        return _timer_write(kind="put", owner=timer.owner, version=timer.version, key=timer.key, timer=timer)

    @staticmethod
    def cancel(owner: AggregateRef, key: str, version: int) -> TimerWrite:
        return TimerWrite(kind="cancel", owner=owner, version=version, key=key)

    @staticmethod
    def cancel_all(owner: AggregateRef, version: int) -> TimerWrite:
        return TimerWrite(kind="cancel_all", owner=owner, version=version)


_timer_write = unchecked(TimerWrite)


def net_writes(writes: Sequence[TimerWrite]) -> list[TimerWrite]:
    """The net effect of a batch of timer writes in log order: at most one write per timer key
    and one ``cancel_all`` per owner, which the store may apply in any order.

    The writes of one commit are those of one owner at one version (a commit's timer events in
    order, then its ``cancel_all`` when it deletes the aggregate), and they are applied in their
    order: a later write of a key replaces an earlier one of the same commit, and a ``cancel_all``
    cancels the writes of its commit before it, not those after it. Across commits the higher
    version wins. So per key the write last in that order stays (the highest version, then the
    last in the batch), and one before its owner's last ``cancel_all`` becomes a cancel at the
    ``cancel_all``'s version (it leaves a tombstone: it is never written live). A ``cancel_all``
    whose own commit writes keys after it that stay is written one version below its commit: it
    cancels every timer of the earlier commits and none of the ones its commit leaves live.

    With the store's version rules (a later version replaces, a tombstone refuses a put at or
    below it) the writes kept commute, so the result is the same as applying the batch in order,
    and a replay of any of its commits changes nothing.
    """
    # keyed by the owner's fields (a tuple hashes in C; the dataclass's hash is Python code):
    # per owner, its last cancel_all as (version, index in writes); per key, the index of the
    # write that stays (a dict keeps the first insertion's place: the order of first writes)
    last_all: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    winners: dict[tuple[str, str, str, str, str], int] = {}
    for i, w in enumerate(writes):
        o = w.owner
        if w.kind == "cancel_all":
            ok = (o.context, o.aggregate, o.tenant_id, o.id)
            cur = last_all.get(ok)
            if cur is None or w.version >= cur[0]:
                last_all[ok] = (w.version, i)
            continue
        k = (o.context, o.aggregate, o.tenant_id, o.id, w.key)
        j = winners.get(k)
        if j is None or w.version >= writes[j].version:
            winners[k] = i
    if not last_all:
        return [writes[j] for j in winners.values()]
    out: list[TimerWrite] = []
    followed: set[tuple[str, str, str, str]] = set()  # owners with a write after their cancel_all, kept
    for k, j in winners.items():
        w = writes[j]
        ok = k[:4]
        ca = last_all.get(ok)
        if ca is not None:
            v = w.version
            if v < ca[0] or (v == ca[0] and j < ca[1]):
                # never live: a tombstone at the cancel_all's version (a replay of the put with
                # other batch boundaries is refused by it)
                out.append(TimerWrite.cancel(w.owner, w.key, ca[0]))
                continue
            if v == ca[0]:
                followed.add(ok)
        out.append(w)
    alls = [
        TimerWrite.cancel_all(writes[i].owner, version - 1 if ok in followed else version)
        for ok, (version, i) in last_all.items()
        if version > 1 or ok not in followed  # below version 1 there is nothing to cancel
    ]
    return alls + out


# --------------------------------------------------------------------------- timer events


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerScheduled:
    key: str
    due_at: int
    rule: Rule
    target: AggregateRef
    command: Command
    command_json: str = field(default="", compare=False)
    """The command's JSON text as the timer stores it (written once, when the event is read)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerCancelled:
    key: str


_ONCE = OnceRule()
_ONCE_DOC = {"type": "once"}


def timer_event_from(
    event: DomainEvent, *, max_body_bytes: int = MAX_BODY_BYTES, min_interval_ms: int = MIN_INTERVAL_MS
) -> TimerScheduled | TimerCancelled | None:
    """Reads a timer event of the log (docs/schema.md); ``None`` for other events.

    Raises :class:`InvalidInput` naming the field for a malformed timer event, and for an
    interval rule shorter than ``min_interval_ms``.
    """
    if event.name not in ("TimerScheduled", "TimerCancelled"):
        return None
    body = event.body
    key = body.get("key")
    if not isinstance(key, str) or not key or len(key) > 512:
        raise InvalidInput("must be a non-empty string of at most 512 characters", field="body.key")
    refuse_controls(key, field="body.key")
    if event.name == "TimerCancelled":
        return TimerCancelled(key=key)
    due_at = body.get("due_at")
    if not isinstance(due_at, int) or isinstance(due_at, bool) or not 0 <= due_at <= _MAX_MS:
        raise InvalidInput(f"must be an integer in [0, {_MAX_MS}] (ms), got {due_at!r}", field="body.due_at")
    rule_doc = body.get("rule", _ONCE_DOC)
    rule = _ONCE if rule_doc == _ONCE_DOC else parse_rule(rule_doc)
    if isinstance(rule, IntervalRule) and rule.every_ms < min_interval_ms:
        raise InvalidInput(
            f"{rule.every_ms} ms is below the shortest interval, {min_interval_ms} ms", field="rule.every_ms"
        )
    t = body.get("target")
    if not _is_doc(t):
        raise InvalidInput("must be a document {context, aggregate, tenant_id, id}", field="body.target")
    try:
        target = _shared_ref(t.get("context"), t.get("aggregate"), t.get("tenant_id", DEFAULT_TENANT), t.get("id"))
    except (ConfigError, InvalidInput) as exc:
        raise InvalidInput(str(exc), field="body.target") from exc
    c = body.get("command")
    if not _is_doc(c) or not isinstance(c.get("name"), str) or not c.get("name"):
        raise InvalidInput("must be a document {name, body_type?, body}", field="body.command")
    cbody = c.get("body", {})
    if not _is_doc(cbody):
        raise InvalidInput("must be a document", field="body.command.body")
    body_type = c.get("body_type")
    if "body_type" in c and not isinstance(body_type, str):
        raise InvalidInput("must be a string or absent", field="body.command.body_type")
    command = _command(name=c["name"], body=cbody, body_type=body_type)
    try:
        text = command.to_json()
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"cannot be written as JSON: {exc}", field="body.command.body") from exc
    size = len(text) if text.isascii() else len(text.encode())
    if size > max_body_bytes:
        raise InvalidInput(f"is {size} bytes, over the limit of {max_body_bytes}", field="body.command")
    return _scheduled(key=key, due_at=due_at, rule=rule, target=target, command=command, command_json=text)


_command = unchecked(Command)
_scheduled = unchecked(TimerScheduled)
_timer = unchecked(Timer)


def timer_from_event(commit: Commit, ev: TimerScheduled, partitions: int) -> Timer:
    """The timer a ``TimerScheduled`` event of ``commit`` puts (owned by the commit's aggregate,
    at its version, with the deterministic id a rebuilt view gives it again)."""
    owner = commit.ref
    return _timer(
        timer_id=deterministic_timer_id(owner, ev.key, commit.version),
        partition=partition(owner.id, partitions),
        owner=owner,
        key=ev.key,
        version=commit.version,
        due_at=ev.due_at,
        scheduled_at=ev.due_at,
        target=ev.target,
        body=ev.command_json or ev.command.to_json(),
        rule=ev.rule,
        status=TimerStatus.PENDING,
        attempts=0,
        fired=0,
        claim=None,
        last_error=None,
        revision=0,
    )
