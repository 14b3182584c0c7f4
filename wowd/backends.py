"""Backend assembly: settings -> the configured backend's operations object and its stores (opened,
prepared), closed whatever happens. Used by the command line, the daemon's composition root and
the application client (:mod:`wowd.client`).

The one place a backend is registered (:data:`BACKENDS`): its name (``WOWD_BACKEND``) and the
package that gives its operations object, imported only when that backend is used (the embedded
default never imports pymongo). docs/architecture.md, "Adding a backend", says what a backend
package implements.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio

from wowd.config import WowdSettings
from wowd.errors import ConfigError
from wowd.stores.base import Backend, Operations

__all__ = ["BACKENDS", "CLOSE_TIMEOUT_S", "missing_database", "open_backend", "opened_backend", "operations"]

CLOSE_TIMEOUT_S = 10.0


def _embedded(settings: WowdSettings) -> Operations:
    from wowd.stores.embedded import EmbeddedOperations

    return EmbeddedOperations(settings)


def _mongo(settings: WowdSettings) -> Operations:
    from wowd.stores.mongo import MongoOperations

    return MongoOperations(settings)


BACKENDS: dict[str, Callable[[WowdSettings], Operations]] = {"embedded": _embedded, "mongo": _mongo}
"""The backends by name (``WOWD_BACKEND``): each makes its operations object of the settings."""


def operations(settings: WowdSettings) -> Operations:
    """The operations object of the configured backend (nothing opened)."""
    make = BACKENDS.get(settings.backend)
    if make is None:
        raise ConfigError(f"WOWD_BACKEND: no backend {settings.backend!r} (there are {', '.join(sorted(BACKENDS))})")
    return make(settings)


def missing_database(settings: WowdSettings, how_to_create: str) -> ConfigError | None:
    """The error of opening the stores without creating them when they do not exist (a mistyped
    embedded file path, the wrong directory), naming the setting and ``how_to_create`` them;
    None when they exist or the backend's stores are a server's."""
    return operations(settings).absent(how_to_create)


async def open_backend(settings: WowdSettings, *, create: bool = True) -> Backend:
    """Opens and prepares every store of the configured backend; imports its drivers only now
    (the embedded backend never imports pymongo). With ``create`` false, stores that do not
    exist are a :class:`ConfigError` (nothing is created)."""
    ops = operations(settings)
    if not create:
        missing = ops.absent("--create creates it")
        if missing is not None:
            raise missing
    return await ops.open()


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
