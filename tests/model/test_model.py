"""wowd.model: partitioning, names, rules, timer events, timer changes, snapshots, commits."""

from __future__ import annotations

import itertools
import json
from dataclasses import FrozenInstanceError, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests import factories
from wowd import model
from wowd.errors import ConfigError, InvalidInput
from wowd.model import (
    AggregateRef,
    AggregateType,
    Claim,
    Command,
    Commit,
    CronRule,
    DomainEvent,
    IntervalRule,
    OnceRule,
    SnapshotRecord,
    SnapshotSaveOutcome,
    Timer,
    TimerCancelled,
    TimerChange,
    TimerScheduled,
    TimerStatus,
    TimerWrite,
    commit_from_doc,
    commit_to_doc,
    commits,
    deterministic_timer_id,
    java_string_hash,
    misfired,
    net_writes,
    parse_rule,
    partition,
    request_id_for,
    stream_id,
    timer_event_from,
    validate_name,
)


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).astimezone(UTC).timestamp() * 1000)


# --------------------------------------------------------------------------- partitioning


VECTORS = [  # docs/concepts.md, computed with a JVM
    ("", 0, 0, 0),
    ("order-1", -1207111310, 50, 1),
    ("0U9EJ8pEXLA", -1164353479, 57, 5),
    ("(0)", 39969, 33, 6),
    ("聚合根", 32270091, 11, 0),
    ("emoji-😀", 1164511306, 10, 0),
    ("a-very-long-aggregate-id-0123456789abcdef", -272322810, 6, 3),
]


@pytest.mark.parametrize(("agg_id", "hash_code", "mod64", "mod7"), VECTORS)
def test_partition_matches_javas_string_hash_code(agg_id: str, hash_code: int, mod64: int, mod7: int) -> None:
    assert java_string_hash(agg_id) == hash_code
    assert partition(agg_id, 64) == mod64
    assert partition(agg_id, 7) == mod7


@given(st.text(), st.integers(min_value=1, max_value=4096))
def test_partition_is_a_floor_mod_in_range(agg_id: str, n: int) -> None:
    p = partition(agg_id, n)
    assert 0 <= p < n
    h = java_string_hash(agg_id)
    assert -(2**31) <= h < 2**31
    assert (h - p) % n == 0


def _hash_unit_by_unit(s: str) -> int:
    """Java's definition, ``h = 31 * h + unit`` over the UTF-16 code units, in 32 bits."""
    units = s.encode("utf-16-be", "surrogatepass")
    h = 0
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i : i + 2], "big")) % 2**32
    return h - 2**32 if h >= 2**31 else h


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=1500) | st.text())
def test_string_hash_follows_javas_definition_for_any_length(agg_id: str) -> None:
    # ASCII ids up to 1,024 characters take the weighed sum; longer or other ids unit by unit
    assert java_string_hash(agg_id) == _hash_unit_by_unit(agg_id)


def test_partition_count_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="partitions"):
        partition("x", 0)


def test_aggregate_ref_partition_uses_the_id_only() -> None:
    ref = AggregateRef(context="ctx", aggregate="order", id="order-1", tenant_id="tenant-9")
    assert ref.partition(64) == 50
    assert AggregateRef(context="ctx", aggregate="order", id="order-1").tenant_id == "(0)"


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["order", "order_line-2", "a", "x" * 64])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "Order", "order.line", "order line", "x" * 65, "ordre/1"])
def test_invalid_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(ConfigError, match="^aggregate: "):
        validate_name(name, field="aggregate")


def test_aggregate_types_and_refs_validate_their_names() -> None:
    with pytest.raises(ConfigError, match="context"):
        AggregateType(context="Bad", aggregate="order")
    with pytest.raises(ConfigError, match="aggregate"):
        AggregateRef(context="ctx", aggregate="Order!", id="1")
    with pytest.raises(InvalidInput, match="tenant_id"):
        AggregateRef(context="ctx", aggregate="order", id="1", tenant_id="")


def test_stream_id_percent_encodes_each_part() -> None:
    ref = AggregateRef(context="ctx", aggregate="order", id="a:b/c", tenant_id="(0)")
    assert stream_id(ref, 3) == "%280%29:a%3Ab%2Fc:3"


# --------------------------------------------------------------------------- rules


def test_once_rule_fires_once() -> None:
    assert OnceRule().next_after(1_000) is None
    assert parse_rule({"type": "once"}) == OnceRule()


def test_interval_rule_until() -> None:
    rule = IntervalRule(every_ms=1_000, until=3_000)
    assert rule.next_after(1_000) == 2_000
    assert rule.next_after(2_000) == 3_000
    assert rule.next_after(2_500) is None
    assert IntervalRule(every_ms=5).next_after(10) == 15


def test_cron_rule_next_after_in_utc() -> None:
    rule = CronRule(expression="*/15 * * * *")
    assert rule.next_after(ms("2026-03-01T10:07:00+00:00")) == ms("2026-03-01T10:15:00+00:00")
    # strictly after: an occurrence at the start is not repeated
    assert rule.next_after(ms("2026-03-01T10:15:00+00:00")) == ms("2026-03-01T10:30:00+00:00")


def test_cron_rule_follows_its_zone_across_daylight_saving() -> None:
    rule = CronRule(expression="0 9 * * *", zone="Europe/Paris")
    assert rule.next_after(ms("2026-01-15T12:00:00+00:00")) == ms("2026-01-16T08:00:00+00:00")  # CET
    assert rule.next_after(ms("2026-07-15T12:00:00+00:00")) == ms("2026-07-16T07:00:00+00:00")  # CEST


def occurrences(rule: CronRule, start: str, until: str) -> list[int]:
    out: list[int] = []
    t = rule.next_after(ms(start))
    while t is not None and t <= ms(until):
        out.append(t)
        t = rule.next_after(t)
    return out


def test_a_daily_cron_fires_once_on_the_fall_back_day() -> None:
    """New York, 2026-11-01: 01:00-02:00 happens twice (EDT, then EST). A daily 01:30 fires at
    the first 01:30 only, then at 01:30 EST the next day."""
    rule = CronRule(expression="30 1 * * *", zone="America/New_York")
    assert occurrences(rule, "2026-10-31T12:00:00-04:00", "2026-11-02T12:00:00-05:00") == [
        ms("2026-11-01T01:30:00-04:00"),
        ms("2026-11-02T01:30:00-05:00"),
    ]
    # a timer whose last fire was the first 01:30 is not fired again an hour later
    assert rule.next_after(ms("2026-11-01T01:30:00-04:00")) == ms("2026-11-02T01:30:00-05:00")


def test_a_daily_cron_in_the_skipped_hour_fires_at_the_first_valid_time() -> None:
    """New York, 2026-03-08: 02:00-03:00 does not exist. A daily 02:30 fires at 03:00 EDT, as
    cron runs the jobs of a skipped interval right after the change; then at 02:30 again."""
    rule = CronRule(expression="30 2 * * *", zone="America/New_York")
    assert occurrences(rule, "2026-03-07T12:00:00-05:00", "2026-03-09T12:00:00-04:00") == [
        ms("2026-03-08T03:00:00-04:00"),
        ms("2026-03-09T02:30:00-04:00"),
    ]


def test_a_cron_with_a_wildcard_hour_or_minute_follows_the_clock_across_daylight_saving() -> None:
    """Hourly and every-30-minute rules fire in the repeated hour again: every real hour (half
    hour), as cron runs its wildcard jobs."""
    hourly = CronRule(expression="0 * * * *", zone="America/New_York")
    assert occurrences(hourly, "2026-11-01T00:30:00-04:00", "2026-11-01T02:00:00-05:00") == [
        ms("2026-11-01T01:00:00-04:00"),
        ms("2026-11-01T01:00:00-05:00"),
        ms("2026-11-01T02:00:00-05:00"),
    ]
    half = CronRule(expression="*/30 1 * * *", zone="America/New_York")
    assert occurrences(half, "2026-11-01T00:30:00-04:00", "2026-11-01T03:00:00-05:00") == [
        ms("2026-11-01T01:00:00-04:00"),
        ms("2026-11-01T01:30:00-04:00"),
        ms("2026-11-01T01:00:00-05:00"),
        ms("2026-11-01T01:30:00-05:00"),
    ]
    assert hourly.fixed_time is False and half.fixed_time is False
    assert CronRule(expression="@hourly").fixed_time is False
    assert CronRule(expression="@daily").fixed_time is True
    assert CronRule(expression="0,30 1-3 * * 1-5").fixed_time is True


def test_a_never_firing_cron_has_no_next_occurrence() -> None:
    assert CronRule(expression="0 0 30 2 *").next_after(ms("2026-01-01T00:00:00+00:00")) is None


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ("once", "rule"),
        ({"type": "weekly"}, "rule.type"),
        ({}, "rule.type"),
        ({"type": "interval", "every_ms": 0}, "rule.every_ms"),
        ({"type": "interval", "every_ms": "1s"}, "rule.every_ms"),
        ({"type": "interval", "every_ms": 10, "until": "later"}, "rule.until"),
        ({"type": "cron", "expression": "every minute"}, "rule.expression"),
        ({"type": "cron", "expression": "* * * * *", "zone": "Mars/Olympus"}, "rule.zone"),
        ({"type": "cron", "expression": "* * * * *", "zone": "\u00f5" * 300}, "rule.zone"),  # past a file name's limit
        ({"type": "cron", "expression": "* * * * *", "zone": "America"}, "rule.zone"),  # a directory of zones
        ({"type": "once", "misfire_grace_ms": -1}, "rule.misfire_grace_ms"),
        ({"type": "interval", "every_ms": 10, "misfire_grace_ms": "1m"}, "rule.misfire_grace_ms"),
    ],
)
def test_bad_rules_name_the_field(doc: Any, field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_rule(doc)
    assert info.value.field == field


@pytest.mark.parametrize(
    "rule",
    [
        OnceRule(),
        IntervalRule(every_ms=60_000),
        IntervalRule(every_ms=5, until=99),
        CronRule(expression="0 * * * *"),
    ],
)
def test_rules_round_trip_through_their_documents(rule: Any) -> None:
    assert parse_rule(rule.to_doc()) == rule


# --------------------------------------------------------------------------- timer events

TARGET_DOC = {"context": "billing", "aggregate": "invoice", "tenant_id": "t1", "id": "inv-1"}


def scheduled(**body: Any) -> DomainEvent:
    """A ``TimerScheduled`` of the timer ``expire``, every second, sent to invoice inv-1 of tenant
    t1; ``body``: its body's fields written over it."""
    command = {"name": "ExpireInvoice", "body": {"why": "late"}}
    rule = {"type": "interval", "every_ms": 1000}
    return factories.scheduled(
        **{"key": "expire", "due_at": 1_700_000_000_000, "rule": rule, "target": TARGET_DOC, "command": command, **body}
    )


def test_timer_scheduled_is_read() -> None:
    event = timer_event_from(scheduled())
    assert event == TimerScheduled(
        key="expire",
        due_at=1_700_000_000_000,
        rule=IntervalRule(every_ms=1000),
        target=AggregateRef(context="billing", aggregate="invoice", tenant_id="t1", id="inv-1"),
        command=Command(name="ExpireInvoice", body={"why": "late"}),
    )


def test_timer_scheduled_defaults_to_once() -> None:
    event = scheduled()
    body = {k: v for k, v in event.body.items() if k != "rule"}
    read = timer_event_from(replace(event, body=body))
    assert isinstance(read, TimerScheduled) and read.rule == OnceRule()


def test_timer_cancelled_and_other_events() -> None:
    assert timer_event_from(DomainEvent(id="e", name="TimerCancelled", body={"key": "k"})) == TimerCancelled(key="k")
    assert timer_event_from(DomainEvent(id="e", name="OrderPaid", body={})) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"key": ""}, "body.key"),
        ({"key": 5}, "body.key"),
        ({"key": "k" * 513}, "body.key"),
        ({"due_at": "soon"}, "body.due_at"),
        ({"due_at": -1}, "body.due_at"),
        ({"due_at": True}, "body.due_at"),
        ({"rule": {"type": "sometimes"}}, "rule.type"),
        ({"target": "inv-1"}, "body.target"),
        ({"target": {**TARGET_DOC, "aggregate": "Invoice"}}, "body.target"),
        ({"target": {**TARGET_DOC, "id": None}}, "body.target"),
        ({"command": {"body": {}}}, "body.command"),
        ({"command": {"name": "X", "body": [1]}}, "body.command.body"),
        ({"command": {"name": "X", "body": {"blob": "x" * 70_000}}}, "body.command"),
        # what the published schema refuses: a name's pattern is the whole name, null is no string
        ({"target": {**TARGET_DOC, "context": "ctx\n"}}, "body.target"),
        ({"command": {"name": "X", "body_type": None}}, "body.command.body_type"),
        ({"rule": {"type": "once", "misfire_grace_ms": None}}, "rule.misfire_grace_ms"),
        ({"rule": {"type": "interval", "every_ms": 5, "until": None}}, "rule.until"),
    ],
)
def test_malformed_timer_events_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        timer_event_from(scheduled(**body))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_timer_cancelled_without_a_key_names_the_field() -> None:
    with pytest.raises(InvalidInput) as info:
        timer_event_from(DomainEvent(id="e", name="TimerCancelled", body={}))
    assert info.value.field == "body.key"


def test_body_limit_is_configurable() -> None:
    with pytest.raises(InvalidInput, match="over the limit of 16"):
        timer_event_from(scheduled(), max_body_bytes=16)


# --------------------------------------------------------------------------- timers and changes

OWNER = AggregateRef(context="ctx", aggregate="order", id="o-1")
TARGET = AggregateRef(context="billing", aggregate="invoice", id="inv-1")


def timer(**kw: Any) -> Timer:
    """Timer ``expire`` of :data:`OWNER` at version 3, sent to :data:`TARGET`, at revision 4 after
    two attempts; ``kw``: its fields written over these."""
    values: dict[str, Any] = {
        "owner": OWNER, "key": "expire", "version": 3, "due_at": 1_000, "scheduled_at": 1_000, "target": TARGET,
        "command": Command(name="Expire"), "revision": 4, "attempts": 2, "last_error": "503",
    }  # fmt: skip
    values.update(kw)
    return factories.timer(**values)


def test_timer_ids_and_request_ids_are_deterministic() -> None:
    assert deterministic_timer_id(OWNER, "expire", 3) == deterministic_timer_id(OWNER, "expire", 3)
    assert deterministic_timer_id(OWNER, "expire", 3) != deterministic_timer_id(OWNER, "expire", 4)
    t = timer()
    assert t.request_id == request_id_for(t.timer_id, 1_000)
    assert t.request_id != request_id_for(t.timer_id, 2_000)  # another occurrence, another id
    assert t.command == Command(name="Expire")


def test_claim_applied() -> None:
    after = TimerChange.claim(timer(), owner_key="a", fence=7, until=31_000).applied()
    assert after == timer(
        status=TimerStatus.FIRING,
        due_at=31_000,
        claim=Claim(owner_key="a", fence=7, until=31_000),
        revision=5,
    )
    assert after is not None and after.scheduled_at == 1_000  # the occurrence keeps its request id


def test_fired_applied_deletes_or_reschedules() -> None:
    firing = timer(status=TimerStatus.FIRING, claim=Claim(owner_key="a", fence=1, until=9), due_at=9)
    assert TimerChange.fired(firing, fence=1, next_due=None).applied() is None
    after = TimerChange.fired(firing, fence=1, next_due=2_000).applied()
    assert after == timer(
        status=TimerStatus.PENDING,
        due_at=2_000,
        scheduled_at=2_000,
        fired=1,
        attempts=0,
        claim=None,
        last_error=None,
        revision=5,
    )


def test_retry_park_resume_fail_applied() -> None:
    firing = timer(status=TimerStatus.FIRING, claim=Claim(owner_key="a", fence=1, until=9))
    retry = TimerChange.retry(firing, fence=1, due_at=5_000, error="timeout").applied()
    assert retry == timer(status=TimerStatus.PENDING, due_at=5_000, attempts=3, last_error="timeout", revision=5)
    park = TimerChange.park(firing, fence=1, reason="404").applied()
    assert park == timer(status=TimerStatus.PARKED, last_error="404", revision=5)
    assert park is not None
    resume = TimerChange.resume(park, due_at=7_000).applied()
    assert resume == timer(status=TimerStatus.PENDING, due_at=7_000, attempts=0, last_error="404", revision=6)
    fail = TimerChange.fail(firing, fence=1, reason="400").applied()
    assert fail == timer(status=TimerStatus.FAILED, last_error="400", revision=5)


# --------------------------------------------------------------------------- the net effect of timer writes


def put(key: str, version: int, *, due_at: int = 1_000, owner: AggregateRef = OWNER) -> TimerWrite:
    return TimerWrite.put(
        timer(
            timer_id=deterministic_timer_id(owner, key, version), partition=owner.partition(8), owner=owner,
            key=key, version=version, due_at=due_at, scheduled_at=due_at, revision=0, attempts=0, last_error=None,
        )
    )  # fmt: skip


def cancel(key: str, version: int, *, owner: AggregateRef = OWNER) -> TimerWrite:
    return TimerWrite.cancel(owner, key, version)


def cancel_all(version: int, *, owner: AggregateRef = OWNER) -> TimerWrite:
    return TimerWrite.cancel_all(owner, version)


def net(*writes: TimerWrite) -> list[tuple[str, str, int, int | None]]:
    """``net_writes`` of ``writes`` as (kind, key, version, due time of a put)."""
    return [(w.kind, w.key, w.version, w.timer.due_at if w.timer else None) for w in net_writes(writes)]


def test_a_cancel_then_a_schedule_of_one_key_in_one_commit_leaves_the_schedule_live() -> None:
    # cancel and schedule again in one command handler: the new timer is put
    assert net(cancel("k", 2), put("k", 2, due_at=5_000)) == [("put", "k", 2, 5_000)]
    assert net(put("k", 1), cancel("k", 2), put("k", 2, due_at=5_000)) == [("put", "k", 2, 5_000)]
    # the other order leaves it cancelled
    assert net(put("k", 2), cancel("k", 2)) == [("cancel", "k", 2, None)]
    assert net(cancel("k", 2), put("k", 2), cancel("k", 2)) == [("cancel", "k", 2, None)]


def test_the_last_of_two_schedules_of_one_key_in_one_commit_wins() -> None:
    assert net(put("k", 1, due_at=1_000), put("k", 1, due_at=2_000)) == [("put", "k", 1, 2_000)]
    # across commits the higher version wins, wherever it stands in the batch
    assert net(put("k", 2, due_at=2_000), put("k", 1, due_at=1_000)) == [("put", "k", 2, 2_000)]
    assert net(put("k", 2, due_at=2_000), cancel("k", 1)) == [("put", "k", 2, 2_000)]


def test_a_schedule_after_a_cancel_all_of_its_commit_stays_live() -> None:
    # the cancel_all covers every earlier commit's timer (one version below its own), the keys of
    # its commit written before it are cancelled at its version, the ones written after it stay
    assert net(put("a", 1), put("b", 1), cancel_all(2), put("a", 2, due_at=5_000)) == [
        ("cancel_all", "", 1, None),
        ("put", "a", 2, 5_000),
        ("cancel", "b", 2, None),
    ]
    assert net(put("a", 3), cancel_all(3), put("b", 3), cancel("c", 3)) == [
        ("cancel_all", "", 2, None),
        ("cancel", "a", 3, None),
        ("put", "b", 3, 1_000),
        ("cancel", "c", 3, None),
    ]
    # at version 1 there is nothing below its commit to cancel
    assert net(cancel_all(1), put("a", 1)) == [("put", "a", 1, 1_000)]


def test_a_schedule_before_a_cancel_all_of_its_commit_is_cancelled() -> None:
    # a deleted aggregate's commit: its timer events, then the cancel_all
    assert net(put("a", 1), put("b", 2), cancel_all(2)) == [
        ("cancel_all", "", 2, None),
        ("cancel", "a", 2, None),
        ("cancel", "b", 2, None),
    ]
    assert net(put("a", 2), cancel_all(2), put("a", 2), cancel_all(2)) == [
        ("cancel_all", "", 2, None),
        ("cancel", "a", 2, None),
    ]
    # a later commit's schedule is live again
    assert net(put("a", 2), cancel_all(2), put("a", 3)) == [("cancel_all", "", 2, None), ("put", "a", 3, 1_000)]


class StoreModel:
    """The timer store's version rules over a dict, (owner id, key) -> (version, live due time or
    None for a tombstone): a put replaces an earlier version; a cancel makes a live timer at or
    below its version, or nothing, a tombstone at its version, and raises an earlier tombstone;
    a cancel_all makes every live timer of the owner at or below its version a tombstone."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], tuple[int, int | None]] = {}

    def write(self, w: TimerWrite) -> None:
        key = (w.owner.id, w.key)
        cur = self.rows.get(key)
        if w.kind == "put":
            assert w.timer is not None
            if cur is None or cur[0] < w.version:
                self.rows[key] = (w.version, w.timer.due_at)
        elif w.kind == "cancel":
            if cur is None or cur[0] < w.version or (cur[0] == w.version and cur[1] is not None):
                self.rows[key] = (w.version, None)
        else:
            for k, (v, due) in list(self.rows.items()):
                if k[0] == w.owner.id and due is not None and v <= w.version:
                    self.rows[k] = (w.version, None)

    def live(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {k: (v, due) for k, (v, due) in self.rows.items() if due is not None}


_OP = st.one_of(
    st.tuples(st.just("put"), st.sampled_from("xyz"), st.integers(1, 3)),
    st.tuples(st.just("cancel"), st.sampled_from("xyz"), st.just(0)),
    st.just(("cancel_all", "", 0)),
)


@given(st.lists(st.tuples(st.sampled_from("ab"), st.lists(_OP, max_size=4)), max_size=8), st.data())
def test_the_net_effect_of_batches_is_the_log_applied_in_order(
    commits: list[tuple[str, list[tuple[str, str, int]]]], data: st.DataObject
) -> None:
    """Commits of two owners, each a few timer writes in order: applied in order, event by event,
    they leave a view; the net effect of the log cut into batches (whole commits), each written in
    any order under the store's version rules, leaves the same, and so does a replay of any part
    of the log in other batches."""
    log: list[list[TimerWrite]] = []
    expected: dict[tuple[str, str], tuple[int, int]] = {}
    versions: dict[str, int] = {}
    for oid, ops in commits:
        owner = AggregateRef(context="ctx", aggregate="order", id=oid)
        v = versions[oid] = versions.get(oid, 0) + 1
        writes = []
        for kind, key, due in ops:
            if kind == "put":
                writes.append(put(key, v, due_at=due, owner=owner))
                expected[(oid, key)] = (v, due)
            elif kind == "cancel":
                writes.append(cancel(key, v, owner=owner))
                expected.pop((oid, key), None)
            else:
                writes.append(cancel_all(v, owner=owner))
                expected = {k: t for k, t in expected.items() if k[0] != oid}
        log.append(writes)

    def feed(start: int) -> None:
        cuts = sorted(data.draw(st.sets(st.integers(start, len(log)))) | {start, len(log)})
        for lo, hi in itertools.pairwise(cuts):
            batch = net_writes([w for writes in log[lo:hi] for w in writes])
            keys = [(w.owner.id, w.key) for w in batch]
            assert len(keys) == len(set(keys))  # one write per key, one cancel_all per owner
            for w in data.draw(st.permutations(batch)):
                store.write(w)

    store = StoreModel()
    feed(0)
    assert store.live() == expected
    feed(data.draw(st.integers(0, len(log))))
    assert store.live() == expected


# --------------------------------------------------------------------------- snapshots


def snap(agg_id: str, version: int) -> SnapshotRecord:
    return SnapshotRecord(
        ref=AggregateRef(context="ctx", aggregate="order", id=agg_id),
        version=version,
        state_revision=1,
        state={},
    )


def test_snapshot_rounds_hold_one_snapshot_per_aggregate_in_order() -> None:
    a1, b1, a2, a3, c1, b2 = (
        snap("a", 1),
        snap("b", 1),
        snap("a", 2),
        snap("a", 3),
        snap("c", 1),
        snap("b", 2),
    )
    assert SnapshotSaveOutcome.rounds([a1, b1, a2, a3, c1, b2]) == [[a1, b1, c1], [a2, b2], [a3]]
    assert SnapshotSaveOutcome.rounds([]) == []


# --------------------------------------------------------------------------- commits


def make_commit(**kw: Any) -> Commit:
    values: dict[str, Any] = {
        "ref": AggregateRef(context="ctx", aggregate="order", id="order-1", tenant_id="t1"),
        "version": 2,
        "command_id": "cmd-1",
        "request_id": "req-1",
        "create_time": 1_700_000_000_000,
        "events": (
            DomainEvent(id="e1", name="OrderCreated", revision="1.0", body_type="x.Created", body={"n": 1}),
            DomainEvent(id="e2", name="TimerScheduled", body={"key": "k"}),
        ),
        "header": {"trace": "abc"},
        "access": {"owner_id": "u1", "space_id": "s1", "tags": ["vip"]},
        "access_version": 2,
        "deleted": False,
    }
    values.update(kw)
    return Commit(**values)


def test_commit_round_trips_through_its_document() -> None:
    c = make_commit()
    doc = commit_to_doc(c, 64)
    assert doc["_id"] == {"t": "t1", "a": "order-1", "v": 2}
    assert doc["partition"] == 50 and doc["owner_id"] == "u1" and doc["space_id"] == "s1"
    assert commit_from_doc(AggregateType(context="ctx", aggregate="order"), doc) == c


ID_CHARS = st.characters(exclude_categories=("Cc", "Cs"))
"""What an id may hold: any character but a control character (and a lone surrogate)."""


@given(
    agg_id=st.text(ID_CHARS, min_size=0, max_size=40),
    tenant=st.text(ID_CHARS, min_size=1, max_size=10),
    version=st.integers(min_value=1, max_value=2**53),
    deleted=st.booleans(),
)
def test_commit_round_trip_property(agg_id: str, tenant: str, version: int, deleted: bool) -> None:
    c = make_commit(
        ref=AggregateRef(context="ctx", aggregate="order", id=agg_id, tenant_id=tenant),
        version=version,
        deleted=deleted,
    )
    assert commit_from_doc(AggregateType(context="ctx", aggregate="order"), commit_to_doc(c, 16)) == c


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"aggregate_id": 42}, "aggregate_id"),
        ({"version": "2"}, "version"),
        ({"version": True}, "version"),
        ({"version": 0}, "version"),
        ({"request_id": None}, "request_id"),
        ({"create_time": "now"}, "create_time"),
        ({"events": {}}, "events"),
        ({"events": ["x"]}, "events[0]"),
        ({"events": [{"id": "e"}]}, "events[0].name"),
        ({"events": [{"name": "X", "body": []}]}, "events[0].body"),
        ({"access": "all"}, "access"),
        ({"header": 1}, "header"),
        ({"access_version": "1"}, "access_version"),
        ({"deleted": "no"}, "deleted"),
        ({"tenant_id": ""}, "tenant_id"),
        # the schema's types, null included, where a property is optional
        ({"command_id": 7}, "command_id"),
        ({"header": None}, "header"),
        ({"access": None}, "access"),
        ({"access": {"owner_id": 5}}, "access.owner_id"),
        ({"access": {"tags": ["a", 1]}}, "access.tags"),
        ({"access_version": -1}, "access_version"),
        ({"owner_id": None}, "owner_id"),
        ({"space_id": 1}, "space_id"),
        ({"events": [{"name": "X", "id": 5}]}, "events[0].id"),
        ({"events": [{"name": "X", "revision": 2}]}, "events[0].revision"),
        ({"events": [{"name": "X", "body_type": None}]}, "events[0].body_type"),
    ],
)
def test_malformed_commit_documents_name_the_field(change: dict[str, Any], field: str) -> None:
    doc = commit_to_doc(make_commit(), 64) | change
    with pytest.raises(InvalidInput) as info:
        commit_from_doc(AggregateType(context="ctx", aggregate="order"), doc)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("change", "plain"),
    [
        ({}, True),
        ({"tenant_id": None}, True),  # removed below: the default tenant
        ({"header": None, "access": None}, True),  # removed below
        ({"header": {}, "access": {}}, True),
        ({"access": {"owner_id": "o", "tags": ["t"], "other": 1}}, True),
        ({"access_version": None}, True),  # removed below
        ({"deleted": None}, True),  # removed below
        ({"events": []}, True),
        ({"events": [{"name": "X"}]}, True),
        ({"events": [{"name": "X", "body": {}, "id": "e", "revision": "2", "body_type": "t"}]}, True),
        ({"events": [{"name": "", "body": MappingProxyType({"n": 1})}]}, False),
        ({"access": MappingProxyType({"tags": ("t",)})}, False),
        ({"header": MappingProxyType({"a": 1})}, False),
        ({"version": 2**70}, True),
    ],
)
def test_a_log_document_reads_alike_on_either_reader(change: dict[str, Any], plain: bool) -> None:
    """The reader of the log's own shape and the checked reader give equal commits; the former
    leaves to the checked one (answers None) what is not of the JSON types it expects."""
    doc = commit_to_doc(make_commit(), 64) | change
    for key, value in change.items():
        if value is None and key in ("tenant_id", "access_version", "deleted", "header", "access"):
            del doc[key]
    t = AggregateType(context="ctx", aggregate="order")
    checked = commits._checked_commit(t, doc)
    assert commit_from_doc(t, doc) == checked
    assert commit_from_doc(t, MappingProxyType(doc)) == checked
    assert commits._plain_commit(t, doc) == (checked if plain else None)


def test_refs_read_from_the_log_are_shared() -> None:
    """An aggregate's successive commits and the targets naming it share one ref object."""
    t = AggregateType(context="ctx", aggregate="order")
    ref = AggregateRef(context="ctx", aggregate="order", id="order-7", tenant_id="t1")
    scheduled = DomainEvent(
        id="e",
        name="TimerScheduled",
        body={
            "key": "k",
            "due_at": 5,
            "target": {"context": "ctx", "aggregate": "order", "tenant_id": "t1", "id": "order-7"},
            "command": {"name": "expire", "body": {}},
        },
    )
    docs = [
        json.loads(json.dumps(commit_to_doc(make_commit(ref=ref, version=v, events=(scheduled,)), 64))) for v in (1, 2)
    ]
    first, second = (commit_from_doc(t, d) for d in docs)
    assert first.ref == ref and first.ref is second.ref
    te = timer_event_from(second.events[0])
    assert isinstance(te, TimerScheduled)
    assert te.target is first.ref


def test_missing_fields_are_named() -> None:
    doc = commit_to_doc(make_commit(), 64)
    del doc["request_id"]
    with pytest.raises(InvalidInput, match="^request_id: is missing"):
        commit_from_doc(AggregateType(context="ctx", aggregate="order"), doc)


def test_commit_validates_itself() -> None:
    with pytest.raises(InvalidInput, match="^version"):
        make_commit(version=0)
    with pytest.raises(InvalidInput, match="^request_id"):
        make_commit(request_id="")


def test_an_unchecked_constructor_builds_what_the_dataclass_builds() -> None:
    ref = AggregateRef(context="ctx", aggregate="order", id="o-1")
    for cls, values in [
        (AggregateRef, {"context": "ctx", "aggregate": "order", "id": "o-1", "tenant_id": "t"}),
        (DomainEvent, {"id": "e", "name": "X", "revision": "1", "body_type": "b", "body": {"n": 1}}),
        (TimerWrite, {"kind": "cancel", "owner": ref, "version": 3, "key": "k", "timer": None}),
    ]:
        build = model.unchecked(cls)
        built = build(**values)
        assert type(built) is cls
        assert built == cls(**values)
        with pytest.raises(FrozenInstanceError):
            setattr(built, next(iter(values)), "other")
        missing = dict(values)
        missing.popitem()
        with pytest.raises(TypeError):
            build(**missing)  # every field is required: none is left unset


_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_JSON_DOCS = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=8), _JSON_DOCS, max_size=5), st.booleans())
@example({"\x7f": None}, True)  # DEL is ASCII, and json escapes it with ensure_ascii
def test_sorted_json_writes_the_text_of_pythons_encoder(doc: dict[str, Any], ascii: bool) -> None:
    """Stored texts compared as text (access attributes) stay equal to what Python's encoder
    writes, whichever encoder wrote them: floats, NaN, integers past 64 bits, any character."""
    expected = json.dumps(doc, separators=(",", ":"), sort_keys=True, ensure_ascii=ascii)
    assert model.sorted_json(doc, ascii=ascii) == expected


def test_sorted_json_refuses_what_pythons_encoder_refuses() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(100):
        node["d"] = node = {}
    assert model.sorted_json(deep, ascii=True) == json.dumps(deep, separators=(",", ":"), sort_keys=True)
    with pytest.raises(TypeError):
        model.sorted_json({"when": datetime(2026, 1, 1, tzinfo=UTC)}, ascii=True)
    with pytest.raises(TypeError):
        model.sorted_json({"tuple key": {(1, 2): 3}}, ascii=False)


@pytest.mark.parametrize(
    "doc",
    [
        {"type": "once", "misfire_grace_ms": 0},
        {"type": "interval", "every_ms": 1000, "misfire_grace_ms": 60_000},
        {"type": "cron", "expression": "0 6 * * *", "zone": "UTC", "misfire_grace_ms": 3_600_000},
    ],
)
def test_a_rule_keeps_its_misfire_grace_through_its_document(doc: dict[str, Any]) -> None:
    rule = parse_rule(doc)
    assert rule.misfire_grace_ms == doc["misfire_grace_ms"] and rule.to_doc() == doc
    assert not misfired(rule, 1_000, 1_000 + doc["misfire_grace_ms"])  # at its grace: delivered
    assert misfired(rule, 1_000, 1_001 + doc["misfire_grace_ms"])
    assert not misfired(parse_rule({"type": "once"}), 0, 10**12)  # no grace: however late
