"""The sink within a real cluster's limits, against the fake that enforces them (``fake_es``:
request line, body size, id length, clause count, immense terms, dynamic auto-creation)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch import fake_es
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, Raw, serving
from wowd.errors import FormatError, InvalidInput, SinkWriteError, StorageError, StorageUnavailable
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit, DomainEvent, stream_id
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.sink import MAX_ROUTING_CHARS, STAMP_PAGE, ElasticsearchEventSink

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"
P = f"/{INDEX}"
A = {"owner_id": "u1", "space_id": "s1", "tags": ["x"]}
B = {"owner_id": "u2", "space_id": "s1", "tags": ["x"]}


def ref(id: str, tenant: str = "(0)") -> AggregateRef:
    return AggregateRef(context="ctx", aggregate="order", tenant_id=tenant, id=id)


def commit(id: str, version: int, access: dict[str, Any] = A, access_version: int = 1, **kw: Any) -> Commit:
    return Commit(
        ref=ref(id),
        version=version,
        command_id=kw.pop("command_id", f"cmd-{version}"),
        request_id=kw.pop("request_id", f"req-{id}-{version}"),
        create_time=1_700_000_000_000 + version,
        events=(DomainEvent(id=f"ev-{version}", name="OrderChanged", body=kw.pop("body", {"n": version})),),
        access=access,
        access_version=access_version,
    )


@pytest.fixture
def fake() -> Iterator[FakeElasticsearch]:
    with serving() as server:
        yield server


@pytest.fixture
def model(fake: FakeElasticsearch) -> EsModel:
    fake.model = EsModel()
    return fake.model


@pytest.fixture
async def client(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    # the client's defaults (max_retries 3, retry_on_status 429/502/503/504), as in production
    es = AsyncElasticsearch(fake.url, request_timeout=5)
    try:
        yield es
    finally:
        await es.close()


def sink_of(client: AsyncElasticsearch, **kwargs: Any) -> ElasticsearchEventSink:
    kwargs.setdefault("ddl", Ddl.AUTO)
    return ElasticsearchEventSink(client, TYPE, **kwargs)


async def versions(sink: ElasticsearchEventSink, id: str) -> list[int]:
    return [d["version"] for d in await sink.documents(ref(id))]


# --------------------------------------------------------------------------- request line, clauses


async def test_a_page_of_long_ids_is_stamped_without_routing_and_within_the_clause_limit(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, refresh=True)
    ids = [f"{i:08d}-1234-5678-9abc-def012345678" for i in range(STAMP_PAGE + 5)]  # UUID-long ids
    await sink.write([commit(i, v) for i in ids for v in (1, 2)])
    fake.take()
    stamps = [AccessStamp(ref=ref(i), access=B, as_of=2, from_=1, until=2) for i in ids]
    assert await sink.stamp_all(stamps) == 2 * len(ids)
    first, second = fake.take()
    # the routing of a full page would make the request line too long: every shard instead
    assert "routing" not in first.params and len(first.path) < 4096
    assert second.params["routing"] == ",".join(sorted(ids[STAMP_PAGE:]))
    for i in ids:
        assert [d["access"] for d in await sink.documents(ref(i))] == [B, B]


async def test_the_fake_refuses_a_long_request_line_and_too_many_clauses(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    await sink_of(client).prepare()
    with pytest.raises(Exception, match="too_long_http_line_exception"):
        await client.search(index=INDEX, routing="x" * 4100)
    query = {"bool": {"should": [{"range": {"version": {"gte": i}}} for i in range(513)]}}
    with pytest.raises(Exception, match="too many nested clauses; maxClauseCount is set to 1024"):
        await client.search(index=INDEX, query=query)
    assert MAX_ROUTING_CHARS + len(f"POST /{INDEX}/_update_by_query?routing=&refresh=true HTTP/1.1") < 4096


# --------------------------------------------------------------------------- bulk size


async def test_a_large_write_is_split_into_bulks_under_the_cap(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    fake.max_content_length = 40_000
    sink = sink_of(client, refresh=True, bulk_bytes=30_000, max_request_bytes=40_000)
    records = [commit(f"o{i}", 1, body={"blob": "x" * 2_000}) for i in range(40)]
    await sink.write(records)
    bulks = [r for r in fake.take() if r.path.endswith("/_bulk")]
    assert len(bulks) > 1 and all(len(r.body) <= 30_000 for r in bulks)
    assert [x for r in bulks for x in r.ndjson()[0::2]] == [
        {"create": {"_id": stream_id(c.ref, 1), "routing": c.ref.id}} for c in records
    ]
    for c in records:
        assert await versions(sink, c.ref.id) == [1]


async def test_a_record_over_the_request_cap_is_refused_naming_it_before_anything_is_sent(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, bulk_bytes=10_000, max_request_bytes=20_000)
    await sink.prepare()
    fake.take()
    big = commit("big", 3, body={"blob": "x" * 30_000})
    with pytest.raises(InvalidInput, match="over the request limit") as info:
        await sink.write([commit("a", 1), big])
    assert info.value.ref == big.ref and info.value.version == 3
    assert fake.take() == []


async def test_a_body_over_the_servers_limit_is_refused_not_retried(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client)
    await sink.prepare()
    fake.take()
    fake.max_content_length = 1_000  # a cluster configured below the sink's cap
    with pytest.raises(SinkWriteError, match=r"\[413\]"):
        await sink.write([commit(f"o{i}", 1) for i in range(10)])
    assert len(fake.take()) == 1


# --------------------------------------------------------------------------- ids, routing


async def test_an_id_over_512_bytes_is_refused_naming_the_record_before_sending(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client)
    await sink.prepare()
    fake.take()
    cjk = "注文" * 30  # 60 characters: 180 bytes, 540 once percent-encoded
    # no commit of such an aggregate reaches a sink: its reference is refused on every backend
    with pytest.raises(InvalidInput, match="at most 491 on every backend") as info:
        await sink.write([commit("a", 1), commit(cjk, 1)])
    assert info.value.field == "aggregate_id"
    assert fake.take() == []
    # the fake refuses the whole bulk as ES does (request validation), not the item
    body = b'{"create":{"_id":"%b","routing":"a"}}\n{}\n' % (b"x" * 513)
    with pytest.raises(Exception, match="action_request_validation_exception"):
        await client.bulk(index=INDEX, operations=body)  # type: ignore[arg-type]


async def test_an_empty_aggregate_id_is_written_routed_and_stamped(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, refresh=True)
    await sink.write([commit("", 1, A, 1), commit("", 2, A, 1)])
    await sink.write([commit("", 3, B, 3)])
    assert [(d["version"], d["access"]) for d in await sink.documents(ref(""))] == [(v, B) for v in (1, 2, 3)]
    bulk = next(r for r in fake.take() if r.path.endswith("/_bulk"))
    assert bulk.ndjson()[0] == {"create": {"_id": "%280%29::1", "routing": "-"}}


# --------------------------------------------------------------------------- a missing index


async def test_ddl_none_detects_an_index_a_write_created_with_a_dynamic_mapping(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, ddl=Ddl.NONE)
    with pytest.raises(FormatError, match=r"dynamic mapping.*tenant_id is text, expected keyword"):
        await sink.write([commit("a", 1)])
    assert [r.split()[0] for r in model.requests] == ["mapping", "bulk", "auto_create", "mapping"]


async def test_an_index_deleted_at_run_time_is_created_again_under_ddl_auto(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    model.auto_create_index = False  # action.auto_create_index: -wow.*.events,+*
    sink = sink_of(client, refresh=True)
    await sink.write([commit("a", 1)])
    del model.indices[INDEX]
    with pytest.raises(StorageUnavailable, match="index is missing"):
        await sink.write([commit("a", 2)])
    await sink.write([commit("a", 2)])  # the retry: created again with the sink's mapping
    assert await versions(sink, "a") == [2]
    assert model.indices[INDEX].mapping["dynamic"] == "strict"
    other = sink_of(client, ddl=Ddl.NONE)
    del model.indices[INDEX]
    with pytest.raises(FormatError, match="does not exist"):
        await other.write([commit("a", 3)])


# --------------------------------------------------------------------------- immense terms


async def test_a_free_form_keyword_over_the_term_limit_is_kept_not_indexed(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, refresh=True)
    await sink.write([commit("a", 1, request_id="r" * 40_000)])
    (doc,) = await sink.documents(ref("a"))
    assert len(doc["request_id"]) == 40_000
    # without ignore_above the fake refuses the item as ES does
    del model.indices[INDEX].mapping["properties"]["request_id"]["ignore_above"]
    with pytest.raises(SinkWriteError, match="immense term"):
        await sink.write([commit("a", 2, request_id="r" * 40_000)])


# --------------------------------------------------------------------------- client retries


async def test_a_429_is_one_request_left_to_the_feed(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.NONE)
    fake.on("GET", f"{P}/_mapping", body={INDEX: {"mappings": fake_es.stored_mapping(_mapping())}})
    fake.on("PUT", f"{P}/_bulk", 429, fake_es.error(429, "es_rejected_execution_exception", "queue full"))
    with pytest.raises(StorageUnavailable, match="429"):
        await sink.write([commit("a", 1)])
    assert [r.path for r in fake.take()] == [f"{P}/_mapping", f"{P}/_bulk"]  # not retried by the client


def _mapping() -> dict[str, Any]:
    from wowd.stores.elasticsearch.sink import events_mapping

    return events_mapping()


# --------------------------------------------------------------------------- smaller


async def test_a_proxys_error_page_is_classified_by_its_status(
    client: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    sink = sink_of(client, ddl=Ddl.NONE)
    fake.on("GET", f"{P}/_mapping", body={INDEX: {"mappings": fake_es.stored_mapping(_mapping())}})
    await sink.prepare()
    fake.on("PUT", f"{P}/_bulk", 502, Raw(b"<html>502 Bad Gateway</html>", "text/html"))
    with pytest.raises(StorageUnavailable, match="502.*Bad Gateway"):
        await sink.write([commit("a", 1)])
    fake.on("PUT", f"{P}/_bulk", 503, Raw(b"upstream connect error", "application/json"))
    with pytest.raises(StorageUnavailable, match="503.*upstream connect error"):
        await sink.write([commit("a", 1)])
    fake.on("PUT", f"{P}/_bulk", 200, Raw(b"<html>ok</html>", "application/json"))
    with pytest.raises(StorageError, match="bad answer") as info:
        await sink.write([commit("a", 1)])
    assert not isinstance(info.value, StorageUnavailable)


async def test_each_bulk_item_must_be_the_create_of_its_id(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client, ddl=Ddl.NONE)
    fake.on("GET", f"{P}/_mapping", body={INDEX: {"mappings": fake_es.stored_mapping(_mapping())}})
    await sink.prepare()

    def swapped(req: fake_es.Recorded) -> Any:
        answer = fake_es.bulk_answer(201, 201)(req)
        answer["items"].reverse()
        return answer

    fake.on("PUT", f"{P}/_bulk", body=swapped)
    with pytest.raises(StorageError, match="the create of %280%29:a:1 answered with"):
        await sink.write([commit("a", 1), commit("b", 1)])
    fake.on("PUT", f"{P}/_bulk", body={"items": [{"index": {"_id": "%280%29:a:1", "status": 201}}]})
    with pytest.raises(StorageError, match="answered with"):
        await sink.write([commit("a", 1)])
    (_, first, second) = fake.take()
    assert first.params["filter_path"] == "items.*._id,items.*.status,items.*.error.type,items.*.error.reason"


async def test_stamp_rounds_are_refreshed_between(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client)
    await sink.write([commit("a", v) for v in (1, 2, 3)])
    await client.indices.refresh(index=INDEX)
    model.requests.clear()
    stamps = [
        AccessStamp(ref=ref("a"), access=B, as_of=2, from_=1, until=2),
        AccessStamp(ref=ref("a"), access=A, as_of=3, from_=1, until=3),
    ]
    assert await sink.stamp_all(stamps) == 5
    # the second round sees the first's writes: no version conflict, no search again
    assert [r.split()[0] for r in model.requests] == ["update_by_query", "refresh", "update_by_query"]


async def test_an_update_by_query_has_its_own_client_timeout_and_is_not_retried(fake: FakeElasticsearch) -> None:
    release = threading.Event()

    def slow(req: fake_es.Recorded) -> Any:
        release.wait(10)
        return fake_es.ubq_answer(updated=1)

    fake.on("POST", f"{P}/_update_by_query", body=slow)
    es = AsyncElasticsearch(fake.url, request_timeout=30)  # the client's own timeout is longer
    try:
        sink = ElasticsearchEventSink(es, TYPE, ddl=Ddl.NONE, stamp_timeout_s=0.3)
        with anyio.fail_after(5), pytest.raises(StorageUnavailable, match="update_by_query"):
            await sink.stamp(ref("a"), B, 2, 1, 1)
        release.set()  # the fake answers under its lock
        assert len(fake.take()) == 1  # a timed-out update may still run on the cluster: no second one
    finally:
        release.set()
        await es.close()
