"""The replica's life cycle as a process: a crashed loop, the systemd watchdog, ``make run``'s
command, its log lines, and a second signal during a long drain, tested as processes. Every wait
reads the process's output, socket or stores inside ``fail_after``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tests import forkserver
from tests.factories import CONTEXT, PARTITIONS, eventually, timer_commit
from tests.processes import Replica, base_env
from wowd.cli.run import ESCALATE_AFTER_S
from wowd.model import Owner, TimerStatus, partition
from wowd.stores.base import Backend

pytestmark = [pytest.mark.anyio, pytest.mark.process]

NS = f"wowd.{CONTEXT}"


def _json_lines(text: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


# --------------------------------------------------------------------------- 1. a crashed side loop


CRASHING_REDUCER = """
class Reducer:
    state_revision = 1

    def fold(self, state, event):
        raise RuntimeError("reducer exploded on " + event.name)


reducer = Reducer()
"""


async def test_a_raising_reducer_stalls_its_snapshot_view_and_nothing_else(
    spawn: Callable[..., Replica], db: Path, stores: Backend, tmp_path: Path
) -> None:
    """A bug in user code (a reducer raising a non-wowd exception) stalls that type's snapshot
    view: it says so (``wowd_feed_stalled{view}``, an ERROR line naming the reducer) and does not
    move its checkpoints, while the replica stays ready and the timer view feeds the commits. A
    commit in the log before the replica starts meets the reducer first in the slot's snapshot
    rebuild, which fails for the type (``wowd_snapshot_rebuild_failed``, an ERROR line) and lets
    the feed start."""
    (tmp_path / "crashing_reducer.py").write_text(textwrap.dedent(CRASHING_REDUCER))
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    env = base_env(
        db,
        WOWD_LEASE__LIMIT=1,
        WOWD_REDUCERS=json.dumps({"order": "crashing_reducer:reducer"}),
        PYTHONPATH=pythonpath,
    )
    due_at = int(time.time() * 1000) + 3_600_000
    early, late = (timer_commit(f"boom-{i}", 1, ["k"], due_at=due_at) for i in range(2))
    await stores.log.append(early)
    r = spawn("crashy", env)
    await r.wait_ready()
    await stores.log.append(late)
    parts = list(range(PARTITIONS))

    async def timers_viewed() -> bool:
        return None not in [await stores.timer_queries.find(c.ref, "k") for c in (early, late)]

    async def stalled() -> bool:
        text = (await r.get("/metrics")).text
        return (
            'wowd_feed_stalled{slot="0",view="snapshots.order"} 1.0' in text
            and 'wowd_snapshot_rebuild_failed{aggregate="order",slot="0"} 1.0' in text
        )

    await eventually(timers_viewed, 15, "the timer view fed the commits")
    await eventually(stalled, 15, "the snapshot view stalled and its rebuild failed")
    assert (await r.get("/readyz")).status_code == 200
    assert r.proc.poll() is None
    fed_parts = {partition(c.ref.id, PARTITIONS) for c in (early, late)}
    assert sorted(await stores.checkpoints.read("wowd", parts)) == sorted(fed_parts)
    # the snapshot view's position stays before the commits (they are folded once the reducer is fixed)
    snapshot_cps = await stores.checkpoints.read("wowd.snapshots.order", parts)
    assert not any(cp.position for cp in snapshot_cps.values())
    assert [await stores.snapshots.load(c.ref) for c in (early, late)] == [None, None]
    log = r.log()
    errors = [str(d["msg"]) for d in _json_lines(log) if d.get("level") == "ERROR"]
    assert any("snapshots.order view stalled" in m and "reducer exploded on ItemAdded" in m for m in errors), log
    rebuild = f"snapshots of {early.ref.context}.order not rebuilt at state revision 1: reducer of order raised on"
    assert any(m.startswith(rebuild) and "reducer exploded on ItemAdded" in m for m in errors), log


# --------------------------------------------------------------------------- 2. systemd watchdog


async def test_systemd_ready_watchdog_cadence_status_and_stopping(spawn: Callable[..., Replica], db: Path) -> None:
    watchdog_usec = 100_000
    with tempfile.TemporaryDirectory(prefix="wowd-") as d:  # short: AF_UNIX paths are <= 107 bytes
        path = str(Path(d) / "notify")
        async with await anyio.create_unix_datagram_socket(local_path=path) as sock:
            env = base_env(db, WOWD_LEASE__LIMIT=1, NOTIFY_SOCKET=path, WATCHDOG_USEC=watchdog_usec)
            r = spawn("sd", env)
            received: list[tuple[float, str]] = []

            async def until(pred: Callable[[str], bool], within: float, what: str) -> str:
                try:
                    with anyio.fail_after(within):
                        while True:
                            data, _ = await sock.receive()
                            msg = data.decode()
                            received.append((time.monotonic(), msg))
                            if pred(msg):
                                return msg
                except TimeoutError:
                    raise AssertionError(f"no {what} within {within}s; got {received!r}: {r.log()}") from None

            ready = await until(lambda m: "READY=1" in m, 15, "READY=1")
            assert ready.split("\n") == ["READY=1", "STATUS=holding slot(s) 0 (fence 1) of wowd.demo"]

            # WATCHDOG=1 every WATCHDOG_USEC/2: 10 pings after READY, systemd's deadline kept on
            # average with room to spare, and no busy loop either
            pings: list[float] = []
            for _ in range(10):
                await until(lambda m: m == "WATCHDOG=1", 2, "WATCHDOG=1")
                pings.append(received[-1][0])
            mean_gap = (pings[-1] - pings[0]) / (len(pings) - 1)
            assert watchdog_usec / 4e6 <= mean_gap <= watchdog_usec / 1e6, pings

            r.signal(signal.SIGTERM)
            stopping = await until(lambda m: "STOPPING=1" in m, 10, "STOPPING=1")
            assert stopping.startswith("STOPPING=1\nSTATUS=")
            assert await r.wait_exit(10) == 0
            # every datagram is a valid sd_notify assignment list
            for _, msg in received:
                for line in msg.split("\n"):
                    assert re.fullmatch(r"(READY|WATCHDOG|STOPPING)=1|STATUS=[^\n]+", line), msg


# --------------------------------------------------------------------------- 3. make run


PROGRESS = re.compile(r"demo: appended (\d+) commits \((\d+) timers\) \| fed (\d+) commits \| fired (\d+) timers")


async def _demo_output(tmp_path: Path, *, forked: bool = False, **settings: str) -> list[str]:
    """``wowd run --demo`` from a fresh directory, stdout and stderr in one pipe as a terminal
    shows them, until a progress line shows timers fired; then SIGTERM, and it exits 0. Its
    lines, in order. ``forked``: ``python -m wowd`` from the fork server (:mod:`tests.forkserver`),
    else the console script ``make run`` calls, started afresh."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WOWD_") and k not in ("NOTIFY_SOCKET",)}
    env.update({"WOWD_HTTP__PORT": "0", "PYTHONUNBUFFERED": "1", **settings})
    command = [sys.executable, "-m", "wowd"] if forked else _wowd_command()
    proc = await forkserver.open_process(
        [*command, "run", "--demo"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    buf = b""
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        with anyio.fail_after(30):
            while not any((m := PROGRESS.search(line)) and int(m.group(4)) > 0 for line in lines):
                buf += await proc.stdout.receive()
                *done, buf = buf.split(b"\n")
                lines += [line.decode() for line in done]
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(15):
            async for chunk in proc.stdout:
                buf += chunk
            assert await proc.wait() == 0
        lines += [line.decode() for line in buf.split(b"\n") if line]
    finally:
        if proc.returncode is None:
            proc.kill()
            with anyio.CancelScope(shield=True):
                await proc.wait()
        await proc.aclose()
    return lines


async def test_make_run_shows_commits_fed_and_timers_fired_the_first_progress_within_ten_lines_then_exits_zero(
    tmp_path: Path,
) -> None:
    """``make run`` is ``.venv/bin/wowd run --demo`` with no configuration, from a fresh directory:
    progress lines show commits fed and timers fired within seconds; SIGTERM exits 0. The first
    build of the snapshots of a new file is routine (logged at DEBUG), so the first progress line
    comes within the first ten lines a terminal shows."""
    lines = await _demo_output(tmp_path)
    counts = [tuple(map(int, m.groups())) for line in lines if (m := PROGRESS.search(line))]
    appended, timers, fed, fired = next(c for c in reversed(counts) if c[3] > 0)
    assert appended >= fed > 0 and timers >= fired > 0, lines
    assert (tmp_path / "wowd.db").exists()  # the embedded default: ./wowd.db
    assert any("received SIGTERM: stopping gracefully" in line for line in lines), lines
    first = next(i for i, line in enumerate(lines) if PROGRESS.search(line))
    assert first < 10, "\n".join(lines[: first + 1])
    assert not [line for line in lines if "snapshots" in line]


async def test_at_4096_partitions_no_log_line_is_over_1_kb(tmp_path: Path) -> None:
    """Every line of a slot carries the slot and its partitions in a compact form; the full list
    is logged once at acquisition, at DEBUG."""
    lines = await _demo_output(tmp_path, forked=True, WOWD_PARTITIONS="4096")
    assert max(len(line.encode()) for line in lines) <= 1024, max(lines, key=len)[:300]
    of_slot = [json.loads(line) for line in lines if line.startswith("{") and '"slot": 0' in line]
    assert {"acquired", "feeding", "released"} <= {doc["msg"].split()[0] for doc in of_slot}
    assert all(doc["partitions"] == "0..4095 (4096 partitions)" for doc in of_slot), of_slot
    assert not any("holds partitions" in line for line in lines)  # the 19.5 KB list: DEBUG only


def _wowd_command() -> list[str]:
    """The console script ``make run`` calls (beside this interpreter), else ``python -m wowd``."""
    script = Path(sys.executable).with_name("wowd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "wowd"]


# --------------------------------------------------------------------------- 4. a second signal


@asynccontextmanager
async def delivering_forever(
    spawn: Callable[..., Replica], db: Path, stores: Backend, name: str, grace_s: float
) -> AsyncIterator[Replica]:
    """The replica ``name`` (one slot, the http gateway, a grace period of ``grace_s``), once the
    delivery of its one timer is in flight to a target that reads the request and never answers."""
    requests = anyio.Event()

    async def hang(stream: SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            requests.set()
            await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    url = f"http://127.0.0.1:{port}"
    env = base_env(
        db,
        WOWD_LEASE__LIMIT=1,
        WOWD_GATEWAY__KIND="http",
        WOWD_GATEWAY__URL=url,
        WOWD_GATEWAY__TIMEOUT_S=60,
        WOWD_SHUTDOWN__GRACE_S=grace_s,
    )
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hang)
        r = spawn(name, env)
        await r.wait_ready()
        await stores.log.append(timer_commit(f"{name}-1", 1, ["k"]))
        with anyio.fail_after(15):
            await requests.wait()  # the delivery is in flight and will not finish by itself
        yield r
        tg.cancel_scope.cancel()


async def test_two_sigterms_within_a_second_count_once(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    """``timeout`` and ``make`` forwarding one stop together: the drain of a delivery in flight
    runs its grace period and the replica exits 0, not cancelled."""
    async with delivering_forever(spawn, db, stores, "twice", grace_s=0.5) as r:
        r.signal(signal.SIGTERM)
        first = time.monotonic()
        await eventually(lambda: _logged(r, "received SIGTERM: stopping gracefully"), 10, "the first signal taken")
        r.signal(signal.SIGTERM)
        assert time.monotonic() - first < ESCALATE_AFTER_S  # else this test says nothing
        assert await r.wait_exit(20) == 0
        assert time.monotonic() - first >= 0.4  # the grace period (0.5 s) ran
        assert await _logged(r, "again within 1 s of the first: still stopping gracefully")


async def test_second_sigterm_during_a_long_drain_cancels_at_once(
    spawn: Callable[..., Replica], db: Path, stores: Backend
) -> None:
    """The target never answers, so the graceful drain would last the whole grace period; a second
    SIGTERM (a second or more after the first) ends it at once (exit 1), still settling the claim
    and releasing the lease."""
    async with delivering_forever(spawn, db, stores, "drainer", grace_s=60) as r:
        r.signal(signal.SIGTERM)
        await eventually(lambda: _logged(r, "stopping: draining within 60.0s"), 10, "graceful stop begun")
        first = time.monotonic()  # the replica took the first signal before this (a loaded one late)
        assert r.proc.poll() is None  # draining: waits for the delivery in flight
        (timer,) = await stores.timer_queries.scan(limit=10)
        assert timer.status is TimerStatus.FIRING

        # a repeat within ESCALATE_AFTER_S of the first counts as the same signal
        await anyio.sleep(max(0.0, ESCALATE_AFTER_S + 0.1 - (time.monotonic() - first)))
        r.signal(signal.SIGTERM)
        second = time.monotonic()
        assert await r.wait_exit(10) == 1
        assert time.monotonic() - second < 5  # not the 60 s grace nor the 60 s delivery timeout

    assert "again: cancelling" in r.log()
    # cancelled, yet the claim is settled (back to PENDING, due again at once) and the lease released
    (timer,) = await stores.timer_queries.scan(limit=10)
    assert timer.status is TimerStatus.PENDING and timer.claim is None, timer
    assert timer.last_error == "not delivered: stopped" and timer.due_at <= int(time.time() * 1000)
    (state,) = await stores.leases.slots(NS)
    assert state.owner_key is None and state.last_owner_key == "drainer"
    res = await stores.leases.acquire(NS, Owner(key="next"), 1, timedelta(seconds=2), timedelta(seconds=0.5))
    assert res.acquired


async def _logged(r: Replica, text: str) -> bool:
    return text in r.log()
