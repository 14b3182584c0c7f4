"""What the timer loop decides without I/O (:mod:`wowd.daemon.timers`): a recurring timer's
next occurrence, a retry's delay, the settle changes of a round's outcomes and their counting,
and when the loop wakes after a round (:func:`plan_wait`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from wowd import metrics
from wowd.config import TimerSettings
from wowd.delivery import Delivered, DeliveryLog, Fail, Outcome, Park, Retry, delivery_log, target_of
from wowd.model import CronRule, HistoryRecord, IntervalRule, Timer, TimerChange, attempt_record, misfire_reason
from wowd.retry import Backoff

__all__ = [
    "BUDGET_SPENT",
    "attempt_records",
    "MAX_IDLE_S",
    "ReadFirst",
    "Round",
    "Sleep",
    "count_misfired",
    "count_outcomes",
    "next_occurrence",
    "outcome_changes",
    "plan_wait",
    "retry_delay_s",
    "wake_time",
    "wants_next_due",
]

log = logging.getLogger("wowd.daemon.timers")
"""The timer loop's logger (the misfire lines are the loop's)."""

MAX_IDLE_S = 0.5
"""The longest sleep between two due reads: how late a timer the :class:`~wowd.daemon.waker.Waker`
is not told of fires (one stored by another process, or a parked timer a feed resumed)."""
BUDGET_SPENT = "retry budget spent"
"""The start of the reason of a timer failed once its retries are spent."""


def next_occurrence(timer: Timer, now: int) -> int | None:
    """The next due time of a recurring timer after a fire; occurrences already in the past are
    coalesced into the first one after ``now`` (``None``: the rule has no more)."""
    rule = timer.rule
    nxt = rule.next_after(timer.scheduled_at)
    if nxt is None or nxt > now:
        return nxt
    if isinstance(rule, IntervalRule):
        missed = (now - timer.scheduled_at) // rule.every_ms
        cand = timer.scheduled_at + missed * rule.every_ms
        while cand <= now:
            cand += rule.every_ms
        return cand if rule.until is None or cand <= rule.until else None
    if isinstance(rule, CronRule):
        return rule.next_after(now)
    return None


def wake_time(now: int, next_due: Iterable[int | None], lookahead_ms: int, max_idle_s: float | None = None) -> int:
    """When the loop wakes after a round that claimed every timer due by ``now + lookahead``: when
    the earliest of ``next_due`` (the store's next due time, the earliest put since) comes within
    the lookahead, and at the latest after ``max_idle_s`` (default :data:`MAX_IDLE_S`), the
    safety net for timers of these partitions stored by another process."""
    idle_ms = int((MAX_IDLE_S if max_idle_s is None else max_idle_s) * 1000)
    wake = now + idle_ms
    for due in next_due:
        if due is not None and due - lookahead_ms < wake:
            wake = due - lookahead_ms
    return wake


def retry_delay_s(attempts: int, settings: TimerSettings, hint_s: float = 0.0) -> float:
    """Exponential backoff with jitter: ``base * 2**attempts`` capped, scaled by [0.5, 1]; at least
    the target's hint."""
    return max(hint_s, Backoff(settings.backoff_base_s, settings.backoff_max_s, jitter=True)(attempts))


def outcome_changes(
    results: Sequence[tuple[Timer, Outcome, int]], fence: int, settings: TimerSettings
) -> list[TimerChange]:
    """The settle changes of a round's outcomes (``(timer as claimed, outcome, fire time ms)``)."""
    changes: list[TimerChange] = []
    for t, outcome, at in results:
        if isinstance(outcome, Delivered):
            changes.append(TimerChange.fired(t, fence=fence, next_due=next_occurrence(t, at)))
        elif isinstance(outcome, Retry):
            if t.attempts + 1 >= settings.max_attempts:
                reason = f"{BUDGET_SPENT} after {t.attempts + 1} attempts: {outcome.reason}"
                changes.append(TimerChange.fail(t, fence=fence, reason=reason))
            else:
                delay = retry_delay_s(t.attempts, settings, outcome.after_s)
                changes.append(TimerChange.retry(t, fence=fence, due_at=at + int(delay * 1000), error=outcome.reason))
        elif isinstance(outcome, Park):
            changes.append(TimerChange.park(t, fence=fence, reason=outcome.reason, at=at))
        elif isinstance(outcome, Fail):
            changes.append(TimerChange.fail(t, fence=fence, reason=outcome.reason))
    return changes


_SETTLED_AS = {"fired": "delivered", "retry": "retry", "park": "park", "fail": "fail"}
"""The outcome an attempt's history record names, by the kind of its settle change."""


def attempt_records(
    results: Sequence[tuple[Timer, Outcome, int]], changes: Sequence[TimerChange], retention_ms: int
) -> list[HistoryRecord]:
    """The history records of a round's outcomes (:func:`outcome_changes` of ``results``, one
    change per outcome, in order): what was settled, with the reason, and what the gateway saw of
    the exchange (status, latency, the answer's first characters)."""
    return [
        attempt_record(
            t,
            _SETTLED_AS[c.kind],
            at,
            retention_ms,
            status=o.status,
            latency_ms=o.latency_ms,
            reason=c.error,
            answer=o.answer,
        )
        for (t, o, at), c in zip(results, changes, strict=True)
    ]


_COUNTED = {"retry": metrics.TIMERS_RETRIED, "park": metrics.TIMERS_PARKED, "fail": metrics.TIMERS_FAILED}
"""The settle changes counted by kind (besides the fired ones)."""


def count_outcomes(results: Sequence[tuple[Timer, Outcome, int]], changes: Sequence[TimerChange]) -> None:
    """Counts what a round's outcomes did: fired (with their fire lag), retried, parked, failed."""
    metrics.count_fired(
        (target_of(t), t.scheduled_at, at) for t, outcome, at in results if isinstance(outcome, Delivered)
    )
    counted: Counter[tuple[str, str]] = Counter()  # (kind, target): one label lookup each
    for c in changes:
        if c.kind in _COUNTED:
            counted[c.kind, target_of(c.timer)] += 1
        if c.kind == "fail" and c.error is not None and c.error.startswith(BUDGET_SPENT):
            # the gateway logged a Retry; that it is given up is the loop's decision
            delivery_log.outcome(target_of(c.timer), Fail(reason=c.error), c.timer)
    for (kind, target), n in counted.items():
        _COUNTED[kind].labels(target=target).inc(n)


@dataclass(frozen=True, slots=True)
class _Skipped:
    reason: str


class _MisfireLog(DeliveryLog):
    _LEVELS = {_Skipped: (logging.INFO, "an occurrence of a timer for %s was skipped: %s (%s)%s")}


_MISFIRE_LOG = _MisfireLog(log)
"""At most one line per target every 10 s for the occurrences skipped past their grace."""


def count_misfired(t: Timer, at: int) -> None:
    """Counts (and logs, rate-limited) an occurrence skipped past its misfire grace."""
    metrics.TIMERS_MISFIRED.labels(target=target_of(t)).inc()
    why = misfire_reason(t.rule, t.scheduled_at, at)
    _MISFIRE_LOG.outcome(target_of(t), _Skipped(why), t)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the sleep decision


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """What a round did: it read every timer due by ``until`` unless ``full``."""

    until: int
    taken: int = 0
    full: bool = False
    claims_ahead: bool = True
    """Whether its timers were taken up to the lookahead ahead of their due time (else at it)."""
    skipped: int = 0
    """Due timers the log check left: the feed has a commit of their aggregate to apply first."""
    read_bound: bool = True
    """Whether ``until`` was bounded by the feed's last read of the log's head (a round that asks
    the log directly at the due times claims up to the lookahead past now)."""


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep until ``wake_at`` (ms); a put due before ``wake_before`` wakes the loop earlier."""

    wake_at: int
    wake_before: int


@dataclass(frozen=True, slots=True)
class ReadFirst:
    """A timer due at ``first`` is within the lookahead but beyond the feed's last read of the
    log's head: ask the log for a read, then wait until the watermark reaches ``want_watermark``
    (an idle period at most)."""

    first: int
    want_watermark: int


def wants_next_due(r: Round, put_next: int | None, max_idle_s: float | None = None) -> bool:
    """Whether the loop reads the store's next due time before it sleeps: not when its rounds
    fire at the due time and a put of this process is due within an idle period (the round at
    that time reads every timer due by then; one the waker was not told of fires at most an idle
    period late, as with the idle poll)."""
    idle_s = MAX_IDLE_S if max_idle_s is None else max_idle_s
    return r.claims_ahead or put_next is None or put_next > r.until + int(idle_s * 1000)


def plan_wait(
    now: int,
    r: Round,
    next_due: Collection[int | None],
    lookahead_ms: int,
    max_idle_s: float | None = None,
) -> Sleep | ReadFirst:
    """How the loop waits after a round ``r`` that read every timer due by ``r.until``, given
    the next due times known (the store's, the earliest put since).

    A round takes half a lookahead of timers, half a lookahead before its first is due: the next
    one once half the lookahead has passed, not as soon as the next timer comes within it (a
    whole lookahead claimed when its first timer is due would delay that timer by the claim).
    An idle period at most between two reads (timers the waker was not told of)."""
    nexts = [d for d in next_due if d is not None]
    first = min(nexts, default=None)
    look = lookahead_ms if r.claims_ahead else 0
    idle_s = MAX_IDLE_S if max_idle_s is None else max_idle_s
    idle_ms = int(idle_s * 1000)
    halfway = r.until - lookahead_ms // 2
    if (
        r.claims_ahead
        and r.read_bound
        and first is not None
        and r.until < first <= now + lookahead_ms
        and now >= halfway
    ):
        return ReadFirst(first, first - lookahead_ms)
    wake_at = wake_time(now, nexts, look, idle_s)
    if r.claims_ahead and first is not None and first > r.until:
        wake_at = max(wake_at, min(halfway, now + idle_ms))
    return Sleep(wake_at, wake_at + look)
