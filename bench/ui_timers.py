"""The status page's timer list over a million timers (embedded backend): how long ``/ui/timers``
takes to answer, rendered, for the searches an operator makes.

    python -m bench.ui_timers [--timers 1000000] [--path /tmp/ui-bench.db] [--runs 7]

The file is filled once with ``--timers`` one-shot timers over 64 partitions and 10,000 orders
(PENDING, due over the next 30 days; 1 in 1,000 FAILED and 1 in 1,000 PARKED), written as the
store writes rows, then reused (delete it to fill again). Each search is answered ``--runs`` times
through the page's handler (the listener adds a socket round trip); the table gives the median and
the slowest, in milliseconds.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import time
from pathlib import Path

import anyio

from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.model import AggregateRef, Command, Timer, TimerStatus, deterministic_timer_id, partition
from wowd.stores.base import TimerSearch
from wowd.stores.embedded import open_embedded
from wowd.stores.embedded.schema import timer_table
from wowd.stores.embedded.timer_rows import COLUMNS, timer_params
from wowd.ui import StatusPage
from wowd.ui.http import HttpRequest

CONTEXT = "demo"
PARTITIONS = 64
ORDERS = 10_000
DAY_MS = 86_400_000


def _settings(path: Path) -> WowdSettings:
    return WowdSettings(
        context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=path), lease=LeaseSettings(limit=4)
    )


async def fill(path: Path, n: int) -> None:
    backend = await open_embedded(_settings(path))
    try:
        await backend.timers.prepare()
        now = int(time.time() * 1000)
        rng = random.Random(44)
        table = timer_table(CONTEXT)
        marks = ", ".join("?" for _ in COLUMNS)
        cols = ", ".join(f'"{c}"' for c in COLUMNS)
        sql = f"INSERT INTO {table} ({cols}) VALUES ({marks})"
        conn = sqlite3.connect(path)
        try:
            chunk: list[tuple[object, ...]] = []
            for i in range(n):
                owner = AggregateRef(context=CONTEXT, aggregate="order", id=f"o-{i % ORDERS}")
                key = f"k-{i // ORDERS}"
                due = now + rng.randrange(30 * DAY_MS)
                status = TimerStatus.PENDING
                if i % 1000 == 7:
                    status = TimerStatus.FAILED
                elif i % 1000 == 13:
                    status = TimerStatus.PARKED
                t = Timer(
                    timer_id=deterministic_timer_id(owner, key, 1),
                    partition=partition(owner.id, PARTITIONS),
                    owner=owner,
                    key=key,
                    version=1,
                    due_at=due,
                    scheduled_at=due,
                    target=owner,
                    body=Command(name="expire-order", body={"n": i}).to_json(),
                    status=status,
                    last_error="http 404" if status is not TimerStatus.PENDING else None,
                )
                chunk.append(timer_params(t))
                if len(chunk) == 20_000:
                    conn.executemany(sql, chunk)
                    conn.commit()
                    chunk.clear()
            if chunk:
                conn.executemany(sql, chunk)
                conn.commit()
            conn.execute("ANALYZE")
            conn.commit()
        finally:
            conn.close()
    finally:
        await backend.close()


SEARCHES = [
    ("first page, every status", "/ui/timers"),
    ("PENDING", "/ui/timers?status=PENDING"),
    ("FAILED", "/ui/timers?status=FAILED"),
    ("PARKED of a target", "/ui/timers?status=PARKED&target=order/o-13"),
    ("an owner", "/ui/timers?owner=order/o-4242"),
    ("due in a window", "/ui/timers?due_from={d10}&due_until={d11}"),
    ("page 2 (cursor)", "/ui/timers?after={cursor}"),
    ("JSON, first page", "/api/v1/timers"),
]


async def measure(path: Path, runs: int) -> None:
    backend = await open_embedded(_settings(path))
    try:
        page = StatusPage(_settings(path), backend)
        now = int(time.time() * 1000)
        first = await backend.timer_queries.search(TimerSearch(), 50)
        cursor = f"{first[-1].due_at}:{first[-1].timer_id}"
        print("| search | median ms | slowest ms | rows |\n|---|---:|---:|---:|")
        for name, target in SEARCHES:
            target = target.format(d10=now + 10 * DAY_MS, d11=now + 11 * DAY_MS, cursor=cursor)
            times: list[float] = []
            rows = 0
            for _ in range(runs):
                start = time.perf_counter()
                answer = await page(HttpRequest("GET", target, {}, b""))
                times.append((time.perf_counter() - start) * 1000)
                assert answer.status == 200, answer.body[:300]
                rows = answer.body.count(b"data-timer-id=") or answer.body.count(b'"timer_id"')
            print(f"| {name} | {statistics.median(times):.1f} | {max(times):.1f} | {rows} |")
    finally:
        await backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timers", type=int, default=1_000_000)
    p.add_argument("--path", type=Path, default=Path("/tmp/ui-bench.db"))
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    if not args.path.exists():
        start = time.monotonic()
        anyio.run(fill, args.path, args.timers)
        print(f"filled {args.timers} timers in {time.monotonic() - start:.0f} s")
    anyio.run(measure, args.path, args.runs)


if __name__ == "__main__":
    main()
