"""``wowd backup PATH``: a consistent copy of the stores while replicas run on them, where the
backend offers one (:data:`~wowd.stores.base.ONLINE_BACKUP`: the embedded file, copied with
SQLite's online backup and checked before it is put at ``PATH``). Another backend's stores are
backed up with their own tools (docs/operations.md, "Recovery")."""

from __future__ import annotations

import argparse
from pathlib import Path

from wowd.backends import operations
from wowd.cli.args import positive_int
from wowd.cli.output import err, out
from wowd.config import WowdSettings
from wowd.errors import ConfigError
from wowd.stores.base import ONLINE_BACKUP

__all__ = ["STEP_PAGES", "backup", "register"]

STEP_PAGES = 4096
"""Pages copied per step of the backup (16 MiB of 4 KiB pages) unless ``--step-pages`` says."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "backup",
        parents=[common],
        help="copy the embedded database file while replicas run (checked with integrity_check)",
    )
    p.add_argument("path", metavar="PATH", help="the file to write (not an existing one, unless --force)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace PATH when it exists (never the database, its -wal/-shm/-journal, or a directory)",
    )
    p.add_argument(
        "--step-pages",
        type=positive_int,
        default=STEP_PAGES,
        help=f"pages copied per step (default {STEP_PAGES}); progress is shown between steps",
    )
    p.set_defaults(handler=backup)


async def backup(settings: WowdSettings, args: argparse.Namespace) -> int:
    """Exit 0 with the copy at ``PATH``; 1 when the copy fails its check (nothing left at
    ``PATH``); 2 for a backend without an online backup, missing stores, an existing ``PATH``
    (without ``--force``), a directory, or a ``PATH`` that is the stores or a file beside them."""
    ops = operations(settings)
    online = ops.capability(ONLINE_BACKUP)
    if online is None:
        raise ConfigError(
            f"wowd backup copies the stores of a backend that has an online backup; the {ops.name} backend has "
            f"none: back it up with {ops.recovery}"
        )
    done = await online.backup(Path(args.path), force=args.force, step_pages=args.step_pages, progress=out)
    if not done.written:
        err(f"wowd: {done.text}")
        return 1
    out(done.text)
    return 0
