"""MongoDB commands on the wire per feed batch and per 1,000 fired timers, for one ``wowd run``
replica on the simulator of ``tests/mongosim`` (which counts the commands it runs).

    python -m bench.mongo_wire [--timers 1000] [--shards 0] [--idle-s 10]

The path users take, as ``bench.mongo_fire_lag`` runs it: one replica (``outbox`` gateway, the
event index on the Elasticsearch fake of ``tests/elasticsearch``) on a fresh simulated replica
set (``--shards N``: a ``mongos`` of N shards) in this process. Three phases, each counted apart:

- idle: nothing appended for ``--idle-s``: the replica's background (lease renewals, the idle
  change stream's ``getMore``, the driver's monitoring), as a rate;
- feed: the timers appended (by this process, whose commands are not counted), each due 25 s to
  30 s later, until the timer view holds them all: what projecting them costs;
- fire: from the first due time until every timer has its outbox entry: what firing costs.

The feed and fire counts have the idle rate over their duration taken off (so a small count can
read 0). A feed batch is a change-stream batch that carried events to the replica. The section
is written into ``bench/RESULTS.md`` in place of its previous run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.mongo_fire_lag import CONTEXT, DATABASE, _commits
from bench.wowd_timers import start_daemon, stop_daemon, wait_until

RESULTS = REPO / "bench" / "RESULTS.md"
TITLE = "## MongoDB commands on the wire per feed batch and per 1,000 fired timers (simulator)"
WRITER = "bench-writer"
"""The ``appName`` of this process's client: its appends are the user's, not the replica's."""

Counts = dict[tuple[str, str], float]


def _replica_counts(engine: Any) -> collections.Counter[tuple[str, str]]:
    """The replica's commands so far by (command, collection), the writer's left out."""
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    for (app, name, coll), n in engine.counts().items():
        if app != WRITER:
            out[(name, coll)] += n
    return out


def _batches(engine: Any) -> tuple[int, int]:
    with engine.lock:
        return engine.stream_batches[":batches"], engine.stream_batches[":events"]


def _docs(engine: Any, coll: str) -> int:
    with engine.lock:
        return len(engine.data.get((DATABASE, coll), {})) if (DATABASE, coll) in engine.catalog else 0


def _net(
    after: collections.Counter[tuple[str, str]],
    before: collections.Counter[tuple[str, str]],
    idle_rate: Counts,
    seconds: float,
) -> Counts:
    keys = set(after) | set(idle_rate)
    return {k: max(0.0, after[k] - before[k] - idle_rate.get(k, 0.0) * seconds) for k in keys}


async def _append(uri: str, commits: list[Any]) -> None:
    from wowd.stores.mongo.log import MongoLog

    sep = "&" if "?" in uri else "?"
    log = MongoLog(f"{uri}{sep}appName={WRITER}", DATABASE, context=CONTEXT, partitions=64)
    try:
        await log.append_many(commits)
    finally:
        await log.close()


def run(n: int, shards: int, idle_s: float, seed: int) -> dict[str, Any]:
    """One run; answers the phases' counts (idle as a rate per second)."""
    from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch
    from tests.mongosim import Settings, serving

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="wowd-wire-") as d, serving(Settings(shards=shards)) as sim:
        tmp = Path(d)
        engine = sim.engine
        es = FakeElasticsearch()
        es.model = EsModel()
        es.start()
        extra = {
            "WOWD_BACKEND": "mongo",
            "WOWD_MONGODB__URI": sim.uri,
            "WOWD_MONGODB__DATABASE": DATABASE,
            "WOWD_ELASTICSEARCH__URL": es.url,
        }
        try:
            daemon = start_daemon(tmp, tmp / "wowd.db", "wire", limit=1, ttl_s=10.0, extra_env=extra)
            try:
                wait_until(lambda: daemon.ready() or not daemon.alive(), 60, "the replica ready")
                if not daemon.alive():
                    raise RuntimeError(f"the replica exited: {daemon.log_tail()}")
                time.sleep(2.0)  # the replica's first rounds (DDL, first reads) are not the idle rate
                c0, t0 = _replica_counts(engine), time.monotonic()
                time.sleep(idle_s)
                c1, t1 = _replica_counts(engine), time.monotonic()
                idle_rate = {k: (c1[k] - c0[k]) / (t1 - t0) for k in set(c1) | set(c0)}

                due_ms = int(time.time() * 1000) + 25_000
                commits = _commits(n, due_ms, 5_000, rng)
                b0 = _batches(engine)
                c2, t2 = _replica_counts(engine), time.monotonic()
                asyncio.run(_append(sim.uri, commits))
                timers = f"wow_timer__{CONTEXT}__order"
                wait_until(lambda: _docs(engine, timers) >= n, 25, "the timer view holds every timer", every_s=0.05)
                c3, t3 = _replica_counts(engine), time.monotonic()
                b1 = _batches(engine)
                if time.time() * 1000 >= due_ms:
                    raise RuntimeError("the feed phase ran into the first due time: fewer timers, please")

                wait_until(lambda: time.time() * 1000 >= due_ms, 30, "the first due time", every_s=0.05)
                c4, t4 = _replica_counts(engine), time.monotonic()
                outbox = f"wow_outbox__{CONTEXT}"
                wait_until(lambda: _docs(engine, outbox) >= n, 60, "every timer fired", every_s=0.05)
                c5, t5 = _replica_counts(engine), time.monotonic()
            finally:
                stop_daemon(daemon)
        finally:
            es.stop()
    return {
        "idle_rate": idle_rate,
        "feed": _net(c3, c2, idle_rate, t3 - t2),
        "feed_s": t3 - t2,
        "feed_batches": b1[0] - b0[0],
        "feed_events": b1[1] - b0[1],
        "fire": _net(c5, c4, idle_rate, t5 - t4),
        "fire_s": t5 - t4,
        "n": n,
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _short(coll: str) -> str:
    return coll.replace(f"__{CONTEXT}", "") if coll else "-"


def section(r: dict[str, Any], command: str, loads: tuple[str, str], shards: int) -> str:
    n, batches = r["n"], max(1, r["feed_batches"])
    where = f"a simulated sharded cluster of {shards} shards (`mongos`)" if shards else "a simulated replica set"
    lines = [
        TITLE,
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, `{command}`. Machine: {os.cpu_count()} cores, "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}. Load average before / "
        f"after: {loads[0]} / {loads[1]}.",
        "",
        f"One `wowd run` replica (`outbox` gateway, lease ttl 10 s) on {where}; {n} timers (one commit each) "
        f"appended by another client (not counted), due 25 s to 30 s later ({n / 5:.0f} a second: the fire "
        "figures depend on that rate, fewer timers a second fire in smaller rounds). Feed: from the append "
        f"until the timer view holds them all ({r['feed_s']:.1f} s, {r['feed_batches']} change-stream batches of "
        f"{r['feed_events']} events); fire: from the first due time until every timer has its outbox entry "
        f"({r['fire_s']:.1f} s). Both less the idle rate over their duration (measured first, "
        "nothing appended). Commands by name and target collection (`wow_` names without the context).",
        "",
        "| command | collection | feed, per feed batch | feed, per 1,000 timers fed | fire, per 1,000 fired timers "
        "| idle, per minute |",
        "|---|---|---|---|---|---|",
    ]
    keys = sorted(
        set(r["feed"]) | set(r["fire"]) | set(r["idle_rate"]),
        key=lambda k: (-(r["feed"].get(k, 0) + r["fire"].get(k, 0)), k),
    )
    totals = [0.0, 0.0, 0.0, 0.0]
    for k in keys:
        feed, fire, idle = r["feed"].get(k, 0.0), r["fire"].get(k, 0.0), r["idle_rate"].get(k, 0.0) * 60
        row = [feed / batches, feed * 1000 / n, fire * 1000 / n, idle]
        if all(round(v, 1) == 0 for v in row):
            continue
        totals = [a + b for a, b in zip(totals, row, strict=True)]
        lines.append(f"| {k[0]} | {_short(k[1])} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    lines.append("| **all** | | " + " | ".join(f"**{v:.1f}**" for v in totals) + " |")
    lines += [
        "",
        "`hello`/`isMaster` are the driver's monitoring; a `getMore` on `$cmd.aggregate` is the log's "
        "change stream (a database stream).",
    ]
    return "\n".join(lines) + "\n"


def write_section(text: str, path: Path = RESULTS) -> None:
    old = path.read_text() if path.exists() else ""
    head, *sections = re.split(r"(?m)^(?=## )", old)
    kept = [s.strip("\n") for s in sections if not s.startswith(TITLE)]
    at = next((i for i, s in enumerate(sections) if s.startswith(TITLE)), len(kept))
    kept.insert(at, text.strip("\n"))
    path.write_text("\n\n".join([head.rstrip("\n"), *kept]) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mongo_wire", description=__doc__)
    p.add_argument("--timers", type=int, default=1000)
    p.add_argument("--shards", type=int, default=0, help="a sharded cluster of N shards (0: a replica set)")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args(argv)
    before = _load()
    r = run(args.timers, args.shards, args.idle_s, args.seed)
    shown = f" --shards {args.shards}" if args.shards else ""
    text = section(r, f"python -m bench.mongo_wire --timers {args.timers}{shown}", (before, _load()), args.shards)
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
