"""``wowd backup`` of the embedded file while a replica fires timers: the copy is sound and a
replica started on it fires what was pending when it was taken."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import aclosing, closing
from pathlib import Path

import anyio
import pytest

from tests.daemon.inprocess import wowd_in_process
from tests.factories import CONTEXT, PARTITIONS, eventually, timer_commit
from tests.processes import Replica, base_env, run_wowd
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.model import deterministic_timer_id, request_id_for
from wowd.stores.base import Backend
from wowd.stores.embedded import open_embedded
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = [pytest.mark.anyio, pytest.mark.process]


async def _scheduled_request_ids(b: Backend) -> set[str]:
    """The request id of every timer the log of ``b`` schedules (each one-shot, fired once)."""
    found: set[str] = set()
    reader = b.log.read({p: None for p in range(PARTITIONS)}, batch_size=500, follow=False)
    async with aclosing(reader) as batches:  # type: ignore[type-var]
        async for batch in batches:
            for e in batch.entries:
                c = e.commit
                assert c is not None
                for ev in c.events:
                    if ev.name == "TimerScheduled":
                        tid = deterministic_timer_id(c.ref, ev.body["key"], c.version)
                        found.add(request_id_for(tid, ev.body["due_at"]))
    return found


async def _outbox_ids(b: Backend) -> list[str]:
    return [e.request_id for e in await b.outbox.entries(limit=100_000)]


async def test_backup_under_load_is_sound_and_a_replica_on_it_fires_what_was_pending(
    spawn: Callable[..., Replica], db: Path, stores: Backend, tmp_path: Path
) -> None:
    # a's lease, copied with the file, has lapsed by the time the replica on the copy first tries it
    lease = {"WOWD_LEASE__LIMIT": 1, "WOWD_LEASE__TTL_S": 1, "WOWD_LEASE__TOLERANCE_S": 0.25}
    env = base_env(db, **lease)
    a = spawn("a", env)
    await a.wait_ready()
    appended = 0
    stop = anyio.Event()

    async def load() -> None:
        # a commit every few ms, its timers due from now to 1 s from now: some fire before the
        # copy, some are pending in it, some are in its log and not yet fed
        nonlocal appended
        while not stop.is_set():
            now = int(time.time() * 1000)
            due = now + (appended % 5) * 250
            await stores.log.append_many([timer_commit(f"o-{appended}", 1, [f"k-{appended}"], due_at=due)])
            appended += 1
            await anyio.sleep(0.005)

    copy = tmp_path / "copy.db"
    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await eventually(lambda: _fired_some(stores), 10, "the replica fires timers")
        code, out, err = await run_wowd("backup", str(copy), "--step-pages", "4", env=env)
        stop.set()
    assert code == 0, err
    assert "integrity_check ok" in out and "pages copied (100%)" in out
    assert not await anyio.Path(f"{copy}.partial").exists()
    with closing(sqlite3.connect(copy)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]

    settings = WowdSettings(
        context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=copy), lease=LeaseSettings(limit=1)
    )
    restored = await open_embedded(settings)
    try:
        pending = [
            t for t in await restored.timer_queries.scan(limit=100_000) if t.status.value in ("PENDING", "FIRING")
        ]
        expected = await _scheduled_request_ids(restored)
        fired_before = set(await _outbox_ids(restored))
        assert pending, "the copy holds pending timers"
        assert fired_before and fired_before < expected
        assert appended > len(expected)  # the load went on after the copy's snapshot
        b = spawn("b", base_env(copy, **lease))
        await b.wait_ready()

        async def all_fired() -> bool:
            return set(await _outbox_ids(restored)) >= expected

        await eventually(all_fired, 20, "every timer of the copy's log fired on the copy")
        ids = await _outbox_ids(restored)
        assert len(ids) == len(set(ids)) == len(expected)
    finally:
        await restored.close()


async def _fired_some(b: Backend) -> bool:
    return await b.outbox.count() >= 20


async def test_backup_refuses_mongo_and_an_existing_path(db: Path, tmp_path: Path, stores: Backend) -> None:
    env = base_env(db)
    existing = tmp_path / "there.db"
    existing.write_bytes(b"")
    code, _out, err = await wowd_in_process("backup", str(existing), env=env)
    assert code == 2 and "exists" in err and "--force" in err
    mongo = {**env, "WOWD_BACKEND": "mongo", "WOWD_ELASTICSEARCH__URL": "http://127.0.0.1:1"}
    code, _out, err = await wowd_in_process("backup", str(tmp_path / "m.db"), env=mongo)
    assert code == 2 and "mongodump" in err


async def test_backup_never_writes_over_the_database_or_its_wal_and_refuses_a_directory(
    db: Path, tmp_path: Path, stores: Backend
) -> None:
    """``--force`` or not, a PATH that is the database, its ``-wal`` or ``-shm`` (by name, through
    a symlink or a hard link) is refused and the live files stay as they are; a directory is
    refused without a traceback or a ``PATH.partial`` left behind."""
    env = base_env(db)
    live = (db, Path(f"{db}-wal"), Path(f"{db}-shm"))  # ``stores`` holds the file open: all three exist
    inodes = _inodes(live)
    (tmp_path / "wal-link").symlink_to(live[1])
    os.link(db, tmp_path / "db-hardlink")
    for path in (live[1], live[2], db, tmp_path / "wal-link", tmp_path / "db-hardlink"):
        code, _out, err = await wowd_in_process("backup", str(path), "--force", env=env)
        assert code == 2 and "never writes over the database" in err and "Traceback" not in err, (path, err)
    assert _inodes(live) == inodes
    await stores.log.ping()  # the database still reads
    assert await stores.checkpoints.read("timers", [0]) is not None
    folder = tmp_path / "backups"
    folder.mkdir()
    code, _out, err = await wowd_in_process("backup", str(folder), "--force", env=env)
    assert code == 2 and "is a directory" in err and "Traceback" not in err, err
    assert _listing(tmp_path, "*.partial*") == [] and _listing(folder, "*") == []


def _inodes(paths: tuple[Path, ...]) -> dict[Path, int]:
    return {p: p.stat().st_ino for p in paths}


def _listing(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern))
