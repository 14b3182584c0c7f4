"""A document the schema refuses is set aside alike by every backend: quarantined, its reason
naming the first bad field, which is the place the schema refuses (or a value the schema takes
and a documented limit refuses, which the feed looks at first); what is set aside, and what the rest of the stream
leaves in the timer view, is the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given

from tests.differential import backends, cases, compare
from tests.differential.conftest import SHRINKING, sized
from tests.differential.schema_draw import CONTEXT, Append, Stream, schema_errors, streams
from tests.differential.test_streams import report
from wowd.errors import InvalidInput
from wowd.model import AggregateType, commit_from_doc, timer_event_from

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


def in_commit(field: str, event: int | None) -> str:
    """A field a reason names, as a path in the commit: a timer event's fields are named relative
    to the event (``body.due_at``, ``rule.type``)."""
    if event is None:
        return field
    return f"events[{event}].{'body.' if field.startswith('rule') else ''}{field}"


def first_bad_field(a: Append) -> tuple[str, int | None] | None:
    """The first bad field the model finds in ``a`` (as a path in the commit) and the timer event
    it is in (``None``: the commit's own); ``None`` when the model reads it whole."""
    try:
        commit = commit_from_doc(AggregateType(context=CONTEXT, aggregate=a.aggregate), a.doc)
    except InvalidInput as exc:
        return str(exc.field), None
    for i, e in enumerate(commit.events):
        try:
            timer_event_from(e)
        except InvalidInput as exc:
            return in_commit(str(exc.field), i), i
    return None


def one_place(a: str, b: str) -> bool:
    """Whether two paths in a commit name one place: the same, or one inside the other (a reason
    names the first bad value inside what the schema finds missing or mistyped)."""
    return any(x == y or x.startswith((f"{y}.", f"{y}[")) for x, y in ((a, b), (b, a)))


@SHRINKING
@sized(10)
@given(stream=streams(refused=True))
@example(stream=cases.PARTITION_LEFT_OUT_REFUSED)
def test_what_the_schema_refuses_is_set_aside_alike_everywhere(run: Callable[..., Any], stream: Stream) -> None:
    held = run(backends.run, stream)
    problems = compare.quarantine(stream, held) + compare.timers(held) + compare.last_versions(stream, held)
    for i, a in enumerate(stream.appends):
        if a.refused is None:
            continue
        first = first_bad_field(a)
        if first is None:
            problems.append(f"the model reads document {i} whole, which the schema refuses at {a.refused}")
            continue
        field, event = first
        # the first bad field: the place broken, or one the schema takes and a documented limit
        # refuses (a cron expression, a zone, an id's length) that the model looks at first
        if not one_place(field, a.refused) and any(one_place(field, p) for p, _m in schema_errors(a.doc)):
            problems.append(f"the model names {field} first in document {i}, which the schema refuses at {a.refused}")
        for name, h in held.items():
            items = compare.quarantine_view(stream, h)
            named = [in_commit(f.rpartition(":")[2], event) for _agg, doc, f in items if doc == i]
            if field not in named:
                problems.append(f"{name}: document {i} is quarantined naming {named or 'nothing'}, not {field}")
    assert not problems, report(stream, problems)


def test_a_partition_of_another_value_is_computed_by_the_embedded_log_and_named_by_mongodb(
    run: Callable[..., Any],
) -> None:
    """The rule where the logs differ by design: the embedded log computes a commit's partition
    (its ``partition`` is not read), a MongoDB log reads the commit in the partition its aggregate
    id gives and quarantines it there, naming ``partition``; never drops it."""
    stream = cases.OTHER_PARTITIONS
    held = run(backends.run, stream)
    owner = ("order", "(0)", "")
    embedded = held[backends.EMBEDDED]
    assert embedded.quarantined == [] and embedded.last_versions[owner] == 4
    assert [k[3] for k in embedded.timers] == ["k"]
    for name in (backends.MONGO, backends.SHARDED):
        items = sorted(compare.quarantine_view(stream, held[name]).elements(), key=repr)
        assert items == [("order", i, "partition") for i in range(4)], (name, held[name].quarantined)
        assert held[name].timers == {}
