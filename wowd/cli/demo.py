"""``wowd demo``: append demo commits with timer events to the log."""

from __future__ import annotations

import argparse
import time

from wowd.backends import opened_backend
from wowd.cli.output import out
from wowd.config import WowdSettings

__all__ = ["demo", "register"]


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="append demo commits with timer events to the log")
    p.add_argument("--commits", type=_non_negative, default=1000, help="commits to append (default 1000)")
    p.add_argument("--timers", type=_non_negative, default=1000, help="timers to schedule over them (default 1000)")
    p.add_argument(
        "--due-in-ms", type=_non_negative, default=2000, help="timers come due this long after (default 2000)"
    )
    p.add_argument(
        "--aggregates", type=_non_negative, default=100, help="orders the commits are spread over (default 100)"
    )
    p.set_defaults(handler=demo)


async def demo(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.demo import produce

    start = time.monotonic()
    async with opened_backend(settings) as backend:
        stats = await produce(
            backend.log, commits=args.commits, timers=args.timers, due_in_ms=args.due_in_ms, aggregates=args.aggregates
        )
    out(
        f"appended {stats.commits} commits with {stats.timers} timers ({stats.cancelled} cancelled) "
        f"to {settings.context} in {time.monotonic() - start:.2f}s"
    )
    return 0
