"""A cluster that refuses writes for its own reasons (a write block, a closed index, an expired
API key, a missing privilege, a server error) stalls the feed; only what a record causes is set
aside. Against the stateful fake (``fake_es.EsModel``), the sink and then the whole feed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.conftest import order_commit
from tests.elasticsearch.fake_es import EsModel
from tests.elasticsearch.feeding import embedded_with_sink, index_view_stalls_and_catches_up
from wowd.errors import SinkWriteError, StoreRefused
from wowd.model import AggregateRef, AggregateType, Commit, stream_id
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

pytestmark = pytest.mark.anyio

CONTEXT = "ctx"
TYPE = AggregateType(context=CONTEXT, aggregate="order")
INDEX = "wow.ctx.order.events"


def ref(id: str) -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate="order", id=id)


def commit(id: str, version: int = 1, body: Any = None) -> Commit:
    return order_commit(id, version, body=body, context=CONTEXT)


REFUSALS: dict[str, tuple[Callable[[EsModel], None], Callable[[EsModel], None], str]] = {
    "write block": (
        lambda m: m.block_writes(INDEX),
        lambda m: m.block_writes(INDEX, on=False),
        r"index wow.ctx.order.events is write-blocked \(index.blocks.write\)",
    ),
    "closed index": (lambda m: m.close(INDEX), lambda m: m.open(INDEX), r"index wow.ctx.order.events is closed"),
    "expired key": (
        lambda m: setattr(m, "api_key_expired", True),
        lambda m: setattr(m, "api_key_expired", False),
        r"refuses wowd's credentials.*\[401\] security_exception",
    ),
    "missing privilege": (
        lambda m: setattr(m, "index_privileges", {"read", "view_index_metadata"}),
        lambda m: setattr(m, "index_privileges", None),
        r"lacks a privilege on wow.ctx.order.events.*create_doc",
    ),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
async def test_a_refusal_by_the_cluster_is_a_store_refusal_naming_its_cause(
    client: AsyncElasticsearch, model: EsModel, kind: str
) -> None:
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    await sink.prepare()
    refuse, lift, message = REFUSALS[kind]
    refuse(model)
    with pytest.raises(StoreRefused, match=message):
        await sink.write([commit("a"), commit("b")])
    lift(model)
    await sink.write([commit("a"), commit("b")])
    assert sorted(model.indices[INDEX].live) == sorted(stream_id(ref(i), 1) for i in "ab")


async def test_what_a_record_causes_is_still_its_own_refusal(client: AsyncElasticsearch, model: EsModel) -> None:
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    await sink.prepare()
    bad = replace(commit("bad"), header={"x": 1})
    model.indices[INDEX].mapping["properties"]["header"] = {"type": "long"}  # a field the record cannot fill
    with pytest.raises(SinkWriteError, match="document_parsing_exception") as info:
        await sink.write([commit("a"), bad])
    assert not isinstance(info.value, StoreRefused)


# --------------------------------------------------------------------------- the feed


@pytest.mark.parametrize("kind", ["closed index", "expired key", "write block"])
async def test_the_index_view_stalls_while_the_cluster_refuses_and_resumes_losing_nothing(
    tmp_path: Path, client: AsyncElasticsearch, model: EsModel, kind: str
) -> None:
    """The cluster refuses every write: the index view stalls (naming the cause), the timer view
    goes on (the slot is not stalled); once the refusal is lifted the index catches up from its
    own checkpoints, every commit in it exactly once."""
    refuse, lift, message = REFUSALS[kind]
    async with embedded_with_sink(tmp_path, client) as (settings, backend):
        await backend.sink(TYPE).prepare()  # the index as wowd makes it, then refused
        refuse(model)
        commits = [commit(f"order-{i}") for i in range(6)]
        await index_view_stalls_and_catches_up(settings, backend, commits, cause=message, lift=lambda: lift(model))
    # every commit in the index, exactly once
    live = model.indices[INDEX].live
    assert sorted(live) == sorted(stream_id(c.ref, 1) for c in commits)
    assert sorted(d.source["aggregate_id"] for d in live.values()) == sorted(c.ref.id for c in commits)
