"""The formats recorded in the MongoDB database, read without changing anything (``wowd check``)."""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.database import AsyncDatabase

from wowd.stores.formats import StoreFormat
from wowd.stores.mongo._common import FORMAT, SNAPSHOT_TABLES, TIMER_FORMAT, TIMER_REGISTRY, TIMER_UPGRADES_FROM

__all__ = ["mongo_formats"]


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
