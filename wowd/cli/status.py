"""``wowd status``: the slot table of the lease namespace as the lease store holds it."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from wowd.cli.backend import opened_backend
from wowd.cli.output import out, print_json, print_table
from wowd.config import WowdSettings
from wowd.fmt import compact_partitions, iso_ms
from wowd.model import SlotState

__all__ = ["STANDBYS_NOTE", "live_partitions", "register", "status", "status_doc"]

STANDBYS_NOTE = (
    "standbys (replicas waiting for a free slot) hold no lease and are not recorded in the stores: "
    "see each replica's wowd_leases_held (0 on a standby)"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "status", parents=[common], help="the slot table: holders, fences, and partitions without a live holder"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(handler=status)


def live_partitions(settings: WowdSettings, states: Iterable[SlotState]) -> set[int]:
    """The partitions whose slot has a live holder now (by the store's clock)."""
    out_: set[int] = set()
    lo, hi = settings.lease.slot_offset, settings.lease.slot_offset + settings.lease.limit
    for st in states:
        if st.live and lo <= st.slot < hi:
            out_.update(settings.partitions_of_slot(st.slot))
    return out_


def status_doc(settings: WowdSettings, states: list[SlotState]) -> dict[str, Any]:
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
    return {
        "namespace": settings.lease_namespace,
        "limit": settings.lease.limit,
        "store_now": states[0].store_now if states else None,
        "slots": rows,
        "holders": sorted({r["holder"] for r in rows if r["live"]}),
        "standbys": None,
        "standbys_note": STANDBYS_NOTE,
        "partitions_without_live_holder": sorted(set(range(settings.partitions)) - live),
    }


async def status(settings: WowdSettings, args: argparse.Namespace) -> int:
    async with opened_backend(settings) as backend:
        states = await backend.leases.slots(settings.lease_namespace)
    doc = status_doc(settings, states)
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
    holders = doc["holders"]
    out(f"replicas holding a slot: {len(holders)}" + (f" ({', '.join(holders)})" if holders else ""))
    out(STANDBYS_NOTE)
    unowned = doc["partitions_without_live_holder"]
    out(f"partitions without a live holder: {compact_partitions(unowned) if unowned else 'none'}")
    return 0
