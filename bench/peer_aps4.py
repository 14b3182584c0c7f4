"""The peer: APScheduler 4.x (``AsyncScheduler`` with its ``SQLAlchemyDataStore`` on SQLite via
aiosqlite), one ``DateTrigger`` schedule per timer, the task appending to an outbox table.

A standalone script: it runs under another interpreter (APScheduler 4 is a pre-release that
cannot share wowd's virtualenv with APScheduler 3), so it imports nothing from wowd or bench.

    /path/to/aps4-venv/bin/python bench/peer_aps4.py '{"n": 500}'

prints one JSON line like the other workers. The interpreter is taken from
``WOWD_BENCH_APS4_PYTHON`` (default ``/tmp/aps4venv/bin/python``); when it is missing, the
benchmark reports APScheduler 4 as left out.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sqlite3
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_OUTBOX: sqlite3.Connection | None = None
_FIRED = 0
_EXPECTED = -1
_DONE: asyncio.Event | None = None


def _now_ms() -> int:
    return int(time.time() * 1000)


async def fire(timer_id: str, scheduled_at: int) -> None:
    """The task: appends the timer's command to the outbox (one autocommit insert)."""
    global _FIRED
    assert _OUTBOX is not None and _DONE is not None
    _OUTBOX.execute(
        "INSERT OR IGNORE INTO outbox (request_id, scheduled_at, created_at) VALUES (?, ?, ?)",
        (timer_id, scheduled_at, _now_ms()),
    )
    _FIRED += 1
    if _FIRED >= _EXPECTED:
        _DONE.set()


def _pct(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return float(s[min(len(s) - 1, round(q * (len(s) - 1)))])


async def _burst(n: int, timeout_s: float) -> dict[str, Any]:
    global _OUTBOX, _EXPECTED, _DONE
    from apscheduler import AsyncScheduler  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from apscheduler.triggers.date import DateTrigger  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from sqlalchemy.ext.asyncio import create_async_engine

    with tempfile.TemporaryDirectory() as tmp:
        _OUTBOX = sqlite3.connect(str(Path(tmp) / "outbox.db"), isolation_level=None)
        _OUTBOX.execute("PRAGMA journal_mode=WAL")
        _OUTBOX.execute(
            "CREATE TABLE outbox (request_id TEXT PRIMARY KEY, scheduled_at INTEGER NOT NULL,"
            " created_at INTEGER NOT NULL)"
        )
        _EXPECTED = n
        _DONE = asyncio.Event()
        engine = create_async_engine(f"sqlite+aiosqlite:///{Path(tmp) / 'aps.db'}")
        store = SQLAlchemyDataStore(engine)
        async with AsyncScheduler(store) as scheduler:
            due = _now_ms() + 1000 + n * 20
            run_time = datetime.fromtimestamp(due / 1000, UTC)
            for i in range(n):
                await scheduler.add_schedule(fire, DateTrigger(run_time), id=f"t{i}", args=[f"t{i}", due])
            overrun = max(0, _now_ms() - due)
            await asyncio.sleep(max(0.0, (due - _now_ms()) / 1000))
            t = os.times()
            cpu0 = t.user + t.system
            await scheduler.start_in_background()
            try:
                await asyncio.wait_for(_DONE.wait(), timeout_s)
            except TimeoutError:
                pass
            t = os.times()
            cpu = t.user + t.system - cpu0
            fired = _FIRED
            await scheduler.stop()
        lags = [int(r[0]) for r in _OUTBOX.execute("SELECT created_at - scheduled_at FROM outbox")]
        last = _OUTBOX.execute("SELECT max(created_at) FROM outbox").fetchone()[0] or due
        _OUTBOX.close()
        await engine.dispose()
    return {
        "n": n,
        "fired": fired,
        "fired_per_s": fired / max((last - due) / 1000, 1e-3),
        "p50_ms": _pct(lags, 0.5),
        "p99_ms": _pct(lags, 0.99),
        "max_ms": float(max(lags)) if lags else float("nan"),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cpu_s": cpu,
        "add_overrun_ms": overrun,
    }


def main(argv: list[str]) -> int:
    params = json.loads(argv[0]) if argv else {"n": 200}
    result = asyncio.run(_burst(int(params["n"]), float(params.get("timeout_s", 300))))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
