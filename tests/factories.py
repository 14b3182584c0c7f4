"""The tests' one set of builders: aggregates, timers, events, commits, outbox entries and slot
leases with keyword defaults (a test names what it asserts on and takes the rest), the settings of
one replica on an embedded file, one :func:`eventually` and one recording gateway.

The defaults: context :data:`CONTEXT` over :data:`PARTITIONS` partitions, order ``o-1`` of the
default tenant, timer key ``k`` at version 1, a command ``go`` sent to the timer's owner.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio

from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.delivery import Delivered, Outcome
from wowd.model import (
    AggregateRef,
    Command,
    Commit,
    DomainEvent,
    OutboxEntry,
    SlotLease,
    Timer,
    deterministic_timer_id,
    partition,
)

CONTEXT = "demo"
PARTITIONS = 8


def now_ms() -> int:
    return int(time.time() * 1000)


def ref(id: str = "o-1", *, aggregate: str = "order", context: str = CONTEXT, tenant: str = "(0)") -> AggregateRef:
    """The aggregate ``context.aggregate`` ``id`` of ``tenant``."""
    return AggregateRef(context=context, aggregate=aggregate, id=id, tenant_id=tenant)


def timer(
    id: str = "o-1",
    due_at: int = 0,
    *,
    owner: AggregateRef | None = None,
    key: str = "k",
    version: int = 1,
    partitions: int = PARTITIONS,
    target: AggregateRef | None = None,
    command: Command | None = None,
    **fields: Any,
) -> Timer:
    """The timer ``key`` (at ``version``) of order ``id`` (or of ``owner``), due at ``due_at``,
    sending ``command`` (default ``go``) to ``target`` (default its owner). Its id is the one the
    feed derives, its partition the owner's among ``partitions``, ``scheduled_at`` its due time;
    ``fields``: any other field of :class:`Timer` (``rule``, ``status``, ``claim``, ``timer_id``,
    ``partition``, ``scheduled_at``, ...)."""
    owner = owner if owner is not None else ref(id)
    values: dict[str, Any] = {
        "timer_id": deterministic_timer_id(owner, key, version),
        "partition": partition(owner.id, partitions),
        "scheduled_at": due_at,
        "target": target if target is not None else owner,
        "body": (command if command is not None else Command(name="go")).to_json(),
    }
    values.update(fields)
    return Timer(owner=owner, key=key, version=version, due_at=due_at, **values)


def event(name: str = "ItemAdded", **body: Any) -> DomainEvent:
    """A domain event ``name`` with ``body`` (a fresh id)."""
    return DomainEvent(id=uuid.uuid4().hex, name=name, body=body)


def scheduled(
    key: str = "k",
    due_at: Any = 0,
    *,
    target: AggregateRef | Mapping[str, Any] | None = None,
    command: str | Mapping[str, Any] = "go",
    body: Mapping[str, Any] | None = None,
    rule: Any = None,
    **fields: Any,
) -> DomainEvent:
    """A ``TimerScheduled`` event as a producer writes it: the timer ``key`` due at ``due_at``
    (``rule``, its document: once), sending the command ``command`` with ``body`` to ``target``
    (an aggregate, or its document as written; default order ``o-1``). A mapping for ``command``
    is its document as written; ``fields`` are more (or other) fields of the event's body, written
    as given (the readers' tests write what a producer should not)."""
    aim = target if target is not None else ref()
    doc: dict[str, Any] = {
        "key": key,
        "due_at": due_at,
        "rule": rule if rule is not None else {"type": "once"},
        "target": {"context": aim.context, "aggregate": aim.aggregate, "id": aim.id}
        if isinstance(aim, AggregateRef)
        else aim,
        "command": {"name": command, "body": dict(body or {})} if isinstance(command, str) else command,
    }
    if isinstance(aim, AggregateRef) and aim.tenant_id != "(0)":
        doc["target"]["tenant_id"] = aim.tenant_id
    doc.update(fields)
    return DomainEvent(id=uuid.uuid4().hex, name="TimerScheduled", body=doc)


def cancelled(key: str = "k") -> DomainEvent:
    """A ``TimerCancelled`` event of the timer ``key``."""
    return DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": key})


def commit(
    id: str = "o-1",
    version: int = 1,
    *events: DomainEvent,
    owner: AggregateRef | None = None,
    create_time: int | None = None,
    **fields: Any,
) -> Commit:
    """The commit ``version`` of order ``id`` (or of ``owner``) holding ``events`` (none given:
    one ``ItemAdded``), created now (or at ``create_time``), with fresh command and request ids;
    ``fields``: any other field of :class:`Commit` (``deleted``, ``access``, ``request_id``,
    ``events`` as a tuple, ...)."""
    values: dict[str, Any] = {
        "command_id": uuid.uuid4().hex,
        "request_id": uuid.uuid4().hex,
        "events": events or (event(n=version),),
    }
    values.update(fields)
    return Commit(
        ref=owner if owner is not None else ref(id),
        version=version,
        create_time=now_ms() if create_time is None else create_time,
        **values,
    )


def timer_commit(agg_id: str, version: int, keys: list[str], due_at: int | None = None) -> Commit:
    """The commit ``version`` of order ``agg_id``: an ``ItemAdded``, then a timer scheduled for
    each of ``keys``, due at ``due_at`` (default now), sending ``expire-order`` with ``{"key":
    key}`` to the order itself."""
    due = now_ms() if due_at is None else due_at
    owner = ref(agg_id)
    timers = [scheduled(key, due, target=owner, command="expire-order", body={"key": key}) for key in keys]
    return commit(agg_id, version, event(n=version), *timers, create_time=due)


def outbox_entry(
    request_id: str = "r-1", created_at: int = 0, *, target: AggregateRef | None = None, **fields: Any
) -> OutboxEntry:
    """The outbox's entry ``request_id`` of timer ``t`` (fence 1, owner key ``k``), a command
    ``go`` to ``target`` (default order ``o-1``) put at ``created_at``; ``fields``: any other
    field of :class:`OutboxEntry`."""
    values: dict[str, Any] = {
        "timer_id": "t",
        "command": Command(name="go").to_json(),
        "scheduled_at": 1,
        "fence": 1,
        "owner_key": "k",
    }
    values.update(fields)
    return OutboxEntry(
        request_id=request_id, target=target if target is not None else ref(), created_at=created_at, **values
    )


def lease(fence: int = 1, *, owner_key: str = "me", **fields: Any) -> SlotLease:
    """Slot 0 of namespace ``t`` held by ``owner_key`` under ``fence`` (its incarnation too),
    written at 0 and expired since; ``fields``: any other field of :class:`SlotLease`."""
    values: dict[str, Any] = {
        "namespace": "t",
        "slot": 0,
        "incarnation": fence,
        "expires_at": 0,
        "floor": 0,
        "ceiling": 0,
        "written_at": 0,
    }
    values.update(fields)
    return SlotLease(owner_key=owner_key, fence=fence, **values)


def embedded_settings(tmp_path: Path, partitions: int = PARTITIONS, **extra: Any) -> WowdSettings:
    """One replica's settings (a lease limit of 1) on the embedded file ``tmp_path/wowd.db``;
    ``extra``: more settings."""
    extra.setdefault("lease", LeaseSettings(limit=1))
    return WowdSettings(
        context=CONTEXT, partitions=partitions, embedded=EmbeddedSettings(path=tmp_path / "wowd.db"), **extra
    )


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], within: float = 10, what: str = "condition", every: float = 0.05
) -> None:
    """Returns once ``check()`` (a function or a coroutine function) holds, asked every ``every``
    seconds, else fails the test after ``within`` seconds naming ``what``. For a state no event
    announces (a process's file, another process's store); where the code under test sets an
    event, wait on that instead."""
    try:
        with anyio.fail_after(within):
            while True:
                held = check()
                if inspect.isawaitable(held):
                    held = await held
                if held:
                    return
                await anyio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for: {what}") from None


class Recorder:
    """A gateway that records each timer it is sent, and when (:attr:`fired`, ms since the
    epoch), answering ``answer(timer)`` (default :class:`Delivered`). :meth:`hold` makes the sends
    to a target aggregate (or to all) wait until released; :attr:`in_flight` and :attr:`peak`
    count the sends under way per target aggregate; :attr:`entered` is set at the first send."""

    def __init__(self, answer: Callable[[Timer], Outcome] | None = None) -> None:
        self.answer = answer if answer is not None else (lambda _timer: Delivered())
        self.fired: list[tuple[Timer, int]] = []
        self.changed = anyio.Event()
        self.entered = anyio.Event()
        self.in_flight: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self._holds: dict[str | None, anyio.Event] = {}

    @property
    def sent(self) -> list[Timer]:
        """The timers delivered so far, in order."""
        return [t for t, _at in self.fired]

    def hold(self, aggregate: str | None = None) -> anyio.Event:
        """From now on the sends to target aggregate ``aggregate`` (``None``: every send) wait
        until the event answered is set."""
        self._holds[aggregate] = anyio.Event()
        return self._holds[aggregate]

    async def send(self, timer: Timer) -> Outcome:
        aggregate = timer.target.aggregate
        self.in_flight[aggregate] += 1
        self.peak[aggregate] = max(self.peak[aggregate], self.in_flight[aggregate])
        self.entered.set()
        try:
            for held in (self._holds.get(aggregate), self._holds.get(None)):
                if held is not None:
                    await held.wait()
        finally:
            self.in_flight[aggregate] -= 1
        self.fired.append((timer, now_ms()))
        self.changed.set()
        self.changed = anyio.Event()
        return self.answer(timer)

    async def until_fired(self, n: int) -> None:
        """Returns once ``n`` timers were delivered (call it inside ``fail_after``)."""
        while len(self.fired) < n:
            await self.changed.wait()

    async def aclose(self) -> None:
        return None
