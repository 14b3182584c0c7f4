"""The MongoDB backend: log, leases, timers, snapshots and outbox on MongoDB, the event sink on
Elasticsearch (docs/stores.md).

One module per store protocol of :mod:`wowd.stores.base` (``log`` with its read in ``log_read``,
``checkpoints``, ``quarantine``, ``leases``, ``timer_view``, ``timer_firing``, ``timer_queries``
over ``timer_docs``, ``snapshots``, ``snapshot_rebuilds``, ``outbox``, ``history``), the layout of
the collections in ``schema``, the store base and names in ``_common``, and what the backend
offers besides (``timer_rebuild``, the checks of ``privileges`` and ``election``), all reached
through the operations object (:class:`~wowd.stores.mongo.operations.MongoOperations`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wowd.stores.mongo.operations import (
    DEFAULT_APP_NAME,
    LEASES_APP_SUFFIX,
    MongoOperations,
    app_name,
    check_replica_set,
    mongo_client_options,
)

if TYPE_CHECKING:
    from wowd.config import WowdSettings
    from wowd.stores.base import Backend

__all__ = [
    "DEFAULT_APP_NAME",
    "LEASES_APP_SUFFIX",
    "MongoOperations",
    "app_name",
    "check_replica_set",
    "mongo_client_options",
    "open_mongo",
]


async def open_mongo(settings: WowdSettings) -> Backend:
    """Every MongoDB store of ``settings`` and the Elasticsearch sink, prepared
    (:meth:`MongoOperations.open`)."""
    return await MongoOperations(settings).open()
