"""The command gateways: outcome mapping, the Wow REST shape, credentials, bad answers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from pydantic import SecretStr

from wowd.config import GatewaySettings
from wowd.daemon.gateway import (
    Delivered,
    Fail,
    HttpGateway,
    OutboxGateway,
    Outcome,
    Park,
    Retry,
    command_url,
    outbox_entry,
    outcome_for_status,
)
from wowd.errors import StorageUnavailable
from wowd.model import AggregateRef, Claim, Command, OutboxEntry, Timer, TimerStatus

pytestmark = pytest.mark.anyio


def make_timer(tenant: str = "(0)", agg_id: str = "order-1", name: str = "expire-order") -> Timer:
    owner = AggregateRef(context="demo", aggregate="order", id=agg_id, tenant_id=tenant)
    return Timer(
        timer_id="t1",
        partition=3,
        owner=owner,
        key="k",
        version=1,
        due_at=1000,
        scheduled_at=900,
        target=owner,
        body=Command(name=name, body={"reason": "late"}, body_type="demo.Expire").to_json(),
        status=TimerStatus.FIRING,
        claim=Claim(owner_key="host:1:abc", fence=7, until=1000),
    )


@pytest.mark.parametrize(
    ("status", "kind"),
    [(200, Delivered), (201, Delivered), (204, Delivered), (404, Park), (409, Retry), (429, Retry),
     (500, Retry), (503, Retry), (400, Fail), (401, Fail), (403, Fail), (422, Fail), (302, Fail)],
)
def test_status_mapping(status: int, kind: type) -> None:
    assert isinstance(outcome_for_status(status), kind)


def test_retry_after_is_a_hint_and_bounded() -> None:
    r = outcome_for_status(429, "7")
    assert isinstance(r, Retry) and r.after_s == 7.0
    r = outcome_for_status(503, "Wed, 21 Oct 2015 07:28:00 GMT")
    assert isinstance(r, Retry) and r.after_s == 0.0


def test_command_url_follows_wow_rest_shape() -> None:
    assert command_url("http://h/api/", make_timer()) == "http://h/api/order/order-1/expire-order"
    assert (
        command_url("http://h", make_timer(tenant="t 1", agg_id="a/b"))
        == "http://h/tenant/t%201/order/a%2Fb/expire-order"
    )


def _gateway(handler: Any, **kw: Any) -> HttpGateway:
    settings = GatewaySettings(kind="http", url="https://cmd.example/api", timeout_s=kw.pop("timeout_s", 2.0), **kw)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return HttpGateway(settings, client=client, concurrency=4)


async def test_http_gateway_posts_the_command_with_request_id_and_bearer() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    gw = _gateway(handler, token=SecretStr("s3cr3t-token"))
    t = make_timer()
    assert isinstance(await gw.send(t), Delivered)
    req = seen[0]
    assert req.method == "POST"
    assert str(req.url) == "https://cmd.example/api/order/order-1/expire-order"
    assert req.headers["command-request-id"] == t.request_id
    assert req.headers["authorization"] == "Bearer s3cr3t-token"
    assert json.loads(req.content) == {"reason": "late"}


async def test_http_gateway_api_key_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202)

    gw = _gateway(handler, token=SecretStr("k3y"), api_key_header="X-Api-Key")
    assert isinstance(await gw.send(make_timer()), Delivered)
    assert seen[0].headers["x-api-key"] == "k3y" and "authorization" not in seen[0].headers


async def test_http_gateway_bad_answers_never_raise() -> None:
    def huge(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, content=b"<html>" + b"x" * 5_000_000)

    out = await _gateway(huge).send(make_timer())
    assert isinstance(out, Fail) and len(out.reason) < 300

    def notfound(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"errorMsg": "aggregate not found"})

    out = await _gateway(notfound).send(make_timer())
    assert isinstance(out, Park) and "aggregate not found" in out.reason

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    assert isinstance(await _gateway(refused).send(make_timer()), Retry)

    async def slow(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(5)  # a target that does not answer within the gateway's timeout
        return httpx.Response(200)

    with anyio.fail_after(3):
        out = await _gateway(slow, timeout_s=0.1).send(make_timer())
    assert isinstance(out, Retry) and "timeout" in out.reason


async def test_http_gateway_secret_not_in_reasons() -> None:
    def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text=str(request.headers))

    out = await _gateway(echo, token=SecretStr("planted-secret-xyz")).send(make_timer())
    assert isinstance(out, Retry)
    # the reason carries the answer's text only as the target wrote it; the gateway adds nothing
    assert out.reason.startswith("HTTP 500")


async def test_http_gateway_deliver_reports_each_timer() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if request.url.path.endswith("/ok") else 404)

    gw = _gateway(handler)
    timers = [make_timer(agg_id=f"a{i}", name="ok" if i % 2 else "nope") for i in range(10)]
    got: list[tuple[str, Outcome]] = []
    await gw.deliver(timers, lambda t, o: got.append((t.target.id, o)))
    assert len(got) == 10
    assert {i for i, o in got if isinstance(o, Delivered)} == {f"a{i}" for i in range(1, 10, 2)}


class FakeOutbox:
    def __init__(self, fail: bool = False) -> None:
        self.entries: dict[str, OutboxEntry] = {}
        self.fail = fail

    async def put(self, entry: OutboxEntry) -> bool:
        if self.fail:
            raise StorageUnavailable("busy")
        if entry.request_id in self.entries:
            return False
        self.entries[entry.request_id] = entry
        return True

    async def put_many(self, entries: list[OutboxEntry]) -> list[bool]:
        return [await self.put(e) for e in entries]

    async def count(self) -> int:
        if self.fail:
            raise StorageUnavailable("busy")
        return len(self.entries)

    async def trim(self, before: int) -> int:
        if self.fail:
            raise StorageUnavailable("busy")
        old = [k for k, e in self.entries.items() if e.created_at < before]
        for k in old:
            del self.entries[k]
        return len(old)


async def test_outbox_gateway_writes_request_id_fence_and_owner_of_the_claim() -> None:
    box = FakeOutbox()
    gw = OutboxGateway(box)  # type: ignore[arg-type]
    t = make_timer()
    assert isinstance(await gw.send(t), Delivered)
    assert isinstance(await gw.send(t), Delivered)  # a re-fire is idempotent
    (entry,) = box.entries.values()
    assert entry.request_id == t.request_id and entry.fence == 7 and entry.owner_key == "host:1:abc"
    assert entry.command == t.body and entry.scheduled_at == 900


async def test_outbox_gateway_unavailable_is_retry() -> None:
    gw = OutboxGateway(FakeOutbox(fail=True))  # type: ignore[arg-type]
    got: list[Outcome] = []
    await gw.deliver([make_timer()], lambda t, o: got.append(o))
    assert isinstance(got[0], Retry)


async def test_outbox_gateway_trims_past_the_retention_and_counts_the_depth(tmp_path: Path) -> None:
    from wowd.metrics import REGISTRY
    from wowd.stores.embedded import EmbeddedOutbox

    box = EmbeddedOutbox(tmp_path / "o.db")
    try:
        await box.prepare()
        old = replace(make_timer(agg_id="old"), timer_id="t-old")
        await box.put(outbox_entry(old, 1_000))  # created long before the retention
        gw = OutboxGateway(box, retention_s=3600)
        got: list[Outcome] = []
        fresh = [replace(make_timer(agg_id=i), timer_id=f"t-{i}") for i in ("a", "b")]
        await gw.deliver(fresh, lambda t, o: got.append(o))
        assert all(isinstance(o, Delivered) for o in got)
        assert {e.target.id for e in await box.entries()} == {"a", "b"}
        assert REGISTRY.get_sample_value("wowd_outbox_depth") == 2
    finally:
        await box.close()


async def test_outbox_housekeeping_failure_does_not_undo_a_delivery() -> None:
    box = FakeOutbox()
    gw = OutboxGateway(box, retention_s=60)  # type: ignore[arg-type]
    got: list[Outcome] = []
    await gw.deliver([make_timer()], lambda t, o: got.append(o))
    box.fail = True
    await gw.housekeep()  # logged, not raised
    assert isinstance(got[0], Delivered) and len(box.entries) == 1
