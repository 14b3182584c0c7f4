"""Fire lag on an idle MongoDB replica set and an idle sharded cluster (the simulator of
``tests/mongosim``), beside the embedded file, in one run.

    python -m bench.mongo_fire_lag [--timers 60] [--spread-s 30] [--shards 2] [--before REV_CHECKOUT]

One ``wowd run`` replica (``outbox`` gateway, the event index on the Elasticsearch fake of
``tests/elasticsearch``, lease ttl 10 s) on a fresh
simulated replica set (no-op writer every 10 s, as a server's ``periodicNoopIntervalSecs``): the
timers are appended in one go, each due at its own time 15 s to ``15 + spread`` s later, so the
log is idle when they come due (only the replica's lease renewals and the no-op writer move the
oplog). The lag of a timer is its outbox entry's ``created_at`` minus its due time. The same
schedule runs on the embedded file, and, with ``--before DIR`` (a checkout of an earlier wowd),
on the simulator with that code, whose due timers wait for the change stream's watermark.
With ``--shards N`` (2; 0: none) the same schedule runs on a simulated ``mongos`` of N
shards: the log and the outbox are unsharded (on the primary shard), the timers sharded by
partition in one chunk there, so the other shards are idle and the log's merged change stream
waits for their no-op writers. The section is written into ``bench/RESULTS.md`` in place of its
previous run; a row of the previous run this one does not repeat (``--before``) is kept, marked
with its run's date.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import REPO, lag_stats
from bench.wowd_timers import start_daemon, stop_daemon, wait_until
from wowd.model import AggregateRef, Commit, DomainEvent

CONTEXT = "bench"
DATABASE = "bench_fire_lag"
RESULTS = REPO / "bench" / "RESULTS.md"
TITLE = "## Fire lag on an idle MongoDB replica set and sharded cluster (simulator), beside the embedded file"
FORMER_TITLES = ("## Fire lag on an idle MongoDB replica set (simulator), beside the embedded file",)
"""The titles this section had: a run replaces them too."""


def _commits(n: int, start_ms: int, spread_ms: int, rng: random.Random) -> list[Commit]:
    out = []
    for i in range(n):
        due = start_ms + rng.randrange(spread_ms)
        ref = AggregateRef(context=CONTEXT, aggregate="order", id=f"o-{i}")
        event = DomainEvent(
            id=uuid.uuid4().hex,
            name="TimerScheduled",
            body={
                "key": "expire",
                "due_at": due,
                "rule": {"type": "once"},
                "target": {"context": CONTEXT, "aggregate": "order", "id": ref.id},
                "command": {"name": "expire-order", "body": {}},
            },
        )
        out.append(
            Commit(
                ref=ref,
                version=1,
                command_id=uuid.uuid4().hex,
                request_id=uuid.uuid4().hex,
                create_time=int(time.time() * 1000),
                events=(event,),
            )
        )
    return out


def _simulator(tmp: Path, shards: int = 0) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.mongosim", "--port", "0", "--shards", str(shards)],
        stdout=subprocess.PIPE,
        stderr=(tmp / "mongosim.log").open("wb"),
        cwd=str(REPO),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("mongosim listening: "):
        proc.kill()
        raise RuntimeError(f"the simulator did not start: {line!r}")
    return proc, line.split(": ", 1)[1]


async def _append_mongo(uri: str, commits: list[Commit]) -> None:
    from wowd.stores.mongo.log import MongoLog

    log = MongoLog(uri, DATABASE, context=CONTEXT, partitions=64)
    try:
        await log.prepare()
        await log.append_many(commits)
    finally:
        await log.close()


async def _lags_mongo(uri: str) -> list[float]:
    from pymongo import AsyncMongoClient

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
    try:
        docs = await client[DATABASE][f"wow_outbox__{CONTEXT}"].find({}).to_list(None)
    finally:
        await client.close()
    return [float(d["created_at"] - d["scheduled_at"]) for d in docs]


async def _append_embedded(db: Path, commits: list[Commit]) -> None:
    from wowd.stores.embedded.log import EmbeddedLog

    log = EmbeddedLog(db, context=CONTEXT, partitions=64)
    try:
        await log.prepare()
        await log.append_many(commits)
    finally:
        await log.close()


def _lags_embedded(db: Path) -> list[float]:
    import sqlite3

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT created_at - scheduled_at FROM outbox").fetchall()
    return [float(r[0]) for r in rows]


def run_once(kind: str, n: int, spread_s: float, seed: int, code: Path = REPO, *, shards: int = 0) -> dict[str, Any]:
    """One schedule: ``kind`` ``mongo-sim`` (``shards``: a sharded cluster of that many) or
    ``embedded``; ``code``: the checkout that runs."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="wowd-fire-lag-") as d:
        tmp = Path(d)
        db = tmp / "wowd.db"
        sim = es = None
        extra = {"PYTHONPATH": str(code), "WOWD_LOG_LEVEL": "INFO"}
        if kind == "mongo-sim":
            from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch

            sim, uri = _simulator(tmp, shards)
            es = FakeElasticsearch()  # the event index (Elasticsearch 9 as tests/elasticsearch answers)
            es.model = EsModel()
            es.start()
            extra.update(
                {
                    "WOWD_BACKEND": "mongo",
                    "WOWD_MONGODB__URI": uri,
                    "WOWD_MONGODB__DATABASE": DATABASE,
                    "WOWD_ELASTICSEARCH__URL": es.url,
                }
            )
        try:
            daemon = start_daemon(tmp, db, "lag", limit=1, ttl_s=10.0, extra_env=extra)
            try:
                wait_until(lambda: daemon.ready() or not daemon.alive(), 60, "the replica ready")
                if not daemon.alive():
                    raise RuntimeError(f"the replica exited: {daemon.log_tail()}")
                start_ms = int(time.time() * 1000) + 15_000
                commits = _commits(n, start_ms, int(spread_s * 1000), rng)
                if kind == "mongo-sim":
                    asyncio.run(_append_mongo(uri, commits))
                else:
                    asyncio.run(_append_embedded(db, commits))
                last_due = max(int(c.events[0].body["due_at"]) for c in commits)
                lags: list[float] = []

                def done() -> bool:
                    nonlocal lags
                    if time.time() * 1000 < last_due:
                        return False
                    lags = asyncio.run(_lags_mongo(uri)) if kind == "mongo-sim" else _lags_embedded(db)
                    return len(lags) >= n

                wait_until(done, spread_s + 60, "every timer fired", every_s=0.5)
            finally:
                stop_daemon(daemon)
        finally:
            if sim is not None:
                sim.terminate()
                sim.wait(10)
            if es is not None:
                es.stop()
    stats = lag_stats(lags)
    return {"kind": kind, "fired": len(lags), "p50_ms": stats.p50, "p99_ms": stats.p99, "max_ms": stats.max}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def section(rows: list[tuple[str, dict[str, Any]]], command: str, loads: tuple[str, str], n: int, spread: float) -> str:
    lines = [
        TITLE,
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, `{command}`. Machine: {os.cpu_count()} cores, "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}. Load average before / "
        f"after: {loads[0]} / {loads[1]}.",
        "",
        f"One replica, `outbox` gateway, lease ttl 10 s; {n} timers appended in one go, each due 15 s to "
        f"{15 + spread:g} s later, so the log is idle when they come due (the simulator's no-op writer every "
        "10 s and the replica's lease renewals are its only writes). On the sharded cluster the log, the outbox "
        "and the timers (sharded by partition, one chunk) are on the primary shard: the other is idle, and the "
        "log's merged change stream waits for its no-op writer.",
        "",
        "| backend, code | fired | lag p50 ms | lag p99 ms | lag max ms |",
        "|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(f"| {label} | {r['fired']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} |")
    lines += [
        "",
        "The lag counts from the due time to the outbox entry's creation (the replica's clock), so it holds the "
        "log check's round trip (MongoDB) or the firing transaction (embedded), not a delivery over a network.",
    ]
    if any("sharded" in label for label, _ in rows):
        lines += [
            "",
            "On the sharded cluster a due timer fires after its log check (a `find` on the log collection, "
            "answered at once), not after the merged change stream has caught up, so the idle shard's no-op "
            "writer does not add to the lag; it delays the feed (a commit reaches the views up to 10 s late).",
        ]
    return "\n".join(lines) + "\n"


def _ours(section_text: str) -> bool:
    return section_text.startswith((TITLE, *FORMER_TITLES))


def carried_rows(text: str, path: Path = RESULTS) -> str:
    """``text`` with the table rows of the previous run's section that it does not repeat (by
    label), each marked with that run's date."""
    old = path.read_text() if path.exists() else ""
    previous = next((s for s in re.split(r"(?m)^(?=## )", old) if _ours(s)), "")
    run = re.search(r"Run (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", previous)
    labels = {line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")}
    extra = [
        line.replace(" |", f" (run {run.group(1) if run else 'before'}) |", 1)
        for line in previous.splitlines()
        if line.startswith("| ")
        and not line.startswith(("| backend", "|---"))
        and line.split(" | ")[0] not in labels
        and "(run " not in line.split(" | ")[0]
    ]
    if not extra:
        return text
    lines = text.splitlines()
    last_row = max(i for i, line in enumerate(lines) if line.startswith("| "))
    return "\n".join(lines[: last_row + 1] + extra + lines[last_row + 1 :]) + "\n"


def write_section(text: str, path: Path = RESULTS) -> None:
    old = path.read_text() if path.exists() else ""
    head, *sections = re.split(r"(?m)^(?=## )", old)
    kept = [s.strip("\n") for s in sections if not _ours(s)]
    at = next((i for i, s in enumerate(sections) if _ours(s)), len(kept))
    kept.insert(at, text.strip("\n"))
    path.write_text("\n\n".join([head.rstrip("\n"), *kept]) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mongo_fire_lag", description=__doc__)
    p.add_argument("--timers", type=int, default=60)
    p.add_argument("--spread-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shards", type=int, default=2, help="the sharded cluster's shards (0: no sharded run)")
    p.add_argument("--before", type=Path, help="a checkout of an earlier wowd, run on the simulator too")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args(argv)
    before_load = _load()
    rows = [
        ("MongoDB (simulated replica set), this code", run_once("mongo-sim", args.timers, args.spread_s, args.seed)),
    ]
    if args.shards > 0:
        label = f"MongoDB (simulated sharded cluster, {args.shards} shards), this code"
        rows.append((label, run_once("mongo-sim", args.timers, args.spread_s, args.seed, shards=args.shards)))
    rows.append(("embedded file, this code", run_once("embedded", args.timers, args.spread_s, args.seed)))
    if args.before is not None:
        r = run_once("mongo-sim", args.timers, args.spread_s, args.seed, code=args.before.resolve())
        rev = subprocess.run(
            ["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        rows.append((f"MongoDB (simulated replica set), the code of {rev or args.before} (waits for the watermark)", r))
    shown = ["--shards", str(args.shards)] + (["--before", "CHECKOUT"] if args.before is not None else [])
    command = "python -m bench.mongo_fire_lag " + " ".join(shown)
    text = carried_rows(section(rows, command.strip(), (before_load, _load()), args.timers, args.spread_s))
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
