"""``wowd run``: one replica until SIGTERM/SIGINT. Signals are received here only."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from prometheus_client import Counter

from wowd import __version__, metrics
from wowd.backends import operations
from wowd.cli.logs import LogFormatter, json_logs
from wowd.cli.output import out
from wowd.config import WowdSettings, url_shown
from wowd.stores.base import Backend

if TYPE_CHECKING:
    from wowd.daemon.supervisor import Supervisor

__all__ = [
    "ESCALATE_AFTER_S",
    "GC_GEN0_THRESHOLD",
    "NOFILE_WANTED",
    "SWITCH_INTERVAL_S",
    "raise_descriptor_limit",
    "register",
    "run",
    "tune_gc",
]

log = logging.getLogger("wowd")

ESCALATE_AFTER_S = 1.0
"""A second signal cancels at once only this long after the first: ``timeout`` and ``make``
forwarding one Ctrl-C or SIGTERM together count as one."""
GC_GEN0_THRESHOLD = 10_000
"""Allocations between two collections of the youngest generation (Python's default: 700). A
round claims, delivers and settles thousands of timers at once; reference counting frees their
objects, and a collection every 700 of them only walks the live ones again and again."""
SWITCH_INTERVAL_S = 0.001
"""How long a thread that wants the interpreter waits for the one running Python before asking it
to let go (Python's default: 5 ms). The stores' threads give the interpreter up during every
SQLite call and want it back right after; while the event loop runs Python, each of those calls
waited up to 5 ms for it, a delay that lands on a feed batch's transaction and on the timer loop's
claims and settles."""


NOFILE_WANTED = 65_536
"""Open descriptors a replica asks for: its soft limit is raised to this, or to its hard limit
when that is lower."""


def raise_descriptor_limit() -> None:
    """Raises the soft limit of open descriptors towards :data:`NOFILE_WANTED`, within the hard
    limit (which only a privileged process may raise): a process started with the 1,024 that
    systemd and container runtimes give by default gets what its hard limit allows. The HTTP
    listener's connection cap and its handling of ``EMFILE`` hold whatever the limit is."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = NOFILE_WANTED if hard == resource.RLIM_INFINITY else min(NOFILE_WANTED, hard)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            log.debug("descriptor limit raised from %d to %d (hard limit %s)", soft, wanted, hard)
    except (ValueError, OSError) as exc:
        log.debug("descriptor limit left as it is: %s", exc)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run a replica until SIGTERM/SIGINT")
    p.add_argument("--demo", action="store_true", help="also run the demo producer in-process")
    p.add_argument("--port-file", type=Path, help="write the bound HTTP port to this file once listening")
    p.set_defaults(handler=run)


async def run(settings: WowdSettings, args: argparse.Namespace) -> int:
    """Runs the supervisor; the first signal stops gracefully, a later one (at least
    :data:`ESCALATE_AFTER_S` after the first) cancels. Exit 1 when cancelled."""
    from wowd.daemon.replica import open_replica  # the replica: loaded by this command only

    raise_descriptor_limit()
    _port_free(settings)
    forced = False

    async def signals(received: AsyncIterator[int], scope: anyio.CancelScope, sup: Supervisor) -> None:
        nonlocal forced
        first: float | None = None
        async for signum in received:
            name = signal.Signals(signum).name
            if first is None:
                first = time.monotonic()
                log.info("received %s: stopping gracefully", name)
                sup.stop()
            elif time.monotonic() - first < ESCALATE_AFTER_S:
                log.info(
                    "received %s again within %.0f s of the first: still stopping gracefully", name, ESCALATE_AFTER_S
                )
            else:
                log.warning("received %s again: cancelling", name)
                forced = True
                sup.cancel()
                scope.cancel()

    # the signals are ours until the stores are closed: a late one does not kill the close
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async with open_replica(settings, port_file=args.port_file) as sup:
            log.info("%s", where_commands_go(settings))
            tune_gc()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            async with anyio.create_task_group() as tg:
                tg.start_soon(signals, received, tg.cancel_scope, sup)
                if settings.demo:
                    tg.start_soon(_demo_in_process, sup.backend, sup, settings)
                await sup.run()
                tg.cancel_scope.cancel()
    return 1 if forced else 0


def tune_gc() -> None:
    """The collector of a long-running replica: what start-up made (modules, settings, stores) is
    left out of every later collection, and the youngest generation is collected every
    :data:`GC_GEN0_THRESHOLD` allocations."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _total(counter: Counter) -> int:
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))


def progress_printer(settings: WowdSettings) -> Callable[[str, dict[str, object]], None]:
    """Prints a line of ``wowd run --demo`` on stdout in the format of the log lines: plain text
    when they are text, one JSON object a line (the same fields as a log line) when they are
    JSON, so that a pipe reads one format."""
    if not json_logs(settings):
        return lambda text, fields: out(text)
    formatter = LogFormatter(True, [])

    def emit(text: str, fields: dict[str, object]) -> None:
        record = logging.makeLogRecord({"name": "wowd.demo", "levelno": logging.INFO, "levelname": "INFO"})
        record.msg = text
        record.__dict__.update(fields)
        out(formatter.format(record))

    return emit


def _port_free(settings: WowdSettings) -> None:
    """Raises the ``OSError`` of binding the listener's port when it is taken, before anything
    is opened (an embedded file is created only by a replica that starts). The listener binds it
    again when the replica starts (a port taken meanwhile fails the start as it would have)."""
    if settings.http.port == 0:
        return
    try:
        with socket.create_server((settings.http.host, settings.http.port)):
            pass
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise
        # another refusal (a host that does not resolve, a privileged port): the listener's
        # start names its setting


def _newcomer(settings: WowdSettings, port: int | None) -> str:
    """What a first ``make run`` needs to know: it is up, where it writes, where fired commands
    go, where to look (the status page, the commands as this shell runs them, the metrics)."""
    where = operations(settings).where()
    base = f"http://localhost:{port}" if port else ""
    wowd = invocation()
    return (
        f"wowd {__version__}: a replica of context {settings.context!r} is up on {where}; a line below every "
        f"second shows commits fed and timers fired. {where_commands_go(settings, wowd)} Look inside at "
        f"{base}/ui (the status page), with `{wowd} status` and `{wowd} timers list`, and at {base}/metrics; "
        "Ctrl-C stops it (details of the replica: WOWD_LOG_LEVEL=DEBUG)."
    )


def where_commands_go(settings: WowdSettings, wowd: str = "wowd") -> str:
    """Where this replica's fired commands go, and how they are read (a sentence)."""
    g = settings.gateway
    if g.kind == "http":
        routes = f" (and {len(g.routes)} route(s) by target)" if g.routes else ""
        to = url_shown(g.url) if g.url else "the routes of WOWD_GATEWAY__ROUTES"
        return f"Fired commands are POSTed to {to}{routes}."
    table = operations(settings).outbox_where()
    return (
        f"Fired commands go to the outbox ({table}), for your application to take and acknowledge: "
        f"`{wowd} outbox list` shows them, `{wowd} outbox take` takes them, docs/operations.md#the-outbox says "
        "how to consume them from Python; WOWD_GATEWAY__KIND=http and WOWD_GATEWAY__URL POST them to a service "
        "instead."
    )


def invocation() -> str:
    """How this shell runs wowd again: ``wowd`` when the PATH finds this one, else the path it
    was run by (``.venv/bin/wowd``) or ``python -m wowd``."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "__main__.py":
        return f"{_shown_path(Path(sys.executable))} -m wowd"
    found = shutil.which(argv0.name)
    if found is not None and Path(found).resolve() == argv0.resolve():
        return argv0.name
    return _shown_path(argv0)


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it is under it, else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


async def _demo_in_process(backend: Backend, sup: Supervisor, settings: WowdSettings) -> None:
    from wowd.demo import DemoStats, produce_forever

    stats = DemoStats()
    show = progress_printer(settings)

    async def progress() -> None:
        start = time.monotonic()
        with anyio.move_on_after(5):  # a port that cannot be bound stops the replica meanwhile
            await sup.listening.wait()
        port = sup.http.bound_port if sup.http is not None else None
        show(_newcomer(settings, port), {"port": port or 0})
        while True:
            await anyio.sleep(1.0)
            fed, fired = _total(metrics.FEED_COMMITS), _total(metrics.TIMERS_FIRED)
            show(
                f"[{time.monotonic() - start:6.1f}s] demo: appended {stats.commits} commits "
                f"({stats.timers} timers) | fed {fed} commits | fired {fired} timers | leases held {len(sup.held)}",
                {"appended": stats.commits, "fed": fed, "fired": fired, "leases_held": len(sup.held)},
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(progress)
        await produce_forever(backend.log, stats, due_in_ms=1500)
