"""A replica whose log cannot be read is not ready and says why: ``wowd run`` on a copy of a
``wowd.db`` whose log table has damaged pages holds its slot, reports the slot stalled (``/readyz``
503 naming the slot and the error, ``wowd_feed_stalled{slot="0"}`` 1) within seconds, and never
answers 200 while its feed does nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import anyio
import pytest

from tests.factories import CONTEXT, PARTITIONS, eventually
from tests.processes import Replica, base_env, sample
from tests.sqlite_damage import corrupt_table, settled_copy
from wowd.config import EmbeddedSettings, WowdSettings
from wowd.demo import produce
from wowd.stores.embedded import open_embedded
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.slow]

WITHIN_S = 15.0
"""How soon a replica must say that its slot is stalled, from its start."""
WATCH_S = 1.5
"""How long the stalled replica is watched afterwards."""


async def test_a_replica_on_a_log_with_damaged_pages_is_not_ready_and_names_its_stalled_slot(
    tmp_path: Path, spawn: Callable[..., Replica]
) -> None:
    original = tmp_path / "original.db"  # what ``wowd demo --commits 1000 --timers 200`` appends
    backend = await open_embedded(
        WowdSettings(context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=original))
    )
    try:
        await produce(backend.log, commits=1000, timers=200, due_in_ms=2000, aggregates=100)
    finally:
        await backend.close()
    db = settled_copy(original, tmp_path / "wowd.db")
    corrupt_table(db, "log")
    # the log's first rows do not read; the file's header, the leases and the checkpoints do
    with closing(sqlite3.connect(db)) as conn:
        with pytest.raises(sqlite3.DatabaseError, match="malformed"):
            conn.execute("SELECT doc FROM log ORDER BY seq").fetchall()
        conn.execute("SELECT * FROM cosid_slot").fetchall()
        conn.execute("SELECT * FROM log_checkpoint").fetchall()

    started = time.monotonic()
    replica = spawn("a", base_env(db, WOWD_LEASE__LIMIT=1))
    await replica.wait_port(WITHIN_S)
    answers: list[tuple[int, str]] = []

    async def stalled() -> bool:
        r = await replica.get("/readyz")
        answers.append((r.status_code, r.text))
        return r.status_code == 503 and "slot 0 stalled" in r.text

    await eventually(stalled, WITHIN_S - (time.monotonic() - started), "/readyz 503 naming slot 0 stalled")
    _, why = answers[-1]
    assert "malformed" in why, why  # the reason: the store's own error
    metrics = (await replica.get("/metrics")).text
    assert sample(metrics, "wowd_feed_stalled", {"slot": "0"}) == 1.0
    assert sample(metrics, "wowd_leases_held") == 1.0  # it holds the slot: it is not a standby

    async def gauge_not_ready() -> bool:  # set by the replica's health loop, every 2 s at most
        return sample((await replica.get("/metrics")).text, "wowd_ready") == 0.0

    await eventually(gauge_not_ready, WITHIN_S - (time.monotonic() - started), "wowd_ready 0")

    # stalled is a state: from the first failed read on, never ready while the feed does nothing
    # (the slot is given up only after feed.stall_release_s, 300 s by default)
    first_503 = len(answers) - 1
    with anyio.move_on_after(WATCH_S):
        while True:
            r = await replica.get("/readyz")
            answers.append((r.status_code, r.text))
            held = await replica.get("/readyz?holding=1")
            answers.append((held.status_code, held.text))
            await anyio.sleep(0.1)  # sampling a state over WATCH_S, not waiting for an event
    after = answers[first_503:]
    assert len(after) > 5 and all(code == 503 and "slot 0 stalled" in text for code, text in after), after
    metrics = (await replica.get("/metrics")).text
    assert sample(metrics, "wowd_feed_stalled", {"slot": "0"}) == 1.0
    assert replica.proc.poll() is None, replica.log()
    # one ERROR line for the stall however often it is retried meanwhile
    log = replica.log()
    assert log.count("stalled (retrying)") == 1, log
