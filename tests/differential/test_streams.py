"""A stream of commits drawn from the schema leaves the same timer view, the same last versions and
the same snapshots on every backend, and the embedded one holds the timers the schema's text
gives the stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import example, given

from tests.differential import backends, cases, compare
from tests.differential.conftest import SHRINKING, sized
from tests.differential.schema_draw import CONTEXT, TYPES, Stream, streams
from wowd.errors import InvalidInput
from wowd.model import AggregateType, DomainEvent, commit_from_doc

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


class Folding:
    """A reducer of every type: the events counted, the last one's name, type and body."""

    state_revision = 1

    def fold(self, state: dict[str, Any], event: DomainEvent) -> dict[str, Any]:
        last = {"name": event.name, "type": event.body_type, "body": dict(event.body)}
        return {"events": int(state.get("events", 0)) + 1, "last": last}


REDUCERS = dict.fromkeys(TYPES, Folding())


def report(stream: Stream, problems: Sequence[str]) -> str:
    """A failure's message: the differences, then the stream (the minimal one, once shrunk)."""
    return "\n".join(["the backends differ:", *problems, "on the stream (a document a line):", stream.text()])


def read_as_commits(stream: Stream) -> list[int]:
    """The documents of the stream's fed part that read as commits."""
    out = []
    for i, a in enumerate(stream.prefix):
        try:
            commit_from_doc(AggregateType(context=CONTEXT, aggregate=a.aggregate), a.doc)
        except InvalidInput:
            continue
        out.append(i)
    return out


def differences(run: Callable[..., Any], stream: Stream) -> list[str]:
    held = run(backends.run, stream, reducers=REDUCERS)
    problems = compare.timers(held) + compare.last_versions(stream, held) + compare.snapshots(held)
    expected = compare.expected_timers(stream, read_as_commits(stream))
    live = {k: (t.version, t.due_at) for k, t in held[backends.EMBEDDED].timers.items()}
    if live != expected:
        problems.append(f"the embedded view holds {live}, the schema's text gives {expected}")
    return problems


@SHRINKING
@sized(12)
@given(stream=streams())
@example(stream=cases.TENANT_LEFT_OUT)
@example(stream=cases.PARTITION_LEFT_OUT)
def test_a_stream_leaves_the_same_timers_versions_and_snapshots_everywhere(
    run: Callable[..., Any], stream: Stream
) -> None:
    problems = differences(run, stream)
    assert not problems, report(stream, problems)


def test_a_version_that_is_no_integer_hides_no_commit(run: Callable[..., Any]) -> None:
    problems = differences(run, cases.VERSION_NO_INTEGER)
    assert not problems, report(cases.VERSION_NO_INTEGER, problems)


def test_an_aggregate_whose_commits_carry_partition_or_not_folds_every_version(run: Callable[..., Any]) -> None:
    problems = differences(run, cases.PARTITION_WRITTEN_BY_SOME)
    assert not problems, report(cases.PARTITION_WRITTEN_BY_SOME, problems)
