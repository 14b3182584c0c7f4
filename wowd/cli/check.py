"""``wowd check``: the configuration is valid, the backend's servers or file answer and are sound
(:meth:`~wowd.stores.base.Operations.preflight`: the embedded file's ``quick_check``, MongoDB and
Elasticsearch reached, the formats recorded), and every store, the backend's checks of its
servers and the gateway answer. Each server is reached on its own, so that one not answering
does not hide another."""

from __future__ import annotations

import argparse
from contextlib import AsyncExitStack
from functools import partial
from typing import TypeVar

import anyio

from wowd.backends import opened_backend, operations
from wowd.cli.logs import redact, secret_values
from wowd.cli.output import err, out
from wowd.config import WowdSettings, url_shown
from wowd.errors import ConfigError, WowdError
from wowd.model import AggregateRef
from wowd.stores.base import CHUNK_PREPARATION, SERVER_CHECKS, Backend, Probe
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
    found = await operations(settings).preflight()  # the servers or the file, the formats: nothing opened
    for line in found.lines:
        if line.ok:
            out(redact(f"ok   {line.text}", secrets))
        else:
            err(redact(f"FAIL {line.text}", secrets))
            failures += 1
    if found.formats is not None:
        failed, opens = _report_formats(found.formats)
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


async def _prepare(backend: Backend, secrets: list[str]) -> int:
    """``--prepare``: the backend's chunk preparation (:data:`CHUNK_PREPARATION`), where it has one."""
    chunks = backend.capability(CHUNK_PREPARATION)
    if chunks is None:
        out("ok   prepare: nothing to prepare on this backend")
        return 0
    try:
        done = await chunks.prepare_chunks()
    except WowdError as exc:
        err(redact(f"FAIL prepare timer chunks: {type(exc).__name__}: {exc}", secrets))
        return 1
    for name, what in done.items():
        out(f"ok   prepare {name}: {what}")
    if not done:
        out("ok   prepare: no timer chunks to spread (not a sharded cluster, or no timer collection)")
    return 0


async def _probes(settings: WowdSettings, backend: Backend) -> list[Probe]:
    """Every store's probe, then the backend's checks of its servers (:data:`SERVER_CHECKS`, where
    it has them), then per aggregate type of the log its event index and its snapshots."""
    probes = [
        Probe("log", backend.log.ping),
        Probe("leases", partial(backend.leases.slots, settings.lease_namespace)),
        Probe("timers", partial(backend.timer_queries.scan, limit=1)),
        Probe("outbox", backend.outbox.count),
    ]
    servers = backend.capability(SERVER_CHECKS)
    if servers is not None:
        probes += servers.probes()
    try:
        types = await backend.log.aggregate_types()
    except WowdError:
        types = []
    for t in types:
        if backend.has_sink:
            probe_ref = AggregateRef(context=t.context, aggregate=t.aggregate, id="wowd-check")
            probes.append(Probe(f"sink {t}", partial(backend.sink(t).documents, probe_ref)))
            if servers is not None:
                probes += servers.type_probes(t)
        probes.append(Probe(f"snapshots {t}", partial(backend.rebuilds.table, t)))
    return probes
