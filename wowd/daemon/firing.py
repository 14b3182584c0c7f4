"""When a due timer fires: the fire rule and the round strategies that apply it
(docs/architecture.md, "Firing").

**The fire rule.** A due timer fires when no commit of its owner that may change it is past what
the timer view applied: the feed has read (or applied) every commit appended before its due time
(the :class:`~wowd.daemon.waker.Waker`'s read mark or watermark), or the log, asked after the due
time, holds no commit of its owner above the timer's version
(:meth:`~wowd.stores.base.Log.committed_after`, the one question a backend answers for the
rule). A timer the log holds a later commit of waits for the feed to apply it; a cancel, a put of
a later version or a delete appended before the due time therefore always wins.

**Round strategies** (:class:`RoundStrategy`), one per slot, chosen once where the replica is
assembled (:func:`choose`):

- :class:`ClaimDeliverSettle`: claims the due timers ahead (FIRING, the slot's fence), hands each
  to the delivery stream (:class:`~wowd.daemon.stream.DeliveryStream`) at its due time once the
  rule lets it fire, and settles each outcome as it comes.
- :class:`OutboxRounds`: where the backend offers the outbox shortcut
  (:class:`~wowd.stores.base.OutboxShortcut`, the embedded file) and the gateway is the outbox:
  the due timers are read, checked by the rule, written to the outbox and settled in one
  transaction, with no claim and none taken ahead.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import anyio
from anyio.abc import TaskGroup

from wowd import metrics
from wowd.clock import now_ms
from wowd.config import TimerSettings, WowdSettings
from wowd.delivery import CommandGateway, Outcome, Retry
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import HistoryRecord, Timer, TimerChange, attempt_record, misfire_reason, misfired
from wowd.ratelog import RateLimitedLog
from wowd.stores.base import (
    OUTBOX_SHORTCUT,
    Backend,
    OutboxRound,
    OutboxShortcut,
    OwnerProbe,
    TimerFiring,
    TimerHistory,
)

from .leases import HeldSlot
from .stall import Stall
from .stream import DeliveryStream, Limits, Settler
from .timer_plan import (
    MAX_IDLE_S,
    Round,
    attempt_records,
    count_misfired,
    count_outcomes,
    next_occurrence,
    outcome_changes,
)
from .timers import Logx, Nudge, RoundStrategy, TimerLoop
from .waker import Waker, owner_key

__all__ = ["ClaimDeliverSettle", "Firing", "LogGate", "OutboxRounds", "choose"]

log = logging.getLogger("wowd.daemon.timers")
"""The timer loop's logger (the rounds are the loop's)."""

_DELIVERY_ORDER = attrgetter("scheduled_at", "timer_id")

SETTLE_TIMEOUT_S = 10.0
"""How long the last settle of a stopping loop may take."""
READ_WAIT_S = 5.0
"""How long a claimed timer waits for the feed to read the log past its due time before it is
settled back undelivered."""
CHANGED = "not delivered: changed by the log before its due time"
STOPPED = "not delivered: stopped"
NOT_READ = f"not delivered: the log was not read past its due time within {READ_WAIT_S:g}s"
GATE_GRACE_S = 0.02
"""How long a due group waits for the feed to read the log past it (having asked the log to
look at its head) before the log is asked directly (:class:`LogGate`)."""
FEED_BEHIND_S = 2.0
"""The log is asked directly only while the feed has read the log up to its head within this
long: a feed further behind is waited for (its watermark), as is a log with no check."""
WAITING_FEED = "feed_behind"
WAITING_CHECK = "log_check"
WAITING_LIMIT = "target_limit"
WAITING_CIRCUIT = "circuit_open"
"""The reasons of ``wowd_timers_waiting``: due timers held for the feed to read the log past
their due time; held for the log check (asked, or a commit of their aggregate it found, until the
feed reads it); queued for a delivery slot of their target; to be retried because their
target's circuit was open (no request sent)."""
CIRCUIT_WAIT_FORGET_S = 600.0
"""A timer counted as waiting for an open circuit is forgotten this long after it was (its retry
outcome not followed by another: cancelled or taken over meanwhile)."""
SETTLE = "settle"
"""The settle step of a loop's :class:`Stall`."""
HISTORY_BACKLOG = 20_000
"""Attempt records kept for the next settle group while the history store is unavailable (more
are counted in ``wowd_timer_history_unrecorded_total`` and dropped: the history is a record of
the deliveries, never a condition of them)."""

_history_log = RateLimitedLog(log)


LogGate = Callable[[Sequence[OwnerProbe]], Awaitable[set[int]]]
"""The log's check at a due time (:meth:`~wowd.stores.base.Log.committed_after`)."""


class ClaimDeliverSettle:
    """Claims due timers ahead, hands each to the delivery stream at its due time once the fire
    rule lets it fire, and settles each outcome as it comes (grouped).

    ``claim_due(partitions, until, limit)`` claims the due timers (FIRING, ``due_at`` = claim
    expiry, the slot's fence and owner key) up to ``until`` = the lookahead past the earlier of
    now and the feed's last read of the log's head (past now when the log is asked at the due
    times, ``gate``: the feed has read the log's head lately). A claimed timer is handed to the
    delivery stream (:class:`~wowd.daemon.stream.DeliveryStream`, under ``limits``) at its
    scheduled time, once the feed has **read** the log past it (the loop asks the log to look at
    its head at the due time, :meth:`Waker.read_past`) or, while the feed reads the log's head,
    once the log asked after the due time holds no commit of its owner above its version
    (``gate``: what a quiet MongoDB log's watermark would make wait for seconds), and only if no
    batch the feed read after the claim began commits to its owner (:meth:`Waker.changed_since`):
    the claimed copy of a timer the log changed is settled back (a no-op where the feed changed
    the timer). Timers claimed and not yet settled are never claimed again, however long their
    delivery takes; at most ``2 * timers.batch`` are claimed and not yet settled, claiming
    refilling a batch at a time as outcomes are written."""

    def __init__(
        self,
        settings: TimerSettings,
        store: TimerFiring,
        gateway: CommandGateway,
        limits: Limits,
        nudge: Nudge,
        gate: LogGate | None = None,
        history: TimerHistory | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._gateway = gateway
        self._limits = limits
        self._nudge = nudge
        self._gate = gate
        self._history = history
        """Where each attempt is recorded, with the settle group of its outcome (``None``: not)."""
        self._retention_ms = settings.tombstone_retention_s * 1000
        self._attempts: list[HistoryRecord] = []
        """Attempt records of the outcomes made into changes, written with the next settle."""
        """The log's own check at a due time (:meth:`~wowd.stores.base.Log.committed_after`),
        instead of waiting for the feed to read past it; ``None``: the feed is waited for."""
        self._waiting: Counter[str] = Counter()
        """Due timers held, by reason (``wowd_timers_waiting``)."""
        self._short_circuited: dict[str, float] = {}
        """Timers whose last outcome was a retry without a request (the circuit open), with when
        (``anyio.current_time()``)."""
        self._capacity = 2 * settings.batch
        self._claimed: dict[str, Timer] = {}
        """Claimed, with no outcome or release recorded yet."""
        self._unsettled: set[str] = set()
        """Claimed and not settled yet (never claimed again)."""
        self._results: list[tuple[Timer, Outcome, int]] = []
        """Outcomes recorded, not yet made into changes (:meth:`_outcome_changes`)."""
        self._room = anyio.Event()
        self._gauges: dict[str, Any] = {}
        """``wowd_timers_waiting`` of this slot, by reason (looked up once)."""
        self._held: HeldSlot | None = None
        self._waker: Waker | None = None
        self._settler: Settler | None = None
        self._stream: DeliveryStream | None = None
        self._work: TaskGroup | None = None

    @asynccontextmanager
    async def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AsyncIterator[None]:
        self._held, self._waker = held, waker
        self._gauges = {
            reason: metrics.TIMERS_WAITING.labels(slot=str(held.slot), reason=reason)
            for reason in (WAITING_FEED, WAITING_CHECK, WAITING_LIMIT, WAITING_CIRCUIT)
        }
        settler = self._settler = Settler(
            self._store.settle if self._history is None else self._settle,
            self._written,
            logx=logx,
            on_failure=lambda exc: stall.failed(SETTLE, exc, logx),
            on_success=lambda: stall.progressed(logx, SETTLE),
            collect=self._outcome_changes,
        )
        stream = self._stream = DeliveryStream(
            self._gateway,
            self._limits,
            self._record,
            stopped=lambda: held.stopping,
            skip=self._misfired,
        )
        held.on_stop(stream.wake)
        held.on_stop(lambda: self._room.set())  # the event of the moment: round() replaces it
        async with anyio.create_task_group() as side:
            side.start_soon(settler.run)
            try:
                async with anyio.create_task_group() as work:
                    stream.bind(work)
                    self._work = work
                    yield
            finally:
                stream.left()
                self._release(list(self._claimed.values()), STOPPED)
                for gauge in self._gauges.values():
                    gauge.set(0)
                side.cancel_scope.cancel()
                if len(settler) and not held.valid:
                    logx.info("lease lapsed while delivering: settling %d outcomes under their claims", len(settler))
                await settler.drain(SETTLE_TIMEOUT_S)

    async def round(self, held: HeldSlot, waker: Waker, parts: frozenset[int]) -> Round:
        s = self._settings
        # a whole batch at a time, once at most one batch is claimed and unsettled: a claim reads
        # past the timers it excludes, so claims of a few timers each would read the unsettled
        # ones again and again
        while len(self._unsettled) > self._capacity - s.batch and not held.stopping:
            if self._room.is_set():
                self._room = anyio.Event()
            await self._room.wait()
        assert waker.read_mark is not None
        now = now_ms()
        # claimed up to the lookahead past the feed's read of the log's head; past now when the
        # log is asked at the due times (the feed has read it lately)
        read_bound = not self._gated(waker)
        until = (min(now, waker.read_mark) if read_bound else now) + s.lookahead_ms
        limit = s.batch
        batch_mark = waker.hold()
        try:
            held.check()
            claimed = await self._store.claim_due(
                parts,
                until,
                limit,
                owner_key=held.owner_key,
                fence=held.fence,
                claim_until=now_ms() + int(s.claim_ttl_s * 1000),
                exclude=self._unsettled,
            )
        except BaseException:
            waker.release(batch_mark)
            raise
        metrics.TIMERS_CLAIMED_LAST_ROUND.set(len(claimed))
        if not claimed:
            waker.release(batch_mark)
            return Round(until=until, read_bound=read_bound)
        metrics.SETTLE_BATCH.observe(len(claimed))
        for t in claimed:
            self._claimed[t.timer_id] = t
            self._unsettled.add(t.timer_id)
        assert self._work is not None
        self._work.start_soon(self._dispatch, held, claimed, waker, batch_mark)
        return Round(until=until, taken=len(claimed), full=len(claimed) >= limit, read_bound=read_bound)

    def _gated(self, waker: Waker) -> bool:
        """Whether the log is asked directly at the due times: it has a check, and the feed has
        read it up to its head within :data:`FEED_BEHIND_S`."""
        return self._gate is not None and anyio.current_time() - waker.read_at <= FEED_BEHIND_S

    async def _dispatch(self, held: HeldSlot, claimed: list[Timer], waker: Waker, batch_mark: int) -> None:
        """Hands a claimed batch to the stream in scheduled order, each timer not before its
        scheduled time (claimed up to the lookahead early), none once the slot stops. The wait
        for a scheduled time is bounded by the lookahead on the monotonic clock: a wall clock
        stepped back never holds a claimed batch.

        A due timer is handed on once the feed has read the log past its due time, or, when the
        feed has not (asking the log to look at its head, :data:`GATE_GRACE_S`), once the log
        itself, asked after the due time (:meth:`_check`), holds no commit of its aggregate that
        may change it; and never when a batch the feed read after the claim began holds a commit
        of its aggregate: a put, cancel or delete appended before the due time may have changed
        it (settled back, under its claim). A timer the log check holds back waits for the feed
        to read that commit (then settled back) or past its due time; the feed's read is waited
        for at most :data:`READ_WAIT_S` (a commit the check found: half the claim's time to
        live, at least that), then it is settled back undelivered."""
        assert self._stream is not None
        pending = sorted(claimed, key=_DELIVERY_ORDER)
        latest = anyio.current_time() + self._settings.lookahead_ms / 1000
        held_back_s = max(READ_WAIT_S, self._settings.claim_ttl_s / 2)
        waiting: list[tuple[Timer, float, str]] = []
        """Due timers held for the feed: ``(timer, until when, reason)``."""
        i = 0
        try:
            while not held.stopping:
                now = now_ms()
                if waiting:
                    waiting = self._resolve(held, waiting, waker, batch_mark, now)
                if i == len(pending) and not waiting:
                    break
                late = anyio.current_time() >= latest
                j = i
                while j < len(pending) and (late or pending[j].scheduled_at <= now):
                    j += 1
                if j == i:
                    wait_s = float("inf")
                    if i < len(pending):  # slightly ahead (lookahead): handed on at its scheduled time
                        wait_s = min((pending[i].scheduled_at - now) / 1000, latest - anyio.current_time())
                    if waiting:  # the feed's next read, or a due time, whichever first
                        self._nudge()
                        until = min(w[1] for w in waiting)
                        await waker.next_read(min(wait_s, MAX_IDLE_S, until - anyio.current_time()))
                    else:
                        with anyio.move_on_after(max(0.0, wait_s)):
                            await held.stop_event.wait()
                    continue
                group = pending[i:j]
                i = j
                # every commit appended before the group's due times (or, on a wall clock stepped
                # back, before now) read by the feed, or the log asked after them
                read_to = min(group[-1].scheduled_at, now)
                if waker.read_mark is None or waker.read_mark < read_to:
                    group, held_back = await self._read_or_check(group, waker, read_to)
                    t0 = anyio.current_time()
                    for t, reason in held_back:
                        waiting.append((t, t0 + (held_back_s if reason == WAITING_CHECK else READ_WAIT_S), reason))
                        self._wait_count(reason, 1)
                self._hand_on(held, group, waker, batch_mark)
        finally:
            for _t, _until, reason in waiting:
                self._wait_count(reason, -1)
            waker.release(batch_mark)

    async def _read_or_check(
        self, group: list[Timer], waker: Waker, read_to: int
    ) -> tuple[list[Timer], list[tuple[Timer, str]]]:
        """A due group the feed has not read the log past: the timers to hand on now, and those
        held for the feed with the reason. Asks the log to look at its head and waits a moment
        (:data:`GATE_GRACE_S`); then, with the log check and a feed that read the log's head
        lately, asks the log (:meth:`_check`); else holds them all for the feed."""
        self._nudge()
        if await waker.read_past(read_to, GATE_GRACE_S if self._gate is not None else 0.0):
            return group, []
        if not self._gated(waker):
            return [], [(t, WAITING_FEED) for t in group]
        found = await self._check(group)
        if found is None:
            return [], [(t, WAITING_FEED) for t in group]
        return [t for n, t in enumerate(group) if n not in found], [
            (t, WAITING_CHECK) for n, t in enumerate(group) if n in found
        ]

    async def _check(self, group: Sequence[Timer]) -> set[int] | None:
        """The log check of a due group, asked after their due times: the indexes of the timers
        whose aggregate the log holds a commit of past the timer's version that may change it
        (:meth:`~wowd.stores.base.Log.committed_after`); ``None`` when the log does not answer
        (the feed is waited for instead)."""
        assert self._gate is not None and self._held is not None
        self._wait_count(WAITING_CHECK, len(group))
        try:
            return await self._gate([OwnerProbe(t.owner, t.version, t.key) for t in group])
        except StorageError as exc:
            log.warning("log check of %d due timers failed (waiting for the feed instead): %s", len(group), exc,
                        extra=self._held.log_extra())  # fmt: skip
            return None
        finally:
            self._wait_count(WAITING_CHECK, -len(group))

    def _resolve(
        self, held: HeldSlot, waiting: list[tuple[Timer, float, str]], waker: Waker, batch_mark: int, now: int
    ) -> list[tuple[Timer, float, str]]:
        """The timers held for the feed: settled back once a batch the feed read after the claim
        holds a commit of their aggregate, handed on once the feed read the log past their due
        time, settled back undelivered once held too long; answers those still held."""
        kept: list[tuple[Timer, float, str]] = []
        ready: list[Timer] = []
        expired: list[Timer] = []
        t_now = anyio.current_time()
        read_mark = waker.read_mark
        for entry in waiting:
            t, until, reason = entry
            if waker.changed_since(batch_mark, owner_key(t.owner)) or (
                read_mark is not None and read_mark >= min(t.scheduled_at, now)
            ):
                ready.append(t)
            elif t_now >= until:
                expired.append(t)
            else:
                kept.append(entry)
                continue
            self._wait_count(reason, -1)
        self._release(expired, NOT_READ)
        self._hand_on(held, ready, waker, batch_mark)
        return kept

    def _hand_on(self, held: HeldSlot, group: Sequence[Timer], waker: Waker, batch_mark: int) -> None:
        """Hands ``group`` to the stream but the timers a batch the feed read after the claim
        commits to (settled back: the log changed them)."""
        if not group:
            return
        assert self._stream is not None
        ready: list[Timer] = []
        changed: list[Timer] = []
        for t in group:
            (changed if waker.changed_since(batch_mark, owner_key(t.owner)) else ready).append(t)
        held.check()
        self._release(changed, CHANGED)
        if ready:
            self._stream.put(ready)
            self._count_queued()

    def _wait_count(self, reason: str, n: int) -> None:
        """``wowd_timers_waiting{slot, reason}`` moved by ``n``."""
        assert self._held is not None
        self._waiting[reason] += n
        self._gauges[reason].set(self._waiting[reason])

    def _record(self, t: Timer, outcome: Outcome) -> None:
        """An outcome from the stream, kept for the settler's next group."""
        self._claimed.pop(t.timer_id, None)
        self._results.append((t, outcome, now_ms()))
        self._settler.note()  # type: ignore[union-attr]
        short = self._short_circuited
        if isinstance(outcome, Retry) and outcome.circuit_open:
            short[t.timer_id] = anyio.current_time()
        elif short:
            short.pop(t.timer_id, None)

    def _count_queued(self) -> None:
        """``wowd_timers_waiting`` of the timers queued for a delivery slot of their target and
        of those to be retried because their target's circuit was open (as timers are handed on,
        and as each group of outcomes is taken)."""
        assert self._stream is not None
        short = self._short_circuited
        if short:
            forget = anyio.current_time() - CIRCUIT_WAIT_FORGET_S
            for timer_id in [i for i, at in short.items() if at < forget]:
                del short[timer_id]
        self._gauges[WAITING_LIMIT].set(self._stream.queued)
        self._gauges[WAITING_CIRCUIT].set(len(short))

    def _outcome_changes(self) -> list[TimerChange]:
        """The settle changes of the outcomes recorded since the last group, counted (and their
        history records made, written with them)."""
        assert self._held is not None
        self._count_queued()
        results, self._results = self._results, []
        changes = outcome_changes(results, self._held.fence, self._settings)
        count_outcomes(results, changes)
        if self._history is not None:
            self._attempts += attempt_records(results, changes, self._retention_ms)
        return changes

    async def _settle(self, changes: list[TimerChange]) -> int:
        """A settle group, then the history records of the attempts made since the last one (one
        write each). A history store that fails is logged and counted, its records kept for the
        next group while it is unavailable (up to :data:`HISTORY_BACKLOG`): the settle never
        waits for it."""
        written = await self._store.settle(changes)
        records, self._attempts = self._attempts, []
        if records:
            assert self._history is not None
            try:
                await self._history.append(records)
            except StorageError as exc:
                keep = isinstance(exc, StorageUnavailable) and len(records) <= HISTORY_BACKLOG
                if keep:
                    self._attempts = records + self._attempts
                else:
                    metrics.HISTORY_UNRECORDED.inc(len(records))
                _history_log.log(
                    "history",
                    logging.WARNING,
                    "timer history: %d attempt records %s: %s",
                    len(records),
                    "not written yet (kept for the next settle)" if keep else "not written",
                    exc,
                )
        return written

    def _misfired(self, t: Timer) -> bool:
        """Whether ``t``, its turn come, is past its rule's misfire grace: then it is settled as
        an occurrence that passed (a one-shot timer done, a recurring one at its next occurrence
        after now), not delivered, and counted."""
        at = now_ms()
        if not misfired(t.rule, t.scheduled_at, at):
            return False
        assert self._held is not None and self._settler is not None
        self._claimed.pop(t.timer_id, None)
        count_misfired(t, at)
        if self._history is not None:
            why = misfire_reason(t.rule, t.scheduled_at, at)
            self._attempts.append(attempt_record(t, "misfired", at, self._retention_ms, reason=why))
        self._settler.add([TimerChange.fired(t, fence=self._held.fence, next_due=next_occurrence(t, at))])
        return True

    def _release(self, timers: Sequence[Timer], reason: str) -> None:
        """Settles back claimed timers that were not delivered."""
        if not timers:
            return
        assert self._held is not None and self._settler is not None
        now = now_ms()
        fence = self._held.fence
        for t in timers:
            self._claimed.pop(t.timer_id, None)
        self._settler.add([TimerChange.release(t, fence=fence, due_at=now, reason=reason) for t in timers])

    def _written(self, changes: list[TimerChange], written: int) -> None:
        """After a settle call: the timers may be claimed again, the stream has room, and the
        waker knows the new due times."""
        assert self._waker is not None and self._stream is not None
        if written >= 0:
            metrics.SETTLE_BATCH.observe(len(changes))
            if written < len(changes):
                metrics.SETTLE_SKIPPED.inc(len(changes) - written)
        outcomes = 0
        waker = self._waker
        for c in changes:
            self._unsettled.discard(c.timer.timer_id)
            if c.kind == "release":
                continue
            outcomes += 1  # recorded or skipped by the stream: its place in the window is free
            if c.kind == "retry" and c.due_at is not None:
                waker.maybe_wake(c.due_at)
            elif c.kind == "fired" and c.next_due is not None:
                waker.maybe_wake(c.next_due)
        self._stream.settled(outcomes)
        self._room.set()


class OutboxRounds:
    """The outbox gateway's rounds through the backend's outbox shortcut
    (:class:`~wowd.stores.base.OutboxShortcut`): each round reads the timers due by now, applies
    the fire rule in its transaction (those due by the feed's watermark fire; one due after it
    fires where the log holds no commit of its owner above its version), writes them to the
    outbox and settles them, with no claim; nothing is taken ahead. A timer the rule leaves is
    taken again once the feed has applied its next batch."""

    def __init__(self, settings: TimerSettings, shortcut: OutboxShortcut, *, history: bool = False) -> None:
        self._settings = settings
        self._shortcut = shortcut
        self._history_retention_ms = settings.tombstone_retention_s * 1000 if history else None

    @asynccontextmanager
    async def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AsyncIterator[None]:
        yield

    async def round(self, held: HeldSlot, waker: Waker, parts: frozenset[int]) -> Round:
        """Fires the timers due by now the rule lets fire, counted and told to the waker as a
        delivered and settled round is."""
        assert waker.watermark is not None  # the loop runs rounds once the feed reached the log's head
        held.check()
        at = now_ms()
        done = await self._shortcut.fire_into_outbox(
            OutboxRound(
                partitions=parts,
                at=at,
                read_to=waker.watermark,
                limit=self._settings.batch,
                owner_key=held.owner_key,
                fence=held.fence,
                next_due=next_occurrence,
                deadline=held.deadline(),
                history_retention_ms=self._history_retention_ms,
            )
        )
        fired = done.fired
        metrics.TIMERS_CLAIMED_LAST_ROUND.set(len(fired))
        if fired:
            metrics.SETTLE_BATCH.observe(len(fired))
            metrics.count_fired((f.target, f.scheduled_at, at) for f in fired if not f.misfired)
            for f in fired:
                if f.next_due is not None:
                    waker.maybe_wake(f.next_due)
                if f.misfired:
                    if f.timer is not None:
                        count_misfired(f.timer, at)
                    else:
                        metrics.TIMERS_MISFIRED.labels(target=f.target).inc()
        if len(fired) >= self._settings.batch:
            return Round(until=at, taken=len(fired), full=True)
        # every timer due by ``at`` was read (not by now: one due since is still to fire)
        return Round(until=at, taken=len(fired), claims_ahead=False, skipped=done.left)


@dataclass(frozen=True, slots=True, kw_only=True)
class Firing:
    """How a replica fires, chosen once where it is assembled (:func:`choose`): :meth:`strategy`
    makes the round strategy of each slot it holds."""

    settings: TimerSettings
    timers: TimerFiring
    gateway: CommandGateway
    limits: Limits
    nudge: Nudge
    gate: LogGate | None
    """The log's answer to the fire rule (:meth:`~wowd.stores.base.Log.committed_after`)."""
    shortcut: OutboxShortcut | None = None
    """The outbox gateway's rounds in one transaction each, where the backend offers them."""
    history: TimerHistory | None = None
    """Where each attempt is recorded (``None``: no history kept). The outbox shortcut's rounds
    record theirs in their own transaction (the history is in the same file)."""

    def strategy(self) -> RoundStrategy:
        """The round strategy of one slot (each holds the slot's claims and deliveries)."""
        if self.shortcut is not None:
            return OutboxRounds(self.settings, self.shortcut, history=self.history is not None)
        return ClaimDeliverSettle(
            self.settings, self.timers, self.gateway, self.limits, self.nudge, self.gate, self.history
        )

    def loop(self) -> TimerLoop:
        """The timer loop of one slot, over its own round strategy."""
        return TimerLoop(self.settings, self.timers, self.strategy(), self.nudge, history=self.history)


def choose(settings: WowdSettings, backend: Backend, gateway: CommandGateway, limits: Limits) -> Firing:
    """The firing of a replica: the outbox shortcut's rounds where the backend offers it, the
    gateway is the outbox and ``outbox.fast_path`` is on; else claim, deliver and settle, the
    log asked at the due times."""
    outbox = settings.gateway.kind == "outbox" and settings.outbox.fast_path
    shortcut = backend.capability(OUTBOX_SHORTCUT) if outbox else None
    return Firing(
        settings=settings.timers,
        timers=backend.firing,
        gateway=gateway,
        limits=limits,
        nudge=backend.log.nudge,
        gate=backend.log.committed_after,
        shortcut=shortcut,
        history=backend.history,
    )
