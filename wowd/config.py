"""Settings: ``WOWD_``-prefixed environment variables (nested with ``__``) or a TOML file.

A misspelled key is an error (``extra="forbid"``), credentials are ``SecretStr``.
Precedence: init arguments > environment > TOML file (``--config`` / ``WOWD_CONFIG``) > defaults.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import secrets
import socket
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from wowd.errors import ConfigError
from wowd.model import MIN_INTERVAL_MS, validate_name
from wowd.signing import secret_key

__all__ = [
    "ElasticsearchSettings",
    "EmbeddedSettings",
    "GatewaySettings",
    "HttpSettings",
    "LeaseSettings",
    "MongoSettings",
    "OutboxSettings",
    "RouteSettings",
    "ShutdownSettings",
    "TimerSettings",
    "UiSettings",
    "WowdSettings",
    "load_settings",
    "unknown_environment_keys",
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


DAY_S = 86_400
"""The longest duration a time setting takes (a ttl, a timeout, a pause): longer is a typo, and
would overflow the clocks that count it."""
YEARS_S = 100 * 365 * DAY_S
"""The longest retention a setting takes."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _http_url(v: str | None) -> str | None:
    if v is None:
        return v
    try:
        parts = urlsplit(v)
        host = parts.hostname
    except ValueError as exc:
        raise ValueError(f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError("must be an http:// or https:// URL with a host")
    return v


class EmbeddedSettings(_Part):
    path: Path = Path("./wowd.db")


def uri_hosts(uri: str) -> str:
    """The ``host[:port]`` list of a MongoDB URI, without its credentials (``a:1,b:2``)."""
    rest = uri.partition("://")[2]
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    return authority.rpartition("@")[2]


def _host_problem(host: str) -> str | None:
    """What is wrong with a ``host[:port]`` of a MongoDB URI (``None``: nothing)."""
    name, port = host, ""
    if host.startswith("["):
        literal, sep, rest = host[1:].partition("]")
        if not sep or not literal or (rest and not rest.startswith(":")):
            return "an IPv6 address is written [address] or [address]:port"
        name, port = literal, rest[1:]
    elif host.count(":") > 1:
        return "an IPv6 address is written in brackets, [address]:port"
    elif ":" in host:
        name, _, port = host.partition(":")
    if not name:
        return "no host name"
    if ":" in host and not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
        return "the port must be a number from 1 to 65535"
    return None


def url_host(url: str) -> str:
    """The ``host[:port]`` of an HTTP URL, without its credentials."""
    return urlsplit(url).netloc.rpartition("@")[2]


def url_shown(url: str) -> str:
    """An HTTP URL as it may be printed: without the credentials it may hold (``user:password@``)."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else url


def _no_two_credentials(part: GatewaySettings | RouteSettings) -> None:
    """A URL with credentials (``user:password@``, sent as ``Authorization: Basic``) and a token
    sent as ``Authorization: Bearer`` would both be the one header: every request would fail."""
    if part.url and "@" in urlsplit(part.url).netloc and part.token is not None and part.api_key_header is None:
        raise ValueError(
            "url holds credentials (user:password@) and token is set: both would be the Authorization header; "
            "give one (or api_key_header, to send the token in a header of its own)"
        )


class MongoSettings(_Part):
    uri: SecretStr | None = None
    """May hold credentials, hence secret."""

    @field_validator("uri")
    @classmethod
    def _mongodb_uri(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return v
        uri = v.get_secret_value()
        scheme = uri.partition("://")[0] if "://" in uri else ""
        if scheme not in ("mongodb", "mongodb+srv") or not uri_hosts(uri):
            shown = f"a {scheme}:// URI" if scheme else "no URI"
            raise ValueError(f"must be a mongodb:// or mongodb+srv:// URI with a host, got {shown}")
        for host in uri_hosts(uri).split(","):
            problem = _host_problem(host)
            if problem is not None:  # the message never repeats the URI: it may hold a password
                raise ValueError(f"host {host!r} of the URI: {problem}")
        return v

    database: str = "wowd"
    timeout_ms: int = Field(default=10_000, ge=0, le=DAY_S * 1000)
    """The deadline of each store call (0: none); the change stream is never cut by it."""
    write_concern: Literal["majority", "1"] = "majority"
    ddl: Literal["auto", "validate", "none"] = "auto"
    """auto: create the collections and indexes; validate: check them; none: assume them."""
    sharding: Literal["auto", "on", "off"] = "auto"
    """auto: shard on a sharded cluster when the user may (else logged, left unsharded)."""


class ElasticsearchSettings(_Part):
    url: str | None = None
    """The cluster's URL, or the URLs of several of its nodes separated by commas (a request that
    cannot reach one node goes to the next)."""
    cloud_id: str | None = None
    """Elastic Cloud's deployment id, instead of ``url``."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        for one in v.split(","):
            _http_url(one.strip())
        return v

    def hosts(self) -> list[str]:
        """The node URLs of ``url``, in order (none with ``cloud_id``)."""
        return [u.strip() for u in (self.url or "").split(",") if u.strip()]

    api_key: SecretStr | None = None
    username: str | None = None
    password: SecretStr | None = None
    ca_certs: Path | None = None
    verify_certs: bool = True
    client_cert: Path | None = None
    """A TLS client certificate (PEM), for a cluster that authenticates clients by certificate."""
    client_key: Path | None = None
    """The client certificate's private key (PEM), when not in ``client_cert``."""
    ssl_assert_fingerprint: str | None = None
    """The SHA-256 fingerprint (hex) of the certificate pinned instead of a CA: the cluster's HTTP
    CA (Elasticsearch prints it at setup) or a node's own certificate."""
    ddl: Literal["auto", "validate", "none"] = "auto"
    request_timeout_s: float = Field(default=30.0, gt=0, le=DAY_S)
    refresh_interval_s: float = Field(default=1.0, gt=0, le=DAY_S)
    """At most one ``_refresh`` per index this often, shared by the access stamps waiting for it."""
    bulk_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    """A write is split into bulks of about this many bytes."""
    max_request_bytes: int = Field(default=100 * 1024 * 1024, gt=0)
    """The cluster's ``http.max_content_length`` (100 MB by default)."""
    max_document_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    """A commit's document over this many bytes is refused (quarantined, naming the cap)."""
    max_document_events: int = Field(default=10_000, gt=0)
    """A commit with more events is refused: the index's ``index.mapping.nested_objects.limit``."""

    @model_validator(mode="after")
    def _sizes(self) -> ElasticsearchSettings:
        if self.bulk_bytes > self.max_request_bytes:
            raise ValueError("elasticsearch.bulk_bytes must be <= elasticsearch.max_request_bytes")
        if self.max_document_bytes > self.max_request_bytes:
            raise ValueError("elasticsearch.max_document_bytes must be <= elasticsearch.max_request_bytes")
        if self.url and self.cloud_id:
            raise ValueError("elasticsearch.url and elasticsearch.cloud_id: give one")
        return self


class LeaseSettings(_Part):
    namespace: str | None = None
    """Defaults to ``wowd.<context>``."""
    limit: int = Field(default=1, ge=1, le=4096)
    ttl_s: float = Field(default=10.0, gt=0, le=DAY_S)
    tolerance_s: float = Field(default=1.0, ge=0, le=DAY_S)
    slot_offset: int = Field(default=0, ge=0)
    slots_per_process: int = Field(default=1, ge=1)
    owner_key: str | None = None
    """Defaults to ``host:pid:<random>``."""

    @model_validator(mode="after")
    def _tolerance_below_ttl(self) -> LeaseSettings:
        if self.tolerance_s >= self.ttl_s:
            raise ValueError(f"tolerance_s ({self.tolerance_s}) must be below ttl_s ({self.ttl_s})")
        if self.slots_per_process > self.limit:
            raise ValueError(f"slots_per_process ({self.slots_per_process}) must be <= limit ({self.limit})")
        return self


class TimerSettings(_Part):
    batch: int = Field(default=1000, ge=1, le=100_000)
    lookahead_ms: int = Field(default=200, ge=0, le=DAY_S * 1000)
    claim_ttl_s: float = Field(default=30.0, gt=0, le=DAY_S)
    max_attempts: int = Field(default=10, ge=1)
    max_body_bytes: int = Field(default=64 * 1024, ge=64)
    min_interval_ms: int = Field(default=MIN_INTERVAL_MS, ge=1, le=DAY_S * 1000)
    """The shortest interval rule a timer may have (ms): a schedule with less is refused (the
    client and the command line say so; the feed quarantines the timer event as bad input)."""
    backoff_base_s: float = Field(default=1.0, gt=0, le=DAY_S)
    backoff_max_s: float = Field(default=300.0, gt=0, le=DAY_S)
    tombstone_retention_s: int = Field(default=7 * 24 * 3600, ge=60, le=YEARS_S)
    """How long a fired or cancelled timer is remembered: a replay of the log within it
    re-delivers nothing. A timer's history is kept as long."""
    history: bool = True
    """Keep each timer's history (the commits that scheduled and cancelled it, each attempt);
    False: none is written (the feed and the firing path write a little less)."""

    @model_validator(mode="after")
    def _lookahead_below_claim(self) -> TimerSettings:
        if self.lookahead_ms >= self.claim_ttl_s * 1000:
            raise ValueError(
                f"lookahead_ms ({self.lookahead_ms}) must be below claim_ttl_s ({self.claim_ttl_s} s):"
                " a timer claimed that early would come due again before it is delivered"
            )
        return self


def _signing_secrets(v: list[SecretStr] | None) -> list[SecretStr] | None:
    """Each secret is ``whsec_`` and base64 (the message never repeats the value)."""
    for i, secret in enumerate(v or ()):
        try:
            secret_key(secret.get_secret_value())
        except ValueError as exc:
            raise ValueError(f"signing_secrets[{i}]: {exc}") from None
    return v


def _client_key_needs_cert(part: GatewaySettings | RouteSettings) -> None:
    if part.client_key is not None and part.client_cert is None:
        raise ValueError("client_key is given without client_cert")


class RouteSettings(_Part):
    """Where the timers of one context (or one ``context.aggregate``) go; an unset setting is the
    gateway's, except the credential (``token``, ``api_key_header``), which is the route's own."""

    match: str
    """``context`` (every aggregate of it) or ``context.aggregate``."""
    url: str
    token: SecretStr | None = None
    api_key_header: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=DAY_S)
    per_target_concurrency: int | None = Field(default=None, ge=1)
    ca_certs: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    signing_secrets: list[SecretStr] | None = None
    """An empty list: this route's requests are not signed even with ``gateway.signing_secrets``."""

    @field_validator("match")
    @classmethod
    def _match(cls, v: str) -> str:
        parts = v.split(".")
        if len(parts) > 2:
            raise ValueError(f"{v!r} is not 'context' or 'context.aggregate'")
        for part in parts:
            try:
                validate_name(part, field="match")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    _url = field_validator("url")(_http_url)
    _secrets = field_validator("signing_secrets")(_signing_secrets)

    @model_validator(mode="after")
    def _consistent(self) -> RouteSettings:
        _client_key_needs_cert(self)
        _no_two_credentials(self)
        return self


class GatewaySettings(_Part):
    kind: Literal["outbox", "http"] = "outbox"
    url: str | None = None
    """The targets no route matches (without it, their timers fail: no route)."""
    token: SecretStr | None = None
    api_key_header: str | None = None
    """When set, the token is sent in this header instead of ``Authorization: Bearer``."""
    timeout_s: float = Field(default=10.0, gt=0, le=DAY_S)
    ca_certs: Path | None = None
    verify_certs: bool = True
    client_cert: Path | None = None
    """A client certificate (PEM) sent to the targets that ask for one (mutual TLS)."""
    client_key: Path | None = None
    """The client certificate's private key (PEM, unencrypted); unset: it is in ``client_cert``."""
    signing_secrets: list[SecretStr] = []
    """``whsec_<base64>`` secrets: each request is signed with each (Standard Webhooks)."""
    concurrency: int = Field(default=64, ge=1)
    """At most this many deliveries in flight in all (the http gateway's connection pool has as
    many connections)."""
    per_target_concurrency: int = Field(default=16, ge=1)
    """At most this many requests in flight to one target (``context.aggregate``) of the http gateway."""
    breaker_failures: int = Field(default=5, ge=1)
    """Consecutive failures (timeout, transport error, 408, 429, 5xx) of a target that open its circuit."""
    breaker_open_s: float = Field(default=30.0, gt=0, le=DAY_S)
    """How long an open circuit answers Retry without a request before one trial request."""
    routes: list[RouteSettings] = []
    """Per context (or ``context.aggregate``), in order: the first that matches a target is its route."""

    _url = field_validator("url")(_http_url)
    _secrets = field_validator("signing_secrets")(_signing_secrets)

    @model_validator(mode="after")
    def _url_for_http(self) -> GatewaySettings:
        if self.kind == "http" and not self.url and not self.routes:
            raise ValueError("url or routes is required when kind is 'http'")
        _client_key_needs_cert(self)
        _no_two_credentials(self)
        for i, route in enumerate(self.routes):
            for j, earlier in enumerate(self.routes[:i]):
                if route.match == earlier.match or route.match.startswith(earlier.match + "."):
                    raise ValueError(
                        f"routes[{i}] ({route.match}) is never used: routes[{j}] ({earlier.match}) matches first"
                    )
        return self


class FeedSettings(_Part):
    stall_release_s: float = Field(default=300.0, ge=1, le=DAY_S)
    """A slot whose timer view has been stalled this long is released (another replica may try
    it). Another view's stall never releases the slot: it retries until its store takes it."""
    views_off: list[str] = []
    """Views the feed does not keep: ``timers``, ``index``, ``snapshots`` (every snapshot view)
    or ``snapshots.<aggregate>``. With ``timers`` off nothing is projected or fired."""

    @field_validator("views_off")
    @classmethod
    def _view_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in ("timers", "index", "snapshots") and not (
                name.startswith("snapshots.") and len(name) > len("snapshots.")
            ):
                raise ValueError(f"{name!r} is not a view: timers, index, snapshots or snapshots.<aggregate>")
        return v


class OutboxSettings(_Part):
    retention_s: float = Field(default=7 * 24 * 3600.0, ge=0, le=YEARS_S)
    """Entries older than this are trimmed by the outbox gateway, acknowledged or not (0: kept)."""
    fast_path: bool = True
    """On the embedded backend, the timers due now are read, written to the outbox and settled
    in one transaction (no claim); False: claim, deliver and settle as with any gateway."""


_HOST_NAME = re.compile(r"^(\*|\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?)$")


class HttpSettings(_Part):
    host: str = "0.0.0.0"
    port: int = Field(default=9180, ge=0, le=65535)
    max_connections: int = Field(default=256, ge=1, le=65536)
    """Connections the listener serves at once; at the cap, the one that has waited longest
    without a request is closed to make room, and a client beyond it waits in the backlog."""
    allowed_hosts: list[str] = []
    """Names a request's ``Host`` may give besides an IP address and ``localhost``: a name, a
    ``.domain`` (it and every name under it) or ``*`` (any). Another is answered 400."""

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _HOST_NAME.match(name):
                raise ValueError(f"{name!r} is not a host name, a .domain or * (no scheme, port or path)")
        return v


MIN_UI_TOKEN_CHARS = 16
"""The shortest ``ui.token``: anyone who guesses it acts on timers and reads command bodies."""


class UiSettings(_Part):
    token: SecretStr | None = None
    """Enables the status page's actions (retry, resume, re-feed, acknowledge), each a POST that
    carries it, and its reads of command bodies; unset: the page is read-only and shows no
    command body (unless ``open_bodies``). At least 16 characters."""
    open_bodies: bool = False
    """Shows command bodies (and quarantined commits' events) to anyone who reaches the page;
    ``False``: only to a request carrying the token."""

    @field_validator("token")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return v
        n = len(v.get_secret_value())
        if n == 0:
            raise ValueError(
                "is empty (a variable set to an unset one?): unset it for a read-only status page, or give a token "
                f"of at least {MIN_UI_TOKEN_CHARS} characters"
            )
        if n < MIN_UI_TOKEN_CHARS:
            raise ValueError(
                f"is {n} characters: a token of at least {MIN_UI_TOKEN_CHARS} is required "
                "(python -c 'import secrets; print(secrets.token_urlsafe(24))' makes one)"
            )
        return v


class ShutdownSettings(_Part):
    grace_s: float = Field(default=20.0, ge=0, le=DAY_S)


RENAMED: dict[tuple[str, str], tuple[str, str]] = {("timers", "concurrency"): ("gateway", "concurrency")}
"""Settings read under an earlier name: ``(part, key)`` -> where they are now. The old name is read
(the new one wins where both are given) and :attr:`WowdSettings.renamed` says so."""


def _setting_name(part: str, key: str) -> str:
    return f"{part}.{key} ({variable((part, key))})"


def _move_renamed(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with each setting of :data:`RENAMED` moved to its new place, and what was moved."""
    notes: list[str] = []
    for (part, key), (new_part, new_key) in RENAMED.items():
        old = data.get(part)
        if not isinstance(old, Mapping) or key not in old:
            continue
        data = dict(data)
        rest = dict(old)
        value = rest.pop(key)
        data[part] = rest
        new = dict(data.get(new_part) or {})
        new.setdefault(new_key, value)
        data[new_part] = new
        notes.append(
            f"{_setting_name(part, key)} is now {_setting_name(new_part, new_key)}: "
            "the old name is read for now, rename it"
        )
    return data, notes


class WowdSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="WOWD_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        case_sensitive=False,
        allow_inf_nan=False,
    )

    context: str = "demo"
    partitions: int = Field(default=64, ge=1, le=65536)
    backend: Literal["embedded", "mongo"] = "embedded"
    sink: Literal["default", "none"] = "default"
    """The event index: ``default`` keeps one (the embedded file's, or Elasticsearch with the
    ``mongo`` backend); ``none`` keeps none (the log stays the source of truth)."""
    config: Path | None = None
    """The TOML file these settings were read from (``WOWD_CONFIG``)."""
    log_level: str = "INFO"
    log_format: Literal["auto", "json", "text"] = "auto"
    embedded: EmbeddedSettings = EmbeddedSettings()
    mongodb: MongoSettings = MongoSettings()
    elasticsearch: ElasticsearchSettings = ElasticsearchSettings()
    lease: LeaseSettings = LeaseSettings()
    timers: TimerSettings = TimerSettings()
    gateway: GatewaySettings = GatewaySettings()
    outbox: OutboxSettings = OutboxSettings()
    feed: FeedSettings = FeedSettings()
    http: HttpSettings = HttpSettings()
    ui: UiSettings = UiSettings()
    shutdown: ShutdownSettings = ShutdownSettings()
    reducers: dict[str, str] = {}
    """Aggregate name -> import path (``module:attribute``) of a reducer with ``state_revision``
    and ``fold(state, event) -> state``: snapshots of that type are kept from the log."""
    demo: bool = False
    """Run the demo producer in-process (``wowd run --demo``)."""
    _renamed: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _renamed_settings(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> WowdSettings:
        notes: list[str] = []
        if isinstance(data, Mapping):
            data, notes = _move_renamed(dict(data))
        settings: WowdSettings = handler(data)
        settings._renamed = tuple(notes)
        return settings

    @property
    def renamed(self) -> tuple[str, ...]:
        """A line for each setting given under an earlier name (:data:`RENAMED`), to be logged."""
        return self._renamed

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        level = v.upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"{v!r} is not a log level ({', '.join(LOG_LEVELS)})")
        return level

    @field_validator("reducers")
    @classmethod
    def _reducer_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for aggregate, path in v.items():
            module, sep, attribute = path.partition(":")
            if not sep or not module or not attribute:
                raise ValueError(f"{aggregate}: {path!r} is not an import path module:attribute")
        return v

    @field_validator("context")
    @classmethod
    def _context_name(cls, v: str) -> str:
        try:
            return validate_name(v, field="context")
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc

    @model_validator(mode="after")
    def _consistent(self) -> WowdSettings:
        if self.partitions < self.lease.limit:
            raise ValueError(
                f"partitions ({self.partitions}) must be >= lease.limit ({self.lease.limit}): "
                "a slot without partitions does no work"
            )
        if self.backend == "mongo":
            if self.mongodb.uri is None:
                raise ValueError("mongodb.uri (WOWD_MONGODB__URI) is required when backend is 'mongo'")
            if self.sink != "none" and not self.elasticsearch.url and not self.elasticsearch.cloud_id:
                raise ValueError(
                    "elasticsearch.url (WOWD_ELASTICSEARCH__URL) or elasticsearch.cloud_id is required when backend "
                    "is 'mongo' (or sink = 'none': no event index)"
                )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _CONFIG_FILE.get() or os.environ.get("WOWD_CONFIG")
        if path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path)))
        return tuple(sources)

    # ------------------------------------------------------------------ derived values

    @property
    def lease_namespace(self) -> str:
        return self.lease.namespace or f"wowd.{self.context}"

    @property
    def owner_key(self) -> str:
        return self.lease.owner_key or _default_owner_key()

    def partitions_of_slot(self, slot: int) -> list[int]:
        """Slot ``s`` owns the partitions ``p`` with ``p % limit == s - slot_offset``."""
        index = slot - self.lease.slot_offset
        return [p for p in range(self.partitions) if p % self.lease.limit == index]


_OWNER_KEY: str | None = None


def _default_owner_key() -> str:
    global _OWNER_KEY
    if _OWNER_KEY is None:
        _OWNER_KEY = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    return _OWNER_KEY


_CONFIG_FILE: ContextVar[str | None] = ContextVar("wowd_config_file", default=None)

_NOT_SETTINGS = ("WOWD_TEST_",)
"""Prefixes of WOWD_ variables that are not settings (the test suite's own)."""


def unknown_environment_keys(environ: Mapping[str, str] | None = None) -> list[str]:
    """``WOWD_*`` variables that name no setting (pydantic-settings would silently ignore an
    unknown first segment: a misspelled variable must be an error instead): an unknown first
    segment, or an unknown key of a nested setting (``WOWD_TIMERS__CONCURENCY``)."""
    return sorted(key for key, _ in _unknown(environ))


def _unknown(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The unknown ``WOWD_*`` variables, each with the closest known variable (or None)."""
    env = os.environ if environ is None else environ
    fields = {name.lower(): f for name, f in WowdSettings.model_fields.items()}
    found: list[tuple[str, str | None]] = []
    for key in env:
        upper = key.upper()
        if not upper.startswith("WOWD_") or upper.startswith(_NOT_SETTINGS):
            continue
        head, _, rest = upper[len("WOWD_") :].lower().partition("__")
        field_ = fields.get(head)
        if field_ is None:
            close = _one_underscore(head, fields) or _closest(head, fields, "WOWD_")
            found.append((key, f"{close}__{rest.upper()}" if close and rest else close))
            continue
        part = field_.annotation
        if rest and isinstance(part, type) and issubclass(part, BaseModel):
            name = rest.split("__", 1)[0]
            if name not in part.model_fields and (head, name) not in RENAMED:
                close = _closest(name, part.model_fields, f"WOWD_{head.upper()}__")
                old = [key for (p, key) in RENAMED if p == head]
                if close is None and (renamed := _closest(name, dict.fromkeys(old), "")) is not None:
                    close = variable(RENAMED[head, renamed.lower()])  # its new name
                found.append((key, close))
    return found


def _one_underscore(name: str, fields: Mapping[str, Any]) -> str | None:
    """The nested setting ``name`` spells with one underscore where two separate its part and
    its field (``gateway_kind``: ``WOWD_GATEWAY__KIND``), or None."""
    for i, c in enumerate(name):
        if c != "_":
            continue
        part = fields.get(name[:i])
        annotation = part.annotation if part is not None else None
        if (
            isinstance(annotation, type)
            and issubclass(annotation, BaseModel)
            and name[i + 1 :] in annotation.model_fields
        ):
            return f"WOWD_{name[:i].upper()}__{name[i + 1 :].upper()}"
    return None


def _closest(name: str, known: Mapping[str, object], prefix: str) -> str | None:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"{prefix}{close[0].upper()}" if close else None


def variable(loc: tuple[int | str, ...]) -> str:
    """The environment variable of a setting's location (``("mongodb", "uri")`` ->
    ``WOWD_MONGODB__URI``); a dict setting's entry is named by the dict's variable, and a list
    setting's item by the list's (``("gateway", "routes", 0, "url")`` -> ``WOWD_GATEWAY__ROUTES``,
    a JSON array)."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "reducers":
        parts = parts[:1]
    index = next((i for i, p in enumerate(loc) if isinstance(p, int)), None)
    if index is not None:
        parts = parts[:index]
    return "WOWD_" + "__".join(parts).upper()


def _settings_error(exc: SettingsError) -> str:
    """pydantic-settings says ``error parsing value for field "reducers" from source ...``: a
    nested or dict setting from the environment must be JSON."""
    text = str(exc)
    if '"' in text and "EnvSettingsSource" in text:
        name = text.split('"')[1]
        part = WowdSettings.model_fields[name].annotation if name in WowdSettings.model_fields else None
        if isinstance(part, type) and issubclass(part, BaseModel):
            # a list setting of a part (WOWD_GATEWAY__ROUTES): name the variable that is not JSON
            for key, value in sorted(os.environ.items()):
                head, _, field = key.upper().partition("__")
                if head == f"WOWD_{name.upper()}" and field.lower() in part.model_fields and not _is_json(value):
                    return (
                        f"{key}: not JSON (a list setting from the environment is a JSON array, "
                        f'e.g. WOWD_GATEWAY__ROUTES=\'[{{"match": "order", "url": "https://orders.internal"}}]\')'
                    )
        return (
            f"WOWD_{name.upper()}: not JSON (a dict setting from the environment is a JSON object, "
            f'e.g. WOWD_REDUCERS=\'{{"order": "module:attribute"}}\')'
        )
    return text


def _is_json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> WowdSettings:
    """Reads the settings; every error (misspelling, range, consistency) is a :class:`ConfigError`
    whose message names the key (without echoing a secret value). A named config file
    (``config_file``, else ``WOWD_CONFIG``) that does not exist is an error, never defaults."""
    token = None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        token = _CONFIG_FILE.set(str(path))
    else:
        named = os.environ.get("WOWD_CONFIG")
        if named and not Path(named).is_file():
            raise ConfigError(f"WOWD_CONFIG: config file {named!r} does not exist")
    unknown = sorted(_unknown())
    if unknown:
        raise ConfigError(
            "invalid configuration:\n  "
            + "\n  ".join(
                f"{key}: not a wowd setting ({f'did you mean {close}?' if close else 'misspelled?'})"
                for key, close in unknown
            )
        )
    try:
        return WowdSettings(**overrides)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"config file {_CONFIG_FILE.get() or os.environ.get('WOWD_CONFIG')!r}: not TOML: {exc}"
        ) from None
    except SettingsError as exc:
        raise ConfigError(f"invalid configuration: {_settings_error(exc)}") from None
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_input=False, include_url=False):
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc} ({variable(err['loc'])}): {msg}" if err["loc"] else f"{loc}: {msg}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
    finally:
        if token is not None:
            _CONFIG_FILE.reset(token)
