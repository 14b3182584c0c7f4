"""The ceiling: a bare synchronous loop doing the embedded store's own SQLite statements in
batches of 1,000 on one connection (the due read and the claim by ``rowid`` in one write
transaction, as ``claim_due``; the outbox insert; the DONE tombstone of each fired timer, as a
fired ``settle``), with no async hop, no Python objects per timer and no daemon. wowd's firing
path is compared with it."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    BENCH_CONTEXT,
    cpu_seconds,
    create_timer_tables,
    insert_timer_rows,
    lag_stats,
    now_ms,
    peak_rss_mb,
    timer_rows,
)
from wowd.stores.embedded.outbox import put_sql as outbox_put_sql
from wowd.stores.embedded.schema import OUTBOX_SCHEMA as OUTBOX_SCHEMA
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_firing import claim_rowid_sql, due_plan, due_union_sql, settle_sql

__all__ = ["bare_loop", "run_burst"]

_TARGET = '{"context":"billing","aggregate":"invoice","tenant_id":"(0)","id":"%s"}'


def _request_id(timer_id: str, scheduled_at: int) -> str:
    return f"{timer_id}:{scheduled_at}"


def bare_loop(
    conn: sqlite3.Connection,
    *,
    partitions: int,
    batch: int,
    context: str = BENCH_CONTEXT,
    fused: bool = False,
) -> int:
    """Fires every due timer; answers how many. Each batch, each step in its own ``BEGIN
    IMMEDIATE`` transaction as the store and the outbox gateway do: the due read (the store's
    compound statement over the partial index) and the claim ``executemany`` by ``rowid``; one
    outbox ``executemany``; one ``executemany`` of the DONE tombstones.

    ``fused`` (an experiment, not wowd's path): read, outbox insert and tombstone in one write
    transaction and no claim, which an outbox in the timers' own SQLite file would allow."""
    (group,) = due_plan(range(partitions))  # one compound statement (up to DUE_ARMS partitions)
    select = due_union_sql(context, len(group), batch, rowid=True)
    claim = claim_rowid_sql(context)
    done = settle_sql(context, "done")
    insert = outbox_put_sql()
    fired = 0
    while True:
        now = now_ms()
        until = now + 30_000
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute(select, (now, *group)).fetchall()
        if not rows:
            conn.execute("COMMIT")
            return fired
        # row: timer_id 0, partition 1, aggregate 2, owner_tenant 3, owner_id 4, key 5, revision 22, rowid 23
        keys = [(r[1], r[2], r[3], r[4], r[5], r[0]) for r in rows]
        if not fused:
            conn.executemany(claim, [(until, "bare", 1, r[23], r[22]) for r in rows])
            conn.execute("COMMIT")
            conn.execute("BEGIN IMMEDIATE")
        created = now_ms()
        conn.executemany(
            insert,
            [(_request_id(r[0], r[9]), r[0], _TARGET % r[13], r[14], r[9], 1, "bare", created) for r in rows],
        )
        if not fused:
            conn.execute("COMMIT")
            conn.execute("BEGIN IMMEDIATE")
        revision = 0 if fused else 1  # the claim bumped it
        conn.executemany(done, [(*k, r[22] + revision) for k, r in zip(keys, rows, strict=True)])
        conn.execute("COMMIT")
        fired += len(rows)


def run_burst(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: ``n`` timers all due at one instant (or, with ``spread_ms``, spread over that window
    in insertion order: the B-tree pages then follow the firing order), fired by :func:`bare_loop`
    (``fused``: its one-transaction experiment)."""
    n = int(params["n"])
    partitions = int(params.get("partitions", 64))
    batch = int(params.get("batch", 1000))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ceiling.db"
        create_timer_tables(path)
        conn = sqlite3.connect(str(path), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        for stmt in OUTBOX_SCHEMA:
            conn.execute(stmt)
        spread = int(params.get("spread_ms", 0))
        due = now_ms() + 300 + n // 50  # after the insert below
        insert_timer_rows(path, timer_rows(n, due_at=lambda i: due + i * spread // n, partitions=partitions))
        due += spread
        wait = (due - now_ms()) / 1000
        if wait > 0:
            time.sleep(wait)
        cpu0 = cpu_seconds()
        start = time.perf_counter()
        fired = bare_loop(conn, partitions=partitions, batch=batch, fused=bool(params.get("fused", False)))
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds() - cpu0
        lags = [int(r[0]) for r in conn.execute("SELECT created_at - scheduled_at FROM outbox")]
        conn.close()
    if fired != n:
        raise RuntimeError(f"bare loop fired {fired} of {n}")
    last = max(lags)
    return {
        "n": n,
        "fired": fired,
        "fired_per_s": n / elapsed,
        "drain_s": elapsed,
        "spread_ms": spread,
        "max_lag_ms": last,
        **lag_stats(lags).as_dict(),
        "peak_rss_mb": peak_rss_mb(),
        "cpu_s": cpu,
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(run_burst(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"n": 10_000})))
