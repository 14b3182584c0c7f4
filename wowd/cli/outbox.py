"""``wowd outbox list|ack|trim``: the outbox the ``outbox`` gateway delivers into, as a queue."""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from wowd.backends import opened_backend
from wowd.cli.args import non_negative_seconds, positive_int
from wowd.cli.output import at, confirm, err, out, print_json, print_table
from wowd.config import WowdSettings
from wowd.fmt import iso_ms
from wowd.operator import outbox_entry_doc
from wowd.stores.base import OUTBOX_TAKE_LEASE, Outbox

__all__ = ["COUNT_PAGE", "outbox", "register"]

COUNT_PAGE = 1000
"""Entries read a page at a time to count those a trim would remove."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("outbox", parents=[common], help="list, acknowledge and trim the outbox's commands")
    osub = p.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    ol = osub.add_parser("list", help="take the oldest entries no other take holds, in delivery order")
    ol.add_argument("--limit", type=positive_int, default=100, help="take at most this many (default 100)")
    ol.add_argument(
        "--lease-s",
        type=non_negative_seconds,
        default=OUTBOX_TAKE_LEASE.total_seconds(),
        help="hold them for this long: no other take gets them meanwhile; ack them within it "
        f"(default {OUTBOX_TAKE_LEASE.total_seconds():g})",
    )
    ol.add_argument(
        "--json",
        action="store_true",
        help="print JSON ({entries, take, depth}; times in epoch ms) instead of a table",
    )
    oa = osub.add_parser("ack", help="remove consumed entries by request id")
    oa.add_argument("request_ids", nargs="+", metavar="REQUEST_ID", help="request ids as 'outbox list' shows them")
    ot = osub.add_parser(
        "trim", help="remove entries older than an age (unacknowledged ones only with --include-unacked)"
    )
    ot.add_argument(
        "--older-than-s",
        type=non_negative_seconds,
        help="age in seconds (default: the configured outbox.retention_s)",
    )
    ot.add_argument(
        "--include-unacked",
        action="store_true",
        help="remove entries no consumer acknowledged (their commands are lost); without it, trim only counts them",
    )
    ot.add_argument("--yes", action="store_true", help="do not ask for confirmation at a terminal")
    p.set_defaults(handler=outbox)


async def outbox(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        box = backend.outbox
        if args.outbox_command == "list":
            batch = await box.take(args.limit, lease=timedelta(seconds=args.lease_s))
            depth = await box.count()
        elif args.outbox_command == "ack":
            removed = await box.ack(args.request_ids)
            out(f"{removed} of {len(set(args.request_ids))} entries acknowledged (removed)")
            return 0
        else:
            return await _trim(settings, box, args)
    if args.json:
        entries = [outbox_entry_doc(e) for e in batch.entries]
        print_json({"entries": entries, "take": batch.cursor, "depth": depth})
        return 0
    now = int(time.time() * 1000)
    print_table(
        ["request_id", "created", "target", "command"],
        [[e.request_id, at(e.created_at, now), e.target, e.command] for e in batch.entries],
    )
    out(f"{len(batch.entries)} of {depth} entries taken for {args.lease_s:g} s")
    return 0


async def _trim(settings: WowdSettings, box: Outbox, args: argparse.Namespace) -> int:
    """Every entry still in the outbox is unacknowledged (an ack removes it): trimming one loses
    a command no consumer took, so it needs ``--include-unacked`` (and a yes at a terminal)."""
    age = args.older_than_s if args.older_than_s is not None else settings.outbox.retention_s
    before = int(time.time() * 1000 - age * 1000)
    old = await _count_created_before(box, before)
    if old == 0:
        out(f"0 entries created before {iso_ms(before)}: nothing to remove")
        return 0
    if not args.include_unacked:
        err(
            f"wowd: {old} unacknowledged entries were created before {iso_ms(before)}: no consumer took their "
            "commands; --include-unacked removes them (nothing was removed)"
        )
        return 1
    if not confirm(f"remove {old} unacknowledged entries created before {iso_ms(before)}?", yes=args.yes):
        err("wowd: nothing was removed")
        return 1
    removed = await box.trim(before)
    out(f"{removed} unacknowledged entries created before {iso_ms(before)} removed")
    return 0


async def _count_created_before(box: Outbox, before: int) -> int:
    """The entries created before ``before``, read a page at a time (a read: nothing is taken)."""
    count, seen = 0, 0
    while True:
        page = await box.entries(limit=COUNT_PAGE, after=seen)
        count += sum(1 for e in page if e.created_at < before)
        seen += len(page)
        if len(page) < COUNT_PAGE:
            return count
