"""The timer loop of one held slot (``docs/architecture.md``, "Firing").

On start it ends the claims a previous holder of the slot left (``TimerStore.reclaim``: they
come due at once, not after ``claim_ttl_s``), and fires nothing before the feed has applied the
log up to its head. Then it runs *rounds* through a :class:`RoundStrategy`, chosen once where the
backend is assembled (:func:`round_strategy`):

- :class:`ClaimDeliverSettle`: ``claim_due(partitions, until, limit)`` claims the due timers
  (FIRING, ``due_at`` = claim expiry, the slot's fence and owner key) up to ``until`` = the
  lookahead past the earlier of now and the feed's last read of the log's head. A claimed timer
  is handed to the delivery stream (:class:`~wowd.daemon.stream.DeliveryStream`: a queue per
  target, workers, each outcome settled as it comes) at its scheduled time, once the feed has
  **read** the log past it (the loop asks the log to look at its head at the due time,
  :meth:`Waker.read_past`) or, while the feed reads the log's head, once the log asked after the
  due time holds no commit of its aggregate that may change it (the log check,
  :meth:`~wowd.stores.base.Log.committed_after`: what a quiet MongoDB log's watermark would make
  wait for seconds), and only if no batch the feed read after the claim began commits to its
  aggregate (:meth:`Waker.changed_since`): a cancel, a put of a later version or a delete
  appended before the due time always wins, and the claimed copy is settled back (a no-op where
  the feed changed the timer). With the log check, the claims reach the lookahead past now, not
  past the feed's last read of the log's head. Timers claimed and not yet settled are never claimed again,
  however long their delivery takes; at most twice ``timers.batch`` are claimed at once.
- :class:`FusedFiring` (the ``outbox`` gateway on the embedded backend): the timers due by now
  and by the watermark are read, written to the outbox and settled in one transaction with no
  claim; with the log check (:class:`~wowd.stores.base.LogCheck`, the embedded backend's log is
  in the same file) every timer due by now whose aggregate has no commit past the feed's
  checkpoint fires at its due time, and nothing is claimed ahead; a timer left so fires once the
  feed has applied its next batch. Without the log check, what the lookahead adds is claimed as
  above.

Between rounds the loop sleeps as :func:`plan_wait` decides: until the store's next due time
(``next_due``) or the earliest one this process put since (:class:`~wowd.daemon.waker.Waker`)
comes within the lookahead, and not before the round's ``until`` is half a lookahead away (a
steady stream is then claimed in rounds of half a lookahead, each half a lookahead before its
first timer is due), at most :data:`MAX_IDLE_S`; a put due sooner wakes it at once.

A store that fails a round (or the reclaim, or a settle) is retried with a capped backoff and
reported in the loop's :class:`~wowd.daemon.stall.Stall` (:attr:`TimerLoop.stall`): stalled at
once by a full disk or a store that refuses, after a minute of transient failures; readiness then
answers 503 and ``wowd_timers_stalled{slot}`` is 1 until the failing step (a round, a settle)
succeeds again. Nothing is lost meanwhile: a timer is fired, or its claim settled, only by a write
that succeeded.

On stop it claims nothing more; deliveries in flight finish (bounded by the slot's grace period)
and their outcomes are written; what was claimed and not delivered is settled back to PENDING.
The last settle runs shielded and bounded, also after the lease lapsed: each change is guarded by
the timer's revision as claimed, so it is skipped where a new holder has moved the timer on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from operator import attrgetter
from typing import Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from wowd import metrics
from wowd.clock import now_ms
from wowd.config import TimerSettings
from wowd.delivery import (
    CommandGateway,
    FusedFiring,
    Outcome,
    Retry,
)
from wowd.errors import StorageError
from wowd.model import Timer, TimerChange, misfired
from wowd.retry import Backoff, Pauses, RetryStopped, retrying
from wowd.stores.base import FireRequest, LogCheck, OwnerProbe, TimerStore

from .feed import CONSUMER
from .leases import HeldSlot
from .stall import Stall
from .stream import SETTLE_GROUP, DeliveryStream, Settler
from .timer_plan import (
    MAX_IDLE_S,
    ReadFirst,
    Round,
    Sleep,
    count_misfired,
    count_outcomes,
    next_occurrence,
    outcome_changes,
    plan_wait,
    retry_delay_s,
    wake_time,
    wants_next_due,
)
from .waker import Waker, owner_key

__all__ = [
    "MAX_IDLE_S",
    "ClaimDeliverSettle",
    "FusedFirst",
    "LogGate",
    "ReadFirst",
    "Round",
    "RoundStrategy",
    "Sleep",
    "TimerLoop",
    "next_occurrence",
    "outcome_changes",
    "plan_wait",
    "retry_delay_s",
    "round_strategy",
    "wake_time",
]

log = logging.getLogger(__name__)
Logx = logging.LoggerAdapter[logging.Logger]

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
SWEEP_EVERY_S = 10.0
"""How often a loop deletes expired tombstones (a small batch each time)."""
SWEEP_BATCH = 1000
ROUND_BACKOFF = Backoff(0.1, 5.0)
"""The pause before retrying a round or a reclaim the store failed (also while stalled: a loop
resumes at most this long after the store answers again)."""
ROUND = "timer round"
SETTLE = "settle"
"""The steps of a loop's :class:`Stall`: a round (or the reclaim before the first), a settle."""


# --------------------------------------------------------------------------- round strategies


class RoundStrategy(Protocol):
    """How the timers of a held slot are taken, delivered and settled; one per loop, chosen
    where the backend is assembled."""

    def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AbstractAsyncContextManager[None]:
        """An async context for the loop's rounds: what the strategy runs beside them (delivery
        workers, the settler); on exit every timer it took is delivered or settled back."""
        ...

    async def round(self, held: HeldSlot, waker: Waker, parts: frozenset[int]) -> Round:
        """Takes the due timers of ``parts`` (and delivers them, or hands them on); raises
        :class:`~wowd.errors.StorageUnavailable` when the store does not answer."""
        ...


class ClaimDeliverSettle:
    """Claims due timers ahead, hands each to the delivery stream at its due time once the log is
    read past it, and settles each outcome as it comes (grouped). At most ``2 * timers.batch``
    timers are claimed and not yet settled; claiming refills a batch at a time as outcomes are
    written."""

    def __init__(
        self,
        settings: TimerSettings,
        store: TimerStore,
        gateway: CommandGateway,
        nudge: Nudge,
        gate: LogGate | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._gateway = gateway
        self._nudge = nudge
        self._gate = gate
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
        self._held: HeldSlot | None = None
        self._waker: Waker | None = None
        self._settler: Settler | None = None
        self._stream: DeliveryStream | None = None
        self._work: TaskGroup | None = None

    @asynccontextmanager
    async def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AsyncIterator[None]:
        s = self._settings
        self._held, self._waker = held, waker
        settler = self._settler = Settler(
            self._store.settle,
            self._written,
            logx=logx,
            on_failure=lambda exc: stall.failed(SETTLE, exc, logx),
            on_success=lambda: stall.progressed(logx, SETTLE),
            collect=self._outcome_changes,
        )
        stream = self._stream = DeliveryStream(
            self._gateway,
            self._record,
            concurrency=s.concurrency,
            window=s.concurrency + SETTLE_GROUP,
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
                for reason in (WAITING_FEED, WAITING_CHECK, WAITING_LIMIT, WAITING_CIRCUIT):
                    metrics.TIMERS_WAITING.labels(slot=str(held.slot), reason=reason).set(0)
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
        metrics.TIMERS_WAITING.labels(slot=str(self._held.slot), reason=reason).set(self._waiting[reason])

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
        self._count_queued()

    def _count_queued(self) -> None:
        """``wowd_timers_waiting`` of the timers queued for a delivery slot of their target and
        of those to be retried because their target's circuit was open."""
        assert self._held is not None and self._stream is not None
        slot = str(self._held.slot)
        short = self._short_circuited
        if short:
            forget = anyio.current_time() - CIRCUIT_WAIT_FORGET_S
            for timer_id in [i for i, at in short.items() if at < forget]:
                del short[timer_id]
        metrics.TIMERS_WAITING.labels(slot=slot, reason=WAITING_LIMIT).set(self._stream.queued)
        metrics.TIMERS_WAITING.labels(slot=slot, reason=WAITING_CIRCUIT).set(len(short))

    def _outcome_changes(self) -> list[TimerChange]:
        """The settle changes of the outcomes recorded since the last group, counted."""
        assert self._held is not None
        results, self._results = self._results, []
        changes = outcome_changes(results, self._held.fence, self._settings)
        count_outcomes(results, changes)
        return changes

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


class FusedFirst:
    """Fires the due timers through the gateway's fast path (:class:`FusedFiring`): read,
    delivered and settled in one transaction, with no claim. With ``check_log``, every timer due
    by now whose aggregate the log has not changed since the feed's checkpoint, at its due time;
    else the timers due by now and by the watermark, then ``then`` claims what the lookahead
    adds."""

    def __init__(
        self,
        settings: TimerSettings,
        fused: FusedFiring,
        *,
        check_log: bool,
        then: ClaimDeliverSettle | None = None,
    ) -> None:
        if not check_log and then is None:
            raise ValueError("a fast path without the log check needs a claiming strategy after it")
        self._settings = settings
        self._fused = fused
        self._check_log = check_log
        self._then = then
        self._exclude: Collection[str] = then._unsettled if then is not None else ()

    @asynccontextmanager
    async def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AsyncIterator[None]:
        if self._then is None:
            yield
            return
        async with self._then.running(held, waker, stall, logx):
            yield

    async def round(self, held: HeldSlot, waker: Waker, parts: frozenset[int]) -> Round:
        check = LogCheck(CONSUMER, waker.watermark) if self._check_log and waker.watermark is not None else None
        held.check()
        fired, at = await self.fire(held, parts, waker, check)
        if fired >= self._settings.batch:
            return Round(until=at, taken=fired, full=True)
        if self._then is not None:
            return await self._then.round(held, waker, parts)
        # read every timer due by its fire time ``at`` (not by now: one due since is still to fire)
        return Round(until=at, taken=fired, claims_ahead=False, skipped=check.skipped if check else 0)

    async def fire(
        self, held: HeldSlot, parts: frozenset[int], waker: Waker, check: LogCheck | None
    ) -> tuple[int, int]:
        """Fires the timers due by now and by the feed's watermark (every commit appended before
        it applied: a cancel appended before a due time is in the view read), or, with
        ``check``, every timer due by now the log has not changed since the feed's checkpoint;
        counted and told to the waker as a delivered and settled round is; answers how many, and
        the fire time."""
        if waker.watermark is None:
            return 0, now_ms()
        at = now_ms()
        request = FireRequest(
            partitions=parts,
            until=at if check is not None else waker.watermark,
            limit=self._settings.batch,
            at=at,
            owner_key=held.owner_key,
            fence=held.fence,
            next_due=next_occurrence,
            exclude=self._exclude,
            deadline=held.deadline(),
            check=check,
        )
        fired = await self._fused.fire_due(request)
        metrics.TIMERS_CLAIMED_LAST_ROUND.set(len(fired))
        if fired:
            metrics.SETTLE_BATCH.observe(len(fired))
            metrics.count_fired((f.aggregate, f.scheduled_at, at) for f in fired if not f.misfired)
            for f in fired:
                if f.next_due is not None:
                    waker.maybe_wake(f.next_due)
                if f.misfired:
                    metrics.TIMERS_MISFIRED.labels(aggregate=f.aggregate).inc()
        return len(fired), at


class Nudge(Protocol):
    def __call__(self) -> None: ...


LogGate = Callable[[Sequence[OwnerProbe]], Awaitable[set[int]]]
"""The log's check at a due time (:meth:`~wowd.stores.base.Log.committed_after`)."""


def round_strategy(
    settings: TimerSettings,
    store: TimerStore,
    gateway: CommandGateway,
    *,
    nudge: Nudge,
    fused: FusedFiring | None = None,
    check_log: bool = False,
    gate: LogGate | None = None,
) -> RoundStrategy:
    """The round strategy of a backend and gateway: the fast path with the log check where the
    gateway has a fast path and the backend's log is checked in its transaction; the fast path
    then claims where it has no log check; else claim, deliver, settle (with ``gate``, the log
    asked at the due times: :class:`ClaimDeliverSettle`)."""
    if fused is not None and check_log:
        return FusedFirst(settings, fused, check_log=True)
    claims = ClaimDeliverSettle(settings, store, gateway, nudge, gate)
    if fused is not None:
        return FusedFirst(settings, fused, check_log=False, then=claims)
    return claims


# --------------------------------------------------------------------------- the loop


def _storage_error(exc: BaseException) -> StorageError:
    assert isinstance(exc, StorageError)  # what the retry retries
    return exc


class TimerLoop:
    """Fires the due timers of one held slot until the slot stops, in rounds of its strategy."""

    def __init__(
        self,
        settings: TimerSettings,
        store: TimerStore,
        gateway: CommandGateway,
        *,
        nudge: Nudge = lambda: None,
        fused: FusedFiring | None = None,
        check_log: bool = False,
        gate: LogGate | None = None,
        strategy: RoundStrategy | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._nudge = nudge
        self.strategy = strategy or round_strategy(
            settings, store, gateway, nudge=nudge, fused=fused, check_log=check_log, gate=gate
        )
        self._next_sweep = 0.0
        self.stall: Stall | None = None
        """Whether the loop's rounds fail (set when it runs, for its slot: readiness reads it)."""

    async def run(
        self, held: HeldSlot, waker: Waker, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        logx = logging.LoggerAdapter(log, held.log_extra())
        stall = self.stall = Stall(
            f"timer loop of slot {held.slot}", metrics.TIMERS_STALLED.labels(slot=str(held.slot))
        )
        held.on_stop(waker.wake)
        parts = frozenset(held.partitions)
        task_status.started()
        await self._reclaim(held, parts, stall, logx)
        pauses = Pauses(ROUND_BACKOFF, held.stop_event)
        async with self.strategy.running(held, waker, stall, logx):
            while not held.stopping:
                held.check()
                if waker.watermark is None or waker.read_mark is None:
                    # the feed has not applied the log up to its head since the slot was taken
                    self._nudge()
                    await waker.wait(MAX_IDLE_S, float("-inf"), want_watermark=float("-inf"))
                    continue
                mark, applied = waker.mark(), waker.applied_batches
                try:
                    r = await self.strategy.round(held, waker, parts)
                except StorageError as exc:  # a full disk, a store that refuses: stalled, retried
                    stall.failed(ROUND, exc, logx)
                    await pauses.pause()
                    continue
                pauses.reset()
                stall.progressed(logx, ROUND)
                if r.full:
                    continue  # more are due now
                waker.covered(r.until, mark)
                if not held.stopping:
                    await self._sweep(logx)
                    await self._wait(held, waker, parts, r, applied, logx)
        logx.info("timer loop stopped")

    async def _wait(
        self, held: HeldSlot, waker: Waker, parts: frozenset[int], r: Round, applied: int, logx: Logx
    ) -> None:
        """Sleeps after a round that read every timer due by ``r.until`` (:func:`plan_wait`)."""
        if r.skipped:
            # due, but the log holds a commit of their aggregate the feed has not applied yet:
            # taken again once it has applied its next batch
            self._nudge()
            await waker.wait_applied(applied, MAX_IDLE_S)
            return
        put_next = waker.earliest()
        stored_next = await self._next_due(parts, r.until, logx) if wants_next_due(r, put_next) else None
        now = now_ms()
        w = plan_wait(now, r, (stored_next, waker.earliest()), self._settings.lookahead_ms)
        if isinstance(w, ReadFirst):
            self._nudge()
            if waker.watermark is None or waker.watermark < w.want_watermark:
                await waker.wait(MAX_IDLE_S, w.first, want_watermark=w.want_watermark)
            return
        await waker.wait((w.wake_at - now) / 1000, w.wake_before)

    async def _reclaim(self, held: HeldSlot, parts: frozenset[int], stall: Stall, logx: Logx) -> None:
        """Ends the claims an earlier holding of the slot left: a previous holder's (a lower
        fence), or this holder's own before its lease lapsed and was taken back (this fence)."""
        # claims under this very fence too: none is in flight (this slot's work starts now);
        # they were left by this holder's earlier work on the slot, whose lease lapsed and was
        # taken back with the same fence
        try:
            async for attempt in retrying(
                "ending a previous holder's claims",
                backoff=ROUND_BACKOFF,
                stop=held.stop_event,
                logger=None,  # the stall logs
                retry_on=StorageError,
                on_failure=lambda exc: stall.failed(ROUND, _storage_error(exc), logx),
            ):
                with attempt:
                    held.check()
                    n = await self._store.reclaim(parts, held.fence + 1)
        except RetryStopped:
            return
        stall.progressed(logx, ROUND)
        if n:
            logx.info("%d timers claimed by an earlier holding of the slot are due again", n)

    async def _sweep(self, logx: Logx) -> None:
        """Deletes a small batch of expired tombstones, at most every :data:`SWEEP_EVERY_S`."""
        t = time.monotonic()
        if t < self._next_sweep:
            return
        self._next_sweep = t + SWEEP_EVERY_S
        try:
            await self._store.sweep(now_ms() - self._settings.tombstone_retention_s * 1000, SWEEP_BATCH)
        except StorageError as exc:  # nothing waits for it: retried at the next sweep
            stalled = self.stall is not None and self.stall.stalled
            logx.log(logging.DEBUG if stalled else logging.WARNING, "tombstone sweep failed (will retry): %s", exc)

    async def _next_due(self, parts: frozenset[int], after: int, logx: Logx) -> int | None:
        """The store's next due time after ``after``; ``None`` when it does not answer (the loop
        then reads again after an idle period)."""
        try:
            return await self._store.next_due(parts, after)
        except StorageError as exc:
            stalled = self.stall is not None and self.stall.stalled
            logx.log(logging.DEBUG if stalled else logging.WARNING, "next due time not read (polling instead): %s", exc)
            return None
