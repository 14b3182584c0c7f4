"""A feed batch in one transaction on the embedded file (:class:`~wowd.stores.base.FeedWriter`).

The log, the feed's checkpoints, the event sink's documents and the timer view are tables of one
SQLite file, so a batch's writes need not be four transactions: one connection of its own runs
the sink's inserts and stamps, the timer writes, the resumption of the batch's PARKED timers and
the checkpoints under the slot's fence in one ``BEGIN IMMEDIATE`` ... ``COMMIT``. A checkpoint
refused (another holder's higher fence) rolls the whole batch back. Each step is the store's own
code (:meth:`EmbeddedEventSink.plan_rows`, :meth:`EmbeddedTimerView.write_steps`, ...), so the
rows written are those the step-by-step path writes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wowd.metrics import SINK_BULK_SECONDS
from wowd.model import Commit, HistoryRecord, Position, Timer, TimerChange, TimerWrite
from wowd.stores.base import FEED_TRANSACTION, EventSink, FeedApplied
from wowd.stores.embedded.checkpoints import EmbeddedCheckpoints, save_checkpoint_rows
from wowd.stores.embedded.db import SqliteDatabase, SqliteStore
from wowd.stores.embedded.history import record_row, write_records
from wowd.stores.embedded.sink import EmbeddedEventSink, SinkWrite
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring
from wowd.stores.embedded.timer_view import WRITE_CHUNK, EmbeddedTimerView, parked_params

__all__ = ["EmbeddedFeedWriter"]


class _Refused(Exception):
    """A checkpoint of the batch was refused: the transaction is rolled back."""


class EmbeddedFeedWriter(SqliteStore):
    """:class:`~wowd.stores.base.FeedWriter` of the embedded backend, on a connection of its own
    to the stores' file (so the timer loop's calls never queue behind a feed batch in one
    connection's thread; the file's write lock orders the writes)."""

    STORE = "feed"
    CAPABILITIES = (FEED_TRANSACTION,)

    def __init__(
        self,
        db_or_path: SqliteDatabase | str | Path,
        *,
        checkpoints: EmbeddedCheckpoints,
        timers: EmbeddedTimerView,
        firing: EmbeddedTimerFiring,
    ) -> None:
        super().__init__(db_or_path)
        self._checkpoints = checkpoints
        self._timers = timers
        self._firing = firing

    def __repr__(self) -> str:
        return f"EmbeddedFeedWriter({self._db.path!r})"

    async def plan(
        self, records: Sequence[tuple[EventSink, Sequence[Commit]]], timer_writes: Sequence[TimerWrite]
    ) -> _Plan | None:
        """The batch's rows made ready (documents encoded, timer writes checked), to be given to
        :meth:`apply`: the feed makes them while the batch before is written. ``None`` when this
        writer does not take the batch whole."""
        if len(timer_writes) > WRITE_CHUNK or self.path == ":memory:":
            # the timer store's chunks keep the write lock short; a database in memory is one
            # per connection
            return None
        plans: list[tuple[EmbeddedEventSink, SinkWrite]] = []
        for sink, commits in records:
            if not isinstance(sink, EmbeddedEventSink) or sink.path != self.path:
                return None
            plan = sink.plan_rows(commits)
            if plan.bad:
                return None  # the sink step names what it refuses
            plans.append((sink, plan))
        steps = await self._timers.plan_write(timer_writes) if timer_writes else []
        parked = parked_params([c.ref for _sink, commits in records for c in commits])
        return _Plan(plans, steps, parked)

    async def apply(
        self,
        records: Sequence[tuple[EventSink, Sequence[Commit]]],
        timer_writes: Sequence[TimerWrite],
        consumer: str | Sequence[str],
        positions: Mapping[int, Position],
        fence: int,
        *,
        now: int,
        planned: object = None,
        history: Sequence[HistoryRecord] = (),
    ) -> FeedApplied | None:
        ready = planned if isinstance(planned, _Plan) else await self.plan(records, timer_writes)
        if ready is None:
            return None
        plans = [(sink, sink.remember(plan)) for sink, plan in ready.sinks]
        timers, firing = self._timers, self._firing
        checkpoints = self._checkpoints.checkpoint_rows(consumer, positions, fence)
        rows = [record_row(r) for r in history]
        if rows:
            await firing.prepare_history()
        work = functools.partial(_apply, plans, timers, firing, ready.steps, ready.parked, checkpoints, now, rows)
        try:
            created, sink_s, answers, resumed = await self._run("apply", self._db.transaction(work))
        except _Refused:
            return FeedApplied(timer_answers=[], resumed=[], saved=False)
        if plans:
            SINK_BULK_SECONDS.observe(sink_s)
        for (sink, plan), n in zip(plans, created, strict=True):
            sink.written(plan, n)
        return FeedApplied(timer_answers=answers, resumed=resumed, saved=True)


class _Plan:
    """A batch made ready by :meth:`EmbeddedFeedWriter.plan`: per sink its rows (what the sink
    remembers is read when the batch is applied), the timer writes' steps, the PARKED check."""

    __slots__ = ("parked", "sinks", "steps")

    def __init__(
        self,
        sinks: list[tuple[EmbeddedEventSink, SinkWrite]],
        steps: list[tuple[str, tuple[Any, ...]]],
        parked: list[tuple[Any, ...]],
    ) -> None:
        self.sinks = sinks
        self.steps = steps
        self.parked = parked


def _apply(
    plans: Sequence[tuple[EmbeddedEventSink, SinkWrite]],
    timers: EmbeddedTimerView,
    firing: EmbeddedTimerFiring,
    steps: Sequence[tuple[str, tuple[Any, ...]]],
    parked: Sequence[tuple[Any, ...]],
    checkpoints: Sequence[tuple[Any, ...]],
    now: int,
    history: Sequence[tuple[Any, ...]],
    conn: sqlite3.Connection,
) -> tuple[list[int], float, list[int], list[Timer]]:
    """The batch in the caller's transaction: documents created per sink, the seconds the sinks
    took, the timer writes' answers (and the history's rows of their commits), the PARKED timers
    resumed."""
    started = time.perf_counter()
    created = [plan.work(conn) for _sink, plan in plans]
    sink_s = time.perf_counter() - started
    answers = timers.write_steps(steps, conn) if steps else []
    write_records(timers.context, history, conn)
    resumed: list[Timer] = []
    if parked:
        resumed = timers.parked_timers(parked, conn)
        if resumed:
            firing.settle_changes([TimerChange.resume(t, due_at=now) for t in resumed], conn)
    if save_checkpoint_rows(checkpoints, conn) != len(checkpoints):
        raise _Refused
    return created, sink_s, answers, resumed
