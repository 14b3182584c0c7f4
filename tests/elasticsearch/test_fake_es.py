"""The fake Elasticsearch 9 (``fake_es``) answers the failures a real cluster gives, so that the
sink's tests see them: index blocks, closed indices, 401 and 403 (credentials checked), analyzed
``text`` fields, the nested-object and indexing-pressure limits, the compatibility header, a
proxy's pages, aliases and data streams, shards and their document limit, component templates,
update-by-query stopping at a failure, a bulk that outlives its client, and no made-up status."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from elastic_transport import ConnectionTimeout
from elasticsearch import ApiError, AsyncElasticsearch

from tests.elasticsearch import fake_es
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, Recorded

pytestmark = pytest.mark.anyio

INDEX = "idx"


@pytest.fixture
async def es(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    client = AsyncElasticsearch(fake.url, request_timeout=5, max_retries=0, retry_on_status=())
    try:
        yield client
    finally:
        await client.close()


async def create(es: AsyncElasticsearch, *docs: dict[str, Any]) -> Any:
    ops: list[dict[str, Any]] = []
    for n, d in enumerate(docs):
        ops += [{"create": {"_id": str(n)}}, d]
    return (await es.bulk(index=INDEX, operations=ops)).body


async def test_blocked_and_closed_indices_fail_their_items(es: AsyncElasticsearch, model: EsModel) -> None:
    await create(es, {"a": 1})
    model.block_writes(INDEX)
    [item] = (await create(es, {"a": 2}))["items"]
    assert item["create"]["status"] == 403
    assert item["create"]["error"]["type"] == "cluster_block_exception"
    assert "FORBIDDEN/8/index write (api)" in item["create"]["error"]["reason"]
    model.block_writes(INDEX, on=False)
    model.close(INDEX)
    [item] = (await create(es, {"a": 2}))["items"]
    assert (item["create"]["status"], item["create"]["error"]["type"]) == (400, "index_closed_exception")
    with pytest.raises(ApiError) as info:
        await es.search(index=INDEX)
    assert (info.value.meta.status, info.value.error) == (400, "index_closed_exception")


async def test_credentials_and_privileges(es: AsyncElasticsearch, model: EsModel) -> None:
    await create(es, {"a": 1})
    model.index_privileges = {"read"}
    [item] = (await create(es, {"a": 2}))["items"]
    assert item["create"]["status"] == 403 and "indices:data/write/bulk[s]" in item["create"]["error"]["reason"]
    with pytest.raises(ApiError) as info:
        await es.indices.refresh(index=INDEX)
    assert info.value.meta.status == 403 and "maintenance" in str(info.value.body)
    model.api_key_expired = True
    with pytest.raises(ApiError) as info:
        await es.search(index=INDEX)
    assert (info.value.meta.status, info.value.error) == (401, "security_exception")


async def test_limits_of_a_node(es: AsyncElasticsearch, model: EsModel) -> None:
    model.nested_objects_limit = 3
    await es.indices.create(index=INDEX, mappings={"properties": {"events": {"type": "nested"}}})
    [item] = (await create(es, {"events": [{"n": i} for i in range(4)]}))["items"]
    assert item["create"]["status"] == 400 and "nested_objects.limit" in item["create"]["error"]["reason"]
    model.heap_bytes = 1000  # indexing_pressure.memory.limit: 100 bytes
    with pytest.raises(ApiError) as info:
        await create(es, {"x": "y" * 200})
    assert (info.value.meta.status, info.value.error) == (429, "es_rejected_execution_exception")


async def test_an_older_server_refuses_the_compatibility_header(es: AsyncElasticsearch, model: EsModel) -> None:
    model.version = "8.17.0"
    with pytest.raises(ApiError) as info:
        await es.info()
    assert (info.value.meta.status, info.value.error) == (400, "media_type_header_exception")
    assert "must be either version 8 or 7, but found 9" in str(info.value.body)


def test_a_scripted_bulk_answer_names_only_statuses_es_gives() -> None:
    req = Recorded("PUT", "/i/_bulk", {}, {}, b'{"create":{"_id":"a"}}\n{}\n')
    assert fake_es.bulk_answer(503)(req)["items"][0]["create"]["error"]["type"] == "unavailable_shards_exception"
    assert fake_es.bulk_answer(403)(req)["items"][0]["create"]["error"]["type"] == "cluster_block_exception"
    with pytest.raises(AssertionError, match="no item error is scripted for status 500"):
        fake_es.bulk_answer(500)(req)


async def test_credentials_are_checked_on_every_request_and_every_answer_names_the_product(
    fake: FakeElasticsearch, model: EsModel
) -> None:
    model.credentials = {fake_es.api_key_header("k1")}
    for key in (None, "k2"):
        stranger = AsyncElasticsearch(fake.url, api_key=key, max_retries=0)
        try:
            with pytest.raises(ApiError) as info:
                await stranger.info()
        finally:
            await stranger.close()
        meta = info.value.meta
        assert (meta.status, info.value.error) == (401, "security_exception")
        assert meta.headers["x-elastic-product"] == "Elasticsearch" and "realm" in meta.headers["www-authenticate"]
        said = "missing authentication credentials for REST request [/]" if key is None else "unable to authenticate"
        assert said in str(info.value.body)
    known = AsyncElasticsearch(fake.url, api_key="k1", max_retries=0)
    try:
        assert (await known.info()).meta.headers["x-elastic-product"] == "Elasticsearch"
    finally:
        await known.close()


async def test_a_proxys_page_is_not_elasticsearchs(es: AsyncElasticsearch, fake: FakeElasticsearch) -> None:
    fake.proxy = (r"/idx/_search", 502, fake_es.proxy_page(502))
    with pytest.raises(ApiError) as info:
        await es.search(index=INDEX)
    assert info.value.meta.status == 502 and "x-elastic-product" not in info.value.meta.headers
    assert "<h1>502 Bad Gateway</h1>" in str(info.value.body)


async def test_a_write_goes_to_an_aliass_write_index_and_a_data_stream_wants_its_own_routing_rules(
    es: AsyncElasticsearch, model: EsModel
) -> None:
    for name in ("i1", "i2"):
        await es.indices.create(index=name)
    model.aliases["al"] = {"i1": None, "i2": None}
    [item] = (await es.bulk(index="al", operations=[{"create": {"_id": "1"}}, {"a": 1}]))["items"]
    assert item["create"]["status"] == 400 and "no write index is defined for alias [al]" in str(item)
    model.aliases["al"]["i2"] = True
    [item] = (await es.bulk(index="al", operations=[{"create": {"_id": "1"}}, {"a": 1}]))["items"]
    assert (item["create"]["status"], item["create"]["_index"]) == (201, "i2")
    with pytest.raises(ApiError, match="invalid_index_name_exception"):
        await es.indices.create(index="al")
    model.templates["ds"] = {"index_patterns": ["ds-*"], "priority": 1, "data_stream": {}}
    with pytest.raises(ApiError, match="creates data streams only"):
        await es.indices.create(index="ds-1")
    [item] = (await es.bulk(index="ds-1", operations=[{"create": {"_id": "1", "routing": "r"}}, {"a": 1}]))["items"]
    assert item["create"]["status"] == 400 and "specifies a custom routing" in str(item)
    [item] = (await es.bulk(index="ds-1", operations=[{"create": {"_id": "1"}}, {"a": 1}]))["items"]
    assert item["create"]["error"]["caused_by"]["reason"] == "data stream timestamp field [@timestamp] is missing"
    [item] = (await es.bulk(index="ds-1", operations=[{"create": {"_id": "1"}}, {"@timestamp": 1}]))["items"]
    assert item["create"]["_index"].startswith(".ds-ds-1-")


async def test_shards_their_document_limit_and_templates_composed_of_components(
    es: AsyncElasticsearch, model: EsModel
) -> None:
    with pytest.raises(ApiError, match=r"specifies component templates \['c'\] that do not exist"):
        await es.indices.put_index_template(name="t", index_patterns=["s*"], composed_of=["c"])
    await es.indices.put_index_template(
        name="t", index_patterns=["s*"], composed_of=["c"], ignore_missing_component_templates=["c"]
    )
    await es.cluster.put_component_template(name="c", template={"settings": {"number_of_shards": 4}})
    await es.indices.create(index="s1", mappings={"properties": {"events": {"type": "nested"}}})
    index = model.indices["s1"]
    assert index.shards == 4
    ops: list[dict[str, Any]] = []
    for n in range(20):
        ops += [{"create": {"_id": str(n)}}, {"events": [{"n": 1}]}]
    items = (await es.bulk(index="s1", operations=ops))["items"]
    firsts = [it["create"]["_seq_no"] for it in items].count(0)
    assert firsts == len({d.shard for d in index.live.values()}) > 1  # each shard numbers from 0
    assert sum(index.docs.values()) == 40  # a document and its nested event
    model.max_docs_per_shard = max(index.docs.values())
    [item] = (await es.bulk(index="s1", operations=[{"create": {"_id": "x"}}, {"events": []}]))["items"]
    assert "Number of documents in the shard cannot exceed" in item["create"]["error"]["reason"]


async def test_update_by_query_stops_after_the_batch_that_failed_keeping_what_it_updated(
    es: AsyncElasticsearch, model: EsModel
) -> None:
    await create(es, {"n": 1}, {"n": 2}, {"n": 3})
    await es.indices.refresh(index=INDEX)
    model.fail_update = lambda _id: (429, "es_rejected_execution_exception", "queue full") if _id == "1" else None
    script = {"source": "ctx._source.n = 0;", "lang": "painless"}
    with pytest.raises(ApiError) as info:
        await es.update_by_query(index=INDEX, script=script, scroll_size=1, conflicts="proceed")
    body = info.value.body
    assert info.value.meta.status == 429 and (body["updated"], body["batches"]) == (1, 2)
    assert [model.indices[INDEX].live[i].source["n"] for i in "012"] == [0, 2, 3]


async def test_a_bulk_goes_on_after_its_client_gave_up_and_waits_for_a_primary_up_to_its_timeout(
    fake: FakeElasticsearch, model: EsModel
) -> None:
    es = AsyncElasticsearch(fake.url, request_timeout=0.3, max_retries=0)
    try:
        await create(es, {"a": 1})
        model.primaries(INDEX, active=False)
        with pytest.raises(ConnectionTimeout):  # the bulk's own timeout: a minute
            await es.bulk(index=INDEX, operations=[{"create": {"_id": "late"}}, {"a": 2}])
        assert await anyio.to_thread.run_sync(model.waiting, 1, 5.0)
        model.primaries(INDEX, active=True)
        assert await anyio.to_thread.run_sync(model.settled, 5.0)
        assert "late" in model.indices[INDEX].live  # written after all: a retry's create is a 409
        [item] = (await es.bulk(index=INDEX, operations=[{"create": {"_id": "late"}}, {"a": 2}]))["items"]
        assert item["create"]["status"] == 409
        model.primaries(INDEX, active=False)
        ops = [{"create": {"_id": "never"}}, {"a": 3}]
        [item] = (await es.bulk(index=INDEX, operations=ops, timeout="100ms"))["items"]
        assert item["create"]["status"] == 503 and "primary shard is not active Timeout: [100ms]" in str(item)
    finally:
        await es.close()


async def test_a_bulk_line_ends_at_a_newline_only(es: AsyncElasticsearch, model: EsModel) -> None:
    """A string holding a line separator other than "\\n" as it is (JSON allows U+2028, U+0085,
    U+001E unescaped, and orjson writes them so) stays one line of the bulk's NDJSON."""
    text = "a\u2028b\x85c\x1ed"
    body = b'{"create":{"_id":"1"}}\n' + json.dumps({"s": text}, ensure_ascii=False).encode() + b"\n"
    answer = await es.perform_request(
        "POST", f"/{INDEX}/_bulk", body=body, headers={"content-type": "application/x-ndjson"}
    )
    assert answer.body["errors"] is False
    await es.indices.refresh(index=INDEX)
    [hit] = (await es.search(index=INDEX)).body["hits"]["hits"]
    assert hit["_source"] == {"s": text}
