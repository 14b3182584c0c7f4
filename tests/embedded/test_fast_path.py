"""The embedded outbox shortcut (``EmbeddedTimerFiring.fire_into_outbox``): the due timers read,
written to the outbox table of the same file and settled as fired in one transaction, with no
claim. Held to what ``claim_due``, the outbox gateway's ``send_batch`` and a fired ``settle`` do."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.embedded.test_firing_path import CTX, T0, by_due, populate, timer
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.daemon.timer_plan import next_occurrence
from wowd.delivery import target_of
from wowd.delivery.outbox import outbox_entry
from wowd.errors import LeaseLost, StorageError
from wowd.model import (
    AggregateRef,
    Claim,
    CronRule,
    IntervalRule,
    OnceRule,
    OutboxEntry,
    Timer,
    TimerChange,
    TimerStatus,
)
from wowd.stores.base import FiredTimer, OutboxRound
from wowd.stores.embedded.outbox import EmbeddedOutbox, entry_row
from wowd.stores.embedded.schema import timer_table
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_firing import outbox_row
from wowd.stores.embedded.timer_rows import timer_params

pytestmark = pytest.mark.anyio

PARTS = 8
ALL = frozenset(range(PARTS))


@dataclass
class File:
    path: Path
    timers: EmbeddedTimers
    outbox: EmbeddedOutbox


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[File]:
    path = tmp_path / "wowd.db"
    f = File(path, embedded_timers(path, context=CTX, partitions=PARTS), EmbeddedOutbox(path))
    await f.outbox.prepare()
    try:
        yield f
    finally:
        await f.timers.close()
        await f.outbox.close()


async def fire(
    store: EmbeddedTimers,
    at: int,
    limit: int = 1000,
    *,
    parts: frozenset[int] = ALL,
    fence: int = 5,
    owner_key: str = "me",
    exclude: Collection[str] = (),
    deadline: float | None = None,
) -> list[FiredTimer]:
    """An outbox round of the timers due by ``at``, the feed's watermark past them (no question
    to the log)."""
    done = await store.firing.fire_into_outbox(
        OutboxRound(
            partitions=parts,
            at=at,
            read_to=at,
            limit=limit,
            owner_key=owner_key,
            fence=fence,
            next_due=next_occurrence,
            exclude=exclude,
            deadline=deadline,
        )
    )
    assert done.left == 0
    return done.fired


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql).fetchall()


async def test_it_fires_the_timers_claim_due_would_claim_in_the_same_order(tmp_path: Path) -> None:
    """Two files populated alike (PENDING timers, claims expiring at various times, parked and
    failed ones): per round, the outbox round fires exactly the timers ``claim_due`` claims on
    the other, in due order, each answered as read; ``exclude`` is neither fired nor counted."""
    stores = [embedded_timers(tmp_path / f"{n}.db", context=CTX, partitions=PARTS) for n in ("a", "b")]
    claiming, firing = stores
    live = await populate(claiming, PARTS, 300, seed=3)
    assert await populate(firing, PARTS, 300, seed=3) == live
    rng = random.Random(11)
    fired: dict[str, Timer] = {}
    for _ in range(10):
        parts = frozenset(rng.sample(range(PARTS), rng.randrange(1, PARTS + 1)))
        until, limit = T0 + rng.randrange(200), rng.randrange(1, 40)
        exclude = {t.timer_id for t in rng.sample(sorted(live.values(), key=lambda t: t.timer_id), 5)}
        claimed = await claiming.firing.claim_due(
            parts, until, limit, owner_key="me", fence=5, claim_until=T0 + 10**9, exclude=exclude
        )
        answered = await fire(firing, until, limit, parts=parts, exclude=exclude)
        assert answered == [FiredTimer(t.timer_id, target_of(t), t.scheduled_at, None) for t in claimed]
        assert not exclude & {f.timer_id for f in answered}
        fired.update((t.timer_id, t) for t in claimed)
    assert fired, "the rounds fired something"
    rest = by_due(t for t in live.values() if t.due_at <= T0 + 200 and t.timer_id not in fired)
    assert await firing.firing.due(ALL, T0 + 200, 1000) == rest
    for s in stores:
        await s.close()


async def test_outbox_rows_and_tombstones_are_written_together(db: File) -> None:
    """Each fired timer's outbox entry is the gateway's (request id, target, command, scheduled
    time, the firer's fence and owner key); each one-shot timer is a DONE tombstone, so a replay
    of its put is refused (the view's contract) and it never comes due again."""
    ts = [timer(f"o-{i}", PARTS, due_at=T0 + i, aggregate=("order", "cart")[i % 2]) for i in range(30)]
    for t in ts:
        assert await db.timers.view.put(t)
    fired = await fire(db.timers, T0 + 200)
    assert fired == [FiredTimer(t.timer_id, target_of(t), t.scheduled_at, None) for t in by_due(ts)]
    assert await db.outbox.entries() == [
        OutboxEntry(
            request_id=t.request_id,
            timer_id=t.timer_id,
            target=t.target,
            command=t.body,
            scheduled_at=t.scheduled_at,
            fence=5,
            owner_key="me",
            created_at=T0 + 200,
        )
        for t in by_due(ts)
    ]
    stored = rows(
        db.path, f"SELECT DISTINCT status, claim_owner_key, claim_fence, claim_until, revision FROM {timer_table(CTX)}"
    )
    assert stored == [("DONE", None, None, None, 1)]
    assert await db.timers.queries.scan(limit=100) == []
    for t in ts:
        assert await db.timers.view.put(t) is False  # the log replayed: nothing comes back
    assert await db.timers.firing.due(ALL, T0 + 10**9, 100) == []
    assert await fire(db.timers, T0 + 10**9) == []
    assert await db.outbox.count() == 30


async def test_a_round_that_fails_leaves_neither_outbox_rows_nor_tombstones(db: File) -> None:
    ts = [timer(f"o-{i}", PARTS, due_at=T0) for i in range(10)]
    for t in ts:
        assert await db.timers.view.put(t)
    with sqlite3.connect(db.path) as conn:  # the settle of one timer fails after the outbox insert
        conn.execute(
            f"CREATE TRIGGER boom BEFORE UPDATE OF status ON {timer_table(CTX)}"
            " WHEN NEW.status = 'DONE' AND OLD.owner_id = 'o-7' BEGIN SELECT RAISE(ABORT, 'boom'); END"
        )
    with pytest.raises(StorageError, match="boom"):
        await fire(db.timers, T0)
    assert await db.outbox.count() == 0
    assert await db.timers.firing.due(ALL, T0, 100) == by_due(ts)
    # the lease lapsed before the round could commit: nothing of it either
    with sqlite3.connect(db.path) as conn:
        conn.execute("DROP TRIGGER boom")
    with pytest.raises(LeaseLost):
        await fire(db.timers, T0, deadline=time.monotonic())
    assert await db.outbox.count() == 0
    assert await db.timers.firing.due(ALL, T0, 100) == by_due(ts)
    assert len(await fire(db.timers, T0, deadline=time.monotonic() + 60)) == 10
    assert await db.outbox.count() == 10 and await db.timers.firing.due(ALL, T0, 100) == []


async def test_another_holders_claim_is_respected_until_it_expires(db: File) -> None:
    mine, theirs = timer("mine", PARTS, due_at=T0), timer("theirs", PARTS, due_at=T0)
    for t in (mine, theirs):
        assert await db.timers.view.put(t)
    [claimed] = await db.timers.firing.claim_due(
        ALL, T0, 1, owner_key="other", fence=9, claim_until=T0 + 30_000, exclude={mine.timer_id}
    )
    assert claimed.timer_id == theirs.timer_id
    assert [f.timer_id for f in await fire(db.timers, T0 + 29_999)] == [mine.timer_id]
    # its claim expired (the other replica died): due again, fired under this fence
    assert await fire(db.timers, T0 + 30_000) == [FiredTimer(theirs.timer_id, target_of(theirs), T0, None)]
    entries = {e.timer_id: e for e in await db.outbox.entries()}
    assert (entries[theirs.timer_id].fence, entries[theirs.timer_id].owner_key) == (5, "me")
    assert entries[theirs.timer_id].request_id == theirs.request_id
    assert await db.timers.queries.scan(limit=10) == []


async def test_a_recurring_timer_moves_to_its_next_occurrence(db: File) -> None:
    """As a fired ``settle`` writes it: PENDING at the next occurrence (past ones coalesced),
    ``fired + 1``, attempts and error reset, no claim; a rule with no more occurrences leaves a
    DONE tombstone. The entry is the occurrence that fired."""
    every = replace(timer("every", PARTS, due_at=T0), rule=IntervalRule(every_ms=1000))
    ending = replace(timer("ending", PARTS, due_at=T0), rule=IntervalRule(every_ms=1000, until=T0 + 500))
    cron = replace(timer("cron", PARTS, due_at=T0), rule=CronRule(expression="*/5 * * * *"))
    for t in (every, ending, cron):
        assert await db.timers.view.put(t)
    # a failed attempt first: attempts 1, an error, a claim's fence left behind
    claimed = await db.timers.firing.claim_due({every.partition}, T0, 10, owner_key="x", fence=2, claim_until=T0 + 10)
    retry = [TimerChange.retry(t, fence=2, due_at=T0, error="HTTP 503") for t in claimed if t.key == every.key]
    others = [TimerChange.release(t, fence=2, due_at=T0, reason="stopped") for t in claimed if t not in retry]
    assert await db.timers.firing.settle([*retry, *others]) == len(claimed)
    loaded = {t.owner.id: t for t in await db.timers.firing.due(ALL, T0, 10)}
    assert loaded["every"].attempts == 1 and loaded["every"].last_error == "HTTP 503"
    at = T0 + 2_500
    ids = {t.timer_id: name for name, t in loaded.items()}
    fired = {ids[f.timer_id]: f.next_due for f in await fire(db.timers, at)}
    assert fired == {"every": T0 + 3_000, "ending": None, "cron": next_occurrence(loaded["cron"], at)}
    for name, nxt in fired.items():
        t = loaded[name]
        assert await db.timers.queries.find(t.owner, t.key) == TimerChange.fired(t, fence=5, next_due=nxt).applied()
    after = await db.timers.queries.find(every.owner, every.key)
    assert after is not None and (after.status, after.attempts, after.last_error, after.fired) == (
        TimerStatus.PENDING,
        0,
        None,
        1,
    )
    assert {e.timer_id: e.scheduled_at for e in await db.outbox.entries()} == {
        t.timer_id: T0 for t in (every, ending, cron)
    }
    assert rows(db.path, f"SELECT status FROM {timer_table(CTX)} WHERE owner_id = 'ending'") == [("DONE",)]


async def test_a_request_id_in_the_outbox_already_is_a_redelivery(db: File) -> None:
    """A re-fire (delivered, then a crash before the settle): recorded as a re-delivery, the
    first entry kept, and the timer settled with its batch mates."""
    first, second = timer("first", PARTS, due_at=T0), timer("second", PARTS, due_at=T0)
    for t in (first, second):
        assert await db.timers.view.put(t)
    old = outbox_entry(replace(first, claim=Claim(owner_key="dead", fence=4, until=T0)), T0 - 5)
    assert await db.outbox.put(old)
    assert len(await fire(db.timers, T0)) == 2
    entries = {e.request_id: e for e in await db.outbox.entries()}
    assert entries[first.request_id] == old and entries[second.request_id].owner_key == "me"
    assert rows(db.path, "SELECT request_id, fence, owner_key FROM outbox_redelivery") == [(first.request_id, 5, "me")]
    assert await db.timers.queries.scan(limit=10) == []


async def test_a_round_of_one_fires_the_earliest_due_timer(db: File) -> None:
    ts = [timer(f"o-{i}", PARTS, due_at=T0 + i) for i in range(3)]
    for t in ts:
        assert await db.timers.view.put(t)
    assert [f.timer_id for f in await fire(db.timers, T0 + 10, limit=1)] == [ts[0].timer_id]
    assert await db.outbox.count() == 1


async def test_a_timer_that_cannot_be_fired_is_failed_alone(db: File) -> None:
    ts = [timer(f"o-{i}", PARTS, due_at=T0) for i in range(4)]
    for t in ts:
        assert await db.timers.view.put(t)
    with sqlite3.connect(db.path) as conn:
        conn.execute(
            f"UPDATE {timer_table(CTX)} SET rule = ? WHERE owner_id = 'o-2'",
            ('{"expression":"* * * * *","type":"cron","zone":"Europe/Gone"}',),
        )
    fired = await fire(db.timers, T0)
    assert sorted(f.timer_id for f in fired) == sorted(t.timer_id for t in ts if t.owner.id != "o-2")
    assert await db.outbox.count() == 3
    [failed] = await db.timers.queries.scan(status=TimerStatus.FAILED, limit=10)
    assert failed.owner.id == "o-2" and failed.last_error is not None and "Europe/Gone" in failed.last_error


async def test_the_outbox_table_is_created_when_missing(tmp_path: Path) -> None:
    store = embedded_timers(tmp_path / "wowd.db", context=CTX, partitions=PARTS)
    assert await store.view.put(timer("o", PARTS, due_at=T0))
    assert len(await fire(store, T0)) == 1
    box = EmbeddedOutbox(tmp_path / "wowd.db")
    assert [e.timer_id for e in await box.entries()] == [timer("o", PARTS, due_at=T0).timer_id]
    await store.close()
    await box.close()


@pytest.mark.parametrize(
    "target",
    [
        AggregateRef(context="billing", aggregate="invoice", id="inv-1"),
        AggregateRef(context="billing", aggregate="invoice", tenant_id='t\u00e9"n', id='\u805a\u5408\u6839 "\\ 😀'),
    ],
)
def test_an_outbox_row_is_the_row_of_the_gateways_entry(target: AggregateRef) -> None:
    t = replace(timer("o", PARTS, due_at=T0), target=target, claim=Claim(owner_key="k\u00e9y", fence=8, until=T0))
    assert outbox_row((*timer_params(t), 17), 8, "k\u00e9y", T0 + 3) == entry_row(outbox_entry(t, T0 + 3))


async def test_an_occurrence_past_its_misfire_grace_is_settled_with_no_outbox_entry(db: File) -> None:
    """The outbox round fires late (a backlog after a restart): an occurrence later than its rule's
    misfire grace is settled as passed (a one-shot timer done, a recurring one at its next
    occurrence) in the same transaction, with no outbox entry; the others are delivered."""
    graced_once = replace(timer("graced-once", PARTS, due_at=T0), rule=OnceRule(misfire_grace_ms=1_000))
    graced_every = replace(
        timer("graced-every", PARTS, due_at=T0), rule=IntervalRule(every_ms=10_000, misfire_grace_ms=1_000)
    )
    within = replace(timer("within", PARTS, due_at=T0), rule=OnceRule(misfire_grace_ms=60_000))
    plain = timer("plain", PARTS, due_at=T0)
    for t in (graced_once, graced_every, within, plain):
        assert await db.timers.view.put(t)
    fired = {f.timer_id: f for f in await fire(db.timers, T0 + 5_000)}
    assert {t.owner.id for t in (graced_once, graced_every) if fired[t.timer_id].misfired} == {
        "graced-once",
        "graced-every",
    }
    assert not fired[within.timer_id].misfired and not fired[plain.timer_id].misfired
    delivered = {e.timer_id for e in await db.outbox.entries()}
    assert delivered == {within.timer_id, plain.timer_id}
    assert await db.timers.queries.find(graced_once.owner, graced_once.key) is None  # done
    moved = await db.timers.queries.find(graced_every.owner, graced_every.key)
    assert moved is not None and moved.status is TimerStatus.PENDING and moved.scheduled_at == T0 + 10_000


async def test_an_outbox_round_records_the_attempt_with_any_retention_within_the_schemas_time(db: File) -> None:
    # a retention as long as a setting allows: the attempt's expiry is held at the schema's last
    # millisecond, as every other record of the history is
    from wowd.model.history import EXPIRY_MAX_MS
    from wowd.stores.embedded.history import EmbeddedTimerHistory

    t = timer("h-1", PARTS, due_at=T0)
    assert await db.timers.view.put(t)
    history = EmbeddedTimerHistory(db.path, context=CTX)
    try:
        done = await db.timers.firing.fire_into_outbox(
            OutboxRound(partitions=ALL, at=T0, read_to=T0, limit=10, owner_key="me", fence=5,
                        next_due=next_occurrence, history_retention_ms=2**63 - 1)
        )  # fmt: skip
        assert [f.timer_id for f in done.fired] == [t.timer_id]
        [attempt] = await history.of_timer(t.timer_id)
        assert attempt.outcome == "delivered" and attempt.expires_at == EXPIRY_MAX_MS
    finally:
        await history.close()
