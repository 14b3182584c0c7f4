"""The timer loop's wake-up channel: what the feed of one slot put and how far it has applied."""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable

import anyio

from wowd.clock import now_ms
from wowd.model import AggregateRef

__all__ = ["WAKER_HORIZON_MS", "WAKER_MAX_SIZE", "OwnerKey", "Waker", "owner_key"]

OwnerKey = tuple[str, str, str]
"""An aggregate as the :class:`Waker` remembers it: ``(aggregate, tenant_id, id)``."""


def owner_key(ref: AggregateRef) -> OwnerKey:
    """The :data:`OwnerKey` of an aggregate (of one context)."""
    return (ref.aggregate, ref.tenant_id, ref.id)


WAKER_HORIZON_MS = 60_000
"""A :class:`Waker` keeps the due times of puts due within this (the loop's reads find later ones)."""
WAKER_MAX_SIZE = 50_000
"""At most this many due times kept by a :class:`Waker` (about 4 MB)."""


class Waker:
    """What the timer loop of one slot knows of the timers this process put: the due times the
    feed put (and the loop's own retries and next occurrences) that no round has covered yet, in a
    small heap, and an early wake-up when one is put due before the loop's planned wake-up.

    A round that read every timer due by ``until`` (fewer than its batch) covers the heap's
    entries due by then that were pushed before the read began (:meth:`mark` before the read,
    :meth:`covered` after it); an entry pushed meanwhile may have been stored after the read's
    snapshot and is kept. Entries due more than ``horizon_ms`` ahead are not kept (nor any past
    ``max_size``): the loop's next read finds them with ``TimerStore.next_due``, long before they
    are due, as it reads at least once per idle period.
    """

    def __init__(
        self,
        *,
        horizon_ms: int = WAKER_HORIZON_MS,
        max_size: int = WAKER_MAX_SIZE,
        partitions: Collection[int] | None = None,
    ) -> None:
        self._partitions = frozenset(partitions) if partitions is not None else None
        """The slot's partitions: a watermark that holds for some of them only counts once each
        has one (``None``: not known, such a watermark is not taken)."""
        self._watermarks: dict[int, int] = {}
        self._read_marks: dict[int, int] = {}
        """Per partition, the watermark and read mark of reads that covered some partitions only."""
        self.read_at = float("-inf")
        """When (``anyio.current_time()``) the feed last read the log up to its head."""
        self._read_event = anyio.Event()
        self._event = anyio.Event()
        self._heap: list[tuple[int, int]] = []
        """``(due_at, sequence)`` of each put not yet covered by a round."""
        self._seq = 0
        self._horizon_ms = horizon_ms
        self._max_size = max_size
        self._wake_before: float = float("-inf")
        """While the loop waits: a put due before this wakes it (``-inf`` when it is not waiting:
        the heap is read when it is about to wait)."""
        self.watermark: int | None = None
        """The feed's watermark (store time, ms): every commit of the slot's partitions appended
        before it is applied to the timer view. ``None`` until the feed first reaches the log's
        head after the slot was taken: nothing of the slot fires before."""
        self._want_watermark: float = float("inf")
        """While the loop waits: a watermark at or above this wakes it."""
        self.created_ms = now_ms()
        self.read_mark: int | None = None
        """Every commit of the slot's partitions appended before it has been read by the feed:
        applied, or in the batch it is applying (whose aggregates :meth:`changed_since` names)."""
        self._batches = 0
        """Batches the feed has read."""
        self._applied = 0
        """Batches the feed has applied (the last one read, or the one before)."""
        self._recent: deque[tuple[int, frozenset[OwnerKey]]] = deque()
        """``(batch number, aggregates committed)`` of the batches read and not applied, and of
        those applied since the oldest mark held was taken."""
        self._held: Counter[int] = Counter()
        self._readers: list[tuple[int, anyio.Event]] = []
        self._appliers: list[tuple[int, anyio.Event]] = []

    def _slot_mark(self, marks: dict[int, int], mark: int, covers: frozenset[int] | None) -> int | None:
        """The slot's mark implied by a ``mark`` that holds for ``covers`` (``None``: every
        partition): the lowest over the slot's partitions, ``None`` while one has none."""
        if covers is None:
            return mark
        if self._partitions is None:
            return None
        for p in covers & self._partitions:
            if marks.get(p, mark - 1) < mark:
                marks[p] = mark
        if not self._partitions <= marks.keys():
            return None
        return min(marks[p] for p in self._partitions)

    def advance(self, watermark: int, covers: frozenset[int] | None = None) -> None:
        """The feed applied every commit of ``covers`` (``None``: of every partition of the
        slot) appended before ``watermark``: the slot's watermark is the lowest of its
        partitions'; wakes a loop waiting for it to reach a due time at or below it."""
        slot_mark = self._slot_mark(self._watermarks, watermark, covers)
        if slot_mark is None:
            return
        watermark = slot_mark
        if self.watermark is None or watermark > self.watermark:
            self.watermark = watermark
            if watermark >= self._want_watermark:
                self._event.set()
        self._read_to(watermark)

    # ---- what the feed is applying: delivering a timer claimed ahead of the watermark

    def reading(self, read_mark: int | None, owners: Iterable[OwnerKey], covers: frozenset[int] | None = None) -> int:
        """The feed read a batch (committed by ``owners``) and is about to apply it; with a
        ``read_mark`` when the read reached the head of the partitions ``covers`` (``None``:
        every partition). Answers the batch's number, for :meth:`applied`."""
        self._batches += 1
        committed = frozenset(owners)
        if committed:
            self._recent.append((self._batches, committed))
        if read_mark is not None:
            slot_mark = self._slot_mark(self._read_marks, read_mark, covers)
            if slot_mark is not None:
                self.read_at = anyio.current_time()
                self._read_to(slot_mark)
        self._kick()
        return self._batches

    def _kick(self) -> None:
        """Wakes the waiters of :meth:`next_read`."""
        self._read_event.set()
        self._read_event = anyio.Event()

    async def next_read(self, timeout_s: float) -> None:
        """Waits until the feed reads its next batch or its read mark moves (at most
        ``timeout_s``; a stop wakes it)."""
        event = self._read_event
        with anyio.move_on_after(max(0.0, timeout_s)):
            await event.wait()

    def _read_to(self, read_mark: int) -> None:
        if self.read_mark is None or read_mark > self.read_mark:
            self.read_mark = read_mark
            _release(self._readers, lambda at: at <= read_mark)
            self._kick()

    def applied(self, batch: int, watermark: int | None, covers: frozenset[int] | None = None) -> None:
        """The feed applied batch number ``batch`` (and, with a ``watermark``, every commit of
        ``covers`` appended before it, as :meth:`advance` takes it)."""
        self._applied = max(self._applied, batch)
        self._forget()
        _release(self._appliers, lambda after: self._applied > after)
        if watermark is not None:
            self.advance(watermark, covers)

    def hold(self) -> int:
        """Taken before a due read that may claim timers ahead of the watermark: every batch
        not applied when it began may change what it claims (:meth:`changed_since`). Give it
        back with :meth:`release` once its timers are delivered or dropped."""
        mark = self._applied
        self._held[mark] += 1
        return mark

    def release(self, mark: int) -> None:
        self._held[mark] -= 1
        if self._held[mark] <= 0:
            del self._held[mark]
        self._forget()

    def _forget(self) -> None:
        """Drops the batches no mark needs: applied before every mark held was taken."""
        oldest = min(self._applied, min(self._held, default=self._applied))
        while self._recent and self._recent[0][0] <= oldest:
            self._recent.popleft()

    def changed_since(self, mark: int, owner: OwnerKey) -> bool:
        """Whether a batch the feed read after the batch ``mark`` (applied since, or being
        applied) holds a commit of ``owner``: a timer of ``owner`` claimed under ``mark`` may
        have been put again, cancelled, or deleted since."""
        return any(n > mark and owner in owners for n, owners in self._recent)

    @property
    def applied_batches(self) -> int:
        """The number of the last batch the feed applied (for :meth:`wait_applied`)."""
        return self._applied

    async def wait_applied(self, after: int, timeout_s: float) -> None:
        """Waits until the feed has applied a batch numbered above ``after`` (at most
        ``timeout_s``; a stop wakes it too)."""
        if self._applied <= after:
            await _wait_listed(self._appliers, after, timeout_s)

    async def read_past(self, at: int, timeout_s: float) -> bool:
        """Waits until the feed has read every commit appended before ``at`` (at most
        ``timeout_s``); answers whether it has."""
        if self.read_mark is None or self.read_mark < at:
            await _wait_listed(self._readers, at, timeout_s)
        return self.read_mark is not None and self.read_mark >= at

    def __len__(self) -> int:
        return len(self._heap)

    def wake(self) -> None:
        """Wakes the loop now (a stop)."""
        self._event.set()
        self._read_event.set()
        _release(self._appliers, lambda _after: True)

    def maybe_wake(self, due_at: int) -> None:
        """A timer due at ``due_at`` was stored (put, retried, or its next occurrence): kept until
        a round covers it; wakes the waiting loop when it is due before the loop's wake-up."""
        if due_at < self._wake_before:
            self._event.set()
        if len(self._heap) < self._max_size and due_at <= now_ms() + self._horizon_ms:
            heapq.heappush(self._heap, (due_at, self._seq))
            self._seq += 1

    def mark(self) -> int:
        """Taken just before a due read: the entries pushed before it are stored."""
        return self._seq

    def covered(self, until_ms: int, mark: int) -> None:
        """A due read that began at ``mark`` read every timer due by ``until_ms``: drops the
        entries due by then pushed before ``mark``."""
        heap = self._heap
        kept: list[tuple[int, int]] = []
        while heap and heap[0][0] <= until_ms:
            entry = heapq.heappop(heap)
            if entry[1] >= mark:
                kept.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)

    def earliest(self) -> int | None:
        """The earliest due time kept (``None``: none)."""
        return self._heap[0][0] if self._heap else None

    async def wait(self, timeout_s: float, wake_before: float, want_watermark: float = float("inf")) -> None:
        """Sleeps ``timeout_s`` at most; returns early on :meth:`wake`, when a timer due before
        ``wake_before`` is put (stored) meanwhile, or when the watermark reaches ``want_watermark``."""
        if timeout_s > 0 and not self._event.is_set():
            self._wake_before = wake_before
            self._want_watermark = want_watermark
            try:
                with anyio.move_on_after(timeout_s):
                    await self._event.wait()
            finally:
                self._wake_before = float("-inf")
                self._want_watermark = float("inf")
        if self._event.is_set():
            self._event = anyio.Event()


def _release(waiters: list[tuple[int, anyio.Event]], reached: Callable[[int], bool]) -> None:
    """Sets the event of each waiter whose mark is ``reached``; keeps the others, in place."""
    kept = []
    for mark, event in waiters:
        if reached(mark):
            event.set()
        else:
            kept.append((mark, event))
    waiters[:] = kept


async def _wait_listed(waiters: list[tuple[int, anyio.Event]], mark: int, timeout_s: float) -> None:
    """Waits (at most ``timeout_s``) for :func:`_release` to set a waiter added at ``mark``."""
    entry = (mark, anyio.Event())
    waiters.append(entry)
    with anyio.move_on_after(timeout_s):
        await entry[1].wait()
    if not entry[1].is_set():
        waiters.remove(entry)
