"""SnapshotStore contract: every implementation passes these."""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

import anyio
import pytest

from tests.contract.conftest import CONTEXT
from wowd.model import AggregateRef, AggregateType, SnapshotRecord

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context=CONTEXT, aggregate="order")


def ref(id: str, tenant: str = "t1", aggregate: str = "order") -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate=aggregate, id=id, tenant_id=tenant)


def snap(r: AggregateRef, version: int, state_revision: int = 1, **kw: Any) -> SnapshotRecord:
    values: dict[str, Any] = {"state": {"v": version, "items": [version]}, "event_time": 1_700_000_000_000 + version}
    values.update(kw)
    return SnapshotRecord(ref=r, version=version, state_revision=state_revision, **values)


async def test_save_then_load_round_trips_every_field(snapshot_store: Any) -> None:
    s = snap(
        ref("o-1"),
        4,
        state_revision=2,
        state={"status": "paid", "lines": [{"sku": "a", "qty": 2}], "note": "é", "flag": True, "none": None},
        owner_id="u-1",
        space_id="s-1",
        tags=("vip", "eu"),
        access_version=3,
        event_time=1_700_000_000_123,
    )
    assert await snapshot_store.save(s) is True
    assert await snapshot_store.load(s.ref) == s
    assert await snapshot_store.load(ref("o-1", tenant="t2")) is None
    assert await snapshot_store.load(ref("o-1", aggregate="cart")) is None


async def test_decimals_round_trip_exactly(snapshot_store: Any) -> None:
    amounts = {
        "price": Decimal("19.90"),
        "tiny": Decimal("-0.000001"),
        "big": Decimal("1234567890123456789012345.678901234"),
        "nested": [{"tax": Decimal("0.1")}, Decimal("3")],
        "float": 0.5,
    }
    s = snap(ref("o-dec"), 1, state=amounts)
    assert await snapshot_store.save(s)
    loaded = await snapshot_store.load(s.ref)
    assert loaded is not None
    state = loaded.state
    assert state == amounts
    assert isinstance(state["price"], Decimal) and str(state["price"]) == "19.90"
    assert str(state["big"]) == "1234567890123456789012345.678901234"
    assert isinstance(state["nested"][0]["tax"], Decimal) and state["nested"][0]["tax"] == Decimal("0.1")
    assert isinstance(state["float"], float)


async def test_save_writes_only_a_higher_version(snapshot_store: Any) -> None:
    r = ref("o-1")
    assert await snapshot_store.save(snap(r, 5)) is True
    assert await snapshot_store.save(snap(r, 3)) is False
    assert await snapshot_store.save(snap(r, 5, state={"other": 1})) is False
    loaded = await snapshot_store.load(r)
    assert loaded is not None and loaded.version == 5 and loaded.state == {"v": 5, "items": [5]}
    assert await snapshot_store.save(snap(r, 6)) is True
    assert (await snapshot_store.load(r)).version == 6


async def test_concurrent_saves_leave_the_highest_version(snapshot_store: Any) -> None:
    r = ref("o-race")
    versions = list(range(1, 41))
    random.Random(7).shuffle(versions)
    results: dict[int, bool] = {}

    async def save(v: int) -> None:
        results[v] = await snapshot_store.save(snap(r, v))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for v in versions:
                tg.start_soon(save, v)
    loaded = await snapshot_store.load(r)
    assert loaded is not None and loaded.version == 40 and loaded.state["v"] == 40
    assert results[40] is True


async def test_a_lower_state_revision_is_refused_and_marks_the_snapshot_stale(snapshot_store: Any) -> None:
    r = ref("o-1")
    assert await snapshot_store.save(snap(r, 5, state_revision=2))
    # an old reducer (revision 1) at a later version: refused, the stored snapshot is now behind
    assert await snapshot_store.save(snap(r, 7, state_revision=1)) is False
    loaded = await snapshot_store.load(r)
    assert loaded is not None
    assert (loaded.version, loaded.state_revision, loaded.stale_version) == (5, 2, 7)
    # a save of the new revision catching up clears the mark
    assert await snapshot_store.save(snap(r, 8, state_revision=2)) is True
    loaded = await snapshot_store.load(r)
    assert loaded is not None and (loaded.version, loaded.stale_version) == (8, None)
    # a higher state revision is admitted at a higher version
    assert await snapshot_store.save(snap(r, 9, state_revision=3)) is True


async def test_mark_stale(snapshot_store: Any) -> None:
    r = ref("o-1")
    assert await snapshot_store.mark_stale(r) is False
    await snapshot_store.save(snap(r, 5))
    assert await snapshot_store.mark_stale(r) is True
    assert (await snapshot_store.load(r)).stale_version == 6
    assert await snapshot_store.mark_stale(r) is True
    assert (await snapshot_store.load(r)).stale_version == 6
    await snapshot_store.save(snap(r, 9, state_revision=2))
    await snapshot_store.save(snap(r, 12, state_revision=1))  # refused: stale at 12
    assert await snapshot_store.mark_stale(r) is True
    assert (await snapshot_store.load(r)).stale_version == 12  # already later than 9 + 1


async def test_save_all_reports_an_outcome_per_snapshot_in_order(snapshot_store: Any) -> None:
    a, b, c, d, e = (ref(x) for x in "abcde")
    cart = ref("a", aggregate="cart")
    await snapshot_store.save(snap(d, 5))
    await snapshot_store.save(snap(e, 5, state_revision=2))
    batch = [
        snap(a, 1),
        snap(b, 1, state={"bad": {1, 2}}),  # a set: not storable
        snap(c, 1),
        snap(a, 2),  # a second snapshot of one aggregate in the batch
        snap(d, 4),  # the stored one is later
        snap(cart, 1),  # another aggregate type, same id
        snap(e, 6, state_revision=1),  # a lower state revision: refused, marks stale
        snap(a, 3),
    ]
    outcomes = await snapshot_store.save_all(batch)
    assert [(o.ref, o.version, o.status) for o in outcomes] == [
        (a, 1, "saved"),
        (b, 1, "failed"),
        (c, 1, "saved"),
        (a, 2, "saved"),
        (d, 4, "unchanged"),
        (cart, 1, "saved"),
        (e, 6, "unchanged"),
        (a, 3, "saved"),
    ]
    assert outcomes[1].reason
    assert (await snapshot_store.load(a)).version == 3
    assert await snapshot_store.load(b) is None
    assert (await snapshot_store.load(c)).version == 1
    assert (await snapshot_store.load(d)).version == 5
    assert (await snapshot_store.load(cart)).version == 1
    assert (await snapshot_store.load(e)).stale_version == 6
    assert await snapshot_store.save_all([]) == []


async def test_load_many_answers_what_load_answers_for_each_stored_ref(snapshot_store: Any) -> None:
    order, same_id_other_tenant, cart_same_id = ref("o-1"), ref("o-1", tenant="t2"), ref("o-1", aggregate="cart")
    stale, deleted = ref("o-stale"), ref("o-gone")
    await snapshot_store.save_all(
        [
            snap(order, 4, state_revision=2, owner_id="u1", space_id="s1", tags=("a", "b"), access_version=3),
            snap(same_id_other_tenant, 2, state={"price": Decimal("19.90")}),
            snap(cart_same_id, 7),
            snap(stale, 3),
            snap(deleted, 5, deleted=True),
        ]
    )
    await snapshot_store.mark_stale(stale)
    missing = [ref("o-none"), ref("o-1", tenant="t9"), ref("o-1", aggregate="user")]
    asked = [order, *missing, same_id_other_tenant, cart_same_id, stale, deleted, order]  # order twice
    got = await snapshot_store.load_many(asked)
    stored = [order, same_id_other_tenant, cart_same_id, stale, deleted]
    assert got == {r: await snapshot_store.load(r) for r in stored}
    assert got[same_id_other_tenant].state == {"price": Decimal("19.90")}
    assert got[stale].stale_version == 4 and got[deleted].deleted is True
    assert await snapshot_store.load_many([]) == {}
    assert await snapshot_store.load_many(missing) == {}


async def test_load_many_reads_a_whole_feed_batch(snapshot_store: Any) -> None:
    refs = [ref(f"o-{i}", tenant=f"t{i % 3}") for i in range(600)]
    await snapshot_store.save_all([snap(r, 1 + i % 5) for i, r in enumerate(refs) if i % 4])
    got = await snapshot_store.load_many([*refs, *refs[:50]])
    assert set(got) == {r for i, r in enumerate(refs) if i % 4}
    assert all(got[r].version == 1 + i % 5 for i, r in enumerate(refs) if i % 4)


async def test_load_many_refuses_a_ref_of_another_context(snapshot_store: Any) -> None:
    from wowd.errors import InvalidInput

    other = AggregateRef(context="other", aggregate="order", id="o-1", tenant_id="t1")
    with pytest.raises(InvalidInput):
        await snapshot_store.load_many([ref("o-1"), other])
