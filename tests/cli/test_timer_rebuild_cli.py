"""``wowd timers rebuild`` at the command line: what it refuses before opening a store."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest

from wowd.stores.embedded.sqlite import sqlite3

from .conftest import CONTEXT, Run


def test_timers_rebuild_on_mongo_exits_2_with_what_to_do_instead(wowd: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WOWD_BACKEND", "mongo")
    monkeypatch.setenv("WOWD_MONGODB__URI", "mongodb://127.0.0.1:1/")
    monkeypatch.setenv("WOWD_ELASTICSEARCH__URL", "http://127.0.0.1:1")
    code, _out, err = wowd("timers", "rebuild", "--dry-run")
    assert code == 2
    assert "runs on the embedded backend" in err and "reset the feed's checkpoints" in err


def test_check_names_an_interrupted_rebuild_and_a_rebuild_clears_it(wowd: Run, created: Path) -> None:
    with closing(sqlite3.connect(created, isolation_level=None)) as conn:
        conn.execute(
            "CREATE TABLE wow_timer_rebuild (context TEXT PRIMARY KEY, owner TEXT NOT NULL,"
            " started_at INTEGER NOT NULL, expires_at INTEGER NOT NULL)"
        )
        conn.execute("INSERT INTO wow_timer_rebuild VALUES (?, 'elsewhere:1:abcd', 1, 2)", (CONTEXT,))
        conn.execute(f"CREATE TABLE wow_timer__{CONTEXT}__rebuild (x)")
    code, out, err = wowd("check")
    assert code == 0, err
    assert f"ok   timer view rebuild: an interrupted rebuild left wow_timer__{CONTEXT}__rebuild" in out
    code, out, err = wowd("timers", "rebuild")
    assert code == 0, err
    assert "swapped in" in out
    code, out, err = wowd("check")
    assert code == 0 and "timer view rebuild" not in out
