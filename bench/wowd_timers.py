"""wowd's timer side: real ``wowd run`` processes on one SQLite file with the outbox gateway.

- Burst: ``n`` timers put straight into the timer table (the store's own ``put`` statement, by
  this process) all due at one instant after the insert; one process (``limit=1``) or two
  (``limit=2``, each owning half of the partitions). fired/s runs from the due time to the last
  outbox row; lag is each outbox row's ``created_at - scheduled_at``.
- Steady: one process; this process appends commits with ``TimerScheduled`` events to the log
  (the demo producer's commits) at a constant rate, each timer due 1 s after its append; the
  replica feeds them (sink, timers, checkpoints) and fires them.
- Store path (in-process, no daemon): the loop the daemon's timer loop runs, on the real stores
  and the real ``OutboxGateway``: ``claim_due`` (or ``due`` + a claim ``settle`` on a store
  without it) -> ``send_batch`` -> fired ``settle``, with no lease, feed or idle wait; ``fused``:
  the gateway's fast path (``fire_due``, one store call per batch) instead.
"""

from __future__ import annotations

import compileall
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from bench import common
from bench.common import (
    BENCH_CONTEXT,
    REPO,
    cpu_seconds,
    create_timer_tables,
    insert_timer_rows,
    lag_stats,
    now_ms,
    outbox_lags,
    peak_rss_mb,
    proc_stats,
    timer_rows,
)
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["Daemon", "daemons", "run_store_path", "wowd_burst", "wowd_steady"]

PARTITIONS = 64


@dataclass(kw_only=True)
class Daemon:
    """One ``wowd run`` subprocess."""

    name: str
    proc: subprocess.Popen[bytes]
    port_file: Path
    log_file: Path
    port: int = 0
    cpu_mark: float = field(default=0.0)

    def ready(self) -> bool:
        """``/readyz`` answers 200 (holds a lease and its stores answer)."""
        if not self.port:
            try:
                self.port = int(self.port_file.read_text().strip())
            except (OSError, ValueError):
                return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz?holding=1", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stats(self) -> tuple[float, float]:
        return proc_stats(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def daemon_env(
    db: Path, *, limit: int, ttl_s: float = 10.0, owner_key: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WOWD_")}
    env.update(
        {
            "WOWD_CONTEXT": BENCH_CONTEXT,
            "WOWD_PARTITIONS": str(PARTITIONS),
            "WOWD_EMBEDDED__PATH": str(db),
            "WOWD_HTTP__HOST": "127.0.0.1",
            "WOWD_HTTP__PORT": "0",
            "WOWD_LEASE__LIMIT": str(limit),
            "WOWD_LEASE__TTL_S": str(ttl_s),
            "WOWD_LEASE__TOLERANCE_S": str(min(1.0, ttl_s / 5)),
            "WOWD_LEASE__OWNER_KEY": owner_key,
            "WOWD_GATEWAY__KIND": "outbox",
            "WOWD_LOG_LEVEL": "WARNING",
            "WOWD_LOG_FORMAT": "text",
            "WOWD_SHUTDOWN__GRACE_S": "2",
            "PYTHONPATH": str(code_dir()),
        }
    )
    env.update(extra or {})
    return env


def code_dir() -> Path:
    """The checkout whose wowd the measured processes run: ``WOWD_BENCH_CODE`` (another checkout,
    :mod:`bench.interleave`), else this one."""
    return Path(os.environ.get("WOWD_BENCH_CODE") or REPO)


@functools.cache
def _byte_compiled(code: Path) -> None:
    """Byte-compiles a checkout's wowd modules once, as installing the package does: a replica
    started from a checkout without current bytecode (``PYTHONDONTWRITEBYTECODE``, or a module
    changed since) compiles them at every start, a cost an installed wowd does not pay."""
    compileall.compile_dir(code / "wowd", quiet=1)


def wowd_command() -> list[str]:
    _byte_compiled(code_dir())
    return [sys.executable, "-m", "wowd"]


def start_daemon(
    tmp: Path, db: Path, name: str, *, limit: int, ttl_s: float = 10.0, extra_env: dict[str, str] | None = None
) -> Daemon:
    port_file = tmp / f"{name}.port"
    log_file = tmp / f"{name}.log"
    with log_file.open("wb") as out:
        proc = common.POPEN(
            [*wowd_command(), "run", "--port-file", str(port_file)],
            env=daemon_env(db, limit=limit, ttl_s=ttl_s, owner_key=name, extra=extra_env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(tmp),
        )
    return Daemon(name=name, proc=proc, port_file=port_file, log_file=log_file)


def wait_until(predicate: Any, timeout_s: float, what: str, every_s: float = 0.02) -> float:
    """Polls ``predicate`` (a measurement loop, not a test); answers when it held (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def stop_daemon(d: Daemon, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
    if d.proc.poll() is None:
        d.proc.send_signal(sig)
        try:
            d.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(5)


@contextmanager
def daemons(
    tmp: Path,
    db: Path,
    count: int,
    *,
    limit: int,
    ttl_s: float = 10.0,
    ready: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[list[Daemon]]:
    """Starts ``count`` replicas (``extra_env``: settings over the outbox defaults); waits until
    ``ready`` of them (default: ``min(count, limit)``) hold a lease; stops them all (SIGTERM) on
    exit."""
    ds: list[Daemon] = []
    try:
        for i in range(count):
            ds.append(start_daemon(tmp, db, f"bench-{i}", limit=limit, ttl_s=ttl_s, extra_env=extra_env))
            # one at a time: the holder is the first one, the standby the second
            if i < (ready if ready is not None else min(count, limit)):
                wait_until(lambda d=ds[-1]: d.ready() or not d.alive(), 60, f"{ds[-1].name} ready")
            else:
                wait_until(lambda d=ds[-1]: d.port_file.exists() or not d.alive(), 60, f"{ds[-1].name} up")
            if not ds[-1].alive():
                raise RuntimeError(f"{ds[-1].name} exited: {ds[-1].log_tail()}")
        yield ds
    finally:
        for d in ds:
            stop_daemon(d)


def _outbox_count(db: Path) -> int:
    conn = sqlite3.connect(str(db), timeout=30)
    try:
        row = conn.execute("SELECT count(*) FROM outbox").fetchone()
        return int(row[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()


def _outbox_span(db: Path) -> tuple[int, int]:
    conn = sqlite3.connect(str(db), timeout=30)
    try:
        first, last = conn.execute("SELECT min(created_at), max(created_at) FROM outbox").fetchone()
        return int(first or 0), int(last or 0)
    finally:
        conn.close()


def _sum_stats(ds: Sequence[Daemon]) -> tuple[float, float]:
    rss = cpu = 0.0
    for d in ds:
        r, c = d.stats()
        rss += r
        cpu += c
    return rss, cpu


def wowd_burst(
    n: int,
    processes: int,
    *,
    timeout_s: float = 600,
    extra_env: dict[str, str] | None = None,
    lead_ms: int = 300,
) -> dict[str, Any]:
    """``n`` timers due at once, ``lead_ms`` (and 1 ms per 40 timers) after their insert began,
    fired by ``processes`` replicas (``limit = processes``; ``extra_env``: settings over the
    defaults, e.g. ``WOWD_OUTBOX__FAST_PATH=false``)."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        with daemons(tmp, db, processes, limit=processes, extra_env=extra_env) as ds:
            due = now_ms() + lead_ms + n // 40
            insert_timer_rows(db, timer_rows(n, due_at=due, partitions=PARTITIONS))
            overrun = max(0, now_ms() - due)
            wait_until(lambda: now_ms() >= due, 60, "due time", every_s=0.001)
            _, cpu0 = _sum_stats(ds)
            wait_until(lambda: _outbox_count(db) >= n or not all(d.alive() for d in ds), timeout_s, "outbox", 0.05)
            rss, cpu1 = _sum_stats(ds)
            dead = [d.name for d in ds if not d.alive()]
            if dead:
                raise RuntimeError(f"replicas {dead} exited: {ds[0].log_tail()}")
        lags = outbox_lags(db)
        first, last = _outbox_span(db)
    return {
        "n": n,
        "processes": processes,
        "fired": len(lags),
        "fired_per_s": len(lags) / max((last - due) / 1000, 1e-3),
        "drain_per_s": len(lags) / max((last - first) / 1000, 1e-3),
        **lag_stats(lags).as_dict(),
        "peak_rss_mb": rss,
        "cpu_s": cpu1 - cpu0,
        "insert_overrun_ms": overrun,
    }


def wowd_steady(
    rate: float, seconds: float, *, delay_ms: int = 1000, drain_s: float = 30, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One replica (``extra_env``: settings over the outbox defaults); this process appends
    ``rate`` commits a second, each scheduling one timer due ``delay_ms`` after its append, for
    ``seconds``."""
    from wowd.demo import demo_commits
    from wowd.stores.embedded.log import EmbeddedLog

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        with daemons(tmp, db, 1, limit=1, extra_env=extra_env) as ds:

            async def produce() -> int:
                log = EmbeddedLog(db, context=BENCH_CONTEXT, partitions=PARTITIONS)
                await log.prepare()
                added = tick = 0
                start = time.monotonic()
                try:
                    while (elapsed := time.monotonic() - start) < seconds:
                        want = int(rate * elapsed) - added
                        if want > 0:
                            commits, _ = demo_commits(
                                BENCH_CONTEXT,
                                commits=want,
                                timers=want,
                                due_in_ms=delay_ms,
                                aggregates=want,
                                run_id=f"s{tick}",
                            )
                            await log.append_many(commits)
                            added += want
                            tick += 1
                        await anyio.sleep(0.005)
                finally:
                    await log.close()
                return added

            _, cpu0 = _sum_stats(ds)
            added = anyio.run(produce)
            try:
                wait_until(lambda: _outbox_count(db) >= added, drain_s + delay_ms / 1000, "outbox", 0.05)
            except TimeoutError:
                pass
            rss, cpu1 = _sum_stats(ds)
        lags = outbox_lags(db)
    return {
        "rate": rate,
        "offered_per_s": added / seconds,
        "added": added,
        "fired": len(lags),
        **lag_stats(lags).as_dict(),
        "cpu_s": cpu1 - cpu0,
        "peak_rss_mb": rss,
    }


# --------------------------------------------------------------------------- the store path


async def _store_path(n: int, batch: int, fused: bool = False) -> dict[str, Any]:
    from tests.timer_stores import embedded_timers
    from wowd.daemon.timer_plan import next_occurrence
    from wowd.delivery import Delivered, OutboxGateway
    from wowd.model import Timer, TimerChange
    from wowd.stores.base import OutboxRound
    from wowd.stores.embedded.db import SqliteDatabase
    from wowd.stores.embedded.outbox import EmbeddedOutbox

    with tempfile.TemporaryDirectory() as t:
        db_path = Path(t) / "wowd.db"
        create_timer_tables(db_path)
        db = SqliteDatabase(db_path)
        store = embedded_timers(db, context=BENCH_CONTEXT, partitions=PARTITIONS)
        outbox = EmbeddedOutbox(db)
        await store.prepare()
        await outbox.prepare()
        gateway = OutboxGateway(outbox)
        due = now_ms() + 300 + n // 40
        insert_timer_rows(db_path, timer_rows(n, due_at=due, partitions=PARTITIONS))
        await anyio.sleep(max(0.0, (due - now_ms()) / 1000))
        parts = frozenset(range(PARTITIONS))
        claim_due = getattr(store, "claim_due", None)
        cpu0 = cpu_seconds()
        start = time.perf_counter()
        fired = 0
        while fused:  # the outbox shortcut: fire and settle in one store call
            now = now_ms()
            done = await store.firing.fire_into_outbox(
                OutboxRound(
                    partitions=frozenset(parts), at=now, read_to=now, limit=batch, owner_key="bench", fence=1,
                    next_due=next_occurrence,
                )
            )  # fmt: skip
            if not done.fired:
                break
            fired += len(done.fired)
        while not fused:
            now = now_ms()
            claimed: list[Timer]
            if claim_due is not None:  # what the daemon's loop calls when the store has it
                claimed = await claim_due(parts, now, batch, owner_key="bench", fence=1, claim_until=now + 30_000)
            else:
                timers = await store.firing.due(parts, now, batch)
                claims = [TimerChange.claim(x, owner_key="bench", fence=1, until=now + 30_000) for x in timers]
                await store.firing.settle(claims)
                claimed = [c for ch in claims if (c := ch.applied()) is not None]
            if not claimed:
                break
            outcome = await gateway.send_batch(claimed)
            settled = [TimerChange.fired(x, fence=1, next_due=None) for x in claimed if isinstance(outcome, Delivered)]
            await store.firing.settle(settled)
            fired += len(settled)
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds() - cpu0
        await store.close()
        await outbox.close()
        db.close()
        lags = outbox_lags(db_path)
    return {
        "n": n,
        "fired": fired,
        "fired_per_s": fired / elapsed,
        **lag_stats(lags).as_dict(),
        "peak_rss_mb": peak_rss_mb(),
        "cpu_s": cpu,
    }


def run_store_path(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: the daemon's firing path in-process on the real stores (no leases, no idle wait);
    ``fused``: the outbox shortcut (``fire_into_outbox``) instead of claim, deliver, settle."""
    return anyio.run(_store_path, int(params["n"]), int(params.get("batch", 1000)), bool(params.get("fused", False)))
