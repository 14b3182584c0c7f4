"""``wowd quarantine list|show|retry``: what the feed set aside is listed, shown and, once the
cause is fixed, fed by a retry (idempotent steps from its reason); what still fails stays."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.cli.conftest import CONTEXT, PARTITIONS, Run
from tests.factories import commit, event, eventually, ref, scheduled
from tests.helpers import refusing
from wowd.backends import opened_backend
from wowd.cli import quarantine as quarantine_cli
from wowd.config import WowdSettings, load_settings
from wowd.daemon.feed import CONSUMER, Feeder, Waker
from wowd.daemon.leases import HeldSlot
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
    Owner,
    SnapshotRecord,
    commit_to_doc,
    partition,
)
from wowd.stores.base import Backend
from wowd.stores.embedded.sqlite import sqlite3

ORDER = AggregateType(context=CONTEXT, aggregate="order")
DUE = 10**13


def order_commit(agg_id: str, version: int = 1, *, rule: dict[str, Any] | None = None) -> Commit:
    """A commit of ``order/agg_id`` scheduling the timer ``expire`` (``rule``: once)."""
    expire = scheduled("expire", DUE, target=ref(agg_id), command="expire-order", rule=rule)
    return commit(agg_id, version, event(n=version), expire, create_time=1_700_000_000_000 + version)


async def feed_until_caught_up(settings: WowdSettings, backend: Backend) -> None:
    """The daemon's feed over every partition until it reaches the log's head."""
    res = await backend.leases.acquire("ns", Owner(key="me"), 1, timedelta(seconds=60), timedelta(seconds=1))
    assert res.lease is not None
    held = HeldSlot(
        lease=res.lease,
        partitions=frozenset(range(PARTITIONS)),
        valid_until=anyio.current_time() + 60,
        owner_key="me",
    )
    waker = Waker()
    feeder = Feeder(settings, backend)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, waker)

            async def caught_up() -> bool:
                # every view at the log's head: a view that fell behind joined the shared read again
                return waker.watermark is not None and feeder.following() == [v.name for v in feeder.views]

            await eventually(caught_up, 10, "the feed at the log's head")
            held.request_stop()


def events_rows(db: Path, agg_id: str) -> list[tuple[int, str]]:
    """The event sink's documents of ``order/agg_id`` (none while no sink has made its table)."""
    with closing(sqlite3.connect(db)) as conn:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'events'").fetchall():
            return []
        return conn.execute(
            "SELECT version, id FROM events WHERE aggregate = 'order' AND aggregate_id = ?", (agg_id,)
        ).fetchall()


async def timer_of(agg_id: str) -> Any:
    async with opened_backend(load_settings()) as backend:
        return await backend.timer_queries.find(AggregateRef(context=CONTEXT, aggregate="order", id=agg_id), "expire")


async def quarantine_directly(*items: tuple[dict[str, Any], str]) -> list[str]:
    async with opened_backend(load_settings()) as backend:
        for raw, reason in items:
            p = partition(str(raw.get("aggregate_id", "")), PARTITIONS)
            await backend.quarantine.put(CONSUMER, p, ORDER, raw, reason)
        return [i["id"] for i in await backend.quarantine.items()]


def listed(wowd: Run) -> list[dict[str, Any]]:
    code, out, err = wowd("quarantine", "list", "--json")
    assert code == 0, err
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def test_a_commit_the_sink_refused_is_listed_shown_then_fed_by_retry(wowd: Run, db: Path) -> None:
    commits = [order_commit("o-1"), order_commit("bad"), order_commit("o-2")]

    async def feed_with_a_refusing_sink() -> None:
        settings = load_settings()
        async with opened_backend(settings) as backend:
            await backend.log.append_many(commits)
            refusing(backend, refuse={"bad"})
            await feed_until_caught_up(settings, backend)

    anyio.run(feed_with_a_refusing_sink)
    assert events_rows(db, "o-1") and events_rows(db, "o-2")
    # only the index refused it: the timer view projected its timer
    assert events_rows(db, "bad") == [] and anyio.run(timer_of, "bad") is not None

    # listed and shown
    code, out, err = wowd("quarantine", "list")
    assert code == 0, err
    [item] = listed(wowd)
    assert item["reason"].startswith("sink refused it: InvalidInput: events:")
    assert item["raw"]["aggregate_id"] == "bad" and item["partition"] == partition("bad", PARTITIONS)
    assert item["id"] in out and "bad v1" in out and "sink refused it" in out and "1 items" in out
    code, out, err = wowd("quarantine", "show", item["id"])
    assert code == 0, err
    shown = json.loads(out)
    assert shown["id"] == item["id"] and shown["raw"]["aggregate_id"] == "bad" and shown["reason"] == item["reason"]

    # the cause fixed (the plain sink): fed (the timer written again: no change), released
    code, out, err = wowd("quarantine", "retry", item["id"])
    assert code == 0, err
    assert f"fed {item['id']} (demo.order/(0)/bad v1): sink, timers, snapshots, parked; released" in out
    assert [v for v, _ in events_rows(db, "bad")] == [1]
    timer = anyio.run(timer_of, "bad")
    assert timer is not None and timer.due_at == DUE and timer.version == 1
    assert listed(wowd) == []
    # released: a second retry finds nothing
    code, _, err = wowd("quarantine", "retry", item["id"])
    assert code == 1 and f"no quarantined item {item['id']}" in err
    code, out, _ = wowd("quarantine", "show", item["id"])
    assert code == 1


def test_what_still_fails_stays_quarantined_under_its_id_with_the_new_reason(
    wowd: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    malformed = {**commit_to_doc(order_commit("m-1"), PARTITIONS), "version": "one"}
    bad_rule = commit_to_doc(order_commit("r-1", rule={"type": "weekly"}), PARTITIONS)
    refused = commit_to_doc(order_commit("s-1"), PARTITIONS)
    ids = anyio.run(
        quarantine_directly,
        (malformed, "version: must be an int"),
        (bad_rule, "rejected timer event: rule.type: unknown rule type 'weekly'"),
        (refused, "sink refused it: InvalidInput: events: mapper_parsing_exception"),
    )

    # the sink still refuses s-1
    real = quarantine_cli.opened_backend

    @asynccontextmanager
    async def refusing_backend(settings: WowdSettings, *, create: bool = True) -> AsyncIterator[Backend]:
        async with real(settings, create=create) as backend:
            refusing(backend, refuse={"s-1"})
            yield backend

    monkeypatch.setattr(quarantine_cli, "opened_backend", refusing_backend)
    code, out, err = wowd("quarantine", "retry", "--all")
    assert code == 1
    assert f"FAIL {ids[0]} (m-1 vone) stays quarantined: version:" in err
    assert f"FAIL {ids[1]} (demo.order/(0)/r-1 v1) stays quarantined: rejected timer event: " in err
    assert "rule.type" in err
    assert f"FAIL {ids[2]} (demo.order/(0)/s-1 v1) stays quarantined: sink refused it: InvalidInput: " in err
    assert "0 fed and released, 3 still quarantined" in out
    items = listed(wowd)
    assert [i["id"] for i in items] == ids
    assert items[2]["reason"].startswith("sink refused it: InvalidInput: events: ")
    assert "mapper_parsing_exception" in items[2]["reason"]
    assert "rule.type" in items[1]["reason"]

    # the sink fixed: s-1 is fed; the others still fail
    monkeypatch.setattr(quarantine_cli, "opened_backend", real)
    code, out, err = wowd("quarantine", "retry", *ids)
    assert code == 1
    assert f"fed {ids[2]} (demo.order/(0)/s-1 v1): sink, timers, snapshots, parked; released" in out
    assert [i["id"] for i in listed(wowd)] == ids[:2]
    assert anyio.run(timer_of, "s-1") is not None


def test_retry_runs_the_steps_the_reason_names_and_marks_a_snapshot_behind_stale(
    wowd: Run, db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WOWD_REDUCERS", '{"order": "wowd.demo:reducer"}')
    ref = AggregateRef(context=CONTEXT, aggregate="order", id="o-9")

    async def snapshot_at_1_then_quarantine_2() -> list[str]:
        async with opened_backend(load_settings()) as backend:
            await backend.snapshots.save(SnapshotRecord(ref=ref, version=1, state_revision=1, state={"n": 1}))
        return await quarantine_directly(
            (commit_to_doc(order_commit("o-9", 2), PARTITIONS), "snapshots refused it: StorageError: disk full")
        )

    [item_id] = anyio.run(snapshot_at_1_then_quarantine_2)
    code, out, err = wowd("quarantine", "retry", item_id)
    assert code == 0, err
    assert f"fed {item_id} (demo.order/(0)/o-9 v2): snapshots, parked; released" in out

    async def stored() -> SnapshotRecord | None:
        async with opened_backend(load_settings()) as backend:
            return await backend.snapshots.load(ref)

    snap = anyio.run(stored)
    assert snap is not None and snap.version == 1 and snap.stale_version == 2
    # the steps before the one that refused it are not run again
    assert events_rows(db, "o-9") == [] and anyio.run(timer_of, "o-9") is None


def test_list_pages_and_retry_needs_ids_or_all(wowd: Run) -> None:
    ids = anyio.run(
        quarantine_directly, *[({"aggregate_id": f"x-{i}", "version": "one"}, "version: x") for i in range(3)]
    )
    code, out, err = wowd("quarantine", "list", "--limit", "2")
    assert code == 0, err
    assert f"2 items; next: --after {ids[1]}" in out
    code, out, err = wowd("quarantine", "list", "--limit", "2", "--after", ids[1])
    assert code == 0 and ids[2] in out and "1 items" in out and "next" not in out
    code, _, err = wowd("quarantine", "retry")
    assert code == 2 and "ids or --all" in err
    code, _, err = wowd("quarantine", "retry", ids[0], "--all")
    assert code == 2


def test_a_dismissed_commit_leaves_the_list_and_retry_all_and_is_kept_with_who_and_why(wowd: Run) -> None:
    never = {"aggregate_id": "t-1", "version": "one"}
    ids = anyio.run(
        quarantine_directly,
        (never, "version: must be an int"),
        ({"aggregate_id": "t-2", "version": "two"}, "version: must be an int"),
    )
    code, out, err = wowd("quarantine", "dismiss", ids[0], "--reason", "test data from the load test", "--by", "ana")
    assert code == 0, err
    assert f"dismissed {ids[0]}" in out and "1 of 1 dismissed by ana: test data from the load test" in out
    assert [i["id"] for i in listed(wowd)] == [ids[1]]
    # kept for audit: listed with --dismissed, shown by id
    code, out, err = wowd("quarantine", "list", "--dismissed")
    assert code == 0, err
    assert ids[0] in out and "ana" in out and "test data from the load test" in out and "1 dismissed items" in out
    assert "t-2" not in out
    code, out, err = wowd("quarantine", "show", ids[0])
    assert code == 0, err
    shown = json.loads(out)
    assert shown["raw"] == never and shown["reason"] == "version: must be an int"
    assert (shown["dismissed"]["by"], shown["dismissed"]["reason"]) == ("ana", "test data from the load test")
    # retry --all passes it by: only the other is tried
    code, out, err = wowd("quarantine", "retry", "--all")
    assert code == 1 and ids[0] not in err and f"FAIL {ids[1]}" in err
    assert "0 fed and released, 1 still quarantined" in out


def test_a_dismissal_names_what_it_could_not_dismiss_and_exits_1(wowd: Run) -> None:
    [item_id] = anyio.run(quarantine_directly, ({"aggregate_id": "u-1", "version": "one"}, "version: x"))
    code, _, err = wowd("quarantine", "dismiss", item_id, "--reason", "duplicate of u-2")
    assert code == 0, err
    [kept] = json.loads(wowd("quarantine", "list", "--dismissed", "--json")[1])["items"]
    assert kept["dismissed"]["by"] == quarantine_cli.default_author()
    code, out, err = wowd("quarantine", "dismiss", item_id, "999999", "--reason", "again", "--by", "bo")
    assert code == 1
    assert f"wowd: {item_id} was dismissed already" in err and "duplicate of u-2" in err
    assert "wowd: no quarantined item 999999" in err and "0 of 2 dismissed" in out
    [still] = json.loads(wowd("quarantine", "list", "--dismissed", "--json")[1])["items"]
    assert still["dismissed"] == kept["dismissed"]


@pytest.mark.parametrize(("flags", "named"), [(["--reason", " "], "--reason"), (["--reason", "x", "--by", ""], "--by")])
def test_a_dismissal_without_a_reason_or_an_author_is_a_usage_error(wowd: Run, flags: list[str], named: str) -> None:
    [item_id] = anyio.run(quarantine_directly, ({"aggregate_id": "v-1", "version": "one"}, "version: x"))
    code, _, err = wowd("quarantine", "dismiss", item_id, *flags)
    assert code == 2 and f"wowd quarantine dismiss: {named} is required" in err
    assert [i["id"] for i in listed(wowd)] == [item_id]
    code, _, err = wowd("quarantine", "dismiss", item_id)
    assert code == 2 and "--reason" in err
