"""``python -m bench.profile_feed [--commits N] [--timers M] [--threads] [--checkpoint] [--no-profile]``:
the feed on the catch-up case, in-process, under cProfile.

The demo producer (``wowd.demo.produce``, as ``wowd demo --commits N --timers N --aggregates N
--due-in-ms 0`` appends) fills an embedded log of 64 partitions; then one :class:`Feeder` on the
embedded backend feeds every partition (sink, timer view, snapshots when configured, parked-timer
check, checkpoints) from no checkpoint to the log's head, and stops there. No timer loop runs.

By default the stores' SQLite calls run inline on the event loop's thread (``SqliteDatabase.run``
calls ``run_sync`` directly) so that the profile sees their cost where it is spent (cProfile
follows one thread); ``--threads`` keeps the worker threads as the daemon has them (the profile
then shows the loop thread only, and the hop's cost). ``--no-profile`` times the feed without the
profiler's overhead (the numbers to compare a change with). Reported: commits/s, CPU per commit,
the feed's steps (cumulative time per commit) and the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio

from bench.common import cpu_seconds, peak_rss_mb, profile_tables, sqlite_inline
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["STEPS", "feed_once", "main"]

STEPS = (
    ("read: the log query", "log.py", "<lambda>"),
    ("read: documents decoded (_entry)", "log.py", "_entry"),
    ("prepare_batch (timer events, net effect)", "feed.py", "prepare_batch"),
    ("sink documents built", "sink.py", "plan_write"),
    ("timer writes built", "timer_view.py", "plan_write"),
    ("the batch's transaction", "embedded/feed.py", "apply"),
    ("- sink rows", "sink.py", "work"),
    ("- timer view rows", "timer_view.py", "write_steps"),
    ("- parked-timer check", "timer_view.py", "parked_timers"),
    ("- checkpoints", "checkpoints.py", "save_checkpoint_rows"),
    ("one batch applied (_apply)", "feed.py", "_apply"),
    ("one batch processed (_process)", "feed.py", "_process"),
)
"""The feed's steps: (label, file name, function) as cProfile names them."""


async def _feed(
    path: Path, commits: int, timers: int, *, inline: bool, profile: bool, checkpoint: bool
) -> dict[str, Any]:
    from wowd.config import WowdSettings
    from wowd.daemon.feed import Feeder, Waker
    from wowd.daemon.leases import HeldSlot
    from wowd.demo import produce
    from wowd.model import SlotLease
    from wowd.stores.embedded import open_embedded

    settings = WowdSettings(context="bench", partitions=64, embedded={"path": path})  # type: ignore[arg-type]
    backend = await open_embedded(settings)
    try:
        await produce(backend.log, commits=commits, timers=timers, due_in_ms=0, aggregates=commits)
        if checkpoint:  # as after `wowd demo` exits: the log in the main file, not in the WAL
            with closing(sqlite3.connect(str(path))) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        lease = SlotLease(
            namespace="bench",
            slot=0,
            owner_key="profile",
            incarnation=1,
            fence=1,
            expires_at=2**62,
            floor=0,
            ceiling=63,
            written_at=0,
        )
        held = HeldSlot(lease=lease, partitions=frozenset(range(64)), valid_until=float("inf"), owner_key="profile")

        class StopAtHead(Waker):
            """Stops the feed once it reached the log's head (the watermark moves)."""

            def advance(self, watermark: int, covers: frozenset[int] | None = None) -> None:
                super().advance(watermark, covers)
                held.request_stop()

        profiler = cProfile.Profile() if profile else None
        cpu0 = cpu_seconds()
        started = time.perf_counter()
        with sqlite_inline(inline):
            if profiler is not None:
                profiler.enable()
            await Feeder(settings, backend).run(held, StopAtHead())
            if profiler is not None:
                profiler.disable()
        elapsed = time.perf_counter() - started
        cpu = cpu_seconds() - cpu0
        checkpoints = await backend.checkpoints.read("wowd", list(range(64)))
        fed = sum(int(cp.position["seq"]) > 0 for cp in checkpoints.values())
        with closing(sqlite3.connect(str(path))) as conn:
            in_log = int(conn.execute("SELECT count(DISTINCT partition) FROM log").fetchone()[0])
    finally:
        await backend.close()
    return {
        "commits": commits,
        "timers": timers,
        "partitions_checkpointed": fed,
        "partitions_in_log": in_log,
        "wall_s": elapsed,
        "cpu_s": cpu,
        "commits_per_s": commits / elapsed,
        "cpu_us_per_commit": cpu / commits * 1e6,
        "peak_rss_mb": peak_rss_mb(),
        "profiler": profiler,
    }


def feed_once(
    commits: int, *, timers: int | None = None, inline: bool = True, profile: bool = True, checkpoint: bool = False
) -> dict[str, Any]:
    """Appends ``commits`` demo commits (``timers`` timers over them, default one each) to a fresh
    embedded log and feeds them; answers the
    timings (and, with ``profile``, the ``cProfile.Profile``). ``checkpoint``: the WAL is written
    back into the main file before the feed starts (as when ``wowd demo`` exited), else the feed
    reads the log from the WAL (as when the producer runs alongside)."""
    with tempfile.TemporaryDirectory() as tmp:
        return anyio.run(
            lambda: _feed(
                Path(tmp) / "wowd.db",
                commits,
                commits if timers is None else timers,
                inline=inline,
                profile=profile,
                checkpoint=checkpoint,
            )
        )


def report(result: dict[str, Any], top: int) -> str:
    n = result["commits"]
    lines = [
        f"{n:,} commits fed in {result['wall_s']:.2f} s: {result['commits_per_s']:,.0f} commits/s, "
        f"{result['cpu_us_per_commit']:.0f} us CPU per commit, peak RSS {result['peak_rss_mb']:.0f} MB",
    ]
    profiler = result.get("profiler")
    if profiler is None:
        return "\n".join(lines)
    lines += profile_tables(profiler, STEPS, n, "commit", top, 40)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_feed", description=__doc__)
    ap.add_argument("--commits", type=int, default=20_000)
    ap.add_argument("--timers", type=int, help="timers over the commits (default: one per commit)")
    ap.add_argument("--threads", action="store_true", help="keep the stores' worker threads (profile: loop thread)")
    ap.add_argument("--no-profile", action="store_true", help="time the feed without cProfile")
    ap.add_argument(
        "--checkpoint", action="store_true", help="checkpoint the WAL before feeding (as after `wowd demo`)"
    )
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--runs", type=int, default=1, help="with --no-profile: runs (the median is printed)")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    profile = not args.no_profile
    results = [
        feed_once(
            args.commits, timers=args.timers, inline=not args.threads, profile=profile, checkpoint=args.checkpoint
        )
        for _ in range(1 if profile else args.runs)
    ]
    results.sort(key=lambda r: r["commits_per_s"])
    result = results[len(results) // 2]
    text = report(result, args.top)
    if len(results) > 1:
        text += "\nruns (commits/s): " + ", ".join(f"{r['commits_per_s']:,.0f}" for r in results)
    sys.stdout.write(text + "\n")
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "profiler"}) + "\n")
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
