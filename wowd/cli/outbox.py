"""``wowd outbox list|ack|trim``: the outbox the ``outbox`` gateway delivers into, as a queue."""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from wowd.cli.args import non_negative_seconds, positive_int
from wowd.cli.backend import opened_backend
from wowd.cli.output import out, print_json, print_table
from wowd.config import WowdSettings
from wowd.fmt import iso_ms
from wowd.stores.base import OUTBOX_TAKE_LEASE

__all__ = ["outbox", "register"]


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
    ol.add_argument("--json", action="store_true", help="print JSON ({entries, take, depth}) instead of a table")
    oa = osub.add_parser("ack", help="remove consumed entries by request id")
    oa.add_argument("request_ids", nargs="+", metavar="REQUEST_ID", help="request ids as 'outbox list' shows them")
    ot = osub.add_parser("trim", help="remove entries older than an age, acknowledged or not")
    ot.add_argument(
        "--older-than-s",
        type=non_negative_seconds,
        help="age in seconds (default: the configured outbox.retention_s)",
    )
    p.set_defaults(handler=outbox)


async def outbox(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings) as backend:
        box = backend.outbox
        if args.outbox_command == "list":
            batch = await box.take(args.limit, lease=timedelta(seconds=args.lease_s))
            depth = await box.count()
        elif args.outbox_command == "ack":
            removed = await box.ack(args.request_ids)
            out(f"{removed} of {len(set(args.request_ids))} entries acknowledged (removed)")
            return 0
        else:
            age = args.older_than_s if args.older_than_s is not None else settings.outbox.retention_s
            before = int(time.time() * 1000 - age * 1000)
            removed = await box.trim(before)
            out(f"{removed} entries created before {iso_ms(before)} removed")
            return 0
    if args.json:
        entries = [
            {
                "request_id": e.request_id,
                "timer_id": e.timer_id,
                "target": str(e.target),
                "command": e.command,
                "scheduled_at": e.scheduled_at,
                "created_at": e.created_at,
                "fence": e.fence,
                "owner_key": e.owner_key,
            }
            for e in batch.entries
        ]
        print_json({"entries": entries, "take": batch.cursor, "depth": depth})
        return 0
    print_table(
        ["request_id", "created", "target", "command"],
        [[e.request_id, iso_ms(e.created_at), e.target, e.command] for e in batch.entries],
    )
    out(f"{len(batch.entries)} of {depth} entries taken for {args.lease_s:g} s")
    return 0
