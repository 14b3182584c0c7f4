"""Failover: two ``wowd run`` processes on one SQLite file, ``limit=1`` (a holder and a standby).
Timers come due every 20 ms; the holder is killed with SIGKILL; measured is the time from the
kill to the first outbox row written by the standby (its owner key), for each lease ttl.

The bound: ttl + ttl/3 (the standby's acquire retry is at most a renew interval)
+ one poll interval of the timer loop (``MAX_IDLE_S``).
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from typing import Any

from bench.common import create_timer_tables, insert_timer_rows, now_ms, timer_rows
from bench.wowd_timers import PARTITIONS, daemons, wait_until
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["failover_once"]

EVERY_MS = 20


def _first_fire_by(db: Path, owner_key: str) -> int | None:
    conn = sqlite3.connect(str(db), timeout=30)
    try:
        row = conn.execute("SELECT min(created_at) FROM outbox WHERE owner_key = ?", (owner_key,)).fetchone()
        return int(row[0]) if row and row[0] is not None else None
    except sqlite3.OperationalError:
        return None
    finally:
        conn.close()


def failover_once(ttl_s: float, *, warm_s: float = 1.0) -> dict[str, Any]:
    """One kill; answers the failover time (ms) and the bound."""
    from wowd.daemon.timers import MAX_IDLE_S

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        with daemons(tmp, db, 2, limit=1, ttl_s=ttl_s, ready=1) as (holder, standby):
            start = now_ms() + 300
            span_ms = int((warm_s + ttl_s * 3 + 10) * 1000)
            count = span_ms // EVERY_MS
            insert_timer_rows(db, timer_rows(count, due_at=lambda i: start + i * EVERY_MS, partitions=PARTITIONS))
            wait_until(lambda: _first_fire_by(db, holder.name) is not None, 30, "the holder's first fire")
            wait_until(lambda: now_ms() >= start + warm_s * 1000, 30, "warm-up", every_s=0.005)
            killed = now_ms()
            holder.proc.send_signal(signal.SIGKILL)
            holder.proc.wait(10)
            wait_until(
                lambda: _first_fire_by(db, standby.name) is not None or not standby.alive(),
                ttl_s * 3 + 20,
                "the standby's first fire",
                every_s=0.02,
            )
            first = _first_fire_by(db, standby.name)
            if first is None:
                raise RuntimeError(f"the standby exited: {standby.log_tail()}")
    failover = first - killed
    bound = (ttl_s + ttl_s / 3 + MAX_IDLE_S) * 1000
    return {"ttl_s": ttl_s, "failover_ms": failover, "bound_ms": bound, "within": failover <= bound}
