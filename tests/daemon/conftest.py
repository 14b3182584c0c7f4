"""Real ``python -m wowd run`` processes (forked from :mod:`tests.forkserver`) on one SQLite file
(tmp_path), HTTP on port 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests import forkserver
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.daemon.leases import HeldSlot
from wowd.model import AggregateRef, Commit, DomainEvent, Owner
from wowd.stores.base import Backend

CONTEXT = "demo"
PARTITIONS = 8
SECRET_TOKEN = "planted-gw-secret-7781"
SECRET_MONGO_PW = "planted-mongo-pw-9931"


def embedded_settings(tmp_path: Path, partitions: int, **extra: Any) -> WowdSettings:
    """One replica's settings (a lease limit of 1) on the embedded file ``tmp_path/wowd.db``, for
    the tests that build a backend and loops in-process; ``extra``: more settings."""
    extra.setdefault("lease", LeaseSettings(limit=1))
    return WowdSettings(
        context=CONTEXT, partitions=partitions, embedded=EmbeddedSettings(path=tmp_path / "wowd.db"), **extra
    )


async def hold_slot(b: Backend, partitions: int, key: str = "a") -> HeldSlot:
    """Slot 0 of namespace ``ns``, taken by ``key`` for a minute (after the previous holder's
    lease was released), over partitions ``0 .. partitions - 1``: for the tests that run a
    slot's loops in-process."""
    res = await b.leases.acquire("ns", Owner(key=key), 1, timedelta(seconds=60), timedelta(seconds=1))
    assert res.lease is not None
    return HeldSlot(
        lease=res.lease, partitions=frozenset(range(partitions)), valid_until=anyio.current_time() + 60, owner_key=key
    )


def base_env(db: Path, **extra: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WOWD_") and k != "NOTIFY_SOCKET"}
    env.update(
        {
            "WOWD_CONTEXT": CONTEXT,
            "WOWD_PARTITIONS": str(PARTITIONS),
            "WOWD_EMBEDDED__PATH": str(db),
            "WOWD_HTTP__HOST": "127.0.0.1",
            "WOWD_HTTP__PORT": "0",
            "WOWD_LEASE__LIMIT": "2",
            "WOWD_LEASE__TTL_S": "2",
            "WOWD_LEASE__TOLERANCE_S": "0.5",
            "WOWD_SHUTDOWN__GRACE_S": "5",
            "WOWD_LOG_FORMAT": "json",
            "WOWD_GATEWAY__TOKEN": SECRET_TOKEN,
            "WOWD_MONGODB__URI": f"mongodb://wowd:{SECRET_MONGO_PW}@127.0.0.1:1/?authSource=admin",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Replica:
    def __init__(self, tmp_path: Path, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.port_file = tmp_path / f"{name}.port"
        self.log_path = tmp_path / f"{name}.log"
        self.port_file.unlink(missing_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = forkserver.popen(
            [sys.executable, "-m", "wowd", "run", "--port-file", str(self.port_file)],
            env={**env, "WOWD_LEASE__OWNER_KEY": name},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        self.port: int | None = None

    async def wait_port(self, within: float = 15) -> int:
        with anyio.fail_after(within):
            while True:
                if self.port_file.exists() and self.port_file.read_text().strip():
                    self.port = int(self.port_file.read_text())
                    return self.port
                assert self.proc.poll() is None, f"{self.name} exited: {self.log()}"
                await anyio.sleep(0.05)

    async def get(self, path: str) -> httpx.Response:
        port = self.port or await self.wait_port()
        async with httpx.AsyncClient(timeout=5) as client:
            return await client.get(f"http://127.0.0.1:{port}{path}")

    async def wait_ready(self, within: float = 15) -> None:
        await self.wait_port()
        await eventually(lambda: self._status("/readyz?holding=1", 200), within, f"{self.name} holds no slot")

    async def _status(self, path: str, code: int) -> bool:
        return (await self.get(path)).status_code == code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, within: float) -> int:
        with anyio.fail_after(within):
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    return rc
                await anyio.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str = "condition") -> None:
    """Polls ``check`` until it holds, inside ``fail_after`` (never a bare sleep as a sync)."""
    try:
        with anyio.fail_after(within):
            while True:
                if await check():
                    return
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for: {what}") from None


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    started: list[Replica] = []

    def _spawn(name: str, env: dict[str, str]) -> Replica:
        r = Replica(tmp_path, name, env)
        started.append(r)
        return r

    yield _spawn
    for r in started:
        r.close()


def scheduled(agg_id: str, key: str, due_at: int, **command_body: Any) -> DomainEvent:
    """A ``TimerScheduled`` event of the order ``agg_id`` sending ``expire-order`` to itself
    (the command's body: ``{"key": key}`` and ``command_body``)."""
    return DomainEvent(
        id=uuid.uuid4().hex,
        name="TimerScheduled",
        body={
            "key": key,
            "due_at": due_at,
            "rule": {"type": "once"},
            "target": {"context": CONTEXT, "aggregate": "order", "id": agg_id},
            "command": {"name": "expire-order", "body": {"key": key, **command_body}},
        },
    )


def timer_commit(agg_id: str, version: int, keys: list[str], due_at: int | None = None) -> Commit:
    due = int(time.time() * 1000) if due_at is None else due_at
    ref = AggregateRef(context=CONTEXT, aggregate="order", id=agg_id)
    events = [DomainEvent(id=uuid.uuid4().hex, name="ItemAdded", body={"n": version})]
    events += [scheduled(agg_id, key, due) for key in keys]
    return Commit(
        ref=ref,
        version=version,
        command_id=uuid.uuid4().hex,
        request_id=uuid.uuid4().hex,
        create_time=due,
        events=tuple(events),
    )


async def run_wowd(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    """``python -m wowd ARGS``; answers (exit code, stdout, stderr)."""
    with anyio.fail_after(60):
        code, out, err = await forkserver.run_process([sys.executable, "-m", "wowd", *args], env=env, cwd=cwd)
    return code, out.decode(), err.decode()


REPO = Path(__file__).resolve().parents[2]
"""The repository (``python -m tests...`` runs from it)."""


async def rebuild_killed_partway(env: dict[str, str]) -> None:
    """``wowd timers rebuild`` SIGKILLed at a known point partway: run by
    :mod:`tests.chaos.stopping_rebuild`, which stops itself once its replay is done (the lock
    taken, the shadow written, the live view untouched), and killed there, however fast the
    rebuild would otherwise swap in."""
    from tests.chaos.stopping_rebuild import STOPPED_LINE, stopped

    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    proc = await forkserver.open_process([sys.executable, "-m", "tests.chaos.stopping_rebuild"], env=env)
    try:
        assert proc.stdout is not None
        out = b""
        with anyio.fail_after(15):
            while STOPPED_LINE.encode() not in out:
                out += await proc.stdout.receive()
            await stopped(proc.pid)
        assert out.startswith(b"rebuild of the timer view"), out
        proc.kill()
        with anyio.fail_after(10):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """The embedded file the process tests' replicas share."""
    return tmp_path / "wowd.db"


@pytest.fixture
async def stores(db: Path, request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The test's own view of ``db`` (the module's ``LEASE_LIMIT`` slots, 1 by default)."""
    from wowd.stores.embedded import open_embedded

    limit = getattr(request.module, "LEASE_LIMIT", 1)
    settings = WowdSettings(
        context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=db), lease=LeaseSettings(limit=limit)
    )
    backend = await open_embedded(settings)
    try:
        yield backend
    finally:
        await backend.close()
