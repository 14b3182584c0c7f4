"""The feed of a slot into the Elasticsearch sink, on the embedded stores: a test appends commits
while the cluster fails, checks what the index view did (stalled, naming the cause; nothing set
aside; its checkpoints where they were), lets the cluster take writes again and checks that every
commit is in the index once."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from elasticsearch import AsyncElasticsearch

from tests.helpers import held_slot
from wowd import metrics
from wowd.model import Commit
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

PARTITIONS = 4


@asynccontextmanager
async def embedded_with_sink(
    tmp_path: Path, client: AsyncElasticsearch, context: str = "ctx", **sink: Any
) -> AsyncIterator[tuple[Any, Any]]:
    """The embedded stores of ``context`` with the Elasticsearch sink of ``client``."""
    from wowd.config import load_settings
    from wowd.stores.embedded import open_embedded

    settings = load_settings(context=context, partitions=PARTITIONS, embedded={"path": tmp_path / "wowd.db"})
    backend = await open_embedded(settings)
    sink.setdefault("ddl", Ddl.AUTO)
    backend.sink_factory = lambda type_: ElasticsearchEventSink(client, type_, **sink)
    try:
        yield settings, backend
    finally:
        await backend.close()


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    while True:  # polls the stores (inside the caller's fail_after)
        if await check():
            return
        await anyio.sleep(0.02)


async def index_view_stalls_and_catches_up(
    settings: Any,
    backend: Any,
    commits: Sequence[Commit],
    *,
    cause: str,
    lift: Callable[[], None],
    within_s: float = 20,
) -> str:
    """Feeds ``commits`` while the cluster fails: the index view stalls at once naming ``cause``
    (a regular expression) as the store's refusal, the timer view goes on, nothing is
    quarantined and no index checkpoint moves; after ``lift()`` every commit is indexed. Answers
    the stall's reason."""
    from wowd.daemon.feed import CONSUMER, Feeder
    from wowd.daemon.waker import Waker
    from wowd.views import view_named

    index_consumer = view_named("index").consumer
    assert await backend.log.append_many(list(commits)) == ["appended"] * len(commits)
    parts = sorted({c.partition(PARTITIONS) for c in commits})
    held = held_slot(PARTITIONS)
    feeder = Feeder(settings, backend)

    async def index_stalled() -> bool:
        return "index" in feeder.view_stalls()

    async def timers_fed() -> bool:
        return len(await backend.checkpoints.read(CONSUMER, parts)) == len(parts)

    async def index_fed() -> bool:
        cps = await backend.checkpoints.read(index_consumer, parts)
        return sum(1 for cp in cps.values() if cp.position) == len(parts)

    with anyio.fail_after(within_s):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, Waker())
            await until(index_stalled)
            await until(timers_fed)
            why = feeder.view_stalls()["index"]
            assert "StoreRefused" in why and re.search(cause, why), why
            assert feeder.stalled is None  # the index view's stall, not the slot's
            assert metrics.FEED_STALLED.labels(slot=str(held.slot), view="index")._value.get() == 1
            assert await backend.quarantine.items() == []
            assert not any(cp.position for cp in (await backend.checkpoints.read(index_consumer, parts)).values())
            lift()
            await until(index_fed)
            held.request_stop()
    assert feeder.view_stalls() == {}
    assert await backend.quarantine.items() == []
    return why
