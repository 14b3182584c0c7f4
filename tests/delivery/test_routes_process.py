"""Routes through a real ``wowd run``: 1,000 timers over two bounded contexts, each context's
service on its own port requiring its own credential and checking the Standard Webhooks signature
with the documented recipe (written here, not wowd's code). Each request reaches its own service
with its own credential and a valid signature (one service still on the old secret of a rotation);
a route with a wrong secret is refused (401) and its timers FAILED; a timer of an unrouted context
is FAILED at once; a service requiring a client certificate (mutual TLS) takes wowd's."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from tests.certs import Pki, make_pki
from tests.factories import commit, event, eventually, now_ms, ref, scheduled
from tests.processes import SECRET_TOKEN, Replica, base_env
from wowd.model import Commit, TimerStatus
from wowd.stores.base import Backend

pytestmark = [pytest.mark.anyio, pytest.mark.process]


def _secret(label: str) -> str:
    return "whsec_" + base64.b64encode(f"{label}-signing-key".ljust(32, "!").encode()).decode()


ORDER_SECRET = _secret("order")
WRONG_SECRET = _secret("not-the-order")
PAY_NEW, PAY_OLD = _secret("payment-new"), _secret("payment-old")
GLOBAL_SECRET = _secret("gateway-wide")
ORDER_TOKEN = "order-token-3141"
PAY_TOKEN = "payment-key-2718"
LEDGER_TOKEN = "ledger-token-1618"
PER_CONTEXT = 500
FAILING = 5
"""Timers of the route with the wrong secret, of the unrouted context and of the mTLS service."""


def recipe_ok(secret: str, headers: web.Request, body: bytes, tolerance_s: int = 300) -> bool:
    """Standard Webhooks, as docs/delivery.md gives it: ``v1,`` base64 HMAC-SHA256 over
    ``{id}.{timestamp}.{body}``, keyed with the base64-decoded secret after ``whsec_``."""
    msg_id = headers.headers.get("webhook-id", "")
    stamp = headers.headers.get("webhook-timestamp", "")
    if not msg_id or not stamp.isdigit() or abs(time.time() - int(stamp)) > tolerance_s:
        return False
    key = base64.b64decode(secret[len("whsec_") :])
    mac = hmac.new(key, msg_id.encode() + b"." + stamp.encode() + b"." + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(mac).decode()
    return any(hmac.compare_digest(expected, s) for s in headers.headers.get("webhook-signature", "").split(" "))


@dataclass
class Service:
    """One bounded context's command endpoint: takes a request with its credential and a
    signature of its secret, answers 401 otherwise."""

    name: str
    credential: tuple[str, str]
    secret: str
    accepted: dict[str, str] = field(default_factory=dict)
    """Target aggregate id -> request id, of the requests taken."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(target aggregate id, why)."""
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    peers: set[str] = field(default_factory=set)
    """Common names of the client certificates presented."""
    on_request: Callable[[], None] = lambda: None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        agg_id = request.match_info["id"]
        self.headers_seen.append(dict(request.headers))
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        if cert:
            self.peers.add(dict(x[0] for x in cert["subject"])["commonName"])
        header, value = self.credential
        try:
            if request.headers.get(header) != value:
                self.refused.append((agg_id, "credential"))
                return web.json_response({"errorMsg": "unauthorized"}, status=401)
            if request.headers.get("webhook-id") != request.headers.get("command-request-id"):
                self.refused.append((agg_id, "webhook-id"))
                return web.json_response({"errorMsg": "webhook-id is not the request id"}, status=400)
            if not recipe_ok(self.secret, request, body):
                self.refused.append((agg_id, "signature"))
                return web.json_response({"errorMsg": "bad signature"}, status=401)
            self.accepted[agg_id] = request.headers["command-request-id"]
            return web.json_response({})
        finally:
            self.on_request()


@asynccontextmanager
async def serving(service: Service, ssl_context: object = None) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/svc/{aggregate}/{id}/{command}", service.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)  # type: ignore[arg-type]
    await site.start()
    scheme = "https" if ssl_context else "http"
    try:
        yield f"{scheme}://127.0.0.1:{runner.addresses[0][1]}/svc"
    finally:
        await runner.cleanup()


def _commit(owner_id: str, targets: list[tuple[str, str, str]]) -> Commit:
    """One commit of order ``owner_id`` scheduling a timer, due now, per ``(context, aggregate,
    id)`` target."""
    now = now_ms()
    timers = [
        scheduled(
            f"k{i}",
            now,
            target=ref(agg_id, context=context, aggregate=aggregate),
            command="expire",
            body={"target": agg_id},
        )
        for i, (context, aggregate, agg_id) in enumerate(targets)
    ]
    return commit(owner_id, 1, event(), *timers, create_time=now)


def _toml(order_url: str, pay_url: str, ledger_url: str, pki: Pki) -> str:
    """The replica's configuration file: the gateway and its routes, in the order they match (each
    value written as JSON, which TOML reads alike for strings, numbers and lists)."""
    gateway = {"kind": "http", "ca_certs": str(pki.ca), "signing_secrets": [GLOBAL_SECRET]}
    routes: list[dict[str, object]] = [
        {"match": "order.invoice", "url": order_url, "token": ORDER_TOKEN, "signing_secrets": [WRONG_SECRET]},
        {"match": "order", "url": order_url, "token": ORDER_TOKEN, "signing_secrets": [ORDER_SECRET]},
        {"match": "payment", "url": pay_url, "token": PAY_TOKEN, "api_key_header": "X-Api-Key",
         "per_target_concurrency": 8, "signing_secrets": [PAY_NEW, PAY_OLD]},
        {"match": "ledger", "url": ledger_url, "token": LEDGER_TOKEN, "client_cert": str(pki.client_cert),
         "client_key": str(pki.client_key)},
    ]  # fmt: skip
    lines = ["[gateway]", *(f"{k} = {json.dumps(v)}" for k, v in gateway.items())]
    for route in routes:
        lines += ["", "[[gateway.routes]]", *(f"{k} = {json.dumps(v)}" for k, v in route.items())]
    return "\n".join(lines) + "\n"


async def test_each_context_reaches_its_service_with_its_credentials_and_signature(
    spawn: Callable[..., Replica], db: Path, stores: Backend, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path / "pki")
    order = Service("order", ("authorization", f"Bearer {ORDER_TOKEN}"), ORDER_SECRET)
    payment = Service("payment", ("x-api-key", PAY_TOKEN), PAY_OLD)  # not rotated yet: the old secret
    ledger = Service("ledger", ("authorization", f"Bearer {LEDGER_TOKEN}"), GLOBAL_SECRET)
    expected = {
        "order": {f"order-{i}" for i in range(PER_CONTEXT)},
        "payment": {f"pay-{i}" for i in range(PER_CONTEXT)},
        "ledger": {f"ledger-{i}" for i in range(FAILING)},
    }
    invoices = {f"invoice-{i}" for i in range(FAILING)}
    all_in = anyio.Event()

    def progress() -> None:
        if (
            set(order.accepted) >= expected["order"]
            and set(payment.accepted) >= expected["payment"]
            and set(ledger.accepted) >= expected["ledger"]
            and {i for i, _ in order.refused} >= invoices
        ):
            all_in.set()

    for s in (order, payment, ledger):
        s.on_request = progress

    async with (
        serving(order) as order_url,
        serving(payment) as pay_url,
        serving(ledger, pki.server_context(require_client_cert=True)) as ledger_url,
    ):
        config = tmp_path / "wowd.toml"
        config.write_text(_toml(order_url, pay_url, ledger_url, pki))
        env = base_env(db, WOWD_CONFIG=config, WOWD_LEASE__LIMIT=1, WOWD_TIMERS__LOOKAHEAD_MS=0)
        r = spawn("router", env)
        await r.wait_ready(30)

        targets = (
            [("order", "order", i) for i in sorted(expected["order"])]
            + [("payment", "payment", i) for i in sorted(expected["payment"])]
            + [("ledger", "entry", i) for i in sorted(expected["ledger"])]
            + [("order", "invoice", i) for i in sorted(invoices)]
            + [("shipping", "parcel", f"parcel-{i}") for i in range(FAILING)]
        )
        for n in range(0, len(targets), 10):
            await stores.log.append(_commit(f"o-{n}", targets[n : n + 10]))

        with anyio.fail_after(60):
            await all_in.wait()

        async def failed() -> bool:
            return len(await stores.timer_queries.scan(status=TimerStatus.FAILED, limit=100)) >= 2 * FAILING

        await eventually(failed, 30, "the wrong-secret and unrouted timers FAILED")
        metrics_text = (await r.get("/metrics")).text

    # each request reached its own service, with that service's credential and a valid signature
    for service in (order, payment, ledger):
        assert set(service.accepted) == expected[service.name], service.name
    assert sorted(order.refused) == sorted((i, "signature") for i in invoices)  # the wrong secret: 401
    assert not payment.refused and not ledger.refused
    for h in payment.headers_seen:  # a rotation: both secrets sign, the service knows the old one
        assert len(h["webhook-signature"].split(" ")) == 2 and "Authorization" not in h
    assert ledger.peers == {pki.client_cn}  # mutual TLS: wowd's client certificate
    seen = order.headers_seen + payment.headers_seen + ledger.headers_seen
    assert not any(SECRET_TOKEN in v for h in seen for v in h.values())  # gateway.token is no route's

    failed_timers = {t.target.id: t for t in await stores.timer_queries.scan(status=TimerStatus.FAILED, limit=100)}
    assert set(failed_timers) == invoices | {f"parcel-{i}" for i in range(FAILING)}
    for i in invoices:
        assert failed_timers[i].last_error == "HTTP 401: bad signature"
    for i in range(FAILING):
        parcel = failed_timers[f"parcel-{i}"]
        assert parcel.last_error == "no route for shipping.parcel"
        assert parcel.attempts <= 1  # failed at once, never retried
    assert not await stores.timer_queries.scan(status=TimerStatus.PENDING, limit=10)
    assert re.search(r'^wowd_gateway_unrouted_total\{target="shipping.parcel"\} 5\.0$', metrics_text, re.M)
    assert re.search(r'^wowd_gateway_requests_total\{outcome="delivered",route="order"\} 500\.0$', metrics_text, re.M)
    assert re.search(r'^wowd_gateway_requests_total\{outcome="fail",route="order.invoice"\} 5\.0$', metrics_text, re.M)

    log = r.log()
    assert "delivery to order.invoice via route order.invoice failed for good: HTTP 401" in log
    assert "delivery to shipping.parcel failed for good: no route for shipping.parcel" in log
    for secret in (ORDER_TOKEN, PAY_TOKEN, LEDGER_TOKEN, SECRET_TOKEN, ORDER_SECRET, PAY_OLD, PAY_NEW, WRONG_SECRET):
        assert secret not in log and secret not in metrics_text
