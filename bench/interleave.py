"""Two checkouts of wowd side by side, turns interleaved: the steady load through the log
(:func:`bench.e2e.log_steady`) or the HTTP burst (:func:`bench.http_delivery.http_burst`), each
run's ``wowd run`` imported from one checkout or the other (``PYTHONPATH``).

    python -m bench.interleave steady --before DIR [--rate 5000] [--seconds 10] [--turns 3]
    python -m bench.interleave http --before DIR [--commands 20000] [--concurrency 64] [--turns 3]

``DIR`` is a checkout of the earlier wowd (``git worktree add --detach DIR REV``); the other side
is this checkout. One JSON line per run; the first turn runs the earlier code first, the next one
the current code first, and so on.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO


def _turns(turns: int, before: str) -> list[tuple[str, str]]:
    sides = {"before": before, "now": str(REPO)}
    order: list[tuple[str, str]] = []
    for turn in range(turns):
        names = ("before", "now") if turn % 2 == 0 else ("now", "before")
        order += [(name, sides[name]) for name in names]
    return order


def _steady(args: argparse.Namespace) -> None:
    from bench.e2e import log_steady

    for name, path in _turns(args.turns, args.before):
        os.environ["PYTHONPATH"] = path
        r = log_steady(args.rate, args.seconds)
        keys = ("p50_ms", "p99_ms", "max_ms", "fired", "added", "cpu_s", "load_before")
        _line({"code": name, "rate": args.rate, **{k: r.get(k) for k in keys}})


def _http(args: argparse.Namespace) -> None:
    from bench.http_delivery import http_burst, target_server

    with tempfile.TemporaryDirectory() as t, target_server(Path(t)) as target:
        for name, path in _turns(args.turns, args.before):
            os.environ["PYTHONPATH"] = path
            r = http_burst(target, args.commands, args.concurrency)
            _line({"code": name, **{k: r[k] for k in ("fired", "fired_per_s", "p50_ms", "p99_ms", "cpu_s")}})


def _line(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.interleave", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    steady = sub.add_parser("steady", help="steady load through the log")
    steady.add_argument("--rate", type=float, default=5000)
    steady.add_argument("--seconds", type=float, default=10)
    http = sub.add_parser("http", help="a burst over HTTP")
    http.add_argument("--commands", type=int, default=20_000)
    http.add_argument("--concurrency", type=int, default=64)
    for p in (steady, http):
        p.add_argument("--before", required=True, help="a checkout of the earlier wowd")
        p.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    (_steady if args.what == "steady" else _http)(args)


if __name__ == "__main__":
    main()
