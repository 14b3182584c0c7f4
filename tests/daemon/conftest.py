"""What the daemon's in-process tests share: a replica's settings (the test module's
``settings(tmp_path)``, unless it has a ``replica_settings`` fixture of its own) and its stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from wowd.backends import opened_backend
from wowd.config import WowdSettings
from wowd.stores.base import Backend


@pytest.fixture
def replica_settings(request: pytest.FixtureRequest, tmp_path: Path) -> WowdSettings:
    """The settings of the test's module: its ``settings(tmp_path)``."""
    settings: WowdSettings = request.module.settings(tmp_path)
    return settings


@pytest.fixture
async def backend(replica_settings: WowdSettings) -> AsyncIterator[Backend]:
    """The stores of ``replica_settings``, opened for the test."""
    async with opened_backend(replica_settings) as b:
        yield b
