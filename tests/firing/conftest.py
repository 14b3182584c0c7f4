"""What the firing tests share: an embedded timer store of a file of its own, and the simulators
the fire rule runs on (the contract suites' session-wide ones)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.contract.conftest import mongosim_sharded_uri, mongosim_uri
from tests.factories import CONTEXT
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring

__all__ = ["mongosim_sharded_uri", "mongosim_uri"]

PARTS = 4
"""The partitions of :func:`opened_timers`'s file."""


@asynccontextmanager
async def opened_timers(
    tmp_path: Path, firing: type[EmbeddedTimerFiring] | None = None
) -> AsyncIterator[EmbeddedTimers]:
    """The embedded timer stores on ``tmp_path/wowd.db`` (:data:`PARTS` partitions), the firing
    store of class ``firing`` (one that counts its calls, say), closed on exit."""
    store = embedded_timers(tmp_path / "wowd.db", context=CONTEXT, partitions=PARTS, firing=firing)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[EmbeddedTimers]:
    async with opened_timers(tmp_path) as s:
        yield s
