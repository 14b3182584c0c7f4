"""Black-pipe tests of ElasticsearchEventSink: the real AsyncElasticsearch client over a socket
to a fake that answers as Elasticsearch 9 does (``fake_es``); each test scripts the answers and
asserts the requests on the wire."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch import fake_es
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, serving
from wowd.errors import SinkWriteError, StorageUnavailable, StoreRefused
from wowd.metrics import SINK_BULK_SECONDS, SINK_ITEMS
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit, DomainEvent
from wowd.stores.base import Ddl, EventSink
from wowd.stores.elasticsearch import ElasticsearchEventSink, events_mapping, index_name
from wowd.stores.elasticsearch.documents import (
    MAX_CONFLICT_ROUNDS,
    STAMP_CLAUSE_LEAVES,
    STAMP_PAGE,
    STAMP_SCRIPT,
    access_digest,
    index_template,
    stamp_clause,
    stamp_query,
)

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"
P = f"/{INDEX}"
TEMPLATE = "/_index_template/wowd-events"
A = {"owner_id": "u1", "space_id": "s1", "tags": ["x"]}
B = {"owner_id": "u2", "space_id": "s1", "tags": ["x"]}
C = {"owner_id": "u3", "space_id": "s2", "tags": []}


def ref(id: str, tenant: str = "(0)") -> AggregateRef:
    return AggregateRef(context="ctx", aggregate="order", tenant_id=tenant, id=id)


def commit(id: str, version: int, access: dict[str, Any] = A, access_version: int = 1, tenant: str = "(0)") -> Commit:
    return Commit(
        ref=ref(id, tenant),
        version=version,
        command_id=f"cmd-{id}-{version}",
        request_id=f"req-{id}-{version}",
        create_time=1_700_000_000_000 + version,
        events=(DomainEvent(id=f"ev-{id}-{version}", name="OrderChanged", body={"n": version, "deep": {"a": [1]}}),),
        header={"user_agent": "test"},
        access=access,
        access_version=access_version,
    )


@pytest.fixture
def fake() -> Iterator[FakeElasticsearch]:
    with serving() as server:
        yield server


@pytest.fixture
async def client(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    es = AsyncElasticsearch(fake.url, max_retries=0, request_timeout=5)
    try:
        yield es
    finally:
        await es.close()


def sink_of(client: AsyncElasticsearch, **kwargs: Any) -> ElasticsearchEventSink:
    """A sink; by default ``ddl none`` and prepared already (its mapping check is tested on its own),
    so that a test's requests are the write's."""
    ready = "ddl" not in kwargs
    kwargs.setdefault("ddl", Ddl.NONE)
    sink = ElasticsearchEventSink(client, TYPE, **kwargs)
    if ready:
        sink._prepared = True
    return sink


def count(status: str) -> float:
    value = SINK_ITEMS.labels(status=status)._value.get()
    assert isinstance(value, float)
    return value


def _count(histogram: Any) -> float:
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return float(sample.value)
    raise AssertionError("no _count sample")


# --------------------------------------------------------------------------- names, mapping


def test_index_name_and_mapping() -> None:
    assert index_name(TYPE) == INDEX
    m = events_mapping()
    assert m["dynamic"] == "strict"
    p = m["properties"]
    assert p["tenant_id"] == p["aggregate_id"] == p["access_digest"] == {"type": "keyword"}
    # free-form keywords: a value over ignore_above is kept in _source, not indexed (no immense term)
    free = {"type": "keyword", "ignore_above": 8191}
    assert p["request_id"] == p["command_id"] == p["owner_id"] == p["space_id"] == free
    assert all(p["events"]["properties"][k] == free for k in ("id", "name", "revision", "body_type"))
    assert all(p["access"]["properties"][k] == free for k in ("owner_id", "space_id", "tags"))
    assert p["create_time"]["type"] == "date"
    assert p["events"]["type"] == "nested"
    assert p["events"]["properties"]["body"] == {"type": "object", "enabled": False}
    assert p["header"] == {"type": "object", "enabled": False}


def test_the_access_digest_stays_what_documents_hold() -> None:
    # documents written before hold these digests: another digest would re-stamp every stream
    assert access_digest(A) == "5f0e2663b0f254e857edd739753c5fce"
    assert access_digest({"owner_id": "ü", "tags": [], "n": 1.5}) == "27c374efd97bb57106ba0abd6f5378c3"


async def test_is_an_event_sink_named_by_index_and_hosts(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client)
    assert isinstance(sink, EventSink)
    assert INDEX in str(sink) and fake.url in str(sink)


# --------------------------------------------------------------------------- write


async def test_one_bulk_of_creates_with_stream_ids_and_routing(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client)
    records = [commit("o:1", 1), commit("o:1", 2), commit("b/2", 1, tenant="t 1")]
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201, 201, 201))
    before = count("201")
    bulks = _count(SINK_BULK_SECONDS)
    await sink.write(records)
    assert _count(SINK_BULK_SECONDS) == bulks + 1
    (req,) = fake.take()
    assert "refresh" not in req.params
    assert req.headers["content-type"].startswith("application/vnd.elasticsearch+x-ndjson")
    lines = req.ndjson()
    assert lines[0::2] == [
        {"create": {"_id": "%280%29:o%3A1:1", "routing": "o:1"}},
        {"create": {"_id": "%280%29:o%3A1:2", "routing": "o:1"}},
        {"create": {"_id": "t%201:b%2F2:1", "routing": "b/2"}},
    ]
    doc = lines[1]
    assert doc == {
        "tenant_id": "(0)",
        "aggregate_id": "o:1",
        "version": 1,
        "command_id": "cmd-o:1-1",
        "request_id": "req-o:1-1",
        "create_time": 1_700_000_000_001,
        "header": {"user_agent": "test"},
        "events": [
            {
                "id": "ev-o:1-1",
                "name": "OrderChanged",
                "revision": "0.0.1",
                "body_type": "",
                "body": {"n": 1, "deep": {"a": [1]}},
            }
        ],
        "owner_id": "u1",
        "space_id": "s1",
        "access": A,
        "access_version": 1,
        "access_digest": access_digest(A),
        "deleted": False,
    }
    assert count("201") == before + 3


async def test_refresh_param_only_when_refresh_is_true(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    await sink_of(client, refresh=True).write([commit("a", 1)])
    (req,) = fake.take()
    assert req.params["refresh"] == "true"


async def test_transient_items_fail_the_write_and_its_retry_sends_only_what_was_not_written(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client)
    records = [commit("a", 1), commit("b", 1), commit("c", 1)]
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201, 409, 429))
    with pytest.raises(StorageUnavailable, match=r"1 of 3 items.*%280%29:c:1.*429"):
        await sink.write(records)
    # the retry under 429 pressure: the items written (201) or written before (409) stay out
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    await sink.write(records)
    first, retry = fake.take()
    assert [a["create"]["_id"] for a in retry.ndjson()[0::2]] == ["%280%29:c:1"]
    assert retry.ndjson()[1] == first.ndjson()[5]
    # once written, nothing is remembered: the same records again (a replay) are all sent
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(409, 409, 409))
    await sink.write(records)
    assert fake.take()[0].body == first.body


async def test_a_refused_item_fails_the_write_naming_it(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client)
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201, 429, 400))
    with pytest.raises(SinkWriteError, match=r"%280%29:c:1.*\[400\] document_parsing_exception") as info:
        await sink.write([commit("a", 1), commit("b", 1), commit("c", 1)])
    assert not isinstance(info.value, StorageUnavailable)


async def test_request_level_answers_are_classified(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client)
    fake.on("PUT", f"{P}/_bulk", 503, fake_es.error(503, "cluster_block_exception", "blocked"))
    with pytest.raises(StorageUnavailable, match="503"):
        await sink.write([commit("a", 1)])
    fake.on("PUT", f"{P}/_bulk", 400, fake_es.error(400, "illegal_argument_exception", "bad bulk"))
    with pytest.raises(SinkWriteError, match="bad bulk.*%280%29:a:1"):
        await sink.write([commit("a", 1)])
    # 429, 502, 503, 504 are transient; a 500 is the store failing, not the record: a refusal
    fake.on("PUT", f"{P}/_bulk", 502, fake_es.error(502, "bad_gateway", "proxy"))
    with pytest.raises(StorageUnavailable, match="502"):
        await sink.write([commit("a", 1)])
    fake.on("PUT", f"{P}/_bulk", 500, fake_es.error(500, "null_pointer_exception", "a defect"))
    with pytest.raises(StoreRefused, match=r"\[500\] null_pointer_exception"):
        await sink.write([commit("a", 1)])


async def test_a_timeout_is_transient(fake: FakeElasticsearch) -> None:
    slow = fake_es.Held(fake_es.bulk_answer(201))
    fake.on("PUT", f"{P}/_bulk", body=slow)
    es = AsyncElasticsearch(fake.url, max_retries=0)
    try:
        with pytest.raises(StorageUnavailable, match="bulk"):
            await sink_of(es, request_timeout_s=0.2).write([commit("a", 1)])
        assert await anyio.to_thread.run_sync(slow.reached.wait, 5)  # the node had the request
    finally:
        slow.released.set()
        await es.close()


async def test_connection_refused_is_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    es = AsyncElasticsearch(f"http://127.0.0.1:{port}", request_timeout=2)
    sink = ElasticsearchEventSink(es, TYPE, ddl=Ddl.NONE, owns_client=True)
    try:
        with pytest.raises(StorageUnavailable, match="Connection error"):
            await sink.write([commit("a", 1)])
    finally:
        await sink.close()


# --------------------------------------------------------------------------- stamps


def _guard(as_of: int, access: dict[str, Any]) -> dict[str, Any]:
    return {
        "bool": {
            "should": [
                {"bool": {"must_not": [{"exists": {"field": "access_version"}}]}},
                {"range": {"access_version": {"lt": as_of}}},
                {
                    "bool": {
                        "filter": [{"term": {"access_version": as_of}}],
                        "must_not": [{"term": {"access_digest": access_digest(access)}}],
                    }
                },
            ],
            "minimum_should_match": 1,
        }
    }


def _clause(r: AggregateRef, lo: int, hi: int, as_of: int, access: dict[str, Any]) -> dict[str, Any]:
    return {
        "bool": {
            "filter": [
                {"term": {"tenant_id": r.tenant_id}},
                {"term": {"aggregate_id": r.id}},
                {"range": {"version": {"gte": lo, "lte": hi}}},
                _guard(as_of, access),
            ]
        }
    }


def _params(access: dict[str, Any], as_of: int, lo: int, hi: int) -> dict[str, Any]:
    return {
        "access": access,
        "owner_id": access["owner_id"],
        "space_id": access["space_id"],
        "as_of": as_of,
        "from_version": lo,
        "until_version": hi,
        "digest": access_digest(access),
    }


async def test_stamp_is_one_guarded_update_by_query(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client)
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=2, noops=1))
    assert await sink.stamp(ref("a"), B, 4, 1, 3) == 2
    (req,) = fake.take()
    assert req.params == {"routing": "a"}
    body = req.json()
    assert body["conflicts"] == "proceed"
    assert body["query"] == _clause(ref("a"), 1, 3, 4, B)
    assert body["script"] == {
        "lang": "painless",
        "source": STAMP_SCRIPT,
        "params": {"stamps": {"(0)": {"a": _params(B, 4, 1, 3)}}},
    }
    # the script holds the same guard: noop outside the versions or when not newer/other
    for part in ("ctx.op = 'noop'", "av == null", "av < s.as_of", "ctx._source.access_digest != s.digest"):
        assert part in STAMP_SCRIPT


async def test_stamp_all_is_one_request_per_round(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client, refresh=True)
    stamps = [
        AccessStamp(ref=ref("a"), access=B, as_of=3, from_=1, until=2),
        AccessStamp(ref=ref("b", "t2"), access=C, as_of=5, from_=1, until=4),
        AccessStamp(ref=ref("a"), access=B, as_of=3, from_=1, until=2),  # the same again: once
        AccessStamp(ref=ref("a"), access=C, as_of=6, from_=1, until=5),  # another of a: next round
    ]
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=6))
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=5))
    assert await sink.stamp_all(stamps) == 11
    first, second = fake.take()
    assert first.params == {"routing": "a,b", "refresh": "true"}
    assert first.json()["conflicts"] == "proceed"
    assert first.json()["query"] == {
        "bool": {
            "should": [_clause(ref("a"), 1, 2, 3, B), _clause(ref("b", "t2"), 1, 4, 5, C)],
            "minimum_should_match": 1,
        }
    }
    assert first.json()["script"]["params"] == {
        "stamps": {"(0)": {"a": _params(B, 3, 1, 2)}, "t2": {"b": _params(C, 5, 1, 4)}}
    }
    assert second.json()["query"] == _clause(ref("a"), 1, 5, 6, C)
    assert second.json()["script"]["params"] == {"stamps": {"(0)": {"a": _params(C, 6, 1, 5)}}}


async def test_version_conflicts_make_the_stamp_search_again(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client)
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=1, version_conflicts=2))
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=2))
    assert await sink.stamp(ref("a"), B, 4, 1, 3) == 3
    first, refresh, second = fake.take()
    assert (refresh.method, refresh.path) == ("POST", f"{P}/_refresh")
    assert first.body == second.body


async def test_version_conflicts_without_end_are_transient(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client, refresh_interval_s=0.01)
    for _ in range(MAX_CONFLICT_ROUNDS):
        fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(version_conflicts=1))
        fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    with pytest.raises(StorageUnavailable, match="version conflicts"):
        await sink.stamp(ref("a"), B, 4, 1, 3)


async def test_stamp_failures_are_classified(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    """Elasticsearch sends an update_by_query answer holding failures with the highest failure's
    status (408 when it timed out), so the client raises; the sink reads the answer from it."""
    sink = sink_of(client)

    def answer(**kwargs: Any) -> None:
        body = fake_es.ubq_answer(**kwargs)
        fake.on("POST", f"{P}/_update_by_query", fake_es.ubq_status(body), body)

    # a stamp carries no record of the write: what it meets is the store's (a stall), never a record's
    mapping = fake_es.bulk_failure(INDEX, "x", 400, "strict_dynamic_mapping_exception", "strict")
    answer(updated=1, failures=[mapping])
    with pytest.raises(StoreRefused, match=r"\[400\] strict_dynamic_mapping_exception: strict .*id x"):
        await sink.stamp(ref("a"), B, 4, 1, 3)
    rejected = fake_es.bulk_failure(INDEX, "y", 429, "es_rejected_execution_exception", "queue full")
    answer(failures=[rejected])
    with pytest.raises(StorageUnavailable, match="es_rejected_execution_exception") as info:
        await sink.stamp(ref("a"), B, 4, 1, 3)
    assert not isinstance(info.value, StoreRefused)
    # answered 429 (the highest status), yet one failure is not transient: not transient
    answer(failures=[rejected, mapping])
    with pytest.raises(StoreRefused, match=r"\[400\] strict_dynamic_mapping_exception.*2 failures; id x"):
        await sink.stamp(ref("a"), B, 4, 1, 3)
    answer(failures=[fake_es.search_failure(INDEX, 503, "no_shard_available_action_exception", "gone")])
    with pytest.raises(StorageUnavailable, match=r"\[503\] no_shard_available_action_exception.*shard 0") as info:
        await sink.stamp(ref("a"), B, 4, 1, 3)
    assert not isinstance(info.value, StoreRefused)
    timed_out = {**fake_es.ubq_answer(updated=1), "timed_out": True}
    fake.on("POST", f"{P}/_update_by_query", fake_es.ubq_status(timed_out), timed_out)
    with pytest.raises(StorageUnavailable, match="timed out"):
        await sink.stamp(ref("a"), B, 4, 1, 3)
    answer(updated=2)
    assert await sink.stamp(ref("a"), B, 4, 1, 3) == 2
    # a script that fails at run time fails the whole request (an error body)
    fake.on("POST", f"{P}/_update_by_query", 400, fake_es.script_error("runtime error", "null_pointer_exception", "x"))
    with pytest.raises(StoreRefused, match="script_exception: runtime error .caused by null_pointer_exception"):
        await sink.stamp(ref("a"), B, 4, 1, 3)


async def test_stamp_pages_stay_under_the_clause_limit(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    # Lucene counts every leaf of a query against maxClauseCount (a range on a long is two, a
    # must_not-only bool gains a match-all), which ES 9 sizes with a floor of 1024: a full page
    # stays under the floor, counted as the fake counts it
    stamps = [AccessStamp(ref=ref(f"a{i}"), access=B, as_of=3, from_=1, until=2) for i in range(STAMP_PAGE + 1)]
    mapping = events_mapping()
    assert fake_es.lucene_clauses(stamp_clause(stamps[0]), mapping) == STAMP_CLAUSE_LEAVES == 10
    assert fake_es.lucene_clauses(stamp_query(stamps[:STAMP_PAGE]), mapping) <= 1000
    longer = [AccessStamp(ref=ref(f"a{i}"), access=B, as_of=3, from_=1, until=2) for i in range(103)]
    assert fake_es.lucene_clauses(stamp_query(longer), mapping) > 1024  # a page this long would fail
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=2 * STAMP_PAGE))
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=2))
    assert await sink_of(client).stamp_all(stamps) == 2 * STAMP_PAGE + 2
    first, second = fake.take()
    assert len(first.json()["query"]["bool"]["should"]) == STAMP_PAGE
    assert second.json()["query"] == _clause(ref(f"a{STAMP_PAGE}"), 1, 2, 3, B)


# --------------------------------------------------------------------------- access changes in writes


def _latest(version: int, access: dict[str, Any]) -> dict[str, Any]:
    source = {"version": version, "access": access, "access_version": version, "access_digest": access_digest(access)}
    return fake_es.hits(INDEX, [source])


async def test_a_change_inside_one_write_stamps_without_a_search(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client)
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201, 201, 201))
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=2))
    await sink.write([commit("a", 1, A, 1), commit("a", 2, B, 2), commit("a", 3, B, 2)])
    bulk, refresh, ubq = fake.take()
    assert refresh.path == f"{P}/_refresh"
    assert ubq.json()["query"] == _clause(ref("a"), 1, 1, 2, B)


async def test_the_lru_detects_a_change_without_a_search(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client)
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    await sink.write([commit("a", 1, A, 1)])  # version 1: nothing before it, no search
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    await sink.write([commit("a", 2, A, 1)])  # the same attributes: known from the LRU
    assert [r.path for r in fake.take()] == [f"{P}/_bulk", f"{P}/_bulk"]
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=2))
    await sink.write([commit("a", 3, B, 3)])
    reqs = fake.take()
    assert [r.path for r in reqs] == [f"{P}/_bulk", f"{P}/_refresh", f"{P}/_update_by_query"]
    assert reqs[2].json()["query"] == _clause(ref("a"), 1, 2, 3, B)


def _mget(*found: tuple[str, dict[str, Any]] | None) -> Callable[[fake_es.Recorded], dict[str, Any]]:
    """An ``_mget`` answer: per doc asked, its source (found) or None (not found)."""

    def answer(req: fake_es.Recorded) -> dict[str, Any]:
        docs = []
        for spec, hit in zip(req.json()["docs"], found, strict=True):
            doc: dict[str, Any] = {"_index": INDEX, "_id": spec["_id"], "found": hit is not None}
            if hit is not None:
                doc.update(_version=1, _seq_no=1, _primary_term=1, _routing=spec["routing"], _source=hit[1])
            docs.append(doc)
        return {"docs": docs}

    return answer


def _stored(access: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("", {"access_digest": access_digest(access), "access": access})


async def test_an_aggregate_not_in_the_lru_reads_its_previous_document(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client, capacity=1)
    # b and c are not known: the documents of their previous versions are read in real time, no refresh
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201, 201))
    fake.on("POST", f"{P}/_mget", body=_mget(_stored(B), _stored(A)))
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=4))
    await sink.write([commit("b", 5, C, 5), commit("c", 3, A, 1)])
    bulk, mget, refresh, ubq = fake.take()
    assert mget.json() == {
        "docs": [
            {"_id": "%280%29:b:4", "routing": "b", "_source": ["access_digest", "access", "access_version"]},
            {"_id": "%280%29:c:2", "routing": "c", "_source": ["access_digest", "access", "access_version"]},
        ]
    }
    assert mget.params == {}  # realtime (the default): a document not refreshed yet is read
    assert refresh.path == f"{P}/_refresh"  # before the stamp only
    # b changed (B -> C) and is stamped; c did not (A -> A)
    assert ubq.json()["query"] == _clause(ref("b"), 1, 4, 5, C)
    # capacity 1: only c is remembered, so b is read again (same attributes: no stamp)
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    fake.on("POST", f"{P}/_mget", body=_mget(_stored(C)))
    await sink.write([commit("b", 6, C, 5)])
    assert [r.path for r in fake.take()] == [f"{P}/_bulk", f"{P}/_mget"]
    # b is remembered now (and c forgotten): no read
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    await sink.write([commit("b", 7, C, 5)])
    assert [r.path for r in fake.take()] == [f"{P}/_bulk"]


async def test_a_previous_document_not_found_is_searched_on_every_shard(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client)
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201, 201))
    fake.on("POST", f"{P}/_mget", body=_mget(None, _stored(A)))
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_msearch", body=fake_es.msearch_answer(_latest(3, B)))
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=3))
    await sink.write([commit("b", 5, C, 5), commit("c", 3, A, 1)])
    bulk, mget, refresh, msearch, ubq = fake.take()
    lines = msearch.ndjson()
    assert len(lines) == 2  # only the miss
    assert lines[0] == {"allow_partial_search_results": False, "routing": "b"}  # a missed shard is a missed stamp
    assert lines[1] == {
        "query": {
            "bool": {
                "filter": [
                    {"term": {"tenant_id": "(0)"}},
                    {"term": {"aggregate_id": "b"}},
                    {"range": {"version": {"lt": 5}}},
                ]
            }
        },
        "sort": [{"version": {"order": "desc"}}],
        "size": 1,
        "_source": ["version", "access", "access_version", "access_digest"],
    }
    assert ubq.json()["query"] == _clause(ref("b"), 1, 4, 5, C)


async def test_a_failed_stamp_is_stamped_again_by_the_retry(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client, refresh_interval_s=0.05)  # the retry's refresh is not held back
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    await sink.write([commit("a", 1, A, 1)])
    fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_update_by_query", 429, fake_es.error(429, "es_rejected_execution_exception", "full"))
    with pytest.raises(StorageUnavailable):
        await sink.write([commit("a", 2, B, 2)])
    fake.on("POST", f"{P}/_refresh", body=fake_es.refreshed())
    fake.on("POST", f"{P}/_update_by_query", body=fake_es.ubq_answer(updated=1))
    await sink.write([commit("a", 2, B, 2)])  # its document was written: only the stamp again
    retry = fake.take()[-2:]
    assert [r.path for r in retry] == [f"{P}/_refresh", f"{P}/_update_by_query"]
    assert retry[-1].json()["query"] == _clause(ref("a"), 1, 1, 2, B)


# --------------------------------------------------------------------------- prepare


MAPPING_ANSWER = {INDEX: {"mappings": fake_es.stored_mapping(events_mapping())}}


async def test_prepare_auto_creates_the_index_and_waits_for_its_primary_once(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client, ddl=Ddl.AUTO)
    fake.on("PUT", TEMPLATE, body={"acknowledged": True})
    fake.on("PUT", P, body=fake_es.created(INDEX))
    fake.on("GET", f"/_cluster/health/{INDEX}", body=fake_es.health(INDEX))
    await sink.prepare()
    await sink.prepare()
    template, create, health = fake.take()
    assert template.json() == index_template()
    assert template.json()["index_patterns"] == ["wow.*.events"]
    assert template.json()["template"] == {"mappings": events_mapping()}
    assert create.json() == {"mappings": events_mapping()}
    assert health.params["wait_for_status"] == "yellow"


async def test_prepare_auto_checks_an_existing_index(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client, ddl=Ddl.AUTO)
    fake.on("PUT", TEMPLATE, body={"acknowledged": True})
    fake.on("PUT", P, 400, fake_es.error(400, "resource_already_exists_exception", f"index [{INDEX}] already exists"))
    fake.on("GET", f"{P}/_mapping", body=MAPPING_ANSWER)
    fake.on("GET", f"/_cluster/health/{INDEX}", body=fake_es.health(INDEX, "green"))
    await sink.prepare()
    assert [r.path for r in fake.take()] == [TEMPLATE, P, f"{P}/_mapping", f"/_cluster/health/{INDEX}"]


async def test_prepare_auto_fails_transiently_while_the_primary_is_missing(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client, ddl=Ddl.AUTO)
    fake.on("PUT", TEMPLATE, body={"acknowledged": True})
    fake.on("PUT", P, body=fake_es.created(INDEX))
    fake.on("GET", f"/_cluster/health/{INDEX}", 408, fake_es.health(INDEX, "red", timed_out=True))
    with pytest.raises(StorageUnavailable, match="primary"):
        await sink.prepare()


async def test_prepare_validate_requires_the_index_with_its_key_fields(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    fake.on("GET", f"{P}/_mapping", 404, fake_es.error(404, "index_not_found_exception", f"no such index [{INDEX}]"))
    with pytest.raises(StoreRefused, match="does not exist"):
        await sink_of(client, ddl=Ddl.VALIDATE).prepare()
    wrong = events_mapping()
    wrong["properties"]["version"] = {"type": "keyword"}
    fake.on("GET", f"{P}/_mapping", body={INDEX: {"mappings": fake_es.stored_mapping(wrong)}})
    with pytest.raises(StoreRefused, match="version is keyword, expected long"):
        await sink_of(client, ddl=Ddl.VALIDATE).prepare()
    fake.on("GET", f"{P}/_mapping", body=MAPPING_ANSWER)
    fake.on("GET", f"/_cluster/health/{INDEX}", body=fake_es.health(INDEX))
    await sink_of(client, ddl=Ddl.VALIDATE).prepare()
    assert not [r for r in fake.take() if r.method != "GET"]


async def test_prepare_none_creates_nothing_and_checks_an_existing_mapping(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    fake.on("GET", f"{P}/_mapping", body=MAPPING_ANSWER)
    await sink_of(client, ddl=Ddl.NONE).prepare()
    assert [(r.method, r.path) for r in fake.take()] == [("GET", f"{P}/_mapping")]
    dynamic = {INDEX: {"mappings": {"properties": {"tenant_id": {"type": "text"}}}}}
    fake.on("GET", f"{P}/_mapping", body=dynamic)
    with pytest.raises(StoreRefused, match="tenant_id is text, expected keyword"):
        await sink_of(client, ddl=Ddl.NONE).prepare()


# --------------------------------------------------------------------------- reads, close


async def test_documents_are_searched_by_version(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    docs = [{"aggregate_id": "a", "version": v, "access_digest": "d"} for v in (1, 2)]
    fake.on("POST", f"{P}/_search", body=fake_es.hits(INDEX, docs))
    assert await sink_of(client).documents(ref("a")) == [{"aggregate_id": "a", "version": v} for v in (1, 2)]
    (req,) = fake.take()
    assert req.params == {"routing": "a", "allow_partial_search_results": "false"}
    assert req.json()["sort"] == [{"version": {"order": "asc"}}]
    assert req.json()["query"] == {
        "bool": {"filter": [{"term": {"tenant_id": "(0)"}}, {"term": {"aggregate_id": "a"}}]}
    }


async def test_close_closes_only_an_owned_client(fake: FakeElasticsearch) -> None:
    es = AsyncElasticsearch(fake.url, max_retries=0)
    try:
        await sink_of(es).close()
        fake.on("PUT", f"{P}/_bulk", body=fake_es.bulk_answer(201))
        await sink_of(es).write([commit("a", 1)])  # still open
    finally:
        await sink_of(es, owns_client=True).close()


# --------------------------------------------------------------------------- against a stateful ES 9
#
# ``EsModel`` keeps documents, refresh visibility, the mapping and sequence numbers as one ES 9
# node does, evaluates the queries and runs the painless script the sink sends (a subset
# interpreter), and refuses unknown parameters and body keys: the sink's requests are checked
# for what they do, not only for their text. tests/contract/test_sink.py runs against it too
# (the ``fake-elasticsearch`` implementation of its fixture).


@pytest.fixture
def model(fake: FakeElasticsearch) -> EsModel:
    fake.model = EsModel()
    return fake.model


async def _access(sink: ElasticsearchEventSink, id: str) -> list[tuple[int, Any, Any]]:
    return [(d["version"], d["access"], d["access_version"]) for d in await sink.documents(ref(id))]


async def test_a_write_refreshes_before_it_looks_back_or_stamps(client: AsyncElasticsearch, model: EsModel) -> None:
    # no refresh: a search sees what the last refresh saw (one interval apart: 50 ms)
    sink = sink_of(client, ddl=Ddl.AUTO, refresh_interval_s=0.05)
    await sink.write([commit("a", 1, A, 1), commit("a", 2, B, 2)])  # a change inside one write
    await sink.write([commit("a", 3, C, 3)])  # a change known from the LRU
    # nothing remembered: the stream is searched
    restarted = sink_of(client, ddl=Ddl.AUTO, refresh_interval_s=0.05)
    await restarted.write([commit("a", 4, A, 4)])
    await restarted.write([commit("a", 5, A, 4)])  # no change: no stamp
    ops = [r.split()[0] for r in model.requests]
    assert ops == [
        *("put_template", "create", "health", "bulk", "refresh", "update_by_query"),
        *("bulk", "refresh", "update_by_query"),
        *("put_template", "create", "mapping", "health", "bulk", "mget", "refresh", "update_by_query", "bulk"),
    ]
    await client.indices.refresh(index=INDEX)
    assert await _access(sink, "a") == [(v, A, 4) for v in (1, 2, 3, 4, 5)]


async def test_a_stamp_meeting_another_searches_again_and_the_later_wins(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, ddl=Ddl.AUTO, refresh=True, refresh_interval_s=0.05)
    await sink.write([commit(id, v, A, 1) for id in ("a", "b") for v in (1, 2, 3)])
    meanwhile: list[tuple[Any, int]] = []

    def concurrent(m: EsModel, index: str, _id: str) -> None:
        if meanwhile:
            access, as_of = meanwhile.pop()
            m.stamp_now(index, _id, access, as_of, access_digest(access))

    model.before_update = concurrent
    # a later stamp meets an earlier one on version 1: a version conflict, searched again, written
    meanwhile.append((B, 4))
    model.requests.clear()
    assert await sink.stamp(ref("a"), C, 5, 1, 3) == 3
    assert model.requests == [f"update_by_query {INDEX}", f"refresh {INDEX}", f"update_by_query {INDEX}"]
    assert await _access(sink, "a") == [(v, C, 5) for v in (1, 2, 3)]
    # an earlier stamp meets a later one: searched again, the guard keeps the later
    meanwhile.append((C, 5))
    assert await sink.stamp(ref("b"), B, 4, 1, 3) == 2
    assert await _access(sink, "b") == [(1, C, 5), (2, B, 4), (3, B, 4)]


async def test_prepare_against_a_stateful_es(client: AsyncElasticsearch, model: EsModel) -> None:
    with pytest.raises(StoreRefused, match="does not exist"):
        await sink_of(client, ddl=Ddl.VALIDATE).prepare()
    await sink_of(client, ddl=Ddl.AUTO).prepare()
    await sink_of(client, ddl=Ddl.AUTO).prepare()  # there already: its mapping is checked instead
    await sink_of(client, ddl=Ddl.VALIDATE).prepare()
    ops = [r.split()[0] for r in model.requests]
    assert ops == [
        *("mapping", "put_template", "create", "health", "put_template", "create", "mapping", "health"),
        *("mapping", "health"),
    ]


async def test_an_item_the_mapping_refuses_fails_the_write_naming_it(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, ddl=Ddl.AUTO, refresh=True)
    bad = commit("b", 1, {"owner_id": {"nested": "object"}, "space_id": "s1"}, 1)
    with pytest.raises(SinkWriteError, match=r"1 of 2 items.*%280%29:b:1: \[400\] document_parsing_exception"):
        await sink.write([commit("a", 1), bad])
    assert [d["version"] for d in await sink.documents(ref("a"))] == [1]  # the item written stays
