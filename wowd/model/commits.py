"""Commits (the log) and their codec: a stored document read into a :class:`Commit`, checked
field by field, or at once for a document of the usual shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeAlias, TypeGuard, TypeVar

from wowd.errors import InvalidInput
from wowd.model.ids import DEFAULT_TENANT, AggregateRef, AggregateType, partition

_T = TypeVar("_T")


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
    covers: frozenset[int] | None = None
    """The partitions ``watermark`` holds for (``None``: every partition of the read): a read
    that has not reached every partition's head yet (MongoDB's catch-up stream of the partitions
    scanned so far, while the others are scanned) says which."""


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
    """The log document of a commit (docs/schema.md), without storage-specific keys."""
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
    header = get("header", _ABSENT)
    access = get("access", _ABSENT)
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
        and (header.__class__ is dict or header is _ABSENT)
        and (access.__class__ is dict and _plain_access(access) or access is _ABSENT)
        and access_version.__class__ is int
        and access_version >= 0
        and deleted.__class__ is bool
        and get("owner_id", "").__class__ is str
        and get("space_id", "").__class__ is str
    ):
        return None
    if header is _ABSENT:
        header = {}
    if access is _ABSENT:
        access = {}
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
_ABSENT: Any = object()
"""A property the document leaves out (its default applies; a ``null`` one is refused)."""


def _plain_access(access: dict[str, Any]) -> bool:
    """Whether access attributes are of the schema's types: ``owner_id``, ``space_id`` strings,
    ``tags`` a list of strings (each optional; other properties allowed)."""
    if not access:
        return True
    tags = access.get("tags", ())
    return (
        access.get("owner_id", "").__class__ is str
        and access.get("space_id", "").__class__ is str
        and (tags == () or tags.__class__ is list and all(t.__class__ is str for t in tags))
    )


def _optional(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, path: str = "") -> Any:
    """``doc[key]`` when it is of ``kind`` (a bool is no ``int``), ``default`` when it is left
    out; anything else (``null`` included) raises naming the field."""
    if key not in doc:
        return default
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidInput(f"must be {_kind_name(kind)} or absent, got {type(value).__name__}", field=f"{path}{key}")
    return value


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
                id=_optional(e, "id", str, "", path),
                name=_require(e, "name", str, path),
                revision=_optional(e, "revision", str, "0.0.1", path),
                body_type=_optional(e, "body_type", str, "", path),
                body=body,
            )
        )
    access = _optional(doc, "access", Mapping, {})
    _optional(access, "owner_id", str, "", "access.")
    _optional(access, "space_id", str, "", "access.")
    tags = _optional(access, "tags", (list, tuple), [], "access.")
    if not all(isinstance(t, str) for t in tags):
        raise InvalidInput("must be a list of strings", field="access.tags")
    header = _optional(doc, "header", Mapping, {})
    access_version = _optional(doc, "access_version", int, 0)
    if access_version < 0:
        raise InvalidInput("must be an integer >= 0", field="access_version")
    deleted = doc.get("deleted", False)
    if not isinstance(deleted, bool):
        raise InvalidInput("must be a boolean", field="deleted")
    _optional(doc, "owner_id", str, "")
    _optional(doc, "space_id", str, "")
    return Commit(
        ref=AggregateRef(context=aggregate.context, aggregate=aggregate.aggregate, tenant_id=tenant, id=agg_id),
        version=_require(doc, "version", int),
        command_id=_optional(doc, "command_id", str, ""),
        request_id=_require(doc, "request_id", str),
        create_time=_require(doc, "create_time", int),
        events=tuple(events),
        header=header,
        access=access,
        access_version=access_version,
        deleted=deleted,
    )
