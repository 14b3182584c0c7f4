"""The embedded log's reader: the positions it takes, the entries and batches it yields (those it
cannot decode among them), the wake-ups of a following read (an append of this process, another
process's commit found by its poll), and the reads of a rebuild in its own transaction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import CONTEXT, PARTITIONS, commit, now_ms
from tests.helpers import Tail, tailing
from wowd.errors import InvalidInput
from wowd.model import AggregateType, LogBatch, Position, commit_to_doc, partition
from wowd.stores.embedded import log as embedded_log
from wowd.stores.embedded.log import READ_COLUMNS, EmbeddedLog, entries_between, entry_of, insert_sql
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = pytest.mark.anyio

ORDER = AggregateType(context=CONTEXT, aggregate="order")
EVERY = dict.fromkeys(range(PARTITIONS))


@pytest.fixture
def slow_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caught-up reader polls the file once a minute: only a notification wakes it sooner."""
    monkeypatch.setattr(embedded_log, "POLL_MIN_S", 60.0)
    monkeypatch.setattr(embedded_log, "POLL_MAX_S", 60.0)


async def read_all(log: EmbeddedLog, positions: dict[int, Position | None]) -> list[LogBatch]:
    with anyio.fail_after(5):
        return [b async for b in log.read(positions, follow=False)]


def ids(first: str, p: int) -> str:
    """An aggregate id starting ``first`` in partition ``p``."""
    return next(f"{first}-{i}" for i in range(1000) if partition(f"{first}-{i}", PARTITIONS) == p)


def write_rows(path: Path, *rows: tuple[str, int, int, Any]) -> list[int]:
    """Rows of the log written by another program (no notification in this process): each
    ``(aggregate_id, version, partition, doc)``; their ``seq``."""
    with sqlite3.connect(str(path)) as conn:
        return [
            int(conn.execute(insert_sql(), (CONTEXT, "order", "(0)", a, v, p, f"r-{a}-{v}", doc)).lastrowid)
            for a, v, p, doc in rows
        ]


# --------------------------------------------------------------------------- positions


async def test_a_read_from_sequence_zero_reads_from_the_first_commit(log: EmbeddedLog) -> None:
    c = commit(ids("a", 2))
    await log.append(c)
    found = [e.commit for b in await read_all(log, {2: {"seq": 0}}) for e in b.entries]
    assert found == [c]


@pytest.mark.parametrize("position", ["seq=3", 3, {"seq": -1}, {"seq": True}, {"seq": "3"}, {"at": 3}])
async def test_a_read_refuses_a_position_the_log_never_gives_naming_its_partition(
    log: EmbeddedLog, position: Any
) -> None:
    with anyio.fail_after(5), pytest.raises(InvalidInput) as refused:
        async for _ in log.read({0: None, 3: position}, follow=False):
            pass
    assert refused.value.field == "positions[3]"
    assert repr(position) in refused.value.reason


# --------------------------------------------------------------------------- batches


async def test_a_caught_up_read_yields_an_empty_batch_stamped_with_the_time_its_query_began(
    log: EmbeddedLog,
) -> None:
    before = now_ms()
    reader = log.read(EVERY, follow=True)
    try:
        with anyio.fail_after(5):
            batch = await reader.__anext__()
    finally:
        await reader.aclose()
    after = now_ms()
    assert batch.entries == ()
    assert batch.positions == {}
    assert batch.watermark is not None
    assert before <= batch.watermark <= after


async def test_a_read_follows_in_batches_of_500_unless_told_otherwise(log: EmbeddedLog) -> None:
    a = ids("a", 0)
    await log.append_many([commit(a, v) for v in range(1, 502)])
    reader = log.read({0: None})
    try:
        with anyio.fail_after(5):
            sizes = [len((await reader.__anext__()).entries) for _ in range(3)]
    finally:
        await reader.aclose()
    assert sizes == [500, 1, 0]  # the third: caught up, it follows


# --------------------------------------------------------------------------- what cannot be decoded


async def test_an_entry_the_reader_cannot_decode_carries_its_position_partition_type_and_document(
    log: EmbeddedLog, db_path: Path
) -> None:
    """Each comes as an entry with no commit and the error, where it is in the log and the
    document as far as it could be read: the feed sets it aside there and reads on after it."""
    await log.prepare()
    p = 5
    seqs = write_rows(db_path, (ids("a", p), 1, p, "{not json"), (ids("b", p), 1, p, 7), (ids("c", p), 1, p, "[1, 2]"))
    (batch,) = [b for b in await read_all(log, {p: None}) if b.entries]
    assert [(e.position, e.partition, e.aggregate, e.commit, e.raw) for e in batch.entries] == [
        ({"seq": seqs[0]}, p, ORDER, None, {}),
        ({"seq": seqs[1]}, p, ORDER, None, {"doc": 7}),
        ({"seq": seqs[2]}, p, ORDER, None, {"doc": [1, 2]}),
    ]
    errors = [e.error or "" for e in batch.entries]
    assert errors[0].startswith("doc: ")
    assert errors[1:] == ["commit: a commit must be a document"] * 2
    assert batch.positions == {p: {"seq": seqs[2]}}
    assert await read_all(log, {p: batch.positions[p]}) == []


async def test_the_entries_between_two_positions_are_those_a_read_yields_there(log: EmbeddedLog, db_path: Path) -> None:
    """A rebuild reads one partition up to a checkpoint in its own transaction: the same entries,
    decoded alike (one it cannot decode among them), as the read between the same positions."""
    p, q = 1, 6
    a, b = ids("a", p), ids("b", q)
    await log.append_many([commit(a, 1), commit(b, 1), commit(a, 2), commit(b, 2), commit(a, 3)])
    write_rows(db_path, (ids("c", p), 1, p, "{not json"))
    await log.append(commit(a, 4))
    read = [e for batch in await read_all(log, {p: None}) for e in batch.entries]
    assert len(read) == 5
    after, until = read[0].position["seq"], read[3].position["seq"]
    with sqlite3.connect(str(db_path)) as conn:
        between = entries_between(conn, CONTEXT, p, after, until)
        rows = list(conn.execute(f"SELECT {', '.join(READ_COLUMNS)} FROM log WHERE partition = ? ORDER BY seq", (p,)))
    assert between == read[1:4]
    assert between[2].error is not None
    assert [entry_of(ORDER, tuple(row)) for row in rows] == read


# --------------------------------------------------------------------------- wake-ups


async def caught_up(tail: Tail) -> None:
    """Returns once the read has yielded an empty batch after what it had: it waits, subscribed
    to the file's wake-ups, for what comes next."""
    heads = tail.heads
    await tail.until(lambda t: t.heads > heads, timeout=5)


async def test_a_following_read_wakes_at_once_on_an_append_of_this_process(log: EmbeddedLog, slow_poll: None) -> None:
    a = ids("a", 4)
    async with tailing(log, {4: None}) as tail:
        await caught_up(tail)
        await log.append(commit(a, 1))
        await tail.until(lambda t: len(t.entries) == 1, timeout=5)
        await caught_up(tail)
        await log.append_many([commit(a, 2), commit(a, 3)])
        await tail.until(lambda t: len(t.entries) == 3, timeout=5)
        await caught_up(tail)
        log.nudge()
        await caught_up(tail)
    assert [e.commit and e.commit.version for e in tail.entries] == [1, 2, 3]


async def test_stores_of_one_file_wake_each_others_readers_whatever_the_paths_spelling(
    log: EmbeddedLog, db_path: Path, slow_poll: None
) -> None:
    a = ids("a", 4)
    same = EmbeddedLog(db_path, context=CONTEXT, partitions=PARTITIONS)
    (db_path.parent / "link").symlink_to(db_path.parent, target_is_directory=True)
    spelled = EmbeddedLog(db_path.parent / "link" / db_path.name, context=CONTEXT, partitions=PARTITIONS)
    try:
        async with tailing(log, {4: None}) as tail:
            await caught_up(tail)
            await same.append(commit(a, 1))
            await tail.until(lambda t: len(t.entries) == 1, timeout=5)
            await caught_up(tail)
            await spelled.append(commit(a, 2))
            await tail.until(lambda t: len(t.entries) == 2, timeout=5)
    finally:
        await same.close()
        await spelled.close()


async def test_a_following_read_finds_another_processs_commits_by_its_poll(log: EmbeddedLog, db_path: Path) -> None:
    a = ids("a", 3)
    theirs = [commit(a, 1), commit(a, 2)]
    async with tailing(log, {3: None}) as tail:
        for read, c in enumerate(theirs, 1):
            # caught up, and polled more than once with nothing new
            await caught_up(tail)
            await caught_up(tail)
            write_rows(db_path, (a, c.version, 3, json.dumps(commit_to_doc(c, PARTITIONS))))
            await tail.until(lambda t, read=read: len(t.entries) == read, timeout=5)
    assert [e.commit for e in tail.entries] == theirs


async def test_a_caught_up_read_backs_off_its_polls_instead_of_polling_busily(log: EmbeddedLog) -> None:
    """Each poll that finds nothing waits twice as long as the one before, from 2 ms up to 100 ms:
    eight empty polls take 2 + 4 + ... + 64 + 100 + 100 ms at least, not eight times 2 ms."""
    async with tailing(log, EVERY) as tail:
        await caught_up(tail)
        started = anyio.current_time()
        heads = tail.heads
        await tail.until(lambda t: t.heads >= heads + 8, timeout=5)
        waited = anyio.current_time() - started
    assert waited >= 0.25


async def test_a_following_read_leaves_no_wake_up_subscription_behind(log: EmbeddedLog) -> None:
    """A feed follows the log for days, subscribing to the file's wake-ups before each query: a
    read holds at most one subscription at a time, and none once it ends."""
    a = ids("a", 4)
    await log.append(commit(a, 1))
    waiters = log._notifier._waiters
    async with tailing(log, {4: None}) as tail:
        await tail.until(lambda t: len(t.entries) == 1 and t.heads >= 3, timeout=5)
        await log.append(commit(a, 2))
        await tail.until(lambda t: len(t.entries) == 2, timeout=5)
        heads = tail.heads
        await tail.until(lambda t: t.heads >= heads + 2, timeout=5)
        assert len(waiters) <= 1
    assert waiters == {}


async def test_a_read_does_not_wait_behind_an_append_waiting_for_the_files_write_lock(
    log: EmbeddedLog, db_path: Path
) -> None:
    c = commit(ids("a", 2), 1)
    await log.append(c)
    appended: list[str] = []

    async def append() -> None:
        appended.append(await log.append(commit(ids("a", 2), 2)))

    other = sqlite3.connect(str(db_path), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        async with anyio.create_task_group() as tg:
            tg.start_soon(append)
            await anyio.wait_all_tasks_blocked()
            found = [e.commit for b in await read_all(log, {2: None}) for e in b.entries]
            assert appended == []  # the append still waits
            other.execute("COMMIT")
    finally:
        other.close()
    assert found == [c]
    assert appended == ["appended"]
