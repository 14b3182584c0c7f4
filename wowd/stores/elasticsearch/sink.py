"""The event sink of one aggregate type on Elasticsearch 9 (docs/stores.md).

One index per aggregate type, ``wow.<context>.<aggregate>.events``; one document per commit,
its id the commit's stream id (:func:`wowd.model.stream_id`), routed by aggregate id (an empty
aggregate id by :data:`EMPTY_ID_ROUTING`: Elasticsearch reads an empty routing as none).

- ``write`` sends the records as ``create``s in one ``_bulk`` (NDJSON built as bytes with
  orjson), split into bulks of about :data:`BULK_BYTES` when larger, each with a server-side
  ``timeout`` below the client's (:func:`bulk_timeout`). A record that cannot be sent (its id
  over :data:`MAX_ID_BYTES`, its lines over the request cap, a value JSON cannot hold) is
  refused before anything is sent with :class:`InvalidInput` naming it. A ``409`` item is a
  document written before (a retry, a replay, an old owner of the partition): it counts as
  written. Any other failure is classified by :mod:`wowd.stores.elasticsearch.faults` (one
  table): the store's refusal (:class:`StoreRefused`, naming the cause: the feed stalls),
  transient (:class:`StorageUnavailable`), or the record's own fault (:class:`SinkWriteError`
  naming the item: the feed sets it aside); the store's wins over the record's, the record's
  over transient. The items written stay, and the sink remembers them: the retry of a failed
  write sends only what was not written. The bulk answer is asked for with ``filter_path``
  (each item's id, status and error), and each item is checked to be the ``create`` of the id
  sent in its place; an answer without Elasticsearch's product header is not the cluster's.
- A missing index: an item answered ``index_not_found_exception`` (``action.auto_create_index``
  refuses events indices) makes the write transient under ``ddl auto`` (the next write creates
  the index again) and a refusal otherwise. The mapping is checked when the sink saw the index
  missing and a bulk then succeeded, when a bulk made the first document of a shard (``_seq_no``
  0: a new index, made by a write where the sink did not make it), and at most every
  :data:`MAPPING_CHECK_S` while it writes (another replica's write may have made the index
  again); a mapping without every field wowd writes, as wowd writes it, refuses that write and
  every later one (:class:`StoreRefused`, naming the index and the fields) until it fits. Under
  ``ddl auto`` the index template :data:`TEMPLATE_NAME` gives an index a write creates wowd's
  mapping; its settings come from the operator's :data:`CUSTOM_TEMPLATE`. A failed preparation
  is held off per index (:class:`~wowd.retry.Holdoff`): the writes meanwhile fail at once.
- Access stamps: after a write, the stamps of the aggregates whose access attributes changed
  (:mod:`wowd.stores.elasticsearch.stamps`).

The client given is used with ``retry_on_status=()`` and ``retry_on_timeout=False``: a 429 or
a 503 is the feed's to retry with backoff, not the client's at once, and a timed-out bulk or
update-by-query may still be running on the cluster. A pinned certificate
(:mod:`wowd.stores.elasticsearch.tls`) is learned before the first request.

The request bodies are built by the pure functions of :mod:`wowd.stores.elasticsearch.documents`
(the black-pipe tests in ``tests/elasticsearch`` assert them). Client errors stop here: an
``elasticsearch``/``elastic_transport`` exception becomes a :mod:`wowd.errors` one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn, cast

import anyio
import orjson
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
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit, stream_id
from wowd.retry import Backoff, Holdoff
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.documents import (
    _DIGEST_CACHE,
    _DOCUMENTS_PAGE,
    _OPTIONS,
    _STORE,
    BULK_BYTES,
    BULK_FILTER_PATH,
    CUSTOM_TEMPLATE,
    KEYWORD_IGNORE_ABOVE,
    MAPPING_CHECK_S,
    MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_EVENTS,
    MAX_REQUEST_BYTES,
    REFRESH_INTERVAL_S,
    TEMPLATE_NAME,
    BulkBody,
    _routing,
    access_digest,
    bulk_bodies,
    bulk_timeout,
    check_mapping,
    documents_search,
    events_mapping,
    index_name,
    index_template,
    supported_version,
    unbounded_keywords,
)
from wowd.stores.elasticsearch.faults import (
    Failure,
    Fault,
    Verdict,
    answer_body,
    classify,
    failure_of,
    item_failure,
    raise_verdict,
    refuse,
    tolerate_non_json,
    translated,
)
from wowd.stores.elasticsearch.stamps import AccessStamps
from wowd.stores.elasticsearch.tls import ensure_pinned

log = logging.getLogger(__name__)

__all__ = ["ElasticsearchEventSink"]


PREPARE_BACKOFF = Backoff(0.5, 30.0, jitter=True)
"""How long a failed preparation of the index holds the next off (per index, for every writer)."""
MAX_REMEMBERED_WRITTEN = 100_000
"""At most this many ids of documents written by failed writes are remembered (their retries
leave them out)."""


class ElasticsearchEventSink:
    """The event sink of one aggregate type (:class:`wowd.stores.base.EventSink`).

    ``client`` is an ``AsyncElasticsearch`` the caller owns (closed by :meth:`close` only with
    ``owns_client``); the sink uses it without retries on status or timeout, with
    ``request_timeout_s`` as its timeout, and has its transport hand back a body that is not JSON
    as text (for every user of that client: such a body is an error either way). ``refresh``
    makes every write and stamp refresh the index (tests). ``capacity`` is how many aggregates
    the access-attribute LRU remembers. ``bulk_bytes`` is the size a write is split at,
    ``max_request_bytes`` the cluster's ``http.max_content_length``. ``stamp_timeout_s`` is the
    client timeout of one ``_update_by_query``; ``refresh_interval_s`` how often at most the sink
    sends a ``_refresh`` (the writes needing one share it, and their stamps go in one request);
    ``mapping_check_s`` how often at most a write looks at the index's mapping again.
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
        request_timeout_s: float = 30.0,
        stamp_timeout_s: float = 300.0,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        mapping_check_s: float = MAPPING_CHECK_S,
        owns_client: bool = False,
    ) -> None:
        if capacity < 0:
            raise ConfigError(f"sink capacity: must be >= 0, got {capacity}")
        if not 0 < bulk_bytes <= max_request_bytes:
            raise ConfigError(f"sink bulk_bytes: must be in (0, {max_request_bytes}], got {bulk_bytes}")
        self.type = type
        self.index = index_name(type)
        self._own = client
        tolerate_non_json(client)
        self._client = client.options(retry_on_status=(), retry_on_timeout=False, request_timeout=request_timeout_s)
        self._bulk_timeout = bulk_timeout(request_timeout_s)
        self._ddl = Ddl(ddl)
        self._refresh = refresh
        self._bulk_bytes = bulk_bytes
        self._max_request_bytes = max_request_bytes
        self._max_document_bytes = max_document_bytes
        self._max_document_events = max_document_events
        self._owns_client = owns_client
        self._digests: dict[bytes, str] = {}
        self._written: OrderedDict[str, None] = OrderedDict()
        """Ids of documents that failed writes wrote: their retries leave them out."""
        self._index_missing = False
        self._stamps = AccessStamps(
            self._client,
            self.index,
            refresh=refresh,
            capacity=capacity,
            refresh_interval_s=refresh_interval_s,
            stamp_timeout_s=stamp_timeout_s,
            digest=self._digest,
        )
        self._made = False
        """The sink made the index just now: the first documents of its shards are expected."""
        self._mapping_problem: str | None = None
        """Why the index's mapping is not wowd's: every write is refused (:class:`StoreRefused`)
        until the mapping is checked again and fits."""
        self._mapping_check_s = mapping_check_s
        self._mapping_checked: float | None = None
        """When the mapping was last found right (None: no write yet)."""
        self._prepared = False
        self._prepare_lock: anyio.Lock | None = None
        self._holdoff = Holdoff(PREPARE_BACKOFF)
        self._prepare_error: StorageError | None = None

    @property
    def refreshes(self) -> int:
        """``_refresh`` requests sent (the bench counts them)."""
        return self._stamps.refreshes

    def __str__(self) -> str:
        hosts = ", ".join(node.base_url for node in self._client.transport.node_pool.all())
        return f"ElasticsearchEventSink(index {self.index} on {hosts or 'no hosts'})"

    __repr__ = __str__

    # ------------------------------------------------------------------ DDL

    async def prepare(self) -> None:
        """Makes sure of the events index, once, as the DDL mode says: ``auto`` installs the
        index template and creates the index with :func:`events_mapping` (an existing one is
        checked instead) and waits for its primary, ``validate`` requires it and checks its
        fields, ``none`` creates nothing and checks the mapping of an index that is there (one
        that is not is checked after the first write that creates it). A mapping that is not
        wowd's, a missing index under ``validate``, or any refusal is :class:`StoreRefused`;
        after a failure the next preparation is held off (:data:`PREPARE_BACKOFF`), and a call
        meanwhile fails at once with the same error."""
        if self._prepared:
            return
        await ensure_pinned(self._own)
        if self._prepare_lock is None:
            self._prepare_lock = anyio.Lock()
        async with self._prepare_lock:
            if self._prepared:
                return
            wait = self._holdoff.remaining()
            if wait > 0 and self._prepare_error is not None:
                error = self._prepare_error
                raise type(error)(f"{error} (the index is prepared again in {wait:.1f} s)")
            try:
                await self._prepare()
            except FormatError as exc:
                self._prepare_error = StoreRefused(str(exc))
                self._holdoff.failed()
                STORE_UNAVAILABLE.labels(store=_STORE, operation="prepare").inc()
                raise self._prepare_error from exc
            except StorageError as exc:
                self._prepare_error = exc
                self._holdoff.failed()
                raise
            self._holdoff.reset()
            self._prepare_error = None
            self._prepared = True

    async def _prepare(self) -> None:
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

    async def _put_template(self) -> None:
        """Installs (or replaces) the index template :data:`TEMPLATE_NAME`, composed of the
        operator's :data:`CUSTOM_TEMPLATE`, which it never writes."""
        body = index_template()
        with translated(self.index, "put_index_template"):
            await self._client.indices.put_index_template(
                name=TEMPLATE_NAME,
                index_patterns=body["index_patterns"],
                priority=body["priority"],
                composed_of=[CUSTOM_TEMPLATE],
                ignore_missing_component_templates=[CUSTOM_TEMPLATE],
                template=body["template"],
                meta=body["_meta"],
            )

    async def _create_index(self) -> bool:
        """Creates the index (the template's settings apply); False when it exists already (or
        is an alias)."""
        with translated(self.index, "create_index"):
            try:
                await self._client.indices.create(index=self.index, mappings=events_mapping())
            except ApiError as exc:
                f = failure_of(exc)
                if f.from_es and (
                    f.type == "resource_already_exists_exception"
                    or f.type == "invalid_index_name_exception"
                    and "already exists as alias" in f.reason
                ):
                    return False  # its mapping is checked instead (an alias: each index behind it)
                raise
        log.info("created the events index %s", self.index)
        self._index_missing = False
        self._made = True
        self._mapping_checked = anyio.current_time()
        return True

    async def _validate_mapping(self, *, missing_ok: bool = False) -> bool:
        """Checks that the stored mapping has every field wowd writes (:class:`FormatError`);
        False when the index is missing and ``missing_ok``."""
        with translated(self.index, "get_mapping"):
            try:
                resp = await self._client.indices.get_mapping(index=self.index)
            except ApiError as exc:
                f = failure_of(exc)
                if not (f.from_es and f.type == "index_not_found_exception"):
                    raise
                if missing_ok:
                    return False
                raise FormatError(f"the events index {self.index} does not exist (ddl {self._ddl})") from exc
        body = answer_body(self.index, "get_mapping", resp)
        if not body:
            raise FormatError(f"the events index {self.index}: unexpected mapping answer {body!r}")
        problems: list[str] = []
        for name, held in body.items():  # an alias or a data stream: each index behind it
            mappings = (held.get("mappings") or {}) if isinstance(held, Mapping) else {}
            where = "" if name == self.index else f" ({name})"
            problems += [p + where for p in check_mapping(mappings)]
            unbounded = unbounded_keywords(mappings)
            if unbounded:
                log.warning(
                    "the events index %s has keywords without ignore_above (%s): a value over 32766 bytes fails "
                    "its record; add ignore_above %d with the update mapping API",
                    name,
                    ", ".join(unbounded),
                    KEYWORD_IGNORE_ABOVE,
                )
        if problems:
            raise FormatError(
                f"the events index {self.index} has another layout (created by a write with a dynamic mapping?): "
                + "; ".join(problems)
            )
        self._index_missing = False
        self._mapping_checked = anyio.current_time()
        return True

    async def _wait_for_primary(self) -> None:
        with translated(self.index, "cluster_health"):
            resp = await self._client.options(ignore_status=408, request_timeout=45).cluster.health(
                index=self.index, wait_for_status="yellow", timeout="30s"
            )
        body = answer_body(self.index, "cluster_health", resp)
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
        """The bulks of the records (those a failed write wrote left out); then the access
        stamps of the aggregates whose attributes changed (see the module's docstring). Raises
        :class:`InvalidInput` naming a record that cannot be sent (nothing is sent then),
        :class:`StoreRefused` (the store refuses: nothing is the records'),
        :class:`StorageUnavailable` (transient) or :class:`SinkWriteError` naming the item (its
        record's own fault); the items written stay."""
        if not records:
            return
        await self.prepare()
        now = anyio.current_time()
        if self._mapping_checked is None:
            self._mapping_checked = now  # the interval of the periodic look starts
        if self._mapping_problem is not None:
            await self._recheck_mapping()
        elif not self._index_missing and now - self._mapping_checked >= self._mapping_check_s:
            await self._check_created(missing_ok=True)  # another replica's write may have made it again
        try:
            digests = [self._digest(c.access) for c in records]
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"access attributes cannot be digested: {exc}", field="access") from exc
        digest_of = {id(c): d for c, d in zip(records, digests, strict=True)}
        pending = [
            (c, d)
            for c, d in zip(records, digests, strict=True)
            if not self._written or stream_id(c.ref, c.version) not in self._written
        ]
        bodies = bulk_bodies(
            [c for c, _d in pending],
            [d for _c, d in pending],
            bulk_bytes=self._bulk_bytes,
            max_request_bytes=self._max_request_bytes,
            max_document_bytes=self._max_document_bytes,
            max_document_events=self._max_document_events,
        )
        written: list[str] = []
        try:
            new_shard = False
            for body in bodies:
                new_shard = await self._bulk(body, written) or new_shard
            if self._index_missing or (new_shard and not self._made):
                await self._check_created()
            self._made = False
            await self._stamps.after_write(records, digest_of)
        except BaseException:
            if self._mapping_problem is None:  # else they went into an index that is not wowd's
                self._remember_written(written)
            raise
        if self._written:
            for c in records:
                self._written.pop(stream_id(c.ref, c.version), None)

    def _remember_written(self, ids: Iterable[str]) -> None:
        for _id in ids:
            self._written[_id] = None
        while len(self._written) > MAX_REMEMBERED_WRITTEN:
            self._written.popitem(last=False)

    async def _check_created(self, *, missing_ok: bool = False) -> None:
        """The index may be new (a write made a shard's first document, went through where the
        index was missing, or the last look is :data:`MAPPING_CHECK_S` old: another replica's
        write may have made it again): its mapping must have every field wowd writes, else every
        write is refused (:class:`StoreRefused`) until it has. With ``missing_ok``, a missing
        index is looked at after the write that makes it."""
        try:
            if not await self._validate_mapping(missing_ok=missing_ok):
                self._index_missing = True
        except FormatError as exc:
            self._mapping_problem = str(exc)
            self._written.clear()  # written into an index that is not wowd's: to be written again
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
        self._mapping_problem = None
        if not exists and self._ddl is Ddl.AUTO:
            self._prepared = False
            await self.prepare()

    async def _bulk(self, bulk: BulkBody, written: list[str]) -> bool:
        """Sends one bulk, adding to ``written`` the ids of the items written (or written
        before); True when an item was the first document of a shard (``_seq_no`` 0: a new
        index or shard)."""
        records = bulk.records
        extra: dict[str, Any] = {"timeout": self._bulk_timeout}
        if self._refresh:
            extra["refresh"] = True
        started = time.perf_counter()
        try:
            with translated(self.index, "bulk", records=len(records)):
                resp = await self._client.bulk(
                    operations=cast("Sequence[Mapping[str, Any]]", bulk.body),
                    index=self.index,
                    filter_path=BULK_FILTER_PATH,
                    **extra,
                )
        except SinkWriteError as exc:
            raise SinkWriteError(f"{exc} (bulk of {len(records)} items, the first {bulk.ids[0]})") from exc.__cause__
        finally:
            SINK_BULK_SECONDS.observe(time.perf_counter() - started)
        items = answer_body(self.index, "bulk", resp).get("items")
        if not isinstance(items, list) or len(items) != len(records):
            got = len(items) if isinstance(items, list) else "no"
            refuse("bulk", f"elasticsearch bulk on {self.index}: {len(records)} creates answered with {got}")
        failed: list[tuple[str, Verdict, Failure]] = []
        new_shard = False
        missing_index = False
        statuses: Counter[int] = Counter()
        for _id, item in zip(bulk.ids, items, strict=True):
            result = item.get("create") if isinstance(item, Mapping) and len(item) == 1 else None
            if not isinstance(result, Mapping) or result.get("_id") != _id:
                refuse(
                    "bulk", f"elasticsearch bulk on {self.index}: the create of {_id} answered with {str(item)[:200]}"
                )
            assert isinstance(result, Mapping)
            status = int(result.get("status", 0))
            statuses[status] += 1
            if status in (200, 201, 409):
                written.append(_id)
                new_shard = new_shard or (status == 201 and result.get("_seq_no") == 0)
                continue
            f = item_failure(status, result.get("error"), records=1)
            missing_index = missing_index or (status == 404 and f.type == "index_not_found_exception")
            failed.append((_id, classify(f, self.index, "bulk"), f))
        for code, n in statuses.items():
            SINK_ITEMS.labels(status=str(code)).inc(n)
        if failed:
            self._bulk_failed(failed, len(records), missing_index)
        return new_shard

    def _bulk_failed(self, failed: Sequence[tuple[str, Verdict, Failure]], sent: int, missing_index: bool) -> NoReturn:
        """Raises for the items of a bulk that failed: the store's refusal first, then a
        record's fault, else transient."""
        by_fault = {v.fault: (_id, v, f) for _id, v, f in reversed(failed)}  # the first of each fault
        _id, verdict, f = by_fault.get(Fault.STORE) or by_fault.get(Fault.RECORD) or failed[0]
        summary = f"{len(failed)} of {sent} items not written to {self.index}; item {_id}: {f.detail}"
        if missing_index:
            self._index_missing = True
            self._written.clear()  # what failed writes wrote went with the index
            if self._ddl is Ddl.AUTO:
                self._prepared = False  # the next write creates it again
                STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
                raise StorageUnavailable(f"the events index is missing; creating it again: {summary}")
            refuse("bulk", f"the events index {self.index} does not exist (ddl {self._ddl}): {summary}")
        if verdict.fault is Fault.STORE:
            # the store's own reason, not the records': nothing is set aside, the feed stalls
            refuse("bulk", f"{verdict.message} ({summary})")
        if verdict.fault is Fault.RECORD:
            log.error("sink write refused: %s", summary)
            raise SinkWriteError(summary)
        STORE_UNAVAILABLE.labels(store=_STORE, operation="bulk").inc()
        raise StorageUnavailable(summary)

    # ------------------------------------------------------------------ stamps

    async def stamp(self, ref: AggregateRef, access: Mapping[str, Any], as_of: int, from_: int, until: int) -> int:
        """One ``_update_by_query`` (searched again after version conflicts); answers how many
        documents it changed."""
        return await self.stamp_all([AccessStamp(ref=ref, access=access, as_of=as_of, from_=from_, until=until)])

    async def stamp_all(self, stamps: Sequence[AccessStamp]) -> int:
        """The stamps, by :meth:`AccessStamps.stamp_all`; answers how many documents changed."""
        await ensure_pinned(self._own)
        return await self._stamps.stamp_all(stamps)

    # ------------------------------------------------------------------ checks

    async def server_version(self) -> tuple[str, str]:
        """The cluster's version number and distribution, as ``GET /`` answers it, asked with
        the client's credentials and without its ``compatible-with=9`` headers, so that a server
        of another major version answers too (an 8.x server refuses them: 400
        ``media_type_header_exception``)."""
        await ensure_pinned(self._own)
        headers = {k: v for k, v in self._client._headers.items() if k.lower() not in ("accept", "content-type")}
        headers["accept"] = "application/json"
        with translated(self.index, "info"):
            resp = await self._client.transport.perform_request("GET", "/", headers=headers)
        if resp.meta.status >= 300:  # the transport hands back an error answer as it is
            raise_verdict(classify(failure_of(ApiError("info", resp.meta, resp.body)), self.index, "info"), "info")
        body = answer_body(self.index, "info", resp)
        version = body.get("version") or {}
        if not isinstance(version, Mapping) or not isinstance(version.get("number"), str):
            raise StorageError(f"elasticsearch info: no version in {str(body)[:200]!r}")
        return version["number"], str(version.get("distribution") or "elasticsearch")

    async def check_version(self) -> str:
        """``"<number> (supported)"`` for an Elasticsearch 9.x cluster; a :class:`StorageError`
        naming the version and the supported ones otherwise."""
        return supported_version(*await self.server_version())

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
        await ensure_pinned(self._own)
        try:
            with translated(self.index, "has_privileges"):
                resp = await self._client.security.has_privileges(
                    cluster=cluster, index=[{"names": [self.index], "privileges": index}]
                )
        except StorageError as exc:
            cause = exc.__cause__
            reason = failure_of(cause).reason.lower() if isinstance(cause, ApiError) else ""
            if "must be explicitly enabled" in reason or "security is not enabled" in reason:
                return None  # a cluster with security off (SecurityActionFilter's 500)
            raise
        body = answer_body(self.index, "has_privileges", resp)
        missing = [f"cluster {p}" for p, held in (body.get("cluster") or {}).items() if not held]
        for name, held_of in (body.get("index") or {}).items():
            missing += [f"index {p} on {name}" for p, held in held_of.items() if not held]
        return missing

    # ------------------------------------------------------------------ reads

    async def documents(self, ref: AggregateRef) -> list[dict[str, Any]]:
        """The stream's documents by version (the commit's fields; ``access_digest`` left out).
        A missing index holds none."""
        await ensure_pinned(self._own)
        docs: list[dict[str, Any]] = []
        after: int | None = None
        extra: dict[str, Any] = {"allow_partial_search_results": False}
        routing = _routing([ref.id])
        if routing is not None:
            extra["routing"] = routing
        while True:
            with translated(self.index, "search"):
                try:
                    resp = await self._client.search(index=self.index, **documents_search(ref, after), **extra)
                except ApiError as exc:
                    f = failure_of(exc)
                    if f.from_es and f.type == "index_not_found_exception":
                        return docs
                    raise
            hits = answer_body(self.index, "search", resp).get("hits", {}).get("hits", [])
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
            with translated(self.index, "close"):
                await self._own.close()
