"""Real ``python -m wowd`` processes for the tests, forked from :mod:`tests.forkserver`: replicas
on one SQLite file (``tmp_path``), HTTP on port 0, their environment, their output; and a command
run to its end. The fixtures that start and stop them are in ``tests/conftest.py``."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests import forkserver
from tests.factories import CONTEXT, PARTITIONS, eventually

SECRET_TOKEN = "planted-gw-secret-7781"
SECRET_MONGO_PW = "planted-mongo-pw-9931"


LOCAL_TLS = ssl.create_default_context()
"""The TLS context of every client a test makes to a replica's plain HTTP on 127.0.0.1 (never
used on the wire): one for the session, where each new ``httpx`` client would load the system's
CA bundle again, some milliseconds of CPU each, over hundreds of polls."""


def local_client(timeout: float) -> httpx.AsyncClient:
    """An ``httpx`` client for a replica's HTTP endpoints."""
    return httpx.AsyncClient(timeout=timeout, verify=LOCAL_TLS)


def base_env(db: Path, **extra: Any) -> dict[str, str]:
    """The environment of a replica on the embedded file ``db`` (two slots, a lease of 2 s, JSON
    log lines, secrets planted where no answer may show them), without this process's
    ``WOWD_*``; ``extra``: more variables."""
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
    """``wowd run`` as the replica ``name`` (its owner key) in ``tmp_path``: its output in
    ``NAME.log``, its port in ``NAME.port``."""

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
        def written() -> bool:
            assert self.proc.poll() is None, f"{self.name} exited: {self.log()}"
            return self.port_file.exists() and bool(self.port_file.read_text().strip())

        await eventually(written, within, f"{self.name}'s port")
        self.port = int(self.port_file.read_text())
        return self.port

    async def get(self, path: str) -> httpx.Response:
        port = self.port or await self.wait_port()
        async with local_client(5) as client:
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
        await eventually(lambda: self.proc.poll() is not None, within, f"{self.name}'s exit")
        rc = self.proc.poll()
        assert rc is not None
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


async def run_wowd(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    """``python -m wowd ARGS``; answers (exit code, stdout, stderr)."""
    with anyio.fail_after(60):
        code, out, err = await forkserver.run_process([sys.executable, "-m", "wowd", *args], env=env, cwd=cwd)
    return code, out.decode(), err.decode()


REPO = Path(__file__).resolve().parents[1]
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


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of the sample ``name`` (with ``labels``) in a replica's ``/metrics`` text, or
    ``None`` when it has none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(s.value)
    return None
