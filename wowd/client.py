"""The application API: schedule and cancel timers by appending commits to the context's log, and
append an application's own commits (:meth:`WowdClient.append`).

:meth:`WowdClient.schedule` appends a commit carrying one ``TimerScheduled`` event,
:meth:`WowdClient.cancel` one carrying ``TimerCancelled`` (the schema the daemon's feed reads,
docs/schema.md); the daemon turns them into timers and fires each one's command at its target
when due.

Where the commit goes: by default into a stream of wowd's own, never the application's: the
stream of the owner in the reserved aggregate type :data:`SCHEDULES` of the context
(:func:`schedule_stream`: ``demo.wowd_schedule/order/order-42`` for ``demo.order/order-42``), so
that wowd adds nothing to the history of ``order-42`` and never races the application's own
commands for its next version. The timer's key is unique per owner there as well; the command
still goes to the owner (or ``target``). With ``in_owner_stream=True`` the commit is appended to
the owner's own stream instead (an application whose aggregates carry their timers themselves).

Each commit takes the stream's next version: the log's last version + 1, read again and retried
when another writer took that version meanwhile (:class:`~wowd.errors.ConflictError`). A call
given the same ``request_id`` twice appends once (the log is idempotent on it).

    async with WowdClient.connect() as client:  # the settings of the environment (WOWD_*)
        await client.schedule(order, "expire", due_at=due, command=Command(name="expire-order"))

:class:`SyncWowdClient` offers the same calls to code without an event loop.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from typing import Any, Literal

from anyio.from_thread import BlockingPortal, start_blocking_portal

from wowd import clock
from wowd.config import WowdSettings
from wowd.errors import ConfigError, ConflictError, InvalidInput
from wowd.model import (
    MAX_BODY_BYTES,
    MIN_INTERVAL_MS,
    AggregateRef,
    AggregateType,
    Command,
    Commit,
    CronRule,
    DomainEvent,
    IntervalRule,
    OnceRule,
    Rule,
    commit_from_doc,
    cron_dialect_of,
    parse_rule,
    timer_event_from,
)
from wowd.stores.base import Log

__all__ = [
    "MAX_VERSION_RETRIES",
    "Appended",
    "SCHEDULES",
    "SyncWowdClient",
    "WowdClient",
    "cancelled_event",
    "next_occurrences",
    "schedule_stream",
    "scheduled_event",
]

MAX_VERSION_RETRIES = 10
"""Appends tried at successive versions before a :class:`ConflictError` reaches the caller."""

SCHEDULES = "wowd_schedule"
"""The aggregate type, in the configured context, reserved for the timers scheduled from
outside an aggregate (the client's and the command line's default): one stream per owner."""


def schedule_stream(owner: AggregateRef) -> AggregateRef:
    """The stream of wowd's own that holds the schedules of ``owner``: aggregate
    :data:`SCHEDULES`, id ``<aggregate>/<id>``, the owner's context and tenant (``owner`` itself
    when it is such a stream already)."""
    if owner.aggregate == SCHEDULES:
        return owner
    return AggregateRef(
        context=owner.context, aggregate=SCHEDULES, id=f"{owner.aggregate}/{owner.id}", tenant_id=owner.tenant_id
    )


def _ms(value: int | datetime, field: str) -> int:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidInput("must be an aware datetime (with a time zone)", field=field)
        return int(value.timestamp() * 1000)
    return value


def _rule(rule: Rule | Mapping[str, Any] | None) -> Rule:
    """The rule a schedule writes: a cron rule given with no dialect is read in the one its
    fields say (:func:`~wowd.model.cron_dialect_of`: five as Vixie cron, six seconds first as
    the JVM's schedulers), and the rule written names it."""
    if rule is None:
        return OnceRule()
    if isinstance(rule, Mapping):
        doc = dict(rule)
        if doc.get("type") == "cron" and doc.get("dialect") is None and isinstance(doc.get("expression"), str):
            doc["dialect"] = cron_dialect_of(doc["expression"])
        return parse_rule(doc)
    if isinstance(rule, CronRule) and rule.dialect is None:
        return dataclasses.replace(rule, dialect=cron_dialect_of(rule.expression))
    return rule


def next_occurrences(rule: Rule | Mapping[str, Any], n: int = 3, *, after: int | datetime | None = None) -> list[int]:
    """The next ``n`` due times (ms) of a recurring ``rule`` after ``after`` (default now), read
    as a schedule writes it (a cron rule with no dialect as :func:`_rule` says): what a timer of
    that rule fires at. ``[]`` for a once rule."""
    parsed = _rule(rule)
    start = clock.now_ms() if after is None else _ms(after, "after")
    if isinstance(parsed, CronRule):
        return parsed.occurrences(start, n)
    out: list[int] = []
    at: int | None = start
    while isinstance(parsed, IntervalRule) and len(out) < n and at is not None:
        at = parsed.next_after(at)
        if at is not None:
            out.append(at)
    return out


def scheduled_event(
    key: str,
    *,
    target: AggregateRef,
    command: Command | Mapping[str, Any],
    due_at: int | datetime | None = None,
    rule: Rule | Mapping[str, Any] | None = None,
    now_ms: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    min_interval_ms: int = MIN_INTERVAL_MS,
) -> DomainEvent:
    """A ``TimerScheduled`` event, checked as the feed checks it (an error names the field,
    ``body.due_at``, ``body.command`` ...). Without ``due_at``, the first occurrence is the
    rule's first after now; a once rule needs ``due_at``."""
    parsed = _rule(rule)
    if due_at is None:
        if isinstance(parsed, OnceRule):
            raise InvalidInput("is required with a once rule", field="body.due_at")
        now = clock.now_ms() if now_ms is None else now_ms
        first = parsed.next_after(now)
        if first is None:
            if isinstance(parsed, CronRule):
                raise InvalidInput(
                    f"{parsed.expression!r} has no occurrence after now (in zone {parsed.zone})",
                    field="rule.expression",
                )
            raise InvalidInput("has no occurrence after now", field="rule")
        due = first
    else:
        due = _ms(due_at, "body.due_at")
    if isinstance(command, Command):
        cmd: dict[str, Any] = {"name": command.name, "body": dict(command.body)}
        if command.body_type is not None:
            cmd["body_type"] = command.body_type
    else:
        cmd = dict(command)
    body = {
        "key": key,
        "due_at": due,
        "rule": parsed.to_doc(),
        "target": {
            "context": target.context,
            "aggregate": target.aggregate,
            "tenant_id": target.tenant_id,
            "id": target.id,
        },
        "command": cmd,
    }
    event = DomainEvent(id=uuid.uuid4().hex, name="TimerScheduled", body_type="wowd.TimerScheduled", body=body)
    try:
        # raises InvalidInput naming the field
        timer_event_from(event, max_body_bytes=max_body_bytes, min_interval_ms=min_interval_ms)
    except InvalidInput as exc:
        if exc.field == "body.command" and "over the limit" in exc.reason:  # a limit of the settings
            raise InvalidInput(f"{exc.reason} (WOWD_TIMERS__MAX_BODY_BYTES)", field=exc.field) from None
        if exc.field == "rule.every_ms" and "shortest interval" in exc.reason:
            raise InvalidInput(f"{exc.reason} (WOWD_TIMERS__MIN_INTERVAL_MS)", field=exc.field) from None
        raise
    return event


def cancelled_event(key: str) -> DomainEvent:
    """A ``TimerCancelled`` event of ``key`` (checked as the feed checks it)."""
    event = DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body_type="wowd.TimerCancelled", body={"key": key})
    timer_event_from(event)
    return event


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Appended:
    """What :meth:`WowdClient.append` did: ``appended`` the commit, or found its request id in the
    stream already (``duplicate``: a retry of an append that was written; nothing was added, and
    ``commit`` is the one asked for)."""

    outcome: Literal["appended", "duplicate"]
    commit: Commit


class WowdClient:
    """Schedules and cancels timers, and appends an application's own commits, on ``log`` (the
    caller's; :meth:`connect` opens one)."""

    def __init__(
        self, log: Log, *, max_body_bytes: int = MAX_BODY_BYTES, min_interval_ms: int = MIN_INTERVAL_MS
    ) -> None:
        self.log = log
        self._max_body_bytes = max_body_bytes
        self._min_interval_ms = min_interval_ms

    @classmethod
    @asynccontextmanager
    async def connect(cls, settings: WowdSettings | None = None, *, create: bool = False) -> AsyncIterator[WowdClient]:
        """A client on the configured backend's log (``settings``, else the environment's
        ``WOWD_*`` and ``WOWD_CONFIG``), closed on exit. An embedded database file that does
        not exist is a :class:`~wowd.errors.ConfigError` naming ``WOWD_EMBEDDED__PATH`` and the
        path (run from the wrong directory, the client would schedule into a file no replica
        reads), unless ``create`` is true."""
        from wowd.backends import missing_database, opened_backend
        from wowd.config import load_settings

        s = settings if settings is not None else load_settings()
        if not create:
            missing = missing_database(s, "connect(create=True) creates it")
            if missing is not None:
                raise missing
        async with opened_backend(s) as backend:
            yield cls(backend.log, max_body_bytes=s.timers.max_body_bytes, min_interval_ms=s.timers.min_interval_ms)

    async def schedule(
        self,
        owner: AggregateRef,
        key: str,
        *,
        command: Command | Mapping[str, Any],
        due_at: int | datetime | None = None,
        rule: Rule | Mapping[str, Any] | None = None,
        target: AggregateRef | None = None,
        request_id: str | None = None,
        in_owner_stream: bool = False,
        misfire_grace_ms: int | None = None,
    ) -> Commit:
        """Puts the timer ``key`` of ``owner`` (replacing one of the same key): its ``command``
        goes to ``target`` (default: the owner) at ``due_at`` (epoch ms or an aware datetime)
        and then as ``rule`` says (default once). With ``misfire_grace_ms``, an occurrence that
        would be delivered later than that after its due time is skipped instead (the rule's
        ``misfire_grace_ms``; default: delivered however late). The commit goes to the owner's stream of
        wowd's own (:func:`schedule_stream`), or with ``in_owner_stream`` to the owner's own
        stream. Answers the commit appended. Raises :class:`~wowd.errors.InvalidInput` naming
        the field, :class:`ConflictError` when :data:`MAX_VERSION_RETRIES` versions were taken
        by other writers meanwhile."""
        if misfire_grace_ms is not None:
            rule = dataclasses.replace(_rule(rule), misfire_grace_ms=misfire_grace_ms)
        event = scheduled_event(
            key,
            target=target or owner,
            command=command,
            due_at=due_at,
            rule=rule,
            max_body_bytes=self._max_body_bytes,
            min_interval_ms=self._min_interval_ms,
        )
        return await self._append(owner if in_owner_stream else schedule_stream(owner), event, request_id)

    async def cancel(
        self, owner: AggregateRef, key: str, *, request_id: str | None = None, in_owner_stream: bool = False
    ) -> Commit:
        """Cancels the timer ``key`` of ``owner`` (nothing happens when there is none), in the
        stream :meth:`schedule` wrote it to (``in_owner_stream`` as it was given there)."""
        return await self._append(
            owner if in_owner_stream else schedule_stream(owner), cancelled_event(key), request_id
        )

    async def append(
        self,
        aggregate: str,
        commit: Mapping[str, Any],
        *,
        expected_version: int | None = None,
    ) -> Appended:
        """Appends one commit of the log's schema (docs/schema/commit.schema.json: ``aggregate_id``,
        ``tenant_id``, ``request_id``, ``events``, ``header``, ``access``, ``deleted``, ...) to
        the stream of ``aggregate_id`` in the aggregate type ``aggregate`` of the log's context,
        checked as the feed reads it (a malformed field, a timer event the feed would reject, is
        :class:`~wowd.errors.InvalidInput` naming the field; nothing is appended).

        Its version: ``expected_version + 1`` with ``expected_version`` (the version the caller
        saw last; 0 for a new stream), else the document's ``version``; either way a commit of
        another request id at that version is a :class:`ConflictError` (the stream moved on:
        read it again, decide, append again). With neither, the stream's next version, read
        again while other writers take it (up to :data:`MAX_VERSION_RETRIES`).

        Idempotent by ``request_id`` (required): a request id the stream holds already answers
        ``duplicate`` and appends nothing, so a retry after a lost answer is safe. ``create_time``
        defaults to now, ``command_id`` to a new id. The partition is the log's to compute."""
        doc = dict(commit)
        rid = doc.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise InvalidInput(
                "is required: the append is idempotent by it (a retry with the same request id appends nothing)",
                field="request_id",
            )
        asked = doc.get("version")
        if expected_version is not None:
            if not isinstance(expected_version, int) or isinstance(expected_version, bool) or expected_version < 0:
                raise InvalidInput(f"must be an integer >= 0, got {expected_version!r}", field="expected_version")
            if asked is not None and asked != expected_version + 1:
                raise InvalidInput(
                    f"is {asked!r}, but expected_version {expected_version} appends version {expected_version + 1}",
                    field="version",
                )
            asked = expected_version + 1
        doc.setdefault("create_time", clock.now_ms())
        doc.setdefault("command_id", uuid.uuid4().hex)
        try:
            type_ = AggregateType(context=self.log.context, aggregate=aggregate)
        except ConfigError as exc:
            raise InvalidInput(str(exc), field="aggregate") from None
        checked = self._checked(type_, {**doc, "version": asked if asked is not None else 1})
        if asked is not None:
            outcome = await self.log.append(checked)
            return Appended(outcome="duplicate" if outcome == "duplicate" else "appended", commit=checked)
        for _ in range(MAX_VERSION_RETRIES):
            candidate = dataclasses.replace(checked, version=await self.log.last_version(checked.ref) + 1)
            try:
                outcome = await self.log.append(candidate)
            except ConflictError:
                continue  # another writer took this version: read the last one again
            return Appended(outcome="duplicate" if outcome == "duplicate" else "appended", commit=candidate)
        raise ConflictError(f"{checked.ref}: no free version after {MAX_VERSION_RETRIES} attempts (busy writers)")

    def _checked(self, type_: AggregateType, doc: Mapping[str, Any]) -> Commit:
        """The commit of ``doc`` as the feed reads it, its timer events checked as the feed
        checks them (with this client's limits)."""
        commit = commit_from_doc(type_, doc)
        for i, ev in enumerate(commit.events):
            try:
                timer_event_from(ev, max_body_bytes=self._max_body_bytes, min_interval_ms=self._min_interval_ms)
            except InvalidInput as exc:
                raise InvalidInput(exc.reason, field=f"events[{i}].{exc.field}") from None
        return commit

    async def _append(self, owner: AggregateRef, event: DomainEvent, request_id: str | None) -> Commit:
        if owner.context != self.log.context:
            raise InvalidInput(f"{owner.context!r} is not the log's context {self.log.context!r}", field="owner")
        rid = request_id or uuid.uuid4().hex
        for _ in range(MAX_VERSION_RETRIES):
            commit = Commit(
                ref=owner,
                version=await self.log.last_version(owner) + 1,
                command_id=uuid.uuid4().hex,
                request_id=rid,
                create_time=clock.now_ms(),
                events=(event,),
            )
            try:
                await self.log.append(commit)  # "duplicate": this request id was appended before
            except ConflictError:
                continue  # another writer took this version: read the last one again
            return commit
        raise ConflictError(f"{owner}: no free version after {MAX_VERSION_RETRIES} attempts (busy writers)")


class SyncWowdClient:
    """:class:`WowdClient` for code without an event loop: the calls run on a loop of their own
    in a thread (an anyio blocking portal)."""

    def __init__(self, portal: BlockingPortal, client: WowdClient) -> None:
        self._portal = portal
        self._client = client

    @classmethod
    @contextmanager
    def connect(cls, settings: WowdSettings | None = None, *, create: bool = False) -> Iterator[SyncWowdClient]:
        """As :meth:`WowdClient.connect`."""
        with (
            start_blocking_portal() as portal,
            portal.wrap_async_context_manager(WowdClient.connect(settings, create=create)) as client,
        ):
            yield cls(portal, client)

    def schedule(
        self,
        owner: AggregateRef,
        key: str,
        *,
        command: Command | Mapping[str, Any],
        due_at: int | datetime | None = None,
        rule: Rule | Mapping[str, Any] | None = None,
        target: AggregateRef | None = None,
        request_id: str | None = None,
        in_owner_stream: bool = False,
    ) -> Commit:
        async def call() -> Commit:
            return await self._client.schedule(
                owner,
                key,
                command=command,
                due_at=due_at,
                rule=rule,
                target=target,
                request_id=request_id,
                in_owner_stream=in_owner_stream,
            )

        return self._portal.call(call)

    def cancel(
        self, owner: AggregateRef, key: str, *, request_id: str | None = None, in_owner_stream: bool = False
    ) -> Commit:
        async def call() -> Commit:
            return await self._client.cancel(owner, key, request_id=request_id, in_owner_stream=in_owner_stream)

        return self._portal.call(call)

    def append(self, aggregate: str, commit: Mapping[str, Any], *, expected_version: int | None = None) -> Appended:
        """As :meth:`WowdClient.append`."""

        async def call() -> Appended:
            return await self._client.append(aggregate, commit, expected_version=expected_version)

        return self._portal.call(call)
