"""The composition root's stores: open the configured backend, and close it whatever happens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from wowd.config import WowdSettings
from wowd.stores.base import Backend

__all__ = ["CLOSE_TIMEOUT_S", "open_backend", "opened_backend"]

CLOSE_TIMEOUT_S = 10.0


async def open_backend(settings: WowdSettings) -> Backend:
    """Opens and prepares every store of the configured backend; imports its drivers only now
    (the embedded backend never imports pymongo)."""
    if settings.backend == "embedded":
        from wowd.stores.embedded import open_embedded

        return await open_embedded(settings)
    from wowd.stores.mongo import open_mongo

    return await open_mongo(settings)


@asynccontextmanager
async def opened_backend(settings: WowdSettings) -> AsyncIterator[Backend]:
    """The configured backend, closed on exit (shielded from cancellation, bounded in time)."""
    backend = await open_backend(settings)
    try:
        yield backend
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT_S):
            await backend.close()
