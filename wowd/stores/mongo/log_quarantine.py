"""The MongoDB log's quarantine: ``wow_quarantine__<context>``, the documents the feed cannot read
or apply, each with its reason, in the order its ``seq`` names (docs/stores.md). The base of
:class:`~wowd.stores.mongo.log.MongoLog`.

``_id`` from the consumer, the type and the document (idempotent), ``seq`` (an ObjectId, unique)
names an item: its hex is the item's id. ``seq`` is the number after the highest drawn (the last
item's, or the counter document's, ``_id: "seq"``), claimed by the insert through the unique
index, so items become visible in ``seq`` order: a listing paged by ``seq`` never passes an item
committed later.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

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
from wowd.stores.mongo._common import (
    MongoStore,
    mongo_name,
    quarantine_collection,
    write_one,
)
from wowd.stores.mongo.log_queries import (
    COUNTED_FILTER,
    QUARANTINE_SEQ_ID,
    Doc,
    _object_ids,
    counted_seq,
    last_drawn,
    logger,
    quarantine_doc,
    quarantine_item,
    quarantined_filter,
    seq_number,
)

__all__ = ["QUARANTINE_DRAWS", "LogQuarantine"]

QUARANTINE_DRAWS = 100
"""How many ``seq`` numbers one quarantine draws (each taken by another's item) before it gives up."""


class LogQuarantine(MongoStore):
    """The quarantine of one context's log (the :class:`~wowd.stores.mongo._common.MongoStore`
    constructor and the context)."""

    def __init__(
        self, client_or_uri: AsyncMongoClient[Doc] | str, database_name: str, *, context: str,
        operation_timeout: timedelta | None,
    ) -> None:  # fmt: skip
        self.context = mongo_name(context, field="context")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self._quarantine: AsyncCollection[Doc] = self._db[quarantine_collection(context)]

    async def quarantine(
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

    async def quarantined(
        self, limit: int = 1000, after: str | None = None, *, ids: Collection[str] | None = None
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
        with self._call("quarantined"):
            async for d in self._quarantine.find(filter_, sort=[("seq", 1)], limit=limit):
                out.append(quarantine_item(d))
        return out

    async def release_quarantined(self, ids: Collection[str]) -> int:
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
