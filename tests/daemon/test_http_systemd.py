"""The health/metrics listener and sd_notify, in-process."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

import wowd.metrics  # noqa: F401  (registers every metric)
from wowd.daemon import http
from wowd.daemon.http import HttpServer
from wowd.daemon.systemd import SystemdNotifier

pytestmark = pytest.mark.anyio


async def test_endpoints_on_port_zero(tmp_path: Path) -> None:
    ready = False
    holds = False

    def readiness(holding: bool) -> tuple[bool, str]:
        if not ready:
            return False, "slot 0 stalled: sink: disk full"
        if holding and not holds:
            return False, "standby"
        return True, "holding slot 0" if holds else "standby"

    server = HttpServer("127.0.0.1", 0, readiness, port_file=tmp_path / "port")
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        assert port > 0 and (tmp_path / "port").read_text().strip() == str(port)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/healthz")).status_code == 200
            r = await client.get("/readyz")
            assert r.status_code == 503 and r.text == "not ready: slot 0 stalled: sink: disk full\n"
            ready = True
            assert (await client.get("/readyz")).status_code == 200  # a healthy standby
            assert (await client.get("/readyz?holding=1")).status_code == 503
            holds = True
            r = await client.get("/readyz?holding=1")
            assert r.status_code == 200 and r.text == "ready: holding slot 0\n"
            r = await client.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            names = {f.name for f in text_string_to_metric_families(r.text)}
            assert {"wowd_timers_fired", "wowd_feed_commits", "wowd_fire_lag_seconds"} <= names
            assert (await client.get("/nope")).status_code == 404
            assert (await client.post("/metrics")).status_code == 405
            # garbage on the wire: answered 400 (or dropped), the listener keeps serving
            stream = await anyio.connect_tcp("127.0.0.1", port)
            async with stream:
                await stream.send(b"\x00\x01 not http\r\n\r\n")
                try:
                    answer = await stream.receive()
                except anyio.EndOfStream:
                    answer = b""
            assert answer == b"" or answer.startswith(b"HTTP/1.1 400")
            assert (await client.get("/healthz")).status_code == 200
        tg.cancel_scope.cancel()


async def test_metrics_refreshes_before_each_scrape_and_serves_the_last_value_when_it_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http, "REFRESH_TIMEOUT_S", 0.25)  # the bound a hanging refresh is waited for
    registry = CollectorRegistry()
    depth = Gauge("depth", "a gauge read from a store", registry=registry)
    count = 3
    hang = False
    go = anyio.Event()
    started = 0

    async def refresh() -> None:
        nonlocal started
        started += 1
        if hang:
            await go.wait()
        depth.set(count)

    def value(text: str) -> float:
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "depth"]
        return family.samples[0].value

    server = HttpServer("127.0.0.1", 0, lambda holding: (True, "ok"), registry=registry, refresh=refresh)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert value((await client.get("/metrics")).text) == 3
            count = 5
            assert value((await client.get("/metrics")).text) == 5  # counted for this scrape
            assert started == 2
            assert (await client.get("/healthz")).status_code == 200 and started == 2
            hang, count = True, 8
            begun = anyio.current_time()
            assert value((await client.get("/metrics")).text) == 5  # the last value, within the bound
            assert value((await client.get("/metrics")).text) == 5
            assert anyio.current_time() - begun < 2 * http.REFRESH_TIMEOUT_S + 3
            assert started == 3  # the second scrape joined the refresh still running
            go.set()
            hang = False
            with anyio.fail_after(5):
                while value((await client.get("/metrics")).text) != 8:
                    pass
        tg.cancel_scope.cancel()


async def test_sd_notify_datagrams(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
        assert n.enabled and n.watchdog_interval == 2.0
        assert n.ready("holding slot 0")
        assert sock.recv(4096) == b"READY=1\nSTATUS=holding slot 0"
        assert n.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert n.stopping()
        assert sock.recv(4096).startswith(b"STOPPING=1")


async def test_sd_notify_abstract_namespace() -> None:
    name = f"wowd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert SystemdNotifier({"NOTIFY_SOCKET": "@" + name}).status("standby")
        assert sock.recv(4096) == b"STATUS=standby"


def test_sd_notify_absent_or_other_pid_is_a_noop() -> None:
    n = SystemdNotifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert not n.enabled and n.watchdog_interval is None and not n.ready("x")
    assert not SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent/socket"}).watchdog()
