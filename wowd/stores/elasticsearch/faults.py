"""What a failure of Elasticsearch means for the sink: one table, cause -> fault.

Every failure the sink meets (a request's error answer, a bulk item's error, a failure inside an
``_update_by_query`` answer, a look-up's error, a transport error) is read into a
:class:`Failure` and classified by :data:`RULES`, the first rule that matches deciding:

- :attr:`Fault.STORE`: the store refuses for a reason of its own (credentials, a privilege, a
  block, a full disk, a closed or missing index, an alias without a write index, a data stream,
  a full shard, a mapping without a field wowd writes, a server error, TLS, an answer that is not
  Elasticsearch's). The sink raises :class:`~wowd.errors.StoreRefused` naming the cause: the
  index view stalls, nothing is set aside and no checkpoint moves past it.
- :attr:`Fault.TRANSIENT`: a retry fixes it (429, 502, 503, 504, a connection error, a
  timeout): :class:`~wowd.errors.StorageUnavailable`, retried with backoff.
- :attr:`Fault.RECORD`: the record itself cannot be written (a value its field cannot take, a
  document the cluster will not parse, too many nested events): :class:`~wowd.errors.SinkWriteError`
  naming it, and the feed sets that record aside. Only a failure of a request that carries
  records (a bulk, or one of its items) can be the record's; anything no rule gives the record is
  the store's.

The type of an error is not enough where Elasticsearch uses one type for both (an
``illegal_argument_exception`` about the record, or about an alias, a data stream or a full
shard): those rules read the reason too. An answer without Elasticsearch's product header
(``X-Elastic-Product: Elasticsearch``, on every answer of Elasticsearch since 7.14) or without its
error body is a proxy's (or another server's) and never the record's fault.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, cast

from elastic_transport import ConnectionError as TransportConnectionError
from elastic_transport import ConnectionTimeout, SerializationError, Serializer, TlsError, TransportError
from elasticsearch import ApiError, AsyncElasticsearch

from wowd.errors import SinkWriteError, StorageUnavailable, StoreRefused
from wowd.metrics import STORE_UNAVAILABLE
from wowd.stores.elasticsearch.documents import events_mapping

__all__ = [
    "RULES",
    "answer_body",
    "refuse",
    "Failure",
    "Fault",
    "Rule",
    "Verdict",
    "classify",
    "failure_of",
    "from_elasticsearch",
    "raise_verdict",
    "tolerate_non_json",
    "transport_verdict",
    "translated",
    "update_by_query_answer",
    "item_failure",
    "wowd_fields",
]

_STORE = "elasticsearch"


class Fault(enum.Enum):
    """Whose failure it is, and so what the feed does with it."""

    STORE = "store"
    """The store refuses: the index view stalls, nothing is quarantined or checkpointed past."""
    TRANSIENT = "transient"
    """Retried with backoff."""
    RECORD = "record"
    """The record's own fault: it is quarantined."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """One failure as the cluster (or what answers in its place) gave it."""

    status: int
    type: str = "error"
    reason: str = ""
    cause_type: str = ""
    """The ``caused_by`` of the error, when it has one."""
    cause_reason: str = ""
    from_es: bool = True
    """Elasticsearch's own answer: its product header and an error body of its own."""
    records: int = 0
    """The records the failed request carried: 1 for a bulk item, the bulk's for a bulk
    request, 0 for any other request (stamps, look-ups, refreshes, DDL): no record's fault then."""

    @property
    def detail(self) -> str:
        text = f"[{self.status}] {self.type}: {self.reason}"
        if self.cause_type:
            text += f" (caused by {self.cause_type}: {self.cause_reason})"
        return text


def wowd_fields() -> frozenset[str]:
    """Every field path wowd writes (``events.name``, ``access.owner_id``, ...)."""
    out: set[str] = set()

    def walk(spec: Mapping[str, Any], prefix: str) -> None:
        for name, field in spec.get("properties", {}).items():
            out.add(prefix + name)
            walk(field, f"{prefix}{name}.")

    walk(events_mapping(), "")
    return frozenset(out)


_WOWD_FIELDS = wowd_fields()
_STRICT = re.compile(r"dynamic introduction of \[(?P<field>[^\]]*)\] within \[(?P<parent>[^\]]*)\]")


def _strict_field(f: Failure) -> str | None:
    """The field a ``strict_dynamic_mapping_exception`` names, as a path from the document's
    root (``DocumentParser``: "mapping set to strict, dynamic introduction of [f] within [parent]
    is not allowed"; the root is ``_doc``)."""
    m = _STRICT.search(f.reason) or _STRICT.search(f.cause_reason)
    if m is None:
        return None
    parent = m.group("parent")
    return m.group("field") if parent in ("_doc", "") else f"{parent}.{m.group('field')}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One row of :data:`RULES`: a failure matches when every condition given holds."""

    fault: Fault
    says: str
    """The cause, for the message (``{index}``, ``{field}`` filled in)."""
    statuses: frozenset[int] | None = None
    types: frozenset[str] | None = None
    reason: re.Pattern[str] | None = None
    """Searched in the reason and in the cause's reason."""
    from_es: bool | None = None
    single: bool | None = None
    """The failed request carried one record (True) or not (False)."""
    wowd_field: bool | None = None
    """A strict mapping refused a field wowd writes (True) or another (False)."""

    def matches(self, f: Failure) -> bool:
        if self.statuses is not None and f.status not in self.statuses:
            return False
        if self.types is not None and f.type not in self.types and f.cause_type not in self.types:
            return False
        if self.reason is not None and not (self.reason.search(f.reason) or self.reason.search(f.cause_reason)):
            return False
        if self.from_es is not None and f.from_es is not self.from_es:
            return False
        if self.single is not None and (f.records == 1) is not self.single:
            return False
        if self.wowd_field is not None:
            field = _strict_field(f)
            if field is None or (field in _WOWD_FIELDS) is not self.wowd_field:
                return False
        return True


def _s(*items: str | int) -> frozenset[Any]:
    return frozenset(items)


_IAE = _s("illegal_argument_exception")
_BLOCK = _s("cluster_block_exception")
_TRANSIENT = _s(408, 429, 502, 503, 504)

RULES: tuple[Rule, ...] = (
    # a body too large for the cluster's http.max_content_length (or a proxy's limit before it):
    # one record is that record's size; a bulk of several is a limit below max_request_bytes
    Rule(
        fault=Fault.RECORD,
        statuses=_s(413),
        single=True,
        says="the record is larger than the cluster (or a proxy before it) takes",
    ),
    Rule(
        fault=Fault.STORE,
        statuses=_s(413),
        says="the cluster (or a proxy before it) refuses a bulk this large: its http.max_content_length is "
        "below elasticsearch.max_request_bytes",
    ),
    # an answer that is not Elasticsearch's: a proxy's page (a gateway timeout, a node restarting
    # behind it: transient), a wrong path or method through it (404, 405: the store's setup)
    Rule(
        fault=Fault.TRANSIENT,
        from_es=False,
        statuses=_TRANSIENT,
        says="no answer from Elasticsearch: a proxy (or another server) in front of it answers",
    ),
    Rule(
        fault=Fault.STORE,
        from_es=False,
        says="an answer that is not Elasticsearch's (a proxy or another server at the URL; no X-Elastic-Product "
        "header or no Elasticsearch error)",
    ),
    Rule(
        fault=Fault.STORE,
        statuses=_s(401),
        says="elasticsearch refuses wowd's credentials (an expired or revoked API key, a wrong password)",
    ),
    # the flood-stage disk watermark: since 7.x a 429 with the read-only-allow-delete block
    # (DiskThresholdMonitor; ClusterBlockException.status() is the block's TOO_MANY_REQUESTS)
    Rule(
        fault=Fault.STORE,
        types=_BLOCK,
        reason=re.compile(r"disk usage exceeded flood-stage watermark|read-only-allow-delete|read-only / allow delete"),
        says="a disk holding {index} is over the flood-stage watermark: Elasticsearch blocks writes "
        "(index.blocks.read_only_allow_delete) until its usage falls below the high watermark; free disk space",
    ),
    Rule(fault=Fault.TRANSIENT, statuses=_s(429, 502, 503, 504), says="elasticsearch is busy or unavailable"),
    # the other blocks by the description IndexMetadata gives them (APIBlock)
    Rule(
        fault=Fault.STORE,
        types=_BLOCK,
        reason=re.compile(r"index write \(api\)"),
        says="index {index} is write-blocked (index.blocks.write)",
    ),
    Rule(
        fault=Fault.STORE,
        types=_BLOCK,
        reason=re.compile(r"index read-only \(api\)"),
        says="index {index} is write-blocked (index.blocks.read_only)",
    ),
    Rule(fault=Fault.STORE, types=_BLOCK, says="elasticsearch blocks writes to {index}"),
    Rule(fault=Fault.STORE, types=_s("index_closed_exception"), says="index {index} is closed"),
    Rule(fault=Fault.STORE, types=_s("index_not_found_exception"), says="index {index} does not exist"),
    Rule(
        fault=Fault.STORE,
        types=_s("media_type_header_exception"),
        says="the cluster does not take the Elasticsearch 9 client's requests (an older server?)",
    ),
    Rule(fault=Fault.STORE, statuses=_s(403), says="wowd's Elasticsearch user lacks a privilege on {index}"),
    # illegal_argument_exception: the store's when its reason is about the index, not the record
    Rule(
        fault=Fault.STORE,
        types=_IAE,
        reason=re.compile(r"Number of documents in the (shard|index) cannot exceed"),
        says="a shard of {index} holds the most documents Lucene allows (2,147,483,519; nested events and "
        "deleted documents count): write into a new index (see docs/stores.md) or force-merge the deletes away",
    ),
    Rule(
        fault=Fault.STORE,
        types=_IAE,
        reason=re.compile(r"no write index is defined for alias"),
        says="{index} is an alias without a write index",
    ),
    Rule(
        fault=Fault.STORE,
        types=_IAE,
        reason=re.compile(r"targeting data stream \[[^\]]*\] specifies a custom routing"),
        says="{index} is a data stream whose template refuses custom routing (wowd routes each document by its "
        "aggregate id; an events index is not a data stream: see docs/stores.md)",
    ),
    Rule(
        fault=Fault.STORE,
        reason=re.compile(r"data stream timestamp field \[@timestamp\]"),
        says="{index} is a data stream, which wants an @timestamp wowd does not write (an events index is not a "
        "data stream: see docs/stores.md)",
    ),
    Rule(
        fault=Fault.STORE,
        reason=re.compile(r"matching patterns from existing templates|cannot create index with name \["),
        says="another index template claims {index}",
    ),
    Rule(
        fault=Fault.STORE,
        types=_s("strict_dynamic_mapping_exception"),
        wowd_field=True,
        says="the mapping of {index} lacks {field}, a field wowd writes (an index made by hand or by another layout)",
    ),
    # what the record holds that its index cannot take
    Rule(
        fault=Fault.RECORD,
        types=_s(
            "document_parsing_exception",
            "mapper_parsing_exception",
            "strict_dynamic_mapping_exception",
            "x_content_parse_exception",
            "action_request_validation_exception",
            "version_conflict_engine_exception",
            "illegal_argument_exception",
        ),
        says="the record cannot be written into {index}",
    ),
    Rule(fault=Fault.STORE, statuses=_s(*range(500, 600)), says="elasticsearch fails the request on {index}"),
    Rule(fault=Fault.STORE, says="elasticsearch refuses the request on {index}"),
)
"""The table, first match wins: cause -> fault. Its last row gives the store anything else."""


@dataclass(frozen=True, slots=True)
class Verdict:
    fault: Fault
    message: str


def classify(f: Failure, index: str, op: str) -> Verdict:
    """The fault of a failure and the message that names its cause (:data:`RULES`)."""
    rule = next(r for r in RULES if r.matches(f))
    if rule.fault is Fault.RECORD and f.records == 0:
        rule = RULES[-1]  # a request without records: nothing of it is a record's
    fault = rule.fault
    cause = rule.says.format(index=index, field=_strict_field(f))
    if fault is Fault.TRANSIENT:
        return Verdict(fault, f"elasticsearch {op} on {index}: {cause}: {f.detail}")
    if fault is Fault.RECORD:
        return Verdict(fault, f"elasticsearch {op} on {index}: {cause}: {f.detail}")
    return Verdict(fault, f"{cause}: {f.detail}")


def from_elasticsearch(headers: Mapping[str, str] | None) -> bool:
    """Whether an answer carries Elasticsearch's product header (every answer of Elasticsearch
    since 7.14; the client checks it once, on the first successful answer only)."""
    return headers is not None and headers.get("x-elastic-product") == "Elasticsearch"


def failure_of(exc: ApiError, *, records: int = 0) -> Failure:
    """An error answer read: its status, and the type, reason and cause of Elasticsearch's
    error body (``{"error": {type, reason, caused_by}, "status"}``). Without the product header
    or such a body, the answer is not Elasticsearch's (its text is the reason)."""
    body = exc.body
    err = body.get("error") if isinstance(body, Mapping) else None
    from_es = from_elasticsearch(exc.meta.headers) and isinstance(err, Mapping) and "type" in err
    status = exc.meta.status
    if not from_es or not isinstance(err, Mapping):
        return Failure(status=status, type="not elasticsearch", reason=_text(body, exc), from_es=False, records=records)
    cause = err.get("caused_by")
    return Failure(
        status=status,
        type=str(err.get("type")),
        reason=str(err.get("reason", "")),
        cause_type=str(cause.get("type", "")) if isinstance(cause, Mapping) else "",
        cause_reason=str(cause.get("reason", "")) if isinstance(cause, Mapping) else "",
        records=records,
    )


def item_failure(status: int, error: object, *, records: int) -> Failure:
    """A bulk item's (or a look-up's, or an ``_update_by_query`` failure's) error, inside an
    answer of Elasticsearch."""
    if not isinstance(error, Mapping):
        return Failure(status=status, reason=str(error), records=records)
    cause = error.get("caused_by")
    return Failure(
        status=status,
        type=str(error.get("type", "error")),
        reason=str(error.get("reason", "")),
        cause_type=str(cause.get("type", "")) if isinstance(cause, Mapping) else "",
        cause_reason=str(cause.get("reason", "")) if isinstance(cause, Mapping) else "",
        records=records,
    )


def _text(body: object, exc: ApiError) -> str:
    if isinstance(body, str | bytes) and body:
        text = body if isinstance(body, str) else body.decode("utf-8", "replace")
        return " ".join(text.split())[:200]
    if isinstance(body, Mapping):
        return str(body)[:200]
    return "(no body)" if body in (None, "", b"") else str(exc.message)


_ERRORS: dict[Fault, type[Exception]] = {
    Fault.STORE: StoreRefused,
    Fault.TRANSIENT: StorageUnavailable,
    Fault.RECORD: SinkWriteError,
}


def raise_verdict(verdict: Verdict, op: str, cause: BaseException | None = None) -> NoReturn:
    """Raises the wowd error of a verdict (counted in ``wowd_store_unavailable_total`` unless
    it is the record's)."""
    if verdict.fault is not Fault.RECORD:
        STORE_UNAVAILABLE.labels(store=_STORE, operation=op).inc()
    raise _ERRORS[verdict.fault](verdict.message) from cause


def refuse(op: str, message: str) -> NoReturn:
    """Raises the store's refusal (:class:`StoreRefused`) with ``message``."""
    raise_verdict(Verdict(Fault.STORE, message), op)


def answer_body(index: str, op: str, resp: Any) -> Mapping[str, Any]:
    """A 2xx answer's body, which must be Elasticsearch's (its product header) and a JSON
    object; else the store refuses (:class:`StoreRefused`)."""
    if not from_elasticsearch(resp.meta.headers):
        refuse(op, f"elasticsearch {op} on {index}: an answer without Elasticsearch's product header")
    body = resp.body
    if not isinstance(body, Mapping):
        refuse(op, f"elasticsearch {op} on {index}: bad answer: {str(body)[:200]!r}")
    return cast("Mapping[str, Any]", body)


def transport_verdict(exc: TransportError, index: str, op: str) -> Verdict:
    """A failure before any answer: TLS (a certificate expired, rotated, or not the one trusted
    or pinned) is the store's; a connection that fails or times out is transient; an answer that
    cannot be read is the store's."""
    where = f"elasticsearch {op} on {index}"
    if isinstance(exc, TlsError):
        return Verdict(
            Fault.STORE,
            f"TLS with the cluster fails (a certificate expired, rotated, or not the one trusted or pinned): "
            f"{where}: {exc}",
        )
    if isinstance(exc, TransportConnectionError | ConnectionTimeout):
        return Verdict(Fault.TRANSIENT, f"{where}: {exc}")
    if isinstance(exc, SerializationError):
        return Verdict(Fault.STORE, f"an answer that cannot be read: {where}: {exc}")
    return Verdict(Fault.TRANSIENT, f"{where}: {exc}")


@contextmanager
def translated(index: str, op: str, *, records: int = 0) -> Iterator[None]:
    """Client exceptions become wowd's, as :data:`RULES` classify them; ``records`` the records
    the request carries (see :attr:`Failure.records`)."""
    try:
        yield
    except ApiError as exc:
        raise_verdict(classify(failure_of(exc, records=records), index, op), op, exc)
    except TransportError as exc:
        raise_verdict(transport_verdict(exc, index, op), op, exc)


def update_by_query_answer(body: object) -> bool:
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


def tolerate_non_json(client: AsyncElasticsearch) -> None:
    """Has the client's transport hand back a body that is not JSON as text (every user of that
    client: such a body is an error either way)."""
    collection = client.transport.serializers
    for mimetype, serializer in list(collection.serializers.items()):
        if "json" in mimetype and not isinstance(serializer, _TextOnFailure):
            collection.serializers[mimetype] = _TextOnFailure(serializer)
    if not isinstance(collection.default_serializer, _TextOnFailure):
        collection.default_serializer = _TextOnFailure(collection.default_serializer)
