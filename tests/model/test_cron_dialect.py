"""The cron dialect a rule names: five fields as Vixie cron, six seconds first as the JVM's
schedulers, anything else refused; a rule stored without one keeps croniter's reading."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from wowd.client import next_occurrences, scheduled_event
from wowd.errors import InvalidInput
from wowd.model import AggregateRef, CronRule, parse_rule

T0 = int(datetime(2026, 3, 2, 5, 29, 55, tzinfo=UTC).timestamp() * 1000)  # a Monday
ORDER = AggregateRef(context="demo", aggregate="order", id="o-1")


def clock(times: list[int]) -> list[str]:
    return [datetime.fromtimestamp(t / 1000, UTC).strftime("%a %H:%M:%S") for t in times]


def test_six_fields_read_seconds_first_as_the_jvm_schedulers_do() -> None:
    every_10_s = CronRule(expression="*/10 * * * * *", dialect="jvm")
    assert clock(every_10_s.occurrences(T0, 3)) == ["Mon 05:30:00", "Mon 05:30:10", "Mon 05:30:20"]
    quartz = CronRule(expression="0 15 10 ? * MON-FRI", dialect="jvm")  # Quartz's tutorial, "?" and names
    assert clock(quartz.occurrences(T0, 2)) == ["Mon 10:15:00", "Tue 10:15:00"]
    assert quartz.to_doc() == {"type": "cron", "expression": "0 15 10 ? * MON-FRI", "zone": "UTC", "dialect": "jvm"}


def test_five_fields_read_as_vixie_cron() -> None:
    every_10_min = CronRule(expression="*/10 * * * *", dialect="unix")
    assert clock(every_10_min.occurrences(T0, 2)) == ["Mon 05:30:00", "Mon 05:40:00"]
    weekdays = CronRule(expression="0 9 * * 1-5", dialect="unix")  # Vixie's 1 is Monday
    assert clock(weekdays.occurrences(T0, 1)) == ["Mon 09:00:00"]


def test_a_rule_stored_without_a_dialect_keeps_croniter_s_reading() -> None:
    stored = parse_rule({"type": "cron", "expression": "*/10 * * * * *", "zone": "UTC"})
    assert isinstance(stored, CronRule) and stored.dialect is None
    # croniter's own extension: the sixth field is the seconds, every second of every tenth minute
    assert clock(stored.occurrences(T0, 3)) == ["Mon 05:30:00", "Mon 05:30:01", "Mon 05:30:02"]
    assert "dialect" not in stored.to_doc()  # written back as it was


@pytest.mark.parametrize(
    ("expression", "dialect", "says"),
    [
        ("*/10 * * * * * 2026", "jvm", "7 fields"),
        ("*/10 * * * * *", "unix", "6 fields"),
        ("0 0 12 * * 1", "jvm", "1 is Sunday in Quartz, Monday in Spring"),
        ("0 0 12 1 * MON", "jvm", "restricts both"),
        ("0 0 12 L * ?", "jvm", "L, W and #"),
        ("0 0 12 ? * ?", "jvm", "not both"),
        ("0 0 L * *", "unix", "L, W and #"),
        ("0 ? * * * *", "jvm", "whole day field"),
        ("@reboot", "unix", "1 fields"),
    ],
)
def test_what_the_dialects_read_differently_is_refused(expression: str, dialect: str, says: str) -> None:
    with pytest.raises(InvalidInput, match=says) as caught:
        CronRule(expression=expression, dialect=dialect)  # type: ignore[arg-type]
    assert caught.value.field == "rule.expression"
    with pytest.raises(InvalidInput) as bad:
        parse_rule({"type": "cron", "expression": "* * * * *", "dialect": "quartz"})
    assert bad.value.field == "rule.dialect"


def test_the_client_writes_the_dialect_its_fields_say() -> None:
    go = {"name": "go"}
    rule = {"type": "cron", "expression": "*/10 * * * * *"}
    event = scheduled_event("k", target=ORDER, command=go, rule=rule, now_ms=T0)
    assert event.body["rule"]["dialect"] == "jvm" and event.body["due_at"] == T0 + 5_000
    event = scheduled_event("k", target=ORDER, command=go, rule=CronRule(expression="@daily"), now_ms=T0)
    assert event.body["rule"]["dialect"] == "unix"
    with pytest.raises(InvalidInput, match="7 fields"):
        scheduled_event("k", target=ORDER, command=go, rule={"type": "cron", "expression": "0 0 * * * ? 2026"})
    mondays = next_occurrences({"type": "cron", "expression": "0 0 9 ? * MON"}, 2, after=T0)
    assert [datetime.fromtimestamp(t / 1000, UTC).isoformat() for t in mondays] == [
        "2026-03-02T09:00:00+00:00",
        "2026-03-09T09:00:00+00:00",
    ]
