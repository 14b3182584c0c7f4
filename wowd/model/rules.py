"""Timer rules: once, interval, cron."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
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


CronDialect: TypeAlias = Literal["unix", "jvm"]
CRON_DIALECTS: tuple[CronDialect, ...] = ("unix", "jvm")
"""How a cron rule's expression reads (:class:`CronRule`'s ``dialect``)."""
UNIX_MACROS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})
"""The ``@`` forms Vixie cron takes for five fields (not ``@reboot``)."""
_DAY_NAMES = frozenset({"sun", "mon", "tue", "wed", "thu", "fri", "sat"})
_MONTH_NAMES = frozenset({"jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"})
_ATOMS = re.compile(r"[,/-]")


def _check_field(
    text: str, field: str, dialect: str, *, names: frozenset[str] = frozenset(), numbers: bool = True
) -> None:
    """Refuses a field the dialect's schedulers do not all read alike: only numbers (or, for
    months and days, names), ``*``, ranges, lists and steps."""
    for atom in _ATOMS.split(text):
        lowered = atom.lower()
        if atom == "*" or (atom.isascii() and atom.isdigit() and numbers) or lowered in names:
            continue
        if atom.isascii() and atom.isdigit():
            raise InvalidInput(
                f"{field} {text!r}: a day of the week by number is refused (1 is Sunday in Quartz, Monday in Spring): "
                "name it (MON, TUE, ... SUN)",
                field="rule.expression",
            )
        if any(c in lowered for c in "?lw#"):
            raise InvalidInput(
                f"{field} {text!r}: ?, L, W and # are refused in the {dialect} dialect (its schedulers read them "
                "differently, or not at all)",
                field="rule.expression",
            )
        raise InvalidInput(f"{field} {text!r}: {atom!r} is not a value of the field", field="rule.expression")


def jvm_to_croniter(expression: str) -> str:
    """A six-field, seconds-first expression (``second minute hour day-of-month month
    day-of-week``, as Quartz, Spring, db-scheduler and Wow read it) as croniter reads the same
    times (``minute hour day-of-month month day-of-week second``); raises
    :class:`InvalidInput` (field ``rule.expression``) for one they would not read alike: not six
    fields, a ``?`` other than a whole day field, both day fields restricted (Quartz refuses it,
    Vixie cron fires on either, Spring on both), a day of the week given as a number (1 is Sunday
    in Quartz, Monday in Spring: name it, ``MON``), ``L``, ``W`` or ``#``."""
    fields = expression.split()
    if len(fields) != 6:
        raise InvalidInput(
            f"{expression!r} has {len(fields)} fields; the jvm dialect reads six, seconds first "
            "(second minute hour day-of-month month day-of-week), as Quartz and Spring do",
            field="rule.expression",
        )
    second, minute, hour, dom, month, dow = fields
    for text, name in ((second, "second"), (minute, "minute"), (hour, "hour"), (month, "month")):
        if "?" in text:
            raise InvalidInput(f"{name} {text!r}: ? stands for a whole day field only", field="rule.expression")
    for text, name in ((second, "second"), (minute, "minute"), (hour, "hour")):
        _check_field(text, name, "jvm")
    _check_field(month, "month", "jvm", names=_MONTH_NAMES)
    if dom != "?":
        _check_field(dom, "day-of-month", "jvm")
    if dow != "?":
        _check_field(dow, "day-of-week", "jvm", names=_DAY_NAMES, numbers=False)
    if dom not in ("*", "?") and dow not in ("*", "?"):
        raise InvalidInput(
            f"{expression!r} restricts both the day of the month and the day of the week (Quartz refuses it, "
            "Spring fires on days matching both, Vixie cron on days matching either): give ? for one",
            field="rule.expression",
        )
    if dom == "?" and dow == "?":
        raise InvalidInput(f"{expression!r}: ? stands for one day field, not both", field="rule.expression")
    day_of_month = "*" if dom == "?" else dom
    day_of_week = "*" if dow == "?" else dow
    return f"{minute} {hour} {day_of_month} {month} {day_of_week} {second}"


def _unix_checked(expression: str) -> str:
    """A five-field expression as Vixie cron reads it (or one of its ``@`` forms), which croniter
    reads alike; raises :class:`InvalidInput` for another number of fields, a ``?``, ``L``, ``W``
    or ``#`` (not Vixie cron's)."""
    fields = expression.split()
    if len(fields) == 1 and fields[0].lower() in UNIX_MACROS:
        return fields[0].lower()
    if len(fields) != 5:
        raise InvalidInput(
            f"{expression!r} has {len(fields)} fields; the unix dialect reads five (minute hour day-of-month month "
            "day-of-week), as Vixie cron does (six, seconds first: dialect jvm)",
            field="rule.expression",
        )
    minute, hour, dom, month, dow = fields
    for text, name in ((minute, "minute"), (hour, "hour"), (dom, "day-of-month")):
        _check_field(text, name, "unix")
    _check_field(month, "month", "unix", names=_MONTH_NAMES)
    _check_field(dow, "day-of-week", "unix", names=_DAY_NAMES)
    return expression


@lru_cache(maxsize=1024)
def croniter_expression(expression: str, dialect: str | None) -> str:
    """The expression croniter evaluates for a rule's ``expression`` read in ``dialect``
    (``None``: croniter's own reading, as stored rules without a dialect are read); raises
    :class:`InvalidInput` naming ``rule.expression`` (or ``rule.dialect``) when it is refused."""
    from croniter import croniter

    if dialect is None:
        translated = expression
    elif dialect == "jvm":
        translated = jvm_to_croniter(expression)
    elif dialect == "unix":
        translated = _unix_checked(expression)
    else:
        raise InvalidInput(f"{dialect!r} is not a cron dialect ({', '.join(CRON_DIALECTS)})", field="rule.dialect")
    if not croniter.is_valid(translated):
        raise InvalidInput(f"{expression!r} is not a valid cron expression", field="rule.expression")
    return translated


def cron_dialect_of(expression: str) -> CronDialect:
    """The dialect a cron expression given with none is read in where it is written (the client,
    the command line): five fields (or an ``@`` form) as Vixie cron, six seconds first as the
    JVM's schedulers; another number of fields is refused."""
    fields = expression.split() if isinstance(expression, str) else []
    if len(fields) == 6:
        return "jvm"
    if len(fields) == 5 or (len(fields) == 1 and fields[0].lower() in UNIX_MACROS):
        return "unix"
    raise InvalidInput(
        f"{expression!r} has {len(fields)} fields: give five (minute hour day-of-month month day-of-week, as Vixie "
        "cron) or six, seconds first (second minute hour day-of-month month day-of-week, as Quartz and Spring)",
        field="rule.expression",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CronRule:
    """A cron rule evaluated in ``zone``; ``dialect`` says how its expression reads:

    - ``unix``: five fields, ``minute hour day-of-month month day-of-week``, as Vixie cron reads them
      (or ``@daily`` and the other ``@`` forms but ``@reboot``);
    - ``jvm``: six fields, seconds first, ``second minute hour day-of-month month day-of-week``, as
      Quartz, Spring, db-scheduler and Wow read them (``?`` for one day field; a day of the week by
      name; what they read differently is refused: :func:`jvm_to_croniter`);
    - ``None``: croniter's reading, the meaning of a rule stored without a dialect (five fields, or
      six with the seconds last, croniter's own extension).

    The client and the command line always write the dialect (:func:`cron_dialect_of`)."""

    expression: str
    zone: str = "UTC"
    misfire_grace_ms: int | None = None
    """Skip an occurrence instead of delivering it later than this after its due time (ms)."""
    dialect: CronDialect | None = None
    type: Literal["cron"] = "cron"

    def __post_init__(self) -> None:
        _check_grace(self.misfire_grace_ms)
        if not isinstance(self.expression, str):
            raise InvalidInput(f"{self.expression!r} is not a valid cron expression", field="rule.expression")
        croniter_expression(self.expression, self.dialect)
        try:
            ZoneInfo(self.zone)
        except (ZoneInfoNotFoundError, ValueError, TypeError, OSError) as exc:
            # OSError: the name is looked up as a file (a name past the file system's limit, a
            # directory of zones)
            raise InvalidInput(f"{self.zone!r} is not a known time zone", field="rule.zone") from exc

    @property
    def croniter_expression(self) -> str:
        """The expression croniter evaluates (:func:`croniter_expression`)."""
        return croniter_expression(self.expression, self.dialect)

    @property
    def fixed_time(self) -> bool:
        """Whether the rule names its hours and minutes (neither field starts with ``*``, nor
        is it ``@hourly``): such a rule fires at given wall-clock times of the day."""
        fields = self.croniter_expression.split()
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
            it = croniter(self.croniter_expression, start, max_years_between_matches=50)
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
        doc: dict[str, Any] = {"type": "cron", "expression": self.expression, "zone": self.zone}
        if self.dialect is not None:
            doc["dialect"] = self.dialect
        return _with_grace(doc, self.misfire_grace_ms)

    def occurrences(self, after: int, n: int) -> list[int]:
        """The next ``n`` occurrences after ``after`` (ms; fewer when the rule has no more)."""
        out: list[int] = []
        at: int | None = after
        while len(out) < n and at is not None:
            at = self.next_after(at)
            if at is not None:
                out.append(at)
        return out


Rule: TypeAlias = OnceRule | IntervalRule | CronRule


def parse_rule(doc: Any) -> Rule:
    """Reads ``{type, ...}``; an unknown type or bad field raises :class:`InvalidInput`."""
    if not _is_doc(doc):
        raise InvalidInput("must be a document {type, ...}", field="rule")
    kind = doc.get("type")
    grace = doc.get("misfire_grace_ms")
    for optional in ("misfire_grace_ms", "until") if kind == "interval" else ("misfire_grace_ms",):
        if optional in doc and doc[optional] is None:  # the schema's integer, or left out
            raise InvalidInput("must be an integer (ms) or absent, got None", field=f"rule.{optional}")
    if kind == "once":
        return OnceRule(misfire_grace_ms=grace)
    if kind == "interval":
        return IntervalRule(every_ms=doc.get("every_ms"), until=doc.get("until"), misfire_grace_ms=grace)  # type: ignore[arg-type]
    if kind == "cron":
        dialect = doc.get("dialect")
        if dialect is not None and dialect not in CRON_DIALECTS:
            raise InvalidInput(f"{dialect!r} is not a cron dialect ({', '.join(CRON_DIALECTS)})", field="rule.dialect")
        return CronRule(
            expression=doc.get("expression"),  # type: ignore[arg-type]
            zone=doc.get("zone", "UTC"),
            misfire_grace_ms=grace,
            dialect=dialect,
        )
    raise InvalidInput(f"unknown rule type {kind!r} (once, interval, cron)", field="rule.type")
