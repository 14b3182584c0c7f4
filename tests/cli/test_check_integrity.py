"""``wowd check`` runs SQLite's ``quick_check`` on the embedded file: a damaged page fails the
check (exit 1, the first message) even though every store still answers its probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import Run
from tests.sqlite_damage import corrupt_table, settled_copy
from wowd.stores.embedded.sqlite import LIBRARY


def test_check_fails_on_a_file_with_damaged_pages_of_the_log(
    wowd: Run, db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = wowd("demo", "--commits", "400", "--timers", "50", "--aggregates", "40")
    assert code == 0, err
    code, out, err = wowd("check")
    assert code == 0, err
    assert f"ok   embedded file {db} (quick_check)" in out
    assert f"ok   {LIBRARY}" in out  # the SQLite library the replicas use on this file

    damaged = settled_copy(db, tmp_path / "damaged.db")
    corrupt_table(damaged, "log")
    monkeypatch.setenv("WOWD_EMBEDDED__PATH", str(damaged))
    code, out, err = wowd("check")
    assert code == 1
    [line] = [x for x in err.splitlines() if x.startswith("FAIL embedded file")]
    message = line.removeprefix(f"FAIL embedded file {damaged}: quick_check: ")
    # SQLite's own words, which name the damaged page ("Page 42: ..." or "Tree 8 page 42: ...")
    assert message != line and "page " in message.lower() and "***" not in message, line
    assert "wowd check: 1 problem(s)" in err
