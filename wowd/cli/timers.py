"""``wowd timers list|show|schedule|cancel|retry|resume``: the timer view, for operators, and
the application API (:mod:`wowd.client`) on the command line."""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from typing import Any

from wowd.cli.args import positive_int
from wowd.cli.backend import opened_backend
from wowd.cli.output import err, out, print_json, print_table
from wowd.config import WowdSettings
from wowd.errors import ConfigError, InvalidInput
from wowd.fmt import iso_ms
from wowd.model import DEFAULT_TENANT, AggregateRef, Command, Timer, TimerChange, TimerStatus
from wowd.stores.base import Log

__all__ = ["SCAN_LIMIT", "deliveries", "parse_ref", "register", "timer_doc", "timers"]

SCAN_LIMIT = 100_000
"""Timers read to find the ones named by id (``retry``, ``resume``)."""


def _status(text: str) -> TimerStatus:
    try:
        return TimerStatus(text.upper())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a timer status ({', '.join(s.value.lower() for s in TimerStatus)})"
        ) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object {...} is expected")
    return value


def _instant(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: ISO 8601 (with a zone) or epoch milliseconds expected") from None
    if at.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give the time zone (e.g. +00:00 or Z)")
    return int(at.timestamp() * 1000)


def parse_ref(text: str, *, context: str, tenant: str | None = None) -> AggregateRef:
    """``AGGREGATE/ID`` or ``CONTEXT.AGGREGATE/ID`` (the id may hold ``/``) in ``tenant``."""
    head, sep, agg_id = text.partition("/")
    if not sep or not head or not agg_id:
        raise ConfigError(f"{text!r}: AGGREGATE/ID expected (e.g. order/o-1)")
    ctx, dot, aggregate = head.rpartition(".")
    try:
        return AggregateRef(
            context=ctx if dot else context, aggregate=aggregate, id=agg_id, tenant_id=tenant or DEFAULT_TENANT
        )
    except InvalidInput as exc:
        raise ConfigError(f"{text!r}: {exc}") from exc


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("timers", parents=[common], help="list, show, schedule, cancel and repair timers")
    tsub = p.add_subparsers(dest="timers_command", required=True, metavar="COMMAND")

    tl = tsub.add_parser("list", help="list timers by due time, with what each status needs")
    tl.add_argument(
        "--status", type=_status, help="only timers in this status: pending, firing, parked or failed (any case)"
    )
    tl.add_argument("--limit", type=positive_int, default=100, help="list at most this many (default 100)")
    tl.add_argument("--json", action="store_true", help="print JSON instead of a table")

    ts = tsub.add_parser("show", help="one timer, by its owner and key")
    ts.add_argument("owner", metavar="AGGREGATE/ID", help="the owner aggregate (CONTEXT.AGGREGATE/ID also taken)")
    ts.add_argument("key", help="the timer's key")
    ts.add_argument("--tenant", help=f"the owner's tenant id (default {DEFAULT_TENANT})")
    ts.add_argument("--json", action="store_true", help="print JSON instead of lines")

    tsc = tsub.add_parser("schedule", help="append a commit of the owner scheduling a timer (the application API)")
    tsc.add_argument("owner", metavar="AGGREGATE/ID", help="the owner aggregate (CONTEXT.AGGREGATE/ID also taken)")
    tsc.add_argument("key", help="the timer's key (a later schedule of the same key replaces it)")
    tsc.add_argument("--command", required=True, metavar="NAME", help="the command sent to the target when due")
    tsc.add_argument("--body", type=_json_object, default={}, help="the command's body, a JSON object (default {})")
    tsc.add_argument("--body-type", help="the command's body type (sent as Command-Type)")
    when = tsc.add_mutually_exclusive_group()
    when.add_argument("--at", type=_instant, help="due at this time: ISO 8601 with a zone, or epoch milliseconds")
    when.add_argument("--in", dest="in_s", type=float, metavar="SECONDS", help="due this many seconds from now")
    rule = tsc.add_mutually_exclusive_group()
    rule.add_argument("--every-ms", type=positive_int, help="recurring: every this many milliseconds")
    rule.add_argument("--cron", metavar="EXPR", help="recurring: a cron expression (5 or 6 fields)")
    tsc.add_argument("--zone", default="UTC", help="the time zone of --cron (default UTC)")
    tsc.add_argument("--target", metavar="AGGREGATE/ID", help="where the command goes (default: the owner)")
    tsc.add_argument("--tenant", help=f"the owner's tenant id (default {DEFAULT_TENANT})")
    tsc.add_argument("--target-tenant", help="the target's tenant id (default: the owner's)")

    tc = tsub.add_parser("cancel", help="append a commit of the owner cancelling a timer")
    tc.add_argument("owner", metavar="AGGREGATE/ID", help="the owner aggregate (CONTEXT.AGGREGATE/ID also taken)")
    tc.add_argument("key", help="the timer's key")
    tc.add_argument("--tenant", help=f"the owner's tenant id (default {DEFAULT_TENANT})")

    tr = tsub.add_parser("retry", help="FAILED timers back to PENDING, due now")
    tr.add_argument("timer_ids", nargs="+", metavar="TIMER_ID", help="ids as 'timers list' shows them")
    tm = tsub.add_parser("resume", help="PARKED timers back to PENDING, due now")
    tm.add_argument("timer_ids", nargs="+", metavar="TIMER_ID", help="ids as 'timers list' shows them")
    p.set_defaults(handler=timers)


# --------------------------------------------------------------------------- what a timer shows


def deliveries(t: Timer) -> int:
    """Deliveries made of the current occurrence, as the metrics count them (each delivery is one
    of fired, retried, parked or failed): the store's ``attempts`` counts the retries, and a
    PARKED or FAILED timer also had the delivery that parked or failed it."""
    return t.attempts + (1 if t.status in (TimerStatus.PARKED, TimerStatus.FAILED) else 0)


def detail(t: Timer) -> str:
    """What an operator needs of a timer in its status."""
    if t.status is TimerStatus.PENDING:
        text = f"due {iso_ms(t.due_at)}"
        return text + (f" (retry; last error: {t.last_error})" if t.last_error else "")
    if t.status is TimerStatus.FIRING:
        who = t.claim.owner_key if t.claim is not None else "?"
        return f"claimed by {who} until {iso_ms(t.due_at)}"
    if t.status is TimerStatus.PARKED:
        return f"parked since {iso_ms(t.due_at)}: {t.last_error or '-'}"
    return f"failed: {t.last_error or '-'}"


def timer_doc(t: Timer) -> dict[str, Any]:
    doc: dict[str, Any] = {
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
        "command": t.body,
        "attempts": deliveries(t),
        "fired": t.fired,
        "last_error": t.last_error,
        "request_id": t.request_id,
        "claim": None,
    }
    if t.claim is not None:
        doc["claim"] = {"owner_key": t.claim.owner_key, "fence": t.claim.fence, "until": t.claim.until}
    return doc


# --------------------------------------------------------------------------- commands


async def timers(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        store = backend.timers
        if args.timers_command == "list":
            found = await store.scan(status=args.status, limit=args.limit + 1)
            _print_list(found[: args.limit], cut=len(found) > args.limit, json=args.json)
            return 0
        if args.timers_command in ("schedule", "cancel"):
            return await _write(settings, backend.log, args)
        if args.timers_command == "show":
            owner = parse_ref(args.owner, context=settings.context, tenant=args.tenant)
            t = await store.find(owner, args.key)
            if t is None:
                err(f"wowd: no timer {args.key!r} of {owner}")
                return 1
            _print_one(t, json=args.json)
            return 0
        wanted_status = TimerStatus.FAILED if args.timers_command == "retry" else TimerStatus.PARKED
        wanted = set(args.timer_ids)
        candidates = [t for t in await store.scan(status=wanted_status, limit=SCAN_LIMIT) if t.timer_id in wanted]
        now = int(time.time() * 1000)
        written = await store.settle([TimerChange.resume(t, due_at=now) for t in candidates]) if candidates else 0
        missing = wanted - {t.timer_id for t in candidates}
        others = {t.timer_id: t for t in await store.scan(limit=SCAN_LIMIT) if t.timer_id in missing} if missing else {}
    out(f"{written} timer(s) back to PENDING")
    for tid in sorted(missing):
        other = others.get(tid)
        if other is None:
            err(f"wowd: no such timer: {tid}")
        else:
            err(f"wowd: timer {tid} is {other.status.value}, not {wanted_status.value}")
    return 0 if not missing and written == len(candidates) else 1


async def _write(settings: WowdSettings, log: Log, args: argparse.Namespace) -> int:
    from wowd.client import WowdClient

    client = WowdClient(log, max_body_bytes=settings.timers.max_body_bytes)
    owner = parse_ref(args.owner, context=settings.context, tenant=args.tenant)
    if args.timers_command == "cancel":
        commit = await client.cancel(owner, args.key)
        out(f"cancel of timer {args.key!r} of {owner} appended at version {commit.version}")
        return 0
    target = (
        parse_ref(args.target, context=settings.context, tenant=args.target_tenant or owner.tenant_id)
        if (args.target)
        else owner
    )
    rule: dict[str, Any] | None = None
    if args.every_ms is not None:
        rule = {"type": "interval", "every_ms": args.every_ms}
    elif args.cron is not None:
        rule = {"type": "cron", "expression": args.cron, "zone": args.zone}
    due_at = args.at if args.at is not None else None
    if args.in_s is not None:
        due_at = int(time.time() * 1000 + args.in_s * 1000)
    if due_at is None and rule is None:
        due_at = int(time.time() * 1000)  # a one-shot timer without a time: due now
    command = Command(name=args.command, body=args.body, body_type=args.body_type)
    commit = await client.schedule(owner, args.key, command=command, due_at=due_at, rule=rule, target=target)
    (event,) = commit.events
    out(
        f"timer {args.key!r} of {owner} scheduled at version {commit.version}: {args.command} to {target} "
        f"due {iso_ms(event.body['due_at'])}"
    )
    return 0


def _print_list(found: list[Timer], *, cut: bool, json: bool) -> None:
    if json:
        print_json([timer_doc(t) for t in found])
        return
    print_table(
        ["timer_id", "status", "partition", "owner", "key", "target", "attempts", "detail"],
        [[t.timer_id, t.status.value, t.partition, t.owner, t.key, t.target, deliveries(t), detail(t)] for t in found],
        right={2, 6},
    )
    if cut:
        out(f"{len(found)} timer(s) shown; more exist (--limit to list more)")
    else:
        out(f"{len(found)} timer(s)")


def _print_one(t: Timer, *, json: bool) -> None:
    doc = timer_doc(t)
    if json:
        print_json(doc)
        return
    for k, v in doc.items():
        out(f"{k + ':':<13} {v if v is not None else '-'}")
    out(f"{'detail:':<13} {detail(t)}")
