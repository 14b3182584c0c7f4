"""The outbox gateway's housekeeping: the replicas trim entries past the outbox retention, and
every entry still in the outbox is unacknowledged: each trim is said (a WARNING naming the
setting) and counted (``wowd_outbox_trimmed_total``), and the age of the oldest entry is
exported beside the retention (``wowd_outbox_oldest_age_seconds``,
``wowd_outbox_retention_seconds``) so that an alert fires before a command is lost."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.factories import outbox_entry
from wowd import clock, metrics
from wowd.delivery import OutboxGateway
from wowd.model import AggregateRef, OutboxEntry
from wowd.stores.embedded.outbox import EmbeddedOutbox

pytestmark = pytest.mark.anyio

DAY_S = 86_400
TARGET = AggregateRef(context="demo", aggregate="order", id="o-1")


def entry(request_id: str, age_s: float) -> OutboxEntry:
    """The entry ``request_id`` put ``age_s`` seconds ago."""
    return outbox_entry(request_id, clock.now_ms() - int(age_s * 1000), target=TARGET)


async def test_the_trim_of_unacknowledged_entries_is_said_counted_and_seen_coming(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = EmbeddedOutbox(tmp_path / "wowd.db")
    gateway = OutboxGateway(box, retention_s=7 * DAY_S)
    try:
        await box.put_many([entry("old-1", 8 * DAY_S), entry("old-2", 7.5 * DAY_S), entry("young", 5 * DAY_S)])
        await gateway.count_depth()
        assert metrics.OUTBOX_RETENTION._value.get() == 7 * DAY_S
        oldest = metrics.OUTBOX_OLDEST_AGE._value.get()
        assert 8 * DAY_S <= oldest < 8 * DAY_S + 60  # past the retention: the alert would have fired at half of it
        trimmed_before = metrics.OUTBOX_TRIMMED._value.get()
        caplog.set_level(logging.WARNING, logger="wowd.delivery.outbox")
        await gateway.housekeep()
        assert metrics.OUTBOX_TRIMMED._value.get() - trimmed_before == 2
        (line,) = [r for r in caplog.records if r.name == "wowd.delivery.outbox"]
        assert line.levelno == logging.WARNING
        assert line.getMessage().startswith(
            "outbox: 2 entries older than the retention of 7.0 d (WOWD_OUTBOX__RETENTION_S)"
        )
        assert "unacknowledged" in line.getMessage() and "lost" in line.getMessage()
        assert [e.request_id for e in await box.entries()] == ["young"]
        await gateway.count_depth()
        assert 5 * DAY_S <= metrics.OUTBOX_OLDEST_AGE._value.get() < 5 * DAY_S + 60
        await box.ack(["young"])
        await gateway.count_depth()
        assert metrics.OUTBOX_OLDEST_AGE._value.get() == 0  # empty
    finally:
        await box.close()
