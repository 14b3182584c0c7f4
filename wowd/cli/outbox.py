"""``wowd outbox list|take|ack|trim``: the outbox the ``outbox`` gateway delivers into, as a
queue: ``list`` looks (takes nothing: a consumer's takes are unaffected), ``take`` takes as a
consumer does (the entries are held from the other takes for the lease), ``ack`` removes what was
consumed."""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from wowd.backends import opened_backend
from wowd.cli.args import non_negative_int, non_negative_seconds, positive_int
from wowd.cli.output import at, confirm, err, out, print_json, print_table
from wowd.config import WowdSettings
from wowd.fmt import iso_ms
from wowd.operator import outbox_entry_doc, outbox_page
from wowd.stores.base import OUTBOX_TAKE_LEASE, Outbox

__all__ = ["COUNT_PAGE", "outbox", "register"]

COUNT_PAGE = 1000
"""Entries read a page at a time to count those a trim would remove."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("outbox", parents=[common], help="look at, take, acknowledge and trim the outbox's commands")
    osub = p.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    ol = osub.add_parser("list", help="show the entries in delivery order, taking nothing (a consumer's takes go on)")
    ol.add_argument("--limit", type=positive_int, default=100, help="show at most this many (default 100)")
    ol.add_argument(
        "--offset", type=non_negative_int, default=0, help="skip this many first (as a previous list printed)"
    )
    ol.add_argument(
        "--json", action="store_true", help="print JSON ({entries, next, depth}; times in epoch ms) instead of a table"
    )
    ot = osub.add_parser(
        "take", help="take the oldest entries no other take holds, as a consumer does: ack them within the lease"
    )
    ot.add_argument("--limit", type=positive_int, default=100, help="take at most this many (default 100)")
    ot.add_argument(
        "--lease-s",
        type=non_negative_seconds,
        default=OUTBOX_TAKE_LEASE.total_seconds(),
        help="hold them for this long: no other take gets them meanwhile; ack them within it "
        f"(default {OUTBOX_TAKE_LEASE.total_seconds():g})",
    )
    ot.add_argument(
        "--json",
        action="store_true",
        help="print JSON ({entries, take, depth}; times in epoch ms) instead of a table",
    )
    oa = osub.add_parser("ack", help="remove consumed entries by request id")
    oa.add_argument("request_ids", nargs="+", metavar="REQUEST_ID", help="request ids as 'outbox list' shows them")
    tr = osub.add_parser(
        "trim", help="remove entries older than an age (unacknowledged ones only with --include-unacked)"
    )
    tr.add_argument(
        "--older-than-s",
        type=non_negative_seconds,
        help="age in seconds (default: the configured outbox.retention_s)",
    )
    tr.add_argument(
        "--include-unacked",
        action="store_true",
        help="remove entries no consumer acknowledged (their commands are lost); without it, trim only counts them",
    )
    tr.add_argument("--yes", action="store_true", help="do not ask for confirmation at a terminal")
    p.set_defaults(handler=outbox)


async def outbox(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        box = backend.outbox
        if args.outbox_command == "list":
            entries, nxt = await outbox_page(box, args.offset, args.limit)
            depth = await box.count()
        elif args.outbox_command == "take":
            batch = await box.take(args.limit, lease=timedelta(seconds=args.lease_s))
            entries, depth = list(batch.entries), await box.count()
        elif args.outbox_command == "ack":
            return await _ack(box, args.request_ids)
        else:
            return await _trim(settings, box, args)
    if args.json:
        docs = [outbox_entry_doc(e) for e in entries]
        if args.outbox_command == "list":
            print_json({"entries": docs, "next": nxt, "depth": depth})
        else:
            print_json({"entries": docs, "take": batch.cursor, "depth": depth})
        return 0
    now = int(time.time() * 1000)
    print_table(
        ["request_id", "created", "target", "command"],
        [[e.request_id, at(e.created_at, now), e.target, e.command] for e in entries],
    )
    if args.outbox_command == "take":
        out(f"{len(entries)} of {depth} entries taken for {args.lease_s:g} s: acknowledge them within it (outbox ack)")
    else:
        more = f"; next: --offset {nxt}" if nxt is not None else ""
        out(f"{len(entries)} of {depth} entries shown (none taken){more}")
    return 0


async def _ack(box: Outbox, request_ids: list[str]) -> int:
    """Removes the entries; exit 1 naming how many of the request ids were not there (acknowledged
    already, trimmed, or never delivered into the outbox)."""
    wanted = len(set(request_ids))
    removed = await box.ack(request_ids)
    out(f"{removed} of {wanted} entries acknowledged (removed)")
    if removed < wanted:
        err(
            f"wowd: {wanted - removed} of the request ids named no entry of the outbox (acknowledged already, "
            "trimmed, or never delivered into it)"
        )
        return 1
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
