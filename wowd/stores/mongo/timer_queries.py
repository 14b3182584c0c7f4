"""The operators' reads of the timers of one context on MongoDB
(:class:`~wowd.stores.base.TimerQueries`). The documents each method sends are built by the pure
functions next to it (the black-pipe tests assert them on the wire)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from wowd.model import (
    AggregateRef,
    Timer,
    TimerStatus,
)
from wowd.stores.base import TimerSearch
from wowd.stores.mongo.schema import (
    DUE_STATUSES,
    TOMBSTONES,
)
from wowd.stores.mongo.timer_docs import TimerDocuments, key_filter, owner_filter, timer_from_doc

log = logging.getLogger(__name__)


def live_filter(owner: AggregateRef, partition: int, key: str) -> dict[str, Any]:
    """The live timer of (owner, key): its key, not a tombstone (``find``)."""
    return {**key_filter(owner, partition, key), "status": {"$nin": list(TOMBSTONES)}}


def parked_match(target: AggregateRef) -> dict[str, Any]:
    """PARKED timers of a target: equality on the parked partial index's keys and its filter."""
    return {
        "target.id": target.id,
        "target.tenant_id": target.tenant_id,
        "target.aggregate": target.aggregate,
        "target.context": target.context,
        "status": TimerStatus.PARKED.value,
    }


def scan_match(status: TimerStatus | None, partitions: Iterable[int] | None) -> dict[str, Any]:
    """Timers of a status (a live one) or, without, every live timer (no tombstone)."""
    match: dict[str, Any] = {}
    if partitions is not None:
        match["partition"] = {"$in": sorted(set(partitions))}
    match["status"] = {"$nin": list(TOMBSTONES)} if status is None else status.value
    return match


MAX_EXPLODED_SCANS = 200
"""The planner's ``internalQueryMaxScansToExplode``: the most point intervals it merges in order."""


def search_match(query: TimerSearch, partitions: int) -> dict[str, Any]:
    """The live timers of a :class:`~wowd.stores.base.TimerSearch` (its cursor included): the
    owners' unique-index keys, the status (PARKED and FAILED ones for a target search; PENDING and
    FIRING ones with every partition as the due index's points), the target (the parked index's
    keys), the due range."""
    clauses: list[dict[str, Any]] = []
    if query.owners:
        clauses.append({"$or": [owner_filter(o, o.partition(partitions)) for o in query.owners]})
    if query.key is not None:
        clauses.append({"key": query.key})
    statuses = [s.value for s in query.statuses()]
    if not query.owners and set(statuses) <= set(DUE_STATUSES) and partitions <= MAX_EXPLODED_SCANS:
        # the due index's partial filter and its first key by points: one scan per partition,
        # merged in due order (as :func:`due_match` explains)
        clauses.append({"partition": {"$in": list(range(partitions))}, "status": {"$in": list(DUE_STATUSES)}})
    clauses.append({"status": statuses[0] if len(statuses) == 1 else {"$in": statuses}})
    if query.target is not None:
        t = query.target
        clauses.append(
            {
                "target.id": t.id,
                "target.tenant_id": t.tenant_id,
                "target.aggregate": t.aggregate,
                "target.context": t.context,
            }
        )
    due: dict[str, int] = {}
    if query.due_from is not None:
        due["$gte"] = query.due_from
    if query.due_until is not None:
        due["$lte"] = query.due_until
    if due:
        clauses.append({"due_at": due})
    if query.after is not None:
        at, tid = query.after
        clauses.append({"$or": [{"due_at": {"$gt": at}}, {"due_at": at, "timer_id": {"$gt": tid}}]})
    return clauses[0] if len(clauses) == 1 else {"$and": clauses}


class MongoTimerQueries(TimerDocuments):
    """:class:`~wowd.stores.base.TimerQueries` on MongoDB (the constructor of
    :class:`~wowd.stores.mongo.timer_docs.TimerDocuments`)."""

    async def find(self, owner: AggregateRef, key: str) -> Timer | None:
        coll = self._collection(owner)
        with self._call("find"):
            doc = await coll.find_one(live_filter(owner, self._partition(owner), key))
        return None if doc is None else timer_from_doc(doc, context=self.context, aggregate=owner.aggregate)

    async def parked(self, target: AggregateRef) -> list[Timer]:
        with self._call("parked"):
            return await self._union("parked", parked_match(target), None)

    async def scan(
        self, *, status: TimerStatus | None = None, limit: int = 100, partitions: set[int] | None = None
    ) -> list[Timer]:
        if limit < 1:
            return []
        with self._call("scan"):
            return await self._union("scan", scan_match(status, partitions), limit)

    async def search(self, query: TimerSearch, limit: int) -> list[Timer]:
        """One union read of :func:`search_match`; an owner's timers are those of its aggregate's
        collection (the documents leave the aggregate to it)."""
        match = search_match(query, self.partitions)
        if limit < 1:
            return []
        with self._call("search"):
            found = await self._union("search", match, limit)
        if query.owners:
            found = [t for t in found if t.owner in query.owners]
        return found
