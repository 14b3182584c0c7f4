"""The composition root of a replica: settings in, a replica ready to run out.

:func:`open_replica` opens the backend, makes the gateway and the limits of its deliveries, chooses
how the replica fires (:func:`~wowd.daemon.firing.choose`) and gives the
:class:`~wowd.daemon.supervisor.Supervisor` that runs them, all inside one ``AsyncExitStack``:
whatever was opened is closed on the way out, in reverse order, also when a later step fails.
``wowd run``, the tests and the benchmarks assemble a replica here; no component builds a
collaborator of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from wowd.backends import CLOSE_TIMEOUT_S, open_backend
from wowd.config import WowdSettings
from wowd.delivery import CommandGateway, HttpGateway, OutboxGateway
from wowd.delivery.routes import per_target_limit
from wowd.stores.base import Backend

from .firing import Firing, choose
from .stream import Limits, batch_limits, target_limits
from .supervisor import Supervisor
from .systemd import SystemdNotifier

__all__ = ["Delivery", "delivery", "open_replica", "replica_of"]


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a replica's commands go and every limit of their delivery: the gateway, the outbox
    gateway again when that is it (its depth and retention are the replica's to keep), the
    stream's :class:`~wowd.daemon.stream.Limits`."""

    gateway: CommandGateway
    outbox: OutboxGateway | None
    limits: Limits


def delivery(settings: WowdSettings, backend: Backend) -> Delivery:
    """The configured gateway and its limits, sized once: ``gateway.concurrency`` deliveries in
    flight (the http gateway's connection pool as large), ``per_target_concurrency`` per target
    (its route's), or the outbox's chunks."""
    g = settings.gateway
    if g.kind == "http":
        limits = target_limits(g.concurrency, per_target_limit(g))
        return Delivery(HttpGateway(g, pool_size=limits.concurrency), None, limits)
    outbox = OutboxGateway(backend.outbox, retention_s=settings.outbox.retention_s)
    return Delivery(outbox, outbox, batch_limits(g.concurrency))


def replica_of(
    settings: WowdSettings,
    backend: Backend,
    deliveries: Delivery,
    *,
    notifier: SystemdNotifier | None = None,
    port_file: Path | None = None,
) -> Supervisor:
    """The supervisor of a replica on an opened ``backend`` and its ``deliveries``."""
    firing: Firing = choose(settings, backend, deliveries.gateway, deliveries.limits)
    return Supervisor(settings, backend, firing, outbox=deliveries.outbox, notifier=notifier, port_file=port_file)


@asynccontextmanager
async def open_replica(
    settings: WowdSettings,
    *,
    notifier: SystemdNotifier | None = None,
    port_file: Path | None = None,
) -> AsyncIterator[Supervisor]:
    """A replica of ``settings``, ready to :meth:`~Supervisor.run`; its gateway and backend are
    closed on exit (shielded from cancellation, bounded in time)."""
    async with AsyncExitStack() as stack:
        backend = await open_backend(settings)
        stack.push_async_callback(_bounded, backend.close)
        deliveries = delivery(settings, backend)
        stack.push_async_callback(_bounded, deliveries.gateway.aclose)
        yield replica_of(settings, backend, deliveries, notifier=notifier, port_file=port_file)


async def _bounded(close: Callable[[], Awaitable[None]]) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT_S):
        await close()
