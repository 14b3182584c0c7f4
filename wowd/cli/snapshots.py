"""``wowd snapshots status|rebuild``: the snapshot tables of the configured reducers."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import anyio

from wowd.backends import opened_backend
from wowd.cli.output import err, out, print_json, print_table
from wowd.cli.status import live_partitions
from wowd.config import WowdSettings
from wowd.daemon.rebuild import Rebuilder, RebuildReport, RebuildStatus
from wowd.errors import LeaseLost
from wowd.fmt import compact_partitions
from wowd.model import Owner, SlotState, SnapshotTable
from wowd.stores.base import Backend

__all__ = ["register", "report_doc", "snapshots", "status_doc"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("snapshots", parents=[common], help="snapshot tables and rebuilds of the configured reducers")
    ssub = p.add_subparsers(dest="snapshots_command", required=True, metavar="COMMAND")
    ss = ssub.add_parser("status", help="per reducer type: the claimed revision, flags and pending snapshots")
    ss.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sr = ssub.add_parser("rebuild", help="claim the reducers' revisions and rebuild snapshots from the log")
    sr.add_argument("--aggregate", action="append", help="only this aggregate type (repeatable)")
    sr.add_argument(
        "--partitions", nargs="+", metavar="P", help="only these partitions, space or comma separated (default: all)"
    )
    sr.add_argument("--force", action="store_true", help="also partitions a live replica owns, and backfilled types")
    sr.add_argument("--json", action="store_true", help="print JSON instead of a summary line per type")
    p.set_defaults(handler=snapshots)


def _table_doc(t: SnapshotTable | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"revision": t.revision, "rebuilding": t.rebuilding, "backfilled": t.backfilled, "updated_at": t.updated_at}


def status_doc(s: RebuildStatus) -> dict[str, Any]:
    return {
        "aggregate": s.type.aggregate,
        "reducer_revision": s.reducer_revision,
        "table": _table_doc(s.table),
        "target_revision": s.target,
        "pending": s.pending,
        "partitions_done": s.partitions_done,
        "partitions": s.partitions,
    }


def report_doc(r: RebuildReport) -> dict[str, Any]:
    return {
        "aggregate": r.type.aggregate,
        "revision": r.revision,
        "outcome": r.outcome,
        "partitions": sorted(r.partitions),
        "aggregates": r.aggregates,
        "rewritten": r.rewritten,
        "unchanged": r.unchanged,
        "skipped": r.skipped,
        "failed": r.failed,
        "backfilled": r.backfilled,
        "table": _table_doc(r.table),
        "error": r.error,
    }


async def snapshots(settings: WowdSettings, args: argparse.Namespace) -> int:
    from wowd.reducers import load_reducer

    reducers = {agg: load_reducer(path) for agg, path in settings.reducers.items()}
    if not reducers:
        err("wowd: no reducers configured (WOWD_REDUCERS): no snapshots are kept")
        return 2
    unknown = sorted(set(getattr(args, "aggregate", None) or ()) - set(reducers))
    if unknown:
        err(f"wowd: no reducer configured for {', '.join(unknown)} (reducers: {', '.join(sorted(reducers))})")
        return 2
    given: list[str] = getattr(args, "partitions", None) or []
    try:
        parts = sorted({int(x) for arg in given for x in arg.split(",") if x.strip()})
    except ValueError:
        err(f"wowd: --partitions: integers expected, got {' '.join(given)}")
        return 2
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        rebuilder = Rebuilder(settings, backend, reducers)
        if args.snapshots_command == "status":
            return _print_status([status_doc(s) for s in await rebuilder.status()], json=args.json)
        wanted = parts if given else list(range(settings.partitions))
        states = await backend.leases.slots(settings.lease_namespace)
        busy = sorted(set(wanted) & live_partitions(settings, states))
        if busy and not args.force:
            err(
                f"wowd: partitions {compact_partitions(busy)} have a live holder, which rebuilds them itself "
                "(--partitions to choose others, --force to rebuild them anyway)"
            )
            return 1
        reports = await _rebuild_holding_leases(settings, backend, rebuilder, wanted, states, args)
    docs = [report_doc(r) for r in reports]
    if args.json:
        print_json(docs)
    else:
        for d in docs:
            out(
                f"{d['aggregate']} revision {d['revision']}: {d['outcome']}, "
                f"partitions {compact_partitions(d['partitions'])}, "
                f"{d['aggregates']} aggregate(s), {d['rewritten']} rewritten, {d['unchanged']} unchanged, "
                f"{d['skipped']} skipped, {d['failed']} failed"
                + (", backfilled" if d["backfilled"] else "")
                + (f": {d['error']}" if d["error"] else "")
            )
    return 1 if any(d["outcome"] in ("superseded", "failed") or d["failed"] for d in docs) else 0


async def _rebuild_holding_leases(
    settings: WowdSettings,
    backend: Backend,
    rebuilder: Rebuilder,
    wanted: list[int],
    states: list[SlotState],
    args: argparse.Namespace,
) -> list[RebuildReport]:
    """Rebuilds ``wanted`` slot by slot. A slot without a live holder is taken for the duration
    (its lease renewed meanwhile, released at the end), so that the rebuild writes under the
    slot's fence as a replica would; a slot with a live holder (``--force``) is rebuilt under
    no fence, and its holder's progress checkpoints win."""
    live = {st.slot for st in states if st.live}
    lo, limit = settings.lease.slot_offset, settings.lease.limit
    reports: list[RebuildReport] = []
    for slot in range(lo, lo + limit):
        parts = sorted(set(wanted) & set(settings.partitions_of_slot(slot)))
        if not parts:
            continue
        if slot in live:
            reports += await rebuilder.rebuild(parts, aggregates=args.aggregate, force=args.force)
            continue
        async with _holding(settings, backend, slot) as (fence, check):
            reports += await rebuilder.rebuild(
                parts, aggregates=args.aggregate, force=args.force, fence=fence, check=check
            )
    return reports


@asynccontextmanager
async def _holding(
    settings: WowdSettings, backend: Backend, slot: int
) -> AsyncIterator[tuple[int, Callable[[], None]]]:
    """Holds the lease of ``slot`` (its fence, and a check that raises :class:`LeaseLost` once a
    renewal failed) until the block ends; a slot taken meanwhile by a replica is an error."""
    store, ns = backend.leases, settings.lease_namespace
    ttl, tolerance = timedelta(seconds=settings.lease.ttl_s), timedelta(seconds=settings.lease.tolerance_s)
    owner = Owner(key=f"{settings.owner_key}:snapshots-rebuild:{slot}")
    got = await store.acquire(
        ns, owner, settings.lease.limit, ttl, tolerance, slot_offset=settings.lease.slot_offset, preferred_slot=slot
    )
    lease = got.lease
    if lease is None or lease.slot != slot:
        if lease is not None:
            await store.release(lease, last_issued=lease.written_at)
        raise LeaseLost(f"slot {slot}: its lease was taken by a replica meanwhile; run the rebuild again")
    lost: list[str] = []

    def check() -> None:
        if lost:
            raise LeaseLost(f"slot {slot}: {lost[0]}")

    async def renew() -> None:
        nonlocal lease
        while True:
            await anyio.sleep(settings.lease.ttl_s / 3)
            assert lease is not None
            renewed = await store.renew(lease, ttl, tolerance)
            if renewed is None:
                lost.append("the lease could not be renewed (a replica took the slot)")
                return
            lease = renewed

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(renew)
            yield lease.fence, check
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await store.release(lease, last_issued=lease.written_at)


def _print_status(docs: list[dict[str, Any]], *, json: bool) -> int:
    if json:
        print_json(docs)
        return 0
    rows = []
    for d in docs:
        t = d["table"]
        flags = ",".join(k for k in ("rebuilding", "backfilled") if t and t[k]) or "-"
        rows.append(
            [
                d["aggregate"],
                d["reducer_revision"],
                t["revision"] if t else "-",
                flags,
                d["pending"],
                f"{d['partitions_done']}/{d['partitions']}",
            ]
        )
    print_table(["aggregate", "reducer", "table", "flags", "pending", "rebuilt"], rows, right={1, 2, 4})
    return 0
