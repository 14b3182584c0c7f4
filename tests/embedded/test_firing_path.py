"""The firing path on the embedded store: the combined claim, the compound due read, the outbox
batch insert. Each fast path is held to what the plain one does."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

import anyio
import pytest
from prometheus_client import REGISTRY

from tests.helpers import caught_up_waker, held_slot, timer_loop
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.config import TimerSettings
from wowd.delivery import OutboxGateway
from wowd.errors import InvalidInput
from wowd.model import (
    AggregateRef,
    Claim,
    Command,
    CronRule,
    IntervalRule,
    OnceRule,
    OutboxEntry,
    Timer,
    TimerChange,
    TimerStatus,
    deterministic_timer_id,
    partition,
)
from wowd.stores.embedded.db import SqliteDatabase, file_write_lock
from wowd.stores.embedded.outbox import EmbeddedOutbox, _target_json
from wowd.stores.embedded.schema import timer_table
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_firing import DUE_ARMS, SETTLE_SET, EmbeddedTimerFiring, due_union_sql
from wowd.stores.embedded.timer_rows import timer_from_row, timer_params

pytestmark = pytest.mark.anyio

CTX = "ctx"
T0 = 1_700_000_000_000
TYPES = ("order", "cart", "invoice")


def timer(id: str, n: int, *, due_at: int, aggregate: str = "order", tenant: str = "(0)") -> Timer:
    owner = AggregateRef(context=CTX, aggregate=aggregate, tenant_id=tenant, id=id)
    return Timer(
        timer_id=deterministic_timer_id(owner, "k", 1),
        partition=partition(id, n),
        owner=owner,
        key="k",
        version=1,
        due_at=due_at,
        scheduled_at=due_at,
        target=AggregateRef(context="billing", aggregate="invoice", id=f"inv-{id}"),
        body=Command(name="Remind", body={"id": id}).to_json(),
        rule=OnceRule(),
    )


async def populate(store: EmbeddedTimers, n: int, count: int, seed: int) -> dict[str, Timer]:
    """``count`` timers: PENDING (most), claimed (some claims expired, some not), parked, failed.
    Answers the ones ``due`` may answer (PENDING or FIRING), as stored."""
    rng = random.Random(seed)
    live: dict[str, Timer] = {}
    for i in range(count):
        t = timer(f"t-{i}", n, due_at=T0 + rng.randrange(100), aggregate=rng.choice(TYPES))
        assert await store.view.put(t)
        kind = rng.choice(("pending", "pending", "pending", "claim", "park", "fail"))
        if kind == "pending":
            live[t.timer_id] = t
            continue
        if kind == "claim":
            change = TimerChange.claim(t, owner_key="old", fence=1, until=T0 + rng.randrange(200))
        else:
            change = getattr(TimerChange, kind)(t, fence=1, reason="r")
        assert await store.firing.settle([change]) == 1
        after = change.applied()
        if kind == "claim" and after is not None:
            live[t.timer_id] = after
    return live


def by_due(timers: Any) -> list[Timer]:
    return sorted(timers, key=lambda t: (t.due_at, t.timer_id))


# --------------------------------------------------------------------------- due and claim_due


@pytest.mark.parametrize("partitions", [8, DUE_ARMS * 2 + 5])
async def test_due_and_claim_due_answer_what_a_model_of_the_store_does(tmp_path: Path, partitions: int) -> None:
    """``due`` over one compound statement (<= DUE_ARMS partitions) or several merged, and
    ``claim_due``: the same timers, in ``(due_at, timer_id)`` order; ``claim_due`` answers and
    stores exactly ``TimerChange.claim(t, ...).applied()`` of each."""
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=partitions)
    live = await populate(store, partitions, 300, seed=partitions)
    rng = random.Random(5)
    for _ in range(12):
        parts = set(rng.sample(range(partitions), rng.randrange(1, partitions + 1)))
        until, limit = T0 + rng.randrange(200), rng.randrange(1, 120)
        expected = by_due(t for t in live.values() if t.partition in parts and t.due_at <= until)[:limit]
        assert await store.firing.due(parts, until, limit) == expected
    parts = set(range(partitions))
    until = T0 + 150
    due = await store.firing.due(parts, until, 70)
    assert len(due) == 70
    claimed = await store.firing.claim_due(parts, until, 70, owner_key="me", fence=7, claim_until=T0 + 10_000)
    assert claimed == [TimerChange.claim(t, owner_key="me", fence=7, until=T0 + 10_000).applied() for t in due]
    for t in claimed:
        assert await store.queries.find(t.owner, t.key) == t
    # a change made against a timer as loaded before the claim is skipped: it moved on
    assert await store.firing.settle([TimerChange.fired(due[0], fence=1, next_due=None)]) == 0
    # the claimed ones are no longer due before their claim expires; the next read goes on
    rest = by_due(t for t in live.values() if t.due_at <= until and t.timer_id not in {c.timer_id for c in due})
    assert await store.firing.due(parts, until, 1000) == rest
    assert await store.firing.claim_due(parts, until, 0, owner_key="me", fence=7, claim_until=T0) == []
    assert await store.firing.claim_due(set(), until, 10, owner_key="me", fence=7, claim_until=T0) == []
    await store.close()


async def test_a_claim_sets_a_row_it_cannot_read_failed_naming_why_and_claims_the_others(tmp_path: Path) -> None:
    """A timer row the store cannot decode (a rule that is no JSON) stops no claim: it is set
    FAILED with the reason, and the timers after it in due order are claimed."""
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=4)
    ts = [timer(f"o-{i}", 4, due_at=T0 + i) for i in range(4)]
    for t in ts:
        assert await store.view.put(t)
    with sqlite3.connect(tmp_path / "wowd.db") as conn:
        conn.execute(f"UPDATE {timer_table(CTX)} SET rule = '{{not json' WHERE owner_id = 'o-1'")
    failed_before = REGISTRY.get_sample_value("wowd_timers_failed_total", {"target": "billing.invoice"}) or 0.0
    claimed = await store.firing.claim_due(set(range(4)), T0 + 10, 10, owner_key="me", fence=7, claim_until=T0 + 9_000)
    assert [t.owner.id for t in claimed] == ["o-0", "o-2", "o-3"]
    with sqlite3.connect(tmp_path / "wowd.db") as conn:
        ((status, error),) = conn.execute(
            f"SELECT status, last_error FROM {timer_table(CTX)} WHERE owner_id = 'o-1'"
        ).fetchall()
    assert status == "FAILED" and str(error).startswith("undecodable timer: ")
    failed = REGISTRY.get_sample_value("wowd_timers_failed_total", {"target": "billing.invoice"}) or 0.0
    assert failed == failed_before + 1
    await store.close()


async def test_a_settle_of_another_contexts_timer_is_refused_naming_the_field(tmp_path: Path) -> None:
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=4)
    t = timer("o-0", 4, due_at=T0)
    assert await store.view.put(t)
    other = replace(t, owner=replace(t.owner, context="other"))
    with pytest.raises(InvalidInput, match="not of this store's context") as refused:
        await store.firing.settle([TimerChange.fired(other, fence=1, next_due=None)])
    assert refused.value.field == "owner.context"
    assert await store.queries.find(t.owner, t.key) == t  # nothing written
    await store.close()


async def test_a_claimed_timer_settles_as_one_claimed_by_settle(tmp_path: Path) -> None:
    """Every later change (fired of a recurring timer, retry, park) applies to a timer answered
    by ``claim_due`` as to one claimed through ``settle``."""
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=4)
    ts = [replace(timer(f"s-{i}", 4, due_at=T0), rule=IntervalRule(every_ms=1000)) for i in range(3)]
    for t in ts:
        assert await store.view.put(t)
    claimed = await store.firing.claim_due({0, 1, 2, 3}, T0, 10, owner_key="me", fence=2, claim_until=T0 + 500)
    assert {t.timer_id for t in claimed} == {t.timer_id for t in ts}
    a, b, c = claimed
    changes = [
        TimerChange.fired(a, fence=2, next_due=T0 + 1000),
        TimerChange.retry(b, fence=2, due_at=T0 + 50, error="HTTP 503"),
        TimerChange.park(c, fence=2, reason="HTTP 404"),
    ]
    assert await store.firing.settle(changes) == 3
    for ch in changes:
        stored = await store.queries.find(ch.timer.owner, ch.timer.key)
        assert stored == ch.applied()
    await store.close()


SETTLES: dict[str, Any] = {
    "claim": lambda t: TimerChange.claim(t, owner_key="me", fence=3, until=T0 + 900),
    "fired": lambda t: TimerChange.fired(t, fence=3, next_due=T0 + 5_000),
    "done": lambda t: TimerChange.fired(t, fence=3, next_due=None),
    "retry": lambda t: TimerChange.retry(t, fence=3, due_at=T0 + 70, error="HTTP 503"),
    "release": lambda t: TimerChange.release(t, fence=3, due_at=T0 + 80, reason="stopped"),
    "park": lambda t: TimerChange.park(t, fence=3, reason="HTTP 404"),
    "resume": lambda t: TimerChange.resume(t, due_at=T0 + 90),
    "fail": lambda t: TimerChange.fail(t, fence=3, reason="HTTP 400"),
}
"""One change of each kind the settle statements know (``done``: fired with no next occurrence)."""


async def test_each_settle_statement_stores_what_applied_answers(tmp_path: Path) -> None:
    """The settle statement of every change kind writes exactly the timer ``applied()`` answers
    (every field read back), on a timer with attempts, an error and a claim to carry or reset;
    ``done`` leaves a DONE tombstone out of the view. ``claim_due`` stores what a claim's
    ``applied()`` answers too."""
    assert set(SETTLES) == set(get_args(get_type_hints(TimerChange)["kind"])) | {"done"} == set(SETTLE_SET)
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=4)
    revisions: dict[str, int] = {}
    for kind, make in SETTLES.items():
        t = replace(timer(f"k-{kind}", 4, due_at=T0), rule=IntervalRule(every_ms=1000))
        assert await store.view.put(t)
        claimed = TimerChange.claim(t, owner_key="me", fence=2, until=T0 + 10)
        assert (firing := claimed.applied()) is not None
        failed_once = TimerChange.retry(firing, fence=2, due_at=T0, error="HTTP 502")
        assert (pending := failed_once.applied()) is not None
        assert await store.firing.settle([claimed]) == 1 and await store.firing.settle([failed_once]) == 1
        (loaded,) = await store.firing.claim_due({t.partition}, T0, 10, owner_key="me", fence=2, claim_until=T0 + 20)
        assert loaded == TimerChange.claim(pending, owner_key="me", fence=2, until=T0 + 20).applied()
        assert loaded.attempts == 1 and loaded.last_error == "HTTP 502" and loaded.claim is not None
        if kind == "resume":
            assert await store.firing.settle([TimerChange.park(loaded, fence=2, reason="HTTP 404")]) == 1
            (loaded,) = await store.queries.scan(status=TimerStatus.PARKED, partitions={t.partition})
        change = make(loaded)
        assert await store.firing.settle([change]) == 1
        assert await store.queries.find(t.owner, t.key) == change.applied(), kind
        revisions[kind] = loaded.revision
    with sqlite3.connect(tmp_path / "wowd.db") as conn:
        row = conn.execute(
            f"SELECT status, claim_owner_key, claim_fence, claim_until, revision FROM {timer_table(CTX)}"
            " WHERE \"key\" = 'k' AND owner_id = 'k-done'"
        ).fetchone()
    assert row == ("DONE", None, None, None, revisions["done"] + 1)
    await store.close()


async def test_the_due_read_is_one_merge_over_the_partial_index(tmp_path: Path) -> None:
    """Each arm of the compound statement reads the partial index in order and SQLite merges
    them (no sort of every due timer): the read costs about ``limit`` rows however many are due."""
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=DUE_ARMS)
    await store.prepare()
    sql = due_union_sql(CTX, DUE_ARMS, 10)
    conn = sqlite3.connect(tmp_path / "wowd.db")
    try:
        plan = conn.execute("EXPLAIN QUERY PLAN " + sql, (T0, *range(DUE_ARMS))).fetchall()
    finally:
        conn.close()
    detail = [str(r[-1]) for r in plan]
    assert sum("USING INDEX wow_timer__ctx__due (partition=? AND due_at<?)" in d for d in detail) == DUE_ARMS
    assert any("MERGE" in d for d in detail)
    assert not any("TEMP B-TREE" in d for d in detail)
    await store.close()


def test_rows_decode_into_the_timers_written() -> None:
    """The row decoder (its refs validated once per type) builds timers equal to the constructor's,
    every field read back."""
    base = timer("d-1", 8, due_at=T0, tenant="tenant-ü")
    variants = [
        base,
        replace(base, rule=IntervalRule(every_ms=5, until=T0 + 99), attempts=3, fired=2, revision=9),
        replace(
            base,
            rule=CronRule(expression="*/5 * * * *", zone="Europe/Paris"),
            status=TimerStatus.FIRING,
            claim=Claim(owner_key="me", fence=4, until=T0 + 7),
            last_error="HTTP 503",
        ),
        replace(base, status=TimerStatus.PARKED, last_error="HTTP 404"),
    ]
    for t in variants:
        got = timer_from_row(CTX, timer_params(t))
        assert got == t and repr(got) == repr(t) and hash(got.owner) == hash(t.owner)


# --------------------------------------------------------------------------- the outbox


def entry(i: int, *, fence: int = 1, target_id: str | None = None) -> OutboxEntry:
    target = AggregateRef(context="billing", aggregate="invoice", id=target_id or f"inv-{i}")
    return OutboxEntry(
        request_id=f"rq-{i:05d}",
        timer_id=f"tm-{i}",
        target=target,
        command='{"body":{},"name":"Remind"}',
        scheduled_at=T0 + i,
        fence=fence,
        owner_key="me",
        created_at=T0 + 1000,
    )


async def test_put_many_keeps_order_and_answers_per_entry(tmp_path: Path) -> None:
    """New entries (more than one multi-row statement, with a remainder) go in, in order; a batch
    with request ids already there, or twice in it, answers False for each repeat, records it
    as a re-delivery and inserts only the new ones."""
    box = EmbeddedOutbox(tmp_path / "wowd.db")
    first = [entry(i) for i in range(123)]
    assert await box.put_many(first) == [True] * 123
    assert await box.entries(limit=1000) == first
    again = [entry(5, fence=2), entry(500), entry(123), entry(500, fence=3), entry(0, fence=2)]
    assert await box.put_many(again) == [False, True, True, False, False]
    stored = await box.entries(limit=1000)
    assert stored == [*first, entry(500), entry(123)]
    assert await box.count() == 125
    conn = sqlite3.connect(tmp_path / "wowd.db")
    try:
        redelivered = conn.execute("SELECT request_id, fence FROM outbox_redelivery ORDER BY rowid").fetchall()
    finally:
        conn.close()
    assert redelivered == [("rq-00005", 2), ("rq-00500", 3), ("rq-00000", 2)]
    assert await box.put_many([]) == []
    await box.close()


def test_the_target_is_written_as_json_dumps_writes_it() -> None:
    for id in ("inv-1", 'quo"te\\back', "聚合根", "emoji-😀", "sp ace/sl\u2028ash", ""):
        ref = AggregateRef(context="billing", aggregate="invoice", tenant_id="t-ü", id=id)
        expected = json.dumps(
            {"context": ref.context, "aggregate": ref.aggregate, "tenant_id": ref.tenant_id, "id": ref.id},
            separators=(",", ":"),
        )
        assert _target_json(ref) == expected


def test_writers_of_one_file_share_one_write_lock(tmp_path: Path) -> None:
    a = SqliteDatabase(tmp_path / "wowd.db")
    b = SqliteDatabase(str(tmp_path / "." / "wowd.db"))
    assert file_write_lock(a) is file_write_lock(b)
    assert file_write_lock(a) is not file_write_lock(SqliteDatabase(tmp_path / "other.db"))
    assert file_write_lock(SqliteDatabase(":memory:")) is not file_write_lock(SqliteDatabase(":memory:"))


# --------------------------------------------------------------------------- the loop


class CountingTimers(EmbeddedTimerFiring):
    """The embedded firing store, counting the calls the loop makes."""

    def __init__(self, *args: Any, expect_fired: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()
        self.fired = 0
        self.expect_fired = expect_fired
        self.all_fired = anyio.Event()

    async def due(self, *args: Any, **kwargs: Any) -> list[Timer]:
        self.calls["due"] += 1
        return await super().due(*args, **kwargs)

    async def claim_due(self, *args: Any, **kwargs: Any) -> list[Timer]:
        self.calls["claim_due"] += 1
        return await super().claim_due(*args, **kwargs)

    async def settle(self, *args: Any, **kwargs: Any) -> int:
        self.calls["settle"] += 1
        written = await super().settle(*args, **kwargs)
        self.fired += sum(1 for c in args[0] if c.kind == "fired")
        if self.fired >= self.expect_fired:
            self.all_fired.set()
        return written


async def test_the_loop_claims_with_one_call_per_round_and_fires_each_timer_once(tmp_path: Path) -> None:
    """On the embedded store a round is ``claim_due`` (no ``due``, no claim ``settle``), the
    delivery under the slot's fence and owner key, the outcomes settled in bulk."""
    n, parts = 250, 8
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=parts, firing=CountingTimers, expect_fired=n)
    box = EmbeddedOutbox(tmp_path / "wowd.db")
    now = int(time.time() * 1000)
    timers = [timer(f"l-{i}", parts, due_at=now - 1000 + i, aggregate=TYPES[i % 3]) for i in range(n)]
    for t in timers:
        assert await store.view.put(t)
    held = held_slot(parts, fence=3)
    loop = timer_loop(store.firing, OutboxGateway(box), TimerSettings(batch=100))
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, caught_up_waker())
                await store.firing.all_fired.wait()
                held.request_stop()
        assert await store.queries.scan(limit=10) == []  # every timer settled (fired: deleted)
        entries = await box.entries(limit=1000)
        assert sorted(e.request_id for e in entries) == sorted(t.request_id for t in timers)
        assert {(e.fence, e.owner_key) for e in entries} == {(3, "me")}
        assert store.firing.calls["due"] == 0
        assert store.firing.calls["claim_due"] >= 3  # batches of 100
        # the outcomes in bulk (groups as they come), not one write per timer
        assert 1 <= store.firing.calls["settle"] <= 2 * store.firing.calls["claim_due"]
    finally:
        await store.close()
        await box.close()
