"""The formats recorded in the embedded file, read without changing anything (``wowd check``)."""

from __future__ import annotations

import time

from wowd.stores.embedded import log as log_tables
from wowd.stores.embedded import snapshots as snapshot_tables
from wowd.stores.embedded import timer_sql
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.formats import StoreFormat

__all__ = ["embedded_formats", "rebuild_state"]


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}


def embedded_formats(conn: sqlite3.Connection, context: str) -> list[StoreFormat]:
    """The log's format, then that of each timer and snapshot collection of ``context`` recorded
    in the file (a store with nothing recorded yet is one line with ``found`` None). Reads only."""
    tables = _tables(conn)
    found: list[StoreFormat] = []
    row = (
        conn.execute("SELECT format FROM log_format WHERE name = 'log'").fetchone() if "log_format" in tables else None
    )
    found.append(StoreFormat("embedded log", None if row is None else int(row[0]), log_tables.FORMAT))
    timers = (
        conn.execute(timer_sql.registry_formats_sql(), (context,)).fetchall() if timer_sql.REGISTRY in tables else []
    )
    if not timers:
        timers = [(timer_sql.table_name(context), None)]
    for name, fmt in sorted(timers):
        found.append(StoreFormat(f"timer collection {name}", fmt, timer_sql.FORMAT, timer_sql.UPGRADES_FROM))
    snapshots = (
        conn.execute(snapshot_tables.formats_sql(), (context,)).fetchall() if snapshot_tables.REGISTRY in tables else []
    )
    for name, fmt in sorted(snapshots):
        found.append(StoreFormat(f"snapshot collection {name}", fmt, snapshot_tables.FORMAT))
    return found


def rebuild_state(conn: sqlite3.Connection, context: str) -> str | None:
    """A rebuild of the context's timer view that runs or was interrupted (``wowd timers
    rebuild``): its lock row and its shadow table, in one line (a lock of a process of this host
    that is gone is an interrupted rebuild's); ``None`` when there is neither."""
    from wowd.fmt import iso_ms
    from wowd.stores.embedded.timer_rebuild import LOCK_TABLE
    from wowd.stores.timer_rebuild import lock_gone

    tables = _tables(conn)
    shadow = timer_sql.shadow_table_name(context)
    row = None
    if LOCK_TABLE in tables:
        row = conn.execute(
            f"SELECT owner, started_at, expires_at FROM {LOCK_TABLE} WHERE context = ?", (context,)
        ).fetchone()
    if row is None and shadow not in tables:
        return None
    if row is not None and row[2] > time.time() * 1000 and not lock_gone(str(row[0])):
        return f"runs: lock held by {row[0]} since {iso_ms(row[1])}, until {iso_ms(row[2])} unless renewed"
    return (
        f"an interrupted rebuild left {shadow if shadow in tables else 'its lock'}: the live view is as it was; "
        "wowd timers rebuild runs it again (and drops what it left)"
    )
