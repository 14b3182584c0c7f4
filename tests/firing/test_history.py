"""The attempts the firing path records in the timer history: each attempt with what the gateway
saw of it (settled as, HTTP status, latency, the answer's first characters, the reason), kept as
long as tombstones are; a history store that is unavailable gets its records with the next settle
group, one that refuses is counted and the timers fire all the same; the outbox shortcut records
its rounds' attempts in its own transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import REGISTRY

from tests.factories import CONTEXT, Recorder, eventually, now_ms, timer
from tests.firing.conftest import PARTS
from tests.helpers import caught_up_waker, firing, held_slot
from tests.timer_stores import EmbeddedTimers, embedded_timers
from wowd.config import EmbeddedSettings, TimerSettings, WowdSettings
from wowd.daemon import firing as firing_module
from wowd.daemon.firing import choose
from wowd.daemon.stream import target_limits
from wowd.delivery import OutboxGateway
from wowd.delivery.outcomes import Delivered, Fail, Outcome
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import HistoryKind, HistoryRecord, OnceRule, Timer, TimerStatus
from wowd.stores.embedded import open_embedded
from wowd.stores.embedded.history import EmbeddedTimerHistory
from wowd.stores.embedded.outbox import EmbeddedOutbox

pytestmark = pytest.mark.anyio

RETENTION_S = 3_600


def unrecorded() -> float:
    return REGISTRY.get_sample_value("wowd_timer_history_unrecorded_total") or 0.0


class History:
    """A timer history keeping what it is given; :attr:`refusals` are raised by the next appends,
    one each."""

    def __init__(self) -> None:
        self.records: list[HistoryRecord] = []
        self.appends: list[int] = []
        self.refusals: list[StorageError] = []
        self.changed = anyio.Event()

    async def append(self, records: Sequence[HistoryRecord]) -> None:
        if self.refusals:
            raise self.refusals.pop(0)
        self.records += records
        self.appends.append(len(records))
        self.changed.set()
        self.changed = anyio.Event()

    async def sweep(self, now: int, limit: int) -> int:
        return 0  # the timer loop's sweep of expired records: nothing expires here

    async def until_recorded(self, n: int) -> None:
        while len(self.records) < n:
            await self.changed.wait()


async def fire(
    store: EmbeddedTimers, gateway: Recorder, history: Any, *groups: list[Timer], expect: int | None = None
) -> None:
    """One slot's claim, deliver and settle loop firing ``groups`` one after the other (each
    stored once the one before was delivered, so that each is a settle group of its own; ``expect``:
    how many of a single group are delivered, when not all)."""
    settings = TimerSettings(tombstone_retention_s=RETENTION_S)
    loop = replace(firing(store.firing, gateway, settings), history=history).loop()
    held, waker = held_slot(PARTS), caught_up_waker()
    fired = 0
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run, held, waker)
            for group in groups:
                for t in group:
                    assert await store.view.put(t)
                    waker.maybe_wake(t.due_at)  # as the feed does after a put
                fired += len(group) if expect is None else expect
                await gateway.until_fired(fired)
                await eventually(partial(settled, store, group), 5, "the group settled")
            held.request_stop()


async def settled(store: EmbeddedTimers, group: list[Timer]) -> bool:
    """Every timer of ``group`` settled after its attempt (done, or failed for good)."""
    for t in group:
        stored = await store.queries.find(t.owner, t.key)
        if stored is not None and (stored.claim is not None or stored.status is not TimerStatus.FAILED):
            return False
    return True


def answers(t: Timer) -> Outcome:
    if t.owner.id == "o-refused":
        return Fail(reason="target answered 400", status=400, latency_ms=7.5, answer='{"error":"no such order"}')
    return Delivered(status=202, latency_ms=3.25, answer="{}")


async def test_each_attempt_is_recorded_with_what_the_gateway_saw(store: EmbeddedTimers) -> None:
    history = History()
    due = now_ms()
    ok, refused = timer("o-ok", due, partitions=PARTS), timer("o-refused", due, partitions=PARTS)
    await fire(store, Recorder(answers), history, [ok, refused])
    with anyio.fail_after(5):
        await history.until_recorded(2)
    by_timer = {r.timer_id: r for r in history.records}
    assert set(by_timer) == {ok.timer_id, refused.timer_id}
    for t, outcome, status, latency, answer, reason in (
        (ok, "delivered", 202, 3.25, "{}", None),
        (refused, "fail", 400, 7.5, '{"error":"no such order"}', "target answered 400"),
    ):
        r = by_timer[t.timer_id]
        assert (r.kind, r.outcome, r.status, r.latency_ms, r.answer, r.reason) == (
            HistoryKind.ATTEMPT,
            outcome,
            status,
            latency,
            answer,
            reason,
        )
        assert (r.owner, r.key, r.version, r.scheduled_at) == (t.owner, t.key, t.version, t.scheduled_at)
        assert r.expires_at == r.at + RETENTION_S * 1000  # kept as long as the tombstone
        assert due <= r.at <= now_ms()


async def test_an_occurrence_skipped_past_its_misfire_grace_is_recorded_with_the_reason(
    store: EmbeddedTimers,
) -> None:
    history = History()
    hour_ago = now_ms() - 3_600_000
    late = replace(timer("o-late", hour_ago, partitions=PARTS), rule=OnceRule(misfire_grace_ms=60_000))
    on_time = timer("o-on-time", now_ms(), partitions=PARTS)
    gateway = Recorder()
    await fire(store, gateway, history, [on_time, late], expect=1)
    with anyio.fail_after(5):
        await history.until_recorded(2)
    (r,) = [r for r in history.records if r.timer_id == late.timer_id]
    assert (r.outcome, r.status, r.scheduled_at) == ("misfired", None, hour_ago)
    assert r.reason is not None and r.reason.endswith("ms late, past its misfire grace of 60000 ms")
    assert r.expires_at == r.at + RETENTION_S * 1000


async def test_records_the_history_store_could_not_take_are_written_with_the_next_settle_group(
    store: EmbeddedTimers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept while the store is unavailable, up to the backlog (here one record: the first
    group's)."""
    monkeypatch.setattr(firing_module, "HISTORY_BACKLOG", 1)
    history = History()
    history.refusals.append(StorageUnavailable("history: the server did not answer"))
    before = unrecorded()
    first, second = timer("o-1", now_ms(), partitions=PARTS), timer("o-2", now_ms(), partitions=PARTS)
    gateway = Recorder()
    await fire(store, gateway, history, [first], [second])
    assert [t.timer_id for t in gateway.sent] == [first.timer_id, second.timer_id]  # the settle never waited
    with anyio.fail_after(5):
        await history.until_recorded(2)
    assert history.appends == [2]  # the first group's record kept, written with the second's
    assert {r.timer_id for r in history.records} == {first.timer_id, second.timer_id}
    assert unrecorded() == before


async def test_records_a_history_store_refuses_are_counted_and_the_timers_fire_all_the_same(
    store: EmbeddedTimers,
) -> None:
    history = History()
    history.refusals.append(StorageError("history: not authorized on wowd to execute command update"))
    before = unrecorded()
    ts = [timer(f"o-{i}", now_ms(), partitions=PARTS) for i in range(3)]
    later = timer("o-later", now_ms(), partitions=PARTS)
    gateway = Recorder()
    await fire(store, gateway, history, ts, [later])
    assert len(gateway.sent) == 4
    assert unrecorded() == before + 3
    with anyio.fail_after(5):
        await history.until_recorded(1)
    assert [r.timer_id for r in history.records] == [later.timer_id]  # the refused ones not sent again


async def test_the_outbox_shortcut_records_each_rounds_attempts_for_as_long_as_tombstones_are(tmp_path: Path) -> None:
    path = tmp_path / "wowd.db"
    store = embedded_timers(path, context=CONTEXT, partitions=PARTS)
    box, history = EmbeddedOutbox(path), EmbeddedTimerHistory(path, context=CONTEXT)
    try:
        ts = [timer(f"o-{i}", now_ms(), partitions=PARTS) for i in range(3)]
        for t in ts:
            assert await store.view.put(t)
        settings = TimerSettings(tombstone_retention_s=RETENTION_S)
        loop = replace(
            firing(store.firing, OutboxGateway(box), settings, shortcut=store.firing), history=history
        ).loop()
        held = held_slot(PARTS)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, caught_up_waker())
                while len(await box.entries(limit=10)) < 3:
                    await anyio.wait_all_tasks_blocked()
                held.request_stop()
        for t in ts:
            (r,) = await history.of_timer(t.timer_id)
            assert (r.kind, r.outcome, r.request_id) == (HistoryKind.ATTEMPT, "delivered", t.request_id)
            assert r.expires_at == r.at + RETENTION_S * 1000
        # an occurrence past its misfire grace: settled with no outbox entry, recorded as misfired
        hour_ago = now_ms() - 3_600_000
        late = replace(timer("o-late", hour_ago, partitions=PARTS), rule=OnceRule(misfire_grace_ms=60_000))
        assert await store.view.put(late)
        held = held_slot(PARTS)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, caught_up_waker())
                while not await history.of_timer(late.timer_id):
                    await anyio.wait_all_tasks_blocked()
                held.request_stop()
        (r,) = await history.of_timer(late.timer_id)
        assert (r.outcome, r.request_id, r.scheduled_at) == ("misfired", late.request_id, hour_ago)
        assert r.reason is not None and r.reason.endswith("ms late, past its misfire grace of 60000 ms")
        assert r.expires_at == r.at + RETENTION_S * 1000
        assert len(await box.entries(limit=10)) == 3 and await store.queries.find(late.owner, late.key) is None
    finally:
        await history.close()
        await box.close()
        await store.close()


async def test_a_replica_records_its_attempts_in_its_backends_history(tmp_path: Path) -> None:
    """The firing a replica assembles (:func:`~wowd.daemon.firing.choose`) records into the
    backend's history, with either strategy; none without one."""
    for history in (True, False):
        settings = WowdSettings(
            context=CONTEXT,
            embedded=EmbeddedSettings(path=tmp_path / f"{history}.db"),
            timers=TimerSettings(history=history),
        )
        backend = await open_embedded(settings)
        try:
            chosen = choose(settings, backend, Recorder(), target_limits(4, lambda _t: 4))
            assert chosen.history is backend.history and (chosen.history is not None) is history
        finally:
            await backend.close()
