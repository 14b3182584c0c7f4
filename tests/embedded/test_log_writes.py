"""The embedded log's writes: the commits an append refuses, the columns a raw document is stored
under (what ``last_version``, the log check and the duplicate check read of it), a log in memory,
and a log that closes its file."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import anyio
import pytest

from tests.factories import CONTEXT, PARTITIONS, commit, event, ref
from wowd.errors import InvalidInput
from wowd.model import AggregateType
from wowd.stores.base import OwnerProbe
from wowd.stores.embedded.log import EmbeddedLog

pytestmark = pytest.mark.anyio

ORDER = AggregateType(context=CONTEXT, aggregate="order")
EVERY = dict.fromkeys(range(PARTITIONS))


async def everything(log: EmbeddedLog) -> list[object]:
    with anyio.fail_after(5):
        return [e for b in [b async for b in log.read(EVERY, follow=False)] for e in b.entries]


def test_a_log_of_no_partitions_is_refused_naming_the_setting(db_path: Path) -> None:
    with pytest.raises(InvalidInput) as refused:
        EmbeddedLog(db_path, context=CONTEXT, partitions=0)
    assert refused.value.field == "partitions"
    assert "0" in refused.value.reason


async def test_a_commit_of_another_context_is_refused_naming_the_context(log: EmbeddedLog) -> None:
    with pytest.raises(InvalidInput) as refused:
        await log.append(commit(owner=ref(context="billing")))
    assert refused.value.field == "context"
    assert "billing" in refused.value.reason
    assert await everything(log) == []


async def test_a_commit_holding_a_number_json_cannot_write_is_refused_naming_its_events(log: EmbeddedLog) -> None:
    with pytest.raises(InvalidInput) as refused:
        await log.append(commit("o-1", 1, event(amount=float("nan"))))
    assert refused.value.field == "events"
    assert "JSON" in refused.value.reason
    assert await everything(log) == []


async def test_a_raw_documents_tenant_and_version_are_what_the_log_check_and_last_version_read(
    log: EmbeddedLog,
) -> None:
    await log.insert_raw(ORDER, {"aggregate_id": "o-1", "tenant_id": "t1", "version": 2, "request_id": "r-1"})
    t1 = ref("o-1", tenant="t1")
    assert await log.last_version(t1) == 2
    assert await log.last_version(ref("o-1")) == 0
    assert await log.committed_after([OwnerProbe(t1, 1, None), OwnerProbe(ref("o-1"), 0, None)]) == {0}


async def test_a_raw_documents_version_that_is_not_a_whole_number_is_no_version(log: EmbeddedLog) -> None:
    for request_id, version in (("r-1", 1), ("r-2", "two"), ("r-3", True), ("r-4", 2.5)):
        await log.insert_raw(ORDER, {"aggregate_id": "o-1", "version": version, "request_id": request_id})
    await log.insert_raw(ORDER, {"aggregate_id": "o-2", "version": True, "request_id": "r-5"})
    assert await log.last_version(ref("o-1")) == 1
    assert await log.last_version(ref("o-2")) == 0
    assert await log.committed_after([OwnerProbe(ref("o-1"), 1, None), OwnerProbe(ref("o-2"), 0, None)]) == set()


async def test_an_append_repeating_a_raw_documents_request_id_is_a_duplicate(log: EmbeddedLog) -> None:
    await log.insert_raw(ORDER, {"aggregate_id": "o-1", "version": 1, "request_id": "r-1"})
    assert await log.append(commit("o-1", 2, request_id="r-1")) == "duplicate"
    assert await log.last_version(ref("o-1")) == 1


async def test_a_raw_documents_value_json_cannot_hold_is_stored_as_its_text(log: EmbeddedLog) -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    await log.insert_raw(ORDER, {"aggregate_id": "o-1", "version": 1, "request_id": "r-1", "create_time": when})
    (entry,) = await everything(log)
    assert entry.raw["create_time"] == str(when)
    assert entry.commit is None and entry.error


async def test_a_log_in_memory_reads_and_follows_what_it_appended() -> None:
    log = EmbeddedLog(":memory:", context=CONTEXT, partitions=PARTITIONS)
    try:
        first, second = commit("o-1", 1), commit("o-1", 2)
        await log.append(first)
        seen = []
        reader = log.read(EVERY, follow=True)
        with anyio.fail_after(5):
            async for batch in reader:
                seen.extend(e.commit for e in batch.entries)
                if not batch.entries:
                    if len(seen) == 2:
                        break
                    await log.append(second)
        await reader.aclose()
    finally:
        await log.close()
    assert seen == [first, second]


async def test_closing_the_log_closes_its_connections_to_the_file(db_path: Path) -> None:
    """SQLite removes the write-ahead log with the file's last connection: none is left open."""
    log = EmbeddedLog(db_path, context=CONTEXT, partitions=PARTITIONS)
    await log.append(commit())
    assert len(await everything(log)) == 1
    assert db_path.with_name(db_path.name + "-wal").exists()
    await log.close()
    assert not db_path.with_name(db_path.name + "-wal").exists()
