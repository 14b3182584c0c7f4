"""``wowd check``: the configuration is valid, the embedded file is sound (SQLite's
``quick_check``) and every store and the gateway answer. Each server (MongoDB, Elasticsearch,
the gateway) is reached on its own, so that one not answering does not hide another."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, TypeVar

import anyio

from wowd.backends import opened_backend
from wowd.cli.logs import redact, secret_values
from wowd.cli.output import err, out
from wowd.config import WowdSettings, url_shown
from wowd.errors import ConfigError, FormatError, StorageError, WowdError
from wowd.model import AggregateRef, AggregateType
from wowd.stores.base import Backend
from wowd.stores.formats import StoreFormat

T = TypeVar("T")

__all__ = ["check", "register"]

OPEN_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 15.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "check",
        parents=[common],
        help="validate the configuration and reach every store and the gateway (creates nothing)",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="also do the one-off preparation wowd leaves off the feed's path: on a sharded MongoDB "
        "cluster, spread the chunks of each new timer collection over the shards (bounded)",
    )
    p.set_defaults(handler=check)


async def check(settings: WowdSettings, args: argparse.Namespace) -> int:
    """Exit 0 when everything answers, 1 otherwise (one ``FAIL`` line per problem)."""
    secrets = secret_values(settings)
    out(
        f"configuration ok: context {settings.context!r}, backend {settings.backend}, "
        f"{settings.partitions} partitions, lease namespace {settings.lease_namespace!r} "
        f"(limit {settings.lease.limit}, ttl {settings.lease.ttl_s}s), gateway {settings.gateway.kind}"
    )
    failures = _check_reducers(settings)
    failures += await _check_gateway(settings, secrets)
    if settings.backend == "embedded" and not settings.embedded.path.exists():
        failures += _check_new_embedded_path(settings)
    else:
        if settings.backend == "embedded":
            failures += await _check_embedded_file(settings)
            formats = await _embedded_formats(settings)
        else:
            servers = await _check_mongodb(settings, secrets)
            if settings.sink != "none":
                servers += await _check_elasticsearch(settings, secrets)
            formats = await _mongo_formats(settings, secrets) if not servers else None
            failures += servers
        if formats is not None:
            failed, opens = _report_formats(formats)
            failures += failed
            if opens:
                failures += await _check_stores(settings, secrets, args)
    if failures:
        err(f"wowd check: {failures} problem(s)")
        return 1
    out("wowd check: all stores answer")
    return 0


def _check_reducers(settings: WowdSettings) -> int:
    from wowd.reducers import load_reducer

    failures = 0
    for agg, path in settings.reducers.items():
        try:
            load_reducer(path)
            out(f"ok   reducer {agg} -> {path}")
        except ConfigError as exc:
            err(f"FAIL reducer {agg}: {exc}")
            failures += 1
    return failures


def _check_new_embedded_path(settings: WowdSettings) -> int:
    """The database file does not exist: it is not created here; its directory must allow it."""
    path = settings.embedded.path
    parent = path.parent if str(path.parent) else path.cwd()
    if not parent.is_dir():
        err(f"FAIL embedded: {path} does not exist and its directory {parent} does not either")
        return 1
    if not os.access(parent, os.W_OK | os.X_OK):
        err(f"FAIL embedded: {path} does not exist and its directory {parent} is not writable")
        return 1
    out(f"ok   embedded: {path} does not exist yet (not created by check; wowd run creates it)")
    return 0


async def _check_embedded_file(settings: WowdSettings) -> int:
    """SQLite's ``quick_check`` of the embedded file: a corrupted page is a failure even when
    every store still answers its probe (the probes read a few pages)."""
    from wowd.stores.embedded.db import SqliteDatabase

    path = settings.embedded.path
    db = SqliteDatabase(path)
    try:
        problem = await db.quick_check()
    except WowdError as exc:
        err(f"FAIL embedded file {path}: {type(exc).__name__}: {exc}")
        return 1
    finally:
        db.close()
    if problem is not None:
        err(f"FAIL embedded file {path}: quick_check: {problem}")
        return 1
    out(f"ok   embedded file {path} (quick_check)")
    from wowd.stores.embedded.sqlite import LIBRARY, WAL_RESET_BUG

    if WAL_RESET_BUG:
        out(f"ok   {LIBRARY}, which has the WAL-reset bug: its checkpoints are FULL (writers wait for them)")
    else:
        out(f"ok   {LIBRARY}")
    return 0


async def _embedded_formats(settings: WowdSettings) -> list[StoreFormat] | None:
    """The formats recorded in the embedded file (``None``, with a ``FAIL`` line, when they
    cannot be read)."""
    from wowd.stores.embedded.db import SqliteDatabase
    from wowd.stores.embedded.formats import embedded_formats, rebuild_state

    db = SqliteDatabase(settings.embedded.path)
    try:
        rebuild = await db.run(partial(_read_only, rebuild_state, context=settings.context))
        if rebuild is not None:
            out(f"ok   timer view rebuild: {rebuild}")
        return await db.run(partial(_read_only, embedded_formats, context=settings.context))
    except WowdError as exc:
        err(f"FAIL formats: {type(exc).__name__}: {exc}")
        return None
    finally:
        db.close()


def _read_only(read: Callable[..., T], conn: Any, *, context: str) -> T:
    return read(conn, context)


async def _mongo_formats(settings: WowdSettings, secrets: list[str]) -> list[StoreFormat] | None:
    """The formats recorded in the MongoDB database (``None``, with a ``FAIL`` line, when they
    cannot be read)."""
    from pymongo import AsyncMongoClient
    from pymongo.errors import PyMongoError

    from wowd.stores.mongo import mongo_client_options
    from wowd.stores.mongo.formats import mongo_formats, mongo_rebuild_state

    assert settings.mongodb.uri is not None  # the settings require it with the mongo backend
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        settings.mongodb.uri.get_secret_value(), **mongo_client_options(settings.mongodb)
    )
    try:
        with anyio.fail_after(OPEN_TIMEOUT_S):
            db = client[settings.mongodb.database]
            rebuild = await mongo_rebuild_state(db, settings.context)
            if rebuild is not None:
                out(f"ok   timer view rebuild: {rebuild}")
            return await mongo_formats(db, settings.context)
    except (PyMongoError, TimeoutError) as exc:
        err(redact(f"FAIL formats: {type(exc).__name__}: {exc}", secrets))
        return None
    finally:
        with anyio.CancelScope(shield=True):
            await client.close()


def _report_formats(formats: list[StoreFormat]) -> tuple[int, bool]:
    """One line per store: its format and what this version would do to it. Answers the
    failures (formats this version refuses) and whether the stores may be opened to probe them:
    not when opening them would upgrade one (``wowd check`` changes nothing) or be refused."""
    failures = 0
    upgrades = []
    for f in formats:
        if f.action == "refuse":
            err(f"FAIL format {f.describe()}")
            failures += 1
        else:
            out(f"ok   format {f.describe()}")
            if f.action == "upgrade":
                upgrades.append(f.store)
    if failures:
        err("     stores not probed: this wowd refuses a format they hold")
        return failures, False
    if upgrades:
        out(f"ok   stores not probed: opening them would upgrade {', '.join(upgrades)} in place (wowd run does it)")
        return 0, False
    return 0, True


async def _check_gateway(settings: WowdSettings, secrets: list[str]) -> int:
    """A ``HEAD`` of each route's URL (``gateway.url`` last), with its credential and TLS settings."""
    if settings.gateway.kind != "http":
        return 0  # the outbox is probed with the stores
    from wowd.delivery import HttpGateway

    gateway = HttpGateway(settings.gateway, pool_size=1)
    failures = 0
    try:
        for route in gateway.routes:
            name = "gateway" if route.is_fallback else f"gateway route {route.name}"
            try:
                status = await gateway.probe(route)
            except WowdError as exc:
                err(redact(f"FAIL {name}: {exc}", secrets))
                failures += 1
                continue
            out(f"ok   {name}{'' if route.is_fallback else ':'} {url_shown(route.url)} (HEAD answered {status})")
    finally:
        with anyio.CancelScope(shield=True):
            await gateway.aclose()
    return failures


async def _check_mongodb(settings: WowdSettings, secrets: list[str]) -> int:
    """MongoDB answers ``hello`` as a replica-set member or a ``mongos`` (one line either way)."""
    from pymongo import AsyncMongoClient

    from wowd.config import uri_hosts
    from wowd.stores.mongo import check_replica_set, mongo_client_options

    assert settings.mongodb.uri is not None  # the settings require it with the mongo backend
    uri = settings.mongodb.uri.get_secret_value()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, **mongo_client_options(settings.mongodb))
    try:
        with anyio.fail_after(OPEN_TIMEOUT_S):
            await check_replica_set(client, hosts=uri_hosts(uri))
    except (WowdError, TimeoutError) as exc:
        err(redact(f"FAIL mongodb: {type(exc).__name__}: {exc}", secrets))
        return 1
    finally:
        with anyio.CancelScope(shield=True):
            await client.close()
    out(f"ok   mongodb {uri_hosts(uri)}")
    return 0


async def _check_elasticsearch(settings: WowdSettings, secrets: list[str]) -> int:
    """Elasticsearch answers its root endpoint with wowd's credentials (one line naming the
    setting and the hosts if not): ``url`` (each of its nodes in turn until one answers) or
    ``cloud_id``; a pinned certificate is learned first."""
    from wowd.config import url_host
    from wowd.stores.elasticsearch.options import new_client
    from wowd.stores.elasticsearch.tls import ensure_pinned

    es_settings = settings.elasticsearch
    setting = "WOWD_ELASTICSEARCH__URL" if es_settings.url else "WOWD_ELASTICSEARCH__CLOUD_ID"
    try:
        es = new_client(es_settings)
    except (ConfigError, ValueError) as exc:
        err(redact(f"FAIL elasticsearch: {setting}: {exc}", secrets))
        return 1
    nodes = es.transport.node_pool.all()
    hosts = ", ".join(url_host(n.base_url) for n in nodes)
    quiet = logging.getLogger("elastic_transport")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the transport's warning of the failure this reports in one line
    try:
        with anyio.fail_after(OPEN_TIMEOUT_S):
            await ensure_pinned(es)
            info = await es.options(max_retries=len(nodes) - 1).info()
    except TimeoutError:
        err(f"FAIL elasticsearch: {setting}: no answer from {hosts} in {OPEN_TIMEOUT_S:.0f} s")
        return 1
    except Exception as exc:  # the client's transport and API errors: one line each
        text = str(getattr(exc, "message", None) or exc)
        reason = text.splitlines()[0] if text else type(exc).__name__
        err(redact(f"FAIL elasticsearch: {setting}: {hosts}: {reason}", secrets))
        return 1
    finally:
        quiet.setLevel(level)
        with anyio.CancelScope(shield=True):
            await es.close()
    out(f"ok   elasticsearch {hosts} (version {info.get('version', {}).get('number', '?')})")
    return 0


async def _check_stores(settings: WowdSettings, secrets: list[str], args: argparse.Namespace) -> int:
    async with AsyncExitStack() as stack:
        try:
            with anyio.fail_after(OPEN_TIMEOUT_S):
                backend = await stack.enter_async_context(opened_backend(settings))
        except (WowdError, TimeoutError) as exc:
            err(redact(f"FAIL open {settings.backend} backend: {type(exc).__name__}: {exc}", secrets))
            return 1
        failures = 0
        for name, probe in await _probes(settings, backend):
            try:
                with anyio.fail_after(PROBE_TIMEOUT_S):
                    said = await probe()
                out(f"ok   {name}" + (f": {said}" if isinstance(said, str) else ""))
            except (WowdError, TimeoutError) as exc:
                err(redact(f"FAIL {name}: {type(exc).__name__}: {exc}", secrets))
                failures += 1
        if getattr(args, "prepare", False):
            failures += await _prepare(backend, secrets)
        return failures


async def _privileges_probe(settings: WowdSettings, backend: Backend) -> None:
    """The privileges the MongoDB stores need (their modes as configured), asked of the server
    with ``connectionStatus``; fails naming each action missing and what it is for."""
    from wowd.stores.base import Ddl
    from wowd.stores.mongo._common import MongoSharding
    from wowd.stores.mongo.privileges import check_user

    client = getattr(backend.log, "client", None)
    if client is None:
        return
    mongo = settings.mongodb
    missing = await check_user(
        client, mongo.database, settings.context, ddl=Ddl(mongo.ddl), sharding=MongoSharding(mongo.sharding)
    )
    if missing is None:
        out(
            "ok   mongodb privileges: not checked (no authenticated user: access control is off, or no user in the URI)"
        )
        return
    if missing:
        lacks = "; ".join(f"{action} on {need.resource} ({need.store}: {need.why})" for need, action in missing)
        raise ConfigError(f"the user lacks {len(missing)} privilege action(s): {lacks} (docs/stores.md lists them)")


async def _election_probe(settings: WowdSettings, backend: Backend) -> str:
    """The lease's time against the replica set's election timeout: fails when a holder cut off
    with the old primary could go on after a new primary is elected; says so when the setting
    cannot be read (docs/concepts.md, Elections)."""
    from datetime import timedelta

    from wowd.stores.mongo.election import election_window

    client = getattr(backend.leases, "client", None)
    if client is None:
        return "not checked: no MongoDB client"
    lease = settings.lease
    window = await election_window(
        client, ttl=timedelta(seconds=lease.ttl_s), tolerance=timedelta(seconds=lease.tolerance_s)
    )
    if window.safe is False:
        raise ConfigError(window.text)
    return window.text


async def _ttl_probe(missing_ttl: Callable[[], Awaitable[list[str]]]) -> None:
    """Fails naming the timer collections whose tombstones never expire (no TTL index)."""
    missing = await missing_ttl()
    if missing:
        raise FormatError(
            f"no TTL index tombstones_ttl on {', '.join(missing)}: their tombstones never expire "
            "(WOWD_MONGODB__DDL=none creates nothing): create it (docs/stores.md), or start once with "
            "WOWD_MONGODB__DDL=auto"
        )


async def _prepare(backend: Backend, secrets: list[str]) -> int:
    """``--prepare``: the timer store's chunk spread (MongoDB; nothing to do elsewhere)."""
    spread = getattr(backend.timers, "spread_chunks", None)
    if spread is None:
        out("ok   prepare: nothing to prepare on this backend")
        return 0
    try:
        done: dict[str, str] = await spread()
    except WowdError as exc:
        err(redact(f"FAIL prepare timer chunks: {type(exc).__name__}: {exc}", secrets))
        return 1
    for name, what in done.items():
        out(f"ok   prepare {name}: {what}")
    if not done:
        out("ok   prepare: no timer chunks to spread (not a sharded cluster, or no timer collection)")
    return 0


async def _probes(settings: WowdSettings, backend: Backend) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    probes: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("log", backend.log.ping),
        ("leases", partial(backend.leases.slots, settings.lease_namespace)),
        ("timers", partial(backend.timers.scan, limit=1)),
        ("outbox", backend.outbox.count),
    ]
    if settings.backend == "mongo":
        probes.append(("mongodb privileges", partial(_privileges_probe, settings, backend)))
        probes.append(("mongodb elections", partial(_election_probe, settings, backend)))
    missing_ttl = getattr(backend.timers, "missing_ttl", None)
    if missing_ttl is not None:
        probes.append(("timers tombstone expiry (TTL index)", partial(_ttl_probe, missing_ttl)))
    try:
        types = await backend.log.aggregate_types()
    except WowdError:
        types = []
    if settings.backend == "mongo" and backend.has_sink:  # the Elasticsearch sink: its version, types or not
        any_type = types[0] if types else AggregateType(context=settings.context, aggregate="wowd")
        probe_sink = backend.sink(any_type)
        if hasattr(probe_sink, "check_version"):
            probes.append(("elasticsearch version", probe_sink.check_version))
    for t in types:
        if backend.has_sink:
            probe_ref = AggregateRef(context=t.context, aggregate=t.aggregate, id="wowd-check")
            sink = backend.sink(t)
            probes.append((f"sink {t}", partial(sink.documents, probe_ref)))
            if hasattr(sink, "missing_privileges"):
                probes.append((f"sink privileges {t}", partial(_sink_privileges, sink)))
        probes.append((f"snapshots {t}", partial(backend.rebuilds.table, t)))
    return probes


async def _sink_privileges(sink: Any) -> str:
    """The Elasticsearch sink's privileges, as the cluster answers: each missing one named."""
    missing = await sink.missing_privileges()
    if missing:
        raise StorageError(f"wowd's Elasticsearch user lacks {', '.join(missing)} (see docs/stores.md, Elasticsearch)")
    return "security off" if missing is None else "every privilege held"
