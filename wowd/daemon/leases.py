"""Slot leases held by this replica (docs/concepts.md): acquire, renew, lose, release.

One :class:`SlotKeeper` per wanted slot (``slots_per_process``). Each keeper:

- acquires a slot; when every slot is held it is a standby and retries with jittered backoff;
- runs the slot's work (``work(held)``) inside a cancel scope whose deadline is the lease's
  validity on the monotonic clock: ``sent + remaining - tolerance``, where ``sent`` is when the
  last successful acquire/renew was *sent* and ``remaining`` is the store's word, the stored
  lease's ``expires_at`` less the store's now when it answered (a take or a renewal: the ttl;
  an idempotent re-acquire: what is left of the lease it hands back unchanged). Each successful
  renew moves the deadline forward, so the work stops at that instant even while a renew is
  still in flight;
- renews when the validity left drops to ``ttl - tolerance - ttl/3`` (every ``ttl/3`` after a
  take or a renewal, at once after a re-acquire that handed back a worn lease); a refused renew
  (``None``) cancels the work at once;
- works only under a lease this keeper took itself: the stored live lease of its owner key
  written by another process (a predecessor with the same fixed owner key, maybe hung) is never
  worked under; the keeper stands by until that lease expires and then takes the slot with a new
  incarnation and fence, so the predecessor's renew fails and its tenure ended before;
- watches the wall clock against the monotonic clock: a step beyond the tolerance (the embedded
  store decides expiry on the wall clock) renews at once, and a refused renew stops the work;
- after a loss acquires again; on :meth:`stop` the work drains (bounded by the grace period)
  and the lease is released with ``last_issued`` (shielded, bounded);
- when a renewal answers that the slot is *held* (``held_by``: a timer view rebuild swapping its
  view in), drains the work as on a stop (bounded by the grace period), releases the slot and
  stands by, trying to acquire every :data:`HOLD_POLL` until the hold ends.

Keeper ``i`` uses the owner key ``key`` (``i == 0``) or ``key#i``: an owner key holds one slot
(acquire is idempotent per key), so a replica holding several slots needs one key per slot.

:class:`Presence` keeps the replica's one presence record (``key``, holder or standby) beside its
leases for ``wowd status``: a heartbeat at start, every ``ttl/3`` (the renewal period) and after
each acquire or release, deleted on a graceful stop. A failed heartbeat is logged (WARNING at most
once a minute) and counted, and changes nothing else: no lease decision reads the record.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import anyio
from anyio.abc import TaskStatus

from wowd import __version__, metrics
from wowd.config import WowdSettings
from wowd.errors import ConfigError, LeaseLost, SlotStalled, StorageError, StorageUnavailable
from wowd.fmt import compact_partitions
from wowd.model import Owner, SlotLease
from wowd.retry import Backoff, Pauses
from wowd.stores.base import ClockReading, ReplicaInfo, SlotLeaseStore

from .stall import Stall

__all__ = ["HeldSlot", "Presence", "SlotKeeper", "check_store_clock", "clock_disagreement", "owner_key_for"]

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0
MIN_CLOCK_STEP_S = 0.05
"""The smallest wall-clock step reported, whatever the tolerance (jitter of reading two clocks
and a slewing NTP stay well below it)."""
HOLD_POLL = Backoff(0.2, 0.4, jitter=True)
"""How often a keeper that released its slot for a hold tries to acquire again (a hold lasts a
few seconds: the replica takes its slot back soon after it ends)."""
HEARTBEAT_WARN_EVERY_S = 60.0
"""Failed heartbeats are logged at WARNING at most this often (at DEBUG in between)."""


COARSE_FILE_TIME_MS = 2000
"""How far a file system that keeps whole seconds (or two) may stamp a write before it happened."""


def clock_disagreement(reading: ClockReading, tolerance_s: float) -> str | None:
    """Why this process's clock disagrees with the file's (:class:`ClockReading`) by more than
    the lease tolerance (at least :data:`MIN_CLOCK_STEP_S`), or None. Two comparisons:

    - a lease or presence record written at a time later than this process's now: the process
      that wrote it had a clock ahead of this one (this one behind, or that one ahead);
    - the file's modification time just after this process wrote it, stamped by the host's clock,
      outside the span this process's clock gave around the write: this process's clock is ahead
      of the host's or behind it.
    """
    tol_ms = max(tolerance_s, MIN_CLOCK_STEP_S) * 1000
    if reading.latest is not None and reading.latest > reading.after + tol_ms:
        by = f" by {reading.latest_by}" if reading.latest_by else ""
        return (
            f"the {reading.latest_what} last written{by} in {reading.path} is stamped "
            f"{(reading.latest - reading.after) / 1000:.1f} s after this process's now: this process's clock is "
            "behind the clock of the replica that wrote it (or that one was ahead)"
        )
    if reading.file_written is not None:
        slack = tol_ms + (COARSE_FILE_TIME_MS if reading.file_coarse else 0)
        if reading.file_written > reading.after + slack:
            return (
                f"this process's clock is {(reading.file_written - reading.after) / 1000:.1f} s behind the "
                f"host's ({reading.path} was modified by this process's write at that time)"
            )
        if reading.file_written < reading.before - slack:
            return (
                f"this process's clock is {(reading.before - reading.file_written) / 1000:.1f} s ahead of the "
                f"host's ({reading.path} was modified by this process's write at that time)"
            )
    return None


def check_store_clock(reading: ClockReading, tolerance_s: float) -> None:
    """Raises :class:`ConfigError` (``wowd run`` exits 2) when :func:`clock_disagreement` finds
    one: on a backend whose store clock is each replica's own, a clock ahead would take live slots
    and fire timers early, one behind would never take over an expired slot."""
    why = clock_disagreement(reading, tolerance_s)
    if why is None:
        return
    raise ConfigError(
        f"refusing to start: {why}; more than the lease tolerance (lease.tolerance_s, WOWD_LEASE__TOLERANCE_S = "
        f"{tolerance_s:g} s). The embedded store decides lease expiry by the clock of each replica, so every "
        "replica sharing the file must keep the host's time: fix the clock (NTP) and start again"
    )


def owner_key_for(base: str, index: int) -> str:
    return base if index == 0 else f"{base}#{index}"


@dataclass(eq=False, kw_only=True)
class HeldSlot:
    """A slot this replica holds now, with its partitions and its validity (monotonic clock)."""

    lease: SlotLease
    partitions: frozenset[int]
    valid_until: float
    owner_key: str
    stop_event: anyio.Event = field(default_factory=anyio.Event)
    lost: bool = False
    _listeners: list[Callable[[], None]] = field(default_factory=list)

    @property
    def slot(self) -> int:
        return self.lease.slot

    @property
    def fence(self) -> int:
        return self.lease.fence

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    @property
    def valid(self) -> bool:
        return not self.lost and anyio.current_time() < self.valid_until

    def deadline(self) -> float:
        """The end of the lease's validity on ``time.monotonic()``'s clock: for a store call
        that checks it from a thread of its own, where the event loop's clock is not at hand."""
        return time.monotonic() + (self.valid_until - anyio.current_time())

    def check(self) -> None:
        """Raises :class:`LeaseLost` unless the lease is valid now on the monotonic clock: called
        before every side effect of the slot (deliver, settle, checkpoint)."""
        if not self.valid:
            raise LeaseLost(f"slot {self.slot} (fence {self.fence}): lease no longer valid")

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def request_stop(self) -> None:
        if not self.stop_event.is_set():
            self.stop_event.set()
            for cb in self._listeners:
                cb()

    def log_extra(self) -> dict[str, object]:
        """What every log line of the slot carries: the slot and its partitions in a compact form."""
        return {"slot": self.slot, "partitions": compact_partitions(self.partitions)}


Work = Callable[[HeldSlot], Awaitable[None]]


STALL_COOLDOWN_MIN_S = 10.0


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


class SlotKeeper:
    """Holds one slot at a time for this replica (see the module docstring)."""

    def __init__(
        self,
        index: int,
        settings: WowdSettings,
        store: SlotLeaseStore,
        work: Work,
        *,
        owner_key: str,
        on_change: Callable[[], None] = lambda: None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self._settings = settings
        self._store = store
        self._work = work
        self._owner = Owner(key=owner_key)
        self._on_change = on_change
        ls = settings.lease
        self._ns = settings.lease_namespace
        self._ttl = timedelta(seconds=ls.ttl_s)
        self._tolerance = timedelta(seconds=ls.tolerance_s)
        self._ttl_s = ls.ttl_s
        self._tolerance_s = ls.tolerance_s
        self._validity_s = ls.ttl_s - ls.tolerance_s
        self._renew_every = ls.ttl_s / 3
        self._standby_backoff = Backoff(0.1, max(0.2, self._renew_every), jitter=True)
        self._wall = wall_clock
        self._step_s = max(MIN_CLOCK_STEP_S, ls.tolerance_s)
        self._clock_base = self._clock_offset()
        self._revalidate = anyio.Event()
        self._tenures: set[tuple[int, int, int]] = set()
        """(slot, incarnation, fence) of every lease this keeper took: the only ones it works under."""
        self._waiting_for: tuple[int, int, int] | None = None
        self._stop = anyio.Event()
        self._grace_scope: anyio.CancelScope | None = None
        self._grace_deadline = math.inf
        self._acquiring: anyio.CancelScope | None = None
        """The acquire in flight, which a stop cancels: a standby has nothing to drain."""
        self.held: HeldSlot | None = None
        self._cooldown_s = 0.0
        """After a stalled slot was given up: how long to stand by before acquiring again."""
        self._paused_by: str | None = None
        """Who held the slot this keeper released last (until it acquires one again)."""
        self.standby = False
        self.stall = Stall(f"slot keeper {owner_key}", after_unavailable_s=math.inf)
        """Stalled while the lease store refuses this keeper's acquires or renewals for a full disk
        (or a refusal retrying will not fix), until one is answered again: the lease lapses and
        the keeper cannot take a slot back meanwhile. Readiness reads it; it sets the
        ``wowd_timers_stalled`` of the slot it holds or last held (whose timers wait)."""

    @property
    def owner_key(self) -> str:
        return self._owner.key

    def stop(self, grace_s: float) -> None:
        """Stops acquiring; the held slot's work is asked to stop and cancelled after ``grace_s``."""
        self._stop.set()
        if self._acquiring is not None:
            self._acquiring.cancel()
        self._grace_deadline = min(self._grace_deadline, anyio.current_time() + grace_s)
        if self.held is not None:
            self.held.request_stop()
        if self._grace_scope is not None:
            self._grace_scope.deadline = self._grace_deadline

    def _clock_offset(self) -> float:
        return self._wall() - anyio.current_time()

    def validity_s(self, lease: SlotLease) -> float:
        """How long after sending the request that answered ``lease`` the holder may work: the
        lease's remaining time on the store clock (never more than the ttl) less the tolerance."""
        return min(lease.remaining_ms / 1000, self._ttl_s) - self._tolerance_s

    def _usable(self, lease: SlotLease) -> bool:
        """Takes note of a lease this keeper took; False for a live lease of its owner key that
        another process took (or one with no validity left): the keeper waits for it to expire."""
        tenure = (lease.slot, lease.incarnation, lease.fence)
        if lease.store_now is None:  # answered by the write that took it: ours
            self._tenures.add(tenure)
        if tenure not in self._tenures:
            if self._waiting_for != tenure:
                self._waiting_for = tenure
                log.warning(
                    "owner key %s holds slot %d (fence %d, incarnation %d) under another process: "
                    "waiting %.1f s for that lease to expire before taking the slot",
                    self._owner.key,
                    lease.slot,
                    lease.fence,
                    lease.incarnation,
                    lease.remaining_ms / 1000,
                )
            return False
        if self.validity_s(lease) <= 0:
            if self._waiting_for != tenure:
                self._waiting_for = tenure
                log.warning(
                    "slot %d (fence %d): the lease has %.3f s left, within the tolerance: not working under it",
                    lease.slot,
                    lease.fence,
                    lease.remaining_ms / 1000,
                )
            return False
        self._waiting_for = None
        return True

    async def _acquire(self) -> tuple[float, SlotLease | None]:
        ls = self._settings.lease
        sent = anyio.current_time()
        try:
            res = await self._store.acquire(
                self._ns, self._owner, ls.limit, self._ttl, self._tolerance, slot_offset=ls.slot_offset
            )
        except StorageUnavailable as exc:
            self.stall.failed("lease acquire", exc, log)
            return sent, None
        if res.status == "refused":
            raise ConfigError(f"lease namespace {self._ns!r} refused this configuration: {res.reason}")
        if res.lease is None or not res.acquired or not self._usable(res.lease):
            if res.status == "exhausted":  # every slot held by others: a healthy standby
                self.stall.progressed(log)
            return sent, None
        if res.lease.store_now is None:
            self.stall.progressed(log)  # a take: the store took a write (not for a lease handed back unusable)
        else:
            # its own live lease read back, no write: a renewal that failed (a full disk) stays
            # stalled until a renewal succeeds
            self.stall.progressed(log, "lease acquire")
        return sent, res.lease

    async def run(self, *, task_status: TaskStatus[HeldSlot | None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Acquires and holds slots until stopped. ``started`` after the first acquire attempt
        with the held slot or ``None`` (standby)."""
        started = False
        standing_by = Pauses(self._standby_backoff, self._stop)
        while not self._stop.is_set():
            sent, lease = anyio.current_time(), None
            with anyio.CancelScope() as self._acquiring:
                sent, lease = await self._acquire()
            self._acquiring = None
            if lease is None and self._stop.is_set():
                # stopped while a store that does not answer kept the acquire waiting: a lease it
                # may have granted meanwhile goes unused and expires with its ttl (one granted just
                # as the stop came is held, and released at once: the work sees the stop)
                break
            if lease is None:
                if not self.standby:
                    self.standby = True
                    if self._paused_by is not None:
                        log.info("slots of %s held by %s: standing by until the hold ends", self._ns, self._paused_by)
                    else:
                        log.info("no free slot in %s: standing by", self._ns)
                    self._on_change()
                if not started:
                    started = True
                    task_status.started(None)
                await standing_by.pause(HOLD_POLL if self._paused_by is not None else None)
                continue
            standing_by.reset()
            self._paused_by = None
            self.standby = False
            held = HeldSlot(
                lease=lease,
                partitions=frozenset(self._settings.partitions_of_slot(lease.slot)),
                valid_until=sent + self.validity_s(lease),
                owner_key=self._owner.key,
            )
            if not started:
                started = True
                task_status.started(held)
            await self._hold(held)
            if self._cooldown_s:
                self.standby = True
                self._on_change()
                with anyio.move_on_after(self._cooldown_s):
                    await self._stop.wait()
                self._cooldown_s = 0.0
        self.standby = False
        if not started:  # stopped before the first acquire (a SIGTERM during the start)
            task_status.started(None)

    async def _hold(self, held: HeldSlot) -> None:
        extra = held.log_extra()
        log.info(
            "acquired slot %d (fence %d, incarnation %d) of %s",
            held.slot,
            held.fence,
            held.lease.incarnation,
            self._ns,
            extra=extra,
        )
        if log.isEnabledFor(logging.DEBUG):  # the acquisition line has them in a compact form
            listed = ",".join(map(str, sorted(held.partitions)))
            log.debug("slot %d holds partitions %s", held.slot, listed, extra={"slot": held.slot})
        self.held = held
        self.stall.gauge = metrics.TIMERS_STALLED.labels(slot=str(held.slot))
        metrics.LEASE_FENCE.labels(slot=str(held.slot)).set(held.fence)
        self._on_change()
        work_scope = anyio.CancelScope(deadline=held.valid_until)
        grace_scope = anyio.CancelScope(deadline=self._grace_deadline)
        self._grace_scope = grace_scope
        if self._stop.is_set():
            held.request_stop()
        graceful = False
        try:
            async with anyio.create_task_group() as tg:
                self._clock_base = self._clock_offset()
                self._revalidate = anyio.Event()
                tg.start_soon(self._renew_loop, held, work_scope)
                tg.start_soon(self._watch_clock)
                with work_scope, grace_scope:
                    try:
                        await self._work(held)
                        graceful = not held.lost
                    except* LeaseLost as eg:
                        held.lost = True
                        log.warning("slot %d: %s", held.slot, _first(eg), extra=extra)
                    except* SlotStalled as eg:
                        # given up for another replica to try: released, then a standby for a while
                        graceful = True
                        self._cooldown_s = max(2 * self._settings.lease.ttl_s, STALL_COOLDOWN_MIN_S)
                        log.error(
                            "giving up slot %d for another replica to try (standby for %.0f s): %s",
                            held.slot, self._cooldown_s, _first(eg), extra=extra,
                        )  # fmt: skip
                tg.cancel_scope.cancel()
        finally:
            self.held = None
            self._grace_scope = None
            if work_scope.cancelled_caught and not grace_scope.cancelled_caught:
                held.lost = True
            metrics.LEASE_FENCE.remove(str(held.slot))
            if held.lost or not held.valid:
                metrics.LEASE_LOST.inc()
                log.warning("lost slot %d (fence %d): its work stopped", held.slot, held.fence, extra=extra)
            else:
                await self._release(held, graceful)
            self._on_change()

    async def _release(self, held: HeldSlot, graceful: bool) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            try:
                ok = await self._store.release(held.lease, last_issued=held.lease.written_at)
            except StorageError as exc:
                log.warning("release of slot %d failed: %s", held.slot, exc, extra=held.log_extra())
                return
            log.info(
                "released slot %d (fence %d)%s",
                held.slot,
                held.fence,
                "" if ok else ": it was no longer ours",
                extra=held.log_extra(),
            )

    def _next_renew(self, held: HeldSlot) -> float:
        """When the validity left drops to ``ttl - tolerance - ttl/3``: ``ttl/3`` after a take or
        a renewal, sooner after a re-acquire that handed back a worn lease."""
        return held.valid_until - self._validity_s + self._renew_every

    async def _watch_clock(self) -> None:
        """Compares the wall clock with the monotonic clock every half step: a step beyond the
        tolerance (an NTP step, a manual change) wakes the renew loop at once."""
        while True:
            await anyio.sleep(self._step_s / 2)
            offset = self._clock_offset()
            step = offset - self._clock_base
            if abs(step) > self._step_s:
                self._clock_base = offset
                log.warning("the wall clock stepped %+.3f s against the monotonic clock: renewing the lease now", step)
                self._revalidate.set()

    async def _renew_loop(self, held: HeldSlot, work_scope: anyio.CancelScope) -> None:
        next_at = self._next_renew(held)
        while True:
            with anyio.CancelScope(deadline=next_at):
                await self._revalidate.wait()
            if self._revalidate.is_set():
                self._revalidate = anyio.Event()
            sent = anyio.current_time()
            base = self._clock_offset()
            try:
                with metrics.LEASE_RENEW_SECONDS.time():
                    renewed = await self._store.renew(held.lease, self._ttl, self._tolerance)
            except StorageError as exc:
                reason = "unavailable" if isinstance(exc, StorageUnavailable) else "error"
                metrics.LEASE_RENEW_FAILURES.labels(reason=reason).inc()
                self.stall.failed(f"renew of slot {held.slot}", exc, logging.LoggerAdapter(log, held.log_extra()))
                next_at = anyio.current_time() + max(0.05, self._renew_every / 4)
                continue
            self.stall.progressed(log)
            if renewed is None:
                metrics.LEASE_RENEW_FAILURES.labels(reason="lost").inc()
                held.lost = True
                log.warning("renew of slot %d refused: the lease is lost", held.slot, extra=held.log_extra())
                work_scope.cancel()
                return
            if anyio.current_time() >= held.valid_until:
                # the work is already stopped (deadline passed while the renew was in flight)
                return
            if abs(base - self._clock_base) <= self._step_s:
                self._clock_base = base  # a slewing clock's drift never adds up to a step
            valid_until = sent + self.validity_s(renewed)
            held.lease = renewed
            held.valid_until = valid_until
            work_scope.deadline = valid_until
            metrics.LEASE_FENCE.labels(slot=str(held.slot)).set(renewed.fence)
            next_at = self._next_renew(held)
            if renewed.held_by is not None and not held.stopping:
                self._release_for_hold(held, renewed.held_by)

    def _release_for_hold(self, held: HeldSlot, by: str) -> None:
        """The slot is held (``by``): its work drains as on a stop, bounded by the grace period;
        :meth:`_hold` releases it and :meth:`run` stands by until the hold ends."""
        grace_s = self._settings.shutdown.grace_s
        log.info(
            "slot %d is held by %s: draining its work (at most %.1f s) and releasing it until the hold ends",
            held.slot,
            by,
            grace_s,
            extra=held.log_extra(),
        )
        self._paused_by = by
        held.request_stop()
        if self._grace_scope is not None:
            self._grace_scope.deadline = min(self._grace_scope.deadline, anyio.current_time() + grace_s)


class Presence:
    """This replica's presence record (see the module docstring). ``held`` answers the slots the
    replica holds now; :meth:`changed` asks for a heartbeat at once (after an acquire or a
    release); :meth:`stop` ends :meth:`run`, which then deletes the record."""

    def __init__(
        self,
        settings: WowdSettings,
        store: SlotLeaseStore,
        held: Callable[[], Iterable[HeldSlot]],
        *,
        owner_key: str,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        self._store = store
        self._held = held
        self._ns = settings.lease_namespace
        self._ttl_s = settings.lease.ttl_s
        self._ttl = timedelta(seconds=settings.lease.ttl_s)
        self._every_s = settings.lease.ttl_s / 3
        self.owner_key = owner_key
        self._host = socket.gethostname() if host is None else host
        self._pid = os.getpid() if pid is None else pid
        self._instance = uuid.uuid4().hex
        self._poke = anyio.Event()
        self._stop = anyio.Event()
        self._beating: anyio.CancelScope | None = None
        self._warned_at = -math.inf
        self._failures = 0

    def info(self) -> ReplicaInfo:
        """What the next heartbeat writes: the slots held with a valid lease now."""
        return ReplicaInfo(
            instance=self._instance,
            host=self._host,
            pid=self._pid,
            version=__version__,
            slots=tuple(sorted(h.slot for h in self._held() if h.valid)),
        )

    def changed(self) -> None:
        """A heartbeat at once (the slots held changed)."""
        self._poke.set()

    def stop(self) -> None:
        """Ends the heartbeats; one in flight is cancelled (the record is deleted next)."""
        self._stop.set()
        self._poke.set()
        if self._beating is not None:
            self._beating.cancel()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Heartbeats until stopped: at once, then every ``ttl/3`` or sooner after a change;
        then deletes the record (also when cancelled: shielded, bounded)."""
        task_status.started()
        try:
            while not self._stop.is_set():
                self._poke = anyio.Event()
                with anyio.CancelScope() as self._beating:
                    await self._beat()
                self._beating = None
                with anyio.move_on_after(self._every_s):
                    await self._poke.wait()
        finally:
            await self._leave()

    async def _beat(self) -> None:
        info = self.info()
        try:
            with anyio.fail_after(self._ttl_s):  # a hung write is a failed one: the next one is due
                await self._store.heartbeat(self._ns, self.owner_key, info, self._ttl)
        except (StorageError, TimeoutError) as exc:
            unavailable = isinstance(exc, StorageUnavailable | TimeoutError)
            metrics.LEASE_HEARTBEAT_FAILURES.labels(reason="unavailable" if unavailable else "error").inc()
            self._failures += 1
            what = str(exc) or "no answer within the ttl"
            now = anyio.current_time()
            if now >= self._warned_at + HEARTBEAT_WARN_EVERY_S:
                log.warning(
                    "presence heartbeat of %s failed (%d since the last warning; leases unaffected): %s",
                    self.owner_key,
                    self._failures,
                    what,
                )
                self._warned_at = now
                self._failures = 0
            else:
                log.debug("presence heartbeat of %s failed: %s", self.owner_key, what)

    async def _leave(self) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            try:
                await self._store.leave(self._ns, self.owner_key)
            except StorageError as exc:
                log.warning("presence record of %s not deleted (it expires on its own): %s", self.owner_key, exc)
                return
            log.debug("presence record of %s deleted", self.owner_key)
