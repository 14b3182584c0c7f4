"""Timer rules: once, interval, cron."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeAlias
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from wowd.errors import InvalidInput
from wowd.model.commits import _is_doc

_MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z
MIN_INTERVAL_MS = 1000
"""The shortest interval rule a timer event may carry, unless the settings say otherwise
(``timers.min_interval_ms``): one timer never asks for more than a delivery a second."""


def _check_grace(grace: int | None) -> None:
    if grace is not None and (not isinstance(grace, int) or isinstance(grace, bool) or grace < 0):
        raise InvalidInput(f"must be an integer >= 0 (ms) or absent, got {grace!r}", field="rule.misfire_grace_ms")


def _with_grace(doc: dict[str, Any], grace: int | None) -> dict[str, Any]:
    if grace is not None:
        doc["misfire_grace_ms"] = grace
    return doc


def misfired(rule: Rule, scheduled_at: int, at: int) -> bool:
    """Whether an occurrence due at ``scheduled_at`` fired at ``at`` would be later than the
    rule's ``misfire_grace_ms`` (then it is skipped, not delivered); never without one."""
    grace = rule.misfire_grace_ms
    return grace is not None and at - scheduled_at > grace


def misfire_reason(rule: Rule, scheduled_at: int, at: int) -> str:
    """Why an occurrence due at ``scheduled_at`` is skipped at ``at`` (:func:`misfired`)."""
    return f"{at - scheduled_at} ms late, past its misfire grace of {rule.misfire_grace_ms} ms"


@dataclass(frozen=True, slots=True, kw_only=True)
class OnceRule:
    misfire_grace_ms: int | None = None
    """Skip the timer instead of delivering it later than this after its due time (ms); ``None``:
    it is delivered however late (the default)."""
    type: Literal["once"] = "once"

    def __post_init__(self) -> None:
        _check_grace(self.misfire_grace_ms)

    def next_after(self, fired_at: int) -> int | None:
        return None

    def to_doc(self) -> dict[str, Any]:
        return _with_grace({"type": "once"}, self.misfire_grace_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class IntervalRule:
    every_ms: int
    until: int | None = None
    misfire_grace_ms: int | None = None
    """Skip an occurrence instead of delivering it later than this after its due time (ms)."""
    type: Literal["interval"] = "interval"

    def __post_init__(self) -> None:
        _check_grace(self.misfire_grace_ms)
        if not isinstance(self.every_ms, int) or isinstance(self.every_ms, bool) or self.every_ms < 1:
            raise InvalidInput(f"must be an integer >= 1, got {self.every_ms!r}", field="rule.every_ms")
        if self.until is not None and (not isinstance(self.until, int) or isinstance(self.until, bool)):
            raise InvalidInput("must be an integer (ms) or absent", field="rule.until")

    def next_after(self, scheduled_at: int) -> int | None:
        nxt = scheduled_at + self.every_ms
        if self.until is not None and nxt > self.until:
            return None
        return nxt

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": "interval", "every_ms": self.every_ms}
        if self.until is not None:
            doc["until"] = self.until
        return _with_grace(doc, self.misfire_grace_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class CronRule:
    """A cron rule (5 or 6 fields, croniter's syntax) evaluated in ``zone``."""

    expression: str
    zone: str = "UTC"
    misfire_grace_ms: int | None = None
    """Skip an occurrence instead of delivering it later than this after its due time (ms)."""
    type: Literal["cron"] = "cron"

    def __post_init__(self) -> None:
        from croniter import croniter

        _check_grace(self.misfire_grace_ms)
        if not isinstance(self.expression, str) or not croniter.is_valid(self.expression):
            raise InvalidInput(f"{self.expression!r} is not a valid cron expression", field="rule.expression")
        try:
            ZoneInfo(self.zone)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise InvalidInput(f"{self.zone!r} is not a known time zone", field="rule.zone") from exc

    @property
    def fixed_time(self) -> bool:
        """Whether the rule names its hours and minutes (neither field starts with ``*``, nor
        is it ``@hourly``): such a rule fires at given wall-clock times of the day."""
        fields = self.expression.split()
        if fields and fields[0].startswith("@"):
            return fields[0].lower() != "@hourly"
        return len(fields) >= 2 and not fields[0].startswith("*") and not fields[1].startswith("*")

    def next_after(self, scheduled_at: int) -> int | None:
        """The first occurrence strictly after ``scheduled_at``; ``None`` when there is none
        before year 9999 (an expression such as ``0 0 30 2 *`` never fires).

        Daylight saving time, as cron (Vixie cron, cronie) does it: a :attr:`fixed_time` rule
        fires once per wall-clock time, so a time repeated when the clocks go back fires on its
        first pass only, and a time skipped when they go forward fires at the first valid time
        after the gap (a daily 02:30 in New York fires at 03:00 EDT that day). A rule with a
        ``*`` in its minute or hour field follows the clock: it fires in the repeated hour again
        and the times of the gap do not exist."""
        from croniter import CroniterBadDateError, croniter

        zone = ZoneInfo(self.zone)
        try:
            start = datetime.fromtimestamp(scheduled_at / 1000, tz=zone)
            it = croniter(self.expression, start, max_years_between_matches=50)
            while True:
                ms = int(it.get_next(datetime).astimezone(UTC).timestamp() * 1000)
                if ms > _MAX_MS:
                    return None
                if self.fixed_time and datetime.fromtimestamp(ms / 1000, tz=zone).fold == 1:
                    continue  # the second pass of a wall-clock time: it fired on the first
                return ms
        except (CroniterBadDateError, OverflowError, ValueError, OSError):
            return None

    def to_doc(self) -> dict[str, Any]:
        return _with_grace({"type": "cron", "expression": self.expression, "zone": self.zone}, self.misfire_grace_ms)


Rule: TypeAlias = OnceRule | IntervalRule | CronRule


def parse_rule(doc: Any) -> Rule:
    """Reads ``{type, ...}``; an unknown type or bad field raises :class:`InvalidInput`."""
    if not _is_doc(doc):
        raise InvalidInput("must be a document {type, ...}", field="rule")
    kind = doc.get("type")
    grace = doc.get("misfire_grace_ms")
    if kind == "once":
        return OnceRule(misfire_grace_ms=grace)
    if kind == "interval":
        return IntervalRule(every_ms=doc.get("every_ms"), until=doc.get("until"), misfire_grace_ms=grace)  # type: ignore[arg-type]
    if kind == "cron":
        return CronRule(expression=doc.get("expression"), zone=doc.get("zone", "UTC"), misfire_grace_ms=grace)  # type: ignore[arg-type]
    raise InvalidInput(f"unknown rule type {kind!r} (once, interval, cron)", field="rule.type")
