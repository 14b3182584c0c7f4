"""The timers' history on MongoDB (:class:`~wowd.stores.base.TimerHistory`).

Collection ``wow_timer_history__<context>``, one document per record
(:class:`~wowd.model.HistoryRecord`)::

    {_id: "<timer_id>:<slot>", timer_id, slot, kind, aggregate, tenant_id, owner_id, key, at,
     version, request_id, expires_at?, scheduled_at?, position?, outcome?, status?, latency_ms?,
     reason?, answer?}

``_id`` names the record (a rewrite replaces it: idempotent), and a timer's records are one
range of the ``_id`` index (its id and a ``:``), so reading them by timer id needs no index of
its own. Times are int64 milliseconds since the epoch, but ``expires_at``, a Date, which the TTL
index expires. Its indexes, each for one read or for the expiry:

- ``key`` ``{owner_id, aggregate, tenant_id, key, at}``, partial over the schedule and cancel
  records (``slot < 0``: an attempt, written with each settle group, is in no index by key):
  :meth:`MongoTimerHistory.of_key` finds a key's timers by it (equality on the owner and on two
  keys, the timer's and ``""``, sorted by ``at``: two index ranges merged in order, "Use Indexes
  to Sort Query Results", https://www.mongodb.com/docs/manual/tutorial/sort-results-with-indexes/;
  a query uses a partial index when its filter implies the index's, "Partial Indexes",
  https://www.mongodb.com/docs/manual/core/index-partial/), and the update that ends a recurring
  timer's schedule (:func:`end_operation`) reads the schedules by it;
- ``request_id`` ``{request_id, at}``: :meth:`MongoTimerHistory.of_request` (what a target's log
  shows), sorted by ``at`` from the index;
- ``expires_ttl`` ``{expires_at}`` with ``expireAfterSeconds: 0``: each document is deleted by
  the server once its ``expires_at`` passed ("Expire Documents at a Specific Clock Time",
  https://www.mongodb.com/docs/manual/tutorial/expire-data/); a document without it (the schedule
  of a recurring timer that lives) is never expired: "If the indexed field in a document is not a
  date or an array that holds one or more date values, the document will not expire"
  (https://www.mongodb.com/docs/manual/core/index-ttl/).

A write is one unordered ``bulkWrite``: a ``replaceOne`` upsert per record and an ``updateMany``
per schedule or cancel record that ends the open schedules of its key. The collection is not
sharded (its writes and reads are by timer, key or request id, none of them by partition).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo import ReplaceOne, UpdateMany
from pymongo.errors import BulkWriteError

from wowd.errors import InvalidInput, StorageError
from wowd.model import AggregateRef, HistoryKind, HistoryRecord, validate_name
from wowd.model.history import CANCELLED, SCHEDULED, check_context
from wowd.stores.base import HISTORY_READ_LIMIT
from wowd.stores.mongo._common import CollectionStore, Doc, durable_or_raise
from wowd.stores.mongo.schema import history_indexes

__all__ = [
    "MongoTimerHistory",
    "end_operation",
    "history_collection",
    "key_filter",
    "timers_filter",
    "history_doc",
    "history_indexes",
    "record_from_doc",
    "write_operations",
]


logger = logging.getLogger(__name__)

_OPTIONAL = ("scheduled_at", "position", "outcome", "status", "latency_ms", "reason", "answer")
_KINDS = {k.value: k for k in HistoryKind}


def history_collection(context: str) -> str:
    return f"wow_timer_history__{validate_name(context, field='context')}"


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _date(ms: int) -> datetime:
    """``ms`` as the Date BSON stores (exact: a float of seconds loses the last millisecond of
    dates far ahead, up to the schema's year 9999)."""
    return _EPOCH + ms * _MS


def _ms(date: datetime) -> int:
    """A Date read back (naive: UTC, as PyMongo decodes it by default) in milliseconds."""
    return (date.replace(tzinfo=date.tzinfo or UTC) - _EPOCH) // _MS


def history_doc(r: HistoryRecord) -> Doc:
    o = r.owner
    doc: Doc = {
        "_id": f"{r.timer_id}:{r.slot}",
        "timer_id": r.timer_id,
        "slot": r.slot,
        "kind": r.kind.value,
        "aggregate": o.aggregate,
        "tenant_id": o.tenant_id,
        "owner_id": o.id,
        "key": r.key,
        "at": r.at,
        "version": r.version,
        "request_id": r.request_id,
    }
    if r.expires_at is not None:
        doc["expires_at"] = _date(r.expires_at)
    for name in _OPTIONAL:
        value = getattr(r, name)
        if value is not None:
            doc[name] = value
    return doc


def key_filter(owner: AggregateRef, key: str) -> Doc:
    """The schedule and cancel records of ``key`` of ``owner`` and its deletes (key ``""``): the
    partial ``key`` index's filter repeated (``slot < 0``), so that the server may read it."""
    return {
        "owner_id": owner.id,
        "aggregate": owner.aggregate,
        "tenant_id": owner.tenant_id,
        "key": {"$in": [key, ""]},
        "slot": {"$lt": 0},
    }


def timers_filter(timer_ids: Sequence[str]) -> Doc:
    """Every record of ``timer_ids``: a range of the ``_id`` index each."""
    return {"$or": [{"_id": {"$gte": f"{t}:", "$lt": f"{t};"}, "timer_id": t} for t in timer_ids]}


def end_operation(r: HistoryRecord) -> UpdateMany | None:
    """The update a schedule or cancel record makes: the open schedules (no ``expires_at``) of its
    key (every key of its owner, for key ``""``) at lower versions expire with it."""
    if r.slot not in (SCHEDULED, CANCELLED) or r.expires_at is None:
        return None
    o = r.owner
    flt: Doc = {"owner_id": o.id, "aggregate": o.aggregate, "tenant_id": o.tenant_id}
    if r.key:
        flt["key"] = r.key
    flt.update({"slot": SCHEDULED, "version": {"$lt": r.version}, "expires_at": {"$exists": False}})
    return UpdateMany(flt, {"$set": {"expires_at": _date(r.expires_at)}})


def write_operations(records: Sequence[HistoryRecord]) -> list[ReplaceOne[Doc] | UpdateMany]:
    """The bulk write of :meth:`MongoTimerHistory.append`."""
    ops: list[ReplaceOne[Doc] | UpdateMany] = []
    for r in records:
        doc = history_doc(r)
        ops.append(ReplaceOne({"_id": doc["_id"]}, doc, upsert=True))
        end = end_operation(r)
        if end is not None:
            ops.append(end)
    return ops


def record_from_doc(context: str, doc: Mapping[str, Any]) -> HistoryRecord:
    try:
        expires = doc.get("expires_at")
        return HistoryRecord(
            timer_id=str(doc["timer_id"]),
            slot=int(doc["slot"]),
            kind=_KINDS[doc["kind"]],
            owner=AggregateRef(
                context=context, aggregate=doc["aggregate"], tenant_id=doc["tenant_id"], id=doc["owner_id"]
            ),
            key=str(doc["key"]),
            at=int(doc["at"]),
            version=int(doc["version"]),
            request_id=str(doc["request_id"]),
            expires_at=_ms(expires) if expires else None,
            **{name: doc[name] for name in _OPTIONAL if doc.get(name) is not None},
        )
    except (KeyError, TypeError, ValueError, InvalidInput) as exc:
        raise StorageError(f"mongodb timer history: unreadable record {doc.get('_id')!r}: {exc!r}") from exc


class MongoTimerHistory(CollectionStore):
    """:class:`~wowd.stores.base.TimerHistory` of one context on MongoDB (the
    :class:`~wowd.stores.mongo._common.CollectionStore` constructor: client or URI, database,
    context, ``ddl``, ``operation_timeout``)."""

    _label = "history"

    def collection_of(self, context: str) -> str:
        return history_collection(context)

    def indexes(self) -> list[Doc]:
        return history_indexes()

    async def append(self, records: Sequence[HistoryRecord]) -> None:
        """One unordered ``bulkWrite`` (:func:`write_operations`)."""
        if not records:
            return
        check_context(records, self.context)
        with self._call("append"):
            try:
                await self._coll.bulk_write(write_operations(records), ordered=False)
            except BulkWriteError as exc:
                durable_or_raise(exc, "timer history append")
                raise  # a record the server refused (translated as the other errors are)

    async def _find(self, operation: str, flt: Doc, sort: list[tuple[str, int]], limit: int) -> list[HistoryRecord]:
        with self._call(operation):
            docs = await self._coll.find(flt, sort=sort, limit=max(1, limit)).to_list()
        return [record_from_doc(self.context, d) for d in reversed(docs)]

    async def of_timer(self, timer_id: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        """A range of the ``_id`` index (the timer's few records, sorted by ``at`` in memory)."""
        return await self._find("of_timer", timers_filter([timer_id])["$or"][0], [("at", -1), ("version", -1)], limit)

    async def of_key(self, owner: AggregateRef, key: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        """Two ``find``s: the schedule and cancel records of the key (and the owner's deletes) over
        the partial ``key`` index (:func:`key_filter`), which name its timers; then every record
        of those timers, over the ``_id`` index (:func:`timers_filter`)."""
        if owner.context != self.context:
            return []
        with self._call("of_key"):
            named = await self._coll.find(
                key_filter(owner, key), {"_id": 0, "timer_id": 1}, sort=[("at", -1)], limit=limit
            ).to_list()
            ids = list(dict.fromkeys(str(d["timer_id"]) for d in named))
        if not ids:
            return []
        return await self._find("of_key", timers_filter(ids), [("at", -1), ("version", -1)], limit)

    async def of_request(self, request_id: str, limit: int = HISTORY_READ_LIMIT) -> list[HistoryRecord]:
        return await self._find("of_request", {"request_id": request_id}, [("at", -1)], limit)

    async def sweep(self, before: int, limit: int) -> int:
        """Records expire by the TTL index: nothing to sweep."""
        return 0
