"""The demo producer: commits of ``order`` aggregates with timer events, appended to the log.

``wowd demo`` appends a fixed number of commits once; ``wowd run --demo`` runs :func:`produce_forever`
in-process. Each commit carries an ``OrderCreated``/``ItemAdded`` event; timers are spread over the
commits (``TimerScheduled``, due ``due_in_ms`` after the append, target the order itself) and every
fifth aggregate's second commit cancels the timer its first one scheduled (``TimerCancelled``);
the timer events are built by :mod:`wowd.client`'s builders, the schema the application API writes.
:data:`reducer` folds the events into a small state for the snapshot projection
(``WOWD_REDUCERS='{"order": "wowd.demo:reducer"}'``).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import anyio

from wowd import clock
from wowd.client import cancelled_event, scheduled_event
from wowd.model import AggregateRef, Commit, DomainEvent
from wowd.stores.base import Log

__all__ = ["DemoReducer", "DemoStats", "demo_commits", "produce", "produce_forever", "reducer"]

AGGREGATE = "order"


class DemoReducer:
    """Counts an order's events, items and timers."""

    state_revision = 1

    def fold(self, state: dict[str, Any], event: DomainEvent) -> dict[str, Any]:
        out = dict(state)
        out["events"] = int(out.get("events", 0)) + 1
        if event.name == "ItemAdded":
            out["items"] = int(out.get("items", 0)) + 1
        elif event.name == "TimerScheduled":
            out["timers"] = int(out.get("timers", 0)) + 1
        elif event.name == "TimerCancelled":
            out["cancelled"] = int(out.get("cancelled", 0)) + 1
        return out


reducer = DemoReducer()


@dataclass(slots=True)
class DemoStats:
    commits: int = 0
    timers: int = 0
    cancelled: int = 0


def _event(name: str, body: dict[str, Any]) -> DomainEvent:
    return DomainEvent(id=uuid.uuid4().hex, name=name, body_type=f"demo.{name}", body=body)


def demo_commits(
    context: str,
    *,
    commits: int,
    timers: int,
    due_in_ms: int,
    aggregates: int,
    run_id: str | None = None,
    now_ms: int | None = None,
    versions: dict[str, int] | None = None,
    first: int = 0,
    first_keys: dict[str, str] | None = None,
) -> tuple[list[Commit], DemoStats]:
    """``commits`` commits over ``aggregates`` orders, scheduling ``timers`` timers in total.

    Commit ``i`` goes to order ``(first + i) % aggregates``: a call continuing an earlier one
    passes the number of commits made before it as ``first``, ``versions`` (each order's last
    version) and ``first_keys`` (the key of each order's first timer, which its second commit
    cancels for every fifth order), both updated in place."""
    run = run_id or secrets.token_hex(4)
    now = clock.now_ms() if now_ms is None else now_ms
    versions = {} if versions is None else versions
    first_key = {} if first_keys is None else first_keys
    stats = DemoStats()
    out: list[Commit] = []
    aggregates = max(1, aggregates)
    per_commit, extra = divmod(max(0, timers), max(1, commits))
    timer_no = 0
    for i in range(commits):
        order = (first + i) % aggregates
        agg_id = f"{AGGREGATE}-{run}-{order}"
        version = versions.get(agg_id, 0) + 1
        versions[agg_id] = version
        ref = AggregateRef(context=context, aggregate=AGGREGATE, id=agg_id)
        events = [_event("OrderCreated" if version == 1 else "ItemAdded", {"order_id": agg_id, "n": version})]
        for k in range(per_commit + (1 if i < extra else 0)):
            key = f"expire-{version}-{k}"
            timer_no += 1
            events.append(
                scheduled_event(
                    key,
                    due_at=now + due_in_ms,
                    target=ref,
                    command={"name": "expire-order", "body": {"order_id": agg_id, "timer": key, "n": timer_no}},
                )
            )
            first_key.setdefault(agg_id, key)
            stats.timers += 1
        if version == 2 and agg_id in first_key and order % 5 == 4:
            events.append(cancelled_event(first_key[agg_id]))
            stats.cancelled += 1
        out.append(
            Commit(
                ref=ref,
                version=version,
                command_id=uuid.uuid4().hex,
                request_id=uuid.uuid4().hex,
                create_time=now,
                events=tuple(events),
                access={"owner_id": "demo", "space_id": "", "tags": []},
            )
        )
        stats.commits += 1
    return out, stats


async def produce(
    log: Log, *, commits: int, timers: int, due_in_ms: int, aggregates: int, chunk: int = 500
) -> DemoStats:
    """Appends the demo commits in chunks; answers what was appended."""
    run = secrets.token_hex(4)
    versions: dict[str, int] = {}
    first_keys: dict[str, str] = {}
    total = DemoStats()
    done = 0
    timers_left = timers
    while done < commits:
        n = min(chunk, commits - done)
        t = timers_left * n // max(1, commits - done)
        batch, stats = demo_commits(
            log.context,
            commits=n,
            timers=t,
            due_in_ms=due_in_ms,
            aggregates=aggregates,
            run_id=run,
            versions=versions,
            first=done,
            first_keys=first_keys,
        )
        # a chunk continues the orders (and their versions) where the previous one stopped
        await log.append_many(batch)
        done += n
        timers_left -= t
        total.commits += stats.commits
        total.timers += stats.timers
        total.cancelled += stats.cancelled
    return total


async def produce_forever(
    log: Log,
    stats: DemoStats,
    *,
    rate_per_s: float = 50.0,
    due_in_ms: int = 2000,
    aggregates: int = 20,
) -> None:
    """Appends ``rate_per_s`` commits a second (each with one timer) until cancelled."""
    run = secrets.token_hex(4)
    versions: dict[str, int] = {}
    first_keys: dict[str, str] = {}
    tick = 0.2
    per_tick = max(1, int(rate_per_s * tick))
    while True:
        batch, s = demo_commits(
            log.context,
            commits=per_tick,
            timers=per_tick,
            due_in_ms=due_in_ms,
            aggregates=aggregates,
            run_id=f"{run}-{stats.commits // max(1, aggregates * 50)}",
            versions=versions,
            first=stats.commits,
            first_keys=first_keys,
        )
        await log.append_many(batch)
        stats.commits += s.commits
        stats.timers += s.timers
        stats.cancelled += s.cancelled
        await anyio.sleep(tick)
