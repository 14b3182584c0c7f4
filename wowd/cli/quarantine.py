"""``wowd quarantine list|show|retry|dismiss``: the commits the feed set aside, feeding them
again (the steps a retry re-runs: :mod:`wowd.operator`, which the status page's re-feed runs too),
and dismissing those that will never apply.

A document that still does not read, or a step that still refuses, keeps the item quarantined
under its id with the new reason (exit 1); otherwise the item is released (deleted). A dismissed
item is kept, with its reason and who dismissed it, out of the listing (``list --dismissed``
shows it) and of ``retry --all``; naming it to ``retry`` still feeds it.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
from typing import Any

from wowd.backends import opened_backend
from wowd.cli.args import positive_int
from wowd.cli.output import err, out, print_table
from wowd.config import WowdSettings
from wowd.errors import InvalidInput
from wowd.fmt import iso_ms
from wowd.operator import STEPS, RetryOutcome, dismiss_item, read_commit, record_of, retry_item, steps_needed
from wowd.stores.base import Backend, dismissal

__all__ = ["STEPS", "RetryOutcome", "quarantine", "read_commit", "register", "retry_item", "steps_needed"]

PAGE = 100
"""Items read per page by ``retry --all``."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "quarantine", parents=[common], help="list, show, feed again or dismiss the commits the feed set aside"
    )
    qsub = p.add_subparsers(dest="quarantine_command", required=True, metavar="COMMAND")
    ql = qsub.add_parser("list", help="quarantined items, oldest first")
    ql.add_argument("--after", metavar="ID", help="only items after this id (as a previous list printed)")
    ql.add_argument("--limit", type=positive_int, default=100, help="list at most this many (default 100)")
    ql.add_argument("--json", action="store_true", help="print JSON ({items, next}) instead of a table")
    ql.add_argument("--dismissed", action="store_true", help="the dismissed items instead (kept for audit)")
    qs = qsub.add_parser("show", help="one item: its reason and its document")
    qs.add_argument("id", metavar="ID", help="an id as 'quarantine list' shows it")
    qr = qsub.add_parser(
        "retry", help="re-run the steps each item still needs; release what is fed, keep what still fails"
    )
    qr.add_argument("ids", nargs="*", metavar="ID", help="ids as 'quarantine list' shows them")
    qr.add_argument("--all", action="store_true", help="every quarantined item not dismissed")
    qd = qsub.add_parser(
        "dismiss",
        help="set items aside for good: their commits will never apply (kept for audit: list --dismissed)",
    )
    qd.add_argument("ids", nargs="+", metavar="ID", help="ids as 'quarantine list' shows them")
    qd.add_argument("--reason", required=True, help="why the commit will never apply (kept with the item)")
    qd.add_argument("--by", default=None, help="who dismisses them (default: USER@HOST of this shell)")
    p.set_defaults(handler=quarantine)


async def quarantine(settings: WowdSettings, args: argparse.Namespace) -> int:
    if args.quarantine_command == "retry" and bool(args.ids) == bool(args.all):
        err("wowd quarantine retry: give ids or --all (not both)")
        return 2
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        if args.quarantine_command == "list":
            items = await backend.quarantine.items(limit=args.limit, after=args.after, dismissed=args.dismissed)
            _print_list(items, args.limit, as_json=args.json, dismissed=args.dismissed)
            return 0
        if args.quarantine_command == "show":
            found = await backend.quarantine.items(limit=1, ids=[args.id])
            if not found:
                err(f"wowd: no quarantined item {args.id}")
                return 1
            _print_json(found[0])
            return 0
        if args.quarantine_command == "dismiss":
            return await _dismiss(backend, args)
        return await _retry(settings, backend, args)


def _print_json(doc: Any) -> None:
    out(json.dumps(doc, indent=2, default=str))


def _print_list(items: list[dict[str, Any]], limit: int, *, as_json: bool, dismissed: bool = False) -> None:
    after = items[-1]["id"] if len(items) == limit else None
    if as_json:
        _print_json({"items": items, "next": after})
        return
    if dismissed:
        print_table(
            ["id", "dismissed", "by", "aggregate", "record", "why"],
            [
                [i["id"], iso_ms(i["dismissed"]["at"]), i["dismissed"]["by"], i["aggregate"], record_of(i)]
                + [i["dismissed"]["reason"]]
                for i in items
            ],
        )
    else:
        print_table(
            ["id", "created", "partition", "aggregate", "record", "reason"],
            [
                [i["id"], iso_ms(i["created_at"]), i["partition"], i["aggregate"], record_of(i), i["reason"]]
                for i in items
            ],
            right={2},
        )
    more = f"; next: --after {after}" + (" --dismissed" if dismissed else "") if after else ""
    out(f"{len(items)} {'dismissed ' if dismissed else ''}items{more}")


# --------------------------------------------------------------------------- dismiss


def default_author() -> str:
    """``USER@HOST`` of the shell that dismisses (the audit's author when ``--by`` is not given)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name and no passwd entry (a container's arbitrary uid)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


async def _dismiss(backend: Backend, args: argparse.Namespace) -> int:
    try:  # refused before anything is read
        reason, by = dismissal(args.reason, args.by if args.by is not None else default_author())
    except InvalidInput as exc:
        err(f"wowd quarantine dismiss: --{exc.field} {str(exc).partition(': ')[2]}")
        return 2
    failures = 0
    wanted = list(dict.fromkeys(args.ids))
    for item_id in wanted:
        refused = await dismiss_item(backend.quarantine, item_id, reason, by)
        if refused is None:
            out(f"dismissed {item_id}")
        else:
            err(f"wowd: {refused.why}")
            failures += 1
    out(f"{len(wanted) - failures} of {len(wanted)} dismissed by {by}: {reason}")
    return 1 if failures else 0


# --------------------------------------------------------------------------- retry


async def _retry(settings: WowdSettings, backend: Backend, args: argparse.Namespace) -> int:
    quarantine = backend.quarantine
    failures = 0
    fed = 0
    if args.all:
        after: str | None = None
        while True:
            page = await quarantine.items(limit=PAGE, after=after)
            for item in page:
                ok = _report(await retry_item(settings, backend, item))
                fed, failures = fed + ok, failures + (not ok)
            if len(page) < PAGE:
                break
            after = page[-1]["id"]
    else:
        wanted = list(dict.fromkeys(args.ids))
        found = {i["id"]: i for i in await quarantine.items(limit=len(wanted), ids=wanted)}
        for item_id in wanted:
            if item_id not in found:
                err(f"wowd: no quarantined item {item_id}")
                failures += 1
                continue
            ok = _report(await retry_item(settings, backend, found[item_id]))
            fed, failures = fed + ok, failures + (not ok)
    out(f"{fed} fed and released, {failures} still quarantined or not found")
    return 1 if failures else 0


def _report(outcome: RetryOutcome) -> bool:
    steps = ", ".join(outcome.done) or "no step"
    if outcome.reason is None:
        out(f"fed {outcome.item_id} ({outcome.record}): {steps}; released")
        return True
    err(f"FAIL {outcome.item_id} ({outcome.record}) stays quarantined: {outcome.reason}")
    return False
