"""The checkpoints of the log's consumers on MongoDB (:class:`~wowd.stores.base.Checkpoints`):
``wow_checkpoint__<context>``, ``{_id: {consumer, partition}, position, fence, written_at}``, a
save admitted only under the same or a higher fence (the filter's guard: a higher fence stored
makes the upsert meet the ``_id``, E11000)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

from pymongo import AsyncMongoClient, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError

from wowd.model import (
    Checkpoint,
    Position,
)
from wowd.stores.base import consumers_of
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    Doc,
    MongoStore,
    checkpoint_collection,
    duplicate_keys,
    mongo_name,
    write_one,
)
from wowd.stores.mongo.log_read import cluster_time_of


def checkpoint_id(consumer: str, partition_: int) -> Doc:
    return {"consumer": consumer, "partition": partition_}


def checkpoint_filter(consumer: str, partition_: int, fence: int) -> Doc:
    """Matches the stored checkpoint only at the same or a lower fence (the fence guard)."""
    return {"_id": checkpoint_id(consumer, partition_), "fence": {"$lte": fence}}


def checkpoint_update(position: Position, fence: int) -> list[Doc]:
    """A pipeline update (the store clock stamps ``written_at``); the position as a literal."""
    return [
        {
            "$set": {
                "position": {"$literal": position},
                "fence": fence,
                "written_at": {"$toLong": "$$NOW"},
            }
        }
    ]


def checkpoint_ids_filter(consumer: str, partitions: Sequence[int]) -> Doc:
    return {"_id": {"$in": [checkpoint_id(consumer, p) for p in partitions]}}


def _bson_position(position: Position) -> Position:
    """A position as stored: a cluster time as ``[time, inc]`` (JSON- and BSON-friendly)."""
    out = dict(position)
    ct = cluster_time_of(out.get("cluster_time"))
    if ct is not None:
        out["cluster_time"] = list(ct)
    return out


class MongoCheckpoints(MongoStore):
    """:class:`~wowd.stores.base.Checkpoints` of one context's log on MongoDB (the
    :class:`~wowd.stores.mongo._common.MongoStore` constructor and the context)."""

    _label = "log"  # the log's: one dashboard for its calls

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Doc] | str,
        database_name: str,
        *,
        context: str,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
    ) -> None:
        self.context = mongo_name(context, field="context")
        super().__init__(client_or_uri, database_name, operation_timeout=operation_timeout)
        self._checkpoints: AsyncCollection[Doc] = self._db[checkpoint_collection(context)]

    async def prepare(self) -> None:
        """Nothing to create: the checkpoints are read and written by ``_id``."""

    async def read(self, consumer: str, partitions: Sequence[int]) -> dict[int, Checkpoint]:
        if not partitions:
            return {}
        out: dict[int, Checkpoint] = {}
        with self._call("checkpoints"):
            async for d in self._checkpoints.find(checkpoint_ids_filter(consumer, partitions)):
                p = d["_id"]["partition"]
                out[p] = Checkpoint(
                    consumer=consumer,
                    partition=p,
                    position=dict(d.get("position") or {}),
                    fence=int(d.get("fence", 0)),
                    written_at=int(d.get("written_at", 0)),
                )
        return out

    async def save_all(self, consumer: str | Sequence[str], positions: Mapping[int, Position], fence: int) -> bool:
        """One unordered bulk of the upserts :meth:`save` sends; an E11000 item (a
        higher fence holds that partition) makes the answer False."""
        ops = [
            UpdateOne(checkpoint_filter(c, p, fence), checkpoint_update(_bson_position(pos), fence), upsert=True)
            for c in consumers_of(consumer)
            for p, pos in sorted(positions.items())
        ]
        if not ops:  # no position or no consumer: nothing to write (a bulk of nothing is refused)
            return True
        with self._call("save_checkpoint"):
            try:
                await self._checkpoints.bulk_write(ops, ordered=False)
            except BulkWriteError as exc:
                duplicate_keys(exc, "log save_checkpoints")  # a higher fence holds one
                return False
        return True

    async def save(self, consumer: str, partition: int, position: Position, fence: int) -> bool:
        """One upsert filtered on the fence guard; E11000 (a higher fence holds it) is False, but
        E11000 with a write concern error :class:`StorageUnavailable` (:func:`write_one`)."""
        with self._call("save_checkpoint"):
            try:
                await write_one(
                    self._checkpoints,
                    UpdateOne(
                        checkpoint_filter(consumer, partition, fence),
                        checkpoint_update(_bson_position(position), fence),
                        upsert=True,
                    ),
                    "log.save_checkpoint",
                )
            except DuplicateKeyError:
                return False
        return True
