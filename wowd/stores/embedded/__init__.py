"""The embedded backend: every store on one SQLite file in WAL mode (docs/stores.md).

Several processes may share the file. Importing this package never imports pymongo or
elasticsearch; a store's module is loaded only by who uses it. One module per store protocol of
:mod:`wowd.stores.base` (``log``, ``checkpoints``, ``quarantine``, ``leases``, ``timer_view``,
``timer_firing``, ``timer_queries``, ``snapshots``, ``snapshot_rebuilds``, ``outbox``, ``history``,
``sink``), the file's layout in ``schema``, and the capabilities it offers (``feed``: a feed batch
in one transaction; ``timer_rebuild``, ``backup``), all reached through the operations object
(:class:`~wowd.stores.embedded.operations.EmbeddedOperations`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wowd.stores.embedded.operations import EmbeddedOperations

if TYPE_CHECKING:
    from wowd.config import WowdSettings
    from wowd.stores.base import Backend

__all__ = ["EmbeddedOperations", "open_embedded"]


async def open_embedded(settings: WowdSettings) -> Backend:
    """Every embedded store of ``settings``, prepared (:meth:`EmbeddedOperations.open`)."""
    return await EmbeddedOperations(settings).open()
