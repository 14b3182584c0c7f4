"""What the event sink and the outbox hold: access stamps, outbox entries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wowd.model.ids import AggregateRef


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessStamp:
    """Write ``access`` (of ``as_of``, an access version) over the documents of ``ref`` whose
    version is in ``[from_, until]``, under the sink's stamp guard."""

    ref: AggregateRef
    access: Mapping[str, Any]
    as_of: int
    from_: int
    until: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxEntry:
    """A command delivered into the outbox: unique on ``request_id``."""

    request_id: str
    timer_id: str
    target: AggregateRef
    command: str
    """The command's JSON text."""
    scheduled_at: int
    fence: int
    owner_key: str
    created_at: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxBatch:
    """Entries taken from the outbox in insertion order, held by the take for its lease, and the
    take's name (``None`` when the batch is empty)."""

    entries: tuple[OutboxEntry, ...]
    cursor: str | None
