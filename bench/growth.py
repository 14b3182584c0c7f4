"""Growth: what a due read costs as the work grows.

- Embedded: ``EmbeddedTimerFiring.due`` over every partition with a fixed 100 due timers while the
  stored-but-not-due timers grow from 1k to 1M; the time must stay flat (the partial index
  ``(partition, due_at, timer_id)`` bounds the scan to what is due).
- MongoDB, on the wire: the MongoDB timer stores against a MockupDB black-pipe server, with 1, 10
  and 100 aggregate types (collections) registered: the commands one ``due`` sends (one
  ``aggregate`` on the registry, whatever the number of types), and the commands of one batch of
  1,000 timers of one type (due, claim settle, fired settle).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import bson

from bench.common import BENCH_CONTEXT, create_timer_tables, insert_timer_rows, now_ms, timer_rows

__all__ = ["run_embedded", "run_mongo_wire"]

PARTITIONS = 64
DUE = 100
FAR = 4_102_444_800_000  # 2100-01-01


async def _embedded(sizes: list[int], reads: int) -> dict[str, Any]:
    from tests.timer_stores import embedded_timers

    out: dict[str, Any] = {"sizes": sizes, "due_read_ms": [], "stored": []}
    with tempfile.TemporaryDirectory() as t:
        path = Path(t) / "growth.db"
        create_timer_tables(path)
        now = now_ms()
        insert_timer_rows(path, timer_rows(DUE, due_at=now - 1000, partitions=PARTITIONS, prefix="due"))
        store = embedded_timers(path, context=BENCH_CONTEXT, partitions=PARTITIONS)
        await store.prepare()
        parts = frozenset(range(PARTITIONS))
        stored = 0
        for size in sizes:
            add = size - stored
            if add > 0:
                insert_timer_rows(
                    path,
                    timer_rows(add, due_at=lambda i: FAR + i, partitions=PARTITIONS, start=stored, prefix="later"),
                )
                stored = size
            for _ in range(3):  # warm the page cache and the worker thread
                got = await store.firing.due(parts, now, 1000)
            assert len(got) == DUE, len(got)
            times = []
            for _ in range(reads):
                started = time.perf_counter()
                await store.firing.due(parts, now, 1000)
                times.append((time.perf_counter() - started) * 1000)
            out["due_read_ms"].append(statistics.median(times))
            out["stored"].append(stored + DUE)
        await store.close()
    times = out["due_read_ms"]
    # the spread: slowest / fastest read over the sizes (flat: close to 1)
    out["growth_ratio"] = max(times) / min(times) if min(times) > 0 else float("nan")
    out["last_over_first"] = times[-1] / times[0] if times[0] > 0 else float("nan")
    return out


def run_embedded(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: median due-read time (ms) per stored size."""
    return anyio.run(_embedded, [int(s) for s in params["sizes"]], int(params.get("reads", 50)))


# --------------------------------------------------------------------------- MongoDB on the wire


class _Wire:
    """Answers the store's commands from the MockupDB thread and counts them by name."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sizes: list[int] = []
        self.stages: list[int] = []
        self.registry: list[dict[str, Any]] = []
        self.answer_timers: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()
            self.sizes.clear()
            self.stages.clear()

    def handle(self, req: Any) -> bool:
        name = req.command_name
        if name in ("endSessions", "killCursors", "abortTransaction"):
            req.ok()
            return True
        if name not in ("find", "aggregate", "update", "delete", "insert", "findAndModify"):
            return False
        with self.lock:
            self.counts[name] += 1
            self.sizes.append(len(bson.encode(dict(req.doc))))
        ns = f"wowd.{req.doc[name]}" if isinstance(req.doc.get(name), str) else "wowd.x"
        if name == "find":
            req.ok(cursor={"id": 0, "ns": ns, "firstBatch": self.registry})
        elif name == "aggregate":
            with self.lock:
                self.stages.append(len(req.doc["pipeline"]))
            batch = [{"registered": len(self.registry)}, *self.answer_timers]
            req.ok(cursor={"id": 0, "ns": ns, "firstBatch": batch})
        elif name == "update":
            n = len(req.doc.get("updates", [])) or len(req.docs)
            req.ok(n=n, nModified=n)
        elif name == "delete":
            n = len(req.doc.get("deletes", [])) or len(req.docs)
            req.ok(n=n)
        else:
            req.ok(n=1)
        return True


async def _mongo(type_counts: list[int], batch: int) -> dict[str, Any]:
    from mockupdb import MockupDB
    from pymongo import AsyncMongoClient

    from tests.timer_stores import mongo_timers
    from wowd.model import AggregateRef, Timer, TimerChange, deterministic_timer_id, partition
    from wowd.stores.mongo.schema import TIMER_FORMAT
    from wowd.stores.mongo.timer_docs import timer_to_doc

    wire = _Wire()
    server = MockupDB(auto_ismaster={"maxWireVersion": 21}, verbose=False)
    server.autoresponds(wire.handle)
    server.run()
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False
    )
    rows: list[dict[str, Any]] = []
    try:
        for k in type_counts:
            wire.registry = [
                {
                    "_id": f"wow_timer__{BENCH_CONTEXT}__t{i}",
                    "context": BENCH_CONTEXT,
                    "aggregate": f"t{i}",
                    "format": TIMER_FORMAT,
                    "created_at": 1,
                }
                for i in range(k)
            ]
            timers = []
            for i in range(batch):
                owner = AggregateRef(context=BENCH_CONTEXT, aggregate="t0", id=f"agg-{i}")
                timers.append(
                    Timer(
                        timer_id=deterministic_timer_id(owner, "remind", 1),
                        partition=partition(owner.id, PARTITIONS),
                        owner=owner,
                        key="remind",
                        version=1,
                        due_at=1000 + i,
                        scheduled_at=1000 + i,
                        target=AggregateRef(context="billing", aggregate="invoice", id=f"inv-{i}"),
                        body='{"body":{},"name":"remind"}',
                    )
                )
            docs = []
            for x in timers:
                d = timer_to_doc(x)
                d["owner"]["aggregate"] = "t0"
                docs.append(d)
            wire.answer_timers = docs
            store = mongo_timers(client, "wowd", context=BENCH_CONTEXT, partitions=PARTITIONS)
            with anyio.fail_after(30):
                await store.prepare()
                wire.reset()
                due = await store.firing.due(frozenset(range(PARTITIONS)), 10_000, batch)
                due_cmds = sum(wire.counts.values())
                due_bytes = wire.sizes[-1] if wire.sizes else 0
                stages = wire.stages[-1] if wire.stages else 0
                claims = [TimerChange.claim(x, owner_key="bench", fence=1, until=99_999) for x in due]
                wire.reset()
                await store.firing.settle(claims)
                claim_cmds = sum(wire.counts.values())
                claimed = [c for ch in claims if (c := ch.applied()) is not None]
                wire.reset()
                await store.firing.settle([TimerChange.fired(x, fence=1, next_due=None) for x in claimed])
                fired_cmds = sum(wire.counts.values())
            rows.append(
                {
                    "types": k,
                    "due_timers": len(due),
                    "due_commands": due_cmds,
                    "pipeline_stages": stages,
                    "due_command_bytes": due_bytes,
                    "claim_commands": claim_cmds,
                    "fired_commands": fired_cmds,
                    "batch_commands": due_cmds + claim_cmds + fired_cmds,
                }
            )
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await client.close()
        server.stop()
    return {"batch": batch, "rows": rows}


def run_mongo_wire(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: commands on the wire per due read and per batch, by number of aggregate types."""
    return anyio.run(_mongo, [int(k) for k in params.get("types", [1, 10, 100])], int(params.get("batch", 1000)))
