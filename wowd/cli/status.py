"""``wowd status``: the replicas of the lease namespace (holders and standbys, from their presence
records) and its slot table, as the lease store holds them, with each slot's due backlog, the
views behind the timer view, the quarantine's count and the outbox's depth
(:func:`wowd.operator.read_status`, which the status page's ``/api/v1/status`` answers too)."""

from __future__ import annotations

import argparse

from wowd.backends import opened_backend
from wowd.cli.output import at, out, print_json, print_table, span
from wowd.config import WowdSettings
from wowd.fmt import compact_partitions, iso_ms
from wowd.operator import live_partitions, read_status, replica_rows, status_doc

__all__ = ["live_partitions", "register", "replica_rows", "status", "status_doc"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "status",
        parents=[common],
        help="the replicas (holders and standbys) and the slot table: holders, fences, and partitions without a "
        "live holder",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.set_defaults(handler=status)


async def status(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        doc = await read_status(settings, backend)
    if args.json:
        print_json(doc)
        return 0
    now = doc["store_now"]
    out(f"namespace {doc['namespace']} (limit {doc['limit']})" + (f", store now {iso_ms(now)}" if now else ""))
    print_table(
        ["slot", "fence", "live", "expires (store time)", "partitions", "due now", "holder"],
        [
            [
                r["slot"],
                r["fence"],
                "yes" if r["live"] else "no",
                iso_ms(r["expires_at"]) if r["expires_at"] else "-",
                r["partitions"],
                _capped(r["due_backlog"], doc["backlog_cap"]),
                (r["holder"] if r["live"] else f"- (last: {r['last_holder'] or r['holder'] or '-'})")
                + (f" [held by {r['held_by']}]" if r.get("held_by") else ""),
            ]
            for r in doc["slots"]
        ],
        right={0, 1, 4, 5},
    )
    holders, standbys = doc["holders"], doc["standbys"]
    out(f"replicas holding a slot: {len(holders)}" + (f" ({', '.join(holders)})" if holders else ""))
    if doc["replicas"]:
        print_table(
            ["replica", "state", "slots", "last seen", "up", "version", "host/pid"],
            [
                [
                    r["owner_key"],
                    r["state"],
                    ",".join(map(str, r["slots"])) or "-",
                    span(r["seen_ms_ago"]) + " ago",
                    span(r["up_ms"]),
                    r["version"],
                    f"{r['host']}/{r['pid']}",
                ]
                for r in doc["replicas"]
            ],
        )
    else:
        out("replicas: no presence record (no replica is running)")
    out(f"standbys: {len(standbys)}" + (f" ({', '.join(standbys)})" if standbys else ""))
    gone = [r["owner_key"] for r in doc["replicas"] if r["state"] == "gone"]
    if gone:
        out(f"gone without leaving (recently): {len(gone)} ({', '.join(gone)})")
    unowned = doc["partitions_without_live_holder"]
    out(f"partitions without a live holder: {compact_partitions(unowned) if unowned else 'none'}")
    for v in doc["views"]:
        behind = v["partitions_behind"]
        state = f"behind the timer view in partitions {compact_partitions(behind)}" if behind else "current"
        out(f"view {v['view']}: {state}")
    out(f"quarantined commits: {_capped(doc['quarantined'], doc['quarantine_cap'])}")
    box, oldest = doc["outbox"], doc["outbox"]["oldest"]
    out(f"outbox: {box['depth']} entries" + (f", oldest created {at(oldest['created_at'])}" if oldest else ""))
    return 0


def _capped(n: int, cap: int) -> str:
    return f"{n}+" if n >= cap else str(n)
