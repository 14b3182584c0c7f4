"""The feed over a log holding malformed documents and timer events the model refuses: each is
quarantined with the field named in its reason and counted by field, the good commits around it
(same partitions) are fed, and every partition's checkpoint passes them all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import CONTEXT, commit, event, eventually, scheduled
from tests.helpers import held_slot
from wowd import metrics
from wowd.config import WowdSettings, load_settings
from wowd.model import AggregateType, Commit, DomainEvent, commit_to_doc

TYPE = AggregateType(context=CONTEXT, aggregate="order")


def good(agg_id: str, *events: DomainEvent) -> Commit:
    """The first commit of order ``agg_id``: an ``ItemAdded``, then ``events``."""
    return commit(agg_id, 1, event(n=1), *events)


def timer_event(key: str, **body: Any) -> DomainEvent:
    """A ``TimerScheduled`` of ``key`` due in 2096, its body's fields as given in ``body``."""
    return scheduled(**{"key": key, "due_at": 4_000_000_000_000, **body})


def raw(agg_id: str, **fields: Any) -> dict[str, Any]:
    """The log document of :func:`good` ``(agg_id)`` with ``fields`` written over it."""
    return {**commit_to_doc(good(agg_id), 8), **fields}


MALFORMED: list[tuple[str, dict[str, Any]]] = [
    ("request_id", raw("bad-1", request_id=17)),
    ("version", raw("bad-2", version="three")),
    ("events", raw("bad-3", events={"not": "a list"})),
    ("events[0].name", raw("bad-4", events=[{"id": "x", "body": {}}])),
    ("tenant_id", raw("bad-5", tenant_id="")),
    ("create_time", raw("bad-6", create_time=1.5)),
]
"""(field named, raw document) written with ``insert_raw``."""

REJECTED_EVENTS: list[tuple[str, DomainEvent]] = [
    ("rule.type", timer_event("r1", rule={"type": "fortnightly"})),
    ("body.command", timer_event("r2", command={"name": "c", "body": {"pad": "x" * 600}})),
    ("body.target", timer_event("r3", target={"context": "Bad.Ctx", "aggregate": "order", "id": "x"})),
    ("body.due_at", timer_event("r4", due_at=-5)),
]
"""(field named, timer event): each in an otherwise valid commit, which is fed and quarantined."""


def _count(counter: Any, field: str) -> float:
    value = counter.labels(field=field)._value.get()
    assert isinstance(value, float)
    return value


@pytest.fixture
def feed_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WowdSettings:
    """Bodies over 512 bytes refused; nothing read from this process's ``WOWD_*``."""
    for key in [k for k in os.environ if k.startswith("WOWD_")]:
        monkeypatch.delenv(key)
    return load_settings(
        context=TYPE.context,
        partitions=4,
        embedded={"path": tmp_path / "wowd.db"},
        timers={"max_body_bytes": 512},
    )


@pytest.mark.anyio
async def test_the_feed_quarantines_bad_input_counts_it_and_goes_on(feed_settings: WowdSettings) -> None:
    """Malformed documents and rejected timer events are quarantined with the field named in the
    reason and counted by field; the good commits around them (same partitions) are fed to the sink
    and the timer store, and every partition's checkpoint passes them all."""
    from wowd.daemon.feed import CONSUMER, Feeder
    from wowd.daemon.waker import Waker
    from wowd.stores.embedded import open_embedded

    backend = await open_embedded(feed_settings)
    try:
        log = backend.log
        before_q = {f: _count(metrics.QUARANTINED, f) for f, _ in MALFORMED + REJECTED_EVENTS}
        before_r = {f: _count(metrics.TIMER_EVENTS_REJECTED, f) for f, _ in REJECTED_EVENTS}
        goods = [good(f"good-{i}", timer_event(f"ok-{i}")) for i in range(8)]
        await log.append_many(goods[:4])
        for _field, raw in MALFORMED:
            await log.insert_raw(TYPE, raw)
        rejected = [good(f"rej-{i}", ev) for i, (_f, ev) in enumerate(REJECTED_EVENTS)]
        zone = {"type": "cron", "expression": "* * * * *", "zone": "Mars/Olympus"}
        two = good("rej-two", timer_event("", due_at=5), timer_event("z", rule=zone))
        await log.append_many([*rejected, two])
        await log.append_many(goods[4:])

        held = held_slot(4)
        feeder = Feeder(feed_settings, backend)
        last_seq = len(goods) + len(MALFORMED) + len(REJECTED_EVENTS) + 1
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, Waker())

                async def past_all() -> bool:
                    cps = await backend.checkpoints.read(CONSUMER, range(4))
                    return bool(cps) and max(cp.position["seq"] for cp in cps.values()) >= last_seq

                await eventually(past_all, 20, "every partition's checkpoint past the last commit")
                held.request_stop()
        assert feeder.stalled is None

        quarantined = await backend.quarantine.items()
        reasons = {q["raw"]["aggregate_id"]: q["reason"] for q in quarantined}
        for field, raw in MALFORMED:
            reason = reasons[raw["aggregate_id"]]
            assert reason.startswith(f"{field}: "), (field, reason)
            assert _count(metrics.QUARANTINED, field) == before_q[field] + 1, field
        for i, (field, _ev) in enumerate(REJECTED_EVENTS):
            assert f"{field}: " in reasons[f"rej-{i}"], (field, reasons[f"rej-{i}"])
            assert _count(metrics.TIMER_EVENTS_REJECTED, field) == before_r[field] + 1, field
        # a commit with two rejected timer events is set aside once, naming the first bad field
        assert reasons["rej-two"].startswith("rejected timer event: body.key: "), reasons["rej-two"]
        assert len(quarantined) == len(MALFORMED) + len(REJECTED_EVENTS) + 1

        sink = backend.sink(TYPE)
        for c in [*goods, *rejected, two]:
            docs = await sink.documents(c.ref)
            assert [d["version"] for d in docs] == [1], c.ref
        for i, c in enumerate(goods):
            assert await backend.timer_queries.find(c.ref, f"ok-{i}") is not None
        owners = {t.owner for t in await backend.timer_queries.scan(limit=100)}
        assert owners == {c.ref for c in goods}, "a rejected timer event puts no timer"
    finally:
        await backend.close()
