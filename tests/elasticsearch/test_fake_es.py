"""The fake Elasticsearch 9 (``fake_es``) answers the failures a real cluster gives, so that the
sink's tests see them: index blocks, closed indices, 401 and 403, analyzed ``text`` fields, the
nested-object and indexing-pressure limits, the compatibility header, and no made-up status."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
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
