"""``wowd timers rebuild`` on the embedded file while a replica runs: pending timers fire once,
nothing that fired or was cancelled fires again, PARKED and FAILED come back where the old view
could be read, the counts match the summary; a rebuild killed leaves the live view as it was."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from tests.daemon.inprocess import wowd_in_process
from tests.daemon.timer_rebuilds import assert_parked_and_failed_kept, outbox_timer_ids, schedule_five_kinds, summary
from tests.factories import CONTEXT, eventually, timer_commit
from tests.processes import Replica, base_env, rebuild_killed_partway
from wowd.model import TimerStatus
from wowd.stores.base import Backend
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = [pytest.mark.anyio, pytest.mark.process]

N = 2000
"""Timers scheduled: a fifth each fired, cancelled, parked, failed and pending at the rebuild."""
SMALL_N = 500
"""Timers scheduled by the tests of a view rebuilt from nothing, in five kinds as for :data:`N`."""
DAY_MS = 86_400_000
TABLE = f"wow_timer__{CONTEXT}"


def _sql(db: Path, statement: str, *params: object) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(db, isolation_level=None, timeout=10)) as conn:
        return conn.execute(statement, params).fetchall()


async def test_rebuild_while_a_replica_runs_fires_pending_once_and_keeps_what_the_log_does_not_hold(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    a = spawn("a", base_env(db, WOWD_LEASE__LIMIT=1))
    await a.wait_ready()
    ids = await schedule_five_kinds(stores, a, park=True, pending_in_ms=2_500, n=N)
    fifth = N // 5

    code, out, err = await wowd_in_process("timers", "rebuild", env=base_env(db))
    assert code == 0, err
    counts = summary(out)
    assert counts["commits"] == N + fifth
    assert (counts["PARKED"], counts["FAILED"], counts["CANCELLED"], counts["expired"]) == (fifth, fifth, fifth, 0)
    # the pending ones are due 2.5 s after they were scheduled: on a slow machine a few may fire first
    assert counts["PENDING"] + counts["DONE"] == 2 * fifth and counts["DONE"] >= fifth
    assert counts["live"] == counts["PENDING"] + 2 * fifth
    assert "swapped in" in out and "rebuild: 0 of" not in out
    # the progress lines count what the log scheduled so far: not "live", a number the summary's
    # live timers (the fired ones known at the end) contradict
    progress = [x for x in out.splitlines() if x.startswith("rebuild: ") and " commits read" in x]
    assert progress and not any("timers live" in x for x in progress)
    so_far = int(re.search(r"(\d+) timers scheduled and not cancelled so far", progress[-1]).group(1))  # type: ignore[union-attr]
    assert so_far >= counts["live"]

    async def pending_fired() -> bool:
        return set(await outbox_timer_ids(stores)) >= ids["pending"]

    await eventually(pending_fired, 20, "every pending timer fired after the rebuild")
    fired = await outbox_timer_ids(stores)
    assert sorted(fired) == sorted(ids["fired"] | ids["pending"])  # once each, nothing else
    assert _sql(db, "SELECT count(*) FROM outbox_redelivery") == [(0,)]  # nothing fired twice
    await assert_parked_and_failed_kept(stores, ids)
    assert a.proc.poll() is None


async def test_rebuild_of_a_dropped_view_keeps_fired_and_cancelled_and_counts_the_expired(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    a = spawn("a", base_env(db, WOWD_LEASE__LIMIT=1))
    await a.wait_ready()
    # the pending ones are due 1.5 s after they were scheduled, after a stopped (a pending one
    # fired before it would be counted DONE below); b cannot fire them from the dropped view
    ids = await schedule_five_kinds(stores, a, park=False, pending_in_ms=1_500, n=SMALL_N)
    # some fired long ago, their outbox entries acknowledged and gone: nothing says they fired
    old = [timer_commit(f"o-old-{i}", 1, [f"k-old-{i}"], due_at=int(time.time() * 1000) - 8 * DAY_MS) for i in range(5)]
    await stores.log.append_many(old)

    async def old_fired() -> bool:
        return await stores.outbox.count() == len(ids["fired"]) + len(old)

    await eventually(old_fired, 20, "the old timers fired")
    _sql(db, f"DELETE FROM outbox WHERE timer_id NOT IN ({', '.join('?' * len(ids['fired']))})", *ids["fired"])
    a.signal(signal.SIGTERM)
    assert await a.wait_exit(10) == 0
    _sql(db, f"DROP TABLE {TABLE}")
    b = spawn("b", base_env(db, WOWD_LEASE__LIMIT=1))  # starts on an empty view
    await b.wait_ready()

    code, out, err = await wowd_in_process("timers", "rebuild", env=base_env(db))
    assert code == 0, err
    counts = summary(out)
    fifth = SMALL_N // 5
    assert counts["expired"] == counts["FAILED"] == len(old)
    assert "expired, state unknown: 5 one-shot timer(s)" in out
    assert counts["DONE"] == fifth and counts["CANCELLED"] == fifth  # from the outbox and the log
    assert counts["PENDING"] == 3 * fifth  # (the parked and failed kinds are due in an hour here)
    assert f"{fifth} one-shot timer(s) found fired in the outbox" in out

    async def pending_fired() -> bool:
        return set(await outbox_timer_ids(stores)) >= ids["pending"]

    await eventually(pending_fired, 20, "the pending timers fired")
    fired = await outbox_timer_ids(stores)
    assert sorted(fired) == sorted(ids["fired"] | ids["pending"])  # once each; no old one, no cancelled one
    assert _sql(db, "SELECT count(*) FROM outbox_redelivery") == [(0,)]
    expired = await stores.timer_queries.scan(status=TimerStatus.FAILED, limit=100)
    assert {t.owner.id for t in expired} == {f"o-old-{i}" for i in range(5)}
    assert all(t.last_error and t.last_error.startswith("expired, state unknown") for t in expired)


async def test_a_rebuild_killed_leaves_the_live_view_and_can_run_again(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    a = spawn("a", base_env(db, WOWD_LEASE__LIMIT=1))
    await a.wait_ready()
    await stores.log.append_many(
        [timer_commit(f"o-{i}", 1, [f"k-{i}"], due_at=int(time.time() * 1000) + 3_600_000) for i in range(N)]
    )

    async def fed() -> bool:
        return len(await stores.timer_queries.scan(limit=100_000)) == N

    await eventually(fed, 20, "fed")
    before = _sql(db, f"SELECT * FROM {TABLE} ORDER BY timer_id")
    await rebuild_killed_partway(base_env(db))
    assert _sql(db, f"SELECT * FROM {TABLE} ORDER BY timer_id") == before
    assert _sql(db, "SELECT count(*) FROM wow_timer_rebuild") == [(1,)]  # its lock, left behind

    code, out, err = await wowd_in_process("timers", "rebuild", "--dry-run", env=base_env(db))
    assert code == 0, err
    assert summary(out)["PENDING"] == N and "dry run: nothing changed" in out
    assert _sql(db, f"SELECT * FROM {TABLE} ORDER BY timer_id") == before
    code, out, err = await wowd_in_process("timers", "rebuild", env=base_env(db))
    assert code == 0, err
    assert summary(out)["PENDING"] == N
    after = _sql(db, f"SELECT * FROM {TABLE} ORDER BY timer_id")
    assert after == before  # the same view, rebuilt
    assert _sql(db, "SELECT name FROM sqlite_schema WHERE name LIKE '%rebuild%' AND type = 'table'") == [
        ("wow_timer_rebuild",)
    ]


async def test_a_second_rebuild_is_refused_naming_the_first(db: Path, stores: Backend) -> None:
    _sql(
        db,
        "CREATE TABLE IF NOT EXISTS wow_timer_rebuild (context TEXT PRIMARY KEY, owner TEXT NOT NULL,"
        " started_at INTEGER NOT NULL, expires_at INTEGER NOT NULL)",
    )
    now = int(time.time() * 1000)
    _sql(db, "INSERT INTO wow_timer_rebuild VALUES (?, 'elsewhere:4242:abcd', ?, ?)", CONTEXT, now, now + 60_000)
    code, out, err = await wowd_in_process("timers", "rebuild", env=base_env(db))
    assert code == 1
    assert "a rebuild of the timer view of context 'demo' runs: lock held by elsewhere:4242:abcd" in err
