"""The command gateways: outcome mapping, the Wow REST shape, credentials, TLS, bad answers, the
per-target limit, the circuit breaker and the outcome log. The http gateway talks to a real local
HTTP server (aiohttp.web) over sockets."""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import pytest
from aiohttp import web
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from pydantic import SecretStr

from tests.delivery.conftest import claimed, serving, status
from tests.helpers import stream_all
from wowd.config import GatewaySettings
from wowd.daemon.stream import target_limits
from wowd.delivery import (
    CircuitBreaker,
    Delivered,
    DeliveryLog,
    Fail,
    HttpGateway,
    OutboxGateway,
    Outcome,
    Park,
    Retry,
    command_url,
    outcome_for_status,
    request_parts,
    target_of,
)
from wowd.delivery.outbox import outbox_entry
from wowd.errors import ConfigError, StorageUnavailable
from wowd.model import Command, OutboxEntry, Timer

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, Delivered),
        (201, Delivered),
        (204, Delivered),
        (404, Park),
        (408, Retry),
        (409, Retry),
        (425, Retry),
        (429, Retry),
        (500, Retry),
        (503, Retry),
        (400, Fail),
        (401, Fail),
        (403, Fail),
        (422, Fail),
        (302, Fail),
    ],
)
def test_status_mapping(status: int, kind: type) -> None:
    assert isinstance(outcome_for_status(status), kind)


def test_retry_after_is_a_hint_and_bounded() -> None:
    r = outcome_for_status(429, "7")
    assert isinstance(r, Retry) and r.after_s == 7.0
    r = outcome_for_status(503, "Wed, 21 Oct 2015 07:28:00 GMT")
    assert isinstance(r, Retry) and r.after_s == 0.0


def test_command_url_follows_wow_rest_shape() -> None:
    assert command_url("http://h/api/", claimed()) == "http://h/api/order/order-1/expire-order"
    assert (
        command_url("http://h", claimed(tenant="t 1", agg_id="a/b")) == "http://h/tenant/t%201/order/a%2Fb/expire-order"
    )


SEGMENT = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)
"""An id or a command name that makes a path segment of its own (not ``.`` or ``..``)."""


@given(agg_id=SEGMENT, tenant=SEGMENT, name=SEGMENT)
@example(agg_id="a-b_c.d~e", tenant="(0)", name="remind")
@example(agg_id="...", tenant="t/../x", name="ä")
def test_command_url_encodes_each_segment_like_quote(agg_id: str, tenant: str, name: str) -> None:
    url = command_url("http://h/api", claimed(agg_id=agg_id, tenant=tenant, name=name))
    in_tenant = "" if tenant == "(0)" else f"tenant/{quote(tenant, safe='')}/"
    assert url == f"http://h/api/{in_tenant}order/{quote(agg_id, safe='')}/{quote(name, safe='')}"


@pytest.mark.parametrize(
    ("agg_id", "tenant", "name", "says"),
    [
        ("..", "(0)", "purge", "the target id '..'"),
        (".", "(0)", "purge", "the target id '.'"),
        ("", "(0)", "purge", "the target id ''"),
        ("o-1", "..", "purge", "the tenant id '..'"),
        ("o-1", "(0)", "..", "the command name '..'"),
    ],
)
async def test_a_dot_segment_fails_the_timer_without_a_request(agg_id: str, tenant: str, name: str, says: str) -> None:
    """``POST /api/order/../purge`` leaves the route's base path (a proxy resolves it to
    ``/api/purge``, with the route's credentials): such a timer fails, and nothing is sent."""
    async with serving(status(200)) as (srv, url):
        gw = gateway(url, token=SecretStr("route-token-1234"))
        try:
            out = await gw.send(claimed(agg_id=agg_id, tenant=tenant, name=name))
        finally:
            await gw.aclose()
    assert isinstance(out, Fail) and out.reason.startswith(f"refused: {says}"), out
    assert srv.seen == []


def test_request_parts_keep_the_body_as_json_says_it() -> None:
    big = 2**70 + 1
    doc = {"amount": big, "who": "Zoë", "f": 1.5, "l": [1, None]}
    name, body, body_type = request_parts(Command(name="pay", body=doc, body_type="x.Pay").to_json())
    assert (name, body_type) == ("pay", "x.Pay")
    assert json.loads(body) == doc
    # what the standard encoder writes for what is not JSON (NaN) goes as it was
    assert request_parts('{"name":"n","body":{"x":NaN}}')[1] == b'{"x":NaN}'
    assert request_parts('{"name":"n"}') == ("n", b"{}", None)
    for bad in ("{", '{"body":{}}', "[1]", '{"name":"n","body":3}'):
        with pytest.raises((ValueError, KeyError, TypeError)):
            request_parts(bad)


def gateway(url: str, **kw: Any) -> HttpGateway:
    pool_size = kw.pop("pool_size", 4)
    outcomes = kw.pop("outcomes", None)
    clock = kw.pop("clock", None)
    settings = GatewaySettings(kind="http", url=url, timeout_s=kw.pop("timeout_s", 2.0), **kw)
    extra: dict[str, Any] = {"clock": clock} if clock else {}
    return HttpGateway(settings, pool_size=pool_size, outcomes=outcomes, **extra)


async def test_http_gateway_posts_the_command_with_request_id_type_and_bearer() -> None:
    async with serving(status(200, text='{"ok": true}', content_type="application/json")) as (srv, url):
        gw = gateway(url, token=SecretStr("s3cr3t-token"))
        try:
            t = claimed()
            assert isinstance(await gw.send(t), Delivered)
        finally:
            await gw.aclose()
    method, path, headers, body = srv.seen[0]
    assert method == "POST"
    assert path == "/api/order/order-1/expire-order"
    assert headers["command-request-id"] == t.request_id
    assert headers["command-type"] == "demo.Expire"
    assert headers["authorization"] == "Bearer s3cr3t-token"
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"reason": "late"}


async def test_http_gateway_asks_for_no_compression_and_keeps_no_cookies() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(status=200)
        resp.set_cookie("session", "abc")
        return resp

    async with serving(handler) as (srv, url):
        gw = gateway(url)
        try:
            for i in range(2):
                assert isinstance(await gw.send(claimed(agg_id=f"a{i}")), Delivered)
        finally:
            await gw.aclose()
    for _method, _path, headers, _body in srv.seen:
        assert headers["accept-encoding"] == "identity" and "cookie" not in headers


async def test_http_gateway_unreadable_command_fails_without_a_request() -> None:
    async with serving(status(200)) as (srv, url):
        gw = gateway(url)
        try:
            out = await gw.send(replace(claimed(), body='{"body": {}}'))
        finally:
            await gw.aclose()
    assert isinstance(out, Fail) and out.reason.startswith("unreadable command")
    assert srv.seen == []


async def test_http_gateway_api_key_header() -> None:
    async with serving(status(202)) as (srv, url):
        gw = gateway(url, token=SecretStr("k3y"), api_key_header="X-Api-Key")
        try:
            assert isinstance(await gw.send(claimed()), Delivered)
        finally:
            await gw.aclose()
    headers = srv.seen[0][2]
    assert headers["x-api-key"] == "k3y" and "authorization" not in headers


async def test_http_gateway_keeps_one_connection_alive() -> None:
    peers: set[Any] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(status=200)

    async with serving(handler) as (_srv, url):
        gw = gateway(url, pool_size=1)
        try:
            for i in range(5):
                assert isinstance(await gw.send(claimed(agg_id=f"a{i}")), Delivered)
        finally:
            await gw.aclose()
    assert len(peers) == 1, "five sequential sends on one kept-alive connection"


async def test_http_gateway_bad_answers_never_raise() -> None:
    async with serving(status(400, body=b"<html>" + b"x" * 5_000_000)) as (_srv, url):
        gw = gateway(url)
        try:
            out = await gw.send(claimed())
        finally:
            await gw.aclose()
    assert isinstance(out, Fail) and len(out.reason) < 300

    async with serving(status(404, text='{"errorMsg": "aggregate not found"}')) as (_srv, url):
        gw = gateway(url)
        try:
            out = await gw.send(claimed())
        finally:
            await gw.aclose()
    assert isinstance(out, Park) and "aggregate not found" in out.reason

    async def slow(request: web.Request) -> web.StreamResponse:
        await srv.gate.wait()  # a target that does not answer within the gateway's timeout
        return web.Response(status=200)

    async with serving(slow) as (srv, url):
        gw = gateway(url, timeout_s=0.1)
        try:
            with anyio.fail_after(3):
                out = await gw.send(claimed())
        finally:
            await gw.aclose()
    assert isinstance(out, Retry) and "timeout" in out.reason


async def test_http_gateway_secret_not_in_reasons() -> None:
    async def echo(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text=str(dict(request.headers)))

    async with serving(echo) as (_srv, url):
        gw = gateway(url, token=SecretStr("planted-secret-xyz"))
        try:
            out = await gw.send(claimed())
        finally:
            await gw.aclose()
    assert isinstance(out, Retry) and out.reason.startswith("HTTP 500")
    assert "planted-secret-xyz" not in out.reason and "***" in out.reason


def _u_escaped(text: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in text)


@pytest.mark.parametrize(
    "answer",
    [
        lambda token: json.dumps({"message": f"bad token {token}"}).replace("/", "\\/"),
        lambda token: '{"message": "bad token ' + _u_escaped(token) + '"}',
        lambda token: '{"message": "bad token ' + _u_escaped(token) + '", "cut": "sh',  # no JSON: cut short
    ],
    ids=["solidus escaped", "unicode escapes", "cut short"],
)
async def test_http_gateway_masks_a_token_echoed_with_json_escapes(answer: Callable[[str], str]) -> None:
    """A target that echoes the token in JSON spells it as it likes: the reason (stored as the
    timer's last error) never holds it, however it was escaped."""
    token = "planted/secret-xyz-0042"

    async def echo(request: web.Request) -> web.StreamResponse:
        return web.Response(status=400, text=answer(request.headers["authorization"].removeprefix("Bearer ")))

    async with serving(echo) as (_srv, url):
        gw = gateway(url, token=SecretStr(token))
        try:
            out = await gw.send(claimed())
        finally:
            await gw.aclose()
    assert isinstance(out, Fail) and "bad token" in out.reason, out
    assert token not in out.reason and "secret-xyz" not in out.reason and "\\u0073" not in out.reason
    assert "***" in out.reason


async def test_http_gateway_deliver_reports_each_timer() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if request.path.endswith("/ok") else 404)

    async with serving(handler) as (_srv, url):
        gw = gateway(url)
        timers = [claimed(agg_id=f"a{i}", name="ok" if i % 2 else "nope") for i in range(10)]
        got: list[tuple[str, Outcome]] = []
        try:
            for t in timers:
                got.append((t.target.id, await gw.send(t)))
        finally:
            await gw.aclose()
    assert len(got) == 10
    assert {i for i, o in got if isinstance(o, Delivered)} == {f"a{i}" for i in range(1, 10, 2)}


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl's command line) and its key."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_http_gateway_tls_verifies_against_the_given_cas_or_not_at_all(self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    async with serving(status(200), ssl_context=server_ctx) as (srv, url):
        outcomes = {}
        for name, kw in {
            "system CAs": {},
            "given CA": {"ca_certs": cert},
            "verify off": {"verify_certs": False},
        }.items():
            gw = gateway(url, **kw)
            try:
                outcomes[name] = await gw.send(claimed())
            finally:
                await gw.aclose()
    assert isinstance(outcomes["system CAs"], Retry), "a certificate no system CA signed is refused"
    assert "certificate" in outcomes["system CAs"].reason.lower()
    assert isinstance(outcomes["given CA"], Delivered) and isinstance(outcomes["verify off"], Delivered)
    assert len(srv.seen) == 2


def test_http_gateway_with_an_unreadable_ca_file_refuses_to_start(tmp_path: Path) -> None:
    # at start-up, naming the setting: not a Retry on every delivery of a replica reporting ready
    missing = tmp_path / "no-such-ca.pem"
    with pytest.raises(ConfigError, match=r"gateway\.ca_certs: cannot load .*no-such-ca\.pem"):
        gateway("https://127.0.0.1:1/", ca_certs=missing)


def test_http_gateway_loads_its_client_when_made_not_at_the_first_delivery() -> None:
    # importing aiohttp and reading the CA bundle stall the event loop for a tenth of a second or
    # more: a replica pays it before it is ready, an outbox replica never
    code = (
        "import sys\n"
        "from wowd.config import GatewaySettings\n"
        "from wowd.delivery import HttpGateway\n"
        "assert 'aiohttp' not in sys.modules\n"
        "HttpGateway(GatewaySettings(kind='http', url='https://127.0.0.1:1/'), pool_size=1)\n"
        "assert 'aiohttp' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- per-target limit


async def test_per_target_limit_holds_and_other_targets_are_not_held_up() -> None:
    """The http gateway under the delivery stream's limits: a target whose requests wait has at
    most its limit in flight, and another target's timer goes out meanwhile."""
    in_flight = {"order": 0, "cart": 0}
    most = {"order": 0, "cart": 0}
    three_waiting = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        agg = request.path.split("/")[2]
        in_flight[agg] += 1
        most[agg] = max(most[agg], in_flight[agg])
        try:
            if agg == "order":
                if in_flight["order"] == 3:
                    three_waiting.set()
                await srv.gate.wait()
            return web.Response(status=200)
        finally:
            in_flight[agg] -= 1

    timers = [claimed(agg_id=f"o{i}") for i in range(10)] + [claimed(agg_id="c1", aggregate="cart")]
    got: dict[str, Outcome] = {}
    cart_done = anyio.Event()

    def record(t: Timer, o: Outcome) -> None:
        got[t.target.id] = o
        if t.target.aggregate == "cart":
            cart_done.set()

    async with serving(handler) as (srv, url):
        gw = gateway(url, pool_size=8)
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream_all, gw, [timers], record, target_limits(8, lambda _target: 3))
                    await three_waiting.wait()
                    await cart_done.wait()  # not held up behind the order target's slots
                    assert in_flight["order"] == 3 and len(got) == 1
                    srv.gate.set()
        finally:
            await gw.aclose()
    assert len(got) == 11 and all(isinstance(o, Delivered) for o in got.values())
    assert most["order"] == 3


async def test_per_target_limit_holds_across_batches_put_at_once() -> None:
    """Two batches for one target put on the stream at once (two rounds in flight): the target
    never has more than its limit in flight."""
    in_flight = 0
    most = 0
    two_waiting = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            if in_flight == 2:
                two_waiting.set()
            await srv.gate.wait()
            return web.Response(status=200)
        finally:
            in_flight -= 1

    first = [claimed(agg_id=f"a{i}") for i in range(5)]
    second = [claimed(agg_id=f"b{i}") for i in range(5)]
    got: list[Outcome] = []
    async with serving(handler) as (srv, url):
        gw = gateway(url, pool_size=8)
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    limits = target_limits(8, lambda _target: 2)
                    tg.start_soon(stream_all, gw, [first, second], lambda t, o: got.append(o), limits)
                    await two_waiting.wait()
                    await anyio.wait_all_tasks_blocked()
                    assert in_flight == 2
                    srv.gate.set()
        finally:
            await gw.aclose()
    assert len(got) == 10 and all(isinstance(o, Delivered) for o in got)
    assert most == 2


# --------------------------------------------------------------------------- circuit breaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _metric(name: str, target: str) -> float:
    return REGISTRY.get_sample_value(name, {"target": target}) or 0.0


async def test_breaker_opens_short_circuits_then_a_trial_closes_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wowd.delivery")
    answers = [503, 503, 503, 503, 503, 200, 200]  # order x3, cart, the failed trial, then healthy

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=answers.pop(0))

    clock = Clock()
    short0 = _metric("wowd_gateway_short_circuited_total", "demo.order")
    async with serving(handler) as (srv, url):
        gw = gateway(url, breaker_failures=3, breaker_open_s=30, clock=clock, outcomes=DeliveryLog(clock=clock))
        try:
            for _ in range(3):
                assert isinstance(await gw.send(claimed()), Retry)
            assert len(srv.seen) == 3
            assert _metric("wowd_gateway_circuit_open", "demo.order") == 1
            assert any(
                r.levelno == logging.WARNING and "circuit of demo.order opened" in r.getMessage()
                for r in caplog.records
            )
            # open: answered without a request, with the time left as the retry hint
            clock.now += 10
            out = await gw.send(claimed())
            assert isinstance(out, Retry) and "circuit open" in out.reason and out.after_s == pytest.approx(20)
            assert len(srv.seen) == 3
            assert _metric("wowd_gateway_short_circuited_total", "demo.order") == short0 + 1
            # another target is not affected
            assert isinstance(await gw.send(claimed(aggregate="cart")), Retry)
            assert len(srv.seen) == 4
            # half-open: one trial; it fails (503): open again for the whole period
            clock.now += 20
            assert isinstance(await gw.send(claimed()), Retry)
            assert len(srv.seen) == 5
            assert isinstance(await gw.send(claimed()), Retry) and len(srv.seen) == 5
            # the next trial succeeds: closed
            clock.now += 30
            assert isinstance(await gw.send(claimed()), Delivered)
            assert isinstance(await gw.send(claimed()), Delivered)
            assert len(srv.seen) == 7
        finally:
            await gw.aclose()
    assert _metric("wowd_gateway_circuit_open", "demo.order") == 0
    assert any(r.levelno == logging.INFO and "circuit of demo.order closed" in r.getMessage() for r in caplog.records)


async def test_half_open_sends_one_trial_at_a_time() -> None:
    answered = anyio.Event()
    arrived = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        arrived.set()
        await answered.wait()
        return web.Response(status=200)

    clock = Clock()
    async with serving(handler) as (srv, url):
        gw = gateway(url, breaker_failures=1, breaker_open_s=5, clock=clock)
        breaker = gw.breaker("demo.order")
        breaker.record(False)  # one failure opens it (breaker_failures=1)
        assert breaker.is_open
        clock.now += 5
        results: list[Outcome] = []
        try:
            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:

                    async def trial() -> None:
                        results.append(await gw.send(claimed()))

                    tg.start_soon(trial)
                    await arrived.wait()
                    other = await gw.send(claimed(agg_id="o2"))  # while the trial is in flight
                    assert isinstance(other, Retry) and "circuit open" in other.reason
                    answered.set()
        finally:
            await gw.aclose()
    assert isinstance(results[0], Delivered) and not breaker.is_open and len(srv.seen) == 1


def test_breaker_counts_consecutive_failures_only() -> None:
    clock = Clock()
    b = CircuitBreaker("x.y", failures=3, open_s=10, clock=clock)
    for ok in (False, False, True, False, False):
        b.record(ok)
    assert not b.is_open, "a success in between resets the count"
    b.record(False)
    assert b.is_open and b.refusing() == 10
    b.record(True)  # a request sent before it opened, answering late: the circuit stays open
    assert b.is_open


# --------------------------------------------------------------------------- the outcome log


def test_delivery_log_levels_and_one_line_per_target_and_kind_per_window(caplog: pytest.LogCaptureFixture) -> None:
    """Each line names the timer (its id, owner and key) besides the request id the target saw:
    a line found by either leads to ``wowd timers show``."""
    caplog.set_level(logging.INFO, logger="wowd.test")
    clock = Clock()
    dl = DeliveryLog(logging.getLogger("wowd.test"), every_s=10, clock=clock)
    order, cart = claimed(agg_id="o-77"), claimed(aggregate="cart", agg_id="c-1")
    named = f"timer t1 of demo.order/(0)/o-77 key 'k', request id {order.request_id}"
    for _ in range(5):
        dl.outcome("demo.order", Retry(reason="HTTP 503"), order)
    dl.outcome("demo.order", Fail(reason="HTTP 400"), order)
    dl.outcome("demo.order", Park(reason="HTTP 404"), order)
    dl.outcome("demo.cart", Retry(reason="timeout after 10s"), cart)
    dl.outcome("demo.cart", Delivered(), cart)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, f"delivery to demo.order will be retried: HTTP 503 ({named})"),
        (logging.ERROR, f"delivery to demo.order failed for good: HTTP 400 ({named})"),
        (logging.INFO, f"delivery to demo.order parked: HTTP 404 ({named})"),
        (
            logging.WARNING,
            f"delivery to demo.cart will be retried: timeout after 10s (timer t1 of demo.cart/(0)/c-1 key 'k', "
            f"request id {cart.request_id})",
        ),
    ]
    caplog.clear()
    clock.now += 9.9
    dl.outcome("demo.order", Retry(reason="HTTP 503"), order)
    assert not caplog.records
    clock.now += 0.1
    dl.outcome("demo.order", Retry(reason="HTTP 502"), order)
    assert [r.getMessage() for r in caplog.records] == [
        f"delivery to demo.order will be retried: HTTP 502 ({named}); "
        "5 more like it left out of the log in the last 10s"
    ]


async def test_http_gateway_logs_its_outcomes_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wowd.delivery")
    async with serving(status(503)) as (_srv, url):
        gw = gateway(url, outcomes=DeliveryLog(clock=Clock()), breaker_failures=100)
        try:
            for i in range(20):
                await gw.send(claimed(agg_id=f"a{i}"))
        finally:
            await gw.aclose()
    retries = [r for r in caplog.records if "will be retried" in r.getMessage()]
    assert len(retries) == 1 and retries[0].levelno == logging.WARNING
    assert "demo.order" in retries[0].getMessage() and "HTTP 503" in retries[0].getMessage()


def test_target_is_context_and_aggregate() -> None:
    assert target_of(claimed(tenant="t1", agg_id="x")) == "demo.order"


class FakeOutbox:
    def __init__(self, fail: bool = False) -> None:
        self.stored: dict[str, OutboxEntry] = {}
        self.fail = fail

    async def put(self, entry: OutboxEntry) -> bool:
        if self.fail:
            raise StorageUnavailable("busy")
        if entry.request_id in self.stored:
            return False
        self.stored[entry.request_id] = entry
        return True

    async def put_many(self, entries: list[OutboxEntry]) -> list[bool]:
        return [await self.put(e) for e in entries]

    async def count(self) -> int:
        if self.fail:
            raise StorageUnavailable("busy")
        return len(self.stored)

    async def entries(self, limit: int = 1000, after: int = 0) -> list[OutboxEntry]:
        if self.fail:
            raise StorageUnavailable("busy")
        return list(self.stored.values())[after : after + limit]

    async def trim(self, before: int) -> int:
        if self.fail:
            raise StorageUnavailable("busy")
        old = [k for k, e in self.stored.items() if e.created_at < before]
        for k in old:
            del self.stored[k]
        return len(old)


async def test_outbox_gateway_writes_request_id_fence_and_owner_of_the_claim() -> None:
    box = FakeOutbox()
    gw = OutboxGateway(box)  # type: ignore[arg-type]
    t = claimed()
    assert isinstance(await gw.send(t), Delivered)
    assert isinstance(await gw.send(t), Delivered)  # a re-fire is idempotent
    (entry,) = box.stored.values()
    assert entry.request_id == t.request_id and entry.fence == 7 and entry.owner_key == "host:1:abc"
    assert entry.command == t.body and entry.scheduled_at == 900


async def test_outbox_gateway_unavailable_is_retry() -> None:
    gw = OutboxGateway(FakeOutbox(fail=True))  # type: ignore[arg-type]
    assert isinstance(await gw.send_batch([claimed()]), Retry)


async def test_outbox_gateway_trims_past_the_retention_and_counts_the_depth_when_asked(tmp_path: Path) -> None:
    from wowd.metrics import REGISTRY
    from wowd.stores.embedded.outbox import EmbeddedOutbox

    box = EmbeddedOutbox(tmp_path / "o.db")
    try:
        await box.prepare()
        old = replace(claimed(agg_id="old"), timer_id="t-old")
        await box.put(outbox_entry(old, 1_000))  # created long before the retention
        gw = OutboxGateway(box, retention_s=3600)
        fresh = [replace(claimed(agg_id=i), timer_id=f"t-{i}") for i in ("a", "b")]
        assert isinstance(await gw.send_batch(fresh), Delivered)
        assert {e.target.id for e in await box.entries()} == {"old", "a", "b"}
        await gw.housekeep()
        assert {e.target.id for e in await box.entries()} == {"a", "b"}
        await gw.count_depth()
        assert REGISTRY.get_sample_value("wowd_outbox_depth") == 2
        assert await box.ack([fresh[0].request_id]) == 1
        await gw.count_depth()
        assert REGISTRY.get_sample_value("wowd_outbox_depth") == 1
    finally:
        await box.close()


async def test_outbox_depth_keeps_its_last_count_while_the_store_fails(caplog: pytest.LogCaptureFixture) -> None:
    box = FakeOutbox()
    gw = OutboxGateway(box)  # type: ignore[arg-type]
    await gw.send(claimed())
    await gw.count_depth()
    assert REGISTRY.get_sample_value("wowd_outbox_depth") == 1
    counted = gw.depth_age()
    box.fail = True
    with caplog.at_level(logging.WARNING, logger="wowd.delivery"):
        await gw.count_depth()  # logged, not raised
        await gw.count_depth()
    assert REGISTRY.get_sample_value("wowd_outbox_depth") == 1
    assert gw.depth_age() >= counted  # the age of the last count tells
    assert len([r for r in caplog.records if "depth not counted" in r.getMessage()]) == 1  # once a streak
    box.fail = False
    box.stored.clear()
    await gw.count_depth()
    assert REGISTRY.get_sample_value("wowd_outbox_depth") == 0 and gw.depth_age() < counted + 1


async def test_outbox_housekeeping_failure_does_not_undo_a_delivery() -> None:
    box = FakeOutbox()
    gw = OutboxGateway(box, retention_s=60)  # type: ignore[arg-type]
    outcome = await gw.send(claimed())
    box.fail = True
    await gw.housekeep()  # logged, not raised
    assert isinstance(outcome, Delivered) and len(box.stored) == 1
