"""Backend assembly: settings -> the configured backend's stores (opened, prepared), closed whatever
happens. Used by the command line and by the application client (:mod:`wowd.client`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from wowd.config import WowdSettings
from wowd.errors import ConfigError
from wowd.stores.base import Backend

__all__ = ["CLOSE_TIMEOUT_S", "missing_database", "open_backend", "opened_backend"]

CLOSE_TIMEOUT_S = 10.0


def missing_database(settings: WowdSettings, how_to_create: str) -> ConfigError | None:
    """The error of opening the embedded database without creating it when its file does not
    exist (a mistyped path, the wrong directory), naming the setting, the path and
    ``how_to_create`` it; None when the file exists or the backend is not embedded."""
    path = settings.embedded.path
    if settings.backend != "embedded" or path.exists():
        return None
    where = "" if path.is_absolute() else f" (in {str(path.absolute().parent)!r})"
    return ConfigError(
        f"WOWD_EMBEDDED__PATH: the database file {str(path)!r}{where} does not exist "
        f"(wowd run creates it; {how_to_create})"
    )


async def open_backend(settings: WowdSettings, *, create: bool = True) -> Backend:
    """Opens and prepares every store of the configured backend; imports its drivers only now
    (the embedded backend never imports pymongo). With ``create`` false, an embedded database
    file that does not exist is a :class:`ConfigError` (nothing is created)."""
    if not create:
        missing = missing_database(settings, "--create creates it")
        if missing is not None:
            raise missing
    if settings.backend == "embedded":
        from wowd.stores.embedded import open_embedded

        return await open_embedded(settings)
    from wowd.stores.mongo import open_mongo

    return await open_mongo(settings)


@asynccontextmanager
async def opened_backend(settings: WowdSettings, *, create: bool = True) -> AsyncIterator[Backend]:
    """The configured backend, closed on exit (shielded from cancellation, bounded in time);
    ``create`` as :func:`open_backend` takes it."""
    backend = await open_backend(settings, create=create)
    try:
        yield backend
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT_S):
            await backend.close()
