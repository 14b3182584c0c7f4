"""HTTP delivery: ``wowd run`` with the ``http`` gateway against a local target, side by side with
a bare loop of the same client (aiohttp) at the same concurrency.

- The target (``python -m bench.http_delivery serve PORT_FILE``) is a minimal keep-alive HTTP/1.1
  server on uvloop in its own process (a raw asyncio protocol, 127.0.0.1): every POST answers
  ``200 {}`` and is recorded with its arrival time (ms) and body; ``GET /count``, ``GET /dump``
  (the records as JSON) and ``GET /reset`` serve the measurement.
- Burst: ``n`` timers put straight into the timer table, due at one instant, one ``wowd run``
  process with ``WOWD_GATEWAY__KIND=http`` and ``WOWD_GATEWAY__CONCURRENCY`` (and the per-target
  limit) at the concurrency measured. Lag = arrival at the target - due time; fired/s = n /
  (last arrival - due time).
- Bare loop: ``concurrency`` tasks on one ``aiohttp.ClientSession`` (connector limit =
  concurrency) POSTing the same ``n`` commands (same paths, headers and body) as fast as the
  target answers; its lag counts from its start (every command "due" then).
- Steady: this process appends commits scheduling one timer each at a constant rate, due 1 s after
  the append (the command's body carries its due time); the replica feeds and fires them over HTTP.
  Beside it, the bare steady loop: one process POSTing the same rate of commands, each at its due
  time, with the same client and no log (the floor of the lag on this machine).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

from bench.common import (
    BENCH_CONTEXT,
    REPO,
    cpu_seconds,
    create_timer_tables,
    insert_timer_rows,
    lag_stats,
    now_ms,
    peak_rss_mb,
    proc_stats,
    timer_rows,
)
from bench.wowd_timers import PARTITIONS, daemons, wait_until

__all__ = [
    "Target",
    "http_bare",
    "http_burst",
    "http_one_service",
    "http_steady",
    "run_bare",
    "serve",
    "target_server",
]

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


# --------------------------------------------------------------------------- the target


class _Protocol(asyncio.Protocol):
    """One keep-alive connection: parses requests (``content-length`` bodies), answers in order."""

    def __init__(self, records: list[tuple[float, bytes]]) -> None:
        self.records = records
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport instances

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                break
            head = self.buf[:i]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            end = i + 4 + length
            if len(self.buf) < end:
                break
            body = self.buf[i + 4 : end]
            self.buf = self.buf[end:]
            method, path = head.split(b" ", 2)[:2]
            if method == b"POST":
                self.records.append((time.time() * 1000, body))
                out.append(_OK)
            else:
                out.append(self._control(path))
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _control(self, path: bytes) -> bytes:
        if path == b"/dump":
            payload = json.dumps([[at, body.decode()] for at, body in self.records]).encode()
        elif path == b"/reset":
            self.records.clear()
            payload = b"0"
        else:
            payload = str(len(self.records)).encode()
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)


async def _serve(port_file: Path) -> None:
    loop = asyncio.get_running_loop()
    records: list[tuple[float, bytes]] = []
    server = await loop.create_server(lambda: _Protocol(records), "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


def serve(port_file: Path) -> None:
    import uvloop

    uvloop.run(_serve(port_file))


class Target:
    """The target server process."""

    def __init__(self, tmp: Path) -> None:
        self.port_file = tmp / "target.port"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.http_delivery", "serve", str(self.port_file)], env=env, cwd=str(REPO)
        )
        wait_until(lambda: self.port_file.exists() or self.proc.poll() is not None, 30, "target up")
        if self.proc.poll() is not None:
            raise RuntimeError(f"target exited with {self.proc.returncode}")
        self.port = int(self.port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}/api"

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as resp:
            return bytes(resp.read())

    def count(self) -> int:
        return int(self._get("/count"))

    def dump(self) -> list[tuple[float, str]]:
        return [(float(at), str(body)) for at, body in json.loads(self._get("/dump"))]

    def reset(self) -> None:
        self._get("/reset")

    def cpu(self) -> float:
        return proc_stats(self.proc.pid)[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextmanager
def target_server(tmp: Path) -> Iterator[Target]:
    target = Target(tmp)
    try:
        yield target
    finally:
        target.stop()


# --------------------------------------------------------------------------- the bare loop


async def _bare(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import aiohttp

    body = b'{"n":1}'
    headers = {"content-type": "application/json", "accept": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    done: list[float] = []
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session:
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                h = {**headers, "command-request-id": uuid.uuid4().hex}
                async with session.post(f"{url}/invoice/inv-{i}/remind", data=body, headers=h) as resp:
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                done.append(time.time() * 1000)

        cpu0 = cpu_seconds()
        start = time.time() * 1000
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, n)):
                tg.start_soon(worker)
        cpu = cpu_seconds() - cpu0
    elapsed_s = max((max(done) - start) / 1000, 1e-3)
    return {
        "n": n,
        "concurrency": concurrency,
        "fired": statuses.get(200, 0),
        "fired_per_s": n / elapsed_s,
        **lag_stats([d - start for d in done]).as_dict(),
        "cpu_s": cpu,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_bare(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: the bare aiohttp loop against ``params["url"]`` (uvloop, as ``wowd run``)."""
    import uvloop

    result: dict[str, Any] = uvloop.run(_bare(str(params["url"]), int(params["n"]), int(params["concurrency"])))
    return result


def http_bare(target: Target, n: int, concurrency: int) -> dict[str, Any]:
    from bench.common import run_worker

    target.reset()
    cpu0 = target.cpu()
    r = run_worker("http_bare", {"url": target.url, "n": n, "concurrency": concurrency})
    r["target_cpu_s"] = target.cpu() - cpu0
    if target.count() != n:
        raise RuntimeError(f"bare loop: the target saw {target.count()} of {n} requests")
    return r


async def _bare_steady(url: str, rate: float, seconds: float, concurrency: int) -> dict[str, Any]:
    """``rate`` commands a second for ``seconds``, each POSTed at its due time (its body carries
    it) by its own task on one aiohttp session: the client and the target alone, no log."""
    import aiohttp

    headers = {"content-type": "application/json", "accept": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    n = int(rate * seconds)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def post(i: int, due: float) -> None:
            h = {**headers, "command-request-id": uuid.uuid4().hex}
            body = json.dumps({"due": due}).encode()
            async with session.post(f"{url}/invoice/inv-{i}/remind", data=body, headers=h) as resp:
                await resp.read()

        cpu0 = cpu_seconds()
        start = time.time() * 1000 + 500
        async with anyio.create_task_group() as tg:
            for i in range(n):
                due = start + i * 1000 / rate
                wait_s = (due - time.time() * 1000) / 1000
                if wait_s > 0:
                    await anyio.sleep(wait_s)
                tg.start_soon(post, i, due)
        cpu = cpu_seconds() - cpu0
    return {"rate": rate, "added": n, "cpu_s": cpu}


def run_bare_steady(params: dict[str, Any]) -> dict[str, Any]:
    """Worker: the bare steady loop against ``params["url"]`` (uvloop, as ``wowd run``)."""
    import uvloop

    result: dict[str, Any] = uvloop.run(
        _bare_steady(str(params["url"]), float(params["rate"]), float(params["seconds"]), int(params["concurrency"]))
    )
    return result


def http_bare_steady(target: Target, rate: float, seconds: float, concurrency: int = 64) -> dict[str, Any]:
    """The floor of a steady delivery on this machine: the bare steady loop in its own process,
    lag = arrival at the target - due time."""
    from bench.common import run_worker

    target.reset()
    r = run_worker(
        "http_bare_steady", {"url": target.url, "rate": rate, "seconds": seconds, "concurrency": concurrency}
    )
    lags = [at - json.loads(body)["due"] for at, body in target.dump()]
    return {**r, "fired": len(lags), **lag_stats(lags).as_dict()}


# --------------------------------------------------------------------------- wowd run


def _http_env(target: Target, concurrency: int, per_target: int | None) -> dict[str, str]:
    return {
        "WOWD_GATEWAY__KIND": "http",
        "WOWD_GATEWAY__URL": target.url,
        _concurrency_setting(): str(concurrency),
        "WOWD_GATEWAY__PER_TARGET_CONCURRENCY": str(per_target if per_target is not None else concurrency),
    }


def _concurrency_setting() -> str:
    """The setting of the deliveries in flight in the checkout measured (an earlier wowd, side by
    side, knows only ``WOWD_TIMERS__CONCURRENCY``)."""
    from bench.wowd_timers import code_dir

    config = (code_dir() / "wowd" / "config.py").read_text()
    return "WOWD_GATEWAY__CONCURRENCY" if '("gateway", "concurrency")' in config else "WOWD_TIMERS__CONCURRENCY"


SIGNING_SECRET = "whsec_" + base64.b64encode(b"wowd-bench-signing-secret-32-byte").decode()
"""The secret of the signed rows (each request carries a Standard Webhooks signature)."""


def http_burst(
    target: Target,
    n: int,
    concurrency: int,
    *,
    per_target: int | None = None,
    signed: bool = False,
    timeout_s: float = 600,
    lead_ms: int = 300,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``n`` timers due at once, ``lead_ms`` (and 1 ms per 40 timers) after their insert began,
    fired over HTTP by one ``wowd run`` (all to one target, ``billing.invoice``); ``per_target``
    defaults to ``concurrency`` (like for like with the bare loop); ``signed``: every request
    signed (``WOWD_GATEWAY__SIGNING_SECRETS``)."""
    target.reset()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        env = {**_http_env(target, concurrency, per_target), **(extra_env or {})}
        if signed:
            env["WOWD_GATEWAY__SIGNING_SECRETS"] = json.dumps([SIGNING_SECRET])
        with daemons(tmp, db, 1, limit=1, extra_env=env) as ds:
            (d,) = ds
            due = now_ms() + lead_ms + n // 40
            insert_timer_rows(db, timer_rows(n, due_at=due, partitions=PARTITIONS))
            wait_until(lambda: now_ms() >= due, 60, "due time", every_s=0.001)
            _, cpu0 = d.stats()
            tcpu0 = target.cpu()
            wait_until(lambda: target.count() >= n or not d.alive(), timeout_s, "target", 0.05)
            rss, cpu1 = d.stats()
            tcpu1 = target.cpu()
            if not d.alive():
                raise RuntimeError(f"wowd exited: {d.log_tail()}")
    arrivals = [at for at, _ in target.dump()]
    last, first = max(arrivals), min(arrivals)
    return {
        "n": n,
        "concurrency": concurrency,
        "per_target": per_target if per_target is not None else concurrency,
        "signed": signed,
        "fired": len(arrivals),
        "fired_per_s": len(arrivals) / max((last - due) / 1000, 1e-3),
        "drain_per_s": len(arrivals) / max((last - first) / 1000, 1e-3),
        **lag_stats([at - due for at in arrivals]).as_dict(),
        "cpu_s": cpu1 - cpu0,
        "target_cpu_s": tcpu1 - tcpu0,
        "peak_rss_mb": rss,
    }


def http_one_service(
    target: Target,
    *,
    commits: int = 200,
    timers: int = 20_000,
    aggregates: int = 200,
    due_in_ms: int = 8_000,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """One service with the default settings, through the log: ``wowd demo`` appends ``commits``
    commits over ``aggregates`` orders carrying ``timers`` timers due ``due_in_ms`` later, then one
    ``wowd run`` (the ``http`` gateway to ``target``, nothing else set) feeds and fires them.
    fired/s = arrivals / (last arrival - the first due time); CPU: the replica's while it fires."""
    from bench.e2e import demo_cli

    target.reset()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        env = {"WOWD_GATEWAY__KIND": "http", "WOWD_GATEWAY__URL": target.url, **(extra_env or {})}
        appended = demo_cli(tmp, db, commits=commits, timers=timers, due_in_ms=due_in_ms, aggregates=aggregates)
        expected = appended["timers"] - appended["cancelled"]
        due = _first_due(db)
        with daemons(tmp, db, 1, limit=1, extra_env=env) as ds:
            (d,) = ds
            wait_until(lambda: now_ms() >= due or not d.alive(), due_in_ms / 1000 + 60, "due time", every_s=0.001)
            _, cpu0 = d.stats()
            wait_until(lambda: target.count() >= expected or not d.alive(), timeout_s, "target", 0.02)
            rss, cpu1 = d.stats()
            if not d.alive():
                raise RuntimeError(f"wowd exited: {d.log_tail()}")
    arrivals = [at for at, _ in target.dump()]
    return {
        "timers": expected,
        "fired": len(arrivals),
        "fired_per_s": len(arrivals) / max((max(arrivals) - due) / 1000, 1e-3),
        **lag_stats([at - due for at in arrivals]).as_dict(),
        "cpu_s": cpu1 - cpu0,
        "cpu_us_per_command": (cpu1 - cpu0) / max(len(arrivals), 1) * 1e6,
        "peak_rss_mb": rss,
    }


def _first_due(db: Path) -> int:
    """The earliest due time of the timers the log's commits schedule."""
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        dues = [
            e["body"]["due_at"]
            for (doc,) in conn.execute("SELECT doc FROM log")
            for e in json.loads(doc)["events"]
            if e["name"] == "TimerScheduled"
        ]
    finally:
        conn.close()
    return min(dues)


def _steady_commits(count: int, due_at: int, tick: int) -> list[Any]:
    from wowd.model import AggregateRef, Commit, DomainEvent

    commits = []
    for i in range(count):
        agg_id = f"s{tick}-{i}"
        scheduled = {
            "key": "remind",
            "due_at": due_at,
            "rule": {"type": "once"},
            "target": {"context": "billing", "aggregate": "invoice", "id": agg_id},
            "command": {"name": "remind", "body": {"due": due_at}},
        }
        commits.append(
            Commit(
                ref=AggregateRef(context=BENCH_CONTEXT, aggregate="order", id=agg_id),
                version=1,
                command_id=uuid.uuid4().hex,
                request_id=uuid.uuid4().hex,
                create_time=due_at,
                events=(DomainEvent(id=uuid.uuid4().hex, name="TimerScheduled", body=scheduled),),
            )
        )
    return commits


def http_steady(
    target: Target, rate: float, seconds: float, concurrency: int = 64, *, delay_ms: int = 1000, drain_s: float = 30
) -> dict[str, Any]:
    """One replica firing over HTTP; this process appends ``rate`` commits a second, each
    scheduling one timer due ``delay_ms`` after its append, for ``seconds``."""
    from wowd.stores.embedded.log import EmbeddedLog

    target.reset()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        db = tmp / "wowd.db"
        create_timer_tables(db)
        with daemons(tmp, db, 1, limit=1, extra_env=_http_env(target, concurrency, None)) as ds:
            (d,) = ds

            async def produce() -> int:
                log = EmbeddedLog(db, context=BENCH_CONTEXT, partitions=PARTITIONS)
                await log.prepare()
                added = tick = 0
                start = time.monotonic()
                try:
                    while (elapsed := time.monotonic() - start) < seconds:
                        want = int(rate * elapsed) - added
                        if want > 0:
                            await log.append_many(_steady_commits(want, now_ms() + delay_ms, tick))
                            added += want
                            tick += 1
                        await anyio.sleep(0.005)
                finally:
                    await log.close()
                return added

            _, cpu0 = d.stats()
            added = anyio.run(produce)
            try:
                wait_until(lambda: target.count() >= added, drain_s + delay_ms / 1000, "target", 0.05)
            except TimeoutError:
                pass
            _, cpu1 = d.stats()
    lags = [at - json.loads(body)["due"] for at, body in target.dump()]
    return {
        "rate": rate,
        "concurrency": concurrency,
        "offered_per_s": added / seconds,
        "added": added,
        "fired": len(lags),
        **lag_stats(lags).as_dict(),
        "cpu_s": cpu1 - cpu0,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(Path(sys.argv[2]))
    else:
        sys.exit("usage: python -m bench.http_delivery serve PORT_FILE")
