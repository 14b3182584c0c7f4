"""The ``wowd`` command line: the one composition root (settings -> stores -> daemon).

``wowd run [--demo] [--config FILE]``, ``wowd check``, ``wowd version``, ``wowd status [--json]``,
``wowd timers list|retry|resume``, ``wowd snapshots status|rebuild``, ``wowd demo``. A configuration
error exits 2 with its message; a store that does not answer exits 1. Signals are handled here
only: the first SIGTERM/SIGINT stops the replica gracefully, a second one cancels it at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

import anyio

from wowd import __version__
from wowd.config import WowdSettings, load_settings
from wowd.errors import ConfigError, WowdError
from wowd.model import AggregateRef, Timer, TimerChange, TimerStatus

__all__ = ["main"]

log = logging.getLogger("wowd")

# --------------------------------------------------------------------------- secrets and logs


def secret_values(settings: WowdSettings) -> list[str]:
    """Every credential in the settings (and the password inside the MongoDB URI)."""
    out: list[str] = []
    for s in (settings.gateway.token, settings.elasticsearch.api_key, settings.elasticsearch.password):
        if s is not None and s.get_secret_value():
            out.append(s.get_secret_value())
    if settings.mongodb.uri is not None:
        uri = settings.mongodb.uri.get_secret_value()
        out.append(uri)
        try:
            parts = urlsplit(uri)
            if parts.password:
                out += [parts.password, unquote(parts.password)]
        except ValueError:
            pass
    return sorted({v for v in out if len(v) >= 3}, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s in text:
            text = text.replace(s, "**********")
    return text


_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _Formatter(logging.Formatter):
    """Text or JSON lines; every secret value is masked in the final line."""

    def __init__(self, json_lines: bool, secrets: list[str]) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._json = json_lines
        self._secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in vars(record).items() if k not in _STD_ATTRS and not k.startswith("_")}
        if self._json:
            doc: dict[str, Any] = {
                "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
            }
            doc.update({k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in extras.items()})
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            line = json.dumps(doc, ensure_ascii=False)
        else:
            line = super().format(record)
            if extras:
                line += " [" + " ".join(f"{k}={v}" for k, v in extras.items()) + "]"
        return redact(line, self._secrets)


def setup_logging(settings: WowdSettings, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    fmt = settings.log_format
    json_lines = fmt == "json" or (fmt == "auto" and not stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_Formatter(json_lines, secret_values(settings)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    try:
        root.setLevel(settings.log_level.upper())
    except ValueError:
        root.setLevel(logging.INFO)
    for noisy in ("aiohttp", "pymongo", "elastic_transport"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wowd", description="Worker daemon for Wow-style event-sourced contexts")
    p.add_argument("--config", help="TOML settings file (also WOWD_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a replica until SIGTERM/SIGINT")
    run.add_argument("--config", dest="sub_config", help=argparse.SUPPRESS)
    run.add_argument("--demo", action="store_true", help="also run the demo producer in-process")
    run.add_argument("--port-file", type=Path, help="write the bound HTTP port to this file")

    check = sub.add_parser("check", help="validate the configuration and reach every store")
    check.add_argument("--config", dest="sub_config", help=argparse.SUPPRESS)

    sub.add_parser("version", help="print the version")

    status = sub.add_parser("status", help="the slot table and partitions without a live holder")
    status.add_argument("--config", dest="sub_config", help=argparse.SUPPRESS)
    status.add_argument("--json", action="store_true")

    timers = sub.add_parser("timers", help="inspect and repair timers")
    timers.add_argument("--config", dest="sub_config", help=argparse.SUPPRESS)
    tsub = timers.add_subparsers(dest="timers_command", required=True)
    tl = tsub.add_parser("list", help="list timers")
    tl.add_argument("--status", choices=[s.value for s in TimerStatus])
    tl.add_argument("--limit", type=int, default=100)
    tl.add_argument("--json", action="store_true")
    tr = tsub.add_parser("retry", help="FAILED -> PENDING")
    tr.add_argument("timer_ids", nargs="+", metavar="TIMER_ID")
    tm = tsub.add_parser("resume", help="PARKED -> PENDING")
    tm.add_argument("timer_ids", nargs="+", metavar="TIMER_ID")

    snaps = sub.add_parser("snapshots", help="snapshot tables and rebuilds of the configured reducers")
    snaps.add_argument("--config", dest="sub_config", help=argparse.SUPPRESS)
    ssub = snaps.add_subparsers(dest="snapshots_command", required=True)
    ss = ssub.add_parser("status", help="per reducer type: the claimed revision, flags and pending snapshots")
    ss.add_argument("--json", action="store_true")
    sr = ssub.add_parser("rebuild", help="claim the reducers' revisions and rebuild snapshots from the log")
    sr.add_argument("--aggregate", action="append", help="only this aggregate type (repeatable)")
    sr.add_argument("--partitions", nargs="+", metavar="P", help="only these partitions (default: all)")
    sr.add_argument(
        "--force", action="store_true", help="also partitions a live replica owns, and backfilled types"
    )
    sr.add_argument("--json", action="store_true")

    demo = sub.add_parser("demo", help="append demo commits with timer events to the log")
    demo.add_argument("--config", dest="sub_config", help=argparse.SUPPRESS)
    demo.add_argument("--commits", type=int, default=1000)
    demo.add_argument("--timers", type=int, default=1000)
    demo.add_argument("--due-in-ms", type=int, default=2000)
    demo.add_argument("--aggregates", type=int, default=100)
    return p


def _anyio_run(fn: Callable[[], Awaitable[int]]) -> int:
    options = {"use_uvloop": True} if importlib.util.find_spec("uvloop") is not None else {}
    return anyio.run(fn, backend="asyncio", backend_options=options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        _out(f"wowd {__version__}")
        return 0
    config = getattr(args, "sub_config", None) or args.config
    overrides: dict[str, Any] = {}
    if args.command == "run" and args.demo:
        overrides["demo"] = True
    try:
        settings = load_settings(config, **overrides)
        if settings.demo and not settings.reducers:
            settings = load_settings(config, **overrides, reducers={"order": "wowd.demo:reducer"})
    except ConfigError as exc:
        _err(f"wowd: {exc}")
        return 2
    setup_logging(settings)
    secrets = secret_values(settings)
    commands: dict[str, Callable[[WowdSettings, argparse.Namespace], Awaitable[int]]] = {
        "run": cmd_run,
        "check": cmd_check,
        "status": cmd_status,
        "timers": cmd_timers,
        "snapshots": cmd_snapshots,
        "demo": cmd_demo,
    }
    try:
        return _anyio_run(partial(commands[args.command], settings, args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the process's last word: one clear line, exit non-zero
        leaf = _leaf(exc)
        if isinstance(leaf, ConfigError):
            _err(redact(f"wowd: {leaf}", secrets))
            return 2
        if isinstance(leaf, WowdError):
            _err(redact(f"wowd: {type(leaf).__name__}: {leaf}", secrets))
            return 1
        log.critical("wowd crashed: %s: %s", type(leaf).__name__, leaf, exc_info=exc)
        return 1


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception of (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


# --------------------------------------------------------------------------- run


async def cmd_run(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.daemon.gateway import CommandGateway, HttpGateway, OutboxGateway
    from wowd.daemon.supervisor import Supervisor
    from wowd.stores import open_backend

    backend = await open_backend(settings)
    gateway: CommandGateway
    if settings.gateway.kind == "http":
        gateway = HttpGateway(settings.gateway, concurrency=settings.timers.concurrency)
    else:
        gateway = OutboxGateway(backend.outbox)
    sup = Supervisor(settings, backend, gateway, port_file=args.port_file)
    forced = False

    async def signals(scope: anyio.CancelScope) -> None:
        nonlocal forced
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                if not sup.stopping:
                    log.info("received %s: stopping gracefully", signal.Signals(signum).name)
                    sup.stop()
                else:
                    log.warning("received %s again: cancelling", signal.Signals(signum).name)
                    forced = True
                    sup.cancel()
                    scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(signals, tg.cancel_scope)
            if settings.demo:
                tg.start_soon(_demo_in_process, settings, backend)
            await sup.run()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await gateway.aclose()
            await backend.close()
    return 1 if forced else 0


async def _demo_in_process(settings: WowdSettings, backend: Any) -> None:
    from wowd import metrics
    from wowd.demo import DemoStats, produce_forever

    stats = DemoStats()

    def total(counter: Any) -> int:
        return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))

    async def progress() -> None:
        start = time.monotonic()
        while True:
            await anyio.sleep(1.0)
            _out(
                f"[{time.monotonic() - start:6.1f}s] demo: appended {stats.commits} commits "
                f"({stats.timers} timers) | fed {total(metrics.FEED_COMMITS)} commits | "
                f"fired {total(metrics.TIMERS_FIRED)} timers | leases held {int(metrics.LEASES_HELD._value.get())}"
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(progress)
        await produce_forever(backend.log, stats, due_in_ms=1500)


# --------------------------------------------------------------------------- check, status, timers, demo


async def cmd_check(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.stores import open_backend

    secrets = secret_values(settings)
    _out(f"configuration ok: context {settings.context!r}, backend {settings.backend}, "
         f"{settings.partitions} partitions, lease namespace {settings.lease_namespace!r} "
         f"(limit {settings.lease.limit}, ttl {settings.lease.ttl_s}s), gateway {settings.gateway.kind}")
    failures = 0
    try:
        with anyio.fail_after(30):
            backend = await open_backend(settings)
    except (WowdError, TimeoutError) as exc:
        _err(redact(f"FAIL open {settings.backend} backend: {type(exc).__name__}: {exc}", secrets))
        return 1
    try:
        from wowd.daemon.feed import load_reducer

        for agg, path in settings.reducers.items():
            try:
                load_reducer(path)
                _out(f"ok   reducer {agg} -> {path}")
            except ConfigError as exc:
                _err(f"FAIL reducer {agg}: {exc}")
                failures += 1
        probes: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("log", backend.log.ping),
            ("leases", partial(backend.leases.slots, settings.lease_namespace)),
            ("timers", partial(backend.timers.scan, limit=1)),
            ("outbox", backend.outbox.count),
        ]
        types = []
        try:
            types = await backend.log.aggregate_types()
        except WowdError:
            pass
        for t in types:
            probes.append((f"sink {t}", partial(backend.sink(t).documents, AggregateRef(
                context=t.context, aggregate=t.aggregate, id="wowd-check"))))
            probes.append((f"snapshots {t}", partial(backend.rebuilds.table, t)))
        for name, probe in probes:
            try:
                with anyio.fail_after(15):
                    await probe()
                _out(f"ok   {name}")
            except (WowdError, TimeoutError) as exc:
                _err(redact(f"FAIL {name}: {type(exc).__name__}: {exc}", secrets))
                failures += 1
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()
    if failures:
        _err(f"wowd check: {failures} problem(s)")
        return 1
    _out("wowd check: all stores answer")
    return 0


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


async def cmd_status(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.stores import open_backend

    backend = await open_backend(settings)
    try:
        states = await backend.leases.slots(settings.lease_namespace)
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()
    lo, hi = settings.lease.slot_offset, settings.lease.slot_offset + settings.lease.limit
    by_slot = {s.slot: s for s in states}
    rows: list[dict[str, Any]] = []
    unowned: list[int] = []
    for slot in range(lo, hi):
        st = by_slot.get(slot)
        live = st is not None and st.live
        if not live:
            unowned += settings.partitions_of_slot(slot)
        rows.append(
            {
                "slot": slot,
                "holder": st.owner_key if st is not None else None,
                "last_holder": st.last_owner_key if st is not None else None,
                "fence": st.fence if st is not None else 0,
                "incarnation": st.incarnation if st is not None else 0,
                "expires_at": st.expires_at if st is not None else None,
                "expires_in_ms": (st.expires_at - st.store_now) if st is not None else None,
                "live": live,
                "partitions": len(settings.partitions_of_slot(slot)),
            }
        )
    store_now = states[0].store_now if states else None
    doc: dict[str, Any] = {
        "namespace": settings.lease_namespace,
        "limit": settings.lease.limit,
        "store_now": store_now,
        "slots": rows,
        "partitions_without_live_holder": sorted(unowned),
    }
    if args.json:
        _out(json.dumps(doc, indent=2))
        return 0
    _out(f"namespace {doc['namespace']} (limit {settings.lease.limit})"
         + (f", store now {_iso(store_now)}" if store_now else ""))
    _out(f"{'slot':>4}  {'fence':>5}  {'live':<4}  {'expires (store time)':<29}  holder")
    for r in rows:
        exp = _iso(r["expires_at"]) if r["expires_at"] else "-"
        holder = r["holder"] or f"- (last: {r['last_holder'] or '-'})"
        _out(f"{r['slot']:>4}  {r['fence']:>5}  {'yes' if r['live'] else 'no':<4}  {exp:<29}  {holder}")
    _out(f"partitions without a live holder: {len(unowned)}"
         + (f" ({', '.join(map(str, sorted(unowned)))})" if unowned else ""))
    return 0


def _timer_doc(t: Timer) -> dict[str, Any]:
    return {
        "timer_id": t.timer_id,
        "status": t.status.value,
        "partition": t.partition,
        "owner": str(t.owner),
        "key": t.key,
        "version": t.version,
        "due_at": t.due_at,
        "scheduled_at": t.scheduled_at,
        "target": str(t.target),
        "rule": t.rule.to_doc(),
        "attempts": t.attempts,
        "fired": t.fired,
        "last_error": t.last_error,
        "request_id": t.request_id,
    }


SCAN_LIMIT = 100_000


async def cmd_timers(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.stores import open_backend

    backend = await open_backend(settings)
    try:
        store = backend.timers
        if args.timers_command == "list":
            status = TimerStatus(args.status) if args.status else None
            found = await store.scan(status=status, limit=args.limit)
            if args.json:
                _out(json.dumps([_timer_doc(t) for t in found], indent=2))
            else:
                for t in found:
                    _out(f"{t.timer_id}  {t.status.value:<7}  p{t.partition:<4} due {_iso(t.due_at)}  "
                         f"{t.owner} {t.key!r} -> {t.target} attempts={t.attempts}"
                         + (f" error={t.last_error}" if t.last_error else ""))
                _out(f"{len(found)} timer(s)")
            return 0
        wanted_status = TimerStatus.FAILED if args.timers_command == "retry" else TimerStatus.PARKED
        wanted = set(args.timer_ids)
        candidates = [t for t in await store.scan(status=wanted_status, limit=SCAN_LIMIT) if t.timer_id in wanted]
        now = int(time.time() * 1000)
        written = await store.settle([TimerChange.resume(t, due_at=now) for t in candidates]) if candidates else 0
        missing = wanted - {t.timer_id for t in candidates}
        _out(f"{written} timer(s) back to PENDING")
        for tid in sorted(missing):
            _err(f"not {wanted_status.value}: {tid}")
        return 0 if not missing and written == len(candidates) else 1
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()


async def cmd_snapshots(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.daemon.feed import load_reducer
    from wowd.daemon.rebuild import Rebuilder, live_partitions, report_doc, status_doc
    from wowd.stores import open_backend

    reducers = {agg: load_reducer(path) for agg, path in settings.reducers.items()}
    if not reducers:
        _err("wowd: no reducers configured (WOWD_REDUCERS): no snapshots are kept")
        return 2
    unknown = sorted(set(getattr(args, "aggregate", None) or ()) - set(reducers))
    if unknown:
        _err(f"wowd: no reducer configured for {', '.join(unknown)} (reducers: {', '.join(sorted(reducers))})")
        return 2
    given: list[str] = getattr(args, "partitions", None) or []
    try:
        parts = sorted({int(x) for arg in given for x in arg.split(",") if x.strip()})
    except ValueError:
        _err(f"wowd: --partitions: integers expected, got {' '.join(given)}")
        return 2
    backend = await open_backend(settings)
    try:
        rebuilder = Rebuilder(settings, backend, reducers)
        if args.snapshots_command == "status":
            docs = [status_doc(s) for s in await rebuilder.status()]
            if args.json:
                _out(json.dumps(docs, indent=2))
                return 0
            _out(f"{'aggregate':<20} {'reducer':>7} {'table':>5}  {'flags':<20} {'pending':>8}  rebuilt")
            for d in docs:
                t = d["table"]
                flags = ",".join(k for k in ("rebuilding", "backfilled") if t and t[k]) or "-"
                _out(f"{d['aggregate']:<20} {d['reducer_revision']:>7} {t['revision'] if t else '-':>5}  "
                     f"{flags:<20} {d['pending']:>8}  {d['partitions_done']}/{d['partitions']}")
            return 0
        wanted = parts if given else list(range(settings.partitions))
        states = await backend.leases.slots(settings.lease_namespace)
        busy = sorted(set(wanted) & live_partitions(settings, states))
        if busy and not args.force:
            _err(f"wowd: partitions {', '.join(map(str, busy))} have a live holder, which rebuilds them itself "
                 "(--partitions to choose others, --force to rebuild them anyway)")
            return 1
        reports = await rebuilder.rebuild(wanted, aggregates=args.aggregate, force=args.force)
        docs = [report_doc(r) for r in reports]
        if args.json:
            _out(json.dumps(docs, indent=2))
        else:
            for d in docs:
                _out(f"{d['aggregate']} revision {d['revision']}: {d['outcome']}, "
                     f"{len(d['partitions'])} partition(s), "
                     f"{d['aggregates']} aggregate(s), {d['rewritten']} rewritten, {d['unchanged']} unchanged, "
                     f"{d['skipped']} skipped, {d['failed']} failed" + (", backfilled" if d["backfilled"] else ""))
        return 1 if any(d["outcome"] == "superseded" or d["failed"] for d in docs) else 0
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()


async def cmd_demo(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.demo import produce
    from wowd.stores import open_backend

    backend = await open_backend(settings)
    try:
        start = time.monotonic()
        stats = await produce(
            backend.log,
            commits=args.commits,
            timers=args.timers,
            due_in_ms=args.due_in_ms,
            aggregates=args.aggregates,
        )
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()
    _out(f"appended {stats.commits} commits with {stats.timers} timers ({stats.cancelled} cancelled) "
         f"to {settings.context} in {time.monotonic() - start:.2f}s")
    return 0



if __name__ == "__main__":
    sys.exit(main())
