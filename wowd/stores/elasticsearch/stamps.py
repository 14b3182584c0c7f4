"""The access attributes of one events index's streams: the stamps of a write and their look-ups.

When a record's access attributes differ from its stream's before it, its attributes are
stamped over the stream's earlier documents. What the stream held before is known from the
write itself (the record before it), else from an LRU of the last record written per aggregate,
else from the stored document of the version just before (a realtime ``_mget`` with routing),
else from the stream's latest document below it (a search after a refresh). A stored document
the record's own stamp rewrote already (:meth:`Seen.stamp_begun`: a stamp that failed halfway,
``_update_by_query`` keeping what it updated, before a restart, a handover or the LRU's
eviction) is stamped again, so that the stamp is finished. The stamps wait for a refresh of
the index shared with the other writes waiting for one (at most one ``_refresh`` per
``refresh_interval_s``) and go in one ``stamp_all`` with theirs. The LRU is updated only once
the stamps succeeded, so the retry of a failed write stamps again.

``stamp_all`` sends ``_update_by_query`` requests guarded twice, in the query and in the
painless script: a document is written when it has no ``access_version``, one below the
stamp's, or the same one with other attributes (compared by ``access_digest``). Version
conflicts are passed over (``conflicts: proceed``) and searched again after a refresh. An
answer holding failures comes with the highest failure's status (408 when it timed out), so it
is read from the client's error and classified per failure
(:mod:`wowd.stores.elasticsearch.faults`). A page holds at most :data:`STAMP_PAGE` stamps (the
query stays under Lucene's clause limit) and is routed only while the routing keeps the request
line short (``MAX_ROUTING_CHARS``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from elasticsearch import ApiError, AsyncElasticsearch

from wowd.errors import StorageError, StorageUnavailable
from wowd.metrics import STORE_UNAVAILABLE
from wowd.model import AccessStamp, Commit
from wowd.stores.elasticsearch.documents import (
    _STORE,
    MAX_CONFLICT_ROUNDS,
    STAMP_PAGE,
    Seen,
    _Known,
    _routing,
    _version,
    _Waiting,
    latest_search,
    previous_docs,
    stamp_query,
    stamp_rounds,
    stamp_script,
)
from wowd.stores.elasticsearch.faults import (
    Fault,
    Verdict,
    answer_body,
    classify,
    from_elasticsearch,
    item_failure,
    raise_verdict,
    refuse,
    translated,
    update_by_query_answer,
)

__all__ = ["AccessStamps"]

log = logging.getLogger(__name__)

_DOC_ERROR_STATUS = {
    "index_not_found_exception": 404,
    "index_closed_exception": 400,
    "routing_missing_exception": 400,
    "no_shard_available_action_exception": 503,
    "unavailable_shards_exception": 503,
    "es_rejected_execution_exception": 429,
}
"""The status Elasticsearch gives the exception a look-up's document error names (its answer
carries none; ``ExceptionsHelper.status``)."""


class AccessStamps:
    """The stamps of one index (see the module's docstring). ``client`` is the sink's (no
    retries); ``refresh`` makes every stamp refresh the index (tests); ``capacity`` is how many
    aggregates the LRU remembers; ``digest`` is the sink's digest of attributes."""

    def __init__(
        self,
        client: AsyncElasticsearch,
        index: str,
        *,
        refresh: bool,
        capacity: int,
        refresh_interval_s: float,
        stamp_timeout_s: float,
        digest: Callable[[Mapping[str, Any]], str],
    ) -> None:
        self._client = client
        self.index = index
        self._refresh = refresh
        self._capacity = capacity
        self._refresh_interval_s = refresh_interval_s
        self._stamp_timeout_s = stamp_timeout_s
        self._digest = digest
        self._known: OrderedDict[tuple[str, str], _Known] = OrderedDict()
        self._refresh_started = float("-inf")
        self._refreshed_as_of = float("-inf")
        """When the last completed refresh started (what it made searchable was written by then)."""
        self._refresh_running: anyio.Event | None = None
        self._waiting: list[_Waiting] = []
        self.refreshes = 0
        """``_refresh`` requests sent (the bench counts them)."""

    async def after_write(self, records: Sequence[Commit], digest_of: Mapping[int, str]) -> None:
        """The access stamps of a write whose documents are written (``digest_of``: each
        record's attributes' digest, by ``id()``), then the LRU of what each stream holds."""
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
            before = await self._previous_docs(unknown)
            missed = [c for c, d in zip(unknown, before, strict=True) if d is None]
            if missed:
                if not self._refresh:
                    await self.refresh(written)
                found = iter(await self._latest_docs(missed))
                before = [d if d is not None else next(found) for d in before]
            for first, seen in zip(unknown, before, strict=True):
                if seen is not None and (seen.digest != digest_of[id(first)] or seen.stamp_begun(first)):
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

    async def refresh(self, since: float | None = None) -> None:
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
                with translated(self.index, "refresh"):
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
                await self.refresh(since)
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

    async def _previous_docs(self, firsts: Sequence[Commit]) -> list[Seen | None]:
        """For each record, its stream's document of the version just before it, by one
        realtime ``_mget`` (None: not found)."""
        with translated(self.index, "mget"):
            resp = await self._client.mget(index=self.index, docs=previous_docs(firsts))
        docs = answer_body(self.index, "mget", resp).get("docs")
        if not isinstance(docs, list) or len(docs) != len(firsts):
            refuse("mget", f"elasticsearch mget on {self.index}: unexpected answer")
        seen: list[Seen | None] = []
        for c, d in zip(firsts, docs, strict=True):
            err = d.get("error")
            if err is not None:
                kind = str(err.get("type")) if isinstance(err, Mapping) else ""
                f = item_failure(_DOC_ERROR_STATUS.get(kind, 500), err, records=0)
                if f.type == "index_not_found_exception":
                    seen.append(None)
                    continue
                raise_verdict(classify(f, self.index, f"mget of {c.ref}"), "mget")
            seen.append(self._seen(d.get("_source"), c.version - 1) if d.get("found") else None)
        return seen

    def _seen(self, source: object, version: object) -> Seen | None:
        if not isinstance(source, Mapping):
            return None
        digest = source.get("access_digest")
        av = source.get("access_version")
        return Seen(
            digest=digest if isinstance(digest, str) else self._digest(source.get("access") or {}),
            access_version=av if isinstance(av, int) else None,
            version=int(version) if isinstance(version, int) else 0,
        )

    async def _latest_docs(self, firsts: Sequence[Commit]) -> list[Seen | None]:
        """For each record, its stream's latest document before it (None: no such document), by
        one ``_msearch`` over every shard's answer."""
        searches: list[dict[str, Any]] = []
        for c in firsts:
            header: dict[str, Any] = {"allow_partial_search_results": False}
            routing = _routing([c.ref.id])
            if routing is not None:
                header["routing"] = routing
            searches.append(header)
            searches.append(latest_search(c.ref, c.version))
        with translated(self.index, "msearch"):
            resp = await self._client.msearch(index=self.index, searches=searches)
        responses = answer_body(self.index, "msearch", resp).get("responses")
        if not isinstance(responses, list) or len(responses) != len(firsts):
            refuse("msearch", f"elasticsearch msearch on {self.index}: unexpected answer")
        seen: list[Seen | None] = []
        for c, r in zip(firsts, responses, strict=True):
            if "error" in r:
                f = item_failure(int(r.get("status", 500)), r["error"], records=0)
                if f.status == 404 and f.type == "index_not_found_exception":
                    seen.append(None)
                    continue
                raise_verdict(classify(f, self.index, f"search of {c.ref}"), "msearch")
            hits = r.get("hits", {}).get("hits", [])
            source = hits[0].get("_source") if hits else None
            seen.append(self._seen(source, source.get("version")) if isinstance(source, Mapping) else None)
        return seen

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
                await self.refresh()
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
            with translated(self.index, "update_by_query"):
                try:
                    resp = await client.update_by_query(
                        index=self.index, query=query, script=script, conflicts="proceed", **extra
                    )
                    body = answer_body(self.index, "update_by_query", resp)
                except ApiError as exc:
                    # failures or a timeout come as the answer itself with the highest failure's
                    # status (408 for a timeout); read them as such, classified per failure
                    if not (from_elasticsearch(exc.meta.headers) and update_by_query_answer(exc.body)):
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
            await self.refresh()
        STORE_UNAVAILABLE.labels(store=_STORE, operation="update_by_query").inc()
        raise StorageUnavailable(
            f"elasticsearch update_by_query on {self.index}: still version conflicts after {MAX_CONFLICT_ROUNDS} rounds"
        )

    def _check_failures(self, failures: Sequence[Mapping[str, Any]]) -> None:
        """The failures of an ``_update_by_query`` answer (it stopped at the first batch that
        had one: what it updated stays): transient when every one is, else the store's."""
        if not failures:
            return
        # bulk failures: {index, id, cause {type, reason}, status}; search (shard) failures:
        # {index, shard, node, status, reason {type, reason}}
        verdicts: list[tuple[Mapping[str, Any], Verdict]] = []
        for failure in failures:
            cause = failure.get("cause") or failure.get("reason") or {}
            f = item_failure(int(failure.get("status", 500)), cause, records=0)
            verdicts.append((failure, classify(f, self.index, "update_by_query")))
        first, verdict = next(((x, v) for x, v in verdicts if v.fault is not Fault.TRANSIENT), verdicts[0])
        where = f"id {first['id']}" if first.get("id") is not None else f"shard {first.get('shard')}"
        raise_verdict(
            Verdict(verdict.fault, f"{verdict.message} ({len(failures)} failures; {where})"), "update_by_query"
        )
