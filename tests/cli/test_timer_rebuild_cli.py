"""``wowd timers rebuild`` at the command line: what it refuses before opening a store."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

from wowd.stores.embedded.sqlite import sqlite3

from .conftest import CONTEXT, Run


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
