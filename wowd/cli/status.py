"""``wowd status``: the replicas of the lease namespace (holders and standbys, from their presence
records) and its slot table, as the lease store holds them."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from wowd.backends import opened_backend
from wowd.cli.output import out, print_json, print_table, span
from wowd.config import WowdSettings
from wowd.fmt import compact_partitions, iso_ms
from wowd.model import SlotState
from wowd.stores.base import ReplicaState
from wowd.views import views_status

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


def live_partitions(settings: WowdSettings, states: Iterable[SlotState]) -> set[int]:
    """The partitions whose slot has a live holder now (by the store's clock)."""
    out_: set[int] = set()
    lo, hi = settings.lease.slot_offset, settings.lease.slot_offset + settings.lease.limit
    for st in states:
        if st.live and lo <= st.slot < hi:
            out_.update(settings.partitions_of_slot(st.slot))
    return out_


def replica_rows(replicas: Iterable[ReplicaState]) -> list[dict[str, Any]]:
    """One row per presence record: ``state`` is ``holding``, ``standby``, or ``gone`` (expired
    without leaving: killed, hung or cut off from the store); times on the store clock."""
    return [
        {
            "owner_key": r.owner_key,
            "state": r.state if r.live else "gone",
            "slots": list(r.slots),
            "host": r.host,
            "pid": r.pid,
            "version": r.version,
            "instance": r.instance,
            "started_at": r.started_at,
            "seen_at": r.seen_at,
            "expires_at": r.expires_at,
            "seen_ms_ago": r.store_now - r.seen_at,
            "up_ms": (r.store_now if r.live else r.seen_at) - r.started_at,
        }
        for r in replicas
    ]


def status_doc(settings: WowdSettings, states: list[SlotState], replicas: list[ReplicaState]) -> dict[str, Any]:
    lo, hi = settings.lease.slot_offset, settings.lease.slot_offset + settings.lease.limit
    by_slot = {s.slot: s for s in states}
    rows: list[dict[str, Any]] = []
    for slot in range(lo, hi):
        st = by_slot.get(slot)
        rows.append(
            {
                "slot": slot,
                "holder": st.owner_key if st is not None else None,
                "last_holder": st.last_owner_key if st is not None else None,
                "fence": st.fence if st is not None else 0,
                "incarnation": st.incarnation if st is not None else 0,
                "expires_at": st.expires_at if st is not None else None,
                "expires_in_ms": (st.expires_at - st.store_now) if st is not None else None,
                "live": st is not None and st.live,
                "partitions": len(settings.partitions_of_slot(slot)),
            }
        )
    live = live_partitions(settings, states)
    present = replica_rows(replicas)
    store_now = states[0].store_now if states else (replicas[0].store_now if replicas else None)
    return {
        "namespace": settings.lease_namespace,
        "limit": settings.lease.limit,
        "store_now": store_now,
        "replicas": present,
        "slots": rows,
        "holders": sorted({r["holder"] for r in rows if r["live"]}),
        "standbys": [r["owner_key"] for r in present if r["state"] == "standby"],
        "partitions_without_live_holder": sorted(set(range(settings.partitions)) - live),
    }


async def status(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings, create=getattr(args, "create", False)) as backend:
        states = await backend.leases.slots(settings.lease_namespace)
        replicas = await backend.leases.replicas(settings.lease_namespace)
        views = await views_status(settings, backend.log, settings.reducers)
    doc = status_doc(settings, states, replicas)
    doc["views"] = views
    if args.json:
        print_json(doc)
        return 0
    now = doc["store_now"]
    out(f"namespace {doc['namespace']} (limit {doc['limit']})" + (f", store now {iso_ms(now)}" if now else ""))
    print_table(
        ["slot", "fence", "live", "expires (store time)", "partitions", "holder"],
        [
            [
                r["slot"],
                r["fence"],
                "yes" if r["live"] else "no",
                iso_ms(r["expires_at"]) if r["expires_at"] else "-",
                r["partitions"],
                r["holder"] if r["live"] else f"- (last: {r['last_holder'] or r['holder'] or '-'})",
            ]
            for r in doc["slots"]
        ],
        right={0, 1, 4},
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
    for v in views:
        behind = v["partitions_behind"]
        state = f"behind the timer view in partitions {compact_partitions(behind)}" if behind else "current"
        out(f"view {v['view']}: {state}")
    return 0
