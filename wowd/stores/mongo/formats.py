"""The formats recorded in the MongoDB database, read without changing anything (``wowd check``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pymongo.asynchronous.database import AsyncDatabase

from wowd.stores.formats import StoreFormat
from wowd.stores.mongo._common import FORMAT, SNAPSHOT_TABLES, TIMER_FORMAT, TIMER_REGISTRY, TIMER_UPGRADES_FROM

__all__ = ["mongo_formats", "mongo_rebuild_state"]


async def mongo_formats(db: AsyncDatabase[Any], context: str) -> list[StoreFormat]:
    """The format of each timer collection of ``context`` (from ``wow_timer_aggregate``; one
    line with ``found`` None when none is registered yet) and of each snapshot collection (from
    ``wow_snapshot_tables``). Two ``find`` commands; reads only."""
    found: list[StoreFormat] = []
    projection = {"_id": 1, "format": 1}
    timers = await db[TIMER_REGISTRY].find({"context": context}, projection).to_list(None)
    for doc in sorted(timers, key=lambda d: str(d["_id"])):
        fmt = doc.get("format")
        found.append(
            StoreFormat(
                f"mongodb timers: {doc['_id']}", fmt if isinstance(fmt, int) else -1, TIMER_FORMAT, TIMER_UPGRADES_FROM
            )
        )
    if not timers:
        found.append(StoreFormat(f"mongodb timers: wow_timer__{context}__*", None, TIMER_FORMAT, TIMER_UPGRADES_FROM))
    snapshots = await db[SNAPSHOT_TABLES].find({"context": context}, projection).to_list(None)
    for doc in sorted(snapshots, key=lambda d: str(d["_id"])):
        fmt = doc.get("format")
        if fmt is None:
            continue  # a control-plane record of a rebuild without its format record yet
        found.append(StoreFormat(f"mongodb {doc['_id']}", fmt if isinstance(fmt, int) else -1, FORMAT))
    return found


async def mongo_rebuild_state(db: AsyncDatabase[Any], context: str) -> str | None:
    """A rebuild of the context's timer view that runs or was interrupted (``wowd timers
    rebuild``): its lock and its shadow collections, in one line (a lock of a process of this
    host that is gone is an interrupted rebuild's); ``None`` when there are neither. An
    ``aggregate`` and a ``find``; reads only."""
    from wowd.fmt import iso_ms
    from wowd.stores.mongo.timer_rebuild import LOCK_COLLECTION, SHADOW_REGISTRY
    from wowd.stores.timer_rebuild import lock_gone

    cursor = await db[LOCK_COLLECTION].aggregate([{"$match": {"_id": context}}, {"$set": {"storeNow": "$$NOW"}}])
    locks = await cursor.to_list(None)
    lock = locks[0] if locks else None
    shadows = await db[SHADOW_REGISTRY].find({"context": context}, {"_id": 1}).to_list(None)
    if lock is None and not shadows:
        return None
    live = lock is not None and lock.get("expiresAt") is not None and lock["expiresAt"] > lock["storeNow"]
    if lock is not None and live and not lock_gone(str(lock.get("owner"))):
        started, until = (_ms(lock[f]) for f in ("startedAt", "expiresAt"))
        return f"runs: lock held by {lock.get('owner')} since {iso_ms(started)}, until {iso_ms(until)} unless renewed"
    left = ", ".join(sorted(str(d["_id"]) for d in shadows)) or "its lock"
    return (
        f"an interrupted rebuild left {left}: the live view is as it was; wowd timers rebuild runs it again "
        "(and drops what it left)"
    )


def _ms(value: datetime) -> int:
    """A BSON date as decoded (naive, UTC) in milliseconds since the epoch."""
    return int(value.replace(tzinfo=UTC).timestamp() * 1000)
