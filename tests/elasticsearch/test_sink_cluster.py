"""The sink in a cluster as operators run it, against the stateful fake: credentials on every
request, several replicas writing one index, stamps that fail halfway, the operator's component
template, another template in the way, a primary that is not active, Elastic Cloud."""

from __future__ import annotations

import base64
from pathlib import Path

import anyio
import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.conftest import order_commit
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, api_key_header
from tests.elasticsearch.feeding import PARTITIONS, embedded_with_sink, until
from tests.helpers import held_slot
from wowd import metrics
from wowd.config import ElasticsearchSettings, load_settings
from wowd.daemon import feed
from wowd.errors import StorageUnavailable, StoreRefused
from wowd.model import AggregateType, stream_id
from wowd.retry import Backoff
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.documents import CUSTOM_TEMPLATE, TEMPLATE_NAME, events_mapping
from wowd.stores.elasticsearch.options import new_client
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink
from wowd.stores.mongo import operations

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"
A = {"owner_id": "alice", "space_id": "s1", "tags": ["x"]}
B = {"owner_id": "bob", "space_id": "s1", "tags": ["x"]}


# --------------------------------------------------------------------------- credentials


async def test_the_version_check_sends_the_credentials(fake: FakeElasticsearch, model: EsModel) -> None:
    model.credentials = {api_key_header("k1")}
    es = new_client(ElasticsearchSettings(url=fake.url, api_key="k1", request_timeout_s=5))
    try:
        sink = ElasticsearchEventSink(es, TYPE)
        assert await sink.check_version() == "Elasticsearch 9.1.0 (supported: 9.x)"
        assert fake.take()[-1].headers["authorization"] == "ApiKey k1"
    finally:
        await es.close()
    stranger = new_client(ElasticsearchSettings(url=fake.url, api_key="k2", request_timeout_s=5))
    try:
        with pytest.raises(StoreRefused, match=r"refuses wowd's credentials.*\[401\] security_exception"):
            await ElasticsearchEventSink(stranger, TYPE).check_version()
    finally:
        await stranger.close()


async def test_check_reaches_a_cloud_id_naming_its_setting_and_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # no server answers either: what check reads first names the setting and the cloud's host
    # (MongoDB's line is given up after its 100 ms operation timeout, not the check's)
    monkeypatch.setattr(operations, "OPEN_TIMEOUT_S", 1.5)
    cloud_id = "prod:" + base64.b64encode(b"es.invalid$abc123$def456").decode()
    settings = load_settings(
        backend="mongo",
        mongodb={"uri": "mongodb://m/?replicaSet=rs", "timeout_ms": 100},
        elasticsearch={"cloud_id": cloud_id},
    )
    found = await operations.MongoOperations(settings).preflight()
    (line,) = [line for line in found.lines if line.text.startswith("elasticsearch")]
    assert not line.ok and found.formats is None
    assert line.text.startswith("elasticsearch: WOWD_ELASTICSEARCH__CLOUD_ID: abc123.es.invalid:443")


# --------------------------------------------------------------------------- several replicas, one index


async def test_every_replica_notices_an_index_made_again_with_another_mapping(
    client: AsyncElasticsearch, second_client: AsyncElasticsearch, model: EsModel
) -> None:
    await ElasticsearchEventSink(client, TYPE).prepare()
    model.templates.clear()  # no template (wowd runs with ddl validate, or the template was removed)
    first = ElasticsearchEventSink(client, TYPE, ddl=Ddl.VALIDATE)
    second = ElasticsearchEventSink(second_client, TYPE, ddl=Ddl.VALIDATE, mapping_check_s=0)  # its look is due
    await first.write([order_commit("a")])
    await second.write([order_commit("b")])
    del model.indices[INDEX]  # deleted while they run: the next write makes it with a dynamic mapping
    with pytest.raises(StoreRefused, match="tenant_id is text, expected keyword"):
        await first.write([order_commit("a", 2)])
    # the other replica's writes reach an index that has documents already: it looks too
    with pytest.raises(StoreRefused, match="tenant_id is text, expected keyword"):
        await second.write([order_commit("b", 2)])
    assert list(model.indices[INDEX].live) == [stream_id(order_commit("a").ref, 2)]


async def test_the_mapping_is_checked_field_by_field_as_wowd_writes_it(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    mapping = events_mapping()
    mapping["properties"]["events"]["properties"]["name"] = {"type": "text"}  # events by name find nothing
    mapping["properties"]["access"]["properties"].pop("tags")
    mapping["properties"]["header"] = {"type": "object"}  # indexed: every header key a field
    await client.indices.create(index=INDEX, mappings=mapping)
    with pytest.raises(StoreRefused) as info:
        await ElasticsearchEventSink(client, TYPE, ddl=Ddl.VALIDATE).prepare()
    for problem in (
        "events.name is text, expected keyword",
        "access.tags is missing, expected keyword",
        "header is indexed, expected enabled false",
    ):
        assert problem in str(info.value)


# --------------------------------------------------------------------------- stamps that fail halfway


@pytest.mark.parametrize("then", ["a restart", "the LRU's eviction", "another holder"])
async def test_a_stamp_that_failed_halfway_is_finished_by_the_retry(
    client: AsyncElasticsearch, second_client: AsyncElasticsearch, model: EsModel, then: str
) -> None:
    sink = ElasticsearchEventSink(
        client, TYPE, capacity=0 if then == "the LRU's eviction" else 10, refresh_interval_s=0.05
    )
    await sink.write([order_commit("a", v, access=A, access_version=1) for v in (1, 2, 3)])
    first = stream_id(order_commit("a").ref, 1)
    # the stamp's batch fails on version 1 (a rejected write) and rewrites versions 2 and 3:
    # _update_by_query keeps what it updated
    model.fail_update = lambda _id: (429, "es_rejected_execution_exception", "queue full") if _id == first else None
    changed = order_commit("a", 4, access=B, access_version=4)
    with pytest.raises(StorageUnavailable, match="es_rejected_execution_exception"):
        await sink.write([changed])
    model.fail_update = None
    live = model.indices[INDEX].live
    assert [live[stream_id(changed.ref, v)].source["owner_id"] for v in (1, 2, 3)] == ["alice", "bob", "bob"]
    retry = {
        "a restart": ElasticsearchEventSink(client, TYPE, refresh_interval_s=0.05),
        "the LRU's eviction": sink,
        "another holder": ElasticsearchEventSink(second_client, TYPE, refresh_interval_s=0.05),
    }[then]
    await retry.write([changed])  # the batch again: its document is there, the stamp is finished
    assert [live[stream_id(changed.ref, v)].source["owner_id"] for v in (1, 2, 3, 4)] == ["bob"] * 4


# --------------------------------------------------------------------------- templates


async def test_the_operators_component_template_sets_shards_and_lifecycle_and_wowd_never_writes_it(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    # wowd's template composes the operator's, which may not exist yet
    await ElasticsearchEventSink(client, AggregateType(context="ctx", aggregate="first")).prepare()
    assert model.templates[TEMPLATE_NAME]["composed_of"] == [CUSTOM_TEMPLATE]
    assert model.indices["wow.ctx.first.events"].shards == 1
    settings = {"number_of_shards": 3, "number_of_replicas": 2, "index.lifecycle.name": "events-90d"}
    await client.cluster.put_component_template(name=CUSTOM_TEMPLATE, template={"settings": settings})
    custom = dict(model.components[CUSTOM_TEMPLATE])
    model.requests.clear()
    await ElasticsearchEventSink(client, TYPE).prepare()  # a start under ddl auto: the template again
    index = model.indices[INDEX]
    assert index.shards == 3 and index.settings["index.lifecycle.name"] == "events-90d"
    assert index.mapping["dynamic"] == "strict"  # wowd's mapping over any the component gives
    assert model.components[CUSTOM_TEMPLATE] == custom
    assert not any(r.startswith("put_component") for r in model.requests)
    # documents go to their shards by routing; each shard numbers its own operations
    sink = ElasticsearchEventSink(client, TYPE)
    await sink.write([order_commit(f"o{i}") for i in range(12)])
    assert len({d.shard for d in index.live.values()}) > 1 and sorted(index.seqs) == sorted(
        {d.shard for d in index.live.values()}
    )


async def test_a_template_in_the_way_is_asked_again_after_a_backoff_not_at_each_commit(
    tmp_path: Path, client: AsyncElasticsearch, model: EsModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wowd.daemon.feed import Feeder
    from wowd.daemon.waker import Waker

    monkeypatch.setattr(feed, "STALL_BACKOFF", Backoff(0.02, 0.05, jitter=True))  # the feed retries often

    model.templates["theirs"] = {"index_patterns": ["wow.*"], "priority": 200, "template": {}}
    async with embedded_with_sink(tmp_path, client) as (settings, backend):
        sink = backend.sink(TYPE)
        with pytest.raises(StoreRefused, match=r"another index template claims .*same priority \[200\]"):
            await sink.prepare()
        with pytest.raises(StoreRefused, match=r"prepared again in \d"):
            await sink.prepare()  # held off: nothing sent
        assert model.requests.count(f"put_template {TEMPLATE_NAME}") == 1
        commits = [order_commit(f"order-{i}") for i in range(50)]
        await backend.log.append_many(commits)
        failed = metrics.FEED_ERRORS.labels(kind="fatal")
        before = failed._value.get()
        feeder = Feeder(settings, backend)
        held = held_slot(PARTITIONS)

        async def retried_five_times() -> bool:
            return failed._value.get() >= before + 5

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, Waker())
                await until(retried_five_times)
                held.request_stop()
        assert "another index template claims" in feeder.view_stalls().get("index", "")
    # five retries of the batch (never commit by commit) within the index's holdoff (0.25 s at least)
    assert model.requests.count(f"put_template {TEMPLATE_NAME}") <= 3
    assert await backend.quarantine.items() == []


# --------------------------------------------------------------------------- a primary that is not active


async def test_a_bulk_waits_for_a_primary_less_long_than_the_client_so_no_retry_piles_on(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = ElasticsearchEventSink(client, TYPE, request_timeout_s=1.0)
    await sink.write([order_commit("a")])
    model.primaries(INDEX, active=False)  # a node lost: the shard's primary is unassigned
    with (
        anyio.fail_after(5),
        pytest.raises(StorageUnavailable, match=r"primary shard is not active Timeout: \[500ms\]"),
    ):
        await sink.write([order_commit("b")])
    assert model.in_flight == 0  # the cluster answered before the client gave up: nothing left running
    model.primaries(INDEX, active=True)
    await sink.write([order_commit("b")])


def test_the_feeds_backoff_is_jittered() -> None:
    for backoff in (feed.RETRY_BACKOFF, feed.STALL_BACKOFF):
        pauses = {backoff(4) for _ in range(50)}
        assert len(pauses) > 1 and all(backoff.base_s * 2**4 / 2 <= p <= backoff.base_s * 2**4 for p in pauses)
