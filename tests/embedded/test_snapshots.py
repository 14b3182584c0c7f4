"""The embedded snapshot store: format records, decimals, concurrent writers, unstorable states.
The protocol behaviour is in tests/contract/."""

from __future__ import annotations

import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers import sql
from wowd.errors import FormatError, InvalidInput
from wowd.model import (
    AggregateRef,
    SnapshotRecord,
)
from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore, encode_state

pytestmark = pytest.mark.anyio

CTX = "ctx"


def snap(id: str, version: int, state: dict[str, Any] | None = None, revision: int = 1) -> SnapshotRecord:
    r = AggregateRef(context=CTX, aggregate="order", id=id)
    return SnapshotRecord(ref=r, version=version, state_revision=revision, state=state or {"v": version})


async def test_snapshot_store_refuses_a_collection_of_another_format(db_path: Path) -> None:
    store = EmbeddedSnapshotStore(db_path, context=CTX)
    await store.save(snap("a", 1))
    await store.close()
    sql(db_path, "UPDATE wow_snapshot_aggregate SET format = 3 WHERE collection = 'wow_snapshot__ctx__order'")
    again = EmbeddedSnapshotStore(db_path, context=CTX)
    with pytest.raises(FormatError, match="format 3"):
        await again.create_collection("order")
    with pytest.raises(FormatError):
        await again.load(snap("a", 1).ref)
    await again.create_collection("cart")  # another type is fine
    await again.close()


def test_decimals_are_stored_as_tagged_strings() -> None:
    text = encode_state({"price": Decimal("0.10"), "n": [Decimal("1E+3")]})
    assert text == '{"price":{"$numberDecimal":"0.10"},"n":[{"$numberDecimal":"1E+3"}]}'
    with pytest.raises(TypeError):
        encode_state({"s": {1}})


async def test_concurrent_saves_from_two_connections_keep_the_highest_version(db_path: Path) -> None:
    stores = [EmbeddedSnapshotStore(db_path, context=CTX) for _ in range(2)]
    for s in stores:
        await s.prepare()
    versions = list(range(1, 61))
    random.Random(5).shuffle(versions)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i, v in enumerate(versions):
                tg.start_soon(stores[i % 2].save, snap("race", v))
    loaded = await stores[0].load(snap("race", 1).ref)
    assert loaded is not None and loaded.version == 60
    for s in stores:
        await s.close()


async def test_save_of_an_unstorable_state_raises_invalid_input(db_path: Path) -> None:
    store = EmbeddedSnapshotStore(db_path, context=CTX)
    with pytest.raises(InvalidInput, match="state"):
        await store.save(snap("a", 1, {"when": object()}))
    assert await store.load(snap("a", 1).ref) is None
    await store.close()
