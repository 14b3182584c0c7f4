"""``wowd timers rebuild``: the timer view rebuilt from the log and swapped in while replicas run
(:mod:`wowd.daemon.timer_rebuild`), with progress lines and a summary."""

from __future__ import annotations

import argparse

from wowd.backends import opened_backend
from wowd.cli.output import err, out, span
from wowd.config import WowdSettings
from wowd.errors import ConfigError, LeaseLost
from wowd.fmt import iso_ms
from wowd.model import validate_name

__all__ = ["rebuild"]


async def rebuild(settings: WowdSettings, args: argparse.Namespace) -> int:
    """Exit 0 when rebuilt (or counted, ``--dry-run``); 1 when another rebuild runs or took the
    lock meanwhile (the live view is left as it was); 2 for bad arguments."""
    from wowd.daemon.timer_rebuild import TimerRebuilder
    from wowd.stores.timer_rebuild import RebuildRunning, SlotsNotReleased

    if args.context and args.context != settings.context:
        try:
            validate_name(args.context, field="context")
        except ValueError as exc:
            raise ConfigError(f"--context: {exc}") from exc
        settings = settings.model_copy(update={"context": args.context})
    if args.aggregate is not None:
        try:
            validate_name(args.aggregate, field="aggregate")
        except ValueError as exc:
            raise ConfigError(f"--aggregate: {exc}") from exc
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        rebuilder = TimerRebuilder(settings, backend, progress=out)
        try:
            report = await rebuilder.run(aggregate=args.aggregate, dry_run=args.dry_run, fire_expired=args.fire_expired)
        except RebuildRunning as exc:
            err(f"wowd: {exc}")
            return 1
        except (LeaseLost, SlotsNotReleased) as exc:
            err(f"wowd: {exc}: the live view is left as it was")
            return 1
    if report.caught_up:
        out(f"rebuild: {report.caught_up} commit(s) more, applied by the feed meanwhile, read at the swap")
    if not report.old_view:
        out("rebuild: no old view to carry over (its table was gone)")
    else:
        out(
            f"rebuild: {report.carried} row(s) carried over from the old view (the same or a later version of their "
            "key: tombstones, attempts, PARKED and FAILED timers and their reasons)"
        )
    if report.unreadable:
        err(
            f"wowd: the old view's partitions {', '.join(map(str, report.unreadable))} could not be read: "
            "nothing carried over from them"
        )
    if report.fired_in_outbox:
        out(f"rebuild: {report.fired_in_outbox} one-shot timer(s) found fired in the outbox (kept as fired)")
    retention = span(settings.timers.tombstone_retention_s * 1000)
    if report.expired:
        out(
            f"expired, state unknown: {report.expired} one-shot timer(s) due more than {retention} ago (the "
            "tombstone retention) with no tombstone: FAILED, not fired (wowd timers retry fires them)"
        )
        for timer_id, owner, key, due_at in report.expired_listed:
            out(f"  {timer_id}  {owner}  {key}  due {iso_ms(due_at)}")
        if report.expired > len(report.expired_listed):
            out(f"  ... and {report.expired - len(report.expired_listed)} more (wowd timers list --status failed)")
    st = report.statuses
    statuses = ", ".join(f"{st.get(k, 0)} {k}" for k in ("PENDING", "FIRING", "PARKED", "FAILED"))
    tombstones = f"{st.get('DONE', 0)} DONE and {st.get('CANCELLED', 0)} CANCELLED tombstones"
    done = "dry run: nothing changed" if report.dry_run else f"swapped in ({report.pause} {report.finish_s:.1f} s)"
    out(
        f"summary: {report.commits + report.caught_up} commits read; {report.live} timers live ({statuses}; "
        f"{report.expired} expired), {tombstones}; {done}"
    )
    return 0
