"""``wowd quarantine list|show|retry``: the commits the feed set aside, and feeding them again.

The feed quarantines a document it cannot read (the reason names the field), a commit with a
timer event it rejects (``rejected timer event: ...``) and a commit a step refuses (``<step>
refused it: <error class>: <message>``). ``retry`` reads the document again and re-runs the
steps its reason says it still needs, each idempotent (what was done before counts as done):

- ``sink``: the commit written to its type's event sink;
- ``timers``: its timer events projected into the timer store (the net effect of the commit, as
  the feed writes it; a later version already stored wins);
- ``snapshots``: where a reducer is configured for its type and the stored snapshot is behind
  the commit, the snapshot marked stale (a rebuild folds it again);
- ``parked``: the parked timers whose target is its aggregate resumed (it committed).

A document that still does not read, or a step that still refuses, keeps the item quarantined
under its id with the new reason (exit 1); otherwise the item is released (deleted).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wowd.backends import opened_backend
from wowd.cli.args import positive_int
from wowd.cli.output import err, out, print_table
from wowd.config import WowdSettings
from wowd.errors import ConfigError, InvalidInput, StorageUnavailable, WowdError
from wowd.fmt import iso_ms
from wowd.model import (
    AggregateType,
    Commit,
    TimerCancelled,
    TimerChange,
    TimerScheduled,
    TimerWrite,
    commit_from_doc,
    net_writes,
    partition,
    timer_event_from,
)
from wowd.stores.base import Backend

__all__ = ["STEPS", "RetryOutcome", "quarantine", "read_commit", "register", "retry_item", "steps_needed"]

STEPS = ("sink", "timers", "snapshots", "parked")
"""The feed's steps a quarantined commit may still need, in the order the feed runs them."""

PAGE = 100
"""Items read per page by ``retry --all``."""

_REFUSED = re.compile(r"^(\w+) refused it: ")
_REJECTED_TIMER_EVENT = "rejected timer event: "


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("quarantine", parents=[common], help="list, show and feed again the commits the feed set aside")
    qsub = p.add_subparsers(dest="quarantine_command", required=True, metavar="COMMAND")
    ql = qsub.add_parser("list", help="quarantined items, oldest first")
    ql.add_argument("--after", metavar="ID", help="only items after this id (as a previous list printed)")
    ql.add_argument("--limit", type=positive_int, default=100, help="list at most this many (default 100)")
    ql.add_argument("--json", action="store_true", help="print JSON ({items, next}) instead of a table")
    qs = qsub.add_parser("show", help="one item: its reason and its document")
    qs.add_argument("id", metavar="ID", help="an id as 'quarantine list' shows it")
    qr = qsub.add_parser(
        "retry", help="re-run the steps each item still needs; release what is fed, keep what still fails"
    )
    qr.add_argument("ids", nargs="*", metavar="ID", help="ids as 'quarantine list' shows them")
    qr.add_argument("--all", action="store_true", help="every quarantined item")
    p.set_defaults(handler=quarantine)


async def quarantine(settings: WowdSettings, args: argparse.Namespace) -> int:
    if args.quarantine_command == "retry" and bool(args.ids) == bool(args.all):
        err("wowd quarantine retry: give ids or --all (not both)")
        return 2
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        if args.quarantine_command == "list":
            items = await backend.log.quarantined(limit=args.limit, after=args.after)
            _print_list(items, args.limit, as_json=args.json)
            return 0
        if args.quarantine_command == "show":
            found = await backend.log.quarantined(limit=1, ids=[args.id])
            if not found:
                err(f"wowd: no quarantined item {args.id}")
                return 1
            _print_json(found[0])
            return 0
        return await _retry(settings, backend, args)


def _record(item: Mapping[str, Any]) -> str:
    raw = item.get("raw")
    if not isinstance(raw, Mapping):
        return "-"
    agg_id, version = raw.get("aggregate_id"), raw.get("version")
    return f"{agg_id} v{version}" if agg_id is not None else "-"


def _print_json(doc: Any) -> None:
    out(json.dumps(doc, indent=2, default=str))


def _print_list(items: list[dict[str, Any]], limit: int, *, as_json: bool) -> None:
    after = items[-1]["id"] if len(items) == limit else None
    if as_json:
        _print_json({"items": items, "next": after})
        return
    print_table(
        ["id", "created", "partition", "aggregate", "record", "reason"],
        [[i["id"], iso_ms(i["created_at"]), i["partition"], i["aggregate"], _record(i), i["reason"]] for i in items],
        right={2},
    )
    out(f"{len(items)} items" + (f"; next: --after {after}" if after else ""))


# --------------------------------------------------------------------------- retry


def steps_needed(reason: str) -> tuple[str, ...]:
    """The steps a quarantined commit still needs, from its reason: a step that refused it and
    the ones after it; the timer projection for a rejected timer event; every step otherwise (a
    document that did not read, a quarantine or checkpoint step that refused it)."""
    m = _REFUSED.match(reason)
    if m is not None and m.group(1) in STEPS:
        return STEPS[STEPS.index(m.group(1)) :]
    if reason.startswith(_REJECTED_TIMER_EVENT):
        return ("timers",)
    return STEPS


def read_commit(item: Mapping[str, Any], context: str, partitions: int) -> Commit:
    """The quarantined document read as a commit, as the log reads it; :class:`InvalidInput`
    naming the field when it still does not read."""
    raw = item.get("raw")
    if not isinstance(raw, Mapping):
        raise InvalidInput("a commit must be a document", field="commit")
    try:
        type_ = AggregateType(context=context, aggregate=str(item.get("aggregate")))
    except ConfigError as exc:
        raise InvalidInput(str(exc), field="aggregate") from exc
    commit = commit_from_doc(type_, raw)
    expected = partition(commit.ref.id, partitions)
    stored = raw.get("partition", expected)
    if stored != expected:
        raise InvalidInput(
            f"is {stored}, but the aggregate id belongs to partition {expected} of {partitions}", field="partition"
        )
    return commit


@dataclass(slots=True)
class RetryOutcome:
    """What a retry did to one item: ``done`` the steps run, ``reason`` why it stays (``None``:
    fed and released)."""

    item_id: str
    record: str
    done: list[str] = field(default_factory=list)
    reason: str | None = None


async def retry_item(settings: WowdSettings, backend: Backend, item: Mapping[str, Any]) -> RetryOutcome:
    """Re-runs the steps ``item`` still needs; releases it when they all pass, else quarantines it
    again (same id) with the new reason. A transient failure (:class:`StorageUnavailable`) is
    raised and leaves the item as it was."""
    outcome = RetryOutcome(item_id=str(item["id"]), record=_record(item))
    try:
        commit = read_commit(item, settings.context, settings.partitions)
    except (InvalidInput, ConfigError) as exc:
        outcome.reason = str(exc)
    else:
        outcome.record = f"{commit.ref} v{commit.version}"
        outcome.reason = await _feed(settings, backend, commit, steps_needed(str(item.get("reason", ""))), outcome)
    if outcome.reason is None:
        await backend.log.release_quarantined([outcome.item_id])
    else:
        type_ = AggregateType(context=settings.context, aggregate=str(item["aggregate"]))
        await backend.log.quarantine(str(item["consumer"]), int(item["partition"]), type_, item["raw"], outcome.reason)
    return outcome


async def _feed(
    settings: WowdSettings, backend: Backend, commit: Commit, steps: tuple[str, ...], outcome: RetryOutcome
) -> str | None:
    """Runs ``steps`` for ``commit`` in order; the reason it stays quarantined (``None``: fed)."""
    rejected: InvalidInput | None = None
    for step in steps:
        try:
            if step == "sink":
                if not backend.has_sink:  # no event index kept: nothing to write
                    outcome.done.append(step)
                    continue
                sink = backend.sink(commit.ref.type)
                await sink.prepare()
                await sink.write([commit])
            elif step == "timers":
                writes, rejected = _timer_writes(settings, commit)
                if writes:
                    await backend.timers.write(net_writes(writes))
            elif step == "snapshots":
                if commit.ref.aggregate in settings.reducers:
                    current = await backend.snapshots.load(commit.ref)
                    if current is not None and current.version < commit.version:
                        await backend.snapshots.mark_stale(commit.ref)
            elif step == "parked":
                parked = await backend.timers.parked(commit.ref)
                if parked:
                    now = int(time.time() * 1000)
                    await backend.timers.settle([TimerChange.resume(t, due_at=now) for t in parked])
        except StorageUnavailable:
            raise
        except WowdError as exc:
            return f"{step} refused it: {type(exc).__name__}: {exc}"
        outcome.done.append(step)
    return f"{_REJECTED_TIMER_EVENT}{rejected}" if rejected is not None else None


def _timer_writes(settings: WowdSettings, commit: Commit) -> tuple[list[TimerWrite], InvalidInput | None]:
    """The timer writes of ``commit`` as the feed makes them, and the first event it rejects."""
    from wowd.model import timer_from_event

    writes: list[TimerWrite] = []
    rejected: InvalidInput | None = None
    for ev in commit.events:
        try:
            te = timer_event_from(ev, max_body_bytes=settings.timers.max_body_bytes)
        except InvalidInput as exc:
            rejected = rejected or exc
            continue
        if isinstance(te, TimerScheduled):
            writes.append(TimerWrite.put(timer_from_event(commit, te, settings.partitions)))
        elif isinstance(te, TimerCancelled):
            writes.append(TimerWrite.cancel(commit.ref, te.key, commit.version))
    if commit.deleted:
        writes.append(TimerWrite.cancel_all(commit.ref, commit.version))
    return writes, rejected


async def _retry(settings: WowdSettings, backend: Backend, args: argparse.Namespace) -> int:
    log = backend.log
    failures = 0
    fed = 0
    if args.all:
        after: str | None = None
        while True:
            page = await log.quarantined(limit=PAGE, after=after)
            for item in page:
                ok = _report(await retry_item(settings, backend, item))
                fed, failures = fed + ok, failures + (not ok)
            if len(page) < PAGE:
                break
            after = page[-1]["id"]
    else:
        wanted = list(dict.fromkeys(args.ids))
        found = {i["id"]: i for i in await log.quarantined(limit=len(wanted), ids=wanted)}
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
