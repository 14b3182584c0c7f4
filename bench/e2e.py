"""End to end through the log: the path users take. Commits with ``TimerScheduled`` events are
appended to the embedded log (``wowd demo``, or ``wowd.demo.demo_commits`` + ``Log.append_many``),
and real ``wowd run`` processes (outbox gateway) feed them (sink, timer view, checkpoints) and
fire them. Side by side, the firing path alone (timers put straight into the timer table, as the
burst section does) and the bare loop (:mod:`bench.ceiling`).

- Catch-up: ``wowd demo`` appends ``n`` commits with one timer each, due at the append; then one
  ``wowd run`` starts. Measured from its start (``Popen``) to every timer fired (an outbox row
  each) and settled (no PENDING or FIRING timer left); also when the feed reached the log's head
  (every partition's checkpoint at its last ``seq``).
- Scheduled: one ``wowd run`` holds the slot; this process appends ``commits`` commits carrying
  ``timers`` timers in all, every one due at one instant ``due_in_ms`` after the append began.
  timers/s = fired / (last fire - due time); whether the feed reached the head before the due
  time (the timer loop fires only below the feed's watermark, so a late feed delays every fire).
- Steady: one ``wowd run``; this process appends ``rate`` commits a second (one timer each, due
  ``delay_ms`` after the append) for ``seconds`` (:func:`bench.wowd_timers.wowd_steady`), or, for
  the firing path alone, inserts ``rate`` timers a second straight into the timer table.

Fire lag = the outbox row's ``created_at`` - the timer's ``scheduled_at``. CPU seconds and peak RSS
(``VmHWM``) are the replica's own, from ``/proc``; the load average is the machine's (1 min), read
before and after each measurement (the machine is shared).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from bench import common
from bench.common import (
    BENCH_CONTEXT,
    create_timer_tables,
    lag_stats,
    now_ms,
    outbox_lags,
    timer_rows,
)
from bench.wowd_timers import (
    PARTITIONS,
    Daemon,
    daemon_env,
    daemons,
    start_daemon,
    stop_daemon,
    wait_until,
    wowd_command,
)
from wowd.stores.embedded.sqlite import sqlite3

__all__ = [
    "E2E_QUICK",
    "E2eConfig",
    "Progress",
    "catch_up",
    "demo_cli",
    "direct_steady",
    "loadavg",
    "log_steady",
    "scheduled",
]

POLL_S = 0.02
_DEMO_OUT = re.compile(r"appended (\d+) commits with (\d+) timers \((\d+) cancelled\)")


def loadavg() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


class Progress:
    """Reads, on its own connection to the file, how far the replica got: outbox rows, live
    (PENDING/FIRING) timers, and whether every partition's feed checkpoint reached the log's head."""

    def __init__(self, db: Path) -> None:
        self._conn = sqlite3.connect(str(db), timeout=30, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout=30000")
        self._heads: dict[int, int] = {}

    def close(self) -> None:
        self._conn.close()

    def _one(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        try:
            row = self._conn.execute(sql, params).fetchone()
        except sqlite3.OperationalError:  # not created yet
            return 0
        return int(row[0] or 0) if row else 0

    def mark_heads(self) -> int:
        """Records each partition's last ``seq`` (call once the append is done); answers the
        number of commits in the log."""
        rows = self._conn.execute(
            "SELECT partition, max(seq), count(*) FROM log WHERE context = ? GROUP BY partition", (BENCH_CONTEXT,)
        ).fetchall()
        self._heads = {int(p): int(s) for p, s, _ in rows}
        return sum(int(c) for _, _, c in rows)

    def fed(self) -> bool:
        """Every partition's checkpoint is at its head (as marked)."""
        try:
            rows = self._conn.execute(
                "SELECT partition, position FROM log_checkpoint WHERE context = ? AND consumer = 'wowd'",
                (BENCH_CONTEXT,),
            ).fetchall()
        except sqlite3.OperationalError:
            return False
        at = {int(p): int(re.sub(r"\D", "", pos) or 0) for p, pos in rows}
        return all(at.get(p, 0) >= head for p, head in self._heads.items())

    def outbox(self) -> int:
        return self._one("SELECT count(*) FROM outbox")

    def live(self) -> int:
        return self._one(f"SELECT count(*) FROM wow_timer__{BENCH_CONTEXT} WHERE status IN ('PENDING', 'FIRING')")

    def span(self) -> tuple[int, int, int, int]:
        """``(min scheduled_at, max scheduled_at, min created_at, max created_at)`` of the outbox."""
        row = self._conn.execute(
            "SELECT min(scheduled_at), max(scheduled_at), min(created_at), max(created_at) FROM outbox"
        ).fetchone()
        return tuple(int(x or 0) for x in row)  # type: ignore[return-value]


@contextmanager
def _progress(db: Path) -> Iterator[Progress]:
    p = Progress(db)
    try:
        yield p
    finally:
        p.close()


def demo_cli(tmp: Path, db: Path, *, commits: int, timers: int, due_in_ms: int, aggregates: int) -> dict[str, Any]:
    """``wowd demo`` as a user runs it, on the replicas' settings; answers what it appended."""
    env = daemon_env(db, limit=1, owner_key="demo")
    args = ["--commits", str(commits), "--timers", str(timers), "--due-in-ms", str(due_in_ms)]
    started = time.monotonic()
    proc = common.POPEN(
        [*wowd_command(), "demo", *args, "--aggregates", str(aggregates)],
        env=env,
        cwd=str(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = (b.decode(errors="replace") for b in proc.communicate(timeout=900))
    elapsed = time.monotonic() - started
    m = _DEMO_OUT.search(out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"wowd demo failed (exit {proc.returncode}): {out[-500:]} {err[-2000:]}")
    return {"commits": int(m[1]), "timers": int(m[2]), "cancelled": int(m[3]), "append_s": elapsed}


def _await_done(d: Daemon, progress: Progress, expected: int, timeout_s: float, what: str) -> float:
    """Waits until ``expected`` outbox rows exist and no timer is live; answers when (monotonic)."""

    def done() -> bool:
        if not d.alive():
            raise RuntimeError(f"{d.name} exited: {d.log_tail()}")
        return progress.outbox() >= expected and progress.live() == 0

    return wait_until(done, timeout_s, what, POLL_S)


def catch_up(
    n: int, *, orders: int | None = None, timeout_s: float = 900, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``wowd demo`` appends ``n`` commits with one timer each (due at once) over ``orders``
    orders (default: one commit each); then one ``wowd run`` starts and feeds, fires and settles
    them all."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        appended = demo_cli(tmp, db, commits=n, timers=n, due_in_ms=0, aggregates=orders or n)
        expected = appended["timers"] - appended["cancelled"]
        load0 = loadavg()
        with _progress(db) as progress:
            in_log = progress.mark_heads()
            started = time.monotonic()
            d = start_daemon(tmp, db, "e2e-catchup", limit=1, extra_env=extra_env)
            try:
                up_at = wait_until(lambda: d.port_file.exists() or not d.alive(), 60, "wowd run up", POLL_S)
                fed_at = wait_until(
                    lambda: progress.fed() or not d.alive(), timeout_s, "feed at the log's head", POLL_S
                )
                done_at = _await_done(d, progress, expected, timeout_s, "every timer fired and settled")
                rss, cpu = d.stats()
            finally:
                stop_daemon(d)
            fired = progress.outbox()
    total_s = done_at - started
    return {
        "n": n,
        "orders": orders or n,
        "commits": in_log,
        "fired": fired,
        "expected": expected,
        "append_s": appended["append_s"],
        "up_s": up_at - started,
        "feed_s": fed_at - started,
        "total_s": total_s,
        "commits_per_s": in_log / total_s,
        "feed_commits_per_s": in_log / (fed_at - started),
        "feed_commits_per_s_after_up": in_log / max(fed_at - up_at, 1e-3),
        "fire_per_s": fired / max(done_at - fed_at, 1e-3),
        "cpu_s": cpu,
        "peak_rss_mb": rss,
        "load_before": load0,
        "load_after": loadavg(),
    }


def scheduled(
    timers: int,
    commits: int,
    *,
    due_in_ms: int = 20_000,
    chunk: int = 500,
    timeout_s: float = 900,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One ``wowd run`` holds the slot; this process appends ``commits`` commits (the demo's, over
    ``commits`` orders) carrying ``timers`` timers, every one due ``due_in_ms`` after the append
    began, in ``chunk``-commit ``append_many`` calls."""
    from wowd.demo import demo_commits
    from wowd.stores.embedded.log import EmbeddedLog

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        with daemons(tmp, db, 1, limit=1, extra_env=extra_env) as ds, _progress(db) as progress:
            d = ds[0]
            load0 = loadavg()
            _, cpu0 = d.stats()
            begin = now_ms()
            due = begin + due_in_ms

            async def append() -> int:
                log = EmbeddedLog(db, context=BENCH_CONTEXT, partitions=PARTITIONS)
                await log.prepare()
                versions: dict[str, int] = {}
                done = added = 0
                try:
                    while done < commits:
                        k = min(chunk, commits - done)
                        share = (timers - added) * k // (commits - done)
                        batch, stats = demo_commits(
                            BENCH_CONTEXT,
                            commits=k,
                            timers=share,
                            due_in_ms=due_in_ms,
                            aggregates=k,
                            run_id=f"c{done}",
                            now_ms=begin,
                            versions=versions,
                        )
                        await log.append_many(batch)
                        done += k
                        added += stats.timers - stats.cancelled
                finally:
                    await log.close()
                return added

            expected = anyio.run(append)
            appended = now_ms()
            progress.mark_heads()
            wait_until(lambda: progress.fed() or not d.alive(), timeout_s, "feed at the log's head", POLL_S)
            fed_ms = now_ms()
            _await_done(d, progress, expected, timeout_s + due_in_ms / 1000, "every timer fired and settled")
            rss, cpu1 = d.stats()
            load1 = loadavg()
            _first_due, _last_due, first_fire, last_fire = progress.span()
            fired = progress.outbox()
        lags = outbox_lags(db)
    return {
        "timers": timers,
        "commits": commits,
        "fired": fired,
        "expected": expected,
        "append_s": (appended - begin) / 1000,
        "feed_done_after_append_s": (fed_ms - begin) / 1000,
        "feed_margin_s": (due - fed_ms) / 1000,
        "fed_before_due": fed_ms <= due,
        "fired_per_s": fired / max((last_fire - due) / 1000, 1e-3),
        "drain_per_s": fired / max((last_fire - first_fire) / 1000, 1e-3),
        **lag_stats(lags).as_dict(),
        "cpu_s": cpu1 - cpu0,
        "peak_rss_mb": rss,
        "load_before": load0,
        "load_after": load1,
    }


def log_steady(
    rate: float, seconds: float, *, delay_ms: int = 1000, drain_s: float = 30, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Steady load through the log (:func:`bench.wowd_timers.wowd_steady`), with the load average."""
    from bench.wowd_timers import wowd_steady

    load0 = loadavg()
    r = wowd_steady(rate, seconds, delay_ms=delay_ms, drain_s=drain_s, extra_env=extra_env)
    r.update(load_before=load0, load_after=loadavg(), delay_ms=delay_ms)
    return r


def direct_steady(
    rate: float, seconds: float, *, delay_ms: int = 1000, drain_s: float = 30, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The firing path alone at a steady rate: this process inserts ``rate`` timers a second
    straight into the timer table (the store's ``put`` statement), each due ``delay_ms`` after its
    insert, for ``seconds``; one ``wowd run`` fires them."""
    from wowd.stores.embedded.timer_view import put_sql

    load0 = loadavg()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        with daemons(tmp, db, 1, limit=1, extra_env=extra_env) as ds, _progress(db) as progress:
            d = ds[0]
            _, cpu0 = d.stats()
            conn = sqlite3.connect(str(db), timeout=30, isolation_level=None)
            conn.execute("PRAGMA busy_timeout=30000")
            sql = put_sql(BENCH_CONTEXT)
            added = 0
            start = time.monotonic()
            try:
                while (elapsed := time.monotonic() - start) < seconds:
                    want = int(rate * elapsed) - added
                    if want > 0:
                        rows = list(timer_rows(want, due_at=now_ms() + delay_ms, partitions=PARTITIONS, start=added))
                        conn.execute("BEGIN IMMEDIATE")
                        conn.executemany(sql, rows)
                        conn.execute("COMMIT")
                        added += want
                    time.sleep(0.005)
            finally:
                conn.close()
            try:
                wait_until(lambda: progress.outbox() >= added, drain_s + delay_ms / 1000, "outbox", 0.05)
            except TimeoutError:
                pass
            rss, cpu1 = d.stats()
        lags = outbox_lags(db)
    return {
        "rate": rate,
        "offered_per_s": added / seconds,
        "added": added,
        "fired": len(lags),
        **lag_stats(lags).as_dict(),
        "cpu_s": cpu1 - cpu0,
        "peak_rss_mb": rss,
        "delay_ms": delay_ms,
        "load_before": load0,
        "load_after": loadavg(),
    }


@dataclass(frozen=True, kw_only=True)
class E2eConfig:
    """The sizes of the end-to-end section."""

    catch_up_commits: int = 20_000
    catch_up_orders: int = 500
    """The catch-up's second case: its commits over this many orders (several versions each)."""
    scheduled_timers: int = 100_000
    scheduled_commits: int = 1_000
    scheduled_due_in_ms: int = 20_000
    firing_sizes: tuple[int, ...] = (20_000, 100_000)
    """The firing path alone and the bare loop, at these burst sizes."""
    steady_rates: tuple[int, ...] = (1_000, 5_000)
    steady_seconds: float = 20.0
    steady_delay_ms: int = 1_000
    """A steady timer is due this long after its append (or insert)."""


E2E_QUICK = E2eConfig(
    catch_up_commits=2_000,
    scheduled_timers=10_000,
    scheduled_commits=100,
    scheduled_due_in_ms=5_000,
    firing_sizes=(10_000,),
    steady_rates=(200, 1_000),
    steady_seconds=3.0,
)
