"""Store formats on MongoDB over the wire: what ``wowd check`` reads (and nothing else), and the
refusal of a format newer than this version knows, naming both (never dropped)."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire
from tests.mongo.timers_support import CONTEXT, REGISTRY, calling, cursor, registry_doc
from tests.timer_stores import mongo_timers
from wowd.errors import ConfigError, FormatTooNew
from wowd.stores.mongo._common import SNAPSHOT_TABLES, MongoSharding
from wowd.stores.mongo.schema import FORMAT, TIMER_FORMAT, TIMER_UPGRADES_FROM, mongo_formats
from wowd.stores.mongo.snapshots import MongoSnapshotStore

pytestmark = pytest.mark.anyio

DB = "wowd"


async def test_the_formats_are_read_with_two_finds_and_judged(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    async with calling(lambda: mongo_formats(mongo_client[DB], CONTEXT)) as out:
        timers = await wire.command("find")
        assert timers.doc["find"] == REGISTRY and timers.doc["filter"] == {"context": CONTEXT}
        timers.ok(
            **cursor(
                f"{DB}.{REGISTRY}",
                [
                    registry_doc("order"),
                    registry_doc("cart", fmt=TIMER_UPGRADES_FROM),
                    registry_doc("user", fmt=TIMER_FORMAT + 1),
                ],
            )
        )
        snapshots = await wire.command("find")
        assert snapshots.doc["find"] == SNAPSHOT_TABLES and snapshots.doc["filter"] == {"context": CONTEXT}
        snapshots.ok(
            **cursor(f"{DB}.{SNAPSHOT_TABLES}", [{"_id": f"wow_snapshot__{CONTEXT}__order", "format": FORMAT}])
        )
    assert out.error is None, out.error
    verdicts = {f.store: (f.found, f.action) for f in out.value or []}
    assert verdicts == {
        f"mongodb timers: wow_timer__{CONTEXT}__cart": (TIMER_UPGRADES_FROM, "upgrade"),
        f"mongodb timers: wow_timer__{CONTEXT}__order": (TIMER_FORMAT, "nothing"),
        f"mongodb timers: wow_timer__{CONTEXT}__user": (TIMER_FORMAT + 1, "refuse"),
        f"mongodb wow_snapshot__{CONTEXT}__order": (FORMAT, "nothing"),
    }
    newer = next(f for f in out.value or [] if f.newer)
    assert f"format {TIMER_FORMAT + 1}, newer than this wowd" in newer.describe()
    assert f"(format {TIMER_FORMAT})" in newer.describe()


async def test_a_newer_timer_format_is_refused_even_where_another_one_is_dropped(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    store = mongo_timers(
        mongo_client,
        DB,
        context=CONTEXT,
        partitions=8,
        sharding=MongoSharding.OFF,
        operation_timeout=None,
        drop_other_format=True,
    )
    async with calling(store.prepare) as out:
        req = await wire.command("find")
        req.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=TIMER_FORMAT + 1)]))
    assert isinstance(out.error, FormatTooNew) and isinstance(out.error, ConfigError)
    text = str(out.error)
    assert f"wow_timer__{CONTEXT}__order is recorded in format {TIMER_FORMAT + 1}" in text
    assert f"(format {TIMER_FORMAT})" in text
    # nothing was dropped: the next command the store sends is the test's own
    async with calling(lambda: mongo_client[DB].command("ping")) as ping:
        (await wire.command("ping")).ok()
    assert ping.error is None


async def test_a_newer_snapshot_format_is_refused_naming_both(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CONTEXT, sharding=MongoSharding.OFF)
    name = f"wow_snapshot__{CONTEXT}__order"
    async with calling(lambda: store.create_collection("order")) as out:
        (await wire.command("findAndModify")).ok(
            value={"_id": name, "context": CONTEXT, "aggregate": "order", "format": FORMAT + 1},
            lastErrorObject={"n": 1, "updatedExisting": True},
        )
    assert isinstance(out.error, FormatTooNew)
    assert f"{name} is recorded in format {FORMAT + 1}" in str(out.error) and f"(format {FORMAT})" in str(out.error)
