"""``python -m bench.timer_rebuild [--commits N] [--file PATH] [--runs R]``: how fast
``wowd timers rebuild --dry-run`` replays a log.

Makes an embedded file of ``N`` commits with ``wowd demo`` (half of them schedule a timer, due a
day later, over 10,000 orders) unless ``PATH`` exists, then times the dry run, as a subprocess,
``R`` times, on a copy of the file in the temporary directory (the dry run changes nothing, but a
copy keeps the file as it was even when a run is killed), and prints the wall time, the CPU time
of the run and of its pool, and the commits replayed per second. The file of a million commits
takes a few minutes to make and about 1.3 GB: keep it (``--file``) for later runs.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]


def _env(path: Path) -> dict[str, str]:
    return {**os.environ, "WOWD_EMBEDDED__PATH": str(path)}


def _wowd(*args: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wowd", *args], env=_env(path), capture_output=True, text=True, check=True
    )


def make_log(path: Path, commits: int) -> None:
    """A file of ``commits`` demo commits (half of them schedule a timer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _wowd(
        "demo",
        "--commits",
        str(commits),
        "--timers",
        str(commits // 2),
        "--due-in-ms",
        "86400000",
        "--aggregates",
        "10000",
        path=path,
    )
    print(f"made {path} ({commits} commits) in {time.monotonic() - started:.0f} s", flush=True)


def dry_run(path: Path) -> tuple[float, int]:
    """One timed ``wowd timers rebuild --dry-run`` on a copy of ``path``: its wall time and the
    commits it read."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        started = time.monotonic()
        done = _wowd("timers", "rebuild", "--dry-run", path=copy)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = next((line for line in done.stdout.splitlines() if line.startswith("summary: ")), "")
    found = re.search(r"(\d+) commits read", summary)
    commits = int(found.group(1)) if found else 0
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(
        f"dry run: {wall:.1f} s wall, {cpu:.1f} s CPU (with its pool), {commits / wall:,.0f} commits/s; "
        f"load average {load:.2f} at the start\n  {summary}",
        flush=True,
    )
    return wall, commits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.timer_rebuild", description=__doc__)
    parser.add_argument("--commits", type=int, default=100_000, help="commits of the log (default 100,000)")
    parser.add_argument("--file", type=Path, help="the file to use, made first when missing (default: a temporary one)")
    parser.add_argument("--runs", type=int, default=1, help="timed dry runs (default 1)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file or Path(tmp) / "wowd.db"
        if not path.exists():
            make_log(path, args.commits)
        runs = sorted(dry_run(path) for _ in range(args.runs))
    wall, commits = runs[len(runs) // 2]
    print(f"median {wall:.1f} s: {commits / wall:,.0f} commits/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
