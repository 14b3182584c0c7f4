"""``wowd timers rebuild`` at the command line: what it refuses before opening a store."""

from __future__ import annotations

import pytest

from .conftest import Run


def test_timers_rebuild_on_mongo_exits_2_with_what_to_do_instead(wowd: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WOWD_BACKEND", "mongo")
    monkeypatch.setenv("WOWD_MONGODB__URI", "mongodb://127.0.0.1:1/")
    monkeypatch.setenv("WOWD_ELASTICSEARCH__URL", "http://127.0.0.1:1")
    code, _out, err = wowd("timers", "rebuild", "--dry-run")
    assert code == 2
    assert "runs on the embedded backend" in err and "reset the feed's checkpoints" in err
