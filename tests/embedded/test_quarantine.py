"""The embedded quarantine: a file written before the quarantine kept dismissals is upgraded in
place at the first start with DDL ``auto`` (no item lost), and refused with ``validate``; a
dismissal or a release of more ids than one statement takes changes each item once."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest

from wowd.errors import FormatError
from wowd.model import AggregateType
from wowd.stores.base import Ddl
from wowd.stores.embedded import schema
from wowd.stores.embedded.quarantine import EmbeddedQuarantine
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = pytest.mark.anyio

ORDER = AggregateType(context="ctx", aggregate="order")

FORMAT_5_QUARANTINE = """CREATE TABLE log_quarantine (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    context TEXT NOT NULL,
    consumer TEXT NOT NULL,
    partition INTEGER NOT NULL,
    aggregate TEXT NOT NULL,
    raw TEXT NOT NULL,
    raw_hash TEXT NOT NULL,
    reason TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (context, consumer, aggregate, raw_hash)
)"""
"""The quarantine as format 5 wrote it."""


async def format_5_file(path: Path) -> None:
    """A log file as a wowd of format 5 left it, with one quarantined item."""
    store = EmbeddedQuarantine(path, context="ctx")
    await store.prepare()
    await store.close()
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TABLE log_quarantine")
        conn.execute(FORMAT_5_QUARANTINE)
        conn.execute(
            "INSERT INTO log_quarantine (context, consumer, partition, aggregate, raw, raw_hash, reason, created_at)"
            " VALUES ('ctx', 'wowd', 3, 'order', '{\"aggregate_id\": \"o-1\"}', 'h', 'events: is missing', 1)"
        )
        conn.execute("UPDATE log_format SET format = 5")


def recorded(path: Path) -> int:
    with closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("SELECT format FROM log_format WHERE name = 'log'").fetchone()[0])


async def test_a_format_5_log_is_upgraded_in_place_keeping_its_items_which_can_then_be_dismissed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "wowd.db"
    await format_5_file(path)
    with closing(sqlite3.connect(path)) as conn:
        [log] = [f for f in schema.embedded_formats(conn, "ctx") if f.store == "embedded log"]
    assert (log.found, log.action) == (5, "upgrade")
    store = EmbeddedQuarantine(path, context="ctx")
    try:
        await store.prepare()
        assert recorded(path) == schema.LOG_FORMAT
        [item] = await store.items()
        assert (item["raw"], item["reason"], item["dismissed"]) == ({"aggregate_id": "o-1"}, "events: is missing", None)
        assert await store.dismiss([item["id"]], "never applies", "ops") == 1
        assert await store.items() == []
        await store.put("wowd", 3, ORDER, {"aggregate_id": "o-2"}, "version: bad")
        assert [i["raw"]["aggregate_id"] for i in await store.items()] == ["o-2"]
    finally:
        await store.close()
    # a second start finds the format it writes: nothing to do
    again = EmbeddedQuarantine(path, context="ctx")
    try:
        await again.prepare()
        assert [i["dismissed"]["reason"] for i in await again.items(dismissed=True)] == ["never applies"]
    finally:
        await again.close()


async def test_a_format_5_log_is_refused_with_ddl_validate_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "wowd.db"
    await format_5_file(path)
    store = EmbeddedQuarantine(path, context="ctx", ddl=Ddl.VALIDATE)
    try:
        with pytest.raises(FormatError, match=f"format 5, this wowd reads format {schema.LOG_FORMAT}"):
            await store.prepare()
    finally:
        await store.close()
    assert recorded(path) == 5


async def test_a_dismissal_and_a_release_of_more_ids_than_one_statement_takes_change_each_item_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "wowd.db"
    store = EmbeddedQuarantine(path, context="ctx")
    try:
        await store.prepare()
        with closing(sqlite3.connect(path)) as conn, conn:  # one transaction
            conn.executemany(
                "INSERT INTO log_quarantine (context, consumer, partition, aggregate, raw, raw_hash, reason,"
                " created_at) VALUES ('ctx', 'wowd', 1, 'order', '{}', ?, 'events: is missing', 1)",
                [(f"h{i}",) for i in range(1_300)],
            )
        ids = [i["id"] for i in await store.items(limit=2_000)]
        assert len(ids) == 1_300
        assert await store.dismiss([*ids[:1_200], *ids[:10], "nope"], "load test data", "ops") == 1_200
        assert [i["id"] for i in await store.items(limit=2_000)] == ids[1_200:]
        assert len(await store.items(limit=2_000, dismissed=True)) == 1_200
        assert await store.release(ids[100:1_300]) == 1_200
        assert [i["id"] for i in await store.items(limit=2_000, dismissed=True)] == ids[:100]
        assert await store.items(limit=2_000) == []
    finally:
        await store.close()
