"""SnapshotRebuildStore contract: the claimed state revision of each type, the snapshots pending a
rebuild, and a rebuilt snapshot rewritten in place."""

from __future__ import annotations

import pytest

from tests.contract.conftest import CONTEXT
from tests.contract.test_snapshots import TYPE, ref, snap
from wowd.model import AggregateRef, AggregateType
from wowd.stores.base import SnapshotRebuildStore, SnapshotStore

pytestmark = pytest.mark.anyio


async def test_claim_mark_and_table(snapshot_store: SnapshotStore, snapshot_rebuilds: SnapshotRebuildStore) -> None:
    assert await snapshot_rebuilds.table(TYPE) is None
    t = await snapshot_rebuilds.claim(TYPE, 2)
    assert (t.type, t.revision, t.rebuilding, t.backfilled) == (TYPE, 2, False, False)
    assert (await snapshot_rebuilds.claim(TYPE, 1)).revision == 2  # a lower revision is not claimed
    assert (await snapshot_rebuilds.claim(TYPE, 2)).revision == 2
    # flags only for the claimed revision
    assert await snapshot_rebuilds.mark(TYPE, 1, rebuilding=True) is None
    t = await snapshot_rebuilds.mark(TYPE, 2, rebuilding=True)
    assert t is not None and (t.revision, t.rebuilding, t.backfilled) == (2, True, False)
    t = await snapshot_rebuilds.mark(TYPE, 2, backfilled=True)
    assert t is not None and (t.rebuilding, t.backfilled) == (True, True)
    t = await snapshot_rebuilds.mark(TYPE, 2, rebuilding=False)
    assert t is not None and (t.rebuilding, t.backfilled) == (False, True)
    stored = await snapshot_rebuilds.table(TYPE)
    assert stored is not None and (stored.revision, stored.rebuilding, stored.backfilled) == (2, False, True)
    # a new revision is claimed afresh
    t = await snapshot_rebuilds.claim(TYPE, 3)
    assert (t.revision, t.rebuilding, t.backfilled) == (3, False, False)
    assert (await snapshot_rebuilds.claim(TYPE, 1, lower=True)).revision == 1
    other = AggregateType(context=CONTEXT, aggregate="cart")
    assert await snapshot_rebuilds.table(other) is None


async def test_pending_pages_through_older_state_revisions_in_key_order(
    snapshot_store: SnapshotStore, snapshot_rebuilds: SnapshotRebuildStore
) -> None:
    keys = [("t2", "a"), ("t1", "b"), ("t1", "a"), ("t1", "c"), ("t3", "z"), ("t1", "aa")]
    for i, (tenant, id) in enumerate(keys):
        await snapshot_store.save(snap(ref(id, tenant), 1, state_revision=1 if i % 3 else 2))
    await snapshot_store.save(snap(ref("a", "t1", aggregate="cart"), 1, state_revision=1))  # other type
    expected = sorted((t, i) for n, (t, i) in enumerate(keys) if n % 3)
    got = await snapshot_rebuilds.pending(TYPE, 2, None, 100)
    assert [(r.tenant_id, r.id) for r in got] == expected
    assert all(r.type == TYPE for r in got)
    paged: list[AggregateRef] = []
    after = None
    while page := await snapshot_rebuilds.pending(TYPE, 2, after, 1):
        paged += page
        after = page[-1]
    assert paged == got
    assert len(await snapshot_rebuilds.pending(TYPE, 3, None, 100)) == len(keys)
    assert await snapshot_rebuilds.pending(TYPE, 1, None, 100) == []


async def test_rewrite_replaces_an_older_state_revision_and_clears_the_stale_mark(
    snapshot_store: SnapshotStore, snapshot_rebuilds: SnapshotRebuildStore
) -> None:
    r = ref("o-1")
    await snapshot_store.save(snap(r, 5, state_revision=1))
    await snapshot_store.mark_stale(r)
    assert await snapshot_rebuilds.rewrite(snap(r, 4, state_revision=2)) is False  # behind the stored version
    assert await snapshot_rebuilds.rewrite(snap(r, 5, state_revision=2, state={"rebuilt": True})) is True
    loaded = await snapshot_store.load(r)
    assert loaded is not None
    assert (loaded.version, loaded.state_revision, loaded.state, loaded.stale_version) == (
        5,
        2,
        {"rebuilt": True},
        None,
    )
    assert await snapshot_rebuilds.rewrite(snap(r, 5, state_revision=2)) is False  # same revision, same version
    assert await snapshot_rebuilds.rewrite(snap(r, 9, state_revision=1)) is False  # lower revision
    assert await snapshot_rebuilds.rewrite(snap(r, 6, state_revision=2)) is True  # same revision, later version
    assert (await snapshot_store.load(r)).version == 6
