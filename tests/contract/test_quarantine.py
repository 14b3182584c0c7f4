"""Quarantine contract: the documents the feed cannot read or apply, kept with the reason, named
by ids that page in commit order."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.contract.conftest import PARTITIONS
from tests.contract.test_log import ORDER
from wowd.errors import InvalidInput
from wowd.stores.base import Quarantine

pytestmark = pytest.mark.anyio


def _content(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in i.items() if k not in ("id", "created_at")} for i in items]


async def test_quarantine_keeps_raw_and_reason_once(quarantine: Quarantine) -> None:
    raw = {"aggregate_id": "x", "version": "one"}
    await quarantine.put("feed", 3, ORDER, raw, "version: must be int")
    await quarantine.put("feed", 3, ORDER, dict(raw), "version: must be int")  # idempotent
    await quarantine.put("feed", 3, ORDER, {"aggregate_id": "y"}, "events: is missing")
    items = await quarantine.items()
    assert _content(items) == [
        {
            "consumer": "feed",
            "partition": 3,
            "aggregate": "order",
            "raw": raw,
            "reason": "version: must be int",
            "dismissed": None,
        },
        {
            "consumer": "feed",
            "partition": 3,
            "aggregate": "order",
            "raw": {"aggregate_id": "y"},
            "reason": "events: is missing",
            "dismissed": None,
        },
    ]
    assert len(await quarantine.items(limit=1)) == 1


async def test_quarantined_items_have_stable_ids_pages_and_a_reason_replaced_in_place(quarantine: Quarantine) -> None:
    before = int(time.time() * 1000) - 1000
    for i in range(5):
        await quarantine.put("feed", i % PARTITIONS, ORDER, {"aggregate_id": f"q-{i}"}, f"reason {i}")
    items = await quarantine.items()
    assert [i["raw"]["aggregate_id"] for i in items] == [f"q-{i}" for i in range(5)]
    ids = [i["id"] for i in items]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 5
    assert all(before <= i["created_at"] <= time.time() * 1000 + 1000 for i in items)
    # pages: after the last id of the previous page
    first = await quarantine.items(limit=2)
    second = await quarantine.items(limit=2, after=first[-1]["id"])
    third = await quarantine.items(limit=2, after=second[-1]["id"])
    assert [i["id"] for i in first + second + third] == ids
    assert await quarantine.items(limit=2, after=ids[-1]) == []
    # by id (an id naming nothing is skipped)
    picked = await quarantine.items(ids=[ids[3], ids[1], "0" * 24, "999999999", "not-an-id"])
    assert [i["id"] for i in picked] == [ids[1], ids[3]]
    assert await quarantine.items(ids=[]) == []
    # quarantined again: same id, the new reason
    await quarantine.put("feed", 2, ORDER, {"aggregate_id": "q-2"}, "sink refused it: SinkWriteError: boom")
    [again] = await quarantine.items(ids=[ids[2]])
    assert again["reason"] == "sink refused it: SinkWriteError: boom"
    assert again["created_at"] == items[2]["created_at"]
    assert [i["id"] for i in await quarantine.items()] == ids


async def test_release_deletes_those_ids_once(quarantine: Quarantine) -> None:
    for i in range(3):
        await quarantine.put("feed", 1, ORDER, {"aggregate_id": f"r-{i}"}, "events: is missing")
    ids = [i["id"] for i in await quarantine.items()]
    assert await quarantine.release([ids[0], ids[2], "0" * 24, "999999999", "nope"]) == 2
    assert [i["id"] for i in await quarantine.items()] == [ids[1]]
    assert await quarantine.release([ids[0], ids[2]]) == 0  # idempotent
    assert await quarantine.release([]) == 0
    # a document released and quarantined again is a new item
    await quarantine.put("feed", 1, ORDER, {"aggregate_id": "r-0"}, "events: is missing")
    items = await quarantine.items()
    assert [i["raw"]["aggregate_id"] for i in items] == ["r-1", "r-0"]
    assert items[1]["id"] not in ids


async def test_a_dismissed_item_leaves_the_listing_and_is_kept_with_its_reason_and_author(
    quarantine: Quarantine,
) -> None:
    for i in range(4):
        await quarantine.put("feed", 1, ORDER, {"aggregate_id": f"d-{i}"}, "events: is missing")
    ids = [i["id"] for i in await quarantine.items()]
    before = int(time.time() * 1000) - 1000
    assert await quarantine.dismiss([ids[1], ids[3], "0" * 24, "999999999", "nope"], " never applies ", "ops@host") == 2
    assert [i["id"] for i in await quarantine.items()] == [ids[0], ids[2]]
    kept = await quarantine.items(dismissed=True)
    assert [i["id"] for i in kept] == [ids[1], ids[3]]
    for item in kept:
        mark = item["dismissed"]
        assert (mark["reason"], mark["by"]) == ("never applies", "ops@host")
        assert before <= mark["at"] <= time.time() * 1000 + 1000
        assert item["reason"] == "events: is missing"
    # pages of the dismissed, after an id
    assert [i["id"] for i in await quarantine.items(limit=1, dismissed=True, after=ids[1])] == [ids[3]]
    # read by id, dismissed or not
    assert [(i["id"], i["dismissed"] is None) for i in await quarantine.items(ids=ids)] == [
        (ids[0], True),
        (ids[1], False),
        (ids[2], True),
        (ids[3], False),
    ]
    # dismissed once: a second dismissal changes nothing, not even the reason
    assert await quarantine.dismiss([ids[1]], "another reason", "someone else") == 0
    [again] = await quarantine.items(ids=[ids[1]])
    assert again["dismissed"]["reason"] == "never applies"
    assert await quarantine.dismiss([], "x", "y") == 0


async def test_a_dismissed_document_quarantined_again_stays_dismissed_and_a_release_deletes_it(
    quarantine: Quarantine,
) -> None:
    await quarantine.put("feed", 2, ORDER, {"aggregate_id": "e-0"}, "events: is missing")
    [item] = await quarantine.items()
    assert await quarantine.dismiss([item["id"]], "test data", "ops") == 1
    await quarantine.put("feed", 2, ORDER, {"aggregate_id": "e-0"}, "sink refused it: SinkWriteError: x")
    assert await quarantine.items() == []
    [again] = await quarantine.items(dismissed=True)
    assert (again["id"], again["reason"], again["dismissed"]["reason"]) == (
        item["id"],
        "sink refused it: SinkWriteError: x",
        "test data",
    )
    assert await quarantine.release([item["id"]]) == 1
    assert await quarantine.items(dismissed=True) == []


@pytest.mark.parametrize(
    ("reason", "by", "field"),
    [("", "ops", "reason"), ("   ", "ops", "reason"), ("why", "", "by"), ("x" * 1001, "ops", "reason")],
)
async def test_a_dismissal_without_a_reason_or_an_author_is_refused_naming_the_field(
    quarantine: Quarantine, reason: str, by: str, field: str
) -> None:
    await quarantine.put("feed", 2, ORDER, {"aggregate_id": "f-0"}, "events: is missing")
    [item] = await quarantine.items()
    with pytest.raises(InvalidInput) as refused:
        await quarantine.dismiss([item["id"]], reason, by)
    assert refused.value.field == field
    assert [i["id"] for i in await quarantine.items()] == [item["id"]]
