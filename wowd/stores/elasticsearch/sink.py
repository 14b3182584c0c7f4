"""The event sink of one aggregate type on Elasticsearch 9 (seed 002, DESIGN.md section 7).

One index per aggregate type, ``wow.<context>.<aggregate>.events``; one document per commit,
its id the commit's stream id (:func:`wowd.model.stream_id`), routed by aggregate id.

- ``write`` sends one ``_bulk`` of ``create``s. A ``409`` item is a document written before
  (a retry, a replay, an old owner of the partition): it counts as written. Any other failed
  item fails the write: :class:`StorageUnavailable` when every failure is transient (429, 502,
  503, 504; a 500 is not), else :class:`SinkWriteError` naming the item. The items written
  stay. A failed request is classified the same way; connection failures and timeouts are
  transient.
- Access stamps: after a write, the last record of each aggregate whose access attributes
  differ from the stream's before it (the previous record of the write, else an LRU of the last
  record written per aggregate when it is the version just before, else a search of the
  stream's latest document below it) stamps its attributes over the aggregate's earlier
  documents, after a refresh of the index. The LRU is updated only once the stamps succeeded,
  so the retry of a failed write stamps again.
- ``stamp``/``stamp_all`` are ``_update_by_query`` requests guarded twice, in the query and in
  the painless script: a document is written when it has no ``access_version``, one below the
  stamp's, or the same one with other attributes (compared by ``access_digest``, a digest of the
  attributes kept beside them). Version conflicts are passed over (``conflicts: proceed``:
  counted in ``version_conflicts``, not failures) and searched again after a refresh. An
  answer holding failures comes with the highest failure's status (408 when it timed out), so
  it is read from the client's error and classified per failure. A page holds at most
  :data:`STAMP_PAGE` stamps, so the query stays under Lucene's clause limit.

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
from typing import Any

import anyio
from elastic_transport import ConnectionError as TransportConnectionError
from elastic_transport import ConnectionTimeout, SerializationError, TlsError, TransportError
from elasticsearch import ApiError, AsyncElasticsearch

from wowd.errors import ConfigError, FormatError, SinkWriteError, StorageError, StorageUnavailable
from wowd.metrics import SINK_BULK_SECONDS, SINK_ITEMS, STORE_UNAVAILABLE
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit, commit_fields, stream_id
from wowd.stores.base import Ddl

__all__ = [
    "MAX_CONFLICT_ROUNDS",
    "STAMP_CLAUSE_LEAVES",
    "STAMP_PAGE",
    "STAMP_SCRIPT",
    "TRANSIENT_STATUSES",
    "ElasticsearchEventSink",
    "access_digest",
    "bulk_operations",
    "check_mapping",
    "documents_search",
    "event_document",
    "events_mapping",
    "index_name",
    "latest_search",
    "stamp_clause",
    "stamp_query",
    "stamp_rounds",
    "stamp_script",
]

log = logging.getLogger(__name__)

TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
"""Item (and request) statuses a retry can fix."""

MAX_CONFLICT_ROUNDS = 8
"""How many times a stamp is searched again after version conflicts before giving up (transient)."""

STAMP_PAGE = 128
"""At most this many stamps go into one ``_update_by_query`` (one ``should`` clause each).

Each stamp's clause holds :data:`STAMP_CLAUSE_LEAVES` leaf queries, and Lucene counts every leaf
of the whole query against ``IndexSearcher.maxClauseCount``, which Elasticsearch 9 sizes from the
heap and the search thread pool with a floor of 1024 (``SearchUtils.calculateMaxClauseValue``:
a 1 GB heap on 32 cores gives about 1300). 128 stamps are 896 leaves, under the floor on any
node; more would fail with ``too_many_nested_clauses`` on a small heap with many cores."""

STAMP_CLAUSE_LEAVES = 7
"""Leaf queries in one :func:`stamp_clause` (tenant, aggregate, versions, and the guard's four)."""

_DOCUMENTS_PAGE = 1000
_STORE = "elasticsearch"


# --------------------------------------------------------------------------- names and mapping


def index_name(type: AggregateType) -> str:
    """The events index of an aggregate type: ``wow.<context>.<aggregate>.events``."""
    return f"wow.{type.context}.{type.aggregate}.events"


def events_mapping() -> dict[str, Any]:
    """The index's mapping: strict at the top (a layout mistake fails loudly), ids as keywords,
    ``create_time`` a date (epoch ms), events nested with their bodies stored, not indexed,
    ``header`` stored only, ``access`` indexed for its known attributes (others stored only),
    and routing required (every document is routed by its aggregate id)."""
    keyword: dict[str, Any] = {"type": "keyword"}
    return {
        "dynamic": "strict",
        "_routing": {"required": True},
        "properties": {
            "tenant_id": keyword,
            "aggregate_id": keyword,
            "version": {"type": "long"},
            "command_id": keyword,
            "request_id": keyword,
            "create_time": {"type": "date", "format": "epoch_millis"},
            "header": {"type": "object", "enabled": False},
            "events": {
                "type": "nested",
                "properties": {
                    "id": keyword,
                    "name": keyword,
                    "revision": keyword,
                    "body_type": keyword,
                    "body": {"type": "object", "enabled": False},
                },
            },
            "owner_id": keyword,
            "space_id": keyword,
            "access": {
                "type": "object",
                "dynamic": False,
                "properties": {"owner_id": keyword, "space_id": keyword, "tags": keyword},
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


def bulk_operations(records: Sequence[Commit], digests: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The NDJSON lines of one bulk: a ``create`` (id = stream id, routing = aggregate id) and
    the document, per record (``digests``: the records' access digests, when known)."""
    if digests is None:
        digests = [access_digest(c.access) for c in records]
    ops: list[dict[str, Any]] = []
    for c, digest in zip(records, digests, strict=True):
        ops.append({"create": {"_id": stream_id(c.ref, c.version), "routing": c.ref.id}})
        ops.append(event_document(c, digest))
    return ops


def _routing(ids: Sequence[str]) -> str | None:
    """A search's ``routing`` for these aggregate ids; None (every shard) when one holds a comma,
    which the routing parameter would split."""
    unique = sorted(set(ids))
    if not unique or any("," in i for i in unique):
        return None
    return ",".join(unique)


def _stream_filter(ref: AggregateRef) -> list[dict[str, Any]]:
    return [{"term": {"tenant_id": ref.tenant_id}}, {"term": {"aggregate_id": ref.id}}]


def latest_search(ref: AggregateRef, before: int) -> dict[str, Any]:
    """The search of the stream's latest document below version ``before`` (its attributes)."""
    return {
        "query": {"bool": {"filter": [*_stream_filter(ref), {"range": {"version": {"lt": before}}}]}},
        "sort": [{"version": {"order": "desc"}}],
        "size": 1,
        "_source": ["version", "access", "access_version"],
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
    return str(exc.message)


def _is_transient(status: int) -> bool:
    """Seed 002: 429, 502, 503 and 504 are transient; any other status is not (a 500 is a
    defect or a refused request that a retry repeats)."""
    return status in TRANSIENT_STATUSES


def _is_update_by_query_answer(body: object) -> bool:
    """An ``_update_by_query`` answer (as opposed to an ``{"error": ...}`` body): Elasticsearch
    sends it with a non-2xx status when it holds failures (the highest failure's status) or
    timed out (408)."""
    return isinstance(body, Mapping) and "error" not in body and ("failures" in body or "timed_out" in body)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Known:
    """What the sink knows of a stream: its latest version written and its attributes."""

    version: int
    digest: str


# --------------------------------------------------------------------------- the sink


class ElasticsearchEventSink:
    """The event sink of one aggregate type (:class:`wowd.stores.base.EventSink`).

    ``client`` is an ``AsyncElasticsearch`` the caller owns (closed by :meth:`close` only with
    ``owns_client``). ``refresh`` makes every write and stamp refresh the index (tests).
    ``capacity`` is how many aggregates the access-attribute LRU remembers.
    """

    def __init__(
        self,
        client: AsyncElasticsearch,
        type: AggregateType,
        *,
        ddl: Ddl | str = Ddl.AUTO,
        refresh: bool = False,
        capacity: int = 10_000,
        owns_client: bool = False,
    ) -> None:
        if capacity < 0:
            raise ConfigError(f"sink capacity: must be >= 0, got {capacity}")
        self.type = type
        self.index = index_name(type)
        self._client = client
        self._ddl = Ddl(ddl)
        self._refresh = refresh
        self._capacity = capacity
        self._owns_client = owns_client
        self._known: OrderedDict[tuple[str, str], _Known] = OrderedDict()
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

    # ------------------------------------------------------------------ DDL

    async def prepare(self) -> None:
        """Makes sure of the events index, once, as the DDL mode says: ``auto`` creates it with
        :func:`events_mapping` (an existing one is checked instead) and waits for its primary,
        ``validate`` requires it and checks its key fields (:class:`FormatError`), ``none``
        assumes it (no request)."""
        if self._prepared:
            return
        if self._prepare_lock is None:
            self._prepare_lock = anyio.Lock()
        async with self._prepare_lock:
            if self._prepared:
                return
            if self._ddl is Ddl.AUTO:
                if not await self._create_index():
                    await self._validate_mapping()
                await self._wait_for_primary()
            elif self._ddl is Ddl.VALIDATE:
                await self._validate_mapping()
                await self._wait_for_primary()
            self._prepared = True

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
        return True

    async def _validate_mapping(self) -> None:
        try:
            with self._translate("get_mapping"):
                resp = await self._client.indices.get_mapping(index=self.index)
        except StorageError as exc:
            cause = exc.__cause__
            if isinstance(cause, ApiError) and cause.meta.status == 404:
                raise FormatError(f"the events index {self.index} does not exist (ddl {self._ddl})") from exc
            raise
        body = resp.body
        if not isinstance(body, Mapping) or len(body) != 1:
            raise FormatError(f"the events index {self.index}: unexpected mapping answer {body!r}")
        mappings = next(iter(body.values())).get("mappings") or {}
        problems = check_mapping(mappings)
        if problems:
            raise FormatError(f"the events index {self.index} has another layout: " + "; ".join(problems))

    async def _wait_for_primary(self) -> None:
        with self._translate("cluster_health"):
            resp = await self._client.options(ignore_status=408, request_timeout=45).cluster.health(
                index=self.index, wait_for_status="yellow", timeout="30s"
            )
        body = resp.body
        if body.get("timed_out") or body.get("status") not in ("yellow", "green"):
            STORE_UNAVAILABLE.labels(store=_STORE, operation="cluster_health").inc()
            raise StorageUnavailable(
                f"elasticsearch: the primary of {self.index} is not active (health {body.get('status')})"
            )

    # ------------------------------------------------------------------ write

    async def write(self, records: Sequence[Commit]) -> None:
        """One bulk of creates; then the access stamps of the aggregates whose attributes changed
        (see the module's docstring). Raises :class:`StorageUnavailable` (transient) or
        :class:`SinkWriteError` naming the item; the items written stay."""
        if not records:
            return
        await self.prepare()
        digests = [access_digest(c.access) for c in records]
        digest_of = {id(c): d for c, d in zip(records, digests, strict=True)}
        await self._bulk(records, digests)
        refreshed = self._refresh
        groups: dict[tuple[str, str], list[Commit]] = {}
        for c in records:
            groups.setdefault((c.ref.tenant_id, c.ref.id), []).append(c)
        stamps: list[AccessStamp] = []
        unknown: list[tuple[tuple[str, str], Commit]] = []
        for key, group in groups.items():
            group.sort(key=lambda c: c.version)
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
                unknown.append((key, first))
        if unknown:
            if not refreshed:
                await self._refresh_index()
                refreshed = True
            before = await self._latest_digests([c for _, c in unknown])
            for (_, first), digest in zip(unknown, before, strict=True):
                if digest is not None and digest != digest_of[id(first)]:
                    stamps.append(self._stamp_of(first))
        if stamps:
            if not refreshed:
                await self._refresh_index()
            updated = await self.stamp_all(stamps)
            log.debug("stamped access over %d documents of %d aggregates in %s", updated, len(stamps), self.index)
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

    async def _bulk(self, records: Sequence[Commit], digests: Sequence[str]) -> None:
        ops = bulk_operations(records, digests)
        extra: dict[str, Any] = {"refresh": True} if self._refresh else {}
        started = time.perf_counter()
        try:
            with self._translate("bulk"):
                resp = await self._client.bulk(operations=ops, index=self.index, **extra)
        except StorageUnavailable:
            raise
        except StorageError as exc:
            first = stream_id(records[0].ref, records[0].version)
            raise SinkWriteError(f"{exc} (bulk of {len(records)} items, the first {first})") from exc.__cause__
        finally:
            SINK_BULK_SECONDS.observe(time.perf_counter() - started)
        items = resp.body.get("items")
        if not isinstance(items, list) or len(items) != len(records):
            raise StorageError(
                f"elasticsearch bulk on {self.index}: {len(records)} creates answered with "
                f"{len(items) if isinstance(items, list) else 'no'} items"
            )
        failed: list[tuple[str, int, str]] = []
        statuses: Counter[int] = Counter()
        for record, item in zip(records, items, strict=True):
            result: Mapping[str, Any] = item.get("create") or next(iter(item.values()), {})
            status = int(result.get("status", 0))
            statuses[status] += 1
            if status in (200, 201, 409):
                continue
            err = result.get("error")
            reason = f"{err.get('type', 'error')}: {err.get('reason', '')}" if isinstance(err, Mapping) else str(err)
            failed.append((result.get("_id") or stream_id(record.ref, record.version), status, reason))
        for code, n in statuses.items():
            SINK_ITEMS.labels(status=str(code)).inc(n)
        if not failed:
            return
        _id, status, reason = next((f for f in failed if f[1] not in TRANSIENT_STATUSES), failed[0])
        summary = f"{len(failed)} of {len(records)} items not written to {self.index}; item {_id}: [{status}] {reason}"
        if all(f[1] in TRANSIENT_STATUSES for f in failed):
            STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
            raise StorageUnavailable(summary)
        log.error("sink write refused: %s", summary)
        raise SinkWriteError(summary)

    async def _refresh_index(self) -> None:
        with self._translate("refresh"):
            await self._client.indices.refresh(index=self.index)

    async def _latest_digests(self, firsts: Sequence[Commit]) -> list[str | None]:
        """For each record, the attributes' digest of its stream's latest document before it
        (None: no such document), by one ``_msearch``."""
        searches: list[dict[str, Any]] = []
        for c in firsts:
            header: dict[str, Any] = {}
            routing = _routing([c.ref.id])
            if routing is not None:
                header["routing"] = routing
            searches.append(header)
            searches.append(latest_search(c.ref, c.version))
        with self._translate("msearch"):
            resp = await self._client.msearch(index=self.index, searches=searches)
        responses = resp.body.get("responses")
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
                raise StorageError(msg)
            hits = r.get("hits", {}).get("hits", [])
            if not hits:
                digests.append(None)
                continue
            source = hits[0].get("_source", {})
            digests.append(access_digest(source.get("access") or {}))
        return digests

    # ------------------------------------------------------------------ stamps

    async def stamp(self, ref: AggregateRef, access: Mapping[str, Any], as_of: int, from_: int, until: int) -> int:
        """One ``_update_by_query`` (searched again after version conflicts); answers how many
        documents it changed."""
        return await self.stamp_all([AccessStamp(ref=ref, access=access, as_of=as_of, from_=from_, until=until)])

    async def stamp_all(self, stamps: Sequence[AccessStamp]) -> int:
        """One ``_update_by_query`` per round of :func:`stamp_rounds` (per :data:`STAMP_PAGE`
        stamps); answers how many documents changed."""
        updated = 0
        for round_ in stamp_rounds(stamps):
            for i in range(0, len(round_), STAMP_PAGE):
                updated += await self._update_by_query(round_[i : i + STAMP_PAGE])
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
        updated = 0
        for _ in range(MAX_CONFLICT_ROUNDS):
            body: Mapping[str, Any]
            with self._translate("update_by_query"):
                try:
                    resp = await self._client.update_by_query(
                        index=self.index, query=query, script=script, conflicts="proceed", **extra
                    )
                    body = resp.body
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
        raise StorageError(msg)

    # ------------------------------------------------------------------ reads

    async def documents(self, ref: AggregateRef) -> list[dict[str, Any]]:
        """The stream's documents by version (the commit's fields; ``access_digest`` left out).
        A missing index holds none."""
        docs: list[dict[str, Any]] = []
        after: int | None = None
        extra: dict[str, Any] = {}
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
            hits = resp.body.get("hits", {}).get("hits", [])
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
                await self._client.close()
