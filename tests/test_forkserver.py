"""The fork server the process tests start ``python -m`` processes from: a forked process is the
test process's child, and runs and ends as an interpreter started afresh would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests import forkserver

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not forkserver.ENABLED, reason="the fork server is switched off"),
]

PROBE = [sys.executable, "-m", "tests.forkprobe"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def test_a_forked_process_is_our_child_with_our_arguments_environment_and_directory(tmp_path: Path) -> None:
    proc = forkserver.popen(
        [*PROBE, "a", "b"], env=_env(PROBE="42"), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert isinstance(proc, forkserver.Forked)  # not a fresh interpreter
    assert proc.wait(10) == 0
    assert proc.stdout is not None
    with proc.stdout:
        lines = proc.stdout.read().decode().splitlines()
    assert lines[0] == f"cwd={tmp_path.resolve()} probe=42 argv=['a', 'b']"
    # the interpreter's end: non-daemon threads joined, then the atexit handlers
    assert lines[1:] == ["thread ran", "atexit ran"]
    with pytest.raises(ChildProcessError):  # reaped by us, as a child is
        os.waitpid(proc.pid, os.WNOHANG)


async def test_exit_codes_and_an_uncaught_exception_are_the_interpreters() -> None:
    code, _out, _err = await forkserver.run_process([*PROBE, "exit", "3"], env=_env())
    assert code == 3
    code, out, err = await forkserver.run_process([*PROBE, "raise"], env=_env())
    assert code == 1
    assert b"RuntimeError: the probe raised" in err and b"atexit ran" in out


async def test_a_signal_ends_a_forked_process_as_it_ends_a_started_one(tmp_path: Path) -> None:
    proc = await forkserver.open_process(
        [sys.executable, "-m", "wowd", "run"],
        env={**_env(), "WOWD_EMBEDDED__PATH": str(tmp_path / "w.db"), "WOWD_HTTP__PORT": "0"},
        cwd=tmp_path,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        seen = b""
        with anyio.fail_after(10):
            while b"replica" not in seen or b"started" not in seen:
                seen += await proc.stdout.receive()
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(10):
            assert await proc.wait() == 0  # wowd's own graceful stop
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()


def test_communicate_reads_both_pipes_to_their_end(tmp_path: Path) -> None:
    proc = forkserver.popen(
        [*PROBE, "raise"], env=_env(PROBE="7"), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 1
    assert out.decode().splitlines()[0] == f"cwd={tmp_path.resolve()} probe=7 argv=['raise']"
    assert b"RuntimeError: the probe raised" in err


async def test_a_process_that_cannot_be_set_up_exits_1_saying_why(tmp_path: Path) -> None:
    code, _out, err = await forkserver.run_process([*PROBE], env=_env(), cwd=tmp_path / "gone")
    assert code == 1 and b"FileNotFoundError" in err
