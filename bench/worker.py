"""``python -m bench.worker NAME PARAMS_JSON``: runs one measurement in this fresh process and
prints its result as one JSON line (the orchestrator reads the last ``{...}`` line)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

WORKERS = {
    "ceiling": "bench.ceiling:run_burst",
    "aps3_burst": "bench.peer_aps3:run_burst",
    "aps3_steady": "bench.peer_aps3:run_steady",
    "store_path": "bench.wowd_timers:run_store_path",
    "growth_embedded": "bench.growth:run_embedded",
    "growth_mongo": "bench.growth:run_mongo_wire",
    "sink": "bench.sink:run_sink",
    "http_bare": "bench.http_delivery:run_bare",
    "http_bare_steady": "bench.http_delivery:run_bare_steady",
}


def resolve(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    module, _, attr = WORKERS[name].partition(":")
    fn: Callable[[dict[str, Any]], dict[str, Any]] = getattr(importlib.import_module(module), attr)
    return fn


def main(argv: list[str]) -> int:
    name, params = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    result = resolve(name)(params)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
