"""Two or more sides of one measurement, turns interleaved, in one run: each side a checkout of
wowd (its ``wowd run`` and ``wowd demo`` started from that checkout, ``WOWD_BENCH_CODE``) and
settings of its own.

    python -m bench.interleave WHAT --side NAME=DIR[,KEY=VALUE...] --side ... [--turns 3]

``WHAT``: ``steady`` (the steady load through the log, :func:`bench.e2e.log_steady`),
``scheduled`` (a burst scheduled through the log, :func:`bench.e2e.scheduled`), ``catchup``
(:func:`bench.e2e.catch_up`), ``http`` (an HTTP burst put straight into the timer table,
:func:`bench.http_delivery.http_burst`) or ``one-service`` (HTTP to one service through the log,
default settings, :func:`bench.http_delivery.http_one_service`, with the bare aiohttp loop
measured after each turn). ``DIR`` is a checkout (``git worktree add --detach DIR REV``; ``.`` is
this one); each ``KEY=VALUE`` a ``WOWD_*`` setting of that side's replicas. One JSON line per run;
each turn takes the sides in another order.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import REPO


def _sides(specs: list[str]) -> list[tuple[str, Path, dict[str, str]]]:
    sides = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        where, *settings = rest.split(",")
        code = REPO if where in ("", ".") else Path(where).resolve()
        if not (code / "wowd").is_dir():
            raise SystemExit(f"--side {spec}: {code} is not a checkout of wowd")
        env = dict(s.split("=", 1) for s in settings)
        sides.append((name, code, env))
    return sides


def _turns(sides: list[Any], turns: int) -> list[Any]:
    order = []
    for turn in range(turns):
        k = turn % len(sides)
        order += sides[k:] + sides[:k]
    return order


def _line(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def _run(args: argparse.Namespace, measure: Callable[[dict[str, str]], dict[str, Any]], keys: tuple[str, ...]) -> None:
    for name, code, env in _turns(_sides(args.side), args.turns):
        os.environ["WOWD_BENCH_CODE"] = str(code)
        r = measure(env)
        _line({"side": name, **{k: r.get(k) for k in keys}})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.interleave", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["steady", "scheduled", "catchup", "http", "one-service"])
    parser.add_argument("--side", action="append", required=True, help="NAME=DIR[,KEY=VALUE...]")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rate", type=float, default=5000, help="steady: commits a second")
    parser.add_argument("--seconds", type=float, default=10, help="steady: how long")
    parser.add_argument("--timers", type=int, default=100_000, help="scheduled: timers")
    parser.add_argument("--commits", type=int, default=20_000, help="http: commands; catchup: commits")
    parser.add_argument("--concurrency", type=int, default=64, help="http: requests in flight")
    args = parser.parse_args()
    if args.what == "steady":
        from bench.e2e import log_steady

        keys = ("p50_ms", "p99_ms", "max_ms", "fired", "added", "cpu_s", "load_before")
        _run(args, lambda env: log_steady(args.rate, args.seconds, extra_env=env), keys)
    elif args.what == "scheduled":
        from bench.e2e import scheduled

        keys = ("fired_per_s", "p50_ms", "p99_ms", "fired", "expected", "fed_before_due", "cpu_s", "load_before")
        _run(args, lambda env: scheduled(args.timers, args.timers // 100, extra_env=env), keys)
    elif args.what == "catchup":
        from bench.e2e import catch_up

        keys = ("commits_per_s", "feed_commits_per_s", "fired", "expected", "cpu_s", "load_before")
        _run(args, lambda env: catch_up(args.commits, extra_env=env), keys)
    else:
        from bench.http_delivery import http_bare, http_burst, http_one_service, target_server

        with tempfile.TemporaryDirectory() as t, target_server(Path(t)) as target:
            for turn, (name, code, env) in enumerate(_turns(_sides(args.side), args.turns)):
                os.environ["WOWD_BENCH_CODE"] = str(code)
                if args.what == "http":
                    r = http_burst(target, args.commits, args.concurrency, extra_env=env)
                else:
                    r = http_one_service(target, extra_env=env)
                keys = ("fired", "fired_per_s", "p50_ms", "p99_ms", "cpu_s", "cpu_us_per_command")
                _line({"side": name, **{k: r.get(k) for k in keys}})
                if args.what == "one-service" and (turn + 1) % len(args.side) == 0:
                    b = http_bare(target, 20_000, args.concurrency)
                    _line({"side": f"bare aiohttp loop ({args.concurrency})", "fired_per_s": b["fired_per_s"]})


if __name__ == "__main__":
    main()
