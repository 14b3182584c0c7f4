"""The event sink of one aggregate type on Elasticsearch 9 (DESIGN.md section 7).

One index per aggregate type, ``wow.<context>.<aggregate>.events``; one document per commit,
its id the commit's stream id (:func:`wowd.model.stream_id`), routed by aggregate id (an empty
aggregate id by :data:`EMPTY_ID_ROUTING`: Elasticsearch reads an empty routing as none).

- ``write`` sends the records as ``create``s in one ``_bulk`` (NDJSON built as bytes with
  orjson), split into bulks of about :data:`BULK_BYTES` when larger. A record that cannot be sent
  (its id over :data:`MAX_ID_BYTES`, its lines over the request cap, a value JSON cannot hold) is
  refused before anything is sent with :class:`InvalidInput` naming it. A ``409`` item is a
  document written before (a retry, a replay, an old owner of the partition): it counts as
  written. Any other failed item fails the write: :class:`StoreRefused` when the store refuses
  for a reason of its own (:func:`refusal`: credentials, a privilege, a block, a closed or
  missing index, a 5xx; the feed stalls), else :class:`StorageUnavailable` when every failure is
  transient (429, 502, 503, 504), else :class:`SinkWriteError` naming the item (what the record
  causes, :data:`RECORD_ERRORS`: the feed sets it aside). The items written stay. A failed
  request is classified the same way, by its status and error type (a proxy's HTML page by its
  status); connection failures and timeouts are transient. The bulk answer is asked for with
  ``filter_path`` (each item's id, status and error), and each item is checked to be the
  ``create`` of the id sent in its place.
- A missing index: an item answered ``index_not_found_exception`` (``action.auto_create_index``
  refuses events indices) makes the write transient under ``ddl auto`` (the next write creates
  the index again) and a :class:`FormatError` otherwise. When the sink saw the index missing and
  a bulk then succeeded, or a bulk made the first document of a shard (``_seq_no`` 0: a new
  index, made by a write where the sink did not make it), the mapping is checked; a layout the
  sink cannot work with refuses that write and every later one (:class:`StoreRefused`, naming
  the index) until the mapping fits. Under ``ddl auto`` the index template
  :data:`TEMPLATE_NAME` gives an index a write creates wowd's mapping.
- Access stamps: after a write, the last record of each aggregate whose access attributes
  differ from the stream's before it (the previous record of the write, else an LRU of the last
  record written per aggregate when it is the version just before, else the stored
  ``access_digest`` of the document of the version just before, read by a realtime ``_mget``
  with routing, else of the stream's latest document below it, by a search after a refresh)
  stamps its attributes over the aggregate's earlier documents, after a refresh of the index
  shared with the other writes waiting for one (at most one ``_refresh`` per
  ``refresh_interval_s``), in one ``stamp_all`` with their stamps. The LRU is updated only once
  the stamps succeeded, so the retry of a failed write stamps again.
- ``stamp``/``stamp_all`` are ``_update_by_query`` requests guarded twice, in the query and in
  the painless script: a document is written when it has no ``access_version``, one below the
  stamp's, or the same one with other attributes (compared by ``access_digest``, a digest of the
  attributes kept beside them). Version conflicts are passed over (``conflicts: proceed``:
  counted in ``version_conflicts``, not failures) and searched again after a refresh. An
  answer holding failures comes with the highest failure's status (408 when it timed out), so
  it is read from the client's error and classified per failure. A page holds at most
  :data:`STAMP_PAGE` stamps, so that the query stays under Lucene's clause limit counted as
  Lucene counts (:data:`STAMP_CLAUSE_LEAVES`), and is routed only while the routing keeps the request
  line short (:data:`MAX_ROUTING_CHARS`). Each request has its own client timeout
  (``stamp_timeout_s``).

The client given is used with ``retry_on_status=()`` and ``retry_on_timeout=False``: a 429 or
a 503 is the feed's to retry with backoff, not the client's at once, and a timed-out bulk or
update-by-query may still be running on the cluster.

The request bodies are built by the pure functions below, next to the method that sends them,
so the black-pipe tests in ``tests/elasticsearch`` assert them. Client errors stop here: an
``elasticsearch``/``elastic_transport`` exception becomes a :mod:`wowd.errors` one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any, cast
from urllib.parse import quote

import anyio
import orjson
from elastic_transport import ConnectionError as TransportConnectionError
from elastic_transport import ConnectionTimeout, SerializationError, Serializer, TlsError, TransportError
from elasticsearch import ApiError, AsyncElasticsearch

from wowd.errors import (
    ConfigError,
    FormatError,
    InvalidInput,
    SinkWriteError,
    StorageError,
    StorageUnavailable,
    StoreRefused,
)
from wowd.metrics import SINK_BULK_SECONDS, SINK_ITEMS, STORE_UNAVAILABLE
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit, commit_fields, stream_id
from wowd.stores.base import Ddl

__all__ = [
    "BULK_BYTES",
    "BULK_FILTER_PATH",
    "EMPTY_ID_ROUTING",
    "KEYWORD_IGNORE_ABOVE",
    "MAX_CONFLICT_ROUNDS",
    "MAX_DOCUMENT_BYTES",
    "MAX_DOCUMENT_EVENTS",
    "MAX_ID_BYTES",
    "MAX_QUERY_LEAVES",
    "MAX_REQUEST_BYTES",
    "MAX_ROUTING_CHARS",
    "RECORD_ERRORS",
    "REFRESH_INTERVAL_S",
    "STAMP_CLAUSE_LEAVES",
    "STAMP_PAGE",
    "STAMP_SCRIPT",
    "SUPPORTED",
    "TEMPLATE_NAME",
    "TRANSIENT_STATUSES",
    "ElasticsearchEventSink",
    "access_digest",
    "bulk_bodies",
    "bulk_lines",
    "check_mapping",
    "documents_search",
    "event_document",
    "events_mapping",
    "index_name",
    "index_template",
    "latest_search",
    "previous_docs",
    "refusal",
    "routing_of",
    "stamp_clause",
    "stamp_query",
    "stamp_rounds",
    "stamp_script",
    "unbounded_keywords",
]

log = logging.getLogger(__name__)

TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
"""Item (and request) statuses a retry can fix."""

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

MAX_DOCUMENT_BYTES = 10 * 1024 * 1024
"""The largest document the sink sends (its bulk lines). Elasticsearch's indexing pressure
(``indexing_pressure.memory.limit``, 10 % of the heap) refuses an operation larger than the
limit with a 429 that a retry repeats for ever; 10 MB stays under it from a 128 MB heap up, and a
document fits a bulk of :data:`BULK_BYTES`."""

MAX_DOCUMENT_EVENTS = 10_000
"""The most events a document holds: each event is a nested document, and
``index.mapping.nested_objects.limit`` (10,000 by default) fails a document with more (400)."""

KEYWORD_IGNORE_ABOVE = 8191
"""``ignore_above`` of the free-form keywords: Lucene refuses a term over 32,766 bytes (an
"immense term" fails the item) and ``ignore_above`` counts characters, up to 4 bytes each."""

EMPTY_ID_ROUTING = "-"
"""The routing of an empty aggregate id (Elasticsearch reads an empty routing as none, refused
where routing is required). It only picks a shard: searches filter by aggregate id."""

BULK_FILTER_PATH = "items.*._id,items.*.status,items.*._seq_no,items.*.error.type,items.*.error.reason"
"""What a bulk answer is asked to hold: per item its operation, id, status, sequence number and
error. A sequence number 0 is the first operation of a shard: the index (or that shard) was just
made, by wowd or by a write that auto-created it, and its mapping is checked."""

TEMPLATE_NAME = "wowd-events"
"""The composable index template wowd installs under ``ddl auto``: an events index created by a
write (Elasticsearch's ``action.auto_create_index``, an index deleted at run time) gets wowd's
mapping, not a dynamic one."""

TEMPLATE_PATTERNS = ("wow.*.events",)
TEMPLATE_PRIORITY = 200
"""Above the built-in templates (priority 100 and below); two templates matching one name at the
same priority are refused."""

_DOCUMENTS_PAGE = 1000
_STORE = "elasticsearch"
_DIGEST_CACHE = 4096


# --------------------------------------------------------------------------- names and mapping


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


_KEY_FIELDS: dict[str, str] = {
    "tenant_id": "keyword",
    "aggregate_id": "keyword",
    "version": "long",
    "create_time": "date",
    "events": "nested",
    "owner_id": "keyword",
    "space_id": "keyword",
    "access_version": "long",
    "access_digest": "keyword",
}


def index_template() -> dict[str, Any]:
    """The body of the ``PUT _index_template/wowd-events`` request (:data:`TEMPLATE_NAME`)."""
    return {
        "index_patterns": list(TEMPLATE_PATTERNS),
        "priority": TEMPLATE_PRIORITY,
        "template": {"mappings": events_mapping()},
        "_meta": {"managed_by": "wowd", "description": "the events indexes of wowd's event sink"},
    }


def check_mapping(mapping: Mapping[str, Any]) -> list[str]:
    """The problems of a stored mapping (``{"properties": ...}``) with the key fields the sink's
    writes, stamps and searches rely on; empty when it fits."""
    props = mapping.get("properties") or {}
    problems: list[str] = []
    for name, kind in _KEY_FIELDS.items():
        field = props.get(name)
        got = None if not isinstance(field, Mapping) else field.get("type", "object")
        if got != kind:
            problems.append(f"{name} is {got or 'missing'}, expected {kind}")
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


# --------------------------------------------------------------------------- documents


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
    source = ["access_digest", "access"]
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


# --------------------------------------------------------------------------- stamps

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


# --------------------------------------------------------------------------- errors


def _api_reason(exc: ApiError) -> str:
    body = exc.body
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            reason = f"{err.get('type', 'error')}: {err.get('reason', '')}"
            cause = err.get("caused_by")
            if isinstance(cause, Mapping):
                reason += f" (caused by {cause.get('type', 'error')}: {cause.get('reason', '')})"
            return reason
        if err is not None:
            return str(err)
    if isinstance(body, str | bytes) and body:
        text = body if isinstance(body, str) else body.decode("utf-8", "replace")
        return " ".join(text.split())[:200]
    return "(no body)" if body in (None, "", b"") else str(exc.message)


def _api_error(exc: ApiError) -> tuple[str, str]:
    """The error type and reason of an error answer (``("error", text)`` for another body)."""
    body = exc.body
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        err = body["error"]
        return str(err.get("type", "error")), str(err.get("reason", ""))
    return "error", _api_reason(exc)


def _is_transient(status: int) -> bool:
    """Seed 002: 429, 502, 503 and 504 are transient; any other status is not (a 500 is a
    defect or a refused request that a retry repeats)."""
    return status in TRANSIENT_STATUSES


RECORD_ERRORS = frozenset(
    {
        "document_parsing_exception",
        "mapper_parsing_exception",
        "strict_dynamic_mapping_exception",
        "illegal_argument_exception",
        "x_content_parse_exception",
        "routing_missing_exception",
        "version_conflict_engine_exception",
    }
)
"""Item errors the record causes (the document cannot be written into this index as it is):
its commit is set aside. Any other non-transient failure is the store's (:func:`refusal`)."""

_STORE_400 = frozenset({"index_closed_exception", "media_type_header_exception", "cluster_block_exception"})


def refusal(index: str, status: int, kind: str, reason: str) -> str | None:
    """What a non-transient failure says when the store refuses the write for a reason of its
    own (credentials, privileges, a block, a closed or missing index, a server error): a message
    naming the cause; None when the failure is not a refusal (the request or the record is)."""
    if status in TRANSIENT_STATUSES:
        return None
    detail = f"[{status}] {kind}: {reason}"
    if status == 401:
        return f"elasticsearch refuses wowd's credentials (an expired or revoked API key, a wrong password): {detail}"
    if kind == "cluster_block_exception":
        # the block's description in IndexMetadata (APIBlock): "index write (api)",
        # "index read-only (api)", "index metadata (api)"; the reason names it
        for needle, setting in (
            ("index write", "index.blocks.write"),
            ("index read-only (api)", "index.blocks.read_only"),
            ("read-only / allow delete", "index.blocks.read_only_allow_delete"),
        ):
            if needle in reason:
                return f"index {index} is write-blocked ({setting}): {detail}"
        return f"elasticsearch blocks writes to {index}: {detail}"
    if kind == "index_closed_exception":
        return f"index {index} is closed: {detail}"
    if kind == "index_not_found_exception":
        return f"index {index} does not exist: {detail}"
    if kind == "media_type_header_exception":
        return f"the cluster does not take the Elasticsearch 9 client's requests (an older server?): {detail}"
    if status == 403:
        return f"wowd's Elasticsearch user lacks a privilege on {index}: {detail}"
    if status >= 500:
        return f"elasticsearch fails the request on {index}: {detail}"
    if status == 400 and kind in _STORE_400:
        return f"elasticsearch refuses the request on {index}: {detail}"
    return None


def _is_update_by_query_answer(body: object) -> bool:
    """An ``_update_by_query`` answer (as opposed to an ``{"error": ...}`` body): Elasticsearch
    sends it with a non-2xx status when it holds failures (the highest failure's status) or
    timed out (408)."""
    return isinstance(body, Mapping) and "error" not in body and ("failures" in body or "timed_out" in body)


class _TextOnFailure(Serializer):
    """A JSON deserializer that hands back the text of a body that is not JSON (a proxy's error
    page sent as JSON), so that the answer keeps its status and is classified by it."""

    def __init__(self, inner: Serializer) -> None:
        self.inner = inner
        self.mimetype = inner.mimetype  # type: ignore[misc]

    def loads(self, data: bytes) -> Any:
        try:
            return self.inner.loads(data)
        except SerializationError:
            return bytes(data).decode("utf-8", "replace")

    def dumps(self, data: Any) -> bytes:
        return self.inner.dumps(data)


def _tolerate_non_json(client: AsyncElasticsearch) -> None:
    collection = client.transport.serializers
    for mimetype, serializer in list(collection.serializers.items()):
        if "json" in mimetype and not isinstance(serializer, _TextOnFailure):
            collection.serializers[mimetype] = _TextOnFailure(serializer)
    if not isinstance(collection.default_serializer, _TextOnFailure):
        collection.default_serializer = _TextOnFailure(collection.default_serializer)


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
class _Known:
    """What the sink knows of a stream: its latest version written and its attributes."""

    version: int
    digest: str


# --------------------------------------------------------------------------- the sink


class ElasticsearchEventSink:
    """The event sink of one aggregate type (:class:`wowd.stores.base.EventSink`).

    ``client`` is an ``AsyncElasticsearch`` the caller owns (closed by :meth:`close` only with
    ``owns_client``); the sink uses it without retries on status or timeout, and has its
    transport hand back a body that is not JSON as text (:class:`_TextOnFailure`, for every user
    of that client: such a body is an error either way). ``refresh`` makes
    every write and stamp refresh the index (tests). ``capacity`` is how many aggregates the
    access-attribute LRU remembers. ``bulk_bytes`` is the size a write is split at,
    ``max_request_bytes`` the cluster's ``http.max_content_length``. ``stamp_timeout_s`` is the
    client timeout of one ``_update_by_query``; ``refresh_interval_s`` how often at most the sink
    sends a ``_refresh`` (the writes needing one share it, and their stamps go in one request).
    """

    def __init__(
        self,
        client: AsyncElasticsearch,
        type: AggregateType,
        *,
        ddl: Ddl | str = Ddl.AUTO,
        refresh: bool = False,
        capacity: int = 10_000,
        bulk_bytes: int = BULK_BYTES,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_document_bytes: int = MAX_DOCUMENT_BYTES,
        max_document_events: int = MAX_DOCUMENT_EVENTS,
        stamp_timeout_s: float = 300.0,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        owns_client: bool = False,
    ) -> None:
        if capacity < 0:
            raise ConfigError(f"sink capacity: must be >= 0, got {capacity}")
        if not 0 < bulk_bytes <= max_request_bytes:
            raise ConfigError(f"sink bulk_bytes: must be in (0, {max_request_bytes}], got {bulk_bytes}")
        self.type = type
        self.index = index_name(type)
        self._own = client
        _tolerate_non_json(client)
        self._client = client.options(retry_on_status=(), retry_on_timeout=False)
        self._ddl = Ddl(ddl)
        self._refresh = refresh
        self._capacity = capacity
        self._bulk_bytes = bulk_bytes
        self._max_request_bytes = max_request_bytes
        self._max_document_bytes = max_document_bytes
        self._max_document_events = max_document_events
        self._stamp_timeout_s = stamp_timeout_s
        self._owns_client = owns_client
        self._known: OrderedDict[tuple[str, str], _Known] = OrderedDict()
        self._digests: dict[bytes, str] = {}
        self._index_missing = False
        self._refresh_interval_s = refresh_interval_s
        self._refresh_started = float("-inf")
        self._refreshed_as_of = float("-inf")
        """When the last completed refresh started (what it made searchable was written by then)."""
        self._refresh_running: anyio.Event | None = None
        self._waiting: list[_Waiting] = []
        self.refreshes = 0
        """``_refresh`` requests sent (the bench counts them)."""
        self._made = False
        """The sink made the index just now: the first documents of its shards are expected."""
        self._mapping_problem: str | None = None
        """Why the index's mapping is not wowd's (found after a write made a new shard): every
        write is refused (:class:`StoreRefused`) until the mapping is checked again and fits."""
        self._prepared = False
        self._prepare_lock: anyio.Lock | None = None

    def __str__(self) -> str:
        hosts = ", ".join(node.base_url for node in self._client.transport.node_pool.all())
        return f"ElasticsearchEventSink(index {self.index} on {hosts or 'no hosts'})"

    __repr__ = __str__

    # ------------------------------------------------------------------ errors

    @contextmanager
    def _translate(self, op: str) -> Iterator[None]:
        """Client exceptions become wowd's: transient ones :class:`StorageUnavailable`."""
        try:
            yield
        except ApiError as exc:
            status = exc.meta.status
            msg = f"elasticsearch {op} on {self.index}: [{status}] {_api_reason(exc)}"
            if _is_transient(status):
                STORE_UNAVAILABLE.labels(store=_STORE, operation=op).inc()
                raise StorageUnavailable(msg) from exc
            kind, reason = _api_error(exc)
            refused = refusal(self.index, status, kind, reason)
            if refused is not None:
                STORE_UNAVAILABLE.labels(store=_STORE, operation=op).inc()
                raise StoreRefused(f"elasticsearch {op}: {refused}") from exc
            raise StorageError(msg) from exc
        except TlsError as exc:
            raise StorageError(f"elasticsearch {op} on {self.index}: {exc}") from exc
        except (TransportConnectionError, ConnectionTimeout) as exc:
            STORE_UNAVAILABLE.labels(store=_STORE, operation=op).inc()
            raise StorageUnavailable(f"elasticsearch {op} on {self.index}: {exc}") from exc
        except SerializationError as exc:
            raise StorageError(f"elasticsearch {op} on {self.index}: bad answer: {exc}") from exc
        except TransportError as exc:
            STORE_UNAVAILABLE.labels(store=_STORE, operation=op).inc()
            raise StorageUnavailable(f"elasticsearch {op} on {self.index}: {exc}") from exc

    def _answer(self, op: str, body: object) -> Mapping[str, Any]:
        """A 2xx answer's body, which must be a JSON object."""
        if not isinstance(body, Mapping):
            raise StorageError(f"elasticsearch {op} on {self.index}: bad answer: {str(body)[:200]!r}")
        return body

    # ------------------------------------------------------------------ DDL

    async def prepare(self) -> None:
        """Makes sure of the events index, once, as the DDL mode says: ``auto`` creates it with
        :func:`events_mapping` (an existing one is checked instead) and waits for its primary,
        ``validate`` requires it and checks its key fields (:class:`FormatError`), ``none``
        creates nothing and checks the mapping of an index that is there (one that is not is
        checked after the first write that creates it)."""
        if self._prepared:
            return
        if self._prepare_lock is None:
            self._prepare_lock = anyio.Lock()
        async with self._prepare_lock:
            if self._prepared:
                return
            if self._ddl is Ddl.AUTO:
                await self._put_template()
                if not await self._create_index():
                    await self._validate_mapping()
                await self._wait_for_primary()
            elif self._ddl is Ddl.VALIDATE:
                await self._validate_mapping()
                await self._wait_for_primary()
            elif not await self._validate_mapping(missing_ok=True):
                self._index_missing = True
                log.warning(
                    "the events index %s does not exist (ddl none): a write would create it with a dynamic mapping "
                    "unless action.auto_create_index refuses it",
                    self.index,
                )
            self._prepared = True

    async def _put_template(self) -> None:
        """Installs (or replaces) the index template :data:`TEMPLATE_NAME`."""
        body = index_template()
        with self._translate("put_index_template"):
            await self._client.indices.put_index_template(
                name=TEMPLATE_NAME,
                index_patterns=body["index_patterns"],
                priority=body["priority"],
                template=body["template"],
                meta=body["_meta"],
            )

    async def _create_index(self) -> bool:
        """Creates the index; False when it exists already."""
        try:
            with self._translate("create_index"):
                await self._client.indices.create(index=self.index, mappings=events_mapping())
        except StorageError as exc:
            cause = exc.__cause__
            if (
                isinstance(cause, ApiError)
                and cause.meta.status == 400
                and "resource_already_exists" in str(_api_reason(cause))
            ):
                return False
            raise
        log.info("created the events index %s", self.index)
        self._index_missing = False
        self._made = True
        return True

    async def _validate_mapping(self, *, missing_ok: bool = False) -> bool:
        """Checks the stored mapping's key fields (:class:`FormatError`); False when the index
        is missing and ``missing_ok``."""
        try:
            with self._translate("get_mapping"):
                resp = await self._client.indices.get_mapping(index=self.index)
        except StorageError as exc:
            cause = exc.__cause__
            if isinstance(cause, ApiError) and cause.meta.status == 404:
                if missing_ok:
                    return False
                raise FormatError(f"the events index {self.index} does not exist (ddl {self._ddl})") from exc
            raise
        body = self._answer("get_mapping", resp.body)
        if len(body) != 1:
            raise FormatError(f"the events index {self.index}: unexpected mapping answer {body!r}")
        mappings = next(iter(body.values())).get("mappings") or {}
        problems = check_mapping(mappings)
        if problems:
            raise FormatError(
                f"the events index {self.index} has another layout (created by a write with a dynamic mapping?): "
                + "; ".join(problems)
            )
        unbounded = unbounded_keywords(mappings)
        if unbounded:
            log.warning(
                "the events index %s has keywords without ignore_above (%s): a value over 32766 bytes fails its "
                "record; add ignore_above %d with the update mapping API",
                self.index,
                ", ".join(unbounded),
                KEYWORD_IGNORE_ABOVE,
            )
        self._index_missing = False
        return True

    async def _wait_for_primary(self) -> None:
        with self._translate("cluster_health"):
            resp = await self._client.options(ignore_status=408, request_timeout=45).cluster.health(
                index=self.index, wait_for_status="yellow", timeout="30s"
            )
        body = self._answer("cluster_health", resp.body)
        if body.get("timed_out") or body.get("status") not in ("yellow", "green"):
            STORE_UNAVAILABLE.labels(store=_STORE, operation="cluster_health").inc()
            raise StorageUnavailable(
                f"elasticsearch: the primary of {self.index} is not active (health {body.get('status')})"
            )

    # ------------------------------------------------------------------ write

    def _digest(self, access: Mapping[str, Any]) -> str:
        """:func:`access_digest`, remembered by the attributes' sorted JSON (most records share
        a few attribute sets)."""
        key = orjson.dumps(access, option=orjson.OPT_SORT_KEYS | _OPTIONS, default=str)
        if b"null" in key:  # orjson writes NaN as null too: not a key then
            return access_digest(access)
        digest = self._digests.get(key)
        if digest is None:
            if len(self._digests) >= _DIGEST_CACHE:
                self._digests.clear()
            digest = self._digests[key] = access_digest(access)
        return digest

    async def write(self, records: Sequence[Commit]) -> None:
        """The bulks of the records; then the access stamps of the aggregates whose attributes
        changed (see the module's docstring). Raises :class:`InvalidInput` naming a record that
        cannot be sent (nothing is sent then), :class:`StorageUnavailable` (transient) or
        :class:`SinkWriteError` naming the item; the items written stay."""
        if not records:
            return
        await self.prepare()
        if self._mapping_problem is not None:
            await self._recheck_mapping()
        try:
            digests = [self._digest(c.access) for c in records]
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"access attributes cannot be digested: {exc}", field="access") from exc
        digest_of = {id(c): d for c, d in zip(records, digests, strict=True)}
        bodies = bulk_bodies(
            records,
            digests,
            bulk_bytes=self._bulk_bytes,
            max_request_bytes=self._max_request_bytes,
            max_document_bytes=self._max_document_bytes,
            max_document_events=self._max_document_events,
        )
        new_shard = False
        for body in bodies:
            new_shard = await self._bulk(body) or new_shard
        if self._index_missing or (new_shard and not self._made):
            await self._check_created()
        self._made = False
        written = anyio.current_time()  # what a look-up or a stamp must see is written by now
        groups: dict[tuple[str, str], list[Commit]] = {}
        for c in records:
            key = (c.ref.tenant_id, c.ref.id)
            group = groups.get(key)
            if group is None:
                groups[key] = [c]
            else:
                group.append(c)
        stamps: list[AccessStamp] = []
        unknown: list[Commit] = []
        for key, group in groups.items():
            if len(group) > 1:
                group.sort(key=_version)
                last_change = next(
                    (
                        group[i]
                        for i in range(len(group) - 1, 0, -1)
                        if digest_of[id(group[i])] != digest_of[id(group[i - 1])]
                    ),
                    None,
                )
                if last_change is not None:
                    stamps.append(self._stamp_of(last_change))
                    continue
            first = group[0]
            known = self._known.get(key)
            if known is not None and known.version == first.version - 1:
                self._known.move_to_end(key)
                if known.digest != digest_of[id(first)]:
                    stamps.append(self._stamp_of(first))
            elif first.version > 1:
                unknown.append(first)
        if unknown:
            before = await self._previous_digests(unknown)
            missed = [c for c, d in zip(unknown, before, strict=True) if d is None]
            if missed:
                if not self._refresh:
                    await self._refresh_index(written)
                found = iter(await self._latest_digests(missed))
                before = [d if d is not None else next(found) for d in before]
            for first, digest in zip(unknown, before, strict=True):
                if digest is not None and digest != digest_of[id(first)]:
                    stamps.append(self._stamp_of(first))
        if stamps:
            await self._stamp_after_refresh(stamps, written)
        for key, group in groups.items():
            last = group[-1]
            known = self._known.get(key)
            if known is None or known.version < last.version:
                self._remember(key, _Known(version=last.version, digest=digest_of[id(last)]))

    @staticmethod
    def _stamp_of(record: Commit) -> AccessStamp:
        return AccessStamp(
            ref=record.ref, access=record.access, as_of=record.access_version, from_=1, until=record.version - 1
        )

    def _remember(self, key: tuple[str, str], known: _Known) -> None:
        if self._capacity == 0:
            return
        self._known[key] = known
        self._known.move_to_end(key)
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)

    async def _check_created(self) -> None:
        """A write made a shard's first document (or went through where the index was missing):
        the index is new, made by wowd or by the write (Elasticsearch's auto-creation, an index
        deleted at run time); its mapping must be one the sink can work with, else every write
        is refused (:class:`StoreRefused`) until it is."""
        try:
            await self._validate_mapping()
        except FormatError as exc:
            self._mapping_problem = str(exc)
            log.error("%s: writes stall until the index has wowd's mapping", exc)
            STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
            raise StoreRefused(f"{exc}; writes stall until the index has wowd's mapping") from exc

    async def _recheck_mapping(self) -> None:
        """Before a write while the mapping was found wrong: checks it again (the operator may
        have deleted or reindexed the index; under ``ddl auto`` a missing index is made again)."""
        try:
            exists = await self._validate_mapping(missing_ok=True)
        except FormatError as exc:
            STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
            raise StoreRefused(f"{exc}; writes stall until the index has wowd's mapping") from exc
        if not exists:
            self._mapping_problem = None
            if self._ddl is Ddl.AUTO:
                self._prepared = False
                await self.prepare()
            return
        self._mapping_problem = None

    async def _bulk(self, bulk: BulkBody) -> bool:
        """Sends one bulk; True when an item was the first document of a shard (``_seq_no``
        0: a new index or shard)."""
        records = bulk.records
        extra: dict[str, Any] = {"refresh": True} if self._refresh else {}
        started = time.perf_counter()
        try:
            with self._translate("bulk"):
                resp = await self._client.bulk(
                    operations=cast("Sequence[Mapping[str, Any]]", bulk.body),
                    index=self.index,
                    filter_path=BULK_FILTER_PATH,
                    **extra,
                )
        except StorageUnavailable:
            raise
        except StorageError as exc:
            first = bulk.ids[0]
            cause = exc.__cause__
            if isinstance(cause, ApiError) and cause.meta.status == 413 and len(records) > 1:
                # bulks are cut under max_request_bytes: the cluster's limit is lower
                STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
                raise StoreRefused(
                    f"elasticsearch refuses a bulk of {len(bulk.body)} bytes into {self.index} (413): its "
                    f"http.max_content_length is below the configured max_request_bytes {self._max_request_bytes}"
                ) from cause
            raise SinkWriteError(f"{exc} (bulk of {len(records)} items, the first {first})") from cause
        finally:
            SINK_BULK_SECONDS.observe(time.perf_counter() - started)
        items = self._answer("bulk", resp.body).get("items")
        if not isinstance(items, list) or len(items) != len(records):
            raise StorageError(
                f"elasticsearch bulk on {self.index}: {len(records)} creates answered with "
                f"{len(items) if isinstance(items, list) else 'no'} items"
            )
        failed: list[tuple[str, int, str]] = []
        new_shard = False
        refused: str | None = None
        missing_index = False
        statuses: Counter[int] = Counter()
        for _id, item in zip(bulk.ids, items, strict=True):
            result = item.get("create") if isinstance(item, Mapping) and len(item) == 1 else None
            if not isinstance(result, Mapping) or result.get("_id") != _id:
                raise StorageError(
                    f"elasticsearch bulk on {self.index}: the create of {_id} answered with {str(item)[:200]}"
                )
            status = int(result.get("status", 0))
            statuses[status] += 1
            if status in (200, 201, 409):
                new_shard = new_shard or (status == 201 and result.get("_seq_no") == 0)
                continue
            err = result.get("error")
            kind = err.get("type", "error") if isinstance(err, Mapping) else "error"
            reason = f"{kind}: {err.get('reason', '')}" if isinstance(err, Mapping) else str(err)
            missing_index = missing_index or (status == 404 and kind == "index_not_found_exception")
            if refused is None and not missing_index and kind not in RECORD_ERRORS:
                refused = refusal(self.index, status, kind, err.get("reason", "") if isinstance(err, Mapping) else "")
            failed.append((_id, status, reason))
        for code, n in statuses.items():
            SINK_ITEMS.labels(status=str(code)).inc(n)
        if not failed:
            return new_shard
        _id, status, reason = next((f for f in failed if f[1] not in TRANSIENT_STATUSES), failed[0])
        summary = f"{len(failed)} of {len(records)} items not written to {self.index}; item {_id}: [{status}] {reason}"
        if missing_index:
            self._index_missing = True
            if self._ddl is Ddl.AUTO:
                self._prepared = False  # the next write creates it again
                STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
                raise StorageUnavailable(f"the events index is missing; creating it again: {summary}")
            raise FormatError(f"the events index {self.index} does not exist (ddl {self._ddl}): {summary}")
        if refused is not None:
            # the store's own reason, not the records': nothing is set aside, the feed stalls
            STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
            raise StoreRefused(f"{refused} ({summary})")
        if all(f[1] in TRANSIENT_STATUSES for f in failed):
            STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
            raise StorageUnavailable(summary)
        log.error("sink write refused: %s", summary)
        raise SinkWriteError(summary)

    async def _refresh_index(self, since: float | None = None) -> None:
        """Returns once a refresh that started at ``since`` or later (default: now) completed, so
        that every write completed by then is searchable. Refreshes are shared: a caller waits
        for one under way, and a new one starts at most once per ``refresh_interval_s`` (the
        callers meanwhile wait for it), so the index sees at most one ``_refresh`` per interval
        from this sink however many writes need one."""
        needed = anyio.current_time() if since is None else since
        while self._refreshed_as_of < needed:
            running = self._refresh_running
            if running is not None:
                await running.wait()
                continue
            pause = self._refresh_started + self._refresh_interval_s - anyio.current_time()
            if pause > 0:
                await anyio.sleep(pause)
                continue  # another caller may have started one meanwhile
            started = self._refresh_started = anyio.current_time()
            event = self._refresh_running = anyio.Event()
            try:
                with self._translate("refresh"):
                    await self._client.indices.refresh(index=self.index)
                self.refreshes += 1
                self._refreshed_as_of = max(self._refreshed_as_of, started)
            finally:
                self._refresh_running = None
                event.set()

    async def _stamp_after_refresh(self, stamps: Sequence[AccessStamp], since: float) -> None:
        """The stamps of one write, once a refresh since ``since`` made its documents
        searchable, batched with the stamps of the other writes waiting for that refresh: the
        first writer to get the refresh sends every waiting stamp in one :meth:`stamp_all`; the
        others wait for it and fail with it."""
        me = _Waiting(stamps=list(stamps), since=since, done=anyio.Event())
        self._waiting.append(me)
        try:
            if not self._refresh:  # else each request refreshed
                await self._refresh_index(since)
        except BaseException:
            if not me.taken:
                self._waiting.remove(me)
            raise
        if me.taken:
            await me.done.wait()
            if me.error is not None:
                raise me.error
            return
        batch = [w for w in self._waiting if w.since <= self._refreshed_as_of or w is me]
        for w in batch:
            w.taken = True
            self._waiting.remove(w)
        try:
            updated = await self.stamp_all([s for w in batch for s in w.stamps])
            log.debug(
                "stamped access over %d documents of %d aggregates (%d writes) in %s",
                updated,
                sum(len(w.stamps) for w in batch),
                len(batch),
                self.index,
            )
        except BaseException as exc:
            for w in batch:
                w.error = exc if isinstance(exc, StorageError) else StorageUnavailable(f"stamps not sent: {exc!r}")
            raise
        finally:
            for w in batch:
                w.done.set()

    async def _previous_digests(self, firsts: Sequence[Commit]) -> list[str | None]:
        """For each record, the ``access_digest`` of its stream's document of the version just
        before it, by one realtime ``_mget`` (None: not found)."""
        with self._translate("mget"):
            resp = await self._client.mget(index=self.index, docs=previous_docs(firsts))
        docs = self._answer("mget", resp.body).get("docs")
        if not isinstance(docs, list) or len(docs) != len(firsts):
            raise StorageError(f"elasticsearch mget on {self.index}: unexpected answer")
        digests: list[str | None] = []
        for c, d in zip(firsts, docs, strict=True):
            err = d.get("error")
            if err is not None:
                kind = err.get("type") if isinstance(err, Mapping) else None
                if kind == "index_not_found_exception":
                    digests.append(None)
                    continue
                reason = f"{kind}: {err.get('reason')}" if isinstance(err, Mapping) else str(err)
                STORE_UNAVAILABLE.labels(store=_STORE, operation="mget").inc()
                refused = refusal(self.index, 400, str(kind), str(err.get("reason"))) if kind in _STORE_400 else None
                if refused is not None:
                    raise StoreRefused(f"elasticsearch mget of {c.ref}: {refused}")
                raise StorageUnavailable(f"elasticsearch mget of {c.ref} in {self.index}: {reason}")
            digests.append(self._stored_digest(d.get("_source")) if d.get("found") else None)
        return digests

    def _stored_digest(self, source: object) -> str | None:
        if not isinstance(source, Mapping):
            return None
        digest = source.get("access_digest")
        if isinstance(digest, str):
            return digest
        return self._digest(source.get("access") or {})

    async def _latest_digests(self, firsts: Sequence[Commit]) -> list[str | None]:
        """For each record, the attributes' digest of its stream's latest document before it
        (None: no such document), by one ``_msearch`` over every shard's answer."""
        searches: list[dict[str, Any]] = []
        for c in firsts:
            header: dict[str, Any] = {"allow_partial_search_results": False}
            routing = _routing([c.ref.id])
            if routing is not None:
                header["routing"] = routing
            searches.append(header)
            searches.append(latest_search(c.ref, c.version))
        with self._translate("msearch"):
            resp = await self._client.msearch(index=self.index, searches=searches)
        responses = self._answer("msearch", resp.body).get("responses")
        if not isinstance(responses, list) or len(responses) != len(firsts):
            raise StorageError(f"elasticsearch msearch on {self.index}: unexpected answer")
        digests: list[str | None] = []
        for c, r in zip(firsts, responses, strict=True):
            if "error" in r:
                status = int(r.get("status", 500))
                err = r["error"]
                reason = f"{err.get('type')}: {err.get('reason')}" if isinstance(err, Mapping) else str(err)
                if status == 404:
                    digests.append(None)
                    continue
                msg = f"elasticsearch search of {c.ref} in {self.index}: [{status}] {reason}"
                if _is_transient(status):
                    raise StorageUnavailable(msg)
                refused = (
                    refusal(self.index, status, str(err.get("type")), str(err.get("reason")))
                    if isinstance(err, Mapping)
                    else None
                )
                if refused is not None:
                    raise StoreRefused(f"elasticsearch search of {c.ref}: {refused}")
                raise StorageError(msg)
            hits = r.get("hits", {}).get("hits", [])
            digests.append(self._stored_digest(hits[0].get("_source")) if hits else None)
        return digests

    # ------------------------------------------------------------------ stamps

    async def stamp(self, ref: AggregateRef, access: Mapping[str, Any], as_of: int, from_: int, until: int) -> int:
        """One ``_update_by_query`` (searched again after version conflicts); answers how many
        documents it changed."""
        return await self.stamp_all([AccessStamp(ref=ref, access=access, as_of=as_of, from_=from_, until=until)])

    async def stamp_all(self, stamps: Sequence[AccessStamp]) -> int:
        """One ``_update_by_query`` per round of :func:`stamp_rounds` (per :data:`STAMP_PAGE`
        stamps); answers how many documents changed. A round that changed documents is made
        visible (a refresh) before the next round searches them."""
        updated = 0
        rounds = stamp_rounds(stamps)
        for n, round_ in enumerate(rounds):
            before = updated
            for i in range(0, len(round_), STAMP_PAGE):
                updated += await self._update_by_query(round_[i : i + STAMP_PAGE])
            if updated > before and n + 1 < len(rounds) and not self._refresh:
                await self._refresh_index()
        return updated

    async def _update_by_query(self, stamps: Sequence[AccessStamp]) -> int:
        query = stamp_query(stamps)
        script = stamp_script(stamps)
        extra: dict[str, Any] = {}
        routing = _routing([s.ref.id for s in stamps])
        if routing is not None:
            extra["routing"] = routing
        if self._refresh:
            extra["refresh"] = True
        client = self._client.options(request_timeout=self._stamp_timeout_s)
        updated = 0
        for _ in range(MAX_CONFLICT_ROUNDS):
            body: Mapping[str, Any]
            with self._translate("update_by_query"):
                try:
                    resp = await client.update_by_query(
                        index=self.index, query=query, script=script, conflicts="proceed", **extra
                    )
                    body = self._answer("update_by_query", resp.body)
                except ApiError as exc:
                    # failures or a timeout come as the answer itself with the highest failure's
                    # status (408 for a timeout); read them as such, classified per failure
                    if not _is_update_by_query_answer(exc.body):
                        raise
                    body = exc.body
            self._check_failures(body.get("failures") or [])
            updated += int(body.get("updated", 0))
            if body.get("timed_out"):
                STORE_UNAVAILABLE.labels(store=_STORE, operation="update_by_query").inc()
                raise StorageUnavailable(
                    f"elasticsearch update_by_query on {self.index}: timed out after {updated} updates"
                )
            conflicts = int(body.get("version_conflicts", 0))
            if conflicts == 0:
                return updated
            log.debug("stamp met %d version conflicts in %s; searching again", conflicts, self.index)
            await self._refresh_index()
        STORE_UNAVAILABLE.labels(store=_STORE, operation="update_by_query").inc()
        raise StorageUnavailable(
            f"elasticsearch update_by_query on {self.index}: still version conflicts after {MAX_CONFLICT_ROUNDS} rounds"
        )

    def _check_failures(self, failures: Sequence[Mapping[str, Any]]) -> None:
        if not failures:
            return
        # bulk failures: {index, id, cause {type, reason}, status}; search (shard) failures:
        # {index, shard, node, status, reason {type, reason}}
        statuses = [int(f.get("status", 500)) for f in failures]
        n = next((i for i, st in enumerate(statuses) if not _is_transient(st)), 0)
        first = failures[n]
        cause = first.get("cause") or first.get("reason") or {}
        reason = f"{cause.get('type')}: {cause.get('reason')}" if isinstance(cause, Mapping) else str(cause)
        where = f"id {first['id']}" if first.get("id") is not None else f"shard {first.get('shard')}"
        msg = (
            f"elasticsearch update_by_query on {self.index}: {len(failures)} failures; "
            f"{where}: [{statuses[n]}] {reason}"
        )
        if all(_is_transient(s) for s in statuses):
            STORE_UNAVAILABLE.labels(store=_STORE, operation="update_by_query").inc()
            raise StorageUnavailable(msg)
        if isinstance(cause, Mapping):
            refused = refusal(self.index, statuses[n], str(cause.get("type")), str(cause.get("reason")))
            if refused is not None:
                STORE_UNAVAILABLE.labels(store=_STORE, operation="update_by_query").inc()
                raise StoreRefused(f"elasticsearch update_by_query: {refused}")
        raise StorageError(msg)

    # ------------------------------------------------------------------ checks

    async def server_version(self) -> tuple[str, str]:
        """The cluster's version number and distribution, as ``GET /`` answers it, asked
        without the client's ``compatible-with=9`` headers so that a server of another major
        version answers too (an 8.x server refuses them: 400 ``media_type_header_exception``)."""
        with self._translate("info"):
            resp = await self._client.transport.perform_request("GET", "/", headers={"accept": "application/json"})
        status = resp.meta.status
        if status >= 300:  # the transport hands back an error answer as it is
            err = resp.body.get("error") if isinstance(resp.body, Mapping) else None
            kind = str(err.get("type")) if isinstance(err, Mapping) else "error"
            reason = str(err.get("reason")) if isinstance(err, Mapping) else str(resp.body)[:200]
            refused = refusal(self.index, status, kind, reason)
            raise StorageError(refused or f"elasticsearch info: [{status}] {kind}: {reason}")
        body = self._answer("info", resp.body)
        version = body.get("version") or {}
        if not isinstance(version, Mapping) or not isinstance(version.get("number"), str):
            raise StorageError(f"elasticsearch info: no version in {str(body)[:200]!r}")
        return version["number"], str(version.get("distribution") or "elasticsearch")

    async def check_version(self) -> str:
        """``"<number> (supported)"`` for an Elasticsearch 9.x cluster; a :class:`StorageError`
        naming the version and the supported ones otherwise."""
        number, distribution = await self.server_version()
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

    def required_privileges(self) -> tuple[list[str], list[str]]:
        """The cluster and index privileges the sink's requests need on its index (DDL mode
        included): ``monitor`` (cluster health), ``create_doc`` (writes), ``read`` (the look-ups
        of access stamps), ``index`` (the stamps' ``_update_by_query``), ``maintenance``
        (``_refresh``), ``view_index_metadata`` (the mapping checks); under ``ddl auto``
        ``create_index`` and ``manage_index_templates`` (the index template)."""
        cluster = ["monitor"]
        index = ["create_doc", "read", "index", "maintenance", "view_index_metadata"]
        if self._ddl is Ddl.AUTO:
            cluster.append("manage_index_templates")
            index.append("create_index")
        return cluster, index

    async def missing_privileges(self) -> list[str] | None:
        """The privileges of :meth:`required_privileges` wowd's user does not hold, as the
        cluster answers ``_security/user/_has_privileges`` (``"cluster monitor"``, ``"index
        maintenance on <index>"``); None when the cluster has security off (every request is
        allowed)."""
        cluster, index = self.required_privileges()
        try:
            with self._translate("has_privileges"):
                resp = await self._client.security.has_privileges(
                    cluster=cluster, index=[{"names": [self.index], "privileges": index}]
                )
        except StorageError as exc:
            cause = exc.__cause__
            reason = _api_reason(cause).lower() if isinstance(cause, ApiError) else ""
            if "must be explicitly enabled" in reason or "security is not enabled" in reason:
                return None  # a cluster with security off (SecurityActionFilter's 500)
            raise
        body = self._answer("has_privileges", resp.body)
        missing = [f"cluster {p}" for p, held in (body.get("cluster") or {}).items() if not held]
        for name, held_of in (body.get("index") or {}).items():
            missing += [f"index {p} on {name}" for p, held in held_of.items() if not held]
        return missing

    # ------------------------------------------------------------------ reads

    async def documents(self, ref: AggregateRef) -> list[dict[str, Any]]:
        """The stream's documents by version (the commit's fields; ``access_digest`` left out).
        A missing index holds none."""
        docs: list[dict[str, Any]] = []
        after: int | None = None
        extra: dict[str, Any] = {"allow_partial_search_results": False}
        routing = _routing([ref.id])
        if routing is not None:
            extra["routing"] = routing
        while True:
            try:
                with self._translate("search"):
                    resp = await self._client.search(index=self.index, **documents_search(ref, after), **extra)
            except StorageError as exc:
                cause = exc.__cause__
                if isinstance(cause, ApiError) and cause.meta.status == 404:
                    return docs
                raise
            hits = self._answer("search", resp.body).get("hits", {}).get("hits", [])
            for h in hits:
                source = dict(h.get("_source", {}))
                source.pop("access_digest", None)
                docs.append(source)
            if len(hits) < _DOCUMENTS_PAGE:
                return docs
            after = int(hits[-1]["sort"][0])

    async def close(self) -> None:
        """Closes the client when this sink owns it."""
        if self._owns_client:
            with self._translate("close"):
                await self._own.close()
