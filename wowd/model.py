"""The value types every layer shares: identities, commits, timers, snapshots, leases.

All models are frozen dataclasses; validation happens in ``__post_init__`` (or in the
``*_from_doc`` readers for data coming from a store) and raises :class:`InvalidInput` /
:class:`ConfigError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from enum import StrEnum
from functools import lru_cache
from operator import mul
from typing import Any, Literal, TypeAlias, TypeGuard, TypeVar
from urllib.parse import quote
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import orjson

from wowd.errors import ConfigError, InvalidInput

__all__ = [
    "DEFAULT_TENANT",
    "MAX_BODY_BYTES",
    "AccessStamp",
    "AcquireResult",
    "AggregateRef",
    "AggregateType",
    "Checkpoint",
    "Claim",
    "Command",
    "Commit",
    "CronRule",
    "DomainEvent",
    "IntervalRule",
    "LogBatch",
    "LogEntry",
    "OnceRule",
    "OutboxBatch",
    "OutboxEntry",
    "Owner",
    "Position",
    "Rule",
    "SlotLease",
    "SlotState",
    "SnapshotRecord",
    "SnapshotSaveOutcome",
    "SnapshotTable",
    "Timer",
    "TimerCancelled",
    "TimerChange",
    "TimerWrite",
    "TimerScheduled",
    "TimerStatus",
    "commit_fields",
    "commit_from_doc",
    "commit_to_doc",
    "deterministic_timer_id",
    "java_string_hash",
    "net_writes",
    "parse_rule",
    "partition",
    "request_id_for",
    "sorted_json",
    "stream_id",
    "timer_event_from",
    "timer_from_event",
    "unchecked",
    "validate_name",
]

_T = TypeVar("_T")

DEFAULT_TENANT = "(0)"
"""Wow's default tenant id."""

MAX_BODY_BYTES = 64 * 1024
"""Default limit of a timer command's JSON text (configurable in the daemon)."""

_NAME = re.compile(r"^[a-z0-9_-]+$")


_VALID_NAMES: set[str] = set()
"""Names already found valid (a context has a handful; every commit read names them again)."""


def validate_name(value: str, *, field: str = "name") -> str:
    """A context or aggregate name: ``[a-z0-9_-]+``, lower case, at most 64 characters.

    It becomes part of collection and index names, so anything else is refused.
    """
    if value.__class__ is str and value in _VALID_NAMES:
        return value
    if not isinstance(value, str) or not _NAME.match(value) or len(value) > 64:
        raise ConfigError(f"{field}: {value!r} is not a valid name (lower-case [a-z0-9_-], 1..64 characters)")
    if len(_VALID_NAMES) < 10_000:
        _VALID_NAMES.add(value)
    return value


_HASH_POWERS = [pow(31, i, 1 << 32) for i in range(1024)][::-1]
"""``31 ** k mod 2 ** 32`` for k = 1023 .. 0: the weights of Java's string hash, last unit last."""


@lru_cache(maxsize=65_536)
def java_string_hash(s: str) -> int:
    """Java's ``String.hashCode`` over the UTF-16 code units of ``s``, as a signed 32-bit int.

    ``sum(unit_i * 31 ** (n - 1 - i)) mod 2 ** 32``: an ASCII string's bytes are its code units,
    weighed in one ``sum`` over the precomputed powers; any other string unit by unit."""
    if s.isascii() and len(s) <= len(_HASH_POWERS):
        data = s.encode()
        weighed: int = sum(map(mul, data, _HASH_POWERS[len(_HASH_POWERS) - len(data) :]))
        h = weighed & 0xFFFFFFFF
    else:
        units = s.encode("utf-16-be", "surrogatepass")
        h = 0
        for i in range(0, len(units), 2):
            h = (31 * h + ((units[i] << 8) | units[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def partition(aggregate_id: str, n: int) -> int:
    """``floorMod(javaStringHashCode(aggregate_id), n)``: Wow's ``AggregateId.mod``."""
    if n < 1:
        raise ConfigError(f"partitions: must be >= 1, got {n}")
    return java_string_hash(aggregate_id) % n  # Python's % is a floor mod


# --------------------------------------------------------------------------- identities


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class AggregateType:
    """An aggregate type of a bounded context."""

    context: str
    aggregate: str

    def __post_init__(self) -> None:
        validate_name(self.context, field="context")
        validate_name(self.aggregate, field="aggregate")

    def __str__(self) -> str:
        return f"{self.context}.{self.aggregate}"


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class AggregateRef:
    """One aggregate: ``(context, aggregate, tenant_id, id)``."""

    context: str
    aggregate: str
    id: str
    tenant_id: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        validate_name(self.context, field="context")
        validate_name(self.aggregate, field="aggregate")
        if not isinstance(self.id, str):
            raise InvalidInput("must be a string", field="aggregate_id")
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise InvalidInput("must be a non-empty string", field="tenant_id")

    @property
    def type(self) -> AggregateType:
        return AggregateType(context=self.context, aggregate=self.aggregate)

    def partition(self, n: int) -> int:
        return partition(self.id, n)

    def __str__(self) -> str:
        return f"{self.context}.{self.aggregate}/{self.tenant_id}/{self.id}"


_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]*")


@lru_cache(maxsize=4096)
def _percent_encoded(part: str) -> str:
    # quote(safe="") leaves exactly the unreserved characters alone: skip it when that is all
    return part if _UNRESERVED.fullmatch(part) else quote(part, safe="")


def stream_id(ref: AggregateRef, version: int) -> str:
    """The event document id: tenant, aggregate id and version, each percent-encoded, joined by ``:``."""
    return f"{_percent_encoded(ref.tenant_id)}:{_percent_encoded(ref.id)}:{version}"


# --------------------------------------------------------------------------- commits (the log)


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainEvent:
    id: str
    name: str
    revision: str = "0.0.1"
    body_type: str = ""
    body: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Commit:
    """One commit of the log (Wow's ``StateEventRecord``)."""

    ref: AggregateRef
    version: int
    command_id: str
    request_id: str
    create_time: int
    """Milliseconds since the epoch."""
    events: tuple[DomainEvent, ...] = ()
    header: Mapping[str, Any] = field(default_factory=dict)
    access: Mapping[str, Any] = field(default_factory=dict)
    """The aggregate's access attributes: ``owner_id``, ``space_id``, ``tags``."""
    access_version: int = 0
    """The version the access attributes are of."""
    deleted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise InvalidInput(f"must be an integer >= 1, got {self.version!r}", field="version")
        if not isinstance(self.create_time, int) or isinstance(self.create_time, bool):
            raise InvalidInput("must be an integer (ms)", field="create_time")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidInput("must be a non-empty string", field="request_id")

    @property
    def owner_id(self) -> str:
        return str(self.access.get("owner_id", ""))

    @property
    def space_id(self) -> str:
        return str(self.access.get("space_id", ""))

    def partition(self, n: int) -> int:
        return partition(self.ref.id, n)


Position: TypeAlias = dict[str, Any]
"""A log position: opaque to the daemon, JSON- and BSON-serialisable, meaningful to its log.

The embedded log uses ``{"seq": n}``; the MongoDB log ``{"token": {...}, "cluster_time": ...}``.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogEntry:
    """One entry read from the log: a commit, or a malformed document to quarantine."""

    position: Position
    partition: int
    aggregate: AggregateType
    commit: Commit | None
    raw: Mapping[str, Any]
    error: str | None = None
    """Why ``raw`` could not be read as a commit (``commit`` is then ``None``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogBatch:
    """Entries in log order; ``positions`` holds each partition's last position in this batch."""

    entries: tuple[LogEntry, ...]
    positions: Mapping[int, Position]
    watermark: int | None = None
    """A store time (ms) such that every commit of the read's partitions appended before it is
    in this batch or an earlier one of the same read (``None``: not known, the read is behind)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    consumer: str
    partition: int
    position: Position
    fence: int
    written_at: int


def _is_doc(value: object) -> TypeGuard[Mapping[str, Any]]:
    """A document: a dict (checked first, the common case) or another Mapping."""
    return value.__class__ is dict or isinstance(value, Mapping)


def _require(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str = "") -> Any:
    name = f"{path}{key}"
    if key not in doc:
        raise InvalidInput("is missing", field=name)
    value = doc[key]
    if isinstance(value, bool) and kind in (int, (int,)):
        raise InvalidInput(f"must be {_kind_name(kind)}, got bool", field=name)
    if not isinstance(value, kind):
        raise InvalidInput(f"must be {_kind_name(kind)}, got {type(value).__name__}", field=name)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def commit_fields(commit: Commit) -> dict[str, Any]:
    """The fields of a commit that every view of it stores (the event sinks' stream documents):
    identity, version, command, request, create time, header and events; no partition, no access."""
    ref = commit.ref
    return {
        "tenant_id": ref.tenant_id,
        "aggregate_id": ref.id,
        "version": commit.version,
        "command_id": commit.command_id,
        "request_id": commit.request_id,
        "create_time": commit.create_time,
        "header": dict(commit.header),
        "events": [
            {"id": e.id, "name": e.name, "revision": e.revision, "body_type": e.body_type, "body": dict(e.body)}
            for e in commit.events
        ],
    }


def commit_to_doc(commit: Commit, partitions: int) -> dict[str, Any]:
    """The log document of a commit (DESIGN.md section 3), without storage-specific keys."""
    ref = commit.ref
    return {
        "_id": {"t": ref.tenant_id, "a": ref.id, "v": commit.version},
        "tenant_id": ref.tenant_id,
        "aggregate_id": ref.id,
        "version": commit.version,
        "partition": partition(ref.id, partitions),
        "command_id": commit.command_id,
        "request_id": commit.request_id,
        "create_time": commit.create_time,
        "header": dict(commit.header),
        "events": [
            {
                "id": e.id,
                "name": e.name,
                "revision": e.revision,
                "body_type": e.body_type,
                "body": dict(e.body),
            }
            for e in commit.events
        ],
        "owner_id": commit.owner_id,
        "space_id": commit.space_id,
        "access": dict(commit.access),
        "access_version": commit.access_version,
        "deleted": commit.deleted,
    }


def unchecked(cls: type[_T]) -> Callable[..., _T]:
    """A constructor of the frozen slotted dataclass ``cls`` taking every field by keyword (none
    optional) that sets them through the slots, without ``__init__``'s ``object.__setattr__``
    per field and without ``__post_init__``: for values a reader has checked already. It builds
    an object equal to ``cls(**fields)``."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    scope: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    scope.update({f"_set_{n}": getattr(cls, n).__set__ for n in names})
    body = "".join(f"    _set_{n}(o, {n})\n" for n in names)
    exec(f"def build(*, {', '.join(names)}):\n    o = _new(_cls)\n{body}    return o\n", scope)
    build: Callable[..., _T] = scope["build"]
    return build


_REFS: dict[tuple[str, str, str, str], AggregateRef] = {}
_REFS_MAX = 16_384
"""How many refs :func:`_shared_ref` keeps (then it starts again from none)."""


def _shared_ref(context: Any, aggregate: Any, tenant_id: Any, id: Any) -> AggregateRef:
    """The :class:`AggregateRef` of these fields, one object for equal refs read close together
    (a commit's own ref and its timers' targets, an aggregate's successive commits): built and
    validated once, and dictionaries keyed by it find it by identity. Raises as the constructor."""
    if not (
        context.__class__ is str and aggregate.__class__ is str and tenant_id.__class__ is str and id.__class__ is str
    ):
        return AggregateRef(context=context, aggregate=aggregate, tenant_id=tenant_id, id=id)
    key = (context, aggregate, tenant_id, id)
    ref = _REFS.get(key)
    if ref is None:
        ref = AggregateRef(context=context, aggregate=aggregate, tenant_id=tenant_id, id=id)
        if len(_REFS) >= _REFS_MAX:
            _REFS.clear()
        _REFS[key] = ref
    return ref


def commit_from_doc(aggregate: AggregateType, doc: Mapping[str, Any]) -> Commit:
    """Reads a log document; raises :class:`InvalidInput` naming the first bad field."""
    if doc.__class__ is dict:
        commit = _plain_commit(aggregate, doc)
        if commit is not None:
            return commit
    return _checked_commit(aggregate, doc)


def _plain_commit(aggregate: AggregateType, doc: Mapping[str, Any]) -> Commit | None:
    """:func:`commit_from_doc` of a document in the log's own shape, every value of its exact
    JSON type (as a JSON decoder gives them); ``None`` for anything else, which
    :func:`_checked_commit` then reads or refuses with the field it names. Both give equal
    commits for a document both accept."""
    get = doc.get
    tenant = get("tenant_id", DEFAULT_TENANT)
    agg_id = get("aggregate_id")
    version = get("version")
    request_id = get("request_id")
    create_time = get("create_time")
    command_id = get("command_id", "")
    events_raw = get("events")
    header = get("header") or {}
    access = get("access") or {}
    access_version = get("access_version", 0)
    deleted = get("deleted", False)
    if not (
        tenant.__class__ is str
        and tenant
        and agg_id.__class__ is str
        and version.__class__ is int
        and version >= 1
        and request_id.__class__ is str
        and request_id
        and create_time.__class__ is int
        and command_id.__class__ is str
        and events_raw.__class__ is list
        and header.__class__ is dict
        and access.__class__ is dict
        and access_version.__class__ is int
        and deleted.__class__ is bool
    ):
        return None
    events: list[DomainEvent] = []
    for e in events_raw:
        if e.__class__ is not dict:
            return None
        eget = e.get
        event_id = eget("id", "")
        name = eget("name")
        revision = eget("revision", "0.0.1")
        body_type = eget("body_type", "")
        body = eget("body", {})
        if not (
            event_id.__class__ is str
            and name.__class__ is str
            and revision.__class__ is str
            and body_type.__class__ is str
            and body.__class__ is dict
        ):
            return None
        events.append(_event(id=event_id, name=name, revision=revision, body_type=body_type, body=body))
    return _commit(
        ref=_shared_ref(aggregate.context, aggregate.aggregate, tenant, agg_id),
        version=version,
        command_id=command_id,
        request_id=request_id,
        create_time=create_time,
        events=tuple(events),
        header=header,
        access=access,
        access_version=access_version,
        deleted=deleted,
    )


_event = unchecked(DomainEvent)
_commit = unchecked(Commit)


def _checked_commit(aggregate: AggregateType, doc: Mapping[str, Any]) -> Commit:
    if not _is_doc(doc):
        raise InvalidInput("a commit must be a document", field="commit")
    tenant = doc.get("tenant_id", DEFAULT_TENANT)
    if not isinstance(tenant, str) or not tenant:
        raise InvalidInput("must be a non-empty string", field="tenant_id")
    agg_id = _require(doc, "aggregate_id", str)
    events_raw = _require(doc, "events", list)
    events: list[DomainEvent] = []
    for i, e in enumerate(events_raw):
        path = f"events[{i}]."
        if not _is_doc(e):
            raise InvalidInput("must be a document", field=f"events[{i}]")
        body = e.get("body", {})
        if not _is_doc(body):
            raise InvalidInput("must be a document", field=f"{path}body")
        events.append(
            DomainEvent(
                id=str(e.get("id", "")),
                name=_require(e, "name", str, path),
                revision=str(e.get("revision", "0.0.1")),
                body_type=str(e.get("body_type", "")),
                body=body,
            )
        )
    access = doc.get("access") or {}
    if not _is_doc(access):
        raise InvalidInput("must be a document", field="access")
    header = doc.get("header") or {}
    if not _is_doc(header):
        raise InvalidInput("must be a document", field="header")
    access_version = doc.get("access_version", 0)
    if not isinstance(access_version, int) or isinstance(access_version, bool):
        raise InvalidInput("must be an integer", field="access_version")
    deleted = doc.get("deleted", False)
    if not isinstance(deleted, bool):
        raise InvalidInput("must be a boolean", field="deleted")
    return Commit(
        ref=AggregateRef(context=aggregate.context, aggregate=aggregate.aggregate, tenant_id=tenant, id=agg_id),
        version=_require(doc, "version", int),
        command_id=str(doc.get("command_id", "")),
        request_id=_require(doc, "request_id", str),
        create_time=_require(doc, "create_time", int),
        events=tuple(events),
        header=header,
        access=access,
        access_version=access_version,
        deleted=deleted,
    )


# --------------------------------------------------------------------------- timer rules

_MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z


@dataclass(frozen=True, slots=True, kw_only=True)
class OnceRule:
    type: Literal["once"] = "once"

    def next_after(self, fired_at: int) -> int | None:
        return None

    def to_doc(self) -> dict[str, Any]:
        return {"type": "once"}


@dataclass(frozen=True, slots=True, kw_only=True)
class IntervalRule:
    every_ms: int
    until: int | None = None
    type: Literal["interval"] = "interval"

    def __post_init__(self) -> None:
        if not isinstance(self.every_ms, int) or isinstance(self.every_ms, bool) or self.every_ms < 1:
            raise InvalidInput(f"must be an integer >= 1, got {self.every_ms!r}", field="rule.every_ms")
        if self.until is not None and (not isinstance(self.until, int) or isinstance(self.until, bool)):
            raise InvalidInput("must be an integer (ms) or absent", field="rule.until")

    def next_after(self, scheduled_at: int) -> int | None:
        nxt = scheduled_at + self.every_ms
        if self.until is not None and nxt > self.until:
            return None
        return nxt

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": "interval", "every_ms": self.every_ms}
        if self.until is not None:
            doc["until"] = self.until
        return doc


@dataclass(frozen=True, slots=True, kw_only=True)
class CronRule:
    """A cron rule (5 or 6 fields, croniter's syntax) evaluated in ``zone``."""

    expression: str
    zone: str = "UTC"
    type: Literal["cron"] = "cron"

    def __post_init__(self) -> None:
        from croniter import croniter

        if not isinstance(self.expression, str) or not croniter.is_valid(self.expression):
            raise InvalidInput(f"{self.expression!r} is not a valid cron expression", field="rule.expression")
        try:
            ZoneInfo(self.zone)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise InvalidInput(f"{self.zone!r} is not a known time zone", field="rule.zone") from exc

    @property
    def fixed_time(self) -> bool:
        """Whether the rule names its hours and minutes (neither field starts with ``*``, nor
        is it ``@hourly``): such a rule fires at given wall-clock times of the day."""
        fields = self.expression.split()
        if fields and fields[0].startswith("@"):
            return fields[0].lower() != "@hourly"
        return len(fields) >= 2 and not fields[0].startswith("*") and not fields[1].startswith("*")

    def next_after(self, scheduled_at: int) -> int | None:
        """The first occurrence strictly after ``scheduled_at``; ``None`` when there is none
        before year 9999 (an expression such as ``0 0 30 2 *`` never fires).

        Daylight saving time, as cron (Vixie cron, cronie) does it: a :attr:`fixed_time` rule
        fires once per wall-clock time, so a time repeated when the clocks go back fires on its
        first pass only, and a time skipped when they go forward fires at the first valid time
        after the gap (a daily 02:30 in New York fires at 03:00 EDT that day). A rule with a
        ``*`` in its minute or hour field follows the clock: it fires in the repeated hour again
        and the times of the gap do not exist."""
        from croniter import CroniterBadDateError, croniter

        zone = ZoneInfo(self.zone)
        try:
            start = datetime.fromtimestamp(scheduled_at / 1000, tz=zone)
            it = croniter(self.expression, start, max_years_between_matches=50)
            while True:
                ms = int(it.get_next(datetime).astimezone(UTC).timestamp() * 1000)
                if ms > _MAX_MS:
                    return None
                if self.fixed_time and datetime.fromtimestamp(ms / 1000, tz=zone).fold == 1:
                    continue  # the second pass of a wall-clock time: it fired on the first
                return ms
        except (CroniterBadDateError, OverflowError, ValueError, OSError):
            return None

    def to_doc(self) -> dict[str, Any]:
        return {"type": "cron", "expression": self.expression, "zone": self.zone}


Rule: TypeAlias = OnceRule | IntervalRule | CronRule


def parse_rule(doc: Any) -> Rule:
    """Reads ``{type, ...}``; an unknown type or bad field raises :class:`InvalidInput`."""
    if not _is_doc(doc):
        raise InvalidInput("must be a document {type, ...}", field="rule")
    kind = doc.get("type")
    if kind == "once":
        return OnceRule()
    if kind == "interval":
        return IntervalRule(every_ms=doc.get("every_ms"), until=doc.get("until"))  # type: ignore[arg-type]
    if kind == "cron":
        return CronRule(expression=doc.get("expression"), zone=doc.get("zone", "UTC"))  # type: ignore[arg-type]
    raise InvalidInput(f"unknown rule type {kind!r} (once, interval, cron)", field="rule.type")


# --------------------------------------------------------------------------- timers


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
        if not ascii or out.isascii():
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
    """A timer as stored (DESIGN.md section 5).

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

    Per key the write that wins in log order stays: the highest version; at one version a cancel
    over a put, and the first of two puts. A put at or below its owner's ``cancel_all`` becomes a
    cancel at the ``cancel_all``'s version (it leaves a tombstone: it is never written live).
    With the store's version rules (a later version replaces, a tombstone refuses a put at or
    below it) the writes kept commute, so the result is the same as applying the batch in order.
    """
    # keyed by the owner's fields (a tuple hashes in C; the dataclass's hash is Python code)
    last_all: dict[tuple[str, str, str, str], int] = {}
    for w in writes:
        if w.kind == "cancel_all":
            o = w.owner
            ok = (o.context, o.aggregate, o.tenant_id, o.id)
            if w.version > last_all.get(ok, -1):
                last_all[ok] = w.version
    winners: dict[tuple[str, str, str, str, str], TimerWrite] = {}
    for w in writes:
        if w.kind == "cancel_all":
            continue
        o = w.owner
        k = (o.context, o.aggregate, o.tenant_id, o.id, w.key)
        cur = winners.get(k)
        if cur is None:
            winners[k] = w  # a dict keeps the first insertion's place: the order of first writes
        elif w.version > cur.version or (w.version == cur.version and w.kind == "cancel" and cur.kind == "put"):
            winners[k] = w
    out: list[TimerWrite] = []
    emitted: set[tuple[str, str, str, str]] = set()
    for w in writes:
        if w.kind == "cancel_all":
            o = w.owner
            ok = (o.context, o.aggregate, o.tenant_id, o.id)
            if ok not in emitted:
                emitted.add(ok)
                out.append(TimerWrite.cancel_all(o, last_all[ok]))
    for k, w in winners.items():
        ca = last_all.get(k[:4]) if last_all else None
        if ca is not None and w.version <= ca:
            # never live: a tombstone at the cancel_all's version (a replay of the put with
            # other batch boundaries is refused by it)
            out.append(TimerWrite.cancel(w.owner, w.key, ca))
        else:
            out.append(w)
    return out


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
    event: DomainEvent, *, max_body_bytes: int = MAX_BODY_BYTES
) -> TimerScheduled | TimerCancelled | None:
    """Reads a timer event of the log (DESIGN.md section 3); ``None`` for other events.

    Raises :class:`InvalidInput` naming the field for a malformed timer event.
    """
    if event.name not in ("TimerScheduled", "TimerCancelled"):
        return None
    body = event.body
    key = body.get("key")
    if not isinstance(key, str) or not key or len(key) > 512:
        raise InvalidInput("must be a non-empty string of at most 512 characters", field="body.key")
    if event.name == "TimerCancelled":
        return TimerCancelled(key=key)
    due_at = body.get("due_at")
    if not isinstance(due_at, int) or isinstance(due_at, bool) or not 0 <= due_at <= _MAX_MS:
        raise InvalidInput(f"must be an integer in [0, {_MAX_MS}] (ms), got {due_at!r}", field="body.due_at")
    rule_doc = body.get("rule", _ONCE_DOC)
    rule = _ONCE if rule_doc == _ONCE_DOC else parse_rule(rule_doc)
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
    if body_type is not None and not isinstance(body_type, str):
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


# --------------------------------------------------------------------------- snapshots


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    """The state of one aggregate at ``version``, folded by a reducer of ``state_revision``."""

    ref: AggregateRef
    version: int
    state_revision: int
    state: Mapping[str, Any]
    owner_id: str = ""
    space_id: str = ""
    tags: tuple[str, ...] = ()
    access_version: int = 0
    deleted: bool = False
    event_time: int = 0
    stale_version: int | None = None
    """Set by ``mark_stale``/a refused save: the log is at this version, the snapshot behind it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotTable:
    """The rebuild control plane's record of one aggregate type's snapshot collection."""

    type: AggregateType
    revision: int
    """The claimed state revision."""
    rebuilding: bool = False
    backfilled: bool = False
    updated_at: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotSaveOutcome:
    """What ``save_all`` did with one snapshot: ``saved``, ``unchanged`` (the guard kept a newer
    one, possibly marking it stale) or ``failed`` (``reason`` says why; the others still saved)."""

    ref: AggregateRef
    version: int
    status: Literal["saved", "unchanged", "failed"]
    reason: str | None = None

    @staticmethod
    def rounds(snapshots: Sequence[SnapshotRecord]) -> list[list[SnapshotRecord]]:
        """Splits a batch into rounds holding at most one snapshot per aggregate, in order,
        so one bulk write never carries two upserts of one key."""
        rounds: list[list[SnapshotRecord]] = []
        seen: dict[AggregateRef, int] = {}
        for s in snapshots:
            k = seen.get(s.ref, 0)
            seen[s.ref] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(s)
        return rounds


# --------------------------------------------------------------------------- leases


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

    @property
    def live(self) -> bool:
        return self.owner_key is not None and self.expires_at > self.store_now


# --------------------------------------------------------------------------- sink, outbox


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessStamp:
    """Write ``access`` (of ``as_of``, an access version) over the documents of ``ref`` whose
    version is in ``[from_, until]``, under the sink's stamp guard."""

    ref: AggregateRef
    access: Mapping[str, Any]
    as_of: int
    from_: int
    until: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxEntry:
    """A command delivered into the outbox: unique on ``request_id``."""

    request_id: str
    timer_id: str
    target: AggregateRef
    command: str
    """The command's JSON text."""
    scheduled_at: int
    fence: int
    owner_key: str
    created_at: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxBatch:
    """Entries taken from the outbox in insertion order, held by the take for its lease, and the
    take's name (``None`` when the batch is empty)."""

    entries: tuple[OutboxEntry, ...]
    cursor: str | None
