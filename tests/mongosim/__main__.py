"""``python -m tests.mongosim --port N``: the simulator as a process, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from typing import Any

from tests.mongosim.engine import Engine, Settings
from tests.mongosim.wire import WireServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mongosim", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=27017)
    parser.add_argument("--set-name", default="wowdsim", help="the replica set's name (hello's setName)")
    parser.add_argument("--noop-interval", type=float, default=10.0, help="periodic no-op writer interval, s")
    parser.add_argument("--oplog-window", type=float, default=None, help="history kept, s (default: all)")
    parser.add_argument("--shards", type=int, default=0, help="answer as a mongos of N shards (0: a replica set)")
    parser.add_argument("--ttl-interval", type=float, default=60.0, help="TTL monitor interval, s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(
        set_name=args.set_name,
        noop_interval=args.noop_interval,
        oplog_window=args.oplog_window,
        ttl_interval=args.ttl_interval,
        shards=args.shards,
    )
    server = WireServer(Engine(settings), host=args.host, port=args.port)
    # The handler takes no lock: it runs in the main thread between two bytecodes, and one that
    # sets a threading.Event there can deadlock on the Event's lock, which the main thread holds
    # from the moment it starts waiting on it.
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    profile = os.environ.get("MONGOSIM_PROFILE")
    if profile:  # where the simulator's time goes under a load (pstats file written at exit)
        import cProfile

        profiler = cProfile.Profile()
        engine_run = server.engine.run

        def run(conn: Any, cmd: dict[str, Any]) -> dict[str, Any]:
            profiler.enable()
            try:
                return engine_run(conn, cmd)
            finally:
                profiler.disable()

        server.engine.run = run  # type: ignore[method-assign]
    server.start()
    print(f"mongosim listening: {server.uri}", flush=True)
    while not stopping:
        time.sleep(0.05)  # a poll of the handler's flag; a signal cuts the sleep short
    server.stop()
    if profile:
        profiler.dump_stats(profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
