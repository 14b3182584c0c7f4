"""Throughput of the embedded store on the daemon's firing path (run by hand).

    .venv/bin/python bench/bench_embedded_timers.py [--timers 20000] [--batch 1000] [--partitions 64]
    .venv/bin/python bench/bench_embedded_timers.py --daemon [--timers 20000] [--runs 3]

Store level (default): puts N timers due now into a fresh file, then runs, batch after batch until
none is due, what the timer loop runs on the embedded stores: the claim (``claim_due``: the due
read and the claim in one transaction; with a store without it, ``due`` then a claim ``settle``),
the ``OutboxGateway`` delivery into the outbox (one ``send_batch``: one ``put_many``), and the fired ``settle`` (once
rules: deleted). Prints timers/s, CPU seconds and the time of each step.

Daemon level (``--daemon``): starts ``python -m wowd run`` on a fresh file (outbox gateway,
``WOWD_TIMERS__BATCH``), waits until it is ready, puts N timers due now straight into its timer
table (the store's own ``put`` statement, one transaction) and polls the file until the outbox
holds all N and the timer table is empty. fired/s runs from the first outbox entry to the poll
that saw the last one settled. ``PYTHONPATH`` chooses the wowd the daemon runs (to compare two
trees on one machine).

The daemon's target: >= 25,000 timers/s on this store.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio

from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.model import AggregateRef, OnceRule, Timer, TimerChange, deterministic_timer_id, partition
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.outbox import EmbeddedOutbox
from wowd.stores.embedded.schema import timer_table
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_rows import timer_params
from wowd.stores.embedded.timer_view import put_sql

CONTEXT = "bench"
AGGREGATES = ("order", "cart", "invoice")


def make_timers(n: int, partitions: int, due: int) -> list[Timer]:
    out = []
    for i in range(n):
        owner = AggregateRef(context=CONTEXT, aggregate=AGGREGATES[i % 3], id=f"agg-{i}")
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


async def put_timers(store: EmbeddedTimers, db: SqliteDatabase, timers: list[Timer]) -> None:
    """Registers the aggregate types (one ``put`` each), then writes every timer with the store's
    ``put`` statement in one transaction."""
    for agg in AGGREGATES:
        await store.view.put(next(t for t in timers if t.owner.aggregate == agg))
    params: list[Any] = [timer_params(t) for t in timers]
    sql = put_sql(CONTEXT)
    await db.run(db.transaction(lambda conn: conn.executemany(sql, params)))


async def main(n: int, batch: int, partitions: int) -> None:
    """The store-level run (see the module's docstring)."""
    from wowd.delivery import Delivered, OutboxGateway

    with tempfile.TemporaryDirectory() as tmp:
        db = SqliteDatabase(Path(tmp) / "bench.db")
        store = embedded_timers(db, context=CONTEXT, partitions=partitions)
        await store.prepare()
        outbox = EmbeddedOutbox(db)
        await outbox.prepare()
        gateway = OutboxGateway(outbox)
        now = int(time.time() * 1000)
        timers = make_timers(n, partitions, now - 10_000)
        await put_timers(store, db, timers)
        count = await db.run(lambda c: c.execute(f"SELECT count(*) FROM {timer_table(CONTEXT)}").fetchone()[0])
        assert count == n, count

        parts = frozenset(range(partitions))
        claim_due = getattr(store, "claim_due", None)
        fired = 0
        t_claim = t_out = t_fired = 0.0
        cpu0 = time.process_time()
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            until = now + 30_000
            if claim_due is not None:
                claimed: list[Timer] = await claim_due(parts, now, batch, owner_key="bench", fence=1, claim_until=until)
            else:  # a tree without claim_due (comparing with an older wowd)
                due = await store.firing.due(parts, now, batch)
                claims = [TimerChange.claim(t, owner_key="bench", fence=1, until=until) for t in due]
                assert await store.firing.settle(claims) == len(due)
                claimed = [c for ch in claims if (c := ch.applied()) is not None]
            t1 = time.perf_counter()
            if not claimed:
                break
            outcome = await gateway.send_batch(claimed)
            t2 = time.perf_counter()
            done = [TimerChange.fired(t, fence=1, next_due=None) for t in claimed if isinstance(outcome, Delivered)]
            assert await store.firing.settle(done) == len(claimed)
            t3 = time.perf_counter()
            fired += len(claimed)
            t_claim += t1 - t0
            t_out += t2 - t1
            t_fired += t3 - t2
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        assert await outbox.count() == n
        await store.close()
        await outbox.close()
        db.close()
    print(f"fired {fired} timers in {elapsed:.3f}s: {fired / elapsed:,.0f} timers/s (cpu {cpu:.3f}s)")
    print(f"  due+claim {t_claim * 1000:.0f} ms, outbox {t_out * 1000:.0f} ms, fired settle {t_fired * 1000:.0f} ms")


# --------------------------------------------------------------------------- daemon level


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _poll(predicate: Any, timeout_s: float, every_s: float) -> None:
    """Polls ``predicate`` (a measurement harness, not a test)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {timeout_s}s")
        time.sleep(every_s)


def daemon_run(n: int, batch: int, partitions: int) -> dict[str, float]:
    """One daemon-level run on a fresh file; answers fired/s and the daemon's CPU seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "wowd.db"
        port_file = Path(tmp) / "wowd.port"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WOWD_")}
        env.update(
            WOWD_CONTEXT=CONTEXT,
            WOWD_PARTITIONS=str(partitions),
            WOWD_EMBEDDED__PATH=str(path),
            WOWD_HTTP__HOST="127.0.0.1",
            WOWD_HTTP__PORT="0",
            WOWD_GATEWAY__KIND="outbox",
            WOWD_TIMERS__BATCH=str(batch),
            WOWD_LOG_LEVEL="WARNING",
        )
        log = (Path(tmp) / "wowd.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "wowd", "run", "--port-file", str(port_file)],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:

            def ready() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"wowd exited {proc.returncode}: {(Path(tmp) / 'wowd.log').read_text()}")
                try:
                    port = int(port_file.read_text().strip())
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz?holding=1", timeout=2) as resp:
                        return bool(resp.status == 200)
                except (OSError, ValueError, urllib.error.URLError):
                    return False

            _poll(ready, 60, 0.05)

            async def put() -> None:
                db = SqliteDatabase(path)
                store = embedded_timers(db, context=CONTEXT, partitions=partitions)
                await put_timers(store, db, make_timers(n, partitions, int(time.time() * 1000) - 1000))
                await store.close()
                db.close()

            cpu0 = _cpu_s(proc.pid)
            anyio.run(put)
            conn = sqlite3.connect(str(path), timeout=30)
            table = timer_table(CONTEXT)
            done_at = [0.0]

            def settled() -> bool:
                if conn.execute("SELECT count(*) FROM outbox").fetchone()[0] < n:
                    return False
                if conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0]:
                    return False
                done_at[0] = time.time()
                return True

            _poll(settled, 120, 0.01)
            first, last = conn.execute("SELECT min(created_at), max(created_at) FROM outbox").fetchone()
            conn.close()
            cpu = _cpu_s(proc.pid) - cpu0
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    settle_s = done_at[0] - first / 1000
    return {
        "fired_per_s": n / settle_s,
        "outbox_per_s": n / max((last - first) / 1000, 1e-3),
        "settled_s": settle_s,
        "cpu_s": cpu,
    }


def daemon_main(n: int, batch: int, partitions: int, runs: int) -> None:
    results = []
    for i in range(runs):
        r = daemon_run(n, batch, partitions)
        results.append(r)
        print(
            f"run {i + 1}: {n} timers fired and settled in {r['settled_s']:.3f}s: {r['fired_per_s']:,.0f} timers/s"
            f" (outbox filled at {r['outbox_per_s']:,.0f}/s; daemon cpu {r['cpu_s']:.2f}s)"
        )
    med = statistics.median(r["fired_per_s"] for r in results)
    print(f"median of {runs}: {med:,.0f} timers/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timers", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=64)
    ap.add_argument("--daemon", action="store_true", help="measure a `wowd run` process instead")
    ap.add_argument("--runs", type=int, default=3, help="daemon runs (the median is reported)")
    a = ap.parse_args()
    if a.daemon:
        daemon_main(a.timers, a.batch, a.partitions, a.runs)
    else:
        anyio.run(main, a.timers, a.batch, a.partitions)
