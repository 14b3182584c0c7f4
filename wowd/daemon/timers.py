"""The timer loop of one held slot (DESIGN.md section 5, "Firing").

On start it ends the claims a previous holder of the slot left (``TimerStore.reclaim``: they
come due at once, not after ``claim_ttl_s``), and claims nothing before the feed has applied the
log up to its head. Per round: ``claim_due(partitions, until, batch)`` claims the due timers
(FIRING, ``due_at`` = claim expiry, the slot's fence and owner key) up to ``until`` = the
lookahead past the earlier of now and the feed's last read of the log's head. A claimed timer is
delivered at its scheduled time once the feed has **read** the log past it (every commit
appended before the due time read; the loop asks the log to look at its head at the due time,
:meth:`Waker.read_past`), and only if no batch the feed read after the claim began commits to
its aggregate (:meth:`Waker.changed_since`): a cancel, a put of a later version or a delete
appended before the due time always wins, and the claimed copy is settled back (a no-op where the
feed changed the timer). Timers this loop is still delivering are excluded from the claim,
however long their delivery takes. Each claimed batch's outcomes are settled in one ``settle``
(fired: next occurrence or a DONE tombstone; retry: exponential backoff with jitter; park; fail
after ``max_attempts``). After a round that claimed every timer due, the loop sleeps until the
store's next due time (``next_due``) or the earliest one this process put since
(:class:`~wowd.daemon.waker.Waker`) comes within the lookahead, and not before the round's
``until`` is half a lookahead away (a steady stream is then claimed in rounds of half a
lookahead, each half a lookahead before its first timer is due), at most ``MAX_IDLE_S``; a put
due sooner wakes it at once. A timer within the lookahead but beyond the feed's last read makes
it ask the log for a read instead.

With a gateway's fast path (:class:`~wowd.daemon.gateway.FusedFiring`: the ``outbox`` gateway on
the embedded backend), a round first fires the timers due by now and by the watermark through
it, read, delivered and settled in one transaction with no claim; while a whole batch comes back
it does so again, and then claims what the lookahead adds as above. Where the fast path can check
the log in its transaction (``check_log``: the embedded backend, whose log, the feed's checkpoints
and timers share one file; :class:`~wowd.stores.base.LogCheck`), nothing is claimed ahead: the
loop wakes at each due time and fires every timer due by now whose aggregate has no commit past
the feed's checkpoint, without waiting for the feed to read past the due time; a timer left so
is fired once the feed has applied its next batch.

A store that fails a round (or the reclaim) is retried with a capped backoff (:data:`ROUND_BACKOFF`)
and reported in the loop's :class:`~wowd.daemon.stall.Stall` (:attr:`TimerLoop.stall`): stalled at
once by a full disk or a store that refuses, after a minute of transient failures; readiness then
answers 503 and ``wowd_timers_stalled{slot}`` is 1 until the failing step (a round, a settle)
succeeds again. Nothing is lost meanwhile: a timer is fired, or its claim settled, only by a write
that succeeded.

On stop it claims nothing more; a round in flight finishes delivering (bounded by the slot's grace
period) and settles; what was claimed but not delivered is settled back to PENDING. The settle runs
shielded and bounded, also after the lease lapsed: each change is guarded by the timer's revision
as claimed, so it is skipped where a new holder has moved the timer on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any

import anyio
from anyio.abc import TaskStatus

from wowd import metrics
from wowd.backoff import Backoff
from wowd.clock import now_ms
from wowd.config import TimerSettings
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import CronRule, IntervalRule, Timer, TimerChange
from wowd.stores.base import LogCheck, TimerStore

from .feed import CONSUMER
from .gateway import CommandGateway, Delivered, Fail, FusedFiring, Outcome, Park, Retry, delivery_log, target_of
from .leases import HeldSlot
from .stall import Stall
from .waker import Waker, owner_key

__all__ = [
    "MAX_IDLE_S",
    "TimerLoop",
    "next_occurrence",
    "outcome_changes",
    "retry_delay_s",
    "wake_time",
]

log = logging.getLogger(__name__)

MAX_IDLE_S = 0.5
"""The longest sleep between two due reads: how late a timer the :class:`Waker` is not told of
fires (one stored by another process, or a parked timer a feed resumed)."""
SETTLE_TIMEOUT_S = 10.0
"""How long a round's settle is tried (shielded, also on stop) before it is given up: its claims
then expire after ``claim_ttl_s`` and their timers come due again (a re-delivery has the same
request id)."""
READ_WAIT_S = 5.0
"""How long a claimed round waits for the feed to read the log past its timers' due times
before it settles them back undelivered."""
CHANGED = "not delivered: changed by the log before its due time"
BUDGET_SPENT = "retry budget spent"
SWEEP_EVERY_S = 10.0
"""How often a loop deletes expired tombstones (a small batch each time)."""
SWEEP_BATCH = 1000
ROUND_BACKOFF = Backoff(0.1, 5.0)
"""The pause before retrying a round or a reclaim the store failed (also while stalled: a loop
resumes at most this long after the store answers again)."""
ROUND = "timer round"
SETTLE = "settle"
"""The steps of a loop's :class:`Stall`: a round (or the reclaim before the first), a settle."""
SETTLE_BACKOFF = Backoff(0.05, 2.0)
"""The pause before retrying a settle the store could not take (for :data:`SETTLE_TIMEOUT_S` at most)."""


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


_DELIVERY_ORDER = attrgetter("scheduled_at", "timer_id")
_COUNTED = {"retry": metrics.TIMERS_RETRIED, "park": metrics.TIMERS_PARKED, "fail": metrics.TIMERS_FAILED}
"""The settle changes counted by kind (besides the fired ones)."""


class TimerLoop:
    """Fires the due timers of one held slot until the slot stops."""

    def __init__(
        self,
        settings: TimerSettings,
        store: TimerStore,
        gateway: CommandGateway,
        *,
        nudge: Callable[[], None] = lambda: None,
        fused: FusedFiring | None = None,
        check_log: bool = False,
    ) -> None:
        self._settings = settings
        self._store = store
        self._gateway = gateway
        self._fused = fused
        """The gateway's fast path for the timers due now (None: claim, deliver, settle)."""
        self._check_log = check_log and fused is not None
        """Whether the fast path checks the log in its transaction (:class:`LogCheck`): timers are
        then fired at their due time, none claimed ahead."""
        self._nudge = nudge
        self._in_flight: set[str] = set()
        """Ids of the timers this loop claimed and has not settled yet (never claimed again)."""
        self._next_sweep = 0.0
        self.stall: Stall | None = None
        """Whether the loop's rounds fail (set when it runs, for its slot: readiness reads it)."""

    async def run(
        self, held: HeldSlot, waker: Waker, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Rounds overlap: while one claimed batch is delivered and settled (in the task group
        below), the next is read and claimed (at most two rounds outstanding). A claimed batch
        is handed to its round at once, so whatever stops the loop, every claimed timer is
        settled by the round that owns it."""
        logx = logging.LoggerAdapter(log, held.log_extra())
        gauge = metrics.TIMERS_STALLED.labels(slot=str(held.slot))
        stall = self.stall = Stall(f"timer loop of slot {held.slot}", gauge)
        held.on_stop(waker.wake)
        parts = frozenset(held.partitions)
        s = self._settings
        task_status.started()
        await self._reclaim(held, parts, stall, logx)
        attempt = 0
        async with anyio.create_task_group() as rounds:
            outstanding: deque[anyio.Event] = deque()
            while not held.stopping:
                while len(outstanding) >= 2:
                    await outstanding.popleft().wait()
                if held.stopping:
                    break
                held.check()
                if waker.watermark is None or waker.read_mark is None:
                    # the feed has not applied the log up to its head since the slot was taken
                    self._nudge()
                    await waker.wait(MAX_IDLE_S, float("-inf"), want_watermark=float("-inf"))
                    continue
                check: LogCheck | None = None
                if self._check_log:
                    # fired at their due time, the log checked in the fast path's transaction
                    until = now_ms()
                    check = LogCheck(CONSUMER, waker.watermark)
                else:
                    # claimed up to the lookahead ahead of now and of the feed's reads: delivered
                    # once the feed has read past their due time (see _deliver)
                    until = min(now_ms(), waker.read_mark) + s.lookahead_ms
                lookahead_ms = 0 if check is not None else s.lookahead_ms
                mark = waker.mark()
                applied = waker.applied_batches
                batch_mark: int | None = None
                try:
                    held.check()
                    fired = 0
                    if self._fused is not None:
                        fired = await self._fire_fused(held, parts, waker, check)
                        if fired >= s.batch:
                            attempt = 0
                            stall.progressed(logx, ROUND)
                            continue  # more are due now
                    if check is not None:
                        claimed = []  # the fast path took every timer due
                    else:
                        batch_mark = waker.hold()
                        try:
                            claimed = await self._store.claim_due(
                                parts,
                                until,
                                s.batch,
                                owner_key=held.owner_key,
                                fence=held.fence,
                                claim_until=now_ms() + int(s.claim_ttl_s * 1000),
                                exclude=self._in_flight,
                            )
                        except BaseException:
                            waker.release(batch_mark)
                            raise
                    n_due = len(claimed)
                    if claimed:
                        metrics.SETTLE_BATCH.observe(n_due)
                    if not fired:
                        metrics.TIMERS_CLAIMED_LAST_ROUND.set(n_due)
                    if n_due < s.batch:
                        waker.covered(until, mark)
                    attempt = 0
                    stall.progressed(logx, ROUND)
                except StorageError as exc:  # a full disk, a store that refuses: stalled, retried
                    stall.failed(ROUND, exc, logx)
                    with anyio.move_on_after(ROUND_BACKOFF(attempt)):
                        await held.stop_event.wait()
                    attempt += 1
                    continue
                if claimed:
                    assert batch_mark is not None  # claimed by the steps, not the fast path
                    self._in_flight.update(t.timer_id for t in claimed)
                    done = anyio.Event()
                    outstanding.append(done)
                    rounds.start_soon(self._finish, held, claimed, waker, batch_mark, logx, done)
                elif batch_mark is not None:
                    waker.release(batch_mark)
                if n_due < s.batch and not held.stopping:
                    await self._sweep(logx)
                    if check is not None and check.skipped:
                        # due, but the log holds a commit of their aggregate the feed has not
                        # applied yet: taken again once it has applied its next batch
                        self._nudge()
                        await waker.wait_applied(applied, MAX_IDLE_S)
                        continue
                    # every timer due by `until` is claimed: sleep until the next one (the store's,
                    # or one put since) comes within the lookahead, an idle period at most
                    soon = waker.earliest()
                    if check is not None and soon is not None and soon <= until + int(MAX_IDLE_S * 1000):
                        # a put of this process is due within an idle period: the round at its
                        # due time reads every timer due by then (the store's next one need not
                        # be read first: a timer the waker was not told of fires at most an
                        # idle period late, as with the idle poll)
                        stored_next = None
                    else:
                        stored_next = await self._next_due(parts, until, stall, logx)
                    now = now_ms()
                    nexts = [d for d in (stored_next, waker.earliest()) if d is not None]
                    first = min(nexts, default=None)
                    # a round takes half a lookahead of timers, claimed half a lookahead before its
                    # first is due: the next one once half the lookahead has passed, not as soon
                    # as the next timer comes within it (a whole lookahead claimed when its first
                    # timer is due: the claim, and the settle of the round before that it may
                    # wait for, would delay that timer)
                    halfway = until - s.lookahead_ms // 2
                    if check is None and first is not None and until < first <= now + s.lookahead_ms and now >= halfway:
                        # within the lookahead but beyond the feed's last read of the log's head
                        # (an idle log is read less often): ask for a read now, claim after it
                        self._nudge()
                        want = first - s.lookahead_ms
                        if waker.watermark is None or waker.watermark < want:
                            await waker.wait(MAX_IDLE_S, first, want_watermark=want)
                        continue
                    wake_at = wake_time(now, nexts, lookahead_ms)
                    if check is None and first is not None and first > until:
                        # an idle period at most, as ever (timers the waker was not told of)
                        wake_at = max(wake_at, min(halfway, now + int(MAX_IDLE_S * 1000)))
                    await waker.wait((wake_at - now) / 1000, wake_at + lookahead_ms)
        logx.info("timer loop stopped")

    async def _fire_fused(self, held: HeldSlot, parts: frozenset[int], waker: Waker, check: LogCheck | None) -> int:
        """Fires the timers due by now and by the feed's watermark (every commit appended before
        it applied: a cancel appended before a due time is in the view read), or, with
        ``check``, every timer due by now the log has not changed since the feed's checkpoint,
        through the gateway's fast path, counted and told to the waker as a delivered and
        settled round is; answers how many."""
        assert self._fused is not None
        if waker.watermark is None:
            return 0
        at = now_ms()
        fired = await self._fused.fire_due(
            parts,
            at if check is not None else waker.watermark,
            self._settings.batch,
            at=at,
            owner_key=held.owner_key,
            fence=held.fence,
            next_due=next_occurrence,
            exclude=self._in_flight,
            deadline=held.deadline(),
            check=check,
        )
        metrics.TIMERS_CLAIMED_LAST_ROUND.set(len(fired))
        if fired:
            metrics.SETTLE_BATCH.observe(len(fired))
            metrics.count_fired((f.aggregate, f.scheduled_at, at) for f in fired)
            for f in fired:
                if f.next_due is not None:
                    waker.maybe_wake(f.next_due)
        return len(fired)

    async def _reclaim(
        self, held: HeldSlot, parts: frozenset[int], stall: Stall, logx: logging.LoggerAdapter[logging.Logger]
    ) -> None:
        """Ends the claims an earlier holding of the slot left: a previous holder's (a lower
        fence), or this holder's own before its lease lapsed and was taken back (this fence)."""
        attempt = 0
        while not held.stopping:
            try:
                held.check()
                # claims under this very fence too: none is in flight (this slot's work starts
                # now); they were left by this holder's earlier work on the slot, whose lease
                # lapsed and was taken back with the same fence
                n = await self._store.reclaim(parts, held.fence + 1)
                if n:
                    logx.info("%d timers claimed by an earlier holding of the slot are due again", n)
                stall.progressed(logx, ROUND)
                return
            except StorageError as exc:
                stall.failed(ROUND, exc, logx)
                with anyio.move_on_after(ROUND_BACKOFF(attempt)):
                    await held.stop_event.wait()
                attempt += 1

    async def _sweep(self, logx: logging.LoggerAdapter[logging.Logger]) -> None:
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

    async def _next_due(
        self, parts: frozenset[int], after: int, stall: Stall, logx: logging.LoggerAdapter[logging.Logger]
    ) -> int | None:
        """The store's next due time after ``after``; ``None`` when it does not answer (the loop
        then reads again after an idle period, whose round reports a store that keeps failing)."""
        try:
            return await self._store.next_due(parts, after)
        except StorageError as exc:
            level = logging.DEBUG if stall.stalled else logging.WARNING
            logx.log(level, "next due time not read (polling instead): %s", exc)
            return None

    async def _finish(
        self,
        held: HeldSlot,
        claimed: list[Timer],
        waker: Waker,
        batch_mark: int,
        logx: logging.LoggerAdapter[logging.Logger],
        done: anyio.Event,
    ) -> None:
        """Delivers a claimed batch, then settles the outcomes (shielded, bounded, lease
        permitting), also when cancelled before or while delivering."""
        results: list[tuple[Timer, Outcome, int]] = []

        def record(t: Timer, outcome: Outcome) -> None:
            results.append((t, outcome, now_ms()))

        changes: list[TimerChange] = []
        dropped: set[str] = set()
        try:
            await self._deliver(held, claimed, record, waker, batch_mark, dropped)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(SETTLE_TIMEOUT_S):
                changes = await self._settle_outcomes(held, claimed, results, dropped, logx)
            self._in_flight.difference_update(t.timer_id for t in claimed)
            done.set()
        for c in changes:
            if c.kind == "retry" and c.due_at is not None:
                waker.maybe_wake(c.due_at)
            elif c.kind == "fired" and c.next_due is not None:
                waker.maybe_wake(c.next_due)

    async def _deliver(
        self,
        held: HeldSlot,
        claimed: list[Timer],
        record: Any,
        waker: Waker,
        batch_mark: int,
        dropped: set[str],
    ) -> None:
        """Delivers a claimed batch in scheduled order, each timer not before its scheduled time
        (claimed up to the lookahead early), and none once the slot stops. The wait for a
        scheduled time is bounded by the lookahead on the monotonic clock: a wall clock stepped
        back never holds a claimed round.

        A timer is delivered only once the feed has read the log past its due time (asking the
        log to look at its head when it has not), and not when a batch the feed read after the
        claim began holds a commit of its aggregate: a put, cancel or delete appended before the
        due time may have changed it (those are added to ``dropped`` and settled back, under
        their claim). The feed's watermark is waited for at most :data:`READ_WAIT_S`; what is
        left is settled back undelivered."""
        pending = sorted(claimed, key=_DELIVERY_ORDER)
        latest = anyio.current_time() + self._settings.lookahead_ms / 1000
        read_deadline = anyio.current_time() + READ_WAIT_S

        def stopped() -> bool:
            return held.stopping

        i = 0
        held_mark = True
        try:
            while i < len(pending) and not held.stopping:
                now = now_ms()
                late = anyio.current_time() >= latest
                j = i
                while j < len(pending) and (late or pending[j].scheduled_at <= now):
                    j += 1
                if j == i:
                    # slightly ahead (lookahead): deliver at its scheduled time
                    wait_s = min((pending[i].scheduled_at - now) / 1000, latest - anyio.current_time())
                    with anyio.move_on_after(max(0.0, wait_s)):
                        await held.stop_event.wait()
                    continue
                # every commit appended before the group's due times (or, on a wall clock stepped
                # back, before now) read by the feed
                read_to = min(pending[j - 1].scheduled_at, now)
                if waker.read_mark is None or waker.read_mark < read_to:
                    self._nudge()
                    if not await waker.read_past(read_to, min(MAX_IDLE_S, read_deadline - anyio.current_time())):
                        if anyio.current_time() >= read_deadline:
                            break
                        continue
                group: list[Timer] = []
                for t in pending[i:j]:
                    if waker.changed_since(batch_mark, owner_key(t.owner)):
                        dropped.add(t.timer_id)
                    else:
                        group.append(t)
                if j == len(pending):
                    held_mark = False
                    waker.release(batch_mark)
                held.check()
                if group:
                    await self._gateway.deliver(group, record, stopped)
                i = j
        finally:
            if held_mark:
                waker.release(batch_mark)

    async def _settle_outcomes(
        self,
        held: HeldSlot,
        claimed: list[Timer],
        results: list[tuple[Timer, Outcome, int]],
        dropped: set[str],
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> list[TimerChange]:
        """Settles the round; answers the changes written (empty when none could be)."""
        s = self._settings
        changes = outcome_changes(results, held.fence, s)
        done = {t.timer_id for t, _o, _a in results}
        now = now_ms()
        for t in claimed:
            if t.timer_id in dropped:  # the log changed it after the claim (the change is skipped if so)
                changes.append(TimerChange.release(t, fence=held.fence, due_at=now, reason=CHANGED))
            elif t.timer_id not in done:  # claimed, not delivered (stop, cancellation, feed too late)
                changes.append(TimerChange.release(t, fence=held.fence, due_at=now, reason="not delivered: stopped"))
        if not changes:
            return []
        self._count(results, changes)
        # Settled even when the lease has lapsed meanwhile: each change is written over the timer
        # only as this round claimed it (id and revision), so a timer a new holder claimed or
        # reclaimed since has moved on and its change is skipped; what is written is the truth
        # (a delivered timer is not delivered again)
        if not held.valid:
            logx.info("lease lapsed while delivering: settling %d outcomes under their claims", len(changes))
        attempt = 0
        while True:
            try:
                written = await self._store.settle(changes)
                if self.stall is not None:
                    self.stall.progressed(logx, SETTLE)
                break
            except StorageUnavailable as exc:  # retried until the caller's bound (SETTLE_TIMEOUT_S)
                if self.stall is not None:  # stalled until a settle is written (a round may write nothing)
                    self.stall.failed(SETTLE, exc, logx)
                else:
                    logx.warning("settle failed (will retry): %s", exc)
                await anyio.sleep(SETTLE_BACKOFF(attempt))
                attempt += 1
            except StorageError as exc:
                logx.error("settle failed: %s (claims will expire and re-fire)", exc)
                return []
        metrics.SETTLE_BATCH.observe(len(changes))
        if written < len(changes):
            metrics.SETTLE_SKIPPED.inc(len(changes) - written)
        return changes

    @staticmethod
    def _count(results: list[tuple[Timer, Outcome, int]], changes: list[TimerChange]) -> None:
        metrics.count_fired(
            (t.owner.aggregate, t.scheduled_at, at) for t, outcome, at in results if isinstance(outcome, Delivered)
        )
        counted: Counter[tuple[str, str]] = Counter()  # (kind, aggregate): one label lookup each
        for c in changes:
            if c.kind in _COUNTED:
                counted[c.kind, c.timer.owner.aggregate] += 1
            if c.kind == "fail" and c.error is not None and c.error.startswith(BUDGET_SPENT):
                # the gateway logged a Retry; that it is given up is the loop's decision
                delivery_log.outcome(target_of(c.timer), Fail(reason=c.error), c.timer.request_id)
        for (kind, agg), n in counted.items():
            _COUNTED[kind].labels(aggregate=agg).inc(n)
