"""A full disk stalls a replica; it does not end it. ``wowd run`` on an embedded file on a small
tmpfs, with timers coming due: once a filler file takes the file system's last byte, the process
keeps running, ``/readyz`` answers 503 naming the full disk from then on and
``wowd_timers_stalled{slot="0"}`` is 1, while the timers due wait; once the filler is deleted it is
ready again by itself and every timer is in the outbox exactly once. With a lease ttl longer than
the stall the slot is held throughout (its timer loop's stall); with a short one the lease lapses
(its renewals fail) and the slot is taken back once space returns.

Mounting a tmpfs needs root (CAP_SYS_ADMIN): without it the test is skipped, and fails instead
with ``WOWD_TEST_REQUIRE_TMPFS=1`` (``.ci/run`` sets it where it can mount one)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from pathlib import Path

import anyio
import httpx
import pytest

from tests.factories import CONTEXT, PARTITIONS, eventually, timer_commit
from tests.processes import Replica, base_env, sample
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.model import deterministic_timer_id, request_id_for
from wowd.stores.base import Backend
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.slow]

REQUIRE = os.environ.get("WOWD_TEST_REQUIRE_TMPFS") == "1"
DISK_SIZE = "24m"
TIMERS = 300
DUE_FROM_MS = 2000
"""The first timer is due this long after the commits are appended (the disk is full by then)."""
DUE_SPREAD_MS = 600
"""The timers are due over this long: some are still due after the first write failed."""
WATCH_MS = 600
"""How long the stalled replica is watched after the last timer came due: the disk is full for
longer than a lease of 2 s is valid (the lease-lapses variant's lease lapses meanwhile)."""


VARIANTS = {"lease-held": (30, True), "lease-held-claims": (30, False), "lease-lapses": (2, True)}
"""Each variant's lease ttl (s) and whether the outbox's fast path fires (else claims)."""


@contextlib.contextmanager
def small_disk(disk: Path) -> Iterator[Path]:
    """A tmpfs of :data:`DISK_SIZE` mounted at ``disk``, unmounted afterwards."""
    disk.mkdir()
    try:
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(disk)], capture_output=True, text=True
        )
        error = mount.stderr.strip() if mount.returncode != 0 else None
    except OSError as exc:  # no mount command
        error = str(exc)
    if error is not None:
        why = f"cannot mount a tmpfs (root with CAP_SYS_ADMIN needed): {error}"
        if REQUIRE:
            pytest.fail(f"{why} (WOWD_TEST_REQUIRE_TMPFS=1)")
        pytest.skip(why)
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(disk)], check=False)


@pytest.fixture
def small_disks(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A small tmpfs for each of :data:`VARIANTS`, at ``tmp_path/NAME``."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(small_disk(tmp_path / name)) for name in VARIANTS}


@contextlib.asynccontextmanager
async def opened(db: Path) -> AsyncIterator[Backend]:
    """The test's own view of the embedded file ``db``."""
    from wowd.stores.embedded import open_embedded

    settings = WowdSettings(
        context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=db), lease=LeaseSettings(limit=1)
    )
    backend = await open_embedded(settings)
    try:
        yield backend
    finally:
        await backend.close()


def fill(path: Path) -> int:
    """Writes ``path`` until its file system has no byte left; answers the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    written = 0
    size = 1 << 20
    try:
        while size:
            try:
                written += os.write(fd, b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2
    finally:
        os.close(fd)
    return written


def truncate_wal(db: Path) -> None:
    """Checkpoints the whole WAL into the file and truncates it, so that the next writes need new
    space (a WAL keeps its size and is written over from its start after a checkpoint)."""
    with closing(sqlite3.connect(db, timeout=10)) as conn:
        deadline = time.monotonic() + 10
        while True:
            busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            assert time.monotonic() < deadline, "the WAL was not checkpointed within 10 s"
            time.sleep(0.01)  # a poll: the replica's reader of an older snapshot is done soon


def fill_with_no_wal(db: Path, filler: Path) -> None:
    """Fills the disk of ``db`` with its WAL truncated to nothing, so that every write of the
    replica needs space it does not get. A write the replica made between the truncation and the
    end of the filling grew the WAL again, and the frames of a grown WAL are reused after a
    checkpoint (a lease renewal would then fit): the filler is removed and both done again."""
    wal = db.with_name(db.name + "-wal")
    for _ in range(20):
        truncate_wal(db)
        assert fill(filler) > 0
        if not wal.exists() or wal.stat().st_size == 0:
            return
        filler.unlink()
    raise AssertionError("the replica wrote to its WAL during each of 20 fillings")


async def get(replica: Replica, path: str) -> httpx.Response:
    """``replica.get(path)``; when nothing answers, the replica's exit is the failure."""
    try:
        return await replica.get(path)
    except httpx.TransportError:
        with contextlib.suppress(AssertionError):
            await replica.wait_exit(5)
        assert replica.proc.poll() is None, f"the replica exited: {replica.log()[-3000:]}"
        raise


async def test_a_full_disk_stalls_the_timer_loop_and_it_resumes_when_space_returns(
    small_disks: dict[str, Path], spawn: Callable[..., Replica]
) -> None:
    """Each of :data:`VARIANTS` side by side, a replica on a disk of its own (they wait for the
    same seconds: their timers coming due and their stalls)."""
    async with anyio.create_task_group() as tg:
        for name, (ttl_s, fast_path) in VARIANTS.items():
            tg.start_soon(stalls_and_resumes, name, small_disks[name], spawn, ttl_s, fast_path)


async def stalls_and_resumes(name: str, disk: Path, spawn: Callable[..., Replica], ttl_s: int, fast_path: bool) -> None:
    """One variant: ``ttl_s``, the lease ttl; ``fast_path``: the outbox's fast path (fired in one
    transaction) or claims (claimed, delivered, settled; a claim the full disk left unsettled
    expires after 2 s). A failure names the variant."""
    db = disk / "wowd.db"
    env = base_env(db, WOWD_LEASE__LIMIT=1, WOWD_LEASE__TTL_S=ttl_s, WOWD_OUTBOX__FAST_PATH=str(fast_path).lower())
    replica = spawn(name, {**env, "WOWD_TIMERS__CLAIM_TTL_S": "2"})
    try:
        async with opened(db) as stores:
            await replica.wait_ready()
            await stalls_and_resumes_on(replica, stores, disk, ttl_s)
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from exc


async def stalls_and_resumes_on(replica: Replica, stores: Backend, disk: Path, ttl_s: int) -> None:
    """The variant of ``replica`` on the embedded file ``disk/wowd.db`` (``stores``, the test's
    view of it) after the replica is ready."""
    db = disk / "wowd.db"

    start = int(time.time() * 1000) + DUE_FROM_MS
    commits = [
        timer_commit(f"order-{i}", 1, [f"k-{i}"], due_at=start + i * DUE_SPREAD_MS // TIMERS) for i in range(TIMERS)
    ]
    expected = {
        request_id_for(deterministic_timer_id(c.ref, e.body["key"], c.version), e.body["due_at"])
        for c in commits
        for e in c.events
        if e.name == "TimerScheduled"
    }
    await stores.log.append_many(commits)

    async def fed() -> bool:  # in the timer view before the disk is full
        text = (await get(replica, "/metrics")).text
        return sample(text, "wowd_feed_commits_total", {"aggregate": "order"}) == TIMERS

    await eventually(fed, DUE_FROM_MS / 1000, "the commits fed")
    filler = disk / "filler"
    fill_with_no_wal(db, filler)
    assert time.time() * 1000 < start, "the disk was filled after the first timer came due"

    answers: list[tuple[int, str]] = []

    async def stalled() -> bool:
        r = await get(replica, "/readyz")
        answers.append((r.status_code, r.text))
        gauge = sample((await get(replica, "/metrics")).text, "wowd_timers_stalled", {"slot": "0"})
        return r.status_code == 503 and "database or disk is full" in r.text and gauge == 1.0

    await eventually(stalled, DUE_FROM_MS / 1000 + 15, "/readyz 503 naming the full disk, wowd_timers_stalled 1")

    async def all_due() -> bool:  # those not fired wait; the replica stays up and not ready
        r = await get(replica, "/readyz")
        answers.append((r.status_code, r.text))
        return time.time() * 1000 > start + DUE_SPREAD_MS + WATCH_MS

    await eventually(all_due, DUE_SPREAD_MS / 1000 + 5, "every timer due")
    assert await stores.outbox.count() < TIMERS  # they waited for the disk
    first_503 = next(i for i, (code, _text) in enumerate(answers) if code == 503)
    # not ready from the first refused write on, while the disk is full
    other = [(i, code, text) for i, (code, text) in enumerate(answers[first_503:], first_503)
             if not (code == 503 and "database or disk is full" in text)]  # fmt: skip
    assert not other, f"{len(answers)} answers, the first 503 at {first_503}; others after it: {other[:3]}"
    if ttl_s > 2:
        assert any("timer loop: timer round: StorageFull" in text for _code, text in answers), answers
    metrics = (await get(replica, "/metrics")).text
    assert sample(metrics, "wowd_timers_stalled", {"slot": "0"}) == 1.0

    filler.unlink()

    async def resumed() -> bool:
        ready = (await get(replica, "/readyz?holding=1")).status_code == 200
        return ready and await stores.outbox.count() >= TIMERS

    await eventually(resumed, 30, "ready again and every timer fired")
    entries = await stores.outbox.entries(limit=10 * TIMERS)
    assert len(entries) == TIMERS and {e.request_id for e in entries} == expected  # none lost, none twice
    metrics = (await get(replica, "/metrics")).text
    assert sample(metrics, "wowd_timers_stalled", {"slot": "0"}) == 0.0
    assert sample(metrics, "wowd_timers_fired_total", {"target": f"{CONTEXT}.order"}) == TIMERS

    replica.signal(signal.SIGTERM)
    assert await replica.wait_exit(15) == 0
    if ttl_s == 2:
        assert "lost slot 0 (fence 1)" in replica.log()  # taken back once space returned
    # a stalled loop's ERROR line comes at most once a minute, however often it retries
    errors = [json.loads(line) for line in replica.log().splitlines() if line.startswith("{")]
    stall_lines = [e["msg"] for e in errors if e.get("level") == "ERROR" and "stalled (retrying)" in e["msg"]]
    assert stall_lines, replica.log()[-3000:]
    whats = [m.split(" stalled (retrying)")[0] for m in stall_lines]
    assert len(whats) == len(set(whats)), stall_lines
