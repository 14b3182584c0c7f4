"""The peer: APScheduler 3.x, ``AsyncIOScheduler`` with a ``SQLAlchemyJobStore`` on SQLite, one
``date`` job per timer, the job appending a row to an outbox table (SQLite, WAL).

With ``wal`` (the default here) the job store's SQLite file gets the pragmas wowd's embedded
store uses (WAL, ``synchronous=NORMAL``), so the peer is not slowed by a rollback journal and an
fsync per job; ``wal=False`` is APScheduler's out-of-the-box ``sqlite:///`` URL. The outbox file
is WAL in both. ``misfire_grace_time=None``: a job fired late still
runs (APScheduler's default of 1 s would skip most of a burst as missed).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler  # type: ignore[import-untyped]
from sqlalchemy import create_engine, event

from bench.common import cpu_seconds, lag_stats, now_ms, peak_rss_mb

__all__ = ["fire", "run_burst", "run_steady"]

ADD_MS_PER_JOB = {True: 0.5, False: 2.5}
"""A generous estimate of one ``add_job`` (insert + commit; WAL or not), to place the burst after
the adds (``add_overrun_ms`` reports when it was not enough)."""


@dataclass
class _State:
    outbox: sqlite3.Connection | None = None
    fired: int = 0
    expected: int = -1
    done: asyncio.Event = field(default_factory=asyncio.Event)


_STATE = _State()


async def fire(timer_id: str, scheduled_at: int) -> None:
    """The job: appends the timer's command to the outbox (one autocommit insert)."""
    conn = _STATE.outbox
    assert conn is not None
    conn.execute(
        "INSERT INTO outbox (request_id, scheduled_at, created_at) VALUES (?, ?, ?)",
        (timer_id, scheduled_at, now_ms()),
    )
    _STATE.fired += 1
    if _STATE.fired == _STATE.expected:
        _STATE.done.set()


def _pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _scheduler(tmp: Path, wal: bool) -> AsyncIOScheduler:
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore  # type: ignore[import-untyped]

    engine = create_engine(f"sqlite:///{tmp / 'jobs.db'}")
    if wal:
        event.listen(engine, "connect", _pragmas)
    outbox = sqlite3.connect(str(tmp / "outbox.db"), isolation_level=None, check_same_thread=False)
    outbox.execute("PRAGMA journal_mode=WAL")
    outbox.execute("PRAGMA synchronous=NORMAL")
    outbox.execute(
        "CREATE TABLE IF NOT EXISTS outbox (request_id TEXT PRIMARY KEY, scheduled_at INTEGER NOT NULL,"
        " created_at INTEGER NOT NULL)"
    )
    _STATE.outbox = outbox
    _STATE.fired = 0
    _STATE.done = asyncio.Event()
    return AsyncIOScheduler(
        jobstores={"default": SQLAlchemyJobStore(engine=engine)},
        job_defaults={"misfire_grace_time": None, "coalesce": False, "max_instances": 1},
        timezone=UTC,
    )


def _lags() -> list[int]:
    assert _STATE.outbox is not None
    return [int(r[0]) for r in _STATE.outbox.execute("SELECT created_at - scheduled_at FROM outbox")]


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


async def _burst(n: int, timeout_s: float, wal: bool, lead_ms: int = 500) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sched = _scheduler(Path(tmp), wal)
        _STATE.expected = n
        sched.start(paused=True)
        due = now_ms() + lead_ms + int(n * ADD_MS_PER_JOB[wal])
        for i in range(n):
            sched.add_job(fire, "date", run_date=_dt(due), args=[f"t{i}", due], id=f"t{i}")
        overrun = max(0, now_ms() - due)
        await asyncio.sleep(max(0.0, (due - now_ms()) / 1000))
        cpu0 = cpu_seconds()
        sched.resume()
        try:
            await asyncio.wait_for(_STATE.done.wait(), timeout_s)
        except TimeoutError:
            pass
        cpu = cpu_seconds() - cpu0
        fired = _STATE.fired
        sched.shutdown(wait=False)
        lags = _lags()
        assert _STATE.outbox is not None
        first, last = _STATE.outbox.execute("SELECT min(created_at), max(created_at) FROM outbox").fetchone()
        _STATE.outbox.close()
    stats = lag_stats(lags)
    span_s = max((last - due) / 1000, 1e-3) if fired else float("nan")
    return {
        "n": n,
        "fired": fired,
        "fired_per_s": fired / span_s,
        "drain_per_s": fired / max((last - first) / 1000, 1e-3) if fired else float("nan"),
        **stats.as_dict(),
        "peak_rss_mb": peak_rss_mb(),
        "cpu_s": cpu,
        "add_overrun_ms": overrun,
    }


def run_burst(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: ``n`` date jobs all due at one instant, ``lead_ms`` (default 500) and the adds'
    estimate after the start; fired/s from the due time to the last fire."""
    return asyncio.run(
        _burst(
            int(params["n"]),
            float(params.get("timeout_s", 600)),
            bool(params.get("wal", True)),
            int(params.get("lead_ms", 500)),
        )
    )


async def _steady(rate: float, seconds: float, delay_ms: int, drain_s: float, wal: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sched = _scheduler(Path(tmp), wal)
        sched.start()
        added = 0
        start = time.monotonic()
        cpu0 = cpu_seconds()
        while (elapsed := time.monotonic() - start) < seconds:
            want = int(rate * elapsed)
            now = now_ms()
            while added < want:
                due = now + delay_ms
                sched.add_job(fire, "date", run_date=_dt(due), args=[f"t{added}", due], id=f"t{added}")
                added += 1
            await asyncio.sleep(0.005)
        offered = added / seconds
        _STATE.expected = added
        if _STATE.fired < added:
            try:
                await asyncio.wait_for(_STATE.done.wait(), drain_s + delay_ms / 1000)
            except TimeoutError:
                pass
        cpu = cpu_seconds() - cpu0
        fired = _STATE.fired
        sched.shutdown(wait=False)
        lags = _lags()
        assert _STATE.outbox is not None
        _STATE.outbox.close()
    return {
        "rate": rate,
        "offered_per_s": offered,
        "added": added,
        "fired": fired,
        **lag_stats(lags).as_dict(),
        "cpu_s": cpu,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_steady(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: ``rate`` new jobs a second, each due ``delay_ms`` later, for ``seconds``; lag of each
    fire; jobs not fired ``drain_s`` after the last add are reported as not fired."""
    return asyncio.run(
        _steady(
            float(params["rate"]),
            float(params.get("seconds", 60)),
            int(params.get("delay_ms", 1000)),
            float(params.get("drain_s", 30)),
            bool(params.get("wal", True)),
        )
    )


if __name__ == "__main__":
    import sys

    print(json.dumps(run_burst(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"n": 1000})))
