"""The sink within a real cluster's limits, against the fake that enforces them (``fake_es``:
request line, body size, id length, clause count, immense terms, dynamic auto-creation)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch import fake_es
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, Raw, serving
from wowd.errors import InvalidInput, SinkWriteError, StorageUnavailable, StoreRefused
from wowd.model import AccessStamp, AggregateRef, AggregateType, Commit, DomainEvent, stream_id
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.documents import MAX_ROUTING_CHARS, STAMP_PAGE
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

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


def sink_of(client: AsyncElasticsearch, **kwargs: Any) -> ElasticsearchEventSink:
    kwargs.setdefault("ddl", Ddl.AUTO)
    return ElasticsearchEventSink(client, TYPE, **kwargs)


async def versions(sink: ElasticsearchEventSink, id: str) -> list[int]:
    return [d["version"] for d in await sink.documents(ref(id))]


# --------------------------------------------------------------------------- request line, clauses


async def test_a_page_of_long_ids_is_stamped_without_routing_and_within_the_clause_limit(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client, refresh=True, refresh_interval_s=0.05)
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
    # a bulk of several records: the cluster's limit is the problem, not a record (a stall)
    with pytest.raises(StoreRefused, match=r"http.max_content_length.*\[413\]"):
        await sink.write([commit(f"o{i}", 1) for i in range(10)])
    assert len(fake.take()) == 1
    # one record over it: that record is set aside
    with pytest.raises(SinkWriteError, match=r"\[413\]"):
        await sink.write([commit("big", 1, body={"x": "y" * 2_000})])
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
    with pytest.raises(
        StoreRefused, match=r"wow.ctx.order.events .*dynamic mapping.*tenant_id is text, expected keyword"
    ):
        await sink.write([commit("a", 1)])
    assert [r.split()[0] for r in model.requests] == ["mapping", "bulk", "auto_create", "mapping"]
    # every later write stalls too, sending nothing until the mapping is wowd's
    with pytest.raises(StoreRefused, match="writes stall until the index has wowd's mapping"):
        await sink.write([commit("a", 2)])
    assert [r.split()[0] for r in model.requests][4:] == ["mapping"]


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
    with pytest.raises(StoreRefused, match="does not exist"):
        await other.write([commit("a", 3)])


async def test_an_index_deleted_at_run_time_comes_back_with_wowds_mapping_from_the_template(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    # action.auto_create_index at its default: a write into a missing index creates it
    sink = sink_of(client)
    await sink.write([commit("a", 1), commit("a", 2)])
    del model.indices[INDEX]
    await sink.write([commit("a", 3, B, 3)])
    mapping = model.indices[INDEX].mapping
    assert mapping["dynamic"] == "strict" and mapping["_routing"] == {"required": True}
    assert mapping["properties"]["tenant_id"]["type"] == "keyword"
    assert mapping["properties"]["events"]["type"] == "nested"
    model.indices[INDEX].refresh()
    assert await versions(sink, "a") == [3]


async def test_a_dynamic_mapping_made_at_run_time_stalls_every_write_until_the_index_is_wowds(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    await sink_of(client).prepare()
    model.templates.clear()  # no template (removed, or wowd runs with ddl validate only)
    sink = sink_of(client, ddl=Ddl.VALIDATE)
    await sink.write([commit("a", 1)])
    del model.indices[INDEX]  # deleted while wowd runs: the next write makes it dynamic
    with pytest.raises(StoreRefused, match=r"index wow.ctx.order.events .*tenant_id is text, expected keyword"):
        await sink.write([commit("a", 2)])
    with pytest.raises(StoreRefused, match=r"wow.ctx.order.events .*events is object, expected nested"):
        await sink.write([commit("a", 3)])
    # the operator deletes the wrong index and wowd makes it again: writes go on
    del model.indices[INDEX]
    await sink_of(client).prepare()
    await sink.write([commit("a", 2), commit("a", 3)])
    model.indices[INDEX].refresh()
    assert await versions(sink, "a") == [2, 3]


async def test_the_fake_matches_a_term_on_a_text_field_against_its_analyzed_terms(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    doc = {"tenant_id": "(0)", "aggregate_id": "order-1"}
    await client.bulk(index="plain", operations=[{"create": {"_id": "1"}}, doc], refresh=True)
    mapping = model.indices["plain"].mapping["properties"]
    assert mapping["tenant_id"]["type"] == "text"
    found = await client.search(index="plain", query={"term": {"tenant_id": "(0)"}})
    assert found["hits"]["total"]["value"] == 0
    found = await client.search(index="plain", query={"term": {"aggregate_id": "order"}})
    assert found["hits"]["total"]["value"] == 1


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
    from wowd.stores.elasticsearch.documents import events_mapping

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
    with pytest.raises(StoreRefused, match="bad answer"):
        await sink.write([commit("a", 1)])


async def test_each_bulk_item_must_be_the_create_of_its_id(client: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    sink = sink_of(client, ddl=Ddl.NONE)
    fake.on("GET", f"{P}/_mapping", body={INDEX: {"mappings": fake_es.stored_mapping(_mapping())}})
    await sink.prepare()

    def swapped(req: fake_es.Recorded) -> Any:
        answer = fake_es.bulk_answer(201, 201)(req)
        answer["items"].reverse()
        return answer

    fake.on("PUT", f"{P}/_bulk", body=swapped)
    with pytest.raises(StoreRefused, match="the create of %280%29:a:1 answered with"):
        await sink.write([commit("a", 1), commit("b", 1)])
    fake.on("PUT", f"{P}/_bulk", body={"items": [{"index": {"_id": "%280%29:a:1", "status": 201}}]})
    with pytest.raises(StoreRefused, match="answered with"):
        await sink.write([commit("a", 1)])
    (_, first, second) = fake.take()
    assert first.params["filter_path"] == (
        "items.*._id,items.*.status,items.*._seq_no,items.*.error.type,items.*.error.reason,"
        "items.*.error.caused_by.type,items.*.error.caused_by.reason"
    )


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
    slow = fake_es.Held(lambda req: fake_es.ubq_answer(updated=1))
    fake.on("POST", f"{P}/_update_by_query", body=slow)
    es = AsyncElasticsearch(fake.url, request_timeout=30)  # the client's own timeout is longer
    try:
        sink = ElasticsearchEventSink(es, TYPE, ddl=Ddl.NONE, stamp_timeout_s=0.3)
        with anyio.fail_after(5), pytest.raises(StorageUnavailable, match="update_by_query"):
            await sink.stamp(ref("a"), B, 2, 1, 1)
        assert await anyio.to_thread.run_sync(slow.reached.wait, 5)
        slow.released.set()  # the fake answers under its lock
        assert len(fake.take()) == 1  # a timed-out update may still run on the cluster: no second one
    finally:
        slow.released.set()
        await es.close()


# --------------------------------------------------------------------------- shared refreshes


async def test_writes_waiting_for_a_refresh_share_it_and_send_their_stamps_in_one_request(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    interval_s = 0.5
    sink = sink_of(client, refresh_interval_s=interval_s)
    await sink.write([commit(f"o{i}", 1) for i in range(10)])
    model.requests.clear()
    # ten writes at once, each changing an aggregate's attributes (the feed of several slots)
    started = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(sink.write, [commit(f"o{i}", 2, B, 2)])
    intervals = int((anyio.current_time() - started) // interval_s)
    ops = [r.split()[0] for r in model.requests]
    assert ops.count("bulk") == 10
    # one refresh for the writes done when it starts, then at most one an interval: not ten
    assert ops.count("refresh") <= 2 + intervals < 10, (ops, intervals)
    assert sink.refreshes == ops.count("refresh")
    assert ops.count("update_by_query") == ops.count("refresh")  # the stamps waiting for one, together
    model.indices[INDEX].refresh()
    for i in range(10):
        assert [d["owner_id"] for d in await sink.documents(ref(f"o{i}"))] == ["u2", "u2"]


async def test_a_refresh_is_sent_at_most_once_per_interval(client: AsyncElasticsearch, model: EsModel) -> None:
    sink = sink_of(client, refresh_interval_s=0.25)
    await sink.write([commit("a", 1)])
    started = anyio.current_time()
    for v in range(2, 5):  # three writes in a row, each changing the attributes
        await sink.write([commit("a", v, A if v % 2 else B, v)])
    assert sink.refreshes == 3
    assert anyio.current_time() - started >= 2 * 0.25  # the second and third waited for their slot


# --------------------------------------------------------------------------- large commits


async def test_a_commit_over_the_event_cap_is_refused_naming_the_cap_before_anything_is_sent(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client)
    await sink.prepare()
    fake.take()
    events = tuple(DomainEvent(id=f"e{i}", name="ItemAdded", body={"i": i}) for i in range(10_001))
    many = Commit(ref=ref("many"), version=1, command_id="c", request_id="r", create_time=1, events=events)
    with pytest.raises(
        InvalidInput, match=r"events: 10001 events, over the cap of 10000 .*nested_objects.limit"
    ) as info:
        await sink.write([commit("a", 1), many])
    assert info.value.field == "events" and info.value.ref == many.ref
    assert fake.take() == []
    # a cap set above the index's limit: the cluster refuses the record itself (set aside)
    wide = sink_of(client, max_document_events=20_000)
    with pytest.raises(SinkWriteError, match=r"nested documents has exceeded the allowed limit of \[10000\]"):
        await wide.write([many])


async def test_a_document_over_the_byte_cap_is_refused_naming_the_cap_before_anything_is_sent(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client)
    await sink.prepare()
    fake.take()
    big = commit("big", 1, body={"x": "y" * (11 * 1024 * 1024)})
    with pytest.raises(
        InvalidInput, match=r"over the cap of 10485760 bytes a document \(elasticsearch.max_document_bytes"
    ):
        await sink.write([commit("a", 1), big])
    assert fake.take() == []
    # what the cap keeps away: indexing pressure refuses a bulk over 10 % of the heap, 429 each time
    # (a small heap: the client warns of a body over 1 MB sent as bytes)
    model.heap_bytes = 8 * 1024 * 1024
    with pytest.raises(StorageUnavailable, match=r"\[429\] es_rejected_execution_exception.*coordinating"):
        await sink.write([commit("mid", 1, body={"x": "y" * 900_000})])
