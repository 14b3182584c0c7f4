"""The outbox on MongoDB: where the ``outbox`` gateway delivers fired commands.

Collection ``wow_outbox__<context>``, unique on ``request_id`` (a re-fire carries the same
request id, so a second put is refused and answers False). Entries are listed in ``_id`` order
(an ObjectId: roughly insertion order); ``entries(limit, after)`` pages by offset in that order.

``take`` pages by no cursor: an ``_id`` is made by each writer's client (one-second resolution,
its own counter), so an entry committed after a consumer passed its ``_id`` would never be read
after such a cursor. A take reads the oldest entries not acknowledged and not leased (``lease_until``,
a date on the server's clock, absent or passed), leases them to itself (``lease_until`` =
``$$NOW`` + the lease, ``lease`` = a random id, re-checked per document in the update so two
takes never both win one) and reads back what its lease id holds.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import timedelta

from pymongo import AsyncMongoClient, InsertOne, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from wowd.errors import InvalidInput, StorageError
from wowd.model import AggregateRef, OutboxBatch, OutboxEntry
from wowd.stores.base import OUTBOX_TAKE_LEASE, Ddl
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    CollectionStore,
    Doc,
    duplicate_keys,
    outbox_collection,
    write_one,
)
from wowd.stores.mongo.schema import outbox_indexes

__all__ = [
    "FREE",
    "MongoOutbox",
    "ack_filter",
    "lease_update",
    "outbox_doc",
    "outbox_entry",
    "outbox_indexes",
    "trim_filter",
]


logger = logging.getLogger(__name__)


FREE: Doc = {"$expr": {"$lte": ["$lease_until", "$$NOW"]}}
"""An entry no live take holds: ``lease_until`` absent (missing sorts below every date in the
aggregation comparison) or passed on the server's clock."""


def lease_update(lease_id: str, lease_ms: int) -> list[Doc]:
    """The pipeline update that leases an entry to one take until the server's now + the lease."""
    return [{"$set": {"lease_until": {"$add": ["$$NOW", lease_ms]}, "lease": lease_id}}]


def ack_filter(request_ids: Sequence[str]) -> Doc:
    return {"request_id": {"$in": list(request_ids)}}


def trim_filter(before: int) -> Doc:
    return {"created_at": {"$lt": before}}


def outbox_doc(entry: OutboxEntry) -> Doc:
    t = entry.target
    return {
        "request_id": entry.request_id,
        "timer_id": entry.timer_id,
        "target": {"context": t.context, "aggregate": t.aggregate, "tenant_id": t.tenant_id, "id": t.id},
        "command": entry.command,
        "scheduled_at": entry.scheduled_at,
        "fence": entry.fence,
        "owner_key": entry.owner_key,
        "created_at": entry.created_at,
    }


def outbox_entry(doc: Doc) -> OutboxEntry:
    t = doc.get("target") or {}
    try:
        return OutboxEntry(
            request_id=doc["request_id"],
            timer_id=doc["timer_id"],
            target=AggregateRef(context=t["context"], aggregate=t["aggregate"], tenant_id=t["tenant_id"], id=t["id"]),
            command=doc["command"],
            scheduled_at=int(doc["scheduled_at"]),
            fence=int(doc.get("fence", 0)),
            owner_key=str(doc.get("owner_key", "")),
            created_at=int(doc.get("created_at", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StorageError(f"mongodb outbox: unreadable entry {doc.get('_id')!r}: {exc!r}") from exc


class MongoOutbox(CollectionStore):
    """:class:`~wowd.stores.base.Outbox` on MongoDB (the
    :class:`~wowd.stores.mongo._common.CollectionStore` constructor)."""

    _label = "outbox"

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Doc] | str,
        database_name: str,
        *,
        context: str,
        ddl: Ddl = Ddl.AUTO,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
    ) -> None:
        super().__init__(client_or_uri, database_name, context=context, ddl=ddl, operation_timeout=operation_timeout)
        self._prepared = self._ddl is Ddl.NONE

    def collection_of(self, context: str) -> str:
        return outbox_collection(context)

    def indexes(self) -> list[Doc]:
        return outbox_indexes()

    async def prepare(self) -> None:
        """Creates (AUTO) or checks (VALIDATE) the unique request-id index and the ``created_at``
        one; idempotent."""
        await super().prepare()
        self._prepared = True

    async def put(self, entry: OutboxEntry) -> bool:
        if not self._prepared:
            await self.prepare()
        with self._call("put"):
            try:
                await write_one(self._coll, InsertOne(outbox_doc(entry)), "outbox.put")
            except DuplicateKeyError:
                return False
        return True

    async def put_many(self, entries: Sequence[OutboxEntry]) -> list[bool]:
        """One unordered ``insert_many``; per entry, False when its request id was there (before,
        or earlier in the batch: the first of the batch is kept)."""
        if not entries:
            return []
        if not self._prepared:
            await self.prepare()
        written = [True] * len(entries)
        with self._call("put_many"):
            try:
                await self._coll.insert_many([outbox_doc(e) for e in entries], ordered=False)
            except BulkWriteError as exc:
                # a write concern error: written, not as durably as asked; a retry answers them
                # False (repeats)
                for e in duplicate_keys(exc, "outbox put_many"):
                    written[e["index"]] = False
        return written

    async def entries(self, limit: int = 1000, after: int = 0) -> list[OutboxEntry]:
        """Up to ``limit`` entries in insertion order, skipping the first ``after``."""
        if limit <= 0:
            return []
        with self._call("entries"):
            docs = await self._coll.find({}, sort=[("_id", 1)], skip=max(0, after), limit=limit).to_list()
        return [outbox_entry(d) for d in docs]

    async def count(self) -> int:
        """``estimatedDocumentCount``: the collection's document count from its metadata, read in
        constant time however deep the outbox (a ``countDocuments`` would read every entry or
        index key). Acknowledging and trimming delete entries, so every document is one not
        acknowledged yet and the collection's count is the depth. The metadata count can be off
        after an unclean shutdown of a ``mongod`` (until the collection is validated) and, on a
        sharded collection, counts orphaned documents during a chunk migration."""
        with self._call("count"):
            return await self._coll.estimated_document_count()

    async def take(self, limit: int = 100, *, lease: timedelta = OUTBOX_TAKE_LEASE) -> OutboxBatch:
        """Three commands: a ``find`` of the ``_id`` of the oldest ``limit`` free entries
        (:data:`FREE`), an ``update`` of those ids still free that leases them to this take
        (:func:`lease_update`, one statement per id: a retryable write, so a reply lost in a
        failover is retried by the driver and answered by the server's record, instead of
        leaving the entries leased to nobody for the lease's length), a ``find`` of what the lease
        id holds, in ``_id`` order. The first ``find`` walks the ``_id`` index and passes over
        the entries leased before the first free one: those other takes hold (in flight)."""
        lease_ms = int(lease.total_seconds() * 1000)
        if lease_ms <= 0:
            raise InvalidInput(f"the lease of a take must be at least 1 ms, got {lease}", field="lease")
        if limit <= 0:
            return OutboxBatch(entries=(), cursor=None)
        lease_id = uuid.uuid4().hex
        with self._call("take"):
            free = await self._coll.find(FREE, {"_id": 1}, sort=[("_id", 1)], limit=limit).to_list()
            if not free:
                return OutboxBatch(entries=(), cursor=None)
            ids = [d["_id"] for d in free]
            update = lease_update(lease_id, lease_ms)
            await self._coll.bulk_write([UpdateOne({"_id": i, **FREE}, update) for i in ids], ordered=False)
            docs = await self._coll.find({"_id": {"$in": ids}, "lease": lease_id}, sort=[("_id", 1)]).to_list()
        if not docs:
            return OutboxBatch(entries=(), cursor=None)
        return OutboxBatch(entries=tuple(outbox_entry(d) for d in docs), cursor=lease_id)

    async def ack(self, request_ids: Sequence[str]) -> int:
        """One ``deleteMany`` of the request ids."""
        if not request_ids:
            return 0
        with self._call("ack"):
            result = await self._coll.delete_many(ack_filter(request_ids))
        return int(result.deleted_count)

    async def trim(self, before: int) -> int:
        """One ``deleteMany`` of the entries created before ``before`` (over the ``created_at`` index)."""
        with self._call("trim"):
            result = await self._coll.delete_many(trim_filter(before))
        return int(result.deleted_count)
