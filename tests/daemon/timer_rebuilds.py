"""What the ``wowd timers rebuild`` process tests share, on either backend: timers of five kinds
scheduled through a running replica and brought to their states, what the outbox holds, the
rebuild's summary line, and the PARKED and FAILED timers a rebuild must keep."""

from __future__ import annotations

import re
import time

from tests.factories import cancelled, commit, eventually, timer_commit
from tests.processes import Replica
from wowd.model import TimerChange, TimerStatus
from wowd.stores.base import Backend


async def outbox_timer_ids(b: Backend) -> list[str]:
    """The timer ids of the outbox's entries: what was fired."""
    return [e.timer_id for e in await b.outbox.entries(limit=100_000)]


async def assert_parked_and_failed_kept(stores: Backend, ids: dict[str, set[str]]) -> None:
    """The PARKED and FAILED timers of :func:`schedule_five_kinds` are back with their reasons (what the
    log does not hold: carried over from the old view)."""
    parked = await stores.timer_queries.scan(status=TimerStatus.PARKED, limit=100_000)
    failed = await stores.timer_queries.scan(status=TimerStatus.FAILED, limit=100_000)
    assert {t.timer_id for t in parked} == ids["parked"] and {t.last_error for t in parked} == {"target answered 409"}
    assert {t.timer_id for t in failed} == ids["failed"] and {t.last_error for t in failed} == {"target answered 400"}


def summary(out: str) -> dict[str, int]:
    """The counts of a rebuild's summary line: by status, commits read, timers live."""
    line = next(x for x in out.splitlines() if x.startswith("summary: "))
    found = {k: int(v) for v, k in re.findall(r"(\d+) (PENDING|FIRING|PARKED|FAILED|DONE|CANCELLED|expired)", line)}
    found["commits"] = int(re.search(r"(\d+) commits read", line).group(1))  # type: ignore[union-attr]
    found["live"] = int(re.search(r"(\d+) timers live", line).group(1))  # type: ignore[union-attr]
    return found


async def schedule_five_kinds(
    stores: Backend, a: Replica, *, park: bool, pending_in_ms: int, n: int
) -> dict[str, set[str]]:
    """Schedules ``n`` timers (one per order) through the replica ``a``: fired (due now and
    delivered into the outbox), cancelled, parked and failed (due in an hour, then settled so by
    the test as a replica would), and pending (due ``pending_in_ms`` from now). Answers the timer
    ids of each kind."""
    now = int(time.time() * 1000)
    fifth = n // 5
    kinds = ["fired", "cancelled", "parked", "failed", "pending"]
    due = {"fired": now, "cancelled": now + 3_600_000, "parked": now + 3_600_000, "failed": now + 3_600_000}
    due["pending"] = now + pending_in_ms
    commits = []
    for i in range(n):
        kind = kinds[i // fifth]
        commits.append(timer_commit(f"o-{kind}-{i}", 1, [f"k-{i}"], due_at=due[kind]))
    await stores.log.append_many(commits)
    cancels = [commit(f"o-cancelled-{i}", 2, cancelled(f"k-{i}")) for i in range(fifth, 2 * fifth)]
    await stores.log.append_many(cancels)

    ids: dict[str, set[str]] = {k: set() for k in kinds}

    async def settled() -> bool:
        return await stores.outbox.count() >= fifth and len(await stores.timer_queries.scan(limit=100_000)) == 3 * fifth

    await eventually(settled, 20, "the replica fed every commit and fired the due timers")
    for t in await stores.timer_queries.scan(limit=100_000):
        ids[t.owner.id.split("-")[1]].add(t.timer_id)
    ids["fired"] = set(await outbox_timer_ids(stores))
    assert len(ids["fired"]) == fifth
    if park:
        by_id = {t.timer_id: t for t in await stores.timer_queries.scan(limit=100_000)}
        changes = [TimerChange.park(by_id[i], fence=0, reason="target answered 409") for i in ids["parked"]]
        changes += [TimerChange.fail(by_id[i], fence=0, reason="target answered 400") for i in ids["failed"]]
        assert await stores.firing.settle(changes) == 2 * fifth
    return ids
