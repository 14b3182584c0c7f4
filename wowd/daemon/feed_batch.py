"""A batch of the log read into what the feed's steps need (pure: computed once, reused across
retries), and the naming of a step's non-transient failure (:mod:`wowd.daemon.feed`)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from wowd.config import TimerSettings
from wowd.errors import InvalidInput, LeaseLost, SinkWriteError, SlotStalled, StorageUnavailable, WowdError
from wowd.model import (
    AggregateType,
    Commit,
    HistoryRecord,
    LogEntry,
    TimerCancelled,
    TimerScheduled,
    TimerWrite,
    commit_records,
    net_writes,
    timer_event_from,
    timer_from_event,
)

__all__ = ["Prepared", "StepFailed", "field_of", "prepare_batch", "step"]

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def field_of(error: str | None) -> str:
    """The field an :class:`InvalidInput` message names (``"field: reason"``), else ``unknown``."""
    m = _FIELD.match(error or "")
    return m.group(1) if m else "unknown"


class StepFailed(Exception):
    """A feed step's non-transient failure (``error``); ``record_level`` when the error is about
    the record itself (this document cannot be written), not the store."""

    def __init__(self, step: str, error: WowdError) -> None:
        super().__init__(f"{step}: {error}")
        self.step = step
        self.error = error
        self.record_level = isinstance(error, InvalidInput | SinkWriteError)


@contextmanager
def step(name: str) -> Iterator[None]:
    """Names the step of a non-transient failure; transient ones and a lost lease pass."""
    try:
        yield
    except (StorageUnavailable, LeaseLost, SlotStalled):
        raise
    except WowdError as exc:
        raise StepFailed(name, exc) from exc


@dataclass(slots=True)
class Prepared:
    """A batch read into what each step needs (pure: computed once, reused across retries)."""

    malformed: list[LogEntry]
    rejected: list[tuple[Commit, int, InvalidInput]]
    by_type: dict[AggregateType, list[Commit]]
    timer_writes: list[TimerWrite]
    """The net effect of the batch's timer events (:func:`~wowd.model.net_writes`)."""
    history: list[HistoryRecord] = field(default_factory=list)
    """The timer history's records of the batch's timer events, each commit's (every event, also
    one the net effect leaves out: a schedule cancelled later in the batch was scheduled)."""
    planned: object = None
    """:meth:`FeedWriter.plan` of the batch, when the backend has a feed writer."""
    planned_for: tuple[bool, bool] | None = None
    """What ``planned`` holds: the sinks' documents, the timer writes (a plan made for other
    views is made again)."""


def prepare_batch(entries: Sequence[LogEntry], limits: TimerSettings, partitions: int) -> Prepared:
    """What the steps need of ``entries``. The timer writes of each commit are its timer events in
    order, then a ``cancel_all`` when it deletes its aggregate; their net effect applies the writes
    of a commit in that order (:func:`~wowd.model.net_writes`). A timer event beyond ``limits``
    (its body's size, its rule's interval) is rejected."""
    max_body_bytes, min_interval_ms = limits.max_body_bytes, limits.min_interval_ms
    retention_ms = limits.tombstone_retention_s * 1000
    history: list[HistoryRecord] = []
    malformed: list[LogEntry] = []
    rejected: list[tuple[Commit, int, InvalidInput]] = []
    by_type: dict[AggregateType, list[Commit]] = {}
    writes: list[TimerWrite] = []
    last_type: AggregateType | None = None
    of_type: list[Commit] = []
    for e in entries:
        c = e.commit
        if c is None:
            malformed.append(e)
            continue
        if e.aggregate is not last_type:  # a log read shares one type object per aggregate type
            last_type = e.aggregate
            of_type = by_type.setdefault(last_type, [])
        of_type.append(c)
        events: list[TimerScheduled | TimerCancelled] = []
        for ev in c.events:
            try:
                te = timer_event_from(ev, max_body_bytes=max_body_bytes, min_interval_ms=min_interval_ms)
            except InvalidInput as exc:
                rejected.append((c, e.partition, exc))
                continue
            if isinstance(te, TimerScheduled):
                writes.append(TimerWrite.put(timer_from_event(c, te, partitions)))
                events.append(te)
            elif isinstance(te, TimerCancelled):
                writes.append(TimerWrite.cancel(c.ref, te.key, c.version))
                events.append(te)
        if c.deleted:
            writes.append(TimerWrite.cancel_all(c.ref, c.version))
        if events or c.deleted:
            seq = e.position.get("seq")
            history += commit_records(c, events, retention_ms, position=seq if isinstance(seq, int) else None)
    return Prepared(
        malformed=malformed, rejected=rejected, by_type=by_type, timer_writes=net_writes(writes), history=history
    )
