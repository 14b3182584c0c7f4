"""The MongoDB timer view on the wire (MockupDB): tombstones and their TTL index, the format
upgrade, the batched write, the claim of due timers and the takeover's reclaim."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from bson import ObjectId
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire
from tests.mongo.timers_support import (
    CONTEXT,
    PARTITIONS,
    REGISTRY,
    answer_first_use,
    calling,
    cursor,
    dup_key_error,
    key_doc,
    make_timer,
    matches,
    ref,
    registry_doc,
    tombstone,
)
from tests.timer_stores import MongoTimers, mongo_timers
from wowd import metrics
from wowd.errors import FormatError
from wowd.model import Claim, TimerChange, TimerStatus, TimerWrite
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import MongoSharding
from wowd.stores.mongo.schema import timer_index_specs, ttl_index_spec
from wowd.stores.mongo.timer_docs import timer_to_doc, tombstone_update
from wowd.stores.mongo.timer_firing import reclaim_filter, settle_filter
from wowd.stores.mongo.timer_view import cancel_all_filter, cancel_filter, put_filter, put_update

pytestmark = pytest.mark.anyio

DB = "wowd"
ORDER = "wow_timer__ctx__order"
CART = "wow_timer__ctx__cart"
DAY_MS = 24 * 3600 * 1000
TOMBSTONES = ["DONE", "CANCELLED"]


def store_on(client: AsyncMongoClient[Any], **kwargs: Any) -> MongoTimers:
    options: dict[str, Any] = {"sharding": MongoSharding.OFF, "operation_timeout": None}
    options.update(kwargs)
    return mongo_timers(client, DB, context=CONTEXT, partitions=PARTITIONS, **options)


async def prepare(store: MongoTimers, wire: Wire, *aggregates: str) -> None:
    async with calling(store.prepare) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc(a) for a in aggregates]))
    assert out.error is None, out.error


async def ready(store: MongoTimers, wire: Wire, *aggregates: str) -> None:
    """Makes ``aggregates`` known and their DDL done (each type's first put)."""
    for aggregate in aggregates:
        t = make_timer(aggregate=aggregate, id=f"{aggregate}-first")
        async with calling(lambda t=t: store.view.put(t)) as out:  # type: ignore[misc]
            await answer_first_use(wire, aggregate)
            (await wire.command("update")).ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ObjectId()}])
        assert out.value is True, out.error


@pytest.fixture
async def idle_client() -> AsyncIterator[AsyncMongoClient[Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://localhost:1", connect=False)
    try:
        yield client
    finally:
        await client.close()


def union_doc(doc: dict[str, Any], aggregate: str = "order") -> dict[str, Any]:
    """A stored document as the claim's union read answers it: its ``_id`` kept, the owner's type set."""
    out = {"_id": ObjectId(), **doc}
    out["owner"] = {**doc["owner"], "aggregate": aggregate}
    return out


# --------------------------------------------------------------------------- TTL index, format


def test_the_tombstones_ttl_index_is_a_partial_single_field_date_index() -> None:
    """A TTL index must be a single-field index (compound indexes do not support the TTL
    property) over a Date; ``expireAfterSeconds: 0`` expires a document at its ``expires_at``;
    partial over the tombstone statuses, and the due index still holds PENDING/FIRING only."""
    spec = ttl_index_spec()
    assert list(spec["key"].items()) == [("expires_at", 1)]
    assert spec["expireAfterSeconds"] == 0
    assert spec["partialFilterExpression"] == {"status": {"$in": TOMBSTONES}}
    specs = {s["name"]: s for s in timer_index_specs()}
    assert specs["tombstones_ttl"] == spec
    assert specs["due"]["partialFilterExpression"] == {"status": {"$in": ["PENDING", "FIRING"]}}
    # the tombstone's expiry is the server's clock plus the retention: a Date, as a TTL index reads
    [set_stage, unset_stage] = tombstone_update("CANCELLED", 4, DAY_MS)
    assert set_stage["$set"]["expires_at"] == {"$add": ["$$NOW", DAY_MS]}
    assert set_stage["$set"]["status"] == "CANCELLED" and set_stage["$set"]["version"] == {"$literal": 4}
    # a small document: the key and the version it answers for, not the command, target or rule
    assert unset_stage == {"$unset": ["claim", "body", "target", "rule", "last_error"]}


async def test_prepare_upgrades_a_format_5_collection_in_place(mongo_client: Any, wire: Wire) -> None:
    """Format 5 is the same layout without tombstones: ``prepare`` creates the TTL index, then
    records 6 with an update guarded on format 5. The collection is read from then on."""
    store = store_on(mongo_client)
    async with calling(store.prepare) as out:
        (await wire.command("find")).ok(
            **cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=5), registry_doc("cart")])
        )
        ci = await wire.command("createIndexes")
        assert ci.doc["createIndexes"] == ORDER
        assert [dict(i) for i in ci.doc["indexes"]] == [ttl_index_spec()]
        assert "maxTimeMS" not in ci.doc  # the build reads the whole collection: no operation timeout
        ci.ok(numIndexesBefore=4, numIndexesAfter=5, createdCollectionAutomatically=False)
        up = await wire.command("update")
        assert up.doc["update"] == REGISTRY
        [u] = up.doc["updates"]
        assert u["q"] == {"_id": ORDER, "format": 5}
        assert u["u"]["$set"]["format"] == 6 and isinstance(u["u"]["$set"]["upgraded_at"], int)
        assert not u.get("upsert", False)
        up.ok(n=1, nModified=1)
    assert out.error is None, out.error
    async with calling(lambda: store.firing.due({0}, 10, 5)) as due:
        agg = await wire.command("aggregate")
        assert [s["$unionWith"]["coll"] for s in agg.doc["pipeline"] if "$unionWith" in s] == [CART, ORDER]
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}]))
    assert due.value == []


async def test_the_upgrades_index_build_has_no_deadline_under_the_clients_timeout(
    mock_server: Any, wire: Wire, caplog: pytest.LogCaptureFixture
) -> None:
    """The deployment's client has ``timeoutMS`` and the store an operation timeout (both 10 s):
    the TTL index of the upgrade is built over the whole collection, and the server aborts a
    build whose ``createIndexes`` was interrupted (``maxTimeMS`` expired: manual, createIndexes,
    and "Index Builds on Populated Collections"; src/mongo/db/commands/create_indexes_cmd.cpp
    aborts the build when the command's operation is interrupted), so the command carries no
    ``maxTimeMS``. The log names what is built. The answer is a 7.0 server's to a build that
    added one index (``numIndexesBefore``/``numIndexesAfter``)."""
    from datetime import timedelta

    client: AsyncMongoClient[Any] = AsyncMongoClient(
        mock_server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False, timeoutMS=10_000
    )
    try:
        store = mongo_timers(
            client,
            DB,
            context=CONTEXT,
            partitions=PARTITIONS,
            sharding=MongoSharding.OFF,
            operation_timeout=timedelta(seconds=10),
        )
        with caplog.at_level(logging.INFO, logger="wowd.stores.mongo.schema"):
            async with calling(store.prepare) as out:
                (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=5)]))
                ci = await wire.command("createIndexes")
                assert [dict(i) for i in ci.doc["indexes"]] == [ttl_index_spec()]
                assert "maxTimeMS" not in ci.doc
                ci.ok(numIndexesBefore=4, numIndexesAfter=5, createdCollectionAutomatically=False)
                up = await wire.command("update")
                assert 0 < up.doc["maxTimeMS"] <= 10_000  # the registry's update keeps its deadline
                up.ok(n=1, nModified=1)
            assert out.error is None, out.error
        said = caplog.text
        assert "tombstones_ttl" in said and ORDER in said and "upgrade to format 6" in said
        assert f"built 1 index(es) of {ORDER}" in said
    finally:
        await client.close()


async def test_an_upgrade_another_replica_made_first_is_read_again(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(store.prepare) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=5)]))
        (await wire.command("createIndexes")).ok(
            numIndexesBefore=5, numIndexesAfter=5, note="all indexes already exist"
        )
        (await wire.command("update")).ok(n=0, nModified=0)  # the guard: no longer format 5
        again = await wire.command("find")
        assert again.doc["filter"] == {"_id": ORDER}
        again.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
    assert out.error is None, out.error


async def test_ddl_validate_refuses_format_5_and_changes_nothing(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client, ddl=Ddl.VALIDATE)
    async with calling(store.prepare) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=5)]))
    assert isinstance(out.error, FormatError)
    assert "format 5" in str(out.error) and "ddl=auto" in str(out.error)


async def test_first_put_of_a_format_5_type_upgrades_it_then_makes_sure_of_its_indexes(
    mongo_client: Any, wire: Wire
) -> None:
    store = store_on(mongo_client)
    async with calling(lambda: store.view.put(make_timer())) as out:
        (await wire.command("findAndModify")).ok(value=registry_doc("order", fmt=5))
        ci = await wire.command("createIndexes")
        assert [dict(i) for i in ci.doc["indexes"]] == [ttl_index_spec()]
        ci.ok()
        up = await wire.command("update")
        assert up.doc["updates"][0]["q"] == {"_id": ORDER, "format": 5}
        up.ok(n=1, nModified=1)
        (await wire.command("create")).command_err(code=48, errmsg="Collection already exists")
        (await wire.command("createIndexes")).ok()
        (await wire.command("update")).ok(n=1, nModified=1)
    assert out.value is True, out.error


# --------------------------------------------------------------------------- write


async def test_write_is_one_unordered_bulk_per_collection_answered_from_its_result(
    mongo_client: Any, wire: Wire
) -> None:
    """Puts and cancels are conditional upserts (``UpdateOne``), a ``cancel_all`` an
    ``updateMany``; the answers come from the bulk's result: upserted (a put written, a cancel
    of nothing: its tombstone), matched (a put admitted, a live timer cancelled), and for the
    ``cancel_all`` what the bulk matched beyond the single-document statements."""
    store = store_on(mongo_client)
    await ready(store, wire, "order", "cart")
    a, b = ref(id="a"), ref(id="b")
    c = ref("cart", "c")
    k1 = make_timer(id="a", key="k1", version=1)
    c1 = make_timer(aggregate="cart", id="c", key="k", version=3)
    writes = [
        TimerWrite.put(k1),  # a new key: upserted
        TimerWrite.cancel(a, "k2", 2),  # a live timer at v1: matched
        TimerWrite.cancel_all(b, 2),  # two live timers of b
        TimerWrite.put(c1),  # cart
        TimerWrite.cancel(a, "none", 2),  # nothing stored: a tombstone upserted
        TimerWrite.cancel_all(c, 2),  # cart: nothing live
    ]
    seen: dict[str, Any] = {}
    async with calling(lambda: store.view.write(writes)) as out:
        for _ in range(2):
            req = await wire.command("update")
            seen[req.doc["update"]] = req.doc
            assert req.doc["ordered"] is False
            if req.doc["update"] == ORDER:
                # statements in order: put k1, cancel k2, cancel_all b, cancel none
                req.ok(
                    n=5,
                    nModified=3,
                    upserted=[{"index": 0, "_id": ObjectId()}, {"index": 3, "_id": ObjectId()}],
                )
            else:
                req.ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ObjectId()}])
    assert out.error is None, out.error
    assert out.value == [1, 1, 2, 1, 0, 0]
    retention = 7 * DAY_MS
    order = seen[ORDER]["updates"]
    pa, pb, pc = (r.partition(PARTITIONS) for r in (a, b, c))
    assert [(u["q"], u["u"], u.get("upsert", False), u.get("multi", False)) for u in order] == [
        (put_filter(k1), put_update(k1), True, False),
        (cancel_filter(a, pa, "k2", 2), tombstone_update("CANCELLED", 2, retention), True, False),
        (cancel_all_filter(b, pb, 2), tombstone_update("CANCELLED", 2, retention), False, True),
        (cancel_filter(a, pa, "none", 2), tombstone_update("CANCELLED", 2, retention), True, False),
    ]
    assert all(u["q"]["partition"] in (pa, pb) for u in order)  # the shard key in every filter
    cart = seen[CART]["updates"]
    assert [u["q"] for u in cart] == [put_filter(c1), cancel_all_filter(c, pc, 2)]
    assert await store.view.write([]) == []


async def test_write_decides_the_items_that_met_the_unique_key_with_one_read(mongo_client: Any, wire: Wire) -> None:
    """An unordered bulk goes on past its E11000s (each in ``writeErrors`` by index). One read of
    those keys decides: a tombstone at or above a put's version refuses it, a later live version
    refuses a cancel, an earlier version stored is a racing insert (the write again, alone), an
    earlier tombstone is raised to the cancel's version."""
    store = store_on(mongo_client)
    await ready(store, wire, "order")
    done = tombstone(timer_to_doc(make_timer(id="o1", version=3)), "DONE")
    later = timer_to_doc(make_timer(id="o2", version=9))
    raced = timer_to_doc(make_timer(id="o3", version=1))  # inserted between the match and the insert
    old = tombstone(timer_to_doc(make_timer(id="o4", version=2)), "CANCELLED")
    writes = [
        TimerWrite.put(make_timer(id="o1", version=3)),  # replayed after it fired
        TimerWrite.cancel(ref(id="o2"), "remind", 4),
        TimerWrite.put(make_timer(id="o3", version=2)),
        TimerWrite.cancel(ref(id="o4"), "remind", 6),
        TimerWrite.put(make_timer(id="o5", version=1)),
    ]
    stored = [done, later, raced, old]
    async with calling(lambda: store.view.write(writes)) as out:
        bulk = await wire.command("update")
        assert len(bulk.doc["updates"]) == 5 and bulk.doc["ordered"] is False
        for i in (0, 1, 3):  # as the server judges them: none matches what is stored
            assert not matches(bulk.doc["updates"][i]["q"], stored[i])
        bulk.ok(
            n=1,
            nModified=0,
            upserted=[{"index": 4, "_id": ObjectId()}],
            writeErrors=[dup_key_error(i, doc) for i, doc in enumerate(stored)],
        )
        read = await wire.command("find")
        assert read.doc["find"] == ORDER
        assert [clause["owner.id"] for clause in read.doc["filter"]["$or"]] == ["o1", "o2", "o3", "o4"]
        read.ok(**cursor(f"{DB}.{ORDER}", [key_doc(d) for d in stored]))
        # the racing insert: the put again alone, which now matches the earlier version
        retry = await wire.command("update")
        [st] = retry.doc["updates"]
        assert st["q"] == put_filter(writes[2].timer)  # type: ignore[arg-type]
        assert matches(st["q"], raced)
        retry.ok(n=1, nModified=1)
        # the earlier tombstone: raised to the cancel's version
        raise_ = await wire.command("update")
        [st] = raise_.doc["updates"]
        assert st["q"]["version"] == {"$lt": 6} and st["q"]["status"] == {"$in": TOMBSTONES}
        assert matches(st["q"], old) and not st.get("upsert", False)
        assert st["u"] == tombstone_update("CANCELLED", 6, 7 * DAY_MS)
        raise_.ok(n=1, nModified=1)
    assert out.error is None, out.error
    assert out.value == [0, 0, 1, 0, 1]


async def test_two_cancel_alls_in_one_collection_are_counted_by_one_read_before_the_bulk(
    mongo_client: Any, wire: Wire
) -> None:
    """The bulk's result counts matches per command, not per statement: with two ``cancel_all``s
    in one collection, one aggregation counts each owner's live timers first."""
    store = store_on(mongo_client)
    a, b = ref(id="a"), ref(id="b")
    async with calling(lambda: store.view.write([TimerWrite.cancel_all(a, 5), TimerWrite.cancel_all(b, 7)])) as out:
        agg = await wire.command("aggregate")
        assert agg.doc["aggregate"] == ORDER
        match, group = agg.doc["pipeline"]
        pa, pb = a.partition(PARTITIONS), b.partition(PARTITIONS)
        assert match == {"$match": {"$or": [cancel_all_filter(a, pa, 5), cancel_all_filter(b, pb, 7)]}}
        assert group["$group"]["_id"] == {"tenant_id": "$owner.tenant_id", "id": "$owner.id"}
        agg.ok(**cursor(f"{DB}.{ORDER}", [{"_id": {"tenant_id": "(0)", "id": "b"}, "n": 3}]))
        bulk = await wire.command("update")
        assert [u["multi"] for u in bulk.doc["updates"]] == [True, True]
        bulk.ok(n=3, nModified=3)
    assert out.error is None, out.error
    assert out.value == [0, 3]


# --------------------------------------------------------------------------- claim_due


async def test_claim_due_fails_an_undecodable_timer_and_claims_the_rest(
    mongo_client: Any, wire: Wire, caplog: pytest.LogCaptureFixture
) -> None:
    """The due read keeps each document's ``_id``; one a newer library cannot read (a cron
    expression it refuses) is set FAILED by ``_id`` and revision, counted and logged, and the
    others (less the excluded ids in flight) are claimed in one settle."""
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    ok1, ok2 = make_timer(id="o1", due_at=100), make_timer(id="o2", due_at=300)
    flying = replace(make_timer(id="o0", due_at=50), status=TimerStatus.FIRING)
    bad = {**timer_to_doc(make_timer(id="o9", due_at=200, revision=4)), "rule": {"type": "cron", "expression": "?"}}
    failed = metrics.TIMERS_FAILED.labels(target="billing.invoice")
    before = failed._value.get()
    docs = [union_doc(timer_to_doc(t)) for t in (flying, ok1)] + [union_doc(bad), union_doc(timer_to_doc(ok2))]
    caplog.set_level(logging.ERROR, logger="wowd.stores.mongo.schema")
    call = lambda: store.firing.claim_due(  # noqa: E731
        {0, 1, 2, 3}, 500, 2, owner_key="me", fence=7, claim_until=9_000, exclude={flying.timer_id}
    )
    async with calling(call) as out:
        agg = await wire.command("aggregate")
        assert agg.doc["cursor"] == {"batchSize": 5}  # over-read by the excluded one: 3 timers + count
        sub = agg.doc["pipeline"][2]["$unionWith"]["pipeline"]
        assert {"$unset": "_id"} not in sub and {"$limit": 3} in sub
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 1}, *docs]))
        fail = await wire.command("update")
        [st] = fail.doc["updates"]
        assert st["q"] == {"_id": docs[2]["_id"], "partition": bad["partition"], "revision": 4}
        assert st["u"]["$set"]["status"] == "FAILED" and st["u"]["$set"]["revision"] == 5
        assert st["u"]["$set"]["last_error"].startswith("undecodable timer: ")
        assert st["u"]["$unset"] == {"claim": ""}
        fail.ok(n=1, nModified=1)
        claim = await wire.command("update")
        assert [u["q"] for u in claim.doc["updates"]] == [settle_filter(ok1), settle_filter(ok2)]
        claim.ok(n=2, nModified=2)
    assert out.error is None, out.error
    assert [t.timer_id for t in out.value or []] == [ok1.timer_id, ok2.timer_id]
    assert all(t.claim == Claim(owner_key="me", fence=7, until=9_000) for t in out.value or [])
    assert failed._value.get() == before + 1
    assert any("set FAILED" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


async def test_claim_due_confirms_a_partial_claim_by_reading_it_back(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    t1, t2 = make_timer(id="o1", due_at=100), make_timer(id="o2", due_at=200)
    call = lambda: store.firing.claim_due({0, 1, 2, 3, 4, 5, 6, 7}, 500, 10, owner_key="me", fence=7, claim_until=9_000)  # noqa: E731
    async with calling(call) as out:
        (await wire.command("aggregate")).ok(
            **cursor(f"{DB}.{REGISTRY}", [{"registered": 1}, union_doc(timer_to_doc(t1)), union_doc(timer_to_doc(t2))])
        )
        (await wire.command("update")).ok(n=1, nModified=1)  # t2 moved on meanwhile
        mine = TimerChange.claim(t1, owner_key="me", fence=7, until=9_000).applied()
        lost = TimerChange.claim(t2, owner_key="me", fence=7, until=9_000).applied()
        assert mine is not None and lost is not None
        # one read of every claim written, each at its revision (over the unique index)
        read = await wire.command("find")
        assert read.doc["filter"] == {"$or": [settle_filter(mine), settle_filter(lost)]}
        read.ok(**cursor(f"{DB}.{ORDER}", [{"_id": ObjectId(), **timer_to_doc(mine)}]))
    assert out.error is None, out.error
    assert out.value == [mine]


# --------------------------------------------------------------------------- reclaim, sweep


async def test_reclaim_is_one_update_many_per_collection_of_the_registry(mongo_client: Any, wire: Wire) -> None:
    """A takeover ends the previous holder's claims at once: FIRING under a lower fence -> PENDING
    due at its scheduled time, the old fence named, the claim removed. The registry is read first
    (a type another replica registered has claims too); the filter carries the partitions (the
    shard key) and the reclaim index's partial filter."""
    store = store_on(mongo_client)
    async with calling(lambda: store.firing.reclaim({3, 1}, 5)) as out:
        reg = await wire.command("find")
        assert reg.doc["find"] == REGISTRY
        reg.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order"), registry_doc("cart")]))
        counts = {CART: 2, ORDER: 1}
        for name in (CART, ORDER):
            req = await wire.command("update")
            assert req.doc["update"] == name
            [u] = req.doc["updates"]
            assert u["multi"] is True and not u.get("upsert", False)
            assert (
                u["q"]
                == reclaim_filter({1, 3}, 5)
                == {
                    "partition": {"$in": [1, 3]},
                    "status": "FIRING",
                    "claim.fence": {"$lt": 5},
                }
            )
            set_stage, unset_stage = u["u"]
            assert set_stage["$set"]["status"] == "PENDING" and set_stage["$set"]["due_at"] == "$scheduled_at"
            assert set_stage["$set"]["last_error"]["$concat"][1] == {"$toString": "$claim.fence"}
            assert set_stage["$set"]["revision"] == {"$add": ["$revision", 1]}
            assert unset_stage == {"$unset": "claim"}
            req.ok(n=counts[name], nModified=counts[name])
    assert out.error is None, out.error
    assert out.value == 3


def ixscan(spec: dict[str, Any], predicate: dict[str, Any]) -> dict[str, Any] | None:
    """The ``IXSCAN`` of ``explain``'s ``queryPlanner.winningPlan`` that ``spec`` gives
    ``predicate`` by the manual's rules (Partial Indexes: usable only when the predicate contains
    the ``partialFilterExpression``; Explain Results: ``indexBounds`` per key, ``filter`` what the
    ``FETCH`` above it tests): ``$in``/equality point intervals, ``$lt`` a range from MinKey, an
    unconstrained key ``[MinKey, MaxKey]``; None when the index is not eligible."""

    def values(cond: Any) -> list[Any]:
        return list(cond["$in"]) if isinstance(cond, dict) and "$in" in cond else [cond]

    for field, want in spec.get("partialFilterExpression", {}).items():
        got = predicate.get(field)
        if got is None or not set(values(got)) <= set(values(want)):
            return None
    bounds: dict[str, list[str]] = {}
    for key in spec["key"]:
        cond = predicate.get(key)
        if isinstance(cond, dict) and "$in" in cond:
            bounds[key] = [f"[{v}, {v}]" for v in cond["$in"]]
        elif isinstance(cond, dict) and "$lt" in cond:
            bounds[key] = [f"[MinKey, {cond['$lt']})"]
        elif cond is not None and not isinstance(cond, dict):
            bounds[key] = [f"[{cond!r}, {cond!r}]"]
        else:
            bounds[key] = ["[MinKey, MaxKey]"]
    partial = set(spec.get("partialFilterExpression", {}))
    residual = {k: v for k, v in predicate.items() if k not in spec["key"] and k not in partial}
    return {
        "stage": "FETCH",
        "filter": residual,
        "inputStage": {"stage": "IXSCAN", "indexName": spec["name"], "indexBounds": bounds},
    }


def test_reclaim_reads_only_the_firing_timers_of_an_older_fence_over_the_reclaim_index() -> None:
    """The explain of the reclaim's filter on a timer collection: the reclaim index (partial on
    FIRING) bounds the scan by partition and by ``claim.fence`` below the new fence, so a slot
    with millions of PENDING timers reads only the keys of the FIRING ones it takes back, and the
    ``FETCH`` tests nothing more. The due index also qualifies (FIRING is one of its statuses)
    but reads every live timer of the partitions and tests the fence after fetching each: the
    planner's trial picks the plan that answers with fewer works (manual, Query Plans)."""
    specs = {s["name"]: s for s in timer_index_specs()}
    predicate = reclaim_filter({3, 1}, 5)
    plan = ixscan(specs["reclaim"], predicate)
    assert plan == {
        "stage": "FETCH",
        "filter": {},
        "inputStage": {
            "stage": "IXSCAN",
            "indexName": "reclaim",
            "indexBounds": {"partition": ["[1, 1]", "[3, 3]"], "claim.fence": ["[MinKey, 5)"]},
        },
    }
    due = ixscan(specs["due"], predicate)
    assert due is not None and due["filter"] == {"claim.fence": {"$lt": 5}}
    assert due["inputStage"]["indexBounds"]["due_at"] == ["[MinKey, MaxKey]"]


async def test_sweep_and_empty_calls_send_nothing(idle_client: AsyncMongoClient[Any]) -> None:
    store = store_on(idle_client)
    assert await store.firing.sweep(2**62, 100) == 0  # the TTL index expires tombstones
    assert await store.firing.reclaim(set(), 5) == 0
    assert await store.firing.claim_due(set(), 1, 1, owner_key="k", fence=1, claim_until=2) == []
    assert await store.view.write([]) == []


async def test_a_replayed_batch_costs_one_bulk_and_one_read_per_collection(mongo_client: Any, wire: Wire) -> None:
    """A log batch replayed after a takeover: 400 puts over two types, half of them fired since
    (DONE tombstones: refused), half still live at the same version (matched, kept). Whatever the
    number of timers, each collection costs one bulk and one read of its refused keys."""
    store = store_on(mongo_client)
    await ready(store, wire, "order", "cart")
    timers = [make_timer(aggregate=agg, id=f"{agg}-{i}", version=2) for agg in ("order", "cart") for i in range(200)]
    fired = {t.timer_id for t in timers[::2]}
    commands: list[str] = []
    async with calling(lambda: store.view.write([TimerWrite.put(t) for t in timers])) as out:
        for _ in range(2):
            bulk = await wire.command("update")
            commands.append("update")
            name = bulk.doc["update"]
            mine = [t for t in timers if f"wow_timer__ctx__{t.owner.aggregate}" == name]
            assert len(bulk.doc["updates"]) == 200
            refused = [
                dup_key_error(i, tombstone(timer_to_doc(t), "DONE"), ns=f"{DB}.{name}")
                for i, t in enumerate(mine)
                if t.timer_id in fired
            ]
            bulk.ok(n=100, nModified=0, writeErrors=refused)
            read = await wire.command("find")
            commands.append("find")
            assert len(read.doc["filter"]["$or"]) == 100
            read.ok(
                **cursor(
                    f"{DB}.{name}",
                    [key_doc(tombstone(timer_to_doc(t), "DONE")) for t in mine if t.timer_id in fired],
                )
            )
    assert out.error is None, out.error
    assert commands == ["update", "find", "update", "find"]
    assert out.value == [0 if t.timer_id in fired else 1 for t in timers]
