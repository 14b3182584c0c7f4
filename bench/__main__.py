"""``python -m bench [--quick] [--only SECTION ...] [--out FILE]``: runs the benchmarks and writes
``bench/RESULTS.md`` (``make bench``).

Each section runs its measurements (every measured system in its own process) and renders a
Markdown table; the full run takes medians of ``runs`` runs. ``--quick`` runs small sizes once.

The report holds the latest run of each section, with that run's date, command, commit and
machine. ``bench/results.json`` (``--json``) keeps those runs: ``--only SECTION ...`` re-runs some
sections, puts them in place of their earlier run there, and writes the report again from every
section's latest run. ``--render`` runs nothing and writes the report from that file (a
section's ``remark``, a note on its run, can be edited there). Sections of the report that this
module does not write (the chaos soak's) are kept as they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import WorkerError, fmt, fmt_ms, machine, median, median_of, run_worker, table
from bench.e2e import E2E_QUICK, E2eConfig

log = logging.getLogger("bench")

HERE = Path(__file__).resolve().parent
APS4_PYTHON = os.environ.get("WOWD_BENCH_APS4_PYTHON", "/tmp/aps4venv/bin/python")


@dataclass(frozen=True, kw_only=True)
class Config:
    burst_sizes: tuple[int, ...] = (10_000, 100_000)
    burst_lead_ms: int = 300
    """A ``wowd run`` burst's timers come due this long (and 1 ms per 40 timers) after their insert
    began."""
    runs: int = 3
    aps3_max_runs_large: int = 1
    """APScheduler 3 at the largest size: runs (it takes minutes each)."""
    aps3_default_n: int = 10_000
    aps4_n: int = 300
    steady_rates: tuple[int, ...] = (100, 1000, 5000)
    steady_seconds: float = 20.0
    growth_sizes: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    growth_types: tuple[int, ...] = (1, 10, 100)
    sink_n: int = 50_000
    sink_batches: tuple[int, ...] = (100, 1000, 5000)
    sink_refresh_interval_s: float | None = None
    """The sink's refresh interval in the refresh rows; ``None``: its default."""
    failover_ttls: tuple[float, ...] = (5.0, 15.0)
    http_n: int = 20_000
    http_concurrency: tuple[int, ...] = (1, 8, 64)
    http_steady_rate: int = 1000
    http_steady_delay_ms: int = 1000
    """A steady HTTP timer is due this long after its append."""
    timeout_s: float = 900.0
    e2e: E2eConfig = field(default_factory=E2eConfig)


QUICK = Config(
    burst_sizes=(2_000,),
    runs=1,
    aps3_default_n=1_000,
    aps4_n=50,
    steady_rates=(100, 500),
    steady_seconds=3.0,
    growth_sizes=(1_000, 10_000),
    growth_types=(1, 10),
    sink_n=2_000,
    sink_batches=(100, 1000),
    failover_ttls=(3.0,),
    http_n=2_000,
    e2e=E2E_QUICK,
)


@dataclass(kw_only=True)
class Section:
    """One section's latest run: what the report shows of it, its raw numbers and how it was run."""

    key: str
    title: str
    body: str
    data: Any = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    when: str = ""
    """When the section ran, ``YYYY-MM-DD HH:MM-HH:MM UTC``."""
    command: str = ""
    commit: str = ""
    """The checkout's commit (``+`` when wowd or bench had uncommitted changes)."""
    machine: str = ""
    remark: str = ""
    """A note on this run (the machine's state, what the code was), written by hand."""
    targets: list[list[str]] = field(default_factory=list)
    """The targets against this run: rows of target, measured, met."""


TITLES = {
    "timers": "Timers: a burst due at once, wowd against APScheduler",
    "steady": "Fire lag at steady load",
    "growth": "Growth: due-read cost as the work grows",
    "sink": "Sink: ElasticsearchEventSink.write against async_bulk",
    "failover": "Failover: SIGKILL of the holder to the first fire by the standby",
    "http": "HTTP delivery: wowd run's http gateway against a bare aiohttp loop",
    "e2e": "End to end through the log: commits appended, fed and fired, against the firing path alone",
}
"""Each section's title (the steady section's is followed by its rate and duration)."""


def _repeat(fn: Callable[[], dict[str, Any]], runs: int) -> dict[str, Any]:
    return median_of([fn() for _ in range(max(1, runs))])


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"


# --------------------------------------------------------------------------- timers (burst)


def section_timers(cfg: Config) -> Section:
    from bench.wowd_timers import wowd_burst

    results: dict[int, dict[str, dict[str, Any]]] = {}
    notes: list[str] = []
    largest = max(cfg.burst_sizes)
    for n in cfg.burst_sizes:
        r: dict[str, dict[str, Any]] = {}
        r["bare loop (ceiling)"] = _repeat(partial(run_worker, "ceiling", {"n": n}), cfg.runs)
        r["wowd store path (in-process)"] = _repeat(partial(run_worker, "store_path", {"n": n}), cfg.runs)
        r["wowd run, 1 process"] = _repeat(partial(wowd_burst, n, 1, lead_ms=cfg.burst_lead_ms), cfg.runs)
        r["wowd run, 2 processes (limit=2)"] = _repeat(partial(wowd_burst, n, 2, lead_ms=cfg.burst_lead_ms), cfg.runs)
        aps_runs = cfg.aps3_max_runs_large if n == largest and n >= 100_000 else cfg.runs
        r["APScheduler 3 (SQLite WAL)"] = _repeat(
            partial(run_worker, "aps3_burst", {"n": n, "wal": True}, timeout=cfg.timeout_s), aps_runs
        )
        results[n] = r
    # APScheduler 3 out of the box (rollback journal, fsync per job) and APScheduler 4: one size each
    n3 = cfg.aps3_default_n
    default = _repeat(lambda: run_worker("aps3_burst", {"n": n3, "wal": False}, timeout=cfg.timeout_s), cfg.runs)
    results.setdefault(n3, {})["APScheduler 3 (SQLite default)"] = default
    notes.append(
        f"APScheduler 3 at N={fmt(largest)}: {cfg.aps3_max_runs_large} run (about a minute each); "
        f"APScheduler 4 at N={fmt(cfg.aps4_n)} only (at ~100/s a burst of 10,000 takes minutes), run under "
        f"`{APS4_PYTHON}` (APScheduler 4.0.0a6 cannot share the virtualenv with APScheduler 3)."
    )
    if Path(APS4_PYTHON).exists():
        try:
            aps4 = _repeat(
                lambda: run_worker(
                    "aps4",
                    {"n": cfg.aps4_n},
                    python=APS4_PYTHON,
                    script=HERE / "peer_aps4.py",
                    timeout=cfg.timeout_s,
                ),
                cfg.runs,
            )
            results.setdefault(cfg.aps4_n, {})["APScheduler 4.0.0a6 (SQLite)"] = aps4
        except WorkerError as exc:
            notes.append(f"APScheduler 4 failed: {_err(exc)}")
    else:
        notes.append(f"APScheduler 4 left out: no interpreter at {APS4_PYTHON} (set WOWD_BENCH_APS4_PYTHON)")

    rows = []
    for n in sorted(results):
        for name, x in results[n].items():
            rows.append(
                [
                    name,
                    fmt(n),
                    fmt(x.get("fired_per_s")),
                    fmt(x.get("drain_per_s")),
                    fmt_ms(x.get("p50_ms")),
                    fmt_ms(x.get("p99_ms")),
                    fmt_ms(x.get("max_ms")),
                    fmt(x.get("peak_rss_mb")),
                    fmt(x.get("cpu_s"), 2),
                    fmt(x.get("runs")),
                ]
            )
    body = table(
        [
            "system",
            "N",
            "fired/s",
            "drain/s",
            "lag p50 ms",
            "lag p99 ms",
            "lag max ms",
            "peak RSS MB",
            "CPU s",
            "runs",
        ],
        rows,
    )
    ratio_rows = []
    for n in sorted(results):
        r = results[n]
        w1 = r.get("wowd run, 1 process")
        if not w1:
            continue
        for peer, x in r.items():
            if peer == "wowd run, 1 process":
                continue
            ratio_rows.append(
                [
                    fmt(n),
                    f"wowd 1 process / {peer}",
                    fmt(w1["fired_per_s"] / x["fired_per_s"], 2) if x.get("fired_per_s") else "-",
                    fmt(x["p99_ms"] / w1["p99_ms"], 2) if w1.get("p99_ms") else "-",
                    fmt(w1["cpu_s"] / x["cpu_s"], 2) if x.get("cpu_s") else "-",
                ]
            )
    # peers measured at another size: compare with wowd at the nearest size
    for n in sorted(results):
        if "wowd run, 1 process" in results[n]:
            continue
        near = min(
            (m for m in results if "wowd run, 1 process" in results[m]),
            key=lambda m: abs(m - n),
            default=None,
        )
        if near is None:
            continue
        w1 = results[near]["wowd run, 1 process"]
        for peer, x in results[n].items():
            ratio_rows.append(
                [
                    f"{fmt(near)} vs {fmt(n)}",
                    f"wowd 1 process / {peer}",
                    fmt(w1["fired_per_s"] / x["fired_per_s"], 2) if x.get("fired_per_s") else "-",
                    fmt(x["p99_ms"] / w1["p99_ms"], 2) if w1.get("p99_ms") else "-",
                    fmt(w1["cpu_s"] / x["cpu_s"], 2) if x.get("cpu_s") else "-",
                ]
            )
    body += "\n\nRatios (fired/s: higher is better for wowd; p99 lag: peer / wowd; CPU: wowd / peer):\n\n"
    body += table(["N", "ratio", "fired/s", "p99 lag (peer/wowd)", "CPU s (wowd/peer)"], ratio_rows)
    return Section(
        key="timers",
        title=TITLES["timers"],
        body=body,
        data={str(k): v for k, v in results.items()},
        notes=notes,
    )


# --------------------------------------------------------------------------- steady load


def section_steady(cfg: Config) -> Section:
    from bench.wowd_timers import wowd_steady

    rows = []
    data: dict[str, list[dict[str, Any]]] = {"wowd": [], "aps3": []}
    for rate in cfg.steady_rates:
        w = wowd_steady(rate, cfg.steady_seconds)
        a = run_worker("aps3_steady", {"rate": rate, "seconds": cfg.steady_seconds, "wal": True}, timeout=cfg.timeout_s)
        data["wowd"].append(w)
        data["aps3"].append(a)
        for name, x in (("wowd run, 1 process", w), ("APScheduler 3 (SQLite WAL)", a)):
            rows.append(
                [
                    name,
                    fmt(rate),
                    fmt(x["offered_per_s"]),
                    f"{fmt(x['fired'])} / {fmt(x['added'])}",
                    fmt_ms(x["p50_ms"]),
                    fmt_ms(x["p99_ms"]),
                    fmt_ms(x["max_ms"]),
                    fmt(x["cpu_s"], 2),
                ]
            )
    body = table(
        [
            "system",
            "rate /s",
            "achieved /s",
            "fired / added",
            "lag p50 ms",
            "lag p99 ms",
            "lag max ms",
            "CPU s",
        ],
        rows,
    )

    def best(items: Sequence[dict[str, Any]]) -> str:
        ok = [x["rate"] for x in items if x["p99_ms"] < 100 and x["fired"] == x["added"] and x["added"] > 0]
        return fmt(max(ok)) if ok else "none of those tested"

    body += (
        f"\n\nHighest tested rate sustained with p99 < 100 ms: wowd {best(data['wowd'])}/s, "
        f"APScheduler 3 {best(data['aps3'])}/s."
    )
    notes = [
        f"{fmt(cfg.steady_seconds)} s per rate instead of 60 s, to keep `make bench` near "
        "12 minutes on 2 vCPU; one run per rate.",
        "wowd: this process appends the commits (`wowd.demo.demo_commits`, one TimerScheduled each) to the "
        "embedded log; the replica feeds and fires them. APScheduler: `add_job` in the scheduler's own "
        "process (its only way to add work); 'achieved' is the rate its loop managed to add.",
    ]
    return Section(
        notes=notes,
        key="steady",
        title=f"{TITLES['steady']} ({fmt(cfg.steady_seconds)} s per rate, timers due now + 1 s)",
        body=body,
        data=data,
    )


# --------------------------------------------------------------------------- growth


def section_growth(cfg: Config) -> Section:
    emb = run_worker("growth_embedded", {"sizes": list(cfg.growth_sizes)}, timeout=cfg.timeout_s)
    wire = run_worker("growth_mongo", {"types": list(cfg.growth_types)}, timeout=cfg.timeout_s)
    rows = [[fmt(s), fmt_ms(t)] for s, t in zip(emb["stored"], emb["due_read_ms"], strict=True)]
    body = "Embedded: `EmbeddedTimerFiring.due` (64 partitions, 100 due, limit 1000), median of 50 reads:\n\n"
    body += table(["timers stored", "due read ms"], rows)
    body += (
        f"\n\nSlowest / fastest read: {fmt(emb['growth_ratio'], 2)}x; largest size / smallest size: "
        f"{fmt(emb['last_over_first'], 2)}x (target: within 2x).\n\n"
    )
    body += "MongoDB on the wire (MockupDB black-pipe), one batch of 1,000 due timers of one type:\n\n"
    body += table(
        [
            "aggregate types",
            "commands per due read",
            "pipeline stages",
            "due command bytes",
            "claim settle",
            "fired settle",
            "commands per batch",
        ],
        [
            [
                fmt(r["types"]),
                fmt(r["due_commands"]),
                fmt(r["pipeline_stages"]),
                fmt(r["due_command_bytes"]),
                fmt(r["claim_commands"]),
                fmt(r["fired_commands"]),
                fmt(r["batch_commands"]),
            ]
            for r in wire["rows"]
        ],
    )
    return Section(
        key="growth",
        title=TITLES["growth"],
        body=body,
        data={"embedded": emb, "mongo": wire},
    )


# --------------------------------------------------------------------------- sink


def section_sink(cfg: Config) -> Section:
    params: dict[str, Any] = {"n": cfg.sink_n, "batches": list(cfg.sink_batches), "runs": cfg.runs}
    if cfg.sink_refresh_interval_s is not None:
        params["refresh_interval_s"] = cfg.sink_refresh_interval_s
    res = run_worker("sink", params, timeout=cfg.timeout_s)
    rows = []
    by_batch: dict[int, dict[str, dict[str, Any]]] = {}
    for r in res["rows"]:
        by_batch.setdefault(r["batch"], {})[r["variant"]] = r
    for batch, variants in sorted(by_batch.items()):
        sink = variants["wowd sink"]
        for name, r in variants.items():
            ratio = sink["commits_per_s"] / r["commits_per_s"] if name != "wowd sink" else 1.0
            rows.append(
                [
                    fmt(batch),
                    name,
                    fmt(r["commits_per_s"]),
                    fmt(r["bytes_per_s"] / 1e6, 1),
                    fmt(r["cpu_s"], 2),
                    fmt(ratio, 2),
                ]
            )
    body = f"{fmt(cfg.sink_n)} commits (version 1 of distinct aggregates), medians of {res['runs']} runs:\n\n"
    body += table(["batch", "writer", "commits/s", "MB/s", "CPU s", "wowd / this"], rows)
    refresh_rows = [
        [
            "changed in every batch" if r["changes"] else "unchanged",
            fmt(r["batch"]),
            fmt(r["commits"]),
            fmt(r["refreshes_per_1000"], 1),
            fmt(r["update_by_query_per_1000"], 1),
            fmt(r["commits"] / r["seconds"]),
        ]
        for r in res.get("refresh_rows", [])
    ]
    if refresh_rows:
        body += (
            "\n\nRefreshes: four writers at once into one index (later versions of their own aggregates), "
            "requests per 1,000 commits"
            + (
                f" (a refresh at most every {cfg.sink_refresh_interval_s:g} s)"
                if cfg.sink_refresh_interval_s is not None
                else ""
            )
            + ":\n\n"
        )
        body += table(
            ["access attributes", "batch", "commits", "_refresh", "_update_by_query", "commits/s"], refresh_rows
        )
    return Section(key="sink", title=TITLES["sink"], body=body, data=res)


# --------------------------------------------------------------------------- failover


def section_failover(cfg: Config) -> Section:
    from bench.failover import failover_once

    rows = []
    data = []
    for ttl in cfg.failover_ttls:
        runs = [failover_once(ttl) for _ in range(max(1, cfg.runs))]
        times = [r["failover_ms"] for r in runs]
        bound = runs[0]["bound_ms"]
        data.append({"ttl_s": ttl, "failover_ms": times, "bound_ms": bound})
        rows.append(
            [
                fmt(ttl, 0),
                fmt(median(times)),
                ", ".join(fmt(t) for t in times),
                fmt(bound),
                "yes" if max(times) <= bound else "NO",
            ]
        )
    body = table(["ttl s", "median ms", "runs ms", "bound ttl + ttl/3 + poll ms", "all within"], rows)
    return Section(
        key="failover",
        title=TITLES["failover"],
        body=body,
        data=data,
    )


# --------------------------------------------------------------------------- http delivery

HTTP_DEFAULT_PER_TARGET = 16
"""``WOWD_GATEWAY__PER_TARGET_CONCURRENCY``'s default (the bench's timers all go to one target)."""


def section_http(cfg: Config) -> Section:
    import tempfile

    from bench.http_delivery import http_bare, http_bare_steady, http_burst, http_steady, target_server
    from bench.wowd_timers import wowd_burst

    n = cfg.http_n
    top = max(cfg.http_concurrency)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as t, target_server(Path(t)) as target:
        signed_runs: list[dict[str, Any]] = []
        for c in cfg.http_concurrency:
            bare = _repeat(partial(http_bare, target, n, c), cfg.runs)
            if c == top:  # signed and unsigned runs taken in turn: the machine's drift hits both alike
                plain_runs = []
                for _ in range(max(1, cfg.runs)):
                    plain_runs.append(http_burst(target, n, c, lead_ms=cfg.burst_lead_ms))
                    signed_runs.append(http_burst(target, n, c, signed=True, lead_ms=cfg.burst_lead_ms))
                wowd = median_of(plain_runs)
            else:
                wowd = _repeat(partial(http_burst, target, n, c, lead_ms=cfg.burst_lead_ms), cfg.runs)
            rows.append({**bare, "system": "bare aiohttp loop", "concurrency": c, "per_target": "-"})
            rows.append({**wowd, "system": "wowd run, http gateway", "concurrency": c, "per_target": c})
        if HTTP_DEFAULT_PER_TARGET < top:
            x = _repeat(
                partial(http_burst, target, n, top, per_target=HTTP_DEFAULT_PER_TARGET, lead_ms=cfg.burst_lead_ms),
                cfg.runs,
            )
            rows.append(
                {**x, "system": "wowd run, http gateway", "concurrency": top, "per_target": HTTP_DEFAULT_PER_TARGET}
            )
        signed = median_of(signed_runs)
        rows.append({**signed, "system": "wowd run, http gateway, signed", "concurrency": top, "per_target": top})
        steady = http_steady(target, cfg.http_steady_rate, cfg.steady_seconds, top, delay_ms=cfg.http_steady_delay_ms)
        bare_steady = http_bare_steady(target, cfg.http_steady_rate, cfg.steady_seconds, top)
    outbox = _repeat(partial(wowd_burst, n, 1, lead_ms=cfg.burst_lead_ms), cfg.runs)
    rows.append({**outbox, "system": "wowd run, outbox gateway (reference)", "concurrency": "-", "per_target": "-"})
    body = f"{fmt(n)} commands due at once, one target (`billing.invoice`), medians of {cfg.runs} run(s):\n\n"
    body += table(
        [
            "system",
            "concurrency",
            "per target",
            "fired/s",
            "lag p50 ms",
            "lag p99 ms",
            "lag max ms",
            "CPU s",
            "target CPU s",
        ],
        [
            [
                r["system"],
                fmt(r["concurrency"]),
                fmt(r.get("per_target")),
                fmt(r["fired_per_s"]),
                fmt_ms(r["p50_ms"]),
                fmt_ms(r["p99_ms"]),
                fmt_ms(r["max_ms"]),
                fmt(r["cpu_s"], 2),
                fmt(r.get("target_cpu_s"), 2),
            ]
            for r in rows
        ],
    )
    ratios = []
    for c in cfg.http_concurrency:
        b = next(r for r in rows if r["system"] == "bare aiohttp loop" and r["concurrency"] == c)
        w = next(r for r in rows if r["system"] == "wowd run, http gateway" and r["per_target"] == c)
        ratios.append(
            [fmt(c), fmt(w["fired_per_s"] / b["fired_per_s"], 2), fmt(w["cpu_s"] / n * 1e6), fmt(b["cpu_s"] / n * 1e6)]
        )
    body += "\n\nwowd / bare loop, same concurrency, same run:\n\n"
    body += table(["concurrency", "fired/s ratio", "wowd CPU µs per command", "bare CPU µs per command"], ratios)
    plain = next(
        r
        for r in rows
        if r["system"] == "wowd run, http gateway" and r["concurrency"] == top and r["per_target"] == top
    )
    body += (
        f"\n\nSigned requests (Standard Webhooks, one secret) at concurrency {top}, runs taken in turn with the "
        f"unsigned ones: "
        f"{fmt(signed['fired_per_s'])}/s, {fmt(signed['fired_per_s'] / plain['fired_per_s'], 2)}x the unsigned row "
        f"({fmt(signed['cpu_s'] / n * 1e6)} against {fmt(plain['cpu_s'] / n * 1e6)} CPU µs per command)."
    )
    body += (
        f"\n\nSteady {fmt(steady['rate'])}/s over HTTP for {fmt(cfg.steady_seconds)} s (concurrency {top}, "
        f"due {cfg.http_steady_delay_ms / 1000:g} s after the append): fired {fmt(steady['fired'])} / "
        f"{fmt(steady['added'])}, lag p50 "
        f"{fmt_ms(steady['p50_ms'])} ms, p99 {fmt_ms(steady['p99_ms'])} ms, max {fmt_ms(steady['max_ms'])} ms, "
        f"CPU {fmt(steady['cpu_s'], 2)} s. The bare steady loop at the same rate, right after it: fired "
        f"{fmt(bare_steady['fired'])} / {fmt(bare_steady['added'])}, lag p50 {fmt_ms(bare_steady['p50_ms'])} ms, "
        f"p99 {fmt_ms(bare_steady['p99_ms'])} ms, max {fmt_ms(bare_steady['max_ms'])} ms, "
        f"CPU {fmt(bare_steady['cpu_s'], 2)} s."
    )
    notes = [
        "The target: `python -m bench.http_delivery serve`, a raw asyncio protocol on uvloop (keep-alive "
        "HTTP/1.1, 200 `{}`), its own process; lag = arrival at the target - due time.",
        "Bare loop: `concurrency` tasks on one aiohttp session (connector limit = concurrency), its own process "
        "(uvloop), the same paths, headers and body; its lag counts from its start. Bare steady loop: one "
        "process (uvloop) POSTing each command at its due time on one aiohttp session, no log and no producer.",
        f"wowd rows set `WOWD_GATEWAY__PER_TARGET_CONCURRENCY` to the concurrency (like for like); the row with "
        f"per target {HTTP_DEFAULT_PER_TARGET} is the default, which caps one target's requests in flight.",
    ]
    return Section(
        key="http",
        title=TITLES["http"],
        body=body,
        data={"rows": rows, "steady": steady, "bare_steady": bare_steady, "n": n},
        notes=notes,
    )


# --------------------------------------------------------------------------- end to end through the log


def _runs_of(runs: Sequence[dict[str, Any]], name: str) -> str:
    """Each run's value of ``name``."""
    return ", ".join(fmt_ms(float(r[name])) for r in runs)


def section_e2e(cfg: Config) -> Section:
    """The user's path (commits appended to the log, ``wowd run`` feeds and fires them) against
    the firing path alone (timers inserted directly) and the bare loop, interleaved run by run."""
    from bench import e2e
    from bench.wowd_timers import wowd_burst

    c = cfg.e2e
    raw: dict[str, list[dict[str, Any]]] = {}

    def measure(key: str, fn: Callable[[], dict[str, Any]]) -> None:
        result = fn()
        raw.setdefault(key, []).append(result)
        log.info("bench: e2e %s run %d: %s", key, len(raw[key]), json.dumps(result))

    for _ in range(max(1, cfg.runs)):
        measure("catch_up", lambda: e2e.catch_up(c.catch_up_commits, timeout_s=cfg.timeout_s))
        measure(
            "catch_up_orders",
            lambda: e2e.catch_up(c.catch_up_commits, orders=c.catch_up_orders, timeout_s=cfg.timeout_s),
        )
        measure(
            "scheduled",
            lambda: e2e.scheduled(
                c.scheduled_timers, c.scheduled_commits, due_in_ms=c.scheduled_due_in_ms, timeout_s=cfg.timeout_s
            ),
        )
        for n in c.firing_sizes:
            measure(f"alone {n}", partial(wowd_burst, n, 1, timeout_s=cfg.timeout_s, lead_ms=cfg.burst_lead_ms))
            measure(f"bare {n}", partial(run_worker, "ceiling", {"n": n}, timeout=cfg.timeout_s))
        for rate in c.steady_rates:
            measure(f"log steady {rate}", partial(e2e.log_steady, rate, c.steady_seconds, delay_ms=c.steady_delay_ms))
            measure(
                f"alone steady {rate}", partial(e2e.direct_steady, rate, c.steady_seconds, delay_ms=c.steady_delay_ms)
            )
    med = {k: median_of(v) for k, v in raw.items()}
    loads = [x[k] for runs in raw.values() for x in runs for k in ("load_before", "load_after") if k in x]

    cu, sc = med["catch_up"], med["scheduled"]
    burst_rows = [
        [
            "through the log: catch-up (`wowd demo`, then `wowd run`)",
            f"{fmt(x['commits'])} commits, 1 timer each, over {fmt(x['orders'])} orders",
            f"{fmt(x['commits_per_s'])} commits/s start to settled ({_runs_of(raw[key], 'commits_per_s')})",
            f"feed {fmt(x['feed_commits_per_s_after_up'])} commits/s once up; up {fmt(x['up_s'], 1)} s, "
            f"fed {fmt(x['feed_s'], 1)} s, settled {fmt(x['total_s'], 1)} s; fired {fmt(x['fired'])} of "
            f"{fmt(x['expected'])}",
            "-",
            "-",
            fmt(x["cpu_s"], 2),
            fmt(x["peak_rss_mb"]),
        ]
        for key, x in (("catch_up", cu), ("catch_up_orders", med["catch_up_orders"]))
    ]
    burst_rows += [
        [
            f"through the log: scheduled {fmt(c.scheduled_due_in_ms / 1000, 0)} s ahead",
            f"{fmt(sc['timers'])} timers in {fmt(sc['commits'])} commits",
            f"{fmt(sc['fired_per_s'])} timers/s from the due time ({_runs_of(raw['scheduled'], 'fired_per_s')})",
            f"append {fmt(sc['append_s'], 1)} s; feed at the head {fmt(sc['feed_done_after_append_s'], 1)} s after "
            f"the append began, {fmt(sc['feed_margin_s'], 1)} s before the due time (fed before due in "
            f"{sum(1 for x in raw['scheduled'] if x['fed_before_due'])} of {len(raw['scheduled'])} runs); "
            f"fired {fmt(sc['fired'])} of {fmt(sc['expected'])}",
            fmt_ms(sc["p50_ms"]),
            fmt_ms(sc["p99_ms"]),
            fmt(sc["cpu_s"], 2),
            fmt(sc["peak_rss_mb"]),
        ],
    ]
    for n in c.firing_sizes:
        a, b = med[f"alone {n}"], med[f"bare {n}"]
        burst_rows += [
            [
                "firing path alone (timers inserted directly, `wowd run`)",
                f"{fmt(n)} timers",
                f"{fmt(a['fired_per_s'])} timers/s from the due time ({_runs_of(raw[f'alone {n}'], 'fired_per_s')})",
                "-",
                fmt_ms(a["p50_ms"]),
                fmt_ms(a["p99_ms"]),
                fmt(a["cpu_s"], 2),
                fmt(a["peak_rss_mb"]),
            ],
            [
                "bare loop (`bench/ceiling.py`, same statements, no daemon)",
                f"{fmt(n)} timers",
                f"{fmt(b['fired_per_s'])} timers/s ({_runs_of(raw[f'bare {n}'], 'fired_per_s')})",
                "-",
                fmt_ms(b["p50_ms"]),
                fmt_ms(b["p99_ms"]),
                fmt(b["cpu_s"], 2),
                fmt(b["peak_rss_mb"]),
            ],
        ]
    body = "Bursts (medians of the runs; each run's value in brackets):\n\n" + table(
        ["path", "work", "rate", "details", "lag p50 ms", "lag p99 ms", "replica CPU s", "peak RSS MB"],
        burst_rows,
    )
    steady_rows = []
    for rate in c.steady_rates:
        for name, key in (("through the log", f"log steady {rate}"), ("firing path alone", f"alone steady {rate}")):
            x = med[key]
            steady_rows.append(
                [
                    name,
                    fmt(rate),
                    fmt(x["offered_per_s"]),
                    f"{fmt(x['fired'])} / {fmt(x['added'])}",
                    fmt_ms(x["p50_ms"]),
                    fmt_ms(x["p99_ms"]),
                    _runs_of(raw[key], "p99_ms"),
                    fmt_ms(x["max_ms"]),
                    fmt(x["cpu_s"], 2),
                    fmt(x["peak_rss_mb"]),
                ]
            )
    body += (
        f"\n\nSteady load, {fmt(c.steady_seconds)} s per rate, every timer due {fmt(c.steady_delay_ms)} ms after "
        "its append (through the log) or its insert (firing path alone):\n\n"
    )
    body += table(
        [
            "path",
            "rate /s",
            "achieved /s",
            "fired / added",
            "lag p50 ms",
            "lag p99 ms",
            "p99 of each run",
            "lag max ms",
            "replica CPU s",
            "peak RSS MB",
        ],
        steady_rows,
    )
    body += "\n\n" + table(["target", "measured", "met"], e2e_target_rows(med, c))
    load = f"{fmt(min(loads), 2)} to {fmt(max(loads), 2)}" if loads else "not read"
    notes = [
        f"Machine load (1-minute load average, read before and after each measurement): {load} on "
        f"{os.cpu_count()} vCPUs, shared with other engineers' test runs.",
        "Catch-up: the rate counts from the `wowd run` process start (interpreter start-up, lease, checkpoints "
        "included) to every timer delivered into the outbox and settled (no PENDING or FIRING timer left); the "
        "feed rate counts from the moment its HTTP port is bound to every partition's checkpoint at its head. "
        "Over as many orders as commits, each order has one commit, so its timer is fired by the feed batch "
        "that applies it (the outbox gateway on the embedded file); over fewer orders an order's timers wait for "
        "the batch with its last commit (a later one could cancel them), and every fifth order's second commit "
        "cancels a timer: those are expected not to fire.",
        "Scheduled: the append is this process's `Log.append_many` of the demo's commits (`wowd.demo.demo_commits`, "
        "500 commits per call) with one due time for every timer; the replica was already running. The fire rate "
        "counts from that due time to the last outbox row.",
        "The replica's CPU seconds: catch-up, its whole life; the others, over the measured window. Peak RSS: "
        "its `VmHWM`.",
    ]
    return Section(
        key="e2e",
        title=TITLES["e2e"],
        body=body,
        data={"config": asdict(c), "medians": med, "runs": raw},
        notes=notes,
        targets=e2e_target_rows(med, c),
    )


def e2e_target_rows(med: dict[str, dict[str, Any]], c: E2eConfig) -> list[list[str]]:
    """The end-to-end targets against the medians of :func:`section_e2e`."""
    rows: list[list[str]] = []

    def add(target: str, measured: str, met: bool) -> None:
        rows.append([target, measured, "yes" if met else "no"])

    cu, sc = med["catch_up"], med["scheduled"]
    add(
        f"catch-up >= 10,000 commits/s ({fmt(cu['commits'])} commits)",
        f"{fmt(cu['commits_per_s'])} (feed alone {fmt(cu['feed_commits_per_s_after_up'])})",
        cu["commits_per_s"] >= 10_000,
    )
    add(
        f"{fmt(sc['timers'])} timers through the log: >= 20,000 timers/s from the due time, fed before it",
        f"{fmt(sc['fired_per_s'])}/s; feed done {fmt(sc['feed_margin_s'], 1)} s before the due time",
        sc["fired_per_s"] >= 20_000 and sc["feed_margin_s"] >= 0,
    )
    biggest = max(c.firing_sizes)
    a = med[f"alone {biggest}"]
    add(
        f"firing path alone at {fmt(biggest)}: >= 25,000 timers/s",
        fmt(a["fired_per_s"]),
        a["fired_per_s"] >= 25_000,
    )
    for rate, bound in ((5_000, 100.0), (1_000, 10.0)):
        x = med.get(f"log steady {rate}")
        if x is None:
            continue
        kept = x["fired"] >= x["added"] > 0 and x["offered_per_s"] >= 0.95 * rate
        add(
            f"steady {fmt(rate)} commits/s through the log: all fired, p99 <= {fmt(bound, 0)} ms",
            f"p50 {fmt_ms(x['p50_ms'])} ms, p99 {fmt_ms(x['p99_ms'])} ms, {fmt(x['fired'])} of {fmt(x['added'])} "
            f"fired, offered {fmt(x['offered_per_s'])}/s",
            kept and x["p99_ms"] <= bound,
        )
    return rows


SECTIONS: dict[str, Callable[[Config], Section]] = {
    "timers": section_timers,
    "steady": section_steady,
    "growth": section_growth,
    "sink": section_sink,
    "failover": section_failover,
    "http": section_http,
    "e2e": section_e2e,
}

# --------------------------------------------------------------------------- report

RESULTS = HERE / "RESULTS.md"
STORE = HERE / "results.json"
"""Every section's latest run, from which ``RESULTS.md`` is written."""


def section_targets(section: Section) -> list[list[str]]:
    """The targets against a section's run: those it recorded, or those its raw numbers give."""
    if section.targets:
        return section.targets
    if section.data is None:
        return []
    rows: list[list[str]] = []

    def add(target: str, measured: str, met: bool | None) -> None:
        rows.append([target, measured, "-" if met is None else ("yes" if met else "no")])

    key = section.key
    if key == "timers":
        data: dict[str, dict[str, dict[str, Any]]] = section.data
        sizes = sorted(int(k) for k in data if "wowd run, 1 process" in data[k])
        if sizes:
            n = max(sizes)
            r = data[str(n)]
            w1 = r["wowd run, 1 process"]
            add(
                f"one replica fires >= 25,000 timers/s (N={fmt(n)})",
                f"{fmt(w1['fired_per_s'])} (drain {fmt(w1.get('drain_per_s'))})",
                w1["fired_per_s"] >= 25_000,
            )
            aps = r.get("APScheduler 3 (SQLite WAL)")
            if aps:
                ratio = w1["fired_per_s"] / aps["fired_per_s"]
                add(f">= 25x APScheduler 3 (WAL) (N={fmt(n)})", f"{fmt(ratio, 2)}x", ratio >= 25)
            ceil = r.get("bare loop (ceiling)")
            if ceil:
                ratio = w1["fired_per_s"] / ceil["fired_per_s"]
                add(f">= 40% of the bare loop (N={fmt(n)})", f"{fmt(ratio * 100, 0)}%", ratio >= 0.4)
        for size, row in sorted(data.items(), key=lambda kv: int(kv[0])):
            default = row.get("APScheduler 3 (SQLite default)")
            wowd1 = row.get("wowd run, 1 process")
            if default and wowd1:
                ratio = wowd1["fired_per_s"] / default["fired_per_s"]
                add(
                    f">= 25x APScheduler 3 out of the box (N={fmt(int(size))}, a 970/s setup)",
                    f"{fmt(ratio, 2)}x",
                    ratio >= 25,
                )
        if "10000" in data and "wowd run, 1 process" in data["10000"]:
            p99 = data["10000"]["wowd run, 1 process"]["p99_ms"]
            add("burst of 10,000: p99 lag <= 0.5 s", f"{fmt_ms(p99)} ms", p99 <= 500)
    elif key == "steady":
        for x in section.data["wowd"]:
            if x["rate"] == 1000:
                add(
                    "steady 1,000/s: p50 <= 3 ms, p99 <= 10 ms",
                    f"p50 {fmt_ms(x['p50_ms'])} ms, p99 {fmt_ms(x['p99_ms'])} ms",
                    x["p50_ms"] <= 3 and x["p99_ms"] <= 10,
                )
    elif key == "growth":
        emb = section.data["embedded"]
        add(
            f"due read flat within 2x from {fmt(emb['stored'][0])} to {fmt(emb['stored'][-1])} timers",
            f"{fmt(emb['growth_ratio'], 2)}x",
            emb["growth_ratio"] <= 2,
        )
        wrows = section.data["mongo"]["rows"]
        add(
            "one MongoDB due-read command per poll, any number of types",
            ", ".join(f"{r['types']} types: {r['due_commands']}" for r in wrows),
            all(r["due_commands"] == 1 for r in wrows),
        )
        add(
            "<= 3 MongoDB commands per batch of 1,000 of one type",
            ", ".join(str(r["batch_commands"]) for r in wrows),
            all(r["batch_commands"] <= 3 for r in wrows),
        )
    elif key == "sink":
        for variant in ("async_bulk (prebuilt)", "async_bulk (from commits)"):
            ratios = []
            for r in section.data["rows"]:
                if r["variant"] != variant:
                    continue
                sink = next(x for x in section.data["rows"] if x["batch"] == r["batch"] and x["variant"] == "wowd sink")
                ratios.append((sink["commits_per_s"] / r["commits_per_s"], r["batch"]))
            if ratios:
                add(
                    f"sink write >= {variant} (every batch size)",
                    ", ".join(f"{fmt(b)}: {fmt(x, 2)}x" for x, b in sorted(ratios, key=lambda t: t[1])),
                    min(x for x, _ in ratios) >= 1,
                )
    elif key == "failover":
        for d in section.data:
            add(
                f"failover within ttl + ttl/3 + poll (ttl {fmt(d['ttl_s'], 0)} s)",
                f"max {fmt(max(d['failover_ms']))} ms of {fmt(d['bound_ms'])} ms",
                max(d["failover_ms"]) <= d["bound_ms"],
            )
    elif key == "http":
        hrows = section.data["rows"]
        top = max((r["concurrency"] for r in hrows if isinstance(r["concurrency"], int)), default=None)
        w = next((r for r in hrows if r["system"] == "wowd run, http gateway" and r["per_target"] == top), None)
        b = next((r for r in hrows if r["system"] == "bare aiohttp loop" and r["concurrency"] == top), None)
        if w is not None and b is not None:
            add(
                f"http gateway >= 5,000 deliveries/s at concurrency {top} (N={fmt(section.data['n'])})",
                fmt(w["fired_per_s"]),
                w["fired_per_s"] >= 5000,
            )
            ratio = w["fired_per_s"] / b["fired_per_s"]
            add(f"http gateway >= 0.5x the bare aiohttp loop (concurrency {top})", f"{fmt(ratio, 2)}x", ratio >= 0.5)
        st = section.data["steady"]
        add(
            f"steady {fmt(st['rate'])}/s over HTTP: p99 lag <= 20 ms",
            f"p99 {fmt_ms(st['p99_ms'])} ms ({fmt(st['fired'])} / {fmt(st['added'])} fired)",
            st["p99_ms"] <= 20 and st["fired"] == st["added"],
        )
    return rows


def targets(sections: dict[str, Section]) -> str:
    """The targets against the numbers of these sections' runs, in the report's order of sections."""
    rows: list[list[str]] = []
    for key in SECTIONS:
        if key in sections:
            rows += section_targets(sections[key])
    return table(["target", "measured", "met"], rows)


def _is_ours(title: str) -> bool:
    """Whether a report's section ``## title`` is one this module writes."""
    if title in ("Targets", "What we learned") or any(title.startswith(t) for t in TITLES.values()):
        return True
    return title.endswith(": FAILED") and title.removesuffix(": FAILED") in SECTIONS


def other_sections(report: str) -> str:
    """The sections of an existing report that this module does not write (the chaos soak's, the
    takeover's), verbatim and in their order."""
    parts = re.split(r"(?m)^(?=## )", report)
    return "".join(p for p in parts[1:] if not _is_ours(p.split("\n", 1)[0].removeprefix("## ").strip()))


def machine_line() -> str:
    m = machine()
    return (
        f"{m['cores']} cores ({m['cpu']}), {m['system']}; Python {m['python']} ({m['implementation']}), "
        f"SQLite {m['sqlite']}"
    )


def checkout_commit() -> str:
    """The checkout's commit, with ``+`` when wowd or bench has uncommitted changes ("" outside git)."""
    root = HERE.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "wowd", "bench"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if dirty else "")


def render(
    sections: Sequence[Section],
    *,
    cfg: Config | None = None,
    command: str = "",
    quick: bool = False,
    total_s: float = 0.0,
    when: str | None = None,
    others: str = "",
) -> str:
    """The report: each section's latest run with its date, command, commit and machine, the
    targets against those runs, then ``others`` (sections another tool wrote, kept verbatim).

    ``command`` and ``when`` stand for a section that does not name its own run; ``cfg``, ``quick``
    and ``total_s`` are not used: each section names its own run and time."""
    by_key = {s.key: s for s in sections}
    now = when or datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# wowd benchmarks",
        "",
        "The latest run of each section, with its date, command, commit and machine: `python -m bench` "
        "(`make bench`) runs every section, `python -m bench --only SECTION ...` runs some again in place of "
        "their earlier run (`bench/results.json` keeps each section's latest run). What the runs taught is in "
        "[LEARNED.md](LEARNED.md), the changes they measured in [CHANGELOG.md](../CHANGELOG.md).",
        "",
        "- Every measured system runs in its own process (peak RSS and CPU seconds are its own; CPU over the "
        "measured window only; for `wowd run` the sum over its processes).",
        "- APScheduler 4 runs under its own interpreter (`WOWD_BENCH_APS4_PYTHON`, default "
        "`/tmp/aps4venv/bin/python`), made with `python3 -m venv /tmp/aps4venv && /tmp/aps4venv/bin/pip "
        "install apscheduler==4.0.0a6 'sqlalchemy<2.1' aiosqlite greenlet sniffio`.",
        "- Lag = fire time - due time: the outbox row's `created_at` - the timer's `scheduled_at`. "
        "fired/s = N / (last fire - due time); drain/s = N / (last fire - first fire).",
        "",
        "## Targets",
        "",
        targets(by_key),
        "",
    ]
    for s in sections:
        run = f"Run {s.when or now}, `{s.command or command}`"
        run += f", at {s.commit}" if s.commit else ""
        out += [f"## {s.title}", "", f"{run}. Machine: {s.machine or machine_line()}.", ""]
        if s.remark:
            out += [s.remark.strip(), ""]
        out += [s.body, ""]
        for note in s.notes:
            out += [f"- {note}"]
        if s.notes:
            out.append("")
        out += [f"_(section took {fmt(s.seconds)} s)_", ""]
    text = "\n".join(out).rstrip("\n") + "\n"
    if others.strip():
        text += "\n" + others.strip("\n") + "\n"
    return text


def run_sections(keys: Sequence[str], cfg: Config, command: str = "python -m bench") -> list[Section]:
    done = []
    for key in keys:
        started = time.monotonic()
        began = datetime.now(UTC)
        log.info("bench: %s ...", key)
        try:
            section = SECTIONS[key](cfg)
        except Exception as exc:  # a failing benchmark is reported, the others still run
            log.exception("bench: %s failed", key)
            section = Section(key=key + "-failed", title=f"{key}: FAILED", body=f"`{_err(exc)}`")
        section.seconds = time.monotonic() - started
        ended = datetime.now(UTC)
        start, end = began.strftime("%Y-%m-%d %H:%M"), ended.strftime("%Y-%m-%d %H:%M")
        if end == start:
            section.when = f"{start} UTC"
        elif end[:10] == start[:10]:
            section.when = f"{start}-{end[11:]} UTC"
        else:
            section.when = f"{start} - {end} UTC"
        section.command = command
        section.commit = checkout_commit()
        section.machine = machine_line()
        section.targets = section_targets(section)
        log.info("bench: %s done in %.0f s", key, section.seconds)
        done.append(section)
    return done


def load_sections(path: Path) -> dict[str, Section]:
    """The sections of a ``--json`` file, by key (a failed section under its section's key)."""
    doc = json.loads(path.read_text())
    sections = {}
    for d in doc.get("sections", []):
        s = Section(**d)
        s.command = s.command or str(doc.get("command", ""))
        s.when = s.when or str(doc.get("when", ""))
        sections[s.key.removesuffix("-failed")] = s
    return sections


def write_report(out: Path, sections: Sequence[Section]) -> str:
    """Write the report of ``sections`` to ``out``, keeping the sections of ``out`` that another tool
    wrote there."""
    others = other_sections(out.read_text()) if out.exists() else ""
    text = render(sections, others=others)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def write_store(path: Path, sections: Sequence[Section]) -> None:
    doc = {"sections": [asdict(s) for s in sections]}
    path.write_text(json.dumps(doc, indent=1, default=str, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, one run each")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the report (default bench/RESULTS.md)")
    ap.add_argument(
        "--json",
        type=Path,
        help="every section's latest run (tables and raw numbers): read, updated with the sections run, and "
        "written again (default bench/results.json with the default --out, else --out's name with .json)",
    )
    ap.add_argument(
        "--keep",
        type=Path,
        help="with --only: take the sections not run from this --json file instead",
    )
    ap.add_argument(
        "--render",
        type=Path,
        nargs="?",
        const=Path(),
        help="run nothing: write the report from this --json file (default: the --json file)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    cfg = QUICK if args.quick else Config()
    store: Path = args.json or (STORE if args.out == RESULTS else args.out.with_suffix(".json"))
    if args.render is not None:
        source = store if args.render == Path() else args.render
        kept = load_sections(source)
        write_report(args.out, [kept[k] for k in SECTIONS if k in kept])
        return 0
    command = (
        "python -m bench" + (" --quick" if args.quick else "") + (" --only " + " ".join(args.only) if args.only else "")
    )
    fresh = {s.key.removesuffix("-failed"): s for s in run_sections(args.only or list(SECTIONS), cfg, command)}
    source = args.keep or store
    kept = load_sections(source) if source.exists() else {}
    sections = [fresh.get(k) or kept[k] for k in SECTIONS if k in fresh or k in kept]
    write_store(store, sections)
    text = write_report(args.out, sections)
    sys.stdout.write(text)
    return 0 if all(not s.key.endswith("-failed") for s in fresh.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
