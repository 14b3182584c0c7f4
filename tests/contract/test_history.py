"""Timer history contract: records by timer id, by owner and key, by request id; idempotent
writes; a ring of attempts per timer; a recurring timer's schedule kept while it lives."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from wowd.model import (
    HISTORY_ATTEMPTS,
    AggregateRef,
    Command,
    Commit,
    CronRule,
    DomainEvent,
    HistoryKind,
    OnceRule,
    Timer,
    TimerCancelled,
    TimerScheduled,
    attempt_record,
    commit_records,
    deterministic_timer_id,
    partition,
)

pytestmark = pytest.mark.anyio

T0 = 1_700_000_000_000
DAY = 86_400_000
OWNER = AggregateRef(context="ctx", aggregate="order", id="o-1")
OTHER = AggregateRef(context="ctx", aggregate="order", id="o-2")


def commit(owner: AggregateRef, version: int, *, at: int = T0, deleted: bool = False) -> Commit:
    return Commit(
        ref=owner,
        version=version,
        command_id=f"c{version}",
        request_id=f"{owner.id}-r{version}",
        create_time=at,
        events=(DomainEvent(id="e", name="x"),),
        deleted=deleted,
    )


def scheduled(key: str, due_at: int, *, cron: bool = False) -> TimerScheduled:
    rule: Any = CronRule(expression="0 0 * * *") if cron else OnceRule()
    return TimerScheduled(key=key, due_at=due_at, rule=rule, target=OWNER, command=Command(name="go"))


def timer(owner: AggregateRef, key: str, version: int, *, revision: int = 1, scheduled_at: int = T0) -> Timer:
    return Timer(
        timer_id=deterministic_timer_id(owner, key, version),
        partition=partition(owner.id, 8),
        owner=owner,
        key=key,
        version=version,
        due_at=scheduled_at,
        scheduled_at=scheduled_at,
        target=owner,
        body=Command(name="go").to_json(),
        revision=revision,
    )


async def test_a_timer_s_records_by_id_by_key_and_by_request_id(history: Any) -> None:
    (sched,) = commit_records(commit(OWNER, 1), [scheduled("k", T0 + 10)], DAY, position=7)
    t = timer(OWNER, "k", 1, scheduled_at=T0 + 10)
    retry = attempt_record(t, "retry", T0 + 20, DAY, status=503, latency_ms=1.5, reason="HTTP 503", answer="busy")
    done = attempt_record(replace(t, revision=3), "delivered", T0 + 30, DAY, status=200, latency_ms=2.25, answer="{}")
    (cancel,) = commit_records(commit(OWNER, 2, at=T0 + 40), [TimerCancelled(key="k")], DAY)
    (elsewhere,) = commit_records(commit(OTHER, 1), [scheduled("k", T0)], DAY)
    await history.append([done, elsewhere, sched, retry, cancel])

    assert await history.of_timer(t.timer_id) == [sched, retry, done]
    assert await history.of_key(OWNER, "k") == [sched, retry, done, cancel]
    assert await history.of_key(OWNER, "other") == []
    # the id the target saw: both attempts of the occurrence carry it
    assert await history.of_request(t.request_id) == [retry, done]
    assert await history.of_request(sched.request_id) == [sched]  # the commit's own request id
    assert await history.of_request("nothing") == []
    assert sched.position == 7 and done.status == 200 and done.latency_ms == 2.25 and done.answer == "{}"


async def test_a_timer_due_at_the_end_of_the_schemas_time_is_recorded_with_any_retention(history: Any) -> None:
    # the schema's last millisecond (year 9999) and a retention as long as a setting allows: the
    # expiry is held at that millisecond, which both stores keep and read back
    end = 253_402_300_799_999
    (sched,) = commit_records(commit(OWNER, 1, at=end - 1), [scheduled("k", end)], 2**63 - 1)
    done = attempt_record(timer(OWNER, "k", 1, scheduled_at=end), "delivered", end, 2**63 - 1)
    await history.append([sched, done])
    assert await history.of_key(OWNER, "k") == [sched, done]
    assert sched.expires_at == done.expires_at == end


async def test_writing_records_again_changes_nothing(history: Any) -> None:
    records = commit_records(commit(OWNER, 1), [scheduled("k", T0), scheduled("j", T0)], DAY)
    await history.append(records)
    await history.append(records)  # a replay of the commit
    await history.append([])
    assert await history.of_key(OWNER, "k") == [records[0]]
    assert await history.of_key(OWNER, "j") == [records[1]]


async def test_a_timer_keeps_its_latest_attempts_only(history: Any) -> None:
    t = timer(OWNER, "k", 1)
    attempts = [
        attempt_record(replace(t, revision=r), "retry", T0 + r, DAY, reason=f"try {r}")
        for r in range(1, HISTORY_ATTEMPTS + 6)
    ]
    await history.append(attempts[: HISTORY_ATTEMPTS // 2])
    await history.append(attempts[HISTORY_ATTEMPTS // 2 :])
    kept = await history.of_timer(t.timer_id)
    assert kept == attempts[-HISTORY_ATTEMPTS:]
    assert await history.of_timer(t.timer_id, limit=3) == attempts[-3:]


async def test_a_recurring_schedule_lives_until_a_later_commit_of_its_key_ends_it(history: Any) -> None:
    (daily,) = commit_records(commit(OWNER, 1), [scheduled("k", T0 + DAY, cron=True)], DAY)
    (once,) = commit_records(commit(OWNER, 1), [scheduled("j", T0 + DAY)], DAY)
    assert daily.expires_at is None  # kept while the timer lives
    assert once.expires_at == T0 + 2 * DAY  # the retention after its due time
    await history.append([daily, once])
    (cancel,) = commit_records(commit(OWNER, 2, at=T0 + 5 * DAY), [TimerCancelled(key="k")], DAY)
    await history.append([cancel])
    by_key = await history.of_key(OWNER, "k")
    assert by_key == [replace(daily, expires_at=cancel.expires_at), cancel]
    assert await history.of_key(OWNER, "j") == [once]  # another key: untouched


async def test_a_delete_cancels_every_key_of_its_owner(history: Any) -> None:
    records = commit_records(commit(OWNER, 1), [scheduled("k", T0, cron=True), scheduled("j", T0, cron=True)], DAY)
    (other,) = commit_records(commit(OTHER, 1), [scheduled("k", T0, cron=True)], DAY)
    (delete,) = commit_records(commit(OWNER, 2, at=T0 + DAY, deleted=True), [], DAY)
    assert delete.kind is HistoryKind.CANCELLED and delete.key == ""
    await history.append([*records, other, delete])
    ended = delete.expires_at
    assert await history.of_key(OWNER, "k") == [replace(records[0], expires_at=ended), delete]
    assert await history.of_key(OWNER, "j") == [replace(records[1], expires_at=ended), delete]
    assert await history.of_key(OTHER, "k") == [other]  # another owner: still open


async def test_sweep_deletes_no_record_that_has_not_expired(history: Any) -> None:
    t = timer(OWNER, "k", 1)
    old = attempt_record(t, "delivered", T0, 1000)
    new = attempt_record(replace(t, revision=2), "delivered", T0 + 10 * DAY, DAY)
    (open_schedule,) = commit_records(commit(OWNER, 1), [scheduled("k", T0, cron=True)], DAY)
    await history.append([old, new, open_schedule])
    swept = await history.sweep(T0 + 5 * DAY, 100)
    assert swept in (0, 1)  # 0: the store expires them itself (a TTL index)
    kept = await history.of_timer(t.timer_id)
    assert new in kept and open_schedule in kept
    assert (old in kept) is (swept == 0)
