"""What the firing tests share: an embedded timer store of a file of its own, and the simulators
the fire rule runs on (the contract suites' session-wide ones)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from tests.contract.conftest import mongosim_sharded_uri, mongosim_uri
from tests.factories import CONTEXT
from wowd.stores.embedded.timers import EmbeddedTimerStore

__all__ = ["mongosim_sharded_uri", "mongosim_uri"]

PARTS = 4
"""The partitions of :func:`opened_timers`'s file."""

Store = TypeVar("Store", bound=EmbeddedTimerStore)


@asynccontextmanager
async def opened_timers(kind: type[Store], tmp_path: Path) -> AsyncIterator[Store]:
    """An embedded timer store of class ``kind`` on ``tmp_path/wowd.db`` (:data:`PARTS`
    partitions), closed on exit."""
    async with AsyncExitStack() as opened:
        store = kind(tmp_path / "wowd.db", context=CONTEXT, partitions=PARTS)
        opened.push_async_callback(store.close)
        yield store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[EmbeddedTimerStore]:
    async with opened_timers(EmbeddedTimerStore, tmp_path) as s:
        yield s
