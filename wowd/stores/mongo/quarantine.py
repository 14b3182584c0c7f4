"""The MongoDB log's quarantine (:class:`~wowd.stores.base.Quarantine`): ``wow_quarantine__<context>``,
the documents the feed cannot read or apply, each with its reason, in the order its ``seq`` names
(docs/stores.md).

``_id`` from the consumer, the type and the document (idempotent), ``seq`` (an ObjectId, unique)
names an item: its hex is the item's id. ``seq`` is the number after the highest drawn (the last
item's, or the counter document's, ``_id: "seq"``), claimed by the insert through the unique
index, so items become visible in ``seq`` order: a listing paged by ``seq`` never passes an item
committed later.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
from bson.objectid import ObjectId
from pymongo import AsyncMongoClient, InsertOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError

from wowd.errors import (
    InvalidInput,
    StorageError,
    StorageUnavailable,
)
from wowd.model import (
    AggregateType,
)
from wowd.stores.base import Ddl, dismissal
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    CollectionStore,
    Doc,
    collection_name,
    quarantine_collection,
    write_one,
)
from wowd.stores.mongo.schema import quarantine_indexes

__all__ = ["QUARANTINE_DRAWS", "MongoQuarantine"]

logger = logging.getLogger(__name__)

QUARANTINE_DRAWS = 100
"""How many ``seq`` numbers one quarantine draws (each taken by another's item) before it gives up."""


class MongoQuarantine(CollectionStore):
    """The quarantine of one context's log (the :class:`~wowd.stores.mongo._common.CollectionStore`
    constructor: its indexes :func:`~wowd.stores.mongo.schema.quarantine_indexes` as ``ddl``
    says)."""

    _label = "log"  # the log's: one dashboard for its calls

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
        self._quarantine: AsyncCollection[Doc] = self._coll

    def collection_of(self, context: str) -> str:
        return quarantine_collection(context)

    def indexes(self) -> list[Doc]:
        return quarantine_indexes()

    async def put(
        self, consumer: str, partition: int, aggregate: AggregateType, raw: Mapping[str, Any], reason: str
    ) -> None:
        """No transaction, nothing held between commands: ``seq`` is the number after the
        highest drawn (:meth:`_last_drawn`), claimed by the insert through the unique
        ``seq_unique`` index; E11000 on ``seq`` (another quarantine inserted it first): drawn
        again. A number is drawn only past an item already visible, so items become visible in
        ``seq`` order (a listing paged by ``seq`` passes no item committed after it). Then the
        counter's ``n`` is raised to it (``$max``) for replicas of earlier versions, which draw
        with ``$inc`` in a transaction; a failure of that write is logged (the item is stored).
        E11000 on ``_id`` (quarantined before): the stored item's reason is set instead."""
        doc = quarantine_doc(consumer, partition, aggregate, raw, reason, datetime.now(UTC))
        with self._call("quarantine"):
            for _ in range(QUARANTINE_DRAWS):
                n = await self._last_drawn() + 1
                try:
                    await write_one(self._quarantine, InsertOne({**doc, "seq": counted_seq(n)}), "log.quarantine")
                    break
                except DuplicateKeyError as exc:
                    if (exc.details or {}).get("keyPattern") == {"seq": -1}:
                        continue
                    if await self._quarantine.find_one({"_id": doc["_id"]}, {"_id": 1}) is None:
                        continue  # released meanwhile: drawn again
                    await self._quarantine.update_one({"_id": doc["_id"]}, {"$set": {"reason": reason}})
                    return
            else:
                raise StorageUnavailable(
                    f"mongodb log.quarantine: {QUARANTINE_DRAWS} numbers drawn in a row were taken by other quarantines"
                )
        try:
            with self._call("quarantine_counter"):
                await self._raise_counter(n)
        except StorageError as exc:
            logger.warning("log %s: quarantine counter not raised to %d (the item is stored): %s", self.context, n, exc)
        logger.warning(
            "log %s: quarantined a document of %s (partition %d, consumer %s): %s",
            self.context,
            aggregate,
            partition,
            consumer,
            reason,
        )

    async def _last_drawn(self) -> int:
        """The highest ``seq`` number drawn (:func:`last_drawn`): reads by ``_id``, down ``seq``."""
        counter = await self._quarantine.find_one({"_id": QUARANTINE_SEQ_ID}, {"n": 1})
        return last_drawn(counter, await self._quarantine.find_one(COUNTED_FILTER, {"seq": 1}, sort=[("seq", -1)]))

    async def _raise_counter(self, n: int) -> None:
        """The counter document's ``n`` raised to ``n`` at least (``$max``, upserted)."""
        await self._quarantine.update_one({"_id": QUARANTINE_SEQ_ID}, {"$max": {"n": n}}, upsert=True)

    async def items(
        self,
        limit: int = 1000,
        after: str | None = None,
        *,
        ids: Collection[str] | None = None,
        dismissed: bool = False,
    ) -> list[dict[str, Any]]:
        """One ``find`` in ``seq`` order (the ``seq`` index)."""
        out: list[dict[str, Any]] = []
        if limit <= 0:
            return out
        if after is not None and not ObjectId.is_valid(after):
            raise InvalidInput(f"is not a quarantine id of the MongoDB log: {after!r}", field="after")
        wanted = _object_ids(ids) if ids is not None else None
        if wanted == []:
            return out
        filter_ = quarantined_filter(ObjectId(after) if after is not None else None, wanted)
        if wanted is None:
            filter_["dismissed"] = {"$exists": dismissed}
        with self._call("quarantined"):
            async for d in self._quarantine.find(filter_, sort=[("seq", 1)], limit=limit):
                out.append(quarantine_item(d))
        return out

    async def dismiss(self, ids: Collection[str], reason: str, by: str) -> int:
        """One ``update`` of the items among ``ids`` (by ``seq``) without ``dismissed``: ``$set``
        ``dismissed: {at, reason, by}`` (``at`` this client's time, as ``quarantined_at``)."""
        why, who = dismissal(reason, by)
        wanted = _object_ids(ids)
        if not wanted:
            return 0
        filter_ = {**quarantined_filter(None, wanted), "dismissed": {"$exists": False}}
        mark = {"$set": {"dismissed": {"at": datetime.now(UTC), "reason": why, "by": who}}}
        with self._call("dismiss_quarantined"):
            result = await self._quarantine.update_many(filter_, mark)
        return int(result.modified_count)

    async def release(self, ids: Collection[str]) -> int:
        """The items found among ``ids`` (one ``find``), the counter raised to their highest
        ``seq`` number (``$max``: a number is never drawn again, so an id never names another
        item), then one ``delete`` of them by ``seq``."""
        wanted = _object_ids(ids)
        if not wanted:
            return 0
        with self._call("release_quarantined"):
            found = [d["seq"] async for d in self._quarantine.find(quarantined_filter(None, wanted), {"seq": 1})]
            if not found:
                return 0
            top = max(seq_number(s) for s in found)
            if top:
                await self._raise_counter(top)
            result = await self._quarantine.delete_many(quarantined_filter(None, found))
        return int(result.deleted_count)


QUARANTINE_RAW_BYTES = 15 * 1024 * 1024
"""The most BSON bytes of a document a quarantine item keeps whole: the item, with its reason and
the rest, stays within the server's 16 MiB (``maxBsonObjectSize``)."""


RAW_IDENTITY = ("_id", "tenant_id", "aggregate_id", "version", "request_id", "command_id", "create_time", "partition")
"""What an item keeps of a document too large to keep whole: the fields that name the commit."""


def quarantine_doc(
    consumer: str, partition_: int, aggregate: AggregateType, raw: Mapping[str, Any], reason: str, now: datetime
) -> Doc:
    """The quarantine document: ``_id`` from the consumer, the type and the raw document's id
    (a digest of the document when it has none), so quarantining twice is idempotent. A raw
    document of more than :data:`QUARANTINE_RAW_BYTES` (a commit near the 16 MiB limit) is kept
    by its identity (:data:`RAW_IDENTITY`, each value under 1 KiB) and its size, the reason
    saying so: the item is kept, the document stays in its log collection."""
    key: Any = raw.get("_id") if "_id" in raw else _digest(raw)
    kept = dict(raw)
    size = len(bson.encode(kept))
    if size > QUARANTINE_RAW_BYTES:
        kept = {k: raw[k] for k in RAW_IDENTITY if k in raw and len(bson.encode({"v": raw[k]})) <= 1024}
        kept["raw_bytes"] = size
        reason = (
            f"{reason} (the document, {size} bytes, is too large to keep whole here: only the fields that name it "
            f"are; it stays in {collection_name('log', aggregate.context, aggregate.aggregate)})"
        )
    return {
        "_id": {"consumer": consumer, "aggregate": aggregate.aggregate, "key": key},
        "consumer": consumer,
        "partition": partition_,
        "aggregate": aggregate.aggregate,
        "raw": kept,
        "reason": reason,
        "quarantined_at": now,
    }


QUARANTINE_SEQ_ID = "seq"
"""The ``_id`` of the quarantine's counter document (``{_id: "seq", n}``), which has no ``seq``."""


SEQ_PREFIX = b"\xff\xff\xff\xff"
"""The first 4 bytes of a counted ``seq``: above every ObjectId's timestamp until 2106, so items
counted sort after the items of earlier versions (client-made ObjectIds)."""


NO_SEQ = ObjectId(b"\x00" * 12)


def counted_seq(n: int) -> ObjectId:
    """The ``seq`` of the ``n``-th quarantined item: :data:`SEQ_PREFIX` then ``n`` (8 bytes)."""
    return ObjectId(SEQ_PREFIX + n.to_bytes(8, "big"))


def seq_number(seq: Any) -> int:
    """The ``n`` of a counted ``seq`` (:func:`counted_seq`); 0 for anything else (an item of an
    earlier version, whose client-made ObjectId sorts below every counted one)."""
    if isinstance(seq, ObjectId) and seq.binary.startswith(SEQ_PREFIX):
        return int.from_bytes(seq.binary[len(SEQ_PREFIX) :], "big")
    return 0


def last_drawn(counter: Mapping[str, Any] | None, last: Mapping[str, Any] | None) -> int:
    """The highest ``seq`` number drawn: the counter document's ``n`` (a release raises it past
    the items it deletes) or the last counted item's, whichever is higher."""
    n = counter.get("n") if counter is not None else 0
    return max(n if isinstance(n, int) else 0, seq_number(last.get("seq")) if last is not None else 0)


COUNTED_FILTER: Doc = {"seq": {"$gte": counted_seq(0)}}
"""The counted items (sorted by ``seq`` descending, the first is the last drawn)."""


def quarantined_filter(after: ObjectId | None, ids: Sequence[ObjectId] | None) -> Doc:
    """The items after ``after`` and/or among ``ids``, by their ``seq`` (the order of a listing);
    every item at least (an ObjectId ``seq``: the counter document has none)."""
    seq: Doc = {"$gt": after if after is not None else NO_SEQ} if ids is None or after is not None else {}
    if ids is not None:
        seq["$in"] = list(ids)
    return {"seq": seq}


def _ms(at: Any) -> int:
    """A stored date (naive: UTC) in ms since the epoch; 0 for anything else."""
    if isinstance(at, datetime):
        return int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp() * 1000)
    return 0


def quarantine_item(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A quarantine document as :meth:`~wowd.stores.base.Quarantine.items` answers it."""
    item = {"id": str(doc.get("seq")), "created_at": _ms(doc.get("quarantined_at"))}
    item.update({k: doc.get(k) for k in ("consumer", "partition", "aggregate", "raw", "reason")})
    mark = doc.get("dismissed")
    item["dismissed"] = (
        {"at": _ms(mark.get("at")), "reason": mark.get("reason"), "by": mark.get("by")}
        if isinstance(mark, Mapping)
        else None
    )
    return item


def _object_ids(ids: Iterable[str]) -> list[ObjectId]:
    """The ObjectIds among ``ids`` (a string that is not one names nothing)."""
    return sorted({ObjectId(i) for i in ids if ObjectId.is_valid(i)})


def _digest(raw: Mapping[str, Any]) -> str:
    text = json.dumps(raw, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
