"""``python -m bench.profile_http [--n N] [--concurrency C] [--threads] [--no-profile] [--bare]``: the
timer loop firing over the ``http`` gateway, in-process, under cProfile.

The target is :mod:`bench.http_delivery`'s server in its own process. ``n`` timers due at once are
put into a fresh embedded timer store; one timer loop holding every partition (the embedded
timer store, an :class:`~wowd.delivery.HttpGateway` under limits of ``concurrency`` requests in
flight, per target too) claims, delivers and settles them until the
target has seen all of them. No feed and no lease renewals run: what is measured is the firing path
per command (claim, deliver, settle). ``--bare`` times (and profiles) the bare aiohttp loop of
:mod:`bench.http_delivery` in this process instead (same requests, same concurrency).

By default the store's SQLite calls run inline on the event loop's thread (so that the profile
sees their cost); ``--threads`` keeps the worker threads; ``--null`` a gateway that answers at once with no request
(the firing path's own cost). ``--no-profile`` times the path without
the profiler's overhead (CPU per command to compare a change with). The event loop is uvloop and
the garbage collector tuned, as ``wowd run`` has them (``--default-gc``: Python's defaults). Each
attempt is recorded in the timer history with its settle group, as ``wowd run`` records it
(``--no-history``: not recorded).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from bench.common import (
    BENCH_CONTEXT,
    cpu_seconds,
    create_timer_tables,
    insert_timer_rows,
    now_ms,
    profile_tables,
    sqlite_inline,
    timer_rows,
)
from bench.http_delivery import Target, _bare, target_server
from bench.wowd_timers import PARTITIONS

if TYPE_CHECKING:
    from wowd.model import Timer

__all__ = ["STEPS", "fire_once", "main"]

STEPS = (
    ("claim_due (store)", "timer_firing.py", "claim_due"),
    ("settle (store)", "timer_firing.py", "settle"),
    ("outcome_changes", "timer_plan.py", "outcome_changes"),
    ("count_outcomes (metrics)", "timer_plan.py", "count_outcomes"),
    ("history records", "timer_plan.py", "attempt_records"),
    ("stream worker", "stream.py", "_worker"),
    ("gateway send", "http.py", "send"),
    ("gateway _post", "http.py", "_post"),
    ("aiohttp ClientSession._request", "client.py", "_request"),
)
"""The path's steps: (label, file name, function) as cProfile names them."""


async def _fire(
    target: Target,
    db_path: Path,
    n: int,
    concurrency: int,
    *,
    inline: bool,
    profile: bool,
    null: bool = False,
    history: bool = True,
) -> Any:
    from tests.timer_stores import embedded_timers
    from wowd.config import GatewaySettings, TimerSettings
    from wowd.daemon.firing import Firing
    from wowd.daemon.leases import HeldSlot
    from wowd.daemon.stream import target_limits
    from wowd.daemon.waker import Waker
    from wowd.delivery import Delivered, HttpGateway, Outcome
    from wowd.model import SlotLease
    from wowd.stores.embedded.history import EmbeddedTimerHistory

    store = embedded_timers(db_path, context=BENCH_CONTEXT, partitions=PARTITIONS)
    recorded = EmbeddedTimerHistory(db_path, context=BENCH_CONTEXT) if history else None
    all_delivered = anyio.Event()
    delivered = 0

    class Counting(HttpGateway):
        """Sets ``all_delivered`` once ``n`` commands were delivered."""

        async def send(self, timer: Timer) -> Outcome:
            nonlocal delivered
            outcome = await super().send(timer)
            if isinstance(outcome, Delivered):
                delivered += 1
                if delivered >= n:
                    all_delivered.set()
            return outcome

    class Null:
        """Answers Delivered at once, no request: the firing path's own cost."""

        async def send(self, timer: Timer) -> Outcome:
            nonlocal delivered
            delivered += 1
            if delivered >= n:
                all_delivered.set()
            return Delivered()

        async def aclose(self) -> None:
            return None

    gateway: Any = Null() if null else Counting(GatewaySettings(kind="http", url=target.url), pool_size=concurrency)
    firing = Firing(
        settings=TimerSettings(),
        timers=store.firing,
        gateway=gateway,
        limits=target_limits(concurrency, lambda _target: concurrency),
        nudge=lambda: None,
        gate=None,
        history=recorded,
    )
    lease = SlotLease(
        namespace="bench",
        slot=0,
        owner_key="profile",
        incarnation=1,
        fence=1,
        expires_at=2**62,
        floor=0,
        ceiling=PARTITIONS - 1,
        written_at=0,
    )
    held = HeldSlot(lease=lease, partitions=frozenset(range(PARTITIONS)), valid_until=float("inf"), owner_key="profile")
    waker = Waker()
    waker.advance(2**62)
    due = now_ms() + 300 + n // 40
    insert_timer_rows(db_path, timer_rows(n, due_at=due, partitions=PARTITIONS))

    profiler = cProfile.Profile() if profile else None
    try:
        with sqlite_inline(inline):
            await anyio.sleep(max(0.0, (due - now_ms()) / 1000))
            cpu0 = cpu_seconds()
            started = time.perf_counter()

            async def watch() -> None:
                await all_delivered.wait()
                held.request_stop()

            if profiler is not None:
                profiler.enable()
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await firing.loop().run(held, waker)
            if profiler is not None:
                profiler.disable()
            elapsed = time.perf_counter() - started
            cpu = cpu_seconds() - cpu0
    finally:
        await gateway.aclose()
        await store.close()
        if recorded is not None:
            await recorded.close()
    return elapsed, cpu, profiler


def fire_once(
    n: int,
    concurrency: int,
    *,
    inline: bool = True,
    profile: bool = True,
    bare: bool = False,
    tune_gc: bool = True,
    null: bool = False,
    history: bool = True,
) -> dict[str, Any]:
    """Fires ``n`` timers due at once over HTTP in this process (or, with ``bare``, runs the bare
    aiohttp loop); answers the timings (and, with ``profile``, the ``cProfile.Profile``).
    ``tune_gc``: the collector as ``wowd run`` sets it (for the bare loop too)."""
    import uvloop

    if tune_gc:
        import wowd.cli.run
        import wowd.daemon.timers
        import wowd.stores.embedded.timer_firing  # noqa: F401  (start-up done before the collector is tuned)

        wowd.cli.run.tune_gc()

    with tempfile.TemporaryDirectory() as tmp, target_server(Path(tmp)) as target:
        if bare:
            bare_profiler = cProfile.Profile() if profile else None

            async def bare_run() -> dict[str, Any]:
                if bare_profiler is not None:
                    bare_profiler.enable()
                try:
                    return await _bare(target.url, n, concurrency)
                finally:
                    if bare_profiler is not None:
                        bare_profiler.disable()

            r = uvloop.run(bare_run())
            wall = n / r["fired_per_s"]
            return {"n": n, "wall_s": wall, "cpu_s": r["cpu_s"], "profiler": bare_profiler, **_rates(n, r)}
        db_path = Path(tmp) / "wowd.db"
        create_timer_tables(db_path)
        elapsed, cpu, profiler = uvloop.run(
            _fire(target, db_path, n, concurrency, inline=inline, profile=profile, null=null, history=history)
        )
        seen = target.count()
    return {
        "n": n,
        "seen": seen,
        "wall_s": elapsed,
        "cpu_s": cpu,
        "profiler": profiler,
        **_rates(n, {"fired_per_s": n / elapsed, "cpu_s": cpu}),
    }


def _rates(n: int, r: dict[str, Any]) -> dict[str, float]:
    return {"fired_per_s": float(r["fired_per_s"]), "cpu_us_per_command": float(r["cpu_s"]) / n * 1e6}


def report(result: dict[str, Any], top: int) -> str:
    n = result["n"]
    lines = [
        f"{n:,} commands in {result['wall_s']:.2f} s: {result['fired_per_s']:,.0f}/s, "
        f"{result['cpu_us_per_command']:.0f} us CPU per command",
    ]
    profiler = result.get("profiler")
    if profiler is None:
        return "\n".join(lines)
    lines += profile_tables(profiler, STEPS, n, "command", top, 60)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_http", description=__doc__)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--threads", action="store_true", help="keep the store's worker threads (profile: loop thread)")
    ap.add_argument("--no-profile", action="store_true", help="time the path without cProfile")
    ap.add_argument("--bare", action="store_true", help="the bare aiohttp loop instead")
    ap.add_argument("--default-gc", action="store_true", help="Python's collector settings, not wowd run's")
    ap.add_argument("--null", action="store_true", help="a gateway that answers at once, no request")
    ap.add_argument("--no-history", action="store_true", help="record no attempt in the timer history")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    result = fire_once(
        args.n,
        args.concurrency,
        inline=not args.threads,
        profile=not args.no_profile,
        bare=args.bare,
        tune_gc=not args.default_gc,
        null=args.null,
        history=not args.no_history,
    )
    text = report(result, args.top)
    sys.stdout.write(text + "\n")
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "profiler"}) + "\n")
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
