"""Bad input is refused with a message naming the field, and nothing else breaks: property-based
(hypothesis) over the model's readers of outside data, commit documents (``commit_from_doc``) and
timer events (``timer_event_from``). What the feed does with what they refuse is in
``tests/daemon/test_feed_bad_input.py``; the configuration's refusals in ``tests/test_config.py``;
a target's bad answers in ``tests/delivery/test_bad_answers.py``."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests import factories
from wowd.errors import InvalidInput
from wowd.model import (
    MAX_BODY_BYTES,
    AggregateRef,
    AggregateType,
    Command,
    Commit,
    CronRule,
    DomainEvent,
    TimerCancelled,
    TimerScheduled,
    commit_from_doc,
    commit_to_doc,
    timer_event_from,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPE = AggregateType(context="chaos", aggregate="order")
MAX_MS = 253402300799999
NAME = re.compile(r"^[a-z0-9_-]{1,64}$")


# --------------------------------------------------------------------------- strategies

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
bson_only = st.one_of(
    st.datetimes(timezones=st.just(dt.UTC)), st.binary(max_size=8), st.uuids(), st.decimals(allow_nan=False)
)
"""Values a MongoDB log document may hold that JSON has not."""
any_value = st.one_of(json_like, bson_only)

COMMIT_KEYS = (
    "tenant_id", "aggregate_id", "version", "command_id", "request_id", "create_time", "header",
    "events", "access", "access_version", "deleted",
)  # fmt: skip


def valid_doc(agg_id: str = "order-1", version: int = 3) -> dict[str, Any]:
    commit = Commit(
        ref=AggregateRef(context=TYPE.context, aggregate=TYPE.aggregate, id=agg_id),
        version=version,
        command_id="cmd",
        request_id=f"req-{agg_id}-{version}",
        create_time=1_700_000_000_000,
        events=(DomainEvent(id="e1", name="OrderCreated", body={"n": 1}),),
        access={"owner_id": "u1", "space_id": "s1", "tags": ["a"]},
        access_version=2,
    )
    return commit_to_doc(commit, 8)


def _field_is_under(field: str | None, key: str) -> bool:
    return field is not None and (field == key or field.startswith((f"{key}[", f"{key}.")))


# --------------------------------------------------------------------------- commit documents


@FAST
@given(doc=st.dictionaries(st.sampled_from(COMMIT_KEYS) | st.text(max_size=6), any_value, max_size=12))
def test_any_document_is_a_commit_or_names_a_field(doc: dict[str, Any]) -> None:
    """The feed relies on this: a log document reads as a Commit or raises InvalidInput with a
    field (the quarantine reason and the metric label); never another exception."""
    try:
        commit = commit_from_doc(TYPE, doc)
    except InvalidInput as exc:
        assert exc.field, exc
        assert str(exc).startswith(f"{exc.field}: ")
        return
    assert commit.version >= 1 and commit.request_id
    assert commit.ref.type == TYPE


@FAST
@given(data=st.data(), key=st.sampled_from(COMMIT_KEYS), value=any_value)
def test_one_bad_field_of_a_valid_commit_is_the_field_named(data: st.DataObject, key: str, value: Any) -> None:
    doc = valid_doc()
    if data.draw(st.booleans(), label="delete instead"):
        del doc[key]
    else:
        doc[key] = value
    try:
        commit_from_doc(TYPE, doc)
    except InvalidInput as exc:
        assert _field_is_under(exc.field, key), (key, exc.field, str(exc))


@FAST
@given(events=st.lists(any_value | st.dictionaries(st.sampled_from(["id", "name", "body"]), any_value)))
def test_bad_events_name_the_event(events: list[Any]) -> None:
    doc = valid_doc()
    doc["events"] = events
    try:
        commit = commit_from_doc(TYPE, doc)
    except InvalidInput as exc:
        assert exc.field is not None and re.fullmatch(r"events\[\d+\](\.(name|body|id))?", exc.field), exc
        return
    assert len(commit.events) == len(events)


# --------------------------------------------------------------------------- timer events


def scheduled(**body: Any) -> DomainEvent:
    """A ``TimerScheduled`` of order-1's timer ``expire``; ``body``: its fields written over it."""
    command = {"name": "expire-order", "body": {"n": 1}}
    target = {"context": "chaos", "aggregate": "order", "id": "order-1"}
    doc = {"key": "expire", "due_at": 1_700_000_000_000, "target": target, "command": command}
    return factories.scheduled(**{**doc, **body})


def read_timer_event(event: DomainEvent, **kw: Any) -> TimerScheduled | TimerCancelled | None:
    """``timer_event_from`` under the feed's own expectation: a result or InvalidInput naming a field."""
    try:
        return timer_event_from(event, **kw)
    except InvalidInput as exc:
        assert exc.field and exc.field.startswith(("body.", "rule")), exc
        raise


@FAST
@given(body=st.dictionaries(st.sampled_from(["key", "due_at", "rule", "target", "command"]), json_like))
def test_any_timer_event_body_is_read_or_names_a_field(body: dict[str, Any]) -> None:
    for name in ("TimerScheduled", "TimerCancelled"):
        try:
            read_timer_event(DomainEvent(id="e", name=name, body=body))
        except InvalidInput:
            pass


def test_an_interval_under_the_settings_floor_is_rejected_by_the_feed() -> None:
    """``every_ms = 1`` would have one timer ask for a delivery every few milliseconds: under
    ``timers.min_interval_ms`` (1 s by default) the feed rejects the event (bad input, set aside
    with its reason); a floor lowered in the settings lets it through."""
    from wowd.config import TimerSettings
    from wowd.daemon.feed_batch import prepare_batch
    from wowd.model import LogEntry

    event = scheduled(rule={"type": "interval", "every_ms": 1})
    with pytest.raises(InvalidInput) as info:
        read_timer_event(event)
    assert info.value.field == "rule.every_ms" and "below the shortest interval, 1000 ms" in info.value.reason
    assert isinstance(read_timer_event(scheduled(rule={"type": "interval", "every_ms": 1000})), TimerScheduled)
    commit = commit_from_doc(TYPE, {**valid_doc(), "events": [{"id": "e", "name": event.name, "body": event.body}]})
    entry = LogEntry(position={"seq": 1}, partition=0, aggregate=TYPE, commit=commit, raw={})
    default = prepare_batch([entry], TimerSettings(), 8)
    assert default.timer_writes == [] and [(c, exc.field) for c, _, exc in default.rejected] == [
        (commit, "rule.every_ms")
    ]
    lowered = prepare_batch([entry], TimerSettings(min_interval_ms=1), 8)
    assert lowered.rejected == [] and len(lowered.timer_writes) == 1


@FAST
@given(kind=(st.text(max_size=10) | json_like).filter(lambda k: k not in ("once", "interval", "cron")))
def test_unknown_rule_types_are_refused_naming_rule_type(kind: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        read_timer_event(scheduled(rule={"type": kind, "every_ms": 10}))
    assert info.value.field == "rule.type"


@FAST
@given(
    expression=st.sampled_from(["0 0 30 2 *", "0 0 31 2 *", "0 0 31 4 *", "0 0 31 11 *", "15 3 30 2 *"]),
    zone=st.sampled_from(["UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata"]),
    after=st.integers(min_value=0, max_value=MAX_MS - 2 * 86_400_000),
)
def test_a_cron_that_never_fires_has_no_next_occurrence(expression: str, zone: str, after: int) -> None:
    """Read without error (the first occurrence is the event's ``due_at``), then no next one:
    the timer loop deletes the timer after its first fire instead of looping or raising."""
    ev = read_timer_event(scheduled(rule={"type": "cron", "expression": expression, "zone": zone}))
    assert isinstance(ev, TimerScheduled) and isinstance(ev.rule, CronRule)
    assert ev.rule.next_after(after) is None


@FAST
@given(after=st.integers(min_value=MAX_MS - 2 * 86_400_000, max_value=MAX_MS))
@example(after=MAX_MS - 3_000_000)
def test_a_cron_at_the_end_of_time_has_no_next_occurrence(after: int) -> None:
    """A due_at accepted near 9999-12-31 in a zone east of UTC (year 10000 locally) is no crash:
    the next occurrence is None or a time after it within the range of ``due_at``."""
    assert CronRule(expression="0 0 30 2 *", zone="Europe/Paris").next_after(after) is None
    for zone in ("Europe/Paris", "Asia/Tokyo", "UTC", "America/Los_Angeles"):
        nxt = CronRule(expression="* * * * *", zone=zone).next_after(after)
        assert nxt is None or after < nxt <= MAX_MS


@FAST
@given(
    due_at=st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MAX_MS + 1),
        st.booleans(),
        st.floats(),
        st.text(max_size=8),
        st.none(),
    )
)
@example(due_at=float("nan"))
@example(due_at=1.7e12)
def test_due_at_out_of_range_names_body_due_at(due_at: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        read_timer_event(scheduled(due_at=due_at))
    assert info.value.field == "body.due_at"


@FAST
@given(due_at=st.integers(min_value=0, max_value=MAX_MS))
def test_due_at_in_range_is_kept(due_at: int) -> None:
    ev = read_timer_event(scheduled(due_at=due_at))
    assert isinstance(ev, TimerScheduled) and ev.due_at == due_at


@FAST
@given(size=st.integers(min_value=0, max_value=3000), limit=st.integers(min_value=64, max_value=2500))
def test_command_body_over_the_limit_names_body_command(size: int, limit: int) -> None:
    """The limit applies to the command's JSON text exactly (what the timer store keeps)."""
    command = {"name": "expire-order", "body": {"pad": "x" * size}}
    text_size = len(Command(name="expire-order", body={"pad": "x" * size}).to_json().encode())
    if text_size > limit:
        with pytest.raises(InvalidInput) as info:
            read_timer_event(scheduled(command=command), max_body_bytes=limit)
        assert info.value.field == "body.command"
        assert f"over the limit of {limit}" in str(info.value)
    else:
        ev = read_timer_event(scheduled(command=command), max_body_bytes=limit)
        assert isinstance(ev, TimerScheduled) and ev.command.body == {"pad": "x" * size}


def test_the_default_body_limit_is_64_kib() -> None:
    with pytest.raises(InvalidInput, match="over the limit of 65536"):
        read_timer_event(scheduled(command={"name": "c", "body": {"pad": "x" * MAX_BODY_BYTES}}))


@FAST
@given(
    part=st.sampled_from(["context", "aggregate"]),
    name=(st.text(max_size=70) | json_like).filter(lambda n: not (isinstance(n, str) and NAME.match(n))),
)
@example(part="context", name="Orders")
@example(part="aggregate", name="order.items")
@example(part="aggregate", name="a$b")
@example(part="context", name="a" * 65)
@example(part="aggregate", name="")
def test_target_names_a_collection_or_index_cannot_hold_name_body_target(part: str, name: Any) -> None:
    target = {"context": "chaos", "aggregate": "order", "id": "order-1", part: name}
    with pytest.raises(InvalidInput) as info:
        read_timer_event(scheduled(target=target))
    assert info.value.field == "body.target"
    assert part in str(info.value)


@FAST
@given(value=bson_only)
def test_a_command_body_json_cannot_hold_names_the_field(value: Any) -> None:
    """A MongoDB log document may carry BSON values (dates, binaries, decimals) in a command body:
    refused naming the field, not a TypeError that would stop the feed."""
    with pytest.raises(InvalidInput) as info:
        timer_event_from(scheduled(command={"name": "c", "body": {"v": value}}))
    assert info.value.field == "body.command.body"
