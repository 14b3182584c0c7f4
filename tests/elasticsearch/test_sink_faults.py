"""Whose fault a failure is: the sink's one table (``wowd.stores.elasticsearch.faults``), then the
store conditions Elasticsearch reports per item or through a proxy, against the stateful fake:
each stalls the index view with nothing quarantined; only what a record causes is set aside."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.conftest import order_commit
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, proxy_page
from tests.elasticsearch.feeding import embedded_with_sink, index_view_stalls_and_catches_up
from wowd.errors import SinkWriteError, StorageUnavailable, StoreRefused
from wowd.model import AggregateType, stream_id
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.documents import events_mapping
from wowd.stores.elasticsearch.faults import Failure, Fault, classify
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"
IAE = "illegal_argument_exception"
PROXY = "not elasticsearch"

# --------------------------------------------------------------------------- the table

IMMENSE = (
    'Document contains at least one immense term in field="request_id" (whose UTF8 encoding is longer than the max '
    "length 32766), all of which were skipped."
)
TABLE: list[tuple[str, Failure, Fault, str]] = [
    # an illegal_argument_exception is the record's only when its reason is about the record
    ("immense term", Failure(status=400, type=IAE, reason=IMMENSE, records=1), Fault.RECORD, "cannot be written"),
    (
        "shard document limit",
        Failure(status=400, type=IAE, reason="Number of documents in the shard cannot exceed [2147483519]", records=1),
        Fault.STORE,
        "most documents Lucene allows",
    ),
    (
        "alias without a write index",
        Failure(
            status=400, type=IAE, reason="no write index is defined for alias [wow.ctx.order.events]. The", records=1
        ),
        Fault.STORE,
        "an alias without a write index",
    ),
    (
        "data stream refusing custom routing",
        Failure(
            status=400,
            type=IAE,
            reason="index request targeting data stream [x] specifies a custom routing but the [allow_custom_routing]",
            records=1,
        ),
        Fault.STORE,
        "refuses custom routing",
    ),
    (
        "data stream wanting @timestamp",
        Failure(
            status=400,
            type="document_parsing_exception",
            reason="[1:2] failed to parse: data stream timestamp field [@timestamp] is missing",
            cause_type=IAE,
            cause_reason="data stream timestamp field [@timestamp] is missing",
            records=1,
        ),
        Fault.STORE,
        "is a data stream",
    ),
    (
        "strict mapping, a field wowd writes",
        Failure(
            status=400,
            type="strict_dynamic_mapping_exception",
            reason="[1:2] mapping set to strict, dynamic introduction of [owner_id] within [access] is not allowed",
            records=1,
        ),
        Fault.STORE,
        "lacks access.owner_id, a field wowd writes",
    ),
    (
        "strict mapping, another field",
        Failure(
            status=400,
            type="strict_dynamic_mapping_exception",
            reason="[1:2] mapping set to strict, dynamic introduction of [extra] within [header] is not allowed",
            records=1,
        ),
        Fault.RECORD,
        "cannot be written",
    ),
    (
        "a value the field cannot take",
        Failure(status=400, type="document_parsing_exception", reason="failed to parse field [version]", records=1),
        Fault.RECORD,
        "cannot be written",
    ),
    (
        "flood-stage block",
        Failure(
            status=429,
            type="cluster_block_exception",
            reason="index [x] blocked by: [TOO_MANY_REQUESTS/12/disk usage exceeded flood-stage watermark, index has "
            "read-only-allow-delete block];",
            records=1,
        ),
        Fault.STORE,
        "flood-stage watermark",
    ),
    ("a rejection", Failure(status=429, type="es_rejected_execution_exception", records=1), Fault.TRANSIENT, "busy"),
    ("a proxy's 404", Failure(status=404, type=PROXY, from_es=False, records=3), Fault.STORE, "not"),
    ("a proxy's 405", Failure(status=405, type=PROXY, from_es=False, records=1), Fault.STORE, "not"),
    (
        "a proxy's 408",
        Failure(status=408, type=PROXY, from_es=False, records=1),
        Fault.TRANSIENT,
        "proxy",
    ),
    (
        "a proxy's 502",
        Failure(status=502, type=PROXY, from_es=False, records=1),
        Fault.TRANSIENT,
        "proxy",
    ),
    ("a bulk refused", Failure(status=400, type=IAE, reason="bad", records=3), Fault.RECORD, "cannot be written"),
    ("a stamp refused", Failure(status=400, type=IAE, reason="bad", records=0), Fault.STORE, "refuses the request"),
    ("a server error", Failure(status=500, type="null_pointer_exception", records=1), Fault.STORE, "fails the request"),
    ("credentials", Failure(status=401, type="security_exception", records=1), Fault.STORE, "credentials"),
    ("one record too large", Failure(status=413, from_es=False, records=1), Fault.RECORD, "the record is larger"),
    ("a bulk too large", Failure(status=413, from_es=False, records=2), Fault.STORE, "max_content_length"),
]


@pytest.mark.parametrize(("failure", "fault", "says"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE])
def test_the_table_gives_a_record_only_what_the_record_causes(failure: Failure, fault: Fault, says: str) -> None:
    verdict = classify(failure, INDEX, "bulk")
    assert verdict.fault is fault and says in verdict.message, verdict


# --------------------------------------------------------------------------- per item, on the fake


def sink_of(client: AsyncElasticsearch, ddl: Ddl = Ddl.AUTO) -> ElasticsearchEventSink:
    return ElasticsearchEventSink(client, TYPE, ddl=ddl)


def _as_alias_without_write_index(model: EsModel) -> None:
    """The events index name made an alias of two indices, neither the write index (a rollover
    set up by hand, half done)."""
    mapping = events_mapping()
    for n in (1, 2):
        model.indices[f"{INDEX}-00000{n}"] = EsModel._new_index(dict(mapping), {})
    model.aliases[INDEX] = {f"{INDEX}-000001": None, f"{INDEX}-000002": None}


def _with_a_data_stream_template(allow_custom_routing: bool) -> Callable[[EsModel], None]:
    def install(model: EsModel) -> None:
        model.templates["logs-like"] = {
            "index_patterns": ["wow.*"],
            "priority": 500,
            "data_stream": {"allow_custom_routing": allow_custom_routing},
            "template": {"mappings": events_mapping()},
        }

    return install


async def test_a_full_shard_is_the_stores_refusal(client: AsyncElasticsearch, model: EsModel) -> None:
    sink = sink_of(client)
    model.max_docs_per_shard = 4  # each commit is two Lucene documents: its own and its event's
    await sink.write([order_commit("a"), order_commit("b")])
    with pytest.raises(StoreRefused, match=r"most documents Lucene allows.*cannot exceed \[4\]"):
        await sink.write([order_commit("c")])


async def test_an_alias_without_a_write_index_is_the_stores_refusal(client: AsyncElasticsearch, model: EsModel) -> None:
    _as_alias_without_write_index(model)
    sink = sink_of(client, Ddl.VALIDATE)
    with pytest.raises(StoreRefused, match="wow.ctx.order.events is an alias without a write index"):
        await sink.write([order_commit("a")])
    model.aliases[INDEX][f"{INDEX}-000002"] = True  # the operator names the write index
    await sink.write([order_commit("a")])
    assert list(model.indices[f"{INDEX}-000002"].live) == [stream_id(order_commit("a").ref, 1)]


async def test_a_data_stream_is_the_stores_refusal_whatever_its_routing(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    # a data stream template over the events indexes: wowd cannot create its index under ddl auto
    _with_a_data_stream_template(allow_custom_routing=False)(model)
    with pytest.raises(StoreRefused, match=r"another index template claims .*creates data streams only"):
        await sink_of(client).write([order_commit("a")])
    # under ddl none a write makes the data stream: it refuses the custom routing
    with pytest.raises(StoreRefused, match="data stream whose template refuses custom routing"):
        await sink_of(client, Ddl.NONE).write([order_commit("a")])
    # one that takes it wants an @timestamp
    model.data_streams.clear()
    model.indices.clear()
    _with_a_data_stream_template(allow_custom_routing=True)(model)
    with pytest.raises(StoreRefused, match="a data stream, which wants an @timestamp"):
        await sink_of(client, Ddl.NONE).write([order_commit("a")])


async def test_a_strict_mapping_without_a_field_wowd_writes_is_the_stores_refusal(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    mapping = events_mapping()
    del mapping["properties"]["deleted"]  # an index template of an older layout, at a higher priority
    model.templates["by-hand"] = {"index_patterns": ["wow.*"], "priority": 300, "template": {"mappings": mapping}}
    with pytest.raises(StoreRefused, match="lacks deleted, a field wowd writes"):
        await sink_of(client, Ddl.NONE).write([order_commit("a")])


async def test_the_flood_stage_block_is_a_refusal_naming_the_disk(client: AsyncElasticsearch, model: EsModel) -> None:
    sink = sink_of(client)
    await sink.write([order_commit("a")])
    model.flood(INDEX)
    with pytest.raises(StoreRefused, match=r"over the flood-stage watermark.*\[429\] cluster_block_exception"):
        await sink.write([order_commit("b")])
    model.flood(INDEX, on=False)  # the disk below the high watermark: Elasticsearch lifts the block
    await sink.write([order_commit("b")])


async def test_a_proxys_page_is_never_the_records_fault(
    client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel
) -> None:
    sink = sink_of(client)
    await sink.prepare()
    for status, expected in ((404, StoreRefused), (405, StoreRefused), (408, StorageUnavailable)):
        fake.proxy = (rf"/{INDEX}/_bulk", status, proxy_page(status))
        with pytest.raises(expected, match=rf"\[{status}\] not elasticsearch: <html>") as info:
            await sink.write([order_commit("a")])
        assert not isinstance(info.value, SinkWriteError)
        assert expected is StoreRefused or not isinstance(info.value, StoreRefused)
    fake.proxy = None
    await sink.write([order_commit("a")])


# --------------------------------------------------------------------------- the feed


def _put(attr: str, value: object) -> Callable[[EsModel], None]:
    return lambda m: setattr(m, attr, value)


STALLS: dict[str, tuple[Callable[[EsModel], None], Callable[[EsModel, FakeElasticsearch], None], str]] = {
    "full shard": (
        _put("max_docs_per_shard", 0),
        lambda m, f: setattr(m, "max_docs_per_shard", 1000),
        "most documents Lucene allows",
    ),
    "flood stage": (lambda m: m.flood(INDEX), lambda m, f: m.flood(INDEX, on=False), "flood-stage watermark"),
    "a proxy's 404": (
        lambda m: None,
        lambda m, f: setattr(f, "proxy", None),
        r"not Elasticsearch's .*\[404\] not elasticsearch",
    ),
}


@pytest.mark.parametrize("kind", sorted(STALLS))
async def test_the_index_view_stalls_on_a_store_condition_and_sets_no_commit_aside(
    tmp_path: Path, client: AsyncElasticsearch, fake: FakeElasticsearch, model: EsModel, kind: str
) -> None:
    refuse, lift, cause = STALLS[kind]
    async with embedded_with_sink(tmp_path, client) as (settings, backend):
        await backend.sink(TYPE).prepare()
        refuse(model)
        if kind == "a proxy's 404":
            fake.proxy = (rf"/{INDEX}/_bulk", 404, proxy_page(404))
        commits = [order_commit(f"order-{i}") for i in range(6)]
        await index_view_stalls_and_catches_up(settings, backend, commits, cause=cause, lift=lambda: lift(model, fake))
    assert sorted(model.indices[INDEX].live) == sorted(stream_id(c.ref, 1) for c in commits)
