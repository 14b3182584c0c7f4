"""``wowd.client``: schedule and cancel append commits the feed reads, at the owner's next version."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import CONTEXT
from wowd.backends import opened_backend
from wowd.cli.main import build_parser
from wowd.client import SCHEDULES, SyncWowdClient, WowdClient, schedule_stream
from wowd.config import load_settings
from wowd.errors import ConflictError, InvalidInput
from wowd.model import (
    MAX_STREAM_KEY_BYTES,
    AggregateRef,
    AggregateType,
    Command,
    Commit,
    DomainEvent,
    TimerCancelled,
    TimerScheduled,
    commit_from_doc,
    timer_event_from,
)

ORDER = AggregateRef(context=CONTEXT, aggregate="order", id="o-1")

pytestmark = pytest.mark.anyio


async def test_schedule_and_cancel_append_at_successive_versions_of_wowds_stream(created: Path) -> None:
    """By default the commits go to wowd's stream of the owner: the application's stream of
    ``o-1`` gets nothing (its versions stay the application's), the command still goes to o-1."""
    async with WowdClient.connect(load_settings()) as client:
        first = await client.schedule(
            ORDER, "expire", due_at=1_900_000_000_000, command=Command(name="expire-order", body={"n": 1})
        )
        second = await client.cancel(ORDER, "expire")
        stream = AggregateRef(context=CONTEXT, aggregate=SCHEDULES, id="order/o-1")
        assert first.ref == second.ref == stream == schedule_stream(ORDER)
        assert (first.version, second.version) == (1, 2)
        assert await client.log.last_version(stream) == 2
        assert await client.log.last_version(ORDER) == 0
        (ev1,), (ev2,) = first.events, second.events
        scheduled, cancelled = timer_event_from(ev1), timer_event_from(ev2)
        assert isinstance(scheduled, TimerScheduled) and isinstance(cancelled, TimerCancelled)
        assert scheduled.target == ORDER and scheduled.due_at == 1_900_000_000_000
        assert scheduled.command == Command(name="expire-order", body={"n": 1})


async def test_a_schedule_carries_its_misfire_grace_in_its_rule(created: Path) -> None:
    async with WowdClient.connect(load_settings()) as client:
        commit = await client.schedule(
            ORDER,
            "daily",
            rule={"type": "cron", "expression": "0 6 * * *"},
            command=Command(name="remind"),
            misfire_grace_ms=600_000,
        )
    (ev,) = commit.events
    scheduled = timer_event_from(ev)
    assert isinstance(scheduled, TimerScheduled) and scheduled.rule.misfire_grace_ms == 600_000


async def test_a_version_taken_meanwhile_is_read_again(created: Path) -> None:
    async with opened_backend(load_settings()) as backend:
        log = backend.log
        real = log.last_version
        calls = 0

        async def stale(ref: AggregateRef) -> int:
            nonlocal calls
            calls += 1
            if calls == 1:  # another writer appends version 1 after this read
                other = Commit(
                    ref=ORDER,
                    version=1,
                    command_id="c",
                    request_id="other",
                    create_time=1,
                    events=(DomainEvent(id="e", name="OrderCreated"),),
                )
                assert await log.append(other) == "appended"
                return 0
            return await real(ref)

        log.last_version = stale  # type: ignore[method-assign]
        commit = await WowdClient(log).cancel(ORDER, "k", in_owner_stream=True)
        assert commit.version == 2 and calls == 2


async def test_a_log_that_always_conflicts_ends_in_a_conflict_error(created: Path) -> None:
    async with opened_backend(load_settings()) as backend:
        backend.log.last_version = _always_zero  # type: ignore[method-assign]
        await backend.log.append(Commit(ref=ORDER, version=1, command_id="c", request_id="r", create_time=1))
        with pytest.raises(ConflictError, match="no free version"):
            await WowdClient(backend.log).cancel(ORDER, "k", in_owner_stream=True)


async def _always_zero(ref: AggregateRef) -> int:
    return 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"due_at": -1, "command": {"name": "x"}}, "body.due_at"),
        ({"command": {"name": "x"}}, "body.due_at"),  # a once rule needs a time
        ({"due_at": 1, "command": {"body": {}}}, "body.command"),
        ({"due_at": 1, "command": {"name": "x"}, "rule": {"type": "weekly"}}, "rule.type"),
        ({"due_at": 1, "command": {"name": "x"}, "rule": {"type": "interval", "every_ms": 0}}, "rule.every_ms"),
        # under timers.min_interval_ms (1 s): one timer would ask for many deliveries a second
        ({"due_at": 1, "command": {"name": "x"}, "rule": {"type": "interval", "every_ms": 999}}, "rule.every_ms"),
        ({"due_at": 1, "command": {"name": "x", "body": {"big": "x" * 70_000}}}, "body.command"),
    ],
)
async def test_bad_input_names_the_field_as_the_feed_does(created: Path, kwargs: dict[str, Any], field: str) -> None:
    async with WowdClient.connect(load_settings()) as client:
        with pytest.raises(InvalidInput) as caught:
            await client.schedule(ORDER, "k", **kwargs)
        assert caught.value.field == field
        assert await client.log.last_version(schedule_stream(ORDER)) == 0  # nothing appended


async def test_a_recurring_rule_without_a_time_starts_at_its_first_occurrence(created: Path) -> None:
    async with WowdClient.connect(load_settings()) as client:
        commit = await client.schedule(
            ORDER, "tick", rule={"type": "interval", "every_ms": 60_000}, command={"name": "t"}
        )
    te = timer_event_from(commit.events[0])
    assert isinstance(te, TimerScheduled) and te.due_at > commit.create_time


async def test_an_owner_of_another_context_is_refused(created: Path) -> None:
    async with WowdClient.connect(load_settings()) as client:
        with pytest.raises(InvalidInput) as caught:
            await client.cancel(AggregateRef(context="other", aggregate="order", id="o-1"), "k")
    assert caught.value.field == "owner"


def test_the_sync_client_schedules_and_cancels(created: Path) -> None:
    with SyncWowdClient.connect(load_settings()) as client:
        assert client.schedule(ORDER, "k", due_at=5, command={"name": "x"}).version == 1
        assert client.cancel(ORDER, "k").version == 2


def test_every_option_has_help_text() -> None:
    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
                    if not any(c.dest == name and c.help for c in action._choices_actions):
                        missing.append(f"{path} {name}")
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "wowd")
    assert not missing


async def test_an_oversize_command_names_the_setting(created: Path) -> None:
    async with WowdClient.connect(load_settings(timers={"max_body_bytes": 100})) as client:
        with pytest.raises(InvalidInput, match=r"over the limit of 100 \(WOWD_TIMERS__MAX_BODY_BYTES\)"):
            await client.schedule(ORDER, "k", due_at=1_900_000_000_000, command={"name": "x", "body": {"n": "y" * 200}})
        with pytest.raises(InvalidInput, match=r"^rule.expression: '0 0 30 2 \*' has no occurrence after now"):
            await client.schedule(ORDER, "k", rule={"type": "cron", "expression": "0 0 30 2 *"}, command={"name": "x"})


async def test_the_owners_own_stream_only_when_asked(created: Path) -> None:
    async with WowdClient.connect(load_settings()) as client:
        await client.log.append(
            Commit(ref=ORDER, version=1, command_id="c", request_id="r", create_time=1, events=())
        )  # the application's own commit
        commit = await client.schedule(ORDER, "k", due_at=5, command={"name": "x"}, in_owner_stream=True)
        assert commit.ref == ORDER and commit.version == 2
        cancel = await client.cancel(ORDER, "k", in_owner_stream=True)
        assert cancel.ref == ORDER and cancel.version == 3
        assert await client.log.last_version(schedule_stream(ORDER)) == 0


def test_an_aggregate_id_too_long_for_any_backend_is_refused_the_same_way_everywhere(created: Path) -> None:
    """Every backend reads a log document with :func:`commit_from_doc` (the feed quarantines what
    it refuses) and the client builds the same reference: a 600-character id is refused there,
    not fired on one backend and quarantined by the event index on the other."""
    long_id = "o" * 600
    doc = {"aggregate_id": long_id, "version": 1, "request_id": "r", "create_time": 1, "events": []}
    with pytest.raises(InvalidInput, match=r"^aggregate_id: is too long: 607 bytes .* at most 491"):
        commit_from_doc(AggregateType(context=CONTEXT, aggregate="order"), doc)
    at_limit = "o" * (MAX_STREAM_KEY_BYTES - len("%280%29"))  # the default tenant (0), percent-encoded
    assert commit_from_doc(AggregateType(context=CONTEXT, aggregate="order"), {**doc, "aggregate_id": at_limit})
    with pytest.raises(InvalidInput, match="^aggregate_id: is too long"):
        commit_from_doc(AggregateType(context=CONTEXT, aggregate="order"), {**doc, "aggregate_id": at_limit + "é"})
    with SyncWowdClient.connect(load_settings()) as client, pytest.raises(InvalidInput, match="aggregate_id"):
        client.schedule(
            AggregateRef(context=CONTEXT, aggregate="order", id=long_id), "k", due_at=5, command={"name": "x"}
        )
