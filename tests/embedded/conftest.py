from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.factories import CONTEXT, PARTITIONS
from wowd.stores.embedded.log import EmbeddedLog


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "wowd.db"


@pytest.fixture
async def log(db_path: Path) -> AsyncIterator[EmbeddedLog]:
    """The embedded log of ``db_path`` (the context and partitions of :mod:`tests.factories`)."""
    store = EmbeddedLog(db_path, context=CONTEXT, partitions=PARTITIONS)
    try:
        yield store
    finally:
        await store.close()
