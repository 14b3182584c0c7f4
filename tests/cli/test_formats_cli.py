"""Upgrades you can see: ``wowd check`` reports each store's format and what this version would do
to it; a replica refuses a format newer than it knows, naming both (exit 2)."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest

from wowd.stores.embedded import schema
from wowd.stores.embedded.sqlite import sqlite3

from .conftest import CONTEXT, Run

TIMERS = f"wow_timer__{CONTEXT}"


def _sql(db: Path, statement: str, *params: object) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        return conn.execute(statement, params).fetchall()


def test_check_reports_each_format_and_that_it_has_nothing_to_do(wowd: Run, created: Path) -> None:
    _sql(
        created,
        "INSERT INTO wow_snapshot_aggregate VALUES (?, ?, 'order', ?, 0)",
        f"wow_snapshot__{CONTEXT}__order",
        CONTEXT,
        schema.SNAPSHOT_FORMAT,
    )
    code, out, err = wowd("check")
    assert code == 0, err
    assert f"ok   format embedded log: format {schema.LOG_FORMAT}, this wowd's: nothing to do" in out
    assert f"ok   format timer collection {TIMERS}: format {schema.TIMER_FORMAT}, this wowd's: nothing to do" in out
    assert f"ok   format snapshot collection wow_snapshot__{CONTEXT}__order: format {schema.SNAPSHOT_FORMAT}" in out
    assert "ok   timers" in out  # the stores were probed


def test_check_says_an_upgrade_in_place_and_does_not_make_it(wowd: Run, created: Path) -> None:
    _sql(created, "UPDATE wow_timer_aggregate SET format = ?", schema.TIMER_UPGRADES_FROM)
    code, out, err = wowd("check")
    assert code == 0, err
    assert (
        f"ok   format timer collection {TIMERS}: format {schema.TIMER_UPGRADES_FROM},"
        f" upgraded in place to {schema.TIMER_FORMAT} at the next start of wowd run" in out
    )
    assert "stores not probed: opening them would upgrade" in out
    assert _sql(created, "SELECT DISTINCT format FROM wow_timer_aggregate") == [(schema.TIMER_UPGRADES_FROM,)]


@pytest.mark.parametrize(
    ("statement", "store", "newer", "known"),
    [
        ("UPDATE log_format SET format = ?", "embedded log", schema.LOG_FORMAT + 1, schema.LOG_FORMAT),
        ("UPDATE wow_timer_aggregate SET format = ?", f"timer collection {TIMERS}", 7, schema.TIMER_FORMAT),
    ],
)
def test_a_newer_format_is_refused_by_check_and_run_naming_both(
    wowd: Run, created: Path, statement: str, store: str, newer: int, known: int
) -> None:
    _sql(created, statement, newer)
    code, out, err = wowd("check")
    assert code == 1
    assert f"FAIL format {store} is recorded in format {newer}, newer than this wowd" in err
    assert f"knows (format {known})" in err
    code, out, err = wowd("run")
    assert code == 2, err
    assert f"{store} is recorded in format {newer}, newer than this wowd" in err and f"(format {known})" in err
    assert "Traceback" not in err


def test_a_newer_snapshot_format_is_refused_at_start(wowd: Run, created: Path) -> None:
    name = f"wow_snapshot__{CONTEXT}__order"
    _sql(created, "INSERT INTO wow_snapshot_aggregate VALUES (?, ?, 'order', 9, 0)", name, CONTEXT)
    code, _out, err = wowd("run")
    assert code == 2, err
    assert f"snapshot collection {name} is recorded in format 9" in err and f"(format {schema.SNAPSHOT_FORMAT})" in err
