"""What wowd's Elasticsearch user must hold, and how ``wowd check`` asks the cluster for it
(``_security/user/_has_privileges``), against the stateful fake (``fake_es.EsModel``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, serving
from wowd.cli.check import _sink_privileges
from wowd.errors import StorageError, StoreRefused
from wowd.model import AggregateRef, AggregateType, Commit, DomainEvent
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"
A = {"owner_id": "u1", "space_id": "s1", "tags": ["x"]}
B = {"owner_id": "u2", "space_id": "s1", "tags": ["x"]}

DOCUMENTED_INDEX = {"create_doc", "read", "index", "maintenance", "view_index_metadata", "create_index"}
"""The index privileges docs/stores.md lists (with the cluster privileges below)."""
DOCUMENTED_CLUSTER = {"monitor", "manage_index_templates"}


def commit(id: str, version: int, access: dict[str, Any] = A, access_version: int = 1) -> Commit:
    return Commit(
        ref=AggregateRef(context="ctx", aggregate="order", id=id),
        version=version,
        command_id=f"cmd-{version}",
        request_id=f"req-{id}-{version}",
        create_time=1_700_000_000_000 + version,
        events=(DomainEvent(id=f"ev-{version}", name="OrderChanged", body={"n": version}),),
        access=access,
        access_version=access_version,
    )


@pytest.fixture
def fake() -> Iterator[FakeElasticsearch]:
    with serving() as server:
        server.model = EsModel()
        yield server


@pytest.fixture
def model(fake: FakeElasticsearch) -> EsModel:
    assert fake.model is not None
    return fake.model


@pytest.fixture
async def client(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    es = AsyncElasticsearch(fake.url, request_timeout=5)
    try:
        yield es
    finally:
        await es.close()


async def test_the_documented_privileges_run_writes_stamps_and_checks(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    model.index_privileges, model.cluster_privileges = set(DOCUMENTED_INDEX), set(DOCUMENTED_CLUSTER)
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    await sink.write([commit("a", 1), commit("a", 2)])
    await sink.write([commit("a", 3, B, 3)])  # an access change: refresh, look-ups, a stamp
    model.indices[INDEX].refresh()
    assert [d["owner_id"] for d in await sink.documents(commit("a", 1).ref)] == ["u2"] * 3
    assert await sink.missing_privileges() == []
    assert await _sink_privileges(sink) == "every privilege held"


async def test_without_maintenance_and_monitor_the_stamps_fail_and_check_names_what_is_missing(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    await sink.write([commit("a", 1)])
    # what was documented before: no maintenance (refresh), no cluster monitor (health)
    model.index_privileges = {"create_doc", "read", "write", "view_index_metadata", "monitor", "create_index"}
    model.cluster_privileges = set()
    with pytest.raises(StoreRefused, match=r"lacks a privilege.*indices:admin/refresh"):
        await sink.write([commit("a", 2, B, 2)])
    assert await sink.missing_privileges() == [
        "cluster monitor",
        "cluster manage_index_templates",
        f"index maintenance on {INDEX}",
    ]
    with pytest.raises(StorageError, match=r"lacks cluster monitor, cluster manage_index_templates, index maintenance"):
        await _sink_privileges(sink)
    model.security_enabled = False
    assert await sink.missing_privileges() is None
