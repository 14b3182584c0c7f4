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
from tests.factories import eventually
from wowd.daemon import http
from wowd.daemon.http import HttpServer
from wowd.daemon.systemd import SystemdNotifier
from wowd.metrics import HTTP_REFUSED

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


@pytest.mark.parametrize(
    ("host", "allowed", "ok"),
    [
        (None, (), True),  # HTTP/1.0 without a Host: no browser sends that
        ("127.0.0.1:9180", (), True),
        ("10.1.2.3", (), True),
        ("[::1]:9180", (), True),
        ("[::1:9180", (), False),
        ("localhost:9180", (), True),
        ("LOCALHOST.", (), True),
        ("grafana.localhost", (), True),
        ("rebind.attacker.example:9180", (), False),
        ("wowd-1:9180", (), False),
        ("wowd-1:9180", ("wowd-1",), True),
        ("WOWD-1.", ("wowd-1",), True),
        ("ops.example.com", (".example.com",), True),
        ("example.com", (".example.com",), True),
        ("badexample.com", (".example.com",), False),
        ("anything", ("*",), True),
        ("", (), False),
        (":9180", (), False),
    ],
)
def test_a_host_is_an_address_localhost_or_an_allowed_name(
    host: str | None, allowed: tuple[str, ...], ok: bool
) -> None:
    assert http.host_allowed(host, allowed) is ok


async def test_a_request_naming_another_host_is_refused_before_anything_is_read() -> None:
    """A page of another site whose name was made to point here (DNS rebinding) sends its own
    name as the Host: refused (400, counted), while probes and scrapes by address go through."""
    asked: list[str] = []

    async def app(request: http.HttpRequest) -> http.HttpResponse:
        asked.append(request.target)
        return http.HttpResponse(200, "text/plain", b"a command body\n")

    refused = HTTP_REFUSED.labels(reason="host")._value.get()
    server = HttpServer("127.0.0.1", 0, lambda holding: (True, "ok"), app=app, allowed_hosts=["wowd.internal"])
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for host in ("rebind.attacker.example", f"rebind.attacker.example:{port}"):
                for path in ("/api/v1/timers", "/metrics", "/healthz"):
                    r = await client.get(path, headers={"host": host})
                    assert r.status_code == 400 and "Host" in r.text, (host, path)
            assert asked == [] and HTTP_REFUSED.labels(reason="host")._value.get() == refused + 6
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "wowd.internal", f"[::1]:{port}"):
                assert (await client.get("/api/v1/timers", headers={"host": host})).status_code == 200, host
        tg.cancel_scope.cancel()


async def test_a_reader_that_does_not_read_is_dropped_after_the_write_timeout() -> None:
    """A client asks for a large answer and never reads it: after the write timeout its
    connection is reset and the answer freed, not held for as long as the client likes."""
    big = b"x" * (16 * 1024 * 1024)

    async def app(request: http.HttpRequest) -> http.HttpResponse:
        return http.HttpResponse(200, "text/plain", big)

    dropped = HTTP_REFUSED.labels(reason="slow reader")._value.get()
    server = HttpServer("127.0.0.1", 0, lambda holding: (True, "ok"), app=app, write_timeout_s=0.3)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        with socket.socket() as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", port))
            reader.sendall(b"GET /ui/big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")

            async def dropped_it() -> bool:
                return not server.connections and HTTP_REFUSED.labels(reason="slow reader")._value.get() > dropped

            await eventually(dropped_it, 5, "the reader dropped")  # the defect: held until the client goes
            reader.setblocking(False)
            received = 0
            with pytest.raises(ConnectionResetError), anyio.fail_after(5):
                while True:  # what the kernel had of the answer, then the reset
                    await anyio.wait_readable(reader)
                    chunk = reader.recv(1 << 20)
                    assert chunk, "a reset, not an orderly end"
                    received += len(chunk)
            assert received < len(big)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.get("/healthz")).status_code == 200
        tg.cancel_scope.cancel()


async def test_idle_connections_at_the_cap_make_room_for_a_probe() -> None:
    """Clients that connect and send nothing fill the connection cap: each new connection closes
    the one that waited longest without a request, so the listener stays within its cap and a
    probe is still answered."""
    server = HttpServer("127.0.0.1", 0, lambda holding: (True, "ok"), max_connections=8, request_timeout_s=60)
    closed = HTTP_REFUSED.labels(reason="cap")._value.get()
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve)
        idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(40)]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
                assert (await client.get("/healthz")).status_code == 200
            assert server.connections <= 8
            assert HTTP_REFUSED.labels(reason="cap")._value.get() - closed >= 40 + 1 - 8
        finally:
            for stream in idle:
                await stream.aclose()
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
