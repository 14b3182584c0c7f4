"""docs/tutorial.md and the README's example, run as a newcomer runs them: the receiver, a
replica with the http gateway, the scheduling script, ``wowd timers list``, the metrics and
``wowd status``. Only the ports change (a free one instead of 8080 and 9180), and the reminder
comes due in 1 s instead of 5 s."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.factories import eventually

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.process, pytest.mark.slow]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shell_commands(text: str) -> list[str]:
    """The ``sh`` commands of a document, one per line."""
    return [line for block in blocks(text, "sh") for line in block.splitlines() if line.strip()]


def command(text: str, startswith: str) -> list[str]:
    [found] = [c for c in shell_commands(text) if startswith in c]
    return shlex.split(found)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def test_the_tutorial_schedules_receives_cancels_and_watches(workdir: Path) -> None:
    receiver_port, http_port = free_port(), free_port()
    python_blocks = blocks(TUTORIAL, "python")
    receiver = next(b for b in python_blocks if "HTTPServer" in b)
    schedule = next(b for b in python_blocks if "WowdClient" in b)
    (workdir / "receiver.py").write_text(receiver.replace("8080", str(receiver_port)))
    assert "due_at=now + 5_000," in schedule
    (workdir / "schedule.py").write_text(schedule.replace("due_at=now + 5_000,", "due_at=now + 1_000,"))
    # step 1's `export WOWD_EMBEDDED__PATH=tutorial.db`, in each terminal
    [export] = [c for c in shell_commands(TUTORIAL) if c.startswith("export ")]
    name, _, value = export.removeprefix("export ").partition("=")
    env = {**os.environ, name: value, "WOWD_HTTP__PORT": str(http_port), "WOWD_LOG_FORMAT": "text"}
    env.pop("WOWD_CONFIG", None)

    run = command(TUTORIAL, "wowd run")
    assert run[:2] == ["WOWD_GATEWAY__KIND=http", "WOWD_GATEWAY__URL=http://127.0.0.1:8080"], run
    run_env = {**env, "WOWD_GATEWAY__KIND": "http", "WOWD_GATEWAY__URL": f"http://127.0.0.1:{receiver_port}"}

    def exe(argv: list[str]) -> list[str]:
        return [str(BIN / Path(argv[0]).name), *argv[1:]]

    procs: list[subprocess.Popen[str]] = []
    try:
        rec = subprocess.Popen(
            exe(command(TUTORIAL, "receiver.py")), cwd=workdir, env=env, stdout=subprocess.PIPE, text=True
        )
        procs.append(rec)
        replica = subprocess.Popen(
            exe(run[2:]), cwd=workdir, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
        )
        procs.append(replica)

        def holding() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz?holding=1", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        anyio.run(eventually, holding, 30, "the replica holds its slot")
        out = subprocess.run(exe(command(TUTORIAL, "schedule.py")), cwd=workdir, env=env, capture_output=True,
                             text=True, timeout=60, check=True)  # fmt: skip
        assert "scheduled 'reminder', scheduled and cancelled 'expiry'" in out.stdout
        listed = subprocess.run(exe(command(TUTORIAL, "wowd timers list")), cwd=workdir, env=env,
                                capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        assert "expiry" not in listed.stdout
        # a second after the script (five in the tutorial): the reminder's POST, never the cancelled expiry
        assert rec.stdout is not None
        line = rec.stdout.readline()
        assert line.startswith("POST /order/order-1/remind-customer request id "), line
        assert '{"message":"your cart is waiting"}' in line
        for watch in [c for c in shell_commands(TUTORIAL) if c.startswith(("curl", ".venv/bin/wowd status"))]:
            argv = shlex.split(watch.replace("localhost:9180", f"localhost:{http_port}").split(" | ")[0])
            if argv[0].endswith("wowd"):
                argv = exe(argv)
            shown = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, (watch, shown.stderr)
            if "/metrics" in watch:
                # a delivery is counted when its outcome is written (within a settle group's 20 ms)
                fired = 'wowd_timers_fired_total{target="demo.order"} 1.0'
                deadline = time.monotonic() + 5
                while fired not in shown.stdout and time.monotonic() < deadline:
                    shown = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=60)
                assert fired in shown.stdout
                assert 'wowd_slot_held{slot="0"} 1.0' in shown.stdout
            elif "/readyz" in watch:
                assert shown.stdout.startswith("ready")
        listed = subprocess.run(exe(command(TUTORIAL, "wowd timers list")), cwd=workdir, env=env,
                                capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        assert "reminder" not in listed.stdout and "expiry" not in listed.stdout
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        rest = rec.stdout.read() if rec.stdout else ""
        if rec.stdout:
            rec.stdout.close()
    assert "expire-order" not in rest


def test_the_readme_example_schedules_and_cancels(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [example] = [b for b in blocks(README, "python") if "WowdClient" in b]
    (workdir / "example.py").write_text(example)
    env = {**os.environ, "WOWD_EMBEDDED__PATH": str(workdir / "readme.db")}
    env.pop("WOWD_CONFIG", None)
    # the database `make run` creates (the client opens an existing file only)
    subprocess.run([sys.executable, "-m", "wowd", "demo", "--commits", "0", "--timers", "0"], cwd=workdir,
                   env=env, check=True, timeout=60, capture_output=True)  # fmt: skip
    subprocess.run([sys.executable, "example.py"], cwd=workdir, env=env, check=True, timeout=60)
    # two commits in wowd's stream of order-42 (the TimerScheduled, then the TimerCancelled), none
    # in order-42's own: read here, on the example's settings
    from wowd.client import WowdClient, schedule_stream
    from wowd.model import AggregateRef

    monkeypatch.setenv("WOWD_EMBEDDED__PATH", env["WOWD_EMBEDDED__PATH"])
    monkeypatch.delenv("WOWD_CONFIG", raising=False)

    async def versions() -> tuple[int, int]:
        async with WowdClient.connect() as c:
            order = AggregateRef(context="demo", aggregate="order", id="order-42")
            return await c.log.last_version(schedule_stream(order)), await c.log.last_version(order)

    assert anyio.run(versions) == (2, 0)
