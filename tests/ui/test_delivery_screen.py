"""The overview says where the replica serving it sends fired commands: the outbox, or each
route of the http gateway in the order they match with its limits, and whether a credential and
signing are set, never their values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wowd.config import EmbeddedSettings, WowdSettings
from wowd.stores.embedded import open_embedded
from wowd.ui import StatusPage
from wowd.ui.http import HttpRequest

pytestmark = pytest.mark.anyio

TOKEN = "route-token-0123456789"
SECRET = "whsec_d293ZC1zaWduaW5nLXRlc3QtdmVjdG9yLWtleS0zMmI="


async def test_the_overview_shows_the_gateway_and_its_routes_without_a_secret(tmp_path: Path) -> None:
    settings = WowdSettings(
        context="demo",
        partitions=4,
        embedded=EmbeddedSettings(path=tmp_path / "wowd.db"),
        gateway={
            "kind": "http",
            "url": "https://user:pw-secret-42@fallback.internal/api",
            "signing_secrets": [SECRET],
            "routes": [
                {"match": "demo.payment", "url": "https://pay.internal", "token": TOKEN, "timeout_s": 3},
                {"match": "billing", "url": "https://billing.internal", "per_target_concurrency": 4},
            ],
        },
    )
    backend = await open_embedded(settings)
    try:
        page = StatusPage(settings, backend)
        html = (await page(HttpRequest("GET", "/ui", {}, b""))).body.decode()
        doc = json.loads((await page(HttpRequest("GET", "/api/v1/overview", {}, b""))).body)
    finally:
        await backend.close()
    routes = doc["process"]["delivery"]["routes"]
    assert [(r["match"], r["url"], r["credential"], r["signed"]) for r in routes] == [
        ("demo.payment", "https://pay.internal", "token", True),
        ("billing", "https://billing.internal", "none", True),
        ("*", "https://fallback.internal/api", "none", True),
    ]
    assert routes[0]["timeout_s"] == 3 and routes[1]["per_target_concurrency"] == 4
    assert 'id="delivery"' in html and "https://pay.internal" in html and "<code>demo.payment</code>" in html
    for secret in (TOKEN, "pw-secret-42", SECRET):
        assert secret not in html and secret not in json.dumps(doc)
