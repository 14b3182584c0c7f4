"""Sink throughput: ``ElasticsearchEventSink.write`` against ``elasticsearch.helpers.async_bulk``
on the same documents, into a local endpoint that answers bulk requests instantly
(:mod:`bench.es_endpoint`, its own process).

Commits are version 1 of distinct aggregates (no access stamp to write: the write is its one
``_bulk``). Variants, each with its own ``AsyncElasticsearch`` client:

- ``wowd sink``: ``sink.write(batch)`` per batch of commits (``ddl=none``: no index request).
- ``async_bulk (prebuilt)``: the helper over action dicts built before the clock starts (its best
  case: the sink builds its documents from the commits inside ``write``).
- ``async_bulk (from commits)``: the helper over actions built from the commits as it goes (the
  same input as the sink).

Refreshes: ``WRITERS`` writers at once (the feeds of several slots into one index), each writing
batches of later versions of its own aggregates, with the access attributes the same as before
(no stamp) or changed in every batch (a refresh before the stamps): ``_refresh`` and
``_update_by_query`` requests per 1,000 commits, at the sink's default refresh interval.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx

from bench.common import REPO, cpu_seconds, median

__all__ = ["make_commits", "run_sink"]

CONTEXT = "bench"
AGGREGATE = "order"


def make_commits(n: int) -> list[Any]:
    from wowd.model import AggregateRef, Commit, DomainEvent

    out = []
    for i in range(n):
        ref = AggregateRef(context=CONTEXT, aggregate=AGGREGATE, id=f"order-{i}")
        out.append(
            Commit(
                ref=ref,
                version=1,
                command_id=uuid.uuid4().hex,
                request_id=uuid.uuid4().hex,
                create_time=1_700_000_000_000 + i,
                events=(
                    DomainEvent(
                        id=uuid.uuid4().hex,
                        name="OrderCreated",
                        body_type="demo.OrderCreated",
                        body={"order_id": ref.id, "items": [{"sku": "sku-1", "qty": 2}], "total": 42.5},
                    ),
                ),
                access={"owner_id": f"user-{i % 100}", "space_id": "", "tags": []},
                access_version=1,
            )
        )
    return out


def _actions(commits: Sequence[Any], index: str) -> list[dict[str, Any]]:
    from wowd.model import stream_id
    from wowd.stores.elasticsearch.documents import event_document

    return [
        {
            "_op_type": "create",
            "_index": index,
            "_id": stream_id(c.ref, c.version),
            "routing": c.ref.id,
            "_source": event_document(c),
        }
        for c in commits
    ]


async def _lazy_actions(commits: Sequence[Any], index: str) -> AsyncIterator[dict[str, Any]]:
    for a in _actions(commits, index):
        yield a


async def _measure(url: str, variant: str, commits: Sequence[Any], batch: int) -> tuple[float, float]:
    """``(seconds, cpu seconds)`` of one variant over every commit."""
    from elasticsearch import AsyncElasticsearch
    from elasticsearch.helpers import async_bulk

    from wowd.model import AggregateType
    from wowd.stores.elasticsearch.documents import index_name
    from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

    client = AsyncElasticsearch(url, request_timeout=60)
    index = index_name(AggregateType(context=CONTEXT, aggregate=AGGREGATE))
    try:
        prebuilt = _actions(commits, index) if variant == "async_bulk (prebuilt)" else []
        sink = ElasticsearchEventSink(client, AggregateType(context=CONTEXT, aggregate=AGGREGATE), ddl="none")
        cpu0 = cpu_seconds()
        started = time.perf_counter()
        if variant == "wowd sink":
            for i in range(0, len(commits), batch):
                await sink.write(commits[i : i + batch])
        elif variant == "async_bulk (prebuilt)":
            ok, errors = await async_bulk(client, prebuilt, chunk_size=batch, max_chunk_bytes=1 << 30)
            assert ok == len(commits) and not errors
        else:
            ok, errors = await async_bulk(
                client, _lazy_actions(commits, index), chunk_size=batch, max_chunk_bytes=1 << 30
            )
            assert ok == len(commits) and not errors
        return time.perf_counter() - started, cpu_seconds() - cpu0
    finally:
        await client.close()


VARIANTS = ("wowd sink", "async_bulk (prebuilt)", "async_bulk (from commits)")
WRITERS = 4


def make_versions(writer: int, aggregates: int, versions: int, changes: bool) -> list[list[Any]]:
    """The batches of one writer: version ``v`` of each of its aggregates in batch ``v - 2``
    (version 1 is written before the clock starts), the owner changed in every batch when
    ``changes``."""
    from wowd.model import AggregateRef, Commit, DomainEvent

    batches = []
    for v in range(1, versions + 1):
        batch = []
        for i in range(aggregates):
            ref = AggregateRef(context=CONTEXT, aggregate=AGGREGATE, id=f"w{writer}-order-{i}")
            owner = f"user-{v % 2}" if changes else "user-0"
            batch.append(
                Commit(
                    ref=ref,
                    version=v,
                    command_id=uuid.uuid4().hex,
                    request_id=uuid.uuid4().hex,
                    create_time=1_700_000_000_000 + v,
                    events=(DomainEvent(id=uuid.uuid4().hex, name="OrderChanged", body={"v": v}),),
                    access={"owner_id": owner, "space_id": "", "tags": []},
                    access_version=v if changes else 1,
                )
            )
        batches.append(batch)
    return batches


async def _measure_refreshes(
    url: str, http: Any, n: int, batch: int, changes: bool, refresh_interval_s: float | None = None
) -> dict[str, Any]:
    """Refresh and update-by-query requests per 1,000 commits of ``WRITERS`` writers at once, a
    refresh at most every ``refresh_interval_s`` (default: the sink's)."""
    from elasticsearch import AsyncElasticsearch

    from wowd.model import AggregateType
    from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

    versions = max(2, n // (WRITERS * batch) + 1)
    plans = [make_versions(w, batch, versions, changes) for w in range(WRITERS)]
    client = AsyncElasticsearch(url, request_timeout=60)
    interval: dict[str, Any] = {} if refresh_interval_s is None else {"refresh_interval_s": refresh_interval_s}
    try:
        sink = ElasticsearchEventSink(
            client, AggregateType(context=CONTEXT, aggregate=AGGREGATE), ddl="none", **interval
        )
        for plan in plans:  # version 1 of every aggregate: the LRU knows each stream
            await sink.write(plan[0])
        await http.post("/_bench/reset")
        started = time.perf_counter()

        async def feed(plan: list[list[Any]]) -> None:
            for b in plan[1:]:
                await sink.write(b)

        async with anyio.create_task_group() as tg:
            for plan in plans:
                tg.start_soon(feed, plan)
        seconds = time.perf_counter() - started
        stats = (await http.get("/_bench/stats")).json()
        commits = WRITERS * batch * (versions - 1)
        return {
            "changes": changes,
            "batch": batch,
            "commits": commits,
            "seconds": seconds,
            "refreshes_per_1000": stats["refreshes"] * 1000 / commits,
            "update_by_query_per_1000": stats["update_by_query"] * 1000 / commits,
            "bulks_per_1000": stats["requests"] * 1000 / commits,
        }
    finally:
        await client.close()


async def _run(n: int, batches: list[int], runs: int, refresh_interval_s: float | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as t:
        port_file = Path(t) / "es.port"
        proc = await anyio.open_process([sys.executable, "-m", "bench.es_endpoint", str(port_file)], cwd=str(REPO))
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if time.monotonic() > deadline or proc.returncode is not None:
                    raise RuntimeError("the bulk endpoint did not start")
                await anyio.sleep(0.02)
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
            commits = make_commits(n)
            rows = []
            samples: dict[tuple[int, str], list[tuple[float, float, float, int]]] = {}
            async with httpx.AsyncClient(base_url=url) as http:
                # runs interleaved: a burst of noise from a neighbour spreads over every variant
                for _ in range(runs):
                    for batch in batches:
                        for variant in VARIANTS:
                            gc.collect()
                            await http.post("/_bench/reset")
                            s, c = await _measure(url, variant, commits, batch)
                            stats = (await http.get("/_bench/stats")).json()
                            samples.setdefault((batch, variant), []).append(
                                (s, c, stats["bytes"] / s, stats["requests"])
                            )
                refresh_rows = [
                    await _measure_refreshes(url, http, n, batch, changes, refresh_interval_s)
                    for changes in (False, True)
                    for batch in batches
                ]
            rows = [
                {
                    "batch": batch,
                    "variant": variant,
                    "commits_per_s": n / median([x[0] for x in xs]),
                    "bytes_per_s": median([x[2] for x in xs]),
                    "cpu_s": median([x[1] for x in xs]),
                    "requests": xs[-1][3],
                }
                for (batch, variant), xs in samples.items()
            ]
        finally:
            proc.terminate()
            with anyio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
            await proc.aclose()
    return {"n": n, "runs": runs, "rows": rows, "refresh_rows": refresh_rows}


def run_sink(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: every variant at every batch size, ``runs`` times each (medians); the refresh rows
    at ``refresh_interval_s`` when given (else the sink's default)."""
    interval = params.get("refresh_interval_s")
    return anyio.run(
        _run,
        int(params.get("n", 20_000)),
        [int(b) for b in params.get("batches", [100, 1000, 5000])],
        int(params.get("runs", 3)),
        None if interval is None else float(interval),
    )
