"""What the daemon's in-process tests share: the backend of the module's ``replica_settings``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from wowd.backends import opened_backend
from wowd.config import WowdSettings
from wowd.stores.base import Backend


@pytest.fixture
async def backend(replica_settings: WowdSettings) -> AsyncIterator[Backend]:
    """The stores of ``replica_settings`` (a fixture of the test's module), opened for the test."""
    async with opened_backend(replica_settings) as b:
        yield b
