"""The ``wowd`` command line: arguments, settings, the command, its exit code.

A configuration error exits 2 with its message, as does an HTTP port in use; a store that does
not answer exits 1; a closed stdout (``wowd timers list | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio

from wowd import __version__
from wowd.cli import backup, check, demo, outbox, quarantine, run, snapshots, status, timers
from wowd.cli.logs import redact, secret_values, setup_logging
from wowd.cli.output import err, mask, out
from wowd.config import WowdSettings, load_settings
from wowd.errors import ConfigError, WowdError

__all__ = ["build_parser", "main"]

log = logging.getLogger("wowd")

Handler = Callable[[WowdSettings, argparse.Namespace], Awaitable[int]]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", default=argparse.SUPPRESS, metavar="FILE", help="TOML settings file (also WOWD_CONFIG)"
    )
    p = argparse.ArgumentParser(
        prog="wowd", description="Worker daemon for Wow-style event-sourced contexts", parents=[common]
    )
    p.add_argument("--version", action="version", version=f"wowd {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.register(sub, common)
    check.register(sub, common)
    status.register(sub, common)
    timers.register(sub, common)
    outbox.register(sub, common)
    snapshots.register(sub, common)
    quarantine.register(sub, common)
    demo.register(sub, common)
    backup.register(sub, common)
    sub.add_parser("version", help="print the version").set_defaults(handler=None)
    for name, parser in _children(p):
        for nested in _descendants(parser):
            if "--config" not in nested._option_string_actions:
                nested.add_argument(
                    "--config", default=argparse.SUPPRESS, metavar="FILE", help="TOML settings file (also WOWD_CONFIG)"
                )
        if name in OPEN_EXISTING:
            for nested in [parser, *_descendants(parser)]:
                nested.add_argument(
                    "--create",
                    action="store_true",
                    default=argparse.SUPPRESS,
                    help="create the embedded database file when it does not exist (else: exit 2)",
                )
    return p


OPEN_EXISTING = ("status", "timers", "outbox", "quarantine", "snapshots")
"""Commands that open the database without creating it (``--create`` does)."""


def _children(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """The subcommands' parsers of ``parser``, by name (an alias once)."""
    seen: dict[int, tuple[str, argparse.ArgumentParser]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                seen.setdefault(id(child), (name, child))
    return list(seen.values())


def _descendants(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser`` (``timers`` -> ``timers list``, ...): options given after the
    subcommand (``wowd timers list --config f.toml``) are taken there too."""
    out_: list[argparse.ArgumentParser] = []
    for _, child in _children(parser):
        out_ += [child, *_descendants(child)]
    return out_


def _settings(args: argparse.Namespace) -> WowdSettings:
    overrides: dict[str, Any] = {"demo": True} if getattr(args, "demo", False) else {}
    config = getattr(args, "config", None)
    settings = load_settings(config, **overrides)
    if settings.demo and not settings.reducers:
        settings = load_settings(config, **overrides, reducers={"order": "wowd.demo:reducer"})
    return settings


def _anyio_run(fn: Callable[[], Awaitable[int]]) -> int:
    options = {"use_uvloop": True} if importlib.util.find_spec("uvloop") is not None else {}
    return anyio.run(fn, backend="asyncio", backend_options=options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.handler is None:
        out(f"wowd {__version__}")
        return 0
    try:
        settings = _settings(args)
    except ConfigError as exc:
        err(f"wowd: {exc}")
        return 2
    setup_logging(settings)
    mask(secret_values(settings))
    for note in settings.renamed:
        log.warning("%s", note)
    handler: Handler = args.handler
    try:
        return _anyio_run(partial(handler, settings, args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the process's last word: one clear line, exit non-zero
        return _last_word(exc, settings)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _last_word(exc: BaseException, settings: WowdSettings) -> int:
    leaves = _leaves(exc)
    secrets = secret_values(settings)
    for leaf in leaves:
        if isinstance(leaf, BrokenPipeError):
            _silence_stdout()
            return 0
    for leaf in leaves:
        if isinstance(leaf, OSError) and leaf.errno == errno.EADDRINUSE:
            err(
                f"wowd: HTTP port {settings.http.port} on {settings.http.host} is in use "
                "(choose another with WOWD_HTTP__PORT, 0 for any free port)"
            )
            return 2
    for leaf in leaves:
        if isinstance(leaf, ConfigError):
            err(redact(f"wowd: {leaf}", secrets))
            return 2
    leaf = leaves[0] if leaves else exc
    if isinstance(leaf, WowdError):
        err(redact(f"wowd: {type(leaf).__name__}: {leaf}", secrets))
        return 1
    log.critical("wowd crashed: %s: %s", type(leaf).__name__, leaf, exc_info=exc)
    return 1


def _silence_stdout() -> None:
    """The reader of stdout went away: point stdout at /dev/null so that the interpreter's last
    flush does not fail again (the ``BrokenPipeError`` recipe of the ``signal`` docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)
