"""Routes of the http gateway: matching, the settings from TOML and from the environment, the
files of a route's TLS read at start-up, and each request going out with its route's URL,
credential, signature, time limit, per-target limit and client certificate; a target without a
route fails without a request. Real local HTTP servers (aiohttp.web) over sockets."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from pydantic import SecretStr

from tests.certs import Pki, make_pki
from tests.delivery.conftest import serving, status
from tests.factories import ref, timer
from tests.helpers import stream_all
from wowd.cli.logs import secret_values
from wowd.config import GatewaySettings, RouteSettings, WowdSettings, load_settings
from wowd.daemon.stream import target_limits
from wowd.delivery import Delivered, DeliveryLog, Fail, HttpGateway, Retry, target_of
from wowd.delivery.routes import FALLBACK, Routes, matches, per_target_limit
from wowd.errors import ConfigError
from wowd.model import Command, Timer, TimerStatus
from wowd.redaction import MASK

pytestmark = pytest.mark.anyio

ORDER_SECRET = "whsec_" + base64.b64encode(b"order-context-signing-key-000001").decode()
GLOBAL_SECRET = "whsec_" + base64.b64encode(b"gateway-wide-signing-key-0000001").decode()


def aimed(context: str, aggregate: str, agg_id: str = "a-1") -> Timer:
    """Order ``agg_id``'s timer, sent to ``agg_id`` of ``context.aggregate``."""
    target = ref(agg_id, context=context, aggregate=aggregate)
    go = Command(name="go", body={"n": 1})
    return timer(agg_id, 1000, target=target, command=go, status=TimerStatus.FIRING, timer_id=f"t-{target}")


def expected_signature(secret: str, headers: dict[str, str], body: bytes) -> str:
    """The documented recipe, independently of wowd."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


# --------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("match", "target", "taken"),
    [
        ("order", "order.order", True),
        ("order", "order.invoice", True),
        ("order.invoice", "order.invoice", True),
        ("order.invoice", "order.order", False),
        ("order", "orders.order", False),
        ("order", "ord.order", False),
        ("order.inv", "order.invoice", False),
    ],
)
def test_a_route_matches_its_context_or_its_target(match: str, target: str, taken: bool) -> None:
    assert matches(match, target) is taken


def test_the_first_matching_route_wins_then_the_url() -> None:
    settings = GatewaySettings(
        kind="http", url="http://fallback.test/api",
        routes=[
            RouteSettings(match="order.invoice", url="http://billing.test/"),
            RouteSettings(match="order", url="http://orders.test/"),
            RouteSettings(match="payment.refund", url="http://refunds.test/"),
        ],
    )  # fmt: skip
    routes = Routes(settings)
    assert routes.route("order.invoice").name == "order.invoice"  # type: ignore[union-attr]
    assert routes.route("order.order").name == "order"  # type: ignore[union-attr]
    assert routes.route("payment.refund").url == "http://refunds.test/"  # type: ignore[union-attr]
    assert routes.route("payment.payment").name == FALLBACK  # type: ignore[union-attr]
    assert [r.name for r in routes.all] == ["order.invoice", "order", "payment.refund", FALLBACK]
    no_fallback = Routes(settings.model_copy(update={"url": None}))
    assert no_fallback.route("payment.payment") is None and no_fallback.route("order.order") is not None


def test_a_route_inherits_the_gateways_settings_but_not_its_credential() -> None:
    settings = GatewaySettings(
        kind="http", url="http://fallback.test/", token=SecretStr("global-token"), timeout_s=7,
        per_target_concurrency=5, signing_secrets=[SecretStr(GLOBAL_SECRET)],
        routes=[
            RouteSettings(match="order", url="http://orders.test/", token=SecretStr("order-token"),
                          api_key_header="X-Api-Key", timeout_s=2, per_target_concurrency=40,
                          signing_secrets=[SecretStr(ORDER_SECRET)]),
            RouteSettings(match="payment", url="http://payments.test/"),
            RouteSettings(match="audit", url="http://audit.test/", signing_secrets=[]),
        ],
    )  # fmt: skip
    order, payment, audit, fallback = Routes(settings).all
    assert order.headers == {"x-api-key": "order-token"} and order.secret == "order-token"
    assert (order.timeout_s, order.per_target_concurrency) == (2, 40)
    assert payment.headers == {} and payment.secret == ""
    assert (payment.timeout_s, payment.per_target_concurrency) == (7, 5)
    assert fallback.headers == {"authorization": "Bearer global-token"}
    body = b"{}"
    signed = payment.signer.headers("rid", body)  # type: ignore[union-attr]
    assert signed["webhook-signature"] == expected_signature(GLOBAL_SECRET, signed, body)
    signed = order.signer.headers("rid", body)  # type: ignore[union-attr]
    assert signed["webhook-signature"] == expected_signature(ORDER_SECRET, signed, body)
    assert audit.signer is None


# --------------------------------------------------------------------------- settings

TOML = f"""
[gateway]
kind = "http"
signing_secrets = ["{GLOBAL_SECRET}"]

[[gateway.routes]]
match = "order"
url = "https://orders.test/api"
token = "order-token-1234"
timeout_s = 3.5
per_target_concurrency = 8
signing_secrets = ["{ORDER_SECRET}", "{GLOBAL_SECRET}"]

[[gateway.routes]]
match = "payment.refund"
url = "http://refunds.test"
api_key_header = "X-Api-Key"
token = "refund-token-5678"
ca_certs = "/etc/ca.pem"
client_cert = "/etc/client.pem"
client_key = "/etc/client.key"
"""

ROUTES_JSON = [
    {
        "match": "order",
        "url": "https://orders.test/api",
        "token": "order-token-1234",
        "timeout_s": 3.5,
        "per_target_concurrency": 8,
        "signing_secrets": [ORDER_SECRET, GLOBAL_SECRET],
    },
    {
        "match": "payment.refund",
        "url": "http://refunds.test",
        "api_key_header": "X-Api-Key",
        "token": "refund-token-5678",
        "ca_certs": "/etc/ca.pem",
        "client_cert": "/etc/client.pem",
        "client_key": "/etc/client.key",
    },
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key.upper().startswith("WOWD_"):
            monkeypatch.delenv(key)
    return monkeypatch


def _routes_of(settings: WowdSettings) -> list[dict[str, Any]]:
    return [
        {
            k: [s.get_secret_value() for s in v] if k == "signing_secrets" and v is not None
            else v.get_secret_value() if isinstance(v, SecretStr) else v
            for k, v in r.model_dump().items()
        }
        for r in settings.gateway.routes
    ]  # fmt: skip


def test_routes_from_toml_and_from_the_environment_are_the_same(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    config = tmp_path / "wowd.toml"
    config.write_text(TOML)
    from_file = load_settings(config)
    assert from_file.gateway.url is None  # the routes are enough
    clean_env.setenv("WOWD_GATEWAY__KIND", "http")
    clean_env.setenv("WOWD_GATEWAY__SIGNING_SECRETS", json.dumps([GLOBAL_SECRET]))
    clean_env.setenv("WOWD_GATEWAY__ROUTES", json.dumps(ROUTES_JSON))
    from_env = load_settings()
    assert _routes_of(from_file) == _routes_of(from_env)
    order, refund = _routes_of(from_env)
    assert order["match"] == "order" and order["token"] == "order-token-1234" and order["timeout_s"] == 3.5
    assert order["signing_secrets"] == [ORDER_SECRET, GLOBAL_SECRET] and order["client_cert"] is None
    assert refund["client_key"] == Path("/etc/client.key") and refund["signing_secrets"] is None
    assert [s.get_secret_value() for s in from_env.gateway.signing_secrets] == [GLOBAL_SECRET]
    # every credential is masked in logs and errors
    masked = secret_values(from_env)
    for value in ("order-token-1234", "refund-token-5678", ORDER_SECRET, GLOBAL_SECRET, ORDER_SECRET[6:]):
        assert value in masked
    assert "order-token-1234" not in repr(from_env) and ORDER_SECRET not in str(from_env.model_dump())


@pytest.mark.parametrize(
    ("gateway", "says"),
    [
        ({"kind": "http"}, "gateway (WOWD_GATEWAY): url or routes is required when kind is 'http'"),
        (
            {
                "kind": "http",
                "routes": [
                    {"match": "order", "url": "http://a.test"},
                    {"match": "order.invoice", "url": "http://b.test"},
                ],
            },
            "routes[1] (order.invoice) is never used: routes[0] (order) matches first",
        ),
        (
            {
                "kind": "http",
                "routes": [{"match": "order", "url": "http://a.test"}, {"match": "order", "url": "http://b.test"}],
            },
            "routes[1] (order) is never used",
        ),
        ({"routes": [{"match": "order.x.y", "url": "http://a.test"}]}, "is not 'context' or 'context.aggregate'"),
        ({"routes": [{"match": "Order", "url": "http://a.test"}]}, "is not a valid name"),
        (
            {"routes": [{"match": "order", "url": "ftp://a.test"}]},
            "gateway.routes.0.url (WOWD_GATEWAY__ROUTES): must be an http",
        ),
        ({"routes": [{"match": "order"}]}, "gateway.routes.0.url (WOWD_GATEWAY__ROUTES): Field required"),
        (
            {"routes": [{"match": "order", "url": "http://a.test", "tokn": "x"}]},
            "gateway.routes.0.tokn (WOWD_GATEWAY__ROUTES): Extra",
        ),
        ({"routes": [{"match": "o", "url": "http://a.test", "client_key": "/k"}]}, "client_key is given without"),
        ({"client_key": "/k"}, "gateway (WOWD_GATEWAY): client_key is given without client_cert"),
        ({"signing_secrets": ["c2VjcmV0LXdpdGhvdXQtcHJlZml4MDAwMA=="]}, "signing_secrets[0]: a signing secret starts"),
        (
            {"routes": [{"match": "o", "url": "http://a.test", "signing_secrets": [GLOBAL_SECRET, "whsec_!!"]}]},
            "signing_secrets[1]: a signing secret is 'whsec_' followed by standard base64",
        ),
    ],
    ids=lambda v: "" if isinstance(v, dict) else v[:40],
)
def test_bad_routes_and_secrets_are_refused_naming_the_key(
    gateway: dict[str, Any], says: str, clean_env: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(gateway=gateway)
    assert says in str(caught.value)
    for secret in ("c2VjcmV0LXdpdGhvdXQtcHJlZml4MDAwMA==", "whsec_!!", GLOBAL_SECRET):
        assert secret not in str(caught.value)


# --------------------------------------------------------------------------- TLS files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _route(**kw: Any) -> GatewaySettings:
    return GatewaySettings(
        kind="http", url="https://127.0.0.1:1/",
        routes=[RouteSettings(match="ok", url="https://127.0.0.1:2/"), RouteSettings(match="pay", **kw)],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("route key of another certificate", r"gateway\.routes\[1\]\.client_key: cannot load .*other\.key: .*MISMATCH"),
        ("route key encrypted", r"gateway\.routes\[1\]\.client_key: cannot load .*encrypted\.key: the key is encrypt"),
        ("route key missing", r"gateway\.routes\[1\]\.client_key: cannot load .*missing\.key: .*No such file"),
        ("route cert is a key", r"gateway\.routes\[1\]\.client_cert: cannot load .*client\.key"),
        ("route cert without its key", r"gateway\.routes\[1\]\.client_cert: no private key in .*client\.pem"),
        ("global key of another certificate", r"^gateway\.client_key: cannot load .*other\.key"),
        ("route CA missing", r"gateway\.routes\[1\]\.ca_certs: cannot load .*missing-ca\.pem"),
    ],
)  # fmt: skip
def test_an_unusable_tls_file_stops_the_gateway_naming_its_setting(pki: Pki, case: str, says: str) -> None:
    url = "https://127.0.0.1:3/"
    settings = {
        "route key of another certificate": _route(url=url, client_cert=pki.client_cert, client_key=pki.other_key),
        "route key encrypted": _route(url=url, client_cert=pki.client_cert, client_key=pki.encrypted_key),
        "route key missing": _route(url=url, client_cert=pki.client_cert, client_key=pki.ca.parent / "missing.key"),
        "route cert is a key": _route(url=url, client_cert=pki.client_key, client_key=pki.client_key),
        "route cert without its key": _route(url=url, client_cert=pki.client_cert),
        "global key of another certificate": _route(url=url).model_copy(
            update={"client_cert": pki.client_cert, "client_key": pki.other_key}
        ),
        "route CA missing": _route(url=url, ca_certs=pki.ca.parent / "missing-ca.pem"),
    }[case]
    with pytest.raises(ConfigError, match=says):
        HttpGateway(settings, pool_size=4)


# --------------------------------------------------------------------------- requests


async def test_each_request_goes_by_its_route_with_its_credential_and_signature(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="wowd.delivery")
    async with (
        serving(status(200)) as (orders, orders_url),
        serving(status(401, text='{"errorMsg": "bad signature for pay-token-0042"}')) as (pays, pays_url),
        serving(status(200)) as (rest, rest_url),
    ):
        settings = GatewaySettings(
            kind="http", url=rest_url, token=SecretStr("fallback-token"), signing_secrets=[SecretStr(GLOBAL_SECRET)],
            routes=[
                RouteSettings(match="order", url=orders_url, token=SecretStr("order-token-0001"),
                              signing_secrets=[SecretStr(ORDER_SECRET), SecretStr(GLOBAL_SECRET)]),
                RouteSettings(match="payment", url=pays_url, token=SecretStr("pay-token-0042"),
                              api_key_header="X-Api-Key"),
            ],
        )  # fmt: skip
        gw = HttpGateway(settings, pool_size=4, outcomes=DeliveryLog())
        before = REGISTRY.get_sample_value("wowd_gateway_requests_total", {"route": "payment", "outcome": "fail"})
        try:
            outcomes = {
                name: await gw.send(aimed(*name.split(".")))
                for name in ("order.order", "order.invoice", "payment.payment", "shipping.parcel")
            }
        finally:
            await gw.aclose()
    assert isinstance(outcomes["order.order"], Delivered) and isinstance(outcomes["order.invoice"], Delivered)
    assert isinstance(outcomes["shipping.parcel"], Delivered)
    refused = outcomes["payment.payment"]
    assert isinstance(refused, Fail) and refused.reason == f"HTTP 401: bad signature for {MASK}"
    after = REGISTRY.get_sample_value("wowd_gateway_requests_total", {"route": "payment", "outcome": "fail"})
    assert (after or 0) - (before or 0) == 1

    assert [path for _m, path, _h, _b in orders.seen] == ["/api/order/a-1/go", "/api/invoice/a-1/go"]
    for _method, _path, headers, body in orders.seen:
        assert headers["authorization"] == "Bearer order-token-0001" and "x-api-key" not in headers
        assert headers["webhook-id"] == headers["command-request-id"]
        assert headers["webhook-signature"].split(" ") == [
            expected_signature(ORDER_SECRET, headers, body),
            expected_signature(GLOBAL_SECRET, headers, body),
        ]
    ((_m, path, headers, body),) = pays.seen
    assert path == "/api/payment/a-1/go"
    assert headers["x-api-key"] == "pay-token-0042" and "authorization" not in headers
    assert headers["webhook-signature"] == expected_signature(GLOBAL_SECRET, headers, body)  # inherited
    ((_m, path, headers, body),) = rest.seen
    assert headers["authorization"] == "Bearer fallback-token" and path == "/api/parcel/a-1/go"
    assert headers["webhook-signature"] == expected_signature(GLOBAL_SECRET, headers, body)

    failed = [r.getMessage() for r in caplog.records if "failed for good" in r.getMessage()]
    paid = aimed("payment", "payment")
    named = f"timer {paid.timer_id} of {paid.owner} key 'k', request id {paid.request_id}"
    assert failed == [
        f"delivery to payment.payment via route payment failed for good: HTTP 401: bad signature for {MASK} ({named})"
    ]
    assert not any("token" in r.getMessage() for r in caplog.records)


async def test_a_target_without_a_route_fails_at_once_without_a_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wowd.delivery")
    async with serving(status(200)) as (orders, orders_url):
        gw = HttpGateway(
            GatewaySettings(kind="http", routes=[RouteSettings(match="order", url=orders_url)]),
            pool_size=4,
            outcomes=DeliveryLog(),
        )
        before = REGISTRY.get_sample_value("wowd_gateway_unrouted_total", {"target": "shipping.parcel"}) or 0
        got: dict[str, Any] = {}
        try:
            timers = [aimed("shipping", "parcel", f"p-{i}") for i in range(3)] + [aimed("order", "order")]
            for t in timers:
                got[t.target.id] = await gw.send(t)
        finally:
            await gw.aclose()
    assert [p for _m, p, _h, _b in orders.seen] == ["/api/order/a-1/go"]
    assert isinstance(got["a-1"], Delivered)
    for i in range(3):
        assert got[f"p-{i}"] == Fail(reason="no route for shipping.parcel")
    after = REGISTRY.get_sample_value("wowd_gateway_unrouted_total", {"target": "shipping.parcel"})
    assert after == before + 3
    assert target_of(timers[0]) == "shipping.parcel"
    assert any("delivery to shipping.parcel failed for good: no route" in r.getMessage() for r in caplog.records)


async def test_a_routes_time_limit_and_per_target_limit_are_its_own() -> None:
    in_flight = most = 0
    release = anyio.Event()
    two_in_flight = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, most
        if request.match_info["tail"].startswith("api/hang/"):
            await release.wait()  # past the route's time limit
            return web.Response(status=200)
        in_flight += 1
        most = max(most, in_flight)
        if in_flight == 2:
            two_in_flight.set()
        try:
            await release.wait()
        finally:
            in_flight -= 1
        return web.Response(status=200)

    async with serving(handler) as (_srv, url):
        settings = GatewaySettings(
            kind="http", url=url, timeout_s=30, per_target_concurrency=16,
            routes=[
                RouteSettings(match="slow", url=url, timeout_s=0.3),
                RouteSettings(match="narrow", url=url, per_target_concurrency=2),
            ],
        )  # fmt: skip
        gw = HttpGateway(settings, pool_size=32)
        try:
            with anyio.fail_after(10):
                hung = await gw.send(aimed("slow", "hang"))
            assert isinstance(hung, Retry) and hung.reason == "timeout after 0.3s"
            outcomes: list[Any] = []
            async with anyio.create_task_group() as tg:
                limits = target_limits(32, per_target_limit(settings))
                tg.start_soon(stream_all, gw, [[aimed("narrow", "x", f"n-{i}") for i in range(8)]],
                              lambda t, o: outcomes.append(o), limits)  # fmt: skip
                with anyio.fail_after(10):
                    await two_in_flight.wait()
                await anyio.sleep(0.2)  # room for a third request, if the limit let it go
                assert most == 2
                release.set()
        finally:
            release.set()
            await gw.aclose()
    assert len(outcomes) == 8 and all(isinstance(o, Delivered) for o in outcomes) and most == 2


async def test_a_route_presents_its_client_certificate(pki: Pki) -> None:
    peers: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        cert = request.transport.get_extra_info("peercert") if request.transport else None  # type: ignore[union-attr]
        peers.append(dict(x[0] for x in cert["subject"])["commonName"] if cert else "")
        return web.Response(status=200)

    async with serving(handler, ssl_context=pki.server_context(require_client_cert=True)) as (_srv, url):
        settings = GatewaySettings(
            kind="http", ca_certs=pki.ca, url=url,
            routes=[RouteSettings(match="ledger", url=url, client_cert=pki.client_cert, client_key=pki.client_key)],
        )  # fmt: skip
        gw = HttpGateway(settings, pool_size=4)
        try:
            with anyio.fail_after(10):
                with_cert = await gw.send(aimed("ledger", "entry"))
                without = await gw.send(aimed("other", "entry"))  # the fallback has no client certificate
                assert isinstance(await gw.probe(gw.routes[0]), int)
        finally:
            await gw.aclose()
    assert isinstance(with_cert, Delivered)
    assert isinstance(without, Retry) and without.reason.startswith("transport error")
    assert peers[0] == pki.client_cn
