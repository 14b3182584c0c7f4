"""The set of stores a replica works with, opened from the settings (the composition root's helper)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from wowd.config import WowdSettings
from wowd.model import AggregateType
from wowd.stores.base import EventSink, Log, Outbox, SlotLeaseStore, SnapshotRebuildStore, SnapshotStore, TimerStore

__all__ = ["Backend", "open_backend"]


@dataclass(kw_only=True)
class Backend:
    """The stores of one context; ``sink(type)`` gives (and caches) the event sink of a type."""

    name: str
    log: Log
    leases: SlotLeaseStore
    timers: TimerStore
    snapshots: SnapshotStore
    rebuilds: SnapshotRebuildStore
    outbox: Outbox
    sink_factory: Callable[[AggregateType], EventSink]
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    _sinks: dict[AggregateType, EventSink] = field(default_factory=dict)

    def sink(self, type: AggregateType) -> EventSink:
        s = self._sinks.get(type)
        if s is None:
            s = self._sinks[type] = self.sink_factory(type)
        return s

    async def close(self) -> None:
        for s in self._sinks.values():
            await s.close()
        for close in reversed(self.closers):
            await close()


async def open_backend(settings: WowdSettings) -> Backend:
    """Opens the configured backend; imports its drivers only now."""
    if settings.backend == "embedded":
        from wowd.stores.embedded import open_embedded

        backend: Backend = await open_embedded(settings)
        return backend
    from wowd.stores.mongo import open_mongo

    backend = await open_mongo(settings)
    return backend
