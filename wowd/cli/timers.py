"""``wowd timers list|show|schedule|cancel|retry|resume|rebuild``: the timer view, for operators,
and the application API (:mod:`wowd.client`) on the command line."""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from wowd.backends import opened_backend
from wowd.cli.args import non_negative_int, positive_int, seconds
from wowd.cli.output import at, confirm, err, out, print_json, print_table
from wowd.client import SCHEDULES, WowdClient, next_occurrences, schedule_stream
from wowd.config import WowdSettings
from wowd.errors import ConfigError, InvalidInput
from wowd.fmt import iso_ms, one_line
from wowd.model import (
    CRON_DIALECTS,
    DEFAULT_TENANT,
    AggregateRef,
    Command,
    CronRule,
    OnceRule,
    Timer,
    TimerStatus,
    parse_rule,
)
from wowd.operator import (
    ENDED_DETAIL,
    TimerHistoryView,
    cursor_of,
    deliveries,
    detail,
    find_timer,
    history_doc,
    history_line,
    parse_cursor,
    parse_ref,
    repair_timers,
    timer_doc,
    timer_history,
)
from wowd.stores.base import Backend, Log, TimerFiring, TimerQueries, TimerSearch

__all__ = ["SCAN_LIMIT", "cursor_of", "deliveries", "parse_ref", "register", "selected", "timer_doc", "timers"]

SCAN_LIMIT = 100_000
"""Timers read to find the ones named by id, by target or after a cursor (the store lists timers
from the first due only)."""


def _status(text: str) -> TimerStatus:
    try:
        return TimerStatus(text.upper())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a timer status ({', '.join(s.value.lower() for s in TimerStatus)})"
        ) from None


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object, given inline or as ``@FILE`` (read from the file)."""
    where = ""
    if text.startswith("@"):
        where = f"{text[1:]}: "
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {exc}") from None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{where}not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{where}a JSON object {{...}} is expected")
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


NEXT_SHOWN = 3
"""Occurrences a schedule of a recurring timer shows."""
PAST_TOLERANCE_MS = 1000
"""A due time at most this far in the past is "now" (the clock moved while the command ran)."""

FLAGS = {
    "body.due_at": "--at/--in",
    "rule.expression": "--cron",
    "rule.zone": "--zone",
    "rule.dialect": "--cron-dialect",
    "rule.every_ms": "--every-ms",
    "rule.misfire_grace_ms": "--misfire-grace-ms",
    "rule": "--cron/--every-ms",
    "body.command.name": "--command",
    "body.command.body_type": "--body-type",
    "body.command": "--body",
    "body.command.body": "--body",
    "body.key": "KEY",
}
"""The flag of ``wowd timers schedule`` that gave each field of the event."""


def _flag(field: str | None) -> str:
    if field is None:
        return "wowd timers schedule"
    if field in FLAGS:
        return FLAGS[field]
    if field.startswith("body.target"):
        return "--target"
    return next((flag for f, flag in FLAGS.items() if field.startswith(f + ".")), field)


IN_OWNER_STREAM_HELP = (
    "append to the owner aggregate's own stream, at its next version (default: wowd's stream of the owner, "
    f"aggregate {SCHEDULES}, which leaves the application's streams alone)"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("timers", parents=[common], help="list, show, schedule, cancel and repair timers")
    tsub = p.add_subparsers(dest="timers_command", required=True, metavar="COMMAND")

    tl = tsub.add_parser("list", help="list timers by due time, with what each status needs")
    tl.add_argument(
        "--status", type=_status, help="only timers in this status: pending, firing, parked or failed (any case)"
    )
    tl.add_argument("--target", metavar="AGGREGATE/ID", help="only timers whose command goes to this aggregate")
    tl.add_argument("--tenant", help=f"the target's tenant id (default {DEFAULT_TENANT})")
    tl.add_argument("--after", metavar="CURSOR", help="only timers after this cursor (as a previous list printed)")
    tl.add_argument("--limit", type=positive_int, default=100, help="list at most this many (default 100)")
    tl.add_argument("--json", action="store_true", help="print JSON ({timers, next}; times in epoch ms)")

    ts = tsub.add_parser(
        "show",
        help="one timer and its history (also one that fired or was cancelled): by id, owner and key, or request id",
    )
    ts.add_argument(
        "timer",
        nargs="*",
        metavar="TIMER_ID | AGGREGATE/ID KEY",
        help="a timer id as 'timers list' or a log line shows it, or "
        "the owner aggregate (CONTEXT.AGGREGATE/ID also taken) and the timer's key",
    )
    ts.add_argument(
        "--request-id",
        metavar="ID",
        help="the timer of this request id: a delivery's Command-Request-Id (what the target's log shows), "
        "or the request id of a commit that scheduled or cancelled it",
    )
    ts.add_argument("--tenant", help=f"the owner's tenant id (default {DEFAULT_TENANT})")
    ts.add_argument("--json", action="store_true", help="print JSON instead of lines (times in epoch ms)")

    tsc = tsub.add_parser("schedule", help="append a commit scheduling a timer of an owner (the application API)")
    tsc.add_argument("owner", metavar="AGGREGATE/ID", help="the owner aggregate (CONTEXT.AGGREGATE/ID also taken)")
    tsc.add_argument("key", help="the timer's key (a later schedule of the same key replaces it)")
    tsc.add_argument("--command", required=True, metavar="NAME", help="the command sent to the target when due")
    tsc.add_argument(
        "--body",
        type=_json_object,
        default={},
        help="the command's body: a JSON object, or @FILE to read one from a file (default {})",
    )
    tsc.add_argument("--body-type", help="the command's body type (sent as Command-Type)")
    when = tsc.add_mutually_exclusive_group()
    when.add_argument("--at", type=_instant, help="due at this time: ISO 8601 with a zone, or epoch milliseconds")
    when.add_argument("--in", dest="in_s", type=seconds, metavar="SECONDS", help="due this many seconds from now")
    when.add_argument("--now", action="store_true", help="due now: it fires at once")
    tsc.add_argument(
        "--allow-past", action="store_true", help="accept a due time in the past (the timer fires at once)"
    )
    rule = tsc.add_mutually_exclusive_group()
    rule.add_argument("--every-ms", type=positive_int, help="recurring: every this many milliseconds")
    rule.add_argument(
        "--cron",
        metavar="EXPR",
        help="recurring: a cron expression, five fields as Vixie cron ('*/10 * * * *': every ten minutes) or six "
        "seconds first as Quartz and Spring ('*/10 * * * * *': every ten seconds)",
    )
    tsc.add_argument(
        "--cron-dialect",
        choices=CRON_DIALECTS,
        help="how --cron reads: unix (five fields) or jvm (six, seconds first); default: by its number of fields",
    )
    tsc.add_argument("--zone", default="UTC", help="the time zone of --cron (default UTC)")
    tsc.add_argument(
        "--misfire-grace-ms",
        type=non_negative_int,
        help="skip an occurrence instead of delivering it later than this after its due time "
        "(default: delivered however late)",
    )
    tsc.add_argument("--target", metavar="AGGREGATE/ID", help="where the command goes (default: the owner)")
    tsc.add_argument("--tenant", help=f"the owner's tenant id (default {DEFAULT_TENANT})")
    tsc.add_argument("--target-tenant", help="the target's tenant id (default: the owner's)")
    tsc.add_argument("--in-owner-stream", action="store_true", help=IN_OWNER_STREAM_HELP)

    tc = tsub.add_parser("cancel", help="append a commit cancelling a timer (one that exists, unless --force)")
    tc.add_argument(
        "timer",
        nargs="+",
        metavar="TIMER_ID | AGGREGATE/ID KEY",
        help="a timer id as 'timers list' shows it, or the owner aggregate (CONTEXT.AGGREGATE/ID also taken) and "
        "the timer's key",
    )
    tc.add_argument("--tenant", help=f"the owner's tenant id (default {DEFAULT_TENANT})")
    tc.add_argument("--in-owner-stream", action="store_true", help=IN_OWNER_STREAM_HELP)
    tc.add_argument(
        "--force", action="store_true", help="append the cancel even when the timer view holds no such timer"
    )

    for name, status, text in (("retry", "failed", "FAILED"), ("resume", "parked", "PARKED")):
        tr = tsub.add_parser(name, help=f"{text} timers back to PENDING, due now: by id, owner and key, or in bulk")
        tr.add_argument(
            "timers",
            nargs="*",
            metavar="TIMER_ID | AGGREGATE/ID KEY",
            help="timer ids as 'timers list' shows them, or an owner aggregate followed by a key",
        )
        tr.add_argument(
            "--all",
            f"--all-{status}",
            dest="all",
            action="store_true",
            help=f"every {text} timer (with --target: every one of that target)",
        )
        tr.add_argument("--target", metavar="AGGREGATE/ID", help=f"the {text} timers whose command goes there")
        tr.add_argument("--tenant", help=f"the tenant id of owners and targets named (default {DEFAULT_TENANT})")
        tr.add_argument("--yes", action="store_true", help="do not ask for confirmation at a terminal")
    rb = tsub.add_parser(
        "rebuild",
        help="rebuild the timer view from the log beside the live one and swap it in (replicas may run)",
    )
    rb.add_argument("--context", help="the context whose timer view is rebuilt (default: the configured one)")
    rb.add_argument("--aggregate", help="only the timers owned by this aggregate type (the others are kept)")
    rb.add_argument("--dry-run", action="store_true", help="build and count, change nothing")
    rb.add_argument(
        "--fire-expired",
        action="store_true",
        help="fire one-shot timers due before the tombstone retention that have no tombstone "
        "(default: FAILED as 'expired, state unknown', listed, not fired)",
    )
    p.set_defaults(handler=timers)


# --------------------------------------------------------------------------- commands


def _after(text: str) -> tuple[int, str]:
    try:
        return parse_cursor(text)
    except InvalidInput:
        raise ConfigError(f"--after {text!r}: not a cursor of 'timers list' (DUE_AT:TIMER_ID)") from None


def selected(tokens: list[str], *, context: str, tenant: str | None) -> list[str | tuple[AggregateRef, str]]:
    """Timer ids and ``AGGREGATE/ID KEY`` pairs, in the order given: a token with a ``/`` is an
    owner (timer ids have none) and the token after it its key."""
    found: list[str | tuple[AggregateRef, str]] = []
    rest = list(tokens)
    while rest:
        token = rest.pop(0)
        if "/" not in token:
            found.append(token)
            continue
        if not rest:
            raise ConfigError(f"{token!r}: an owner aggregate is followed by the timer's key")
        found.append((parse_ref(token, context=context, tenant=tenant), rest.pop(0)))
    return found


def _matches(t: Timer, wanted: str | tuple[AggregateRef, str]) -> bool:
    """The timer named by id, or by owner and key (the owner's own stream or wowd's of it)."""
    if isinstance(wanted, str):
        return t.timer_id == wanted
    owner, key = wanted
    return t.key == key and t.owner in (owner, schedule_stream(owner))


def _name(wanted: str | tuple[AggregateRef, str]) -> str:
    return wanted if isinstance(wanted, str) else f"{wanted[1]!r} of {wanted[0]}"


async def timers(settings: WowdSettings, args: argparse.Namespace) -> int:
    if args.timers_command == "rebuild":
        from wowd.cli.timer_rebuild import rebuild

        return await rebuild(settings, args)
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        store = backend.timer_queries
        if args.timers_command == "list":
            return await _list(settings, store, args)
        if args.timers_command in ("schedule", "cancel"):
            return await _write(settings, backend.log, store, args)
        if args.timers_command == "show":
            return await _show(settings, backend, args)
        return await _repair(settings, store, backend.firing, args)


async def _list(settings: WowdSettings, store: TimerQueries, args: argparse.Namespace) -> int:
    target = parse_ref(args.target, context=settings.context, tenant=args.tenant) if args.target else None
    after = _after(args.after) if args.after else None
    stuck = (TimerStatus.PARKED, TimerStatus.FAILED)
    if target is None or args.status in stuck:  # the store's search, over its indexes
        found = await store.search(TimerSearch(status=args.status, target=target, after=after), args.limit + 1)
    else:  # no index lists the PENDING or FIRING timers of a target: filter a full read
        found = [
            t
            for t in await store.scan(status=args.status, limit=SCAN_LIMIT)
            if t.target == target and (after is None or (t.due_at, t.timer_id) > after)
        ][: args.limit + 1]
    shown = found[: args.limit]
    nxt = cursor_of(shown[-1]) if len(found) > args.limit else None
    if args.json:
        print_json({"timers": [timer_doc(t) for t in shown], "next": nxt})
        return 0
    now = int(time.time() * 1000)
    print_table(
        ["timer_id", "status", "partition", "owner", "key", "target", "attempts", "detail"],
        [
            [t.timer_id, t.status.value, t.partition, t.owner, t.key, t.target, deliveries(t), detail(t, now)]
            for t in shown
        ],
        right={2, 6},
    )
    out(f"{len(shown)} timer(s) shown; next: --after {nxt}" if nxt else f"{len(shown)} timer(s)")
    return 0


async def _find(settings: WowdSettings, store: TimerQueries, wanted: str | tuple[AggregateRef, str]) -> Timer | None:
    if isinstance(wanted, tuple):
        return await find_timer(store, *wanted)
    return next((t for t in await store.scan(limit=SCAN_LIMIT) if t.timer_id == wanted), None)


async def _show(settings: WowdSettings, backend: Backend, args: argparse.Namespace) -> int:
    """The timer (live, or as its history tells once it fired, was cancelled or replaced) and its
    history, oldest first; exit 1 when nothing is known of it."""
    picked = selected(args.timer, context=settings.context, tenant=args.tenant)
    if len(picked) + (args.request_id is not None) != 1:
        raise ConfigError("timers show: give one TIMER_ID, an owner AGGREGATE/ID and a KEY, or --request-id")
    if args.request_id is not None:
        view = await timer_history(backend, request_id=args.request_id)
        name = f"with request id {args.request_id}"
    elif isinstance(picked[0], str):
        view = await timer_history(backend, timer_id=picked[0])
        name = picked[0]
    else:
        view = await timer_history(backend, owner=picked[0][0], key=picked[0][1])
        name = _name(picked[0])
    if view is None:
        kept = settings.timers.tombstone_retention_s / 86400
        err(f"wowd: no timer {name}: none is live, and none fired or was cancelled in the last {kept:g} days")
        return 1
    _print_view(view, as_json=args.json)
    return 0


async def _repair(settings: WowdSettings, store: TimerQueries, firing: TimerFiring, args: argparse.Namespace) -> int:
    """``retry`` (FAILED) and ``resume`` (PARKED): back to PENDING, due now; by id, by owner and
    key, or in bulk (``--all``, ``--target``) after a count and a confirmation at a terminal."""
    wanted_status = TimerStatus.FAILED if args.timers_command == "retry" else TimerStatus.PARKED
    picked = selected(args.timers, context=settings.context, tenant=args.tenant)
    target = parse_ref(args.target, context=settings.context, tenant=args.tenant) if args.target else None
    bulk = args.all or target is not None
    if not picked and not bulk:
        raise ConfigError(f"timers {args.timers_command}: give timer ids (or AGGREGATE/ID KEY), --all or --target")
    if picked and bulk:
        raise ConfigError(f"timers {args.timers_command}: give timer ids or --all/--target, not both")
    in_status = await store.scan(status=wanted_status, limit=SCAN_LIMIT)
    if bulk:
        candidates = [t for t in in_status if target is None or t.target == target]
        which = f"{wanted_status.value} timer(s)" + (f" of target {target}" if target is not None else "")
        if candidates and not confirm(f"{args.timers_command} {len(candidates)} {which}?", yes=args.yes):
            err("wowd: nothing was changed")
            return 1
        missing: list[str | tuple[AggregateRef, str]] = []
    else:
        candidates = [t for t in in_status if any(_matches(t, w) for w in picked)]
        missing = [w for w in picked if not any(_matches(t, w) for t in candidates)]
    written = await repair_timers(firing, candidates)
    out(f"{written} timer(s) back to PENDING")
    for w in missing:
        other = await _find(settings, store, w)
        if other is None:
            err(f"wowd: no such timer: {_name(w)}")
        else:
            err(f"wowd: timer {_name(w)} is {other.status.value}, not {wanted_status.value}")
    return 0 if not missing and written == len(candidates) else 1


async def _write(settings: WowdSettings, log: Log, timers_store: TimerQueries, args: argparse.Namespace) -> int:
    client = WowdClient(
        log, max_body_bytes=settings.timers.max_body_bytes, min_interval_ms=settings.timers.min_interval_ms
    )
    if args.timers_command == "cancel":
        return await _cancel(settings, client, timers_store, args)
    owner = parse_ref(args.owner, context=settings.context, tenant=args.tenant)
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
        if args.cron_dialect is not None:
            rule["dialect"] = args.cron_dialect
    elif args.cron_dialect is not None:
        raise ConfigError("--cron-dialect: it says how --cron reads; give --cron")
    now = int(time.time() * 1000)
    due_at = args.at if args.at is not None else None
    if args.in_s is not None:
        due_at = int(now + args.in_s * 1000)
    if args.now:
        due_at = now
    if due_at is None and rule is None:
        raise ConfigError(
            "timers schedule: when is it due? --at TIME, --in SECONDS, or --now (it fires at once); a recurring "
            "timer (--every-ms, --cron) starts at its first occurrence without them"
        )
    if due_at is not None and due_at < now - PAST_TOLERANCE_MS and not args.allow_past:
        flag = "--at" if args.at is not None else "--in"
        raise ConfigError(
            f"{flag}: the due time {iso_ms(due_at)} is in the past (the timer would fire at once); "
            "--allow-past to schedule it anyway"
        )
    command = Command(name=args.command, body=args.body, body_type=args.body_type)
    try:
        commit = await client.schedule(
            owner,
            args.key,
            command=command,
            due_at=due_at,
            rule=rule,
            target=target,
            in_owner_stream=args.in_owner_stream,
            misfire_grace_ms=args.misfire_grace_ms,
        )
    except InvalidInput as exc:
        raise ConfigError(f"{_flag(exc.field)}: {exc.reason} ({exc.field})") from exc
    (event,) = commit.events
    out(
        f"timer {args.key!r} of {owner} scheduled in {commit.ref} at version {commit.version}: {args.command} "
        f"to {target} due {iso_ms(event.body['due_at'])}"
    )
    written = parse_rule(event.body["rule"])
    if not isinstance(written, OnceRule):
        first = int(event.body["due_at"])
        then = [first, *next_occurrences(written, NEXT_SHOWN - 1, after=first)]
        how = f" ({written.dialect}: {written.expression!r})" if isinstance(written, CronRule) else ""
        out(f"next occurrences{how}: " + ", ".join(iso_ms(t) for t in then))
    return 0


async def _cancel(settings: WowdSettings, client: WowdClient, store: TimerQueries, args: argparse.Namespace) -> int:
    """Appends the cancel of one timer, named by its id (to the stream it is in) or by its owner
    and key (wowd's stream of the owner, or with ``--in-owner-stream`` the owner's own)."""
    picked = selected(args.timer, context=settings.context, tenant=args.tenant)
    if len(picked) != 1:
        raise ConfigError("timers cancel: give one TIMER_ID, or an owner AGGREGATE/ID and a KEY")
    wanted = picked[0]
    if isinstance(wanted, str):
        if args.in_owner_stream or args.force:
            raise ConfigError("timers cancel: a timer named by its id is cancelled in its own stream (no --force)")
        t = await _find(settings, store, wanted)
        if t is None:
            err(
                f"wowd: no live timer {wanted} (it fired or was cancelled: wowd timers show {wanted}): nothing appended"
            )
            return 1
        owner, key, own = t.owner, t.key, t.owner.aggregate != SCHEDULES
    else:
        owner, key, own = wanted[0], wanted[1], args.in_owner_stream
        stream = owner if own else schedule_stream(owner)
        if not args.force and await store.find(stream, key) is None:
            err(
                f"wowd: no timer {key!r} of {stream} in the timer view (it fired, was cancelled or never "
                "existed; a schedule appended a moment ago may not be fed yet): nothing appended; --force "
                "appends the cancel anyway"
            )
            return 1
    commit = await client.cancel(owner, key, in_owner_stream=own)
    out(f"cancel of timer {key!r} of {owner} appended to {commit.ref} at version {commit.version}")
    return 0


def _print_view(view: TimerHistoryView, *, as_json: bool) -> None:
    t = view.timer
    doc: dict[str, Any] = (
        timer_doc(t)
        if t is not None
        else {"timer_id": view.timer_id, "status": view.state, "owner": str(view.owner), "key": view.key}
    )
    if as_json:
        print_json({**doc, "history": [history_doc(r) for r in view.records]})
        return
    for k, v in doc.items():
        if k in ("due_at", "scheduled_at") and isinstance(v, int):
            v = at(v)
        elif isinstance(v, dict | list):
            v = json.dumps(v, separators=(",", ":"))
        out(f"{k + ':':<13} {one_line(str(v)) if v is not None else '-'}")
    if t is not None:
        out(f"{'detail:':<13} {one_line(detail(t))}")
    else:
        out(f"{'detail:':<13} {ENDED_DETAIL[view.state]}")
    out(f"history:      {len(view.records)} record(s), oldest first" if view.records else "history:      none kept")
    for r in view.records:
        out(f"  {history_line(r)}")
