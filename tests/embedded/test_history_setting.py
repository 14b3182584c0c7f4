"""``WOWD_TIMERS__HISTORY=false``: the embedded backend keeps no timer history (no table, no
store: the feed and the firing path write nothing more)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from wowd.config import EmbeddedSettings, TimerSettings, WowdSettings
from wowd.stores.embedded import open_embedded

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("kept", [True, False])
async def test_the_history_is_kept_unless_the_setting_says_not(tmp_path: Path, kept: bool) -> None:
    path = tmp_path / "wowd.db"
    settings = WowdSettings(context="demo", embedded=EmbeddedSettings(path=path), timers=TimerSettings(history=kept))
    backend = await open_embedded(settings)
    try:
        assert (backend.history is not None) is kept
    finally:
        await backend.close()
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert ("wow_timer_history__demo" in tables) is kept
