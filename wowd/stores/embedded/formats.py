"""The formats recorded in the embedded file, read without changing anything (``wowd check``)."""

from __future__ import annotations

from wowd.stores.embedded import log as log_tables
from wowd.stores.embedded import snapshots as snapshot_tables
from wowd.stores.embedded import timer_sql
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.formats import StoreFormat

__all__ = ["embedded_formats"]


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
