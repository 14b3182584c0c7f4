"""``wowd check`` and ``wowd run`` with gateway routes: each route's URL is probed, and a client
certificate or key that cannot be loaded stops them with exit 2 naming the setting; no token or
signing secret is printed."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.certs import Pki, make_pki
from tests.cli.conftest import Run, refused_check

TOKEN = "route-token-planted-5512"
SECRET = "whsec_cm91dGUtc2lnbmluZy1zZWNyZXQtcGxhbnRlZA=="


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_check_probes_every_route(wowd: Run, monkeypatch: pytest.MonkeyPatch, http_endpoint: str) -> None:
    closed = f"http://127.0.0.1:{_closed_port()}/payments"
    routes = [
        {"match": "order", "url": http_endpoint, "token": TOKEN, "signing_secrets": [SECRET]},
        {"match": "payment", "url": closed, "token": TOKEN},
    ]
    monkeypatch.setenv("WOWD_GATEWAY__KIND", "http")
    monkeypatch.setenv("WOWD_GATEWAY__ROUTES", json.dumps(routes[:1]))
    code, out, err = wowd("check")
    assert code == 0, err
    assert f"ok   gateway route order: {http_endpoint} (HEAD answered 501)" in out

    monkeypatch.setenv("WOWD_GATEWAY__ROUTES", json.dumps(routes))
    monkeypatch.setenv("WOWD_GATEWAY__URL", http_endpoint)
    code, out, err = wowd("check")
    assert code == 1
    assert f"ok   gateway route order: {http_endpoint} (HEAD answered 501)" in out
    assert f"ok   gateway {http_endpoint} (HEAD answered 501)" in out  # gateway.url, the fallback
    assert f"FAIL gateway route payment: gateway {closed}: transport error" in err
    assert TOKEN not in out + err and SECRET not in out + err and SECRET[6:] not in out + err


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_bad_client_key_stops_check_and_run_naming_the_setting(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, pki: Pki, command: str
) -> None:
    routes = [
        {"match": "order", "url": "https://127.0.0.1:1/"},
        {"match": "payment", "url": "https://127.0.0.1:2/", "client_cert": str(pki.client_cert),
         "client_key": str(pki.other_key), "token": TOKEN},
    ]  # fmt: skip
    monkeypatch.setenv("WOWD_GATEWAY__KIND", "http")
    monkeypatch.setenv("WOWD_GATEWAY__ROUTES", json.dumps(routes))
    monkeypatch.setenv("WOWD_HTTP__PORT", "0")
    code, _out, err = wowd(command)
    assert code == 2
    assert f"wowd: gateway.routes[1].client_key: cannot load {pki.other_key}" in err
    assert "Traceback" not in err and TOKEN not in err


def test_a_bad_global_client_certificate_stops_check(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    not_a_cert = tmp_path / "client.pem"
    not_a_cert.write_text("not a certificate\n")
    monkeypatch.setenv("WOWD_GATEWAY__KIND", "http")
    monkeypatch.setenv("WOWD_GATEWAY__URL", "https://127.0.0.1:1/")
    monkeypatch.setenv("WOWD_GATEWAY__CLIENT_CERT", str(not_a_cert))
    code, _out, err = wowd("check")
    assert code == 2 and f"wowd: gateway.client_cert: cannot load {not_a_cert}" in err


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WOWD_GATEWAY__ROUTES": "match=order"}, "WOWD_GATEWAY__ROUTES: not JSON (a list setting"),
        ({"WOWD_GATEWAY__SIGNING_SECRETS": SECRET}, "WOWD_GATEWAY__SIGNING_SECRETS: not JSON (a list setting"),
        (
            {"WOWD_GATEWAY__ROUTES": '{"match": "order"}'},
            "gateway.routes (WOWD_GATEWAY__ROUTES): Input should be a valid list",
        ),
    ],
)
def test_a_list_setting_that_is_not_json_is_named(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], says: str
) -> None:
    err = refused_check(wowd, monkeypatch, env)
    assert says in err and SECRET not in err and SECRET[6:] not in err
