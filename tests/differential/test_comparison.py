"""The comparison itself: on a stream that gives every aspect something to hold (timers that fire,
are skipped and are held back, a quarantined document, snapshots, stamped index documents), the
backends agree and hold it; and one backend's answer changed here (a planted divergence) is
reported, aspect by aspect, so that the comparison cannot quietly compare nothing."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from tests.differential import backends, compare
from tests.differential.backends import EMBEDDED, MONGO, SHARDED, Holdings
from tests.differential.cases import cancelled, scheduled
from tests.differential.schema_draw import AT, Append, Stream
from tests.differential.test_streams import REDUCERS
from wowd.model import partition

Held = dict[str, Holdings]


def order(agg_id: str, version: int, *events: dict[str, Any], **fields: Any) -> Append:
    doc = {
        "aggregate_id": agg_id, "version": version, "request_id": f"{agg_id}-{version}", "tenant_id": "(0)",
        "partition": partition(agg_id, backends.PARTITIONS), "create_time": AT - 10_000, "events": list(events),
        **fields,
    }  # fmt: skip
    return Append("order", doc)


STREAM = Stream(
    appends=(
        order("o-1", 1, scheduled("held", AT - 1)),
        order("o-3", 1, access={"owner_id": "alice", "tags": ["t"]}, access_version=1),
        order("o-3", 2, scheduled("fire", AT - 1_000), access={"owner_id": "bob"}, access_version=2),
        order("o-4", 1, scheduled("skip", AT - 60_000, type="once", misfire_grace_ms=1_000)),
        Append("order", {**order("o-2", 1).doc, "header": []}, refused="header"),
        order("o-1", 2, cancelled("held")),
    ),
    scanned=2,
    fed=5,
)  # fmt: skip
"""Two documents appended before the feed, three while it follows, the cancel of ``held`` after:
at :data:`AT`, ``held`` is held back, ``fire`` fires, ``skip`` is past its grace."""
HELD, FIRE, SKIP = (("order", "(0)", agg, key) for agg, key in (("o-1", "held"), ("o-3", "fire"), ("o-4", "skip")))
O3 = ("order", "(0)", "o-3")


@pytest.fixture(scope="module")
def held(run: Callable[..., Any]) -> Held:
    """What each backend holds of :data:`STREAM`: the timers, quarantine, snapshots, decisions."""
    result: Held = run(backends.run, STREAM, reducers=REDUCERS, decide=True)
    return result


@pytest.fixture(scope="module")
def indexed(run: Callable[..., Any]) -> Held:
    """What the embedded index and Elasticsearch hold of :data:`STREAM`."""
    result: Held = run(backends.run, STREAM, (EMBEDDED, MONGO), index=True)
    return result


def everything(held: Held, indexed: Held) -> list[str]:
    return (
        compare.timers(held)
        + compare.last_versions(STREAM, held)
        + compare.snapshots(held)
        + compare.quarantine(STREAM, held)
        + compare.decisions(STREAM, held)
        + compare.index(indexed)
        + compare.quarantine(STREAM, indexed)
    )


def test_the_backends_agree_on_a_stream_that_gives_every_aspect_something(held: Held, indexed: Held) -> None:
    assert everything(held, indexed) == []
    for h in held.values():
        assert {k[3] for k in h.timers} == {"held", "fire", "skip"}
        assert h.decisions == {HELD: "held", FIRE: "fire", SKIP: "skip"}
        assert [compare.named_field(q["reason"]) for q in h.quarantined] == ["header"]
        assert h.snapshots[O3] is not None and h.snapshots[O3].version == 2
        assert h.last_versions[("order", "(0)", "o-1")] == 2
    for h in indexed.values():
        assert [d["access"] for d in h.index[O3]] == [{"owner_id": "bob"}] * 2  # version 1's, stamped


def _later(h: Held, i: Held) -> None:
    t = h[MONGO].timers[FIRE]
    h[MONGO].timers[FIRE] = replace(t, due_at=t.due_at + 1)


def _drop_timer(h: Held, i: Held) -> None:
    del h[SHARDED].timers[FIRE]


def _last_version(h: Held, i: Held) -> None:
    h[MONGO].last_versions[("order", "(0)", "o-1")] = 1


def _field(h: Held, i: Held) -> None:
    h[SHARDED].quarantined[0]["reason"] = "access: must be a document"


def _drop_quarantine(h: Held, i: Held) -> None:
    h[MONGO].quarantined = []


def _snapshot_state(h: Held, i: Held) -> None:
    s = h[SHARDED].snapshots[O3]
    assert s is not None
    h[SHARDED].snapshots[O3] = replace(s, state={**s.state, "events": 99})


def _unstamped(h: Held, i: Held) -> None:
    i[MONGO].index[O3][0]["access"] = {"owner_id": "alice", "tags": ["t"]}


def _fired(h: Held, i: Held) -> None:
    h[MONGO].decisions[HELD] = "fire"


def _skipped(h: Held, i: Held) -> None:
    h[SHARDED].decisions[FIRE] = "skip"


def _held_back(h: Held, i: Held) -> None:
    h[EMBEDDED].decisions[SKIP] = "held"


Plant = Callable[[Held, Held], None]
Comparison = Callable[[Held, Held], list[str]]
PLANTS: dict[str, tuple[Plant, Comparison, str]] = {
    "a timer's due time": (_later, lambda h, i: compare.timers(h), MONGO),
    "a timer missing": (_drop_timer, lambda h, i: compare.timers(h), SHARDED),
    "a last version": (_last_version, lambda h, i: compare.last_versions(STREAM, h), MONGO),
    "a quarantined document's field": (_field, lambda h, i: compare.quarantine(STREAM, h), SHARDED),
    "a quarantine missing": (_drop_quarantine, lambda h, i: compare.quarantine(STREAM, h), MONGO),
    "a snapshot's state": (_snapshot_state, lambda h, i: compare.snapshots(h), SHARDED),
    "an index document's access": (_unstamped, lambda h, i: compare.index(i), MONGO),
    "a timer fired that a commit not fed cancels": (_fired, lambda h, i: compare.decisions(STREAM, h), MONGO),
    "a timer skipped within its grace": (_skipped, lambda h, i: compare.decisions(STREAM, h), SHARDED),
    "a timer held back with nothing after it": (_held_back, lambda h, i: compare.decisions(STREAM, h), EMBEDDED),
}
"""Each divergence planted: how, the comparison that must report it, and the backend it is on."""


@pytest.mark.parametrize("planted", sorted(PLANTS))
def test_a_planted_divergence_is_reported(held: Held, indexed: Held, planted: str) -> None:
    plant, comparison, backend = PLANTS[planted]
    held, indexed = copy.deepcopy(held), copy.deepcopy(indexed)
    assert comparison(held, indexed) == []
    plant(held, indexed)
    reported = comparison(held, indexed)
    assert reported, f"{planted} on {backend} is not reported"
    named = re.compile(rf"(^|[ :,]){re.escape(backend)}( |$)")
    assert any(named.search(line) for line in reported), reported
