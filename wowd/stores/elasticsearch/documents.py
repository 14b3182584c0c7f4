"""The event index's documents, mapping, template, bulk bodies and queries: pure functions the sink
(:mod:`wowd.stores.elasticsearch.sink`) sends and reads (how a failure is read:
:mod:`wowd.stores.elasticsearch.faults`)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import anyio
import orjson

from wowd.errors import (
    InvalidInput,
    StorageError,
)
from wowd.model import (
    MAX_COMMIT_DOCUMENT_BYTES,
    MAX_COMMIT_EVENTS,
    AccessStamp,
    AggregateRef,
    AggregateType,
    Commit,
    commit_fields,
    stream_id,
)

__all__ = [
    "supported_version",
    "BULK_BYTES",
    "BULK_FILTER_PATH",
    "CUSTOM_TEMPLATE",
    "MAPPING_CHECK_S",
    "EMPTY_ID_ROUTING",
    "KEYWORD_IGNORE_ABOVE",
    "MAX_CONFLICT_ROUNDS",
    "MAX_DOCUMENT_BYTES",
    "MAX_DOCUMENT_EVENTS",
    "MAX_ID_BYTES",
    "MAX_QUERY_LEAVES",
    "MAX_REQUEST_BYTES",
    "MAX_ROUTING_CHARS",
    "REFRESH_INTERVAL_S",
    "STAMP_CLAUSE_LEAVES",
    "STAMP_PAGE",
    "STAMP_SCRIPT",
    "Seen",
    "SUPPORTED",
    "TEMPLATE_NAME",
    "access_digest",
    "bulk_bodies",
    "bulk_timeout",
    "bulk_lines",
    "check_mapping",
    "documents_search",
    "event_document",
    "events_mapping",
    "index_name",
    "index_template",
    "latest_search",
    "previous_docs",
    "routing_of",
    "stamp_clause",
    "stamp_query",
    "stamp_rounds",
    "stamp_script",
    "unbounded_keywords",
]

log = logging.getLogger(__name__)
MAX_CONFLICT_ROUNDS = 8
"""How many times a stamp is searched again after version conflicts before giving up (transient)."""
MAX_QUERY_LEAVES = 1000
"""The most leaf queries one stamp query holds. Lucene counts every leaf of the whole query
against ``IndexSearcher.maxClauseCount``, which Elasticsearch 9 sizes from the heap and the
search thread pool with a floor of 1024 (``indices.query.bool.max_clause_count`` is deprecated
and ignored); the margin leaves room for a filter Elasticsearch adds to the query."""
STAMP_CLAUSE_LEAVES = 10
"""Leaf queries in one :func:`stamp_clause` as Lucene counts them: a ``term`` is one, a ``range``
on a ``long`` two (``IndexOrDocValuesQuery``), a ``bool`` of ``must_not`` clauses only gains a
match-all; so tenant 1, aggregate 1, versions 2, and the guard's 2 + 2 + 2."""
STAMP_PAGE = MAX_QUERY_LEAVES // STAMP_CLAUSE_LEAVES
"""At most this many stamps go into one ``_update_by_query`` (one ``should`` clause each)."""
MAX_ROUTING_CHARS = 2048
"""A request is routed only while its encoded ``routing`` stays this short: the whole request
line must fit ``http.max_initial_line_length`` (4 KB by default; longer is a 400
``too_long_http_line_exception``). Without routing the request goes to every shard."""
MAX_ID_BYTES = 512
"""Elasticsearch refuses a document id over 512 bytes, and fails the whole bulk for it (request
validation, ``action_request_validation_exception``)."""
BULK_BYTES = 10 * 1024 * 1024
"""A write is split into bulks of about this many bytes."""
MAX_REQUEST_BYTES = 100 * 1024 * 1024
"""``http.max_content_length`` (100 MB by default): a record whose lines are longer cannot be sent."""
SUPPORTED = "9.x"
"""The Elasticsearch versions wowd speaks to: its client (elasticsearch-py 9) sends
``compatible-with=9``."""
REFRESH_INTERVAL_S = 1.0
"""The sink sends at most one ``_refresh`` per index this often (Elasticsearch's own
``index.refresh_interval`` default); the writes that need one meanwhile share it."""
MAX_DOCUMENT_BYTES = MAX_COMMIT_DOCUMENT_BYTES
"""The largest document the sink sends (its bulk lines). Elasticsearch's indexing pressure
(``indexing_pressure.memory.limit``, 10 % of the heap) refuses an operation larger than the
limit with a 429 that a retry repeats for ever; 10 MB stays under it from a 128 MB heap up, and a
document fits a bulk of :data:`BULK_BYTES`."""
MAX_DOCUMENT_EVENTS = MAX_COMMIT_EVENTS
"""The most events a document holds: each event is a nested document, and
``index.mapping.nested_objects.limit`` (10,000 by default) fails a document with more (400)."""
KEYWORD_IGNORE_ABOVE = 8191
"""``ignore_above`` of the free-form keywords: Lucene refuses a term over 32,766 bytes (an
"immense term" fails the item) and ``ignore_above`` counts characters, up to 4 bytes each."""
EMPTY_ID_ROUTING = "-"
"""The routing of an empty aggregate id (Elasticsearch reads an empty routing as none, refused
where routing is required). It only picks a shard: searches filter by aggregate id."""
BULK_FILTER_PATH = (
    "items.*._id,items.*.status,items.*._seq_no,items.*.error.type,items.*.error.reason,"
    "items.*.error.caused_by.type,items.*.error.caused_by.reason"
)
"""What a bulk answer is asked to hold: per item its operation, id, status, sequence number and
error with its cause. A sequence number 0 is the first operation of a shard: the index (or that
shard) was just made, by wowd or by a write that auto-created it, and its mapping is checked."""
TEMPLATE_NAME = "wowd-events"
"""The composable index template wowd installs under ``ddl auto``: an events index created by a
write (Elasticsearch's ``action.auto_create_index``, an index deleted at run time) gets wowd's
mapping, not a dynamic one."""
CUSTOM_TEMPLATE = "wowd-events@custom"
"""The component template :data:`TEMPLATE_NAME` is composed of, the operator's: the events
indexes' settings (shards, replicas, ``index.lifecycle.name``). wowd never writes it."""
MAPPING_CHECK_S = 30.0
"""How often at most a sink looks at its index's mapping again while it writes: an index made
again meanwhile with another mapping (by another replica's write) is seen within this."""


def bulk_timeout(request_timeout_s: float) -> str:
    """The ``timeout`` of a bulk (how long its shards wait for an active primary, a mapping
    update): half the client's request timeout, so that the cluster answers (a 503, retried)
    before the client gives up on a bulk that then goes on there while its retry is sent."""
    return f"{max(1, int(request_timeout_s * 500))}ms"


TEMPLATE_PATTERNS = ("wow.*.events",)
TEMPLATE_PRIORITY = 200
"""Above the built-in templates (priority 100 and below); two templates matching one name at the
same priority are refused."""
_DOCUMENTS_PAGE = 1000
_STORE = "elasticsearch"
_DIGEST_CACHE = 4096


def index_name(type: AggregateType) -> str:
    """The events index of an aggregate type: ``wow.<context>.<aggregate>.events``."""
    return f"wow.{type.context}.{type.aggregate}.events"


def events_mapping() -> dict[str, Any]:
    """The index's mapping: strict at the top (a layout mistake fails loudly), ids as keywords
    (the free-form ones with ``ignore_above``), ``create_time`` a date (epoch ms), events nested
    with their bodies stored, not indexed, ``header`` stored only, ``access`` indexed for its
    known attributes (others stored only), and routing required (every document is routed by
    its aggregate id)."""
    keyword: dict[str, Any] = {"type": "keyword"}
    free: dict[str, Any] = {"type": "keyword", "ignore_above": KEYWORD_IGNORE_ABOVE}
    return {
        "dynamic": "strict",
        "_routing": {"required": True},
        "properties": {
            "tenant_id": keyword,
            "aggregate_id": keyword,
            "version": {"type": "long"},
            "command_id": free,
            "request_id": free,
            "create_time": {"type": "date", "format": "epoch_millis"},
            "header": {"type": "object", "enabled": False},
            "events": {
                "type": "nested",
                "properties": {
                    "id": free,
                    "name": free,
                    "revision": free,
                    "body_type": free,
                    "body": {"type": "object", "enabled": False},
                },
            },
            "owner_id": free,
            "space_id": free,
            "access": {
                "type": "object",
                "dynamic": False,
                "properties": {"owner_id": free, "space_id": free, "tags": free},
            },
            "access_version": {"type": "long"},
            "access_digest": keyword,
            "deleted": {"type": "boolean"},
        },
    }


def index_template() -> dict[str, Any]:
    """The body of the ``PUT _index_template/wowd-events`` request (:data:`TEMPLATE_NAME`): wowd's
    mapping, composed with the operator's component template :data:`CUSTOM_TEMPLATE` (shards,
    replicas, a lifecycle policy: wowd never writes it, and it may not exist); the template's own
    mapping overrides a component's, so the fields wowd writes keep their types."""
    return {
        "index_patterns": list(TEMPLATE_PATTERNS),
        "priority": TEMPLATE_PRIORITY,
        "composed_of": [CUSTOM_TEMPLATE],
        "ignore_missing_component_templates": [CUSTOM_TEMPLATE],
        "template": {"mappings": events_mapping()},
        "_meta": {
            "managed_by": "wowd",
            "description": f"the events indexes of wowd's event sink; settings go into {CUSTOM_TEMPLATE}",
        },
    }


def check_mapping(mapping: Mapping[str, Any]) -> list[str]:
    """The problems of a stored mapping (``{"properties": ...}``) with the fields wowd writes:
    each field of :func:`events_mapping` must be there with its type, and an object wowd keeps
    unindexed (``enabled: false``) unindexed; empty when it fits."""
    problems: list[str] = []

    def walk(want: Mapping[str, Any], got: Mapping[str, Any], prefix: str) -> None:
        for name, spec in want.get("properties", {}).items():
            path = prefix + name
            field = (got.get("properties") or {}).get(name)
            kind = spec.get("type", "object")
            found = None if not isinstance(field, Mapping) else field.get("type", "object")
            if found != kind:
                problems.append(f"{path} is {found or 'missing'}, expected {kind}")
                continue
            assert isinstance(field, Mapping)
            if spec.get("enabled") is False and field.get("enabled") not in (False, "false"):
                problems.append(f"{path} is indexed, expected enabled false")
            if "properties" in spec:
                walk(spec, field, f"{path}.")

    walk(events_mapping(), mapping, "")
    return problems


def unbounded_keywords(mapping: Mapping[str, Any]) -> list[str]:
    """The free-form keyword fields of a stored mapping without ``ignore_above`` (an index made
    by an earlier layout): a value over 32,766 bytes fails its item there."""
    wanted = events_mapping()
    out: list[str] = []

    def walk(want: Mapping[str, Any], got: Mapping[str, Any], prefix: str) -> None:
        for name, spec in want.get("properties", {}).items():
            field = got.get("properties", {}).get(name)
            if not isinstance(field, Mapping):
                continue
            if "ignore_above" in spec and field.get("type") == "keyword" and "ignore_above" not in field:
                out.append(prefix + name)
            if "properties" in spec:
                walk(spec, field, f"{prefix}{name}.")

    walk(wanted, mapping, "")
    return out


def access_digest(access: Mapping[str, Any]) -> str:
    """A digest of access attributes (canonical JSON): equal attributes, equal digests."""
    text = json.dumps(access, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def event_document(commit: Commit, digest: str | None = None) -> dict[str, Any]:
    """The stream document of a commit (the log's fields; the partition is not the sink's);
    ``digest`` is its ``access_digest`` when the caller has it already."""
    return {
        **commit_fields(commit),
        "owner_id": commit.owner_id,
        "space_id": commit.space_id,
        "access": dict(commit.access),
        "access_version": commit.access_version,
        "access_digest": digest if digest is not None else access_digest(commit.access),
        "deleted": commit.deleted,
    }


def routing_of(aggregate_id: str) -> str:
    """The routing of an aggregate's documents: its id, :data:`EMPTY_ID_ROUTING` for an empty one."""
    return aggregate_id or EMPTY_ID_ROUTING


def _json_default(value: Any) -> Any:
    # what the client's own serializer accepts beyond JSON, the same way
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, date | datetime):
        return value.isoformat()
    raise TypeError(f"cannot store a {type(value).__name__} as JSON")


_OPTIONS = orjson.OPT_NON_STR_KEYS


def bulk_lines(record: Commit, digest: str) -> bytes:
    """The NDJSON lines of one record in a bulk: a ``create`` (id = stream id, routing =
    :func:`routing_of` the aggregate id) and the document. Raises :class:`InvalidInput` naming
    the record when its id is over :data:`MAX_ID_BYTES` or a value is not JSON."""
    return _record_lines(record, digest)[1]


def _record_lines(record: Commit, digest: str) -> tuple[str, bytes]:
    _id = stream_id(record.ref, record.version)
    if len(_id.encode()) > MAX_ID_BYTES:
        raise InvalidInput(
            f"the document id is {len(_id.encode())} bytes, Elasticsearch takes at most {MAX_ID_BYTES}",
            field="aggregate_id",
            ref=record.ref,
            version=record.version,
        )
    try:
        action = orjson.dumps({"create": {"_id": _id, "routing": routing_of(record.ref.id)}})
        doc = orjson.dumps(event_document(record, digest), default=_json_default)
    except (TypeError, ValueError) as exc:  # orjson.JSONEncodeError: a type JSON has not, a key not a string
        raise InvalidInput(f"cannot be written as JSON: {exc}", ref=record.ref, version=record.version) from exc
    return _id, b"%b\n%b\n" % (action, doc)


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkBody:
    """One ``_bulk`` request: its NDJSON, the records in it and their document ids, in order."""

    body: bytes
    records: Sequence[Commit]
    ids: Sequence[str]


def bulk_bodies(
    records: Sequence[Commit],
    digests: Sequence[str],
    *,
    bulk_bytes: int = BULK_BYTES,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
    max_document_events: int = MAX_DOCUMENT_EVENTS,
) -> list[BulkBody]:
    """The bulks of one write: every record's :func:`bulk_lines`, in order, in bodies of at most
    ``bulk_bytes`` (one body in the common case; a record longer than that alone). Raises
    :class:`InvalidInput` naming a record that cannot be sent, and the cap, before any is: more
    events than ``max_document_events`` (``field`` ``events``), lines over
    ``max_document_bytes`` or ``max_request_bytes``."""
    out: list[BulkBody] = []
    parts: list[bytes] = []
    ids: list[str] = []
    start = size = 0
    for i, (record, digest) in enumerate(zip(records, digests, strict=True)):
        if len(record.events) > max_document_events:
            raise InvalidInput(
                f"{len(record.events)} events, over the cap of {max_document_events} events a document "
                "(elasticsearch.max_document_events; the index's index.mapping.nested_objects.limit)",
                field="events",
                ref=record.ref,
                version=record.version,
            )
        _id, lines = _record_lines(record, digest)
        if len(lines) > max_request_bytes:
            raise InvalidInput(
                f"the document is {len(lines)} bytes, over the request limit of {max_request_bytes} "
                "(elasticsearch.max_request_bytes; the cluster's http.max_content_length)",
                ref=record.ref,
                version=record.version,
            )
        if len(lines) > max_document_bytes:
            raise InvalidInput(
                f"the document is {len(lines)} bytes, over the cap of {max_document_bytes} bytes a document "
                "(elasticsearch.max_document_bytes; indexing pressure refuses an operation over 10% of the heap)",
                ref=record.ref,
                version=record.version,
            )
        if parts and size + len(lines) > bulk_bytes:
            out.append(BulkBody(body=b"".join(parts), records=records[start:i], ids=ids))
            parts, ids, start, size = [], [], i, 0
        parts.append(lines)
        ids.append(_id)
        size += len(lines)
    if parts:
        out.append(BulkBody(body=b"".join(parts), records=records[start:], ids=ids))
    return out


def _routing(ids: Sequence[str]) -> str | None:
    """A request's ``routing`` for these aggregate ids; None (every shard) when one holds a comma,
    which the routing parameter would split, or when the encoded list is over
    :data:`MAX_ROUTING_CHARS` (the request line has a limit)."""
    unique = sorted({routing_of(i) for i in ids})
    if not unique or any("," in i for i in unique):
        return None
    routing = ",".join(unique)
    if len(quote(routing, safe=",")) > MAX_ROUTING_CHARS:
        return None
    return routing


def _stream_filter(ref: AggregateRef) -> list[dict[str, Any]]:
    return [{"term": {"tenant_id": ref.tenant_id}}, {"term": {"aggregate_id": ref.id}}]


def previous_docs(records: Sequence[Commit]) -> list[dict[str, Any]]:
    """The ``_mget`` docs of the document just before each record (version - 1, with routing)."""
    source = ["access_digest", "access", "access_version"]
    return [
        {"_id": stream_id(c.ref, c.version - 1), "routing": routing_of(c.ref.id), "_source": source} for c in records
    ]


def latest_search(ref: AggregateRef, before: int) -> dict[str, Any]:
    """The search of the stream's latest document below version ``before`` (its attributes)."""
    return {
        "query": {"bool": {"filter": [*_stream_filter(ref), {"range": {"version": {"lt": before}}}]}},
        "sort": [{"version": {"order": "desc"}}],
        "size": 1,
        "_source": ["version", "access", "access_version", "access_digest"],
    }


def documents_search(ref: AggregateRef, after: int | None, size: int = _DOCUMENTS_PAGE) -> dict[str, Any]:
    """One page of a stream's documents by version (``search_after`` the last version read)."""
    body: dict[str, Any] = {
        "query": {"bool": {"filter": _stream_filter(ref)}},
        "sort": [{"version": {"order": "asc"}}],
        "size": size,
    }
    if after is not None:
        body["search_after"] = [after]
    return body


STAMP_SCRIPT = (
    "def byTenant = params.stamps[ctx._source.tenant_id];"
    " def s = byTenant == null ? null : byTenant[ctx._source.aggregate_id];"
    " def v = ctx._source.version;"
    " def av = ctx._source.access_version;"
    " if (s == null || v == null || v < s.from_version || v > s.until_version"
    " || !(av == null || av < s.as_of || (av == s.as_of && ctx._source.access_digest != s.digest))) {"
    " ctx.op = 'noop';"
    " } else {"
    " ctx._source.access = s.access;"
    " ctx._source.owner_id = s.owner_id;"
    " ctx._source.space_id = s.space_id;"
    " ctx._source.access_version = s.as_of;"
    " ctx._source.access_digest = s.digest;"
    " }"
)
"""The painless side of the stamp guard: each document finds its own stamp by tenant and
aggregate id, and is written only inside the stamp's versions when its ``access_version`` is
absent, below the stamp's, or the stamp's with other attributes; otherwise ``noop``."""


def stamp_clause(stamp: AccessStamp) -> dict[str, Any]:
    """The query side of one stamp's guard: the stream's documents of versions
    ``[from_, until]`` with no ``access_version``, one below ``as_of``, or ``as_of`` with other
    attributes."""
    return {
        "bool": {
            "filter": [
                *_stream_filter(stamp.ref),
                {"range": {"version": {"gte": stamp.from_, "lte": stamp.until}}},
                {
                    "bool": {
                        "should": [
                            {"bool": {"must_not": [{"exists": {"field": "access_version"}}]}},
                            {"range": {"access_version": {"lt": stamp.as_of}}},
                            {
                                "bool": {
                                    "filter": [{"term": {"access_version": stamp.as_of}}],
                                    "must_not": [{"term": {"access_digest": access_digest(stamp.access)}}],
                                }
                            },
                        ],
                        "minimum_should_match": 1,
                    }
                },
            ]
        }
    }


def stamp_query(stamps: Sequence[AccessStamp]) -> dict[str, Any]:
    """The query of one ``_update_by_query``: one stamp's clause, or the OR of several."""
    if len(stamps) == 1:
        return stamp_clause(stamps[0])
    return {"bool": {"should": [stamp_clause(s) for s in stamps], "minimum_should_match": 1}}


def stamp_script(stamps: Sequence[AccessStamp]) -> dict[str, Any]:
    """The script of one ``_update_by_query``: :data:`STAMP_SCRIPT` with its params, the stamps
    keyed by tenant id, then aggregate id (at most one stamp per aggregate: see
    :func:`stamp_rounds`)."""
    by_tenant: dict[str, dict[str, Any]] = {}
    for s in stamps:
        by_tenant.setdefault(s.ref.tenant_id, {})[s.ref.id] = {
            "access": dict(s.access),
            "owner_id": str(s.access.get("owner_id", "")),
            "space_id": str(s.access.get("space_id", "")),
            "as_of": s.as_of,
            "from_version": s.from_,
            "until_version": s.until,
            "digest": access_digest(s.access),
        }
    return {"lang": "painless", "source": STAMP_SCRIPT, "params": {"stamps": by_tenant}}


def _stamp_key(stamp: AccessStamp) -> tuple[Any, ...]:
    return (stamp.ref, access_digest(stamp.access), stamp.as_of, stamp.from_, stamp.until)


def stamp_rounds(stamps: Sequence[AccessStamp]) -> list[list[AccessStamp]]:
    """Splits stamps into rounds holding at most one stamp per aggregate, in order (identical
    stamps once, empty ranges dropped): stamps of one aggregate with different attributes or
    versions are written one at a time."""
    rounds: list[list[AccessStamp]] = []
    seen_count: dict[tuple[str, str], int] = {}
    seen: set[tuple[Any, ...]] = set()
    for s in stamps:
        key = _stamp_key(s)
        if s.from_ > s.until or key in seen:
            continue
        seen.add(key)
        agg = (s.ref.tenant_id, s.ref.id)
        k = seen_count.get(agg, 0)
        seen_count[agg] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(s)
    return rounds


def _version(record: Commit) -> int:
    return record.version


@dataclass(slots=True, kw_only=True)
class _Waiting:
    """The stamps of one write waiting for a refresh (see ``_stamp_after_refresh``)."""

    stamps: list[AccessStamp]
    since: float
    done: anyio.Event
    taken: bool = False
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """A stored document of a stream, as a look-up before a write reads it: the digest of its
    attributes, the version they are of, and its own version."""

    digest: str
    access_version: int | None
    version: int

    def stamp_begun(self, record: Commit) -> bool:
        """Whether ``record``'s own stamp rewrote this earlier document already: its attributes
        are of ``record``'s access version, later than the document itself. A stamp that failed
        halfway (``_update_by_query`` keeps what it updated) is finished by stamping again."""
        return self.access_version == record.access_version and self.access_version > self.version


@dataclass(frozen=True, slots=True, kw_only=True)
class _Known:
    """What the sink knows of a stream: its latest version written and its attributes."""

    version: int
    digest: str


def supported_version(number: str, distribution: str) -> str:
    """``"Elasticsearch <number> (supported: 9.x)"`` for an Elasticsearch 9.x cluster; a
    :class:`StorageError` naming the version and the supported ones otherwise."""
    major = number.split(".", 1)[0]
    if distribution != "elasticsearch":
        raise StorageError(f"the cluster is {distribution} {number}: wowd supports Elasticsearch {SUPPORTED}")
    if major != SUPPORTED.split(".", 1)[0]:
        why = (
            "its client sends compatible-with=9, which an 8.x server refuses (media_type_header_exception)"
            if major.isdigit() and int(major) < 9
            else "a later major version is untested"
        )
        raise StorageError(f"Elasticsearch {number}: wowd supports Elasticsearch {SUPPORTED} ({why})")
    return f"Elasticsearch {number} (supported: {SUPPORTED})"
