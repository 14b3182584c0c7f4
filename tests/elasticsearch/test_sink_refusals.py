"""A cluster that refuses writes for its own reasons (a write block, a closed index, an expired
API key, a missing privilege, a server error) stalls the feed; only what a record causes is set
aside. Against the stateful fake (``fake_es.EsModel``), the sink and then the whole feed."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.conftest import order_commit
from tests.elasticsearch.fake_es import EsModel
from tests.helpers import held_slot
from wowd import metrics
from wowd.errors import SinkWriteError, StoreRefused
from wowd.model import AggregateRef, AggregateType, Commit, stream_id
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

pytestmark = pytest.mark.anyio

CONTEXT = "ctx"
TYPE = AggregateType(context=CONTEXT, aggregate="order")
INDEX = "wow.ctx.order.events"
PARTITIONS = 4


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


@pytest.fixture
async def feed_backend(tmp_path: Path, client: AsyncElasticsearch) -> AsyncIterator[tuple[Any, Any]]:
    """The embedded stores with the Elasticsearch sink on the stateful fake."""
    from wowd.config import load_settings
    from wowd.stores.embedded import open_embedded

    settings = load_settings(context=CONTEXT, partitions=PARTITIONS, embedded={"path": tmp_path / "wowd.db"})
    backend = await open_embedded(settings)
    backend.sink_factory = lambda type_: ElasticsearchEventSink(client, type_, ddl=Ddl.AUTO)
    try:
        yield settings, backend
    finally:
        await backend.close()


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    while True:  # polls the stores (inside the caller's fail_after)
        if await check():
            return
        await anyio.sleep(0.02)


@pytest.mark.parametrize("kind", ["closed index", "expired key", "write block"])
async def test_the_index_view_stalls_while_the_cluster_refuses_and_resumes_losing_nothing(
    feed_backend: tuple[Any, Any], model: EsModel, kind: str
) -> None:
    """The cluster refuses every write: the index view stalls (naming the cause), the timer view
    goes on (the slot is not stalled); once the refusal is lifted the index catches up from its
    own checkpoints, every commit in it exactly once."""
    from wowd.daemon.feed import CONSUMER, Feeder
    from wowd.daemon.waker import Waker
    from wowd.views import view_named

    settings, backend = feed_backend
    index_consumer = view_named("index").consumer
    await backend.sink(TYPE).prepare()  # the index as wowd makes it, then refused
    refuse, lift, message = REFUSALS[kind]
    refuse(model)
    commits = [commit(f"order-{i}") for i in range(6)]
    assert await backend.log.append_many(commits) == ["appended"] * 6
    parts = sorted({c.partition(PARTITIONS) for c in commits})
    held = held_slot(PARTITIONS)
    feeder = Feeder(settings, backend)

    async def index_stalled() -> bool:
        return "index" in feeder.view_stalls()

    async def timers_fed() -> bool:
        return len(await backend.log.checkpoints(CONSUMER, parts)) == len(parts)

    async def index_fed() -> bool:
        cps = await backend.log.checkpoints(index_consumer, parts)
        return sum(1 for cp in cps.values() if cp.position) == len(parts)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, Waker())
            await _until(index_stalled)
            await _until(timers_fed)
            # the index stalled at once, naming the cause; nothing set aside, its checkpoints
            # not moved; the timer view fed every commit and the slot is not stalled
            why = feeder.view_stalls()["index"]
            assert "StoreRefused" in why and re.search(message, why)
            assert feeder.stalled is None
            assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 1
            assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="timers")._value.get() == 0
            assert await backend.log.quarantined() == []
            assert not any(cp.position for cp in (await backend.log.checkpoints(index_consumer, parts)).values())
            lift(model)
            await _until(index_fed)
            held.request_stop()
    assert feeder.view_stalls() == {}
    assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 0
    assert await backend.log.quarantined() == []
    # every commit in the index, exactly once
    live = model.indices[INDEX].live
    assert sorted(live) == sorted(stream_id(c.ref, 1) for c in commits)
    assert sorted(d.source["aggregate_id"] for d in live.values()) == sorted(c.ref.id for c in commits)
