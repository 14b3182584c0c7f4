"""Throughput of the embedded timer store on the daemon's firing path (run by hand).

    .venv/bin/python bench/bench_embedded_timers.py [--timers 10000] [--batch 1000] [--partitions 64]

Puts N due timers, then measures, batch after batch until none is due: ``due`` of a batch,
a claim ``settle`` of it, the outbox insert of its commands, and the fired ``settle``
(once-rule timers: deleted). Prints timers/s (the daemon needs >= 25,000/s on this store).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from wowd.model import AggregateRef, OnceRule, Timer, TimerChange, deterministic_timer_id, partition
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.outbox import EmbeddedOutbox
from wowd.stores.embedded.outbox import put_sql as outbox_put_sql
from wowd.stores.embedded.timers import EmbeddedTimerStore, put_sql, table_name, timer_params

CONTEXT = "bench"


def make_timers(n: int, partitions: int, due: int) -> list[Timer]:
    out = []
    for i in range(n):
        owner = AggregateRef(context=CONTEXT, aggregate=("order", "cart", "invoice")[i % 3], id=f"agg-{i}")
        target = AggregateRef(context="billing", aggregate="invoice", id=f"inv-{i}")
        out.append(
            Timer(
                timer_id=deterministic_timer_id(owner, "remind", 1),
                partition=partition(owner.id, partitions),
                owner=owner,
                key="remind",
                version=1,
                due_at=due + i % 500,
                scheduled_at=due + i % 500,
                target=target,
                body='{"body":{"n":1},"name":"Remind"}',
                rule=OnceRule(),
            )
        )
    return out


async def outbox_insert(db: SqliteDatabase, timers: list[Timer]) -> None:
    """The outbox gateway's insert of a batch: the embedded outbox's statement, one executemany
    in one transaction (``EmbeddedOutbox.put`` takes one entry per call)."""
    rows = [
        (
            t.request_id,
            t.timer_id,
            json.dumps(
                {
                    "context": t.target.context,
                    "aggregate": t.target.aggregate,
                    "tenant_id": t.target.tenant_id,
                    "id": t.target.id,
                },
                separators=(",", ":"),
            ),
            t.body,
            t.scheduled_at,
            1,
            "bench",
            0,
        )
        for t in timers
    ]
    sql = outbox_put_sql()
    await db.run(db.transaction(lambda conn: conn.executemany(sql, rows)))


async def main(n: int, batch: int, partitions: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = SqliteDatabase(Path(tmp) / "bench.db")
        store = EmbeddedTimerStore(db, context=CONTEXT, partitions=partitions)
        await store.prepare()
        await EmbeddedOutbox(db).prepare()
        now = int(time.time() * 1000)
        timers = make_timers(n, partitions, now - 10_000)
        for agg in ("order", "cart", "invoice"):
            await store.put(next(t for t in timers if t.owner.aggregate == agg))
        params: list[Any] = [timer_params(t) for t in timers]
        sql = put_sql(CONTEXT)
        await db.run(db.transaction(lambda conn: conn.executemany(sql, params)))
        count = await db.run(lambda c: c.execute(f"SELECT count(*) FROM {table_name(CONTEXT)}").fetchone()[0])
        assert count == n, count

        parts = set(range(partitions))
        fired = 0
        t_due = t_claim = t_out = t_fired = 0.0
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            due = await store.due(parts, now, batch)
            t1 = time.perf_counter()
            if not due:
                break
            claims = [TimerChange.claim(t, owner_key="bench", fence=1, until=now + 30_000) for t in due]
            assert await store.settle(claims) == len(due)
            claimed = [c.applied() for c in claims]
            t2 = time.perf_counter()
            await outbox_insert(db, [t for t in claimed if t is not None])
            t3 = time.perf_counter()
            done = [TimerChange.fired(t, fence=1, next_due=None) for t in claimed if t is not None]
            assert await store.settle(done) == len(due)
            t4 = time.perf_counter()
            fired += len(due)
            t_due += t1 - t0
            t_claim += t2 - t1
            t_out += t3 - t2
            t_fired += t4 - t3
        elapsed = time.perf_counter() - start
        await store.close()
        db.close()
    print(f"fired {fired} timers in {elapsed:.3f}s: {fired / elapsed:,.0f} timers/s")
    print(
        f"  due {t_due * 1000:.0f} ms, claim settle {t_claim * 1000:.0f} ms,"
        f" outbox {t_out * 1000:.0f} ms, fired settle {t_fired * 1000:.0f} ms"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timers", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=64)
    a = ap.parse_args()
    anyio.run(main, a.timers, a.batch, a.partitions)
