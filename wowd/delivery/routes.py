"""Where the http gateway sends a target's commands: the routes (``gateway.routes``) and the
fallback (``gateway.url``), each with its credential, time limit, per-target limit, TLS context
(CA bundle, client certificate) and signing secrets, built once when the gateway starts.

A target (``context.aggregate``) goes by the first route whose ``match`` is its context or the
target itself, else by the fallback; with neither, it has no route (:meth:`Routes.route` answers
``None``: its timers fail). A route is named by its ``match``; the fallback is named
:data:`FALLBACK`. Names, never credentials, go to logs and metrics.
"""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import SecretStr

from wowd import metrics
from wowd.config import GatewaySettings
from wowd.errors import ConfigError
from wowd.signing import Signer

__all__ = ["FALLBACK", "Route", "Routes", "env_proxy", "matches", "per_target_limit"]

FALLBACK = "*"
"""The name of the route of ``gateway.url`` (every target no route matches)."""


def matches(match: str, target: str) -> bool:
    """Whether a route's ``match`` (``context`` or ``context.aggregate``) takes ``target``
    (``context.aggregate``)."""
    return target == match or (target.startswith(match) and target[len(match) : len(match) + 1] == ".")


def _first_match(matchers: Sequence[str], target: str) -> int | None:
    """The index of the first of ``matchers`` (routes' ``match``) that takes ``target``."""
    return next((i for i, m in enumerate(matchers) if matches(m, target)), None)


def per_target_limit(settings: GatewaySettings) -> Callable[[str], int]:
    """The deliveries in flight each target may have: its route's ``per_target_concurrency``
    (or ``gateway.per_target_concurrency``); 1 for a target with no route (its timers fail
    without a request)."""
    matchers = [r.match for r in settings.routes]
    limits = [
        r.per_target_concurrency if r.per_target_concurrency is not None else settings.per_target_concurrency
        for r in settings.routes
    ]
    fallback = settings.per_target_concurrency if settings.url else 1

    def limit(target: str) -> int:
        i = _first_match(matchers, target)
        return fallback if i is None else limits[i]

    return limit


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTP_PROXY``/``HTTPS_PROXY``, ``NO_PROXY``),
    read once per route."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if not proxies or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxies.get(parts.scheme) or proxies.get("all")


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One destination of commands, as a request needs it."""

    name: str
    """``match`` of the route, :data:`FALLBACK` for ``gateway.url``."""
    url: str
    origin: Any
    """``yarl.URL`` of ``url`` without its path: a request's URL is its path set on this (a URL
    parsed once per route, not once per request)."""
    path: str
    """The path of ``url`` (percent-encoded as given)."""
    headers: Mapping[str, str]
    """What each request of the route carries besides its own headers (the credential)."""
    secret: str
    """The credential ('' for none), masked in what a target answers."""
    timeout_s: float
    client_timeout: Any
    """``aiohttp.ClientTimeout`` of ``timeout_s``."""
    per_target_concurrency: int
    ssl: ssl.SSLContext | bool
    """The TLS context (``False``: a plain-HTTP url, or verification off without a client
    certificate)."""
    proxy: str | None
    signer: Signer | None
    counted: Mapping[str, Any] = field(default_factory=dict)
    """``wowd_gateway_requests_total`` of this route by outcome (``delivered``, ``retry``,
    ``park``, ``fail``)."""

    @property
    def is_fallback(self) -> bool:
        """The route of ``gateway.url``."""
        return self.name == FALLBACK

    def target_label(self, target: str) -> str:
        """``target`` as the delivery log names it: with its route unless that is the fallback."""
        return target if self.name == FALLBACK else f"{target} via route {self.name}"


def _no_password() -> bytes:
    raise ValueError("the key is encrypted (give an unencrypted key)")


@dataclass(frozen=True, slots=True)
class _Tls:
    """The TLS files of a route, each with the setting it came from (for an error)."""

    ca_certs: Path | None
    ca_setting: str
    client_cert: Path | None
    client_key: Path | None
    cert_setting: str


def _tls_context(url: str, verify: bool, tls: _Tls) -> ssl.SSLContext | bool:
    """The context of a route; the files are read here, at start-up, and an unreadable one is a
    :class:`ConfigError` naming its setting."""
    if urlsplit(url).scheme != "https":
        return False
    cert, key = tls.client_cert, tls.client_key
    if not verify and cert is None:
        return False
    ca = tls.ca_certs
    try:
        ctx = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{tls.ca_setting}.ca_certs: cannot load {ca}: {exc}") from exc
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert is None:
        return ctx
    try:
        ssl.create_default_context(cafile=str(cert))  # the certificate alone parses
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{tls.cert_setting}.client_cert: cannot load {cert}: {exc}") from exc
    try:
        ctx.load_cert_chain(str(cert), str(key) if key is not None else None, password=_no_password)
    except (OSError, ssl.SSLError, ValueError) as exc:
        if key is not None:
            raise ConfigError(f"{tls.cert_setting}.client_key: cannot load {key}: {exc}") from exc
        raise ConfigError(f"{tls.cert_setting}.client_cert: no private key in {cert}: {exc}") from exc
    return ctx


def _credential(token: SecretStr | None, api_key_header: str | None) -> tuple[dict[str, str], str]:
    secret = token.get_secret_value() if token is not None else ""
    if not secret:
        return {}, ""
    if api_key_header:
        return {api_key_header.lower(): secret}, secret
    return {"authorization": f"Bearer {secret}"}, secret


class Routes:
    """The routes of ``settings`` in order, then the fallback; :meth:`route` of a target is
    looked up once. ``base_headers``: what every request carries besides the route's credential
    (none when the session sends its own)."""

    def __init__(self, settings: GatewaySettings, *, base_headers: Mapping[str, str] = {}) -> None:
        import aiohttp  # an http gateway's own dependency
        import yarl

        self._by_target: dict[str, Route | None] = {}
        contexts: dict[tuple[str, _Tls], ssl.SSLContext | bool] = {}
        verify = settings.verify_certs

        def build(
            name: str,
            url: str,
            credential: tuple[dict[str, str], str],
            timeout_s: float,
            per_target: int,
            tls: _Tls,
            secrets: list[SecretStr],
        ) -> Route:
            ctx_key = (urlsplit(url).scheme, tls)
            context = contexts.get(ctx_key)
            if context is None:
                context = contexts[ctx_key] = _tls_context(url, verify, tls)
            headers, secret = credential
            return Route(
                name=name,
                url=url,
                origin=yarl.URL(url, encoded=True).with_path("/", encoded=True),
                path=yarl.URL(url, encoded=True).raw_path,
                headers={**base_headers, **headers},
                secret=secret,
                timeout_s=timeout_s,
                client_timeout=aiohttp.ClientTimeout(total=timeout_s),
                per_target_concurrency=per_target,
                ssl=context,
                proxy=env_proxy(url),
                signer=Signer(s.get_secret_value() for s in secrets) if secrets else None,
                counted={
                    kind: metrics.GATEWAY_REQUESTS.labels(route=name, outcome=kind)
                    for kind in ("delivered", "retry", "park", "fail")
                },
            )

        g = settings
        global_tls = _Tls(g.ca_certs, "gateway", g.client_cert, g.client_key, "gateway")
        routes: list[Route] = []
        for i, r in enumerate(g.routes):
            here = f"gateway.routes[{i}]"
            tls = _Tls(
                r.ca_certs if r.ca_certs is not None else g.ca_certs,
                here if r.ca_certs is not None else "gateway",
                r.client_cert if r.client_cert is not None else g.client_cert,
                r.client_key if r.client_cert is not None else g.client_key,
                here if r.client_cert is not None else "gateway",
            )
            routes.append(
                build(
                    r.match,
                    r.url,
                    _credential(r.token, r.api_key_header),
                    r.timeout_s if r.timeout_s is not None else g.timeout_s,
                    r.per_target_concurrency if r.per_target_concurrency is not None else g.per_target_concurrency,
                    tls,
                    r.signing_secrets if r.signing_secrets is not None else g.signing_secrets,
                )
            )
        self.routes: tuple[Route, ...] = tuple(routes)
        """The configured routes, in their order (the first match wins)."""
        self.fallback: Route | None = None
        """The route of ``gateway.url``."""
        if g.url:
            self.fallback = build(
                FALLBACK,
                g.url,
                _credential(g.token, g.api_key_header),
                g.timeout_s,
                g.per_target_concurrency,
                global_tls,
                g.signing_secrets,
            )

    @property
    def all(self) -> list[Route]:
        """Every route, the fallback last."""
        return [*self.routes, *([self.fallback] if self.fallback is not None else [])]

    def route(self, target: str) -> Route | None:
        """The route of ``target`` (``context.aggregate``); ``None``: it has none."""
        try:
            return self._by_target[target]
        except KeyError:
            pass
        i = _first_match([r.name for r in self.routes], target)
        found = self.fallback if i is None else self.routes[i]
        if len(self._by_target) < 65_536:
            self._by_target[target] = found
        return found
