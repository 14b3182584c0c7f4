"""The supervisor: one task group holding the slot keepers (each running a feed and a timer loop
per held slot), the replica's presence heartbeat, the HTTP listener, the health loop and the
systemd watchdog.

It never touches signals: the composition root calls :meth:`Supervisor.stop` (graceful: stop
claiming, drain deliveries within the grace period, settle, stop the feed at a batch boundary,
release the leases) or :meth:`Supervisor.cancel` (at once). A side loop that dies takes the whole
group down and :meth:`run` raises, so the process exits non-zero.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from wowd import metrics
from wowd.clock import now_ms
from wowd.config import WowdSettings
from wowd.delivery import OutboxGateway
from wowd.delivery.outbox import OUTBOX_HOUSEKEEPING_S
from wowd.errors import StorageError
from wowd.reducers import Reducer, load_reducer
from wowd.retry import Backoff, RetryStopped, retrying
from wowd.stores.base import PROCESS_CLOCK, Backend
from wowd.ui import StatusPage

from .feed import Feeder
from .firing import Firing
from .http import HttpServer
from .leases import HeldSlot, Presence, SlotKeeper, check_store_clock, owner_key_for
from .rebuild import Rebuilder
from .systemd import SystemdNotifier
from .timers import TimerLoop
from .waker import Waker

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

HEALTH_EVERY_S = 2.0
PING_TIMEOUT_S = 5.0
PREPARE_BACKOFF = Backoff(0.2, 10.0)
"""The pause before retrying to prepare stores that did not answer."""


class Supervisor:
    """Runs one replica (docs/architecture.md) until stopped. Constructing it has no side effect."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        firing: Firing,
        *,
        outbox: OutboxGateway | None = None,
        notifier: SystemdNotifier | None = None,
        port_file: Path | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.firing = firing
        """How the slots' timers fire (:func:`~wowd.daemon.firing.choose`)."""
        self.outbox = outbox
        """The outbox gateway, when it is the gateway: its depth and retention are kept here."""
        self.notifier = notifier or SystemdNotifier()
        self._port_file = port_file
        self._keepers: list[SlotKeeper] = []
        self._presence: Presence | None = None
        self._stop = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False
        self.stores_ok = False
        self.http: HttpServer | None = None
        self.listening = anyio.Event()
        """Set once :attr:`http` has bound its port."""
        self._reducers: dict[str, Reducer] = {}
        self._feeders: dict[int, Feeder] = {}
        """The feed of each slot held now (its ``stalled`` state decides readiness)."""
        self._loops: dict[int, TimerLoop] = {}
        """The timer loop of each slot held now (its ``stall`` decides readiness too)."""
        self._wakers: dict[int, Waker] = {}
        self._slots_seen: set[int] = set()
        # read at each scrape: 1 exactly when /readyz answers 200
        metrics.READY.set_function(lambda: 1.0 if self.ready() else 0.0)

    # ------------------------------------------------------------------ state

    @property
    def held(self) -> list[HeldSlot]:
        return [k.held for k in self._keepers if k.held is not None]

    def functioning(self) -> tuple[bool, str]:
        """Whether this replica does its job (``/readyz``, ``wowd_ready``), holder or standby:
        its stores answer, no slot it holds is stalled (its timer view, or its timer loop) and its lease
        keepers' writes are not refused (a full disk); ``why`` says which or what."""
        if not self.stores_ok:
            return False, "the stores do not answer"
        stalled = [(slot, f.stalled) for slot, f in self._feeders.items() if f.stalled is not None]
        stalled += [
            (slot, f"timer loop: {t.stall.reason}")
            for slot, t in self._loops.items()
            if t.stall is not None and t.stall.reason is not None
        ]
        refused = [f"{k.stall.what}: {k.stall.reason}" for k in self._keepers if k.stall.reason is not None]
        if stalled or refused:
            return False, "; ".join([*(f"slot {slot} stalled: {why}" for slot, why in sorted(stalled)), *refused])
        held = [h for h in self.held if h.valid]
        why = (
            "holding slot(s) " + ", ".join(str(h.slot) for h in sorted(held, key=lambda h: h.slot))
            if held
            else f"standby: no free slot in {self.settings.lease_namespace}"
        )
        # another view's stall is not the replica's: it still fires timers (named, still ready)
        behind = [
            f"{view} view of slot {slot} stalled: {reason}"
            for slot, f in sorted(self._feeders.items())
            for view, reason in f.view_stalls().items()
            if view != f.lead.name
        ]
        return True, "; ".join([why, *behind])

    def readiness(self, holding: bool) -> tuple[bool, str]:
        """``/readyz`` (functioning) or ``/readyz?holding=1`` (functioning and holding a slot)."""
        ok, why = self.functioning()
        if ok and holding and not any(h.valid for h in self.held):
            return False, why
        return ok, why

    def ready(self) -> bool:
        return self.functioning()[0]

    def slot_stalls(self) -> dict[int, str | None]:
        """The slots held now, each with why a view or the timer loop is stalled (``None``: none is)."""
        out: dict[int, str | None] = {}
        for h in self.held:
            feeder, loop = self._feeders.get(h.slot), self._loops.get(h.slot)
            stalls = feeder.view_stalls() if feeder is not None else {}
            why = [f"{view} view: {reason}" for view, reason in sorted(stalls.items())]
            if loop is not None and loop.stall is not None and loop.stall.reason is not None:
                why.append(f"timer loop: {loop.stall.reason}")
            out[h.slot] = "; ".join(why) or None
        return out

    def _status_line(self) -> str:
        held = self.held
        if not held:
            return f"standby: no free slot in {self.settings.lease_namespace}"
        slots = ", ".join(f"{h.slot} (fence {h.fence})" for h in sorted(held, key=lambda h: h.slot))
        return f"holding slot(s) {slots} of {self.settings.lease_namespace}"

    def _on_lease_change(self) -> None:
        held = self.held
        slots = {h.slot for h in held}
        for slot in self._slots_seen - slots:
            metrics.SLOT_HELD.labels(slot=str(slot)).set(0)
        for slot in slots:
            metrics.SLOT_HELD.labels(slot=str(slot)).set(1)
        self._slots_seen |= slots
        metrics.LEASES_HELD.set(len(held))
        metrics.PARTITIONS_OWNED.set(sum(len(h.partitions) for h in held))
        if self._presence is not None:
            self._presence.changed()
        if not self._stop.is_set():
            self.notifier.status(self._status_line())

    # ------------------------------------------------------------------ control

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Graceful stop (idempotent)."""
        if self._stop.is_set():
            return
        log.info("stopping: draining within %.1fs", self.settings.shutdown.grace_s)
        self._stop.set()
        self.notifier.stopping()
        for k in self._keepers:
            k.stop(self.settings.shutdown.grace_s)

    def cancel(self) -> None:
        """Stops at once (a second signal): leases are still released, shielded and bounded."""
        self._cancelled = True
        self.stop()
        if self._scope is not None:
            self._scope.cancel()

    # ------------------------------------------------------------------ run

    async def run(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Runs until stopped; ``started`` with the HTTP port once every keeper made its first
        acquire attempt."""
        s = self.settings
        for agg, path in s.reducers.items():
            self._reducers[agg] = load_reducer(path)
        base_key = s.owner_key
        self._keepers = [
            SlotKeeper(
                i,
                s,
                self.backend.leases,
                self._slot_work,
                owner_key=owner_key_for(base_key, i),
                on_change=self._on_lease_change,
            )
            for i in range(s.lease.slots_per_process)
        ]
        presence = self._presence = Presence(s, self.backend.leases, lambda: self.held, owner_key=base_key)
        # the outbox depth is counted at each scrape (the store call cannot run inside a collector)
        outbox = self.outbox
        if outbox is not None:
            metrics.OUTBOX_DEPTH_AGE.set_function(outbox.depth_age)
        self.http = HttpServer(
            s.http.host,
            s.http.port,
            self.readiness,
            port_file=self._port_file,
            refresh=outbox.count_depth if outbox is not None else None,
            app=StatusPage(s, self.backend, local=self.slot_stalls),
            max_connections=s.http.max_connections,
            allowed_hosts=s.http.allowed_hosts,
        )
        with anyio.CancelScope() as scope:
            self._scope = scope
            async with anyio.create_task_group() as tg:
                port = await tg.start(self.http.serve)
                self.listening.set()
                if not await self._prepare():
                    tg.cancel_scope.cancel()
                    return
                await self._ping()
                tg.start_soon(self._health_loop)
                if outbox is not None:
                    tg.start_soon(self._outbox_loop, outbox)
                if self.notifier.watchdog_interval:
                    tg.start_soon(self._watchdog_loop, self.notifier.watchdog_interval)
                async with anyio.create_task_group() as replica:
                    async with anyio.create_task_group() as slots:
                        for k in self._keepers:
                            await slots.start(k.run)
                        if self._stop.is_set():
                            for k in self._keepers:
                                k.stop(s.shutdown.grace_s)
                        self._on_lease_change()
                        # after the first acquire attempts: the first heartbeat says holder or standby
                        await replica.start(presence.run)
                        self.notifier.ready(self._status_line())
                        log.info("replica %s started: %s", base_key, self._status_line())
                        task_status.started(port)
                    presence.stop()  # the leases are released: the presence record goes last
                tg.cancel_scope.cancel()
        self._scope = None
        metrics.READY.set_function(lambda: 0.0)
        log.info("replica stopped%s", " (cancelled)" if self._cancelled else "")

    async def _prepare(self) -> bool:
        """Prepares the stores, retrying while they do not answer (``/healthz`` is served
        meanwhile, ``/readyz`` says 503). False when stopped first. Raises
        :class:`~wowd.errors.ConfigError` when the backend's store clock is this process's own
        and the store disagrees with it (:func:`~wowd.daemon.leases.check_store_clock`)."""
        b = self.backend
        if self._stop.is_set():
            return False
        try:
            async for attempt in retrying("preparing the stores", backoff=PREPARE_BACKOFF, stop=self._stop, logger=log):
                with attempt:
                    await b.log.prepare()
                    await b.timers.prepare()
                    await b.snapshots.prepare()
                    for agg in self._reducers:
                        await b.snapshots.create_collection(agg)
                    clock = b.capability(PROCESS_CLOCK)
                    if clock is not None:
                        # the store clock is this process's own: no slot on a clock the file disagrees with
                        reading = await clock.clock_reading(self.settings.owner_key)
                        check_store_clock(reading, self.settings.lease.tolerance_s)
        except RetryStopped:
            return False
        return True

    async def _slot_work(self, held: HeldSlot) -> None:
        waker = Waker(partitions=held.partitions)
        feeder = Feeder(self.settings, self.backend, reducers=self._reducers)
        loop = self.firing.loop()
        self._feeders[held.slot] = feeder
        self._loops[held.slot] = loop
        self._wakers[held.slot] = waker
        self._on_lease_change()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, waker)
                # snapshots of a raised state revision: this slot's partitions, before its feed
                await Rebuilder(self.settings, self.backend, self._reducers).rebuild_slot(held)
                await tg.start(feeder.run, held, waker)
        finally:
            self._feeders.pop(held.slot, None)
            self._loops.pop(held.slot, None)
            self._wakers.pop(held.slot, None)
            for view in feeder.views:  # the slot's work ended: none of its views is stalled here
                metrics.FEED_STALLED.labels(slot=str(held.slot), view=view.name).set(0)
            for aggregate in self._reducers:  # nor is a rebuild of its partitions failing here
                metrics.SNAPSHOT_REBUILD_FAILED.labels(slot=str(held.slot), aggregate=aggregate).set(0)
            # the slot's timers still wait while its keeper's lease writes are refused (a full disk)
            keeper_stalled = any(k.owner_key == held.owner_key and k.stall.stalled for k in self._keepers)
            metrics.TIMERS_STALLED.labels(slot=str(held.slot)).set(1 if keeper_stalled else 0)

    async def _ping(self) -> None:
        ok = False
        with anyio.move_on_after(PING_TIMEOUT_S):
            try:
                await self.backend.log.ping()
                ok = True
            except StorageError as exc:
                log.warning("stores do not answer: %s", exc)
        if ok != self.stores_ok:
            self.stores_ok = ok
        now = now_ms()
        for slot, waker in list(self._wakers.items()):
            # before the feed first reaches the head: since the slot was taken
            mark = waker.watermark if waker.watermark is not None else waker.created_ms
            metrics.FEED_WATERMARK_LAG.labels(slot=str(slot)).set(max(0.0, (now - mark) / 1000))

    async def _health_loop(self) -> None:
        s = self.settings
        ns = s.lease_namespace
        while True:
            await self._ping()
            try:
                with anyio.fail_after(PING_TIMEOUT_S):
                    states = await self.backend.leases.slots(ns)
                live = {st.slot for st in states if st.live}
                unowned = 0
                for slot in range(s.lease.slot_offset, s.lease.slot_offset + s.lease.limit):
                    if slot not in live:
                        unowned += len(s.partitions_of_slot(slot))
                metrics.PARTITIONS_UNOWNED.set(unowned)
            except (StorageError, TimeoutError) as exc:
                log.debug("slot table not read: %s", exc)
            await anyio.sleep(min(HEALTH_EVERY_S, s.lease.ttl_s / 2))

    async def _outbox_loop(self, outbox: OutboxGateway) -> None:
        """Trims the outbox past its retention every :data:`OUTBOX_HOUSEKEEPING_S`."""
        while True:
            await outbox.housekeep()
            await anyio.sleep(OUTBOX_HOUSEKEEPING_S)

    async def _watchdog_loop(self, every_s: float) -> None:
        while True:
            self.notifier.watchdog()
            await anyio.sleep(every_s)
