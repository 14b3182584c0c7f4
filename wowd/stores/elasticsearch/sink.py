"""The event sink of one aggregate type on Elasticsearch 9 (docs/stores.md).

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

The request bodies are built by the pure functions of :mod:`wowd.stores.elasticsearch.documents`
(the black-pipe tests in ``tests/elasticsearch`` assert them). Client errors stop here: an
``elasticsearch``/``elastic_transport`` exception becomes a :mod:`wowd.errors` one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import anyio
import orjson
from elastic_transport import ConnectionError as TransportConnectionError
from elastic_transport import ConnectionTimeout, SerializationError, TlsError, TransportError
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
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.documents import (
    _DIGEST_CACHE,
    _DOCUMENTS_PAGE,
    _OPTIONS,
    _STORE,
    _STORE_400,
    BULK_BYTES,
    BULK_FILTER_PATH,
    KEYWORD_IGNORE_ABOVE,
    MAX_CONFLICT_ROUNDS,
    MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_EVENTS,
    MAX_REQUEST_BYTES,
    RECORD_ERRORS,
    REFRESH_INTERVAL_S,
    STAMP_PAGE,
    TEMPLATE_NAME,
    TRANSIENT_STATUSES,
    BulkBody,
    _api_error,
    _api_reason,
    _is_transient,
    _is_update_by_query_answer,
    _Known,
    _routing,
    _tolerate_non_json,
    _version,
    _Waiting,
    access_digest,
    bulk_bodies,
    check_mapping,
    documents_search,
    events_mapping,
    index_name,
    index_template,
    latest_search,
    previous_docs,
    refusal,
    stamp_query,
    stamp_rounds,
    stamp_script,
    supported_version,
    unbounded_keywords,
)

log = logging.getLogger(__name__)

__all__ = ["ElasticsearchEventSink"]


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
