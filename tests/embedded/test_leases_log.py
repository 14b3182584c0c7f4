"""Embedded-only behaviour of the SQLite leases, log and outbox (the contract suites cover the
protocols): several processes on one file, the log's format record and wake-ups, raw input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from wowd import clock
from wowd.daemon.leases import check_store_clock, clock_disagreement
from wowd.errors import ConfigError, FormatError
from wowd.model import AggregateRef, AggregateType, Commit, DomainEvent, Owner, SlotLease, partition
from wowd.stores.base import ClockReading, Ddl, OwnerProbe, ReplicaInfo
from wowd.stores.embedded import log as log_module
from wowd.stores.embedded.db import SqliteDatabase
from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
from wowd.stores.embedded.log import EmbeddedLog
from wowd.stores.embedded.outbox import EmbeddedOutbox
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
NS = "wowd.race"
ORDER = AggregateType(context="ctx", aggregate="order")


def commit(agg_id: str, version: int = 1) -> Commit:
    return Commit(
        ref=AggregateRef(context="ctx", aggregate="order", id=agg_id),
        version=version,
        command_id="c",
        request_id=f"r-{agg_id}-{version}",
        create_time=1,
        events=(DomainEvent(id="e", name="Changed"),),
    )


def test_importing_the_embedded_backend_loads_no_mongodb_or_elasticsearch_driver() -> None:
    code = (
        "import sys, pkgutil, importlib, wowd.stores.embedded\n"
        "for m in pkgutil.iter_modules(wowd.stores.embedded.__path__):\n"
        "    importlib.import_module('wowd.stores.embedded.' + m.name)\n"
        "drivers = ('pymongo', 'bson', 'motor', 'elasticsearch', 'elastic_transport')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in drivers)\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- leases, racing


def assert_exclusive(leases: list[SlotLease]) -> None:
    """Every take of a slot got its own fence, and the fences of a slot have no gaps."""
    by_slot: dict[int, list[int]] = {}
    for lease in leases:
        by_slot.setdefault(lease.slot, []).append(lease.fence)
    for slot, fences in by_slot.items():
        assert sorted(fences) == list(range(1, len(fences) + 1)), (slot, sorted(fences))


async def churn(store: EmbeddedSlotLeaseStore, owner: Owner, rounds: int, taken: list[SlotLease]) -> None:
    done = 0
    while done < rounds:
        result = await store.acquire(NS, owner, 2, timedelta(seconds=30), timedelta(0))
        if result.lease is None:
            assert result.status == "exhausted"
            await anyio.sleep(0.001)  # both slots held this instant: let the holders release
            continue
        done += 1
        taken.append(result.lease)
        assert await store.release(result.lease, result.lease.floor)


async def test_two_stores_on_one_file_racing_never_share_a_slot(tmp_path: Path) -> None:
    path = tmp_path / "race.db"
    stores = [EmbeddedSlotLeaseStore(path), EmbeddedSlotLeaseStore(path)]
    try:
        # first: 8 owners at once on 3 slots, through two connections
        results: list[Any] = []

        async def one(store: EmbeddedSlotLeaseStore, key: str) -> None:
            results.append(await store.acquire("wowd.once", Owner(key=key), 3, timedelta(seconds=30), timedelta(0)))

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, stores[i % 2], f"owner-{i}")
        won = [r.lease for r in results if r.lease is not None]
        assert sorted(lease.slot for lease in won) == [0, 1, 2]
        # then: acquire/release churn; every take is exclusive
        taken: list[SlotLease] = []
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(churn, stores[i % 2], Owner(key=f"churn-{i}"), 10, taken)
        assert len(taken) == 60
        assert_exclusive(taken)
    finally:
        for s in stores:
            await s.close()


RACER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import anyio
    from wowd.model import Owner
    from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore

    async def main(path, tag):
        store = EmbeddedSlotLeaseStore(path)
        out = []
        for i in range(40):
            owner = Owner(key=f"{tag}-{i % 3}")
            r = await store.acquire("wowd.race", owner, 2, timedelta(seconds=30), timedelta(0))
            if r.lease is not None:
                out.append([r.lease.slot, r.lease.fence, r.lease.owner_key])
                assert await store.release(r.lease, r.lease.floor)
        await store.close()
        print(json.dumps(out))

    anyio.run(main, sys.argv[1], sys.argv[2])
    """
)


async def test_two_processes_racing_on_one_file_get_distinct_fences(tmp_path: Path) -> None:
    path = tmp_path / "race.db"
    # create the tables first so that both processes start on the same footing
    store = EmbeddedSlotLeaseStore(path)
    await store.prepare()
    await store.close()
    outputs: list[list[Any]] = []

    async def racer(tag: str) -> None:
        done = await anyio.run_process([sys.executable, "-c", RACER, str(path), tag], cwd=ROOT)
        outputs.extend(json.loads(done.stdout))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(racer, "p1")
            tg.start_soon(racer, "p2")
    assert len(outputs) == 80
    leases = [
        SlotLease(
            namespace=NS,
            slot=s,
            owner_key=o,
            incarnation=0,
            fence=f,
            expires_at=0,
            floor=0,
            ceiling=0,
            written_at=0,
        )
        for s, f, o in outputs
    ]
    assert_exclusive(leases)


async def test_a_store_closes_only_what_it_opened(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "shared.db")
    try:
        leases, outbox = EmbeddedSlotLeaseStore(db), EmbeddedOutbox(db)
        lease = (await leases.acquire("ns", Owner(key="a"), 1, timedelta(seconds=5), timedelta(0))).lease
        assert lease is not None
        await leases.close()
        assert await outbox.count() == 0  # the shared connection is still open
        await outbox.close()
        assert await db.run(lambda c: c.execute("SELECT COUNT(*) FROM cosid_slot").fetchone()[0]) == 1
    finally:
        db.close()


async def test_lease_tables_follow_the_seed_fields(tmp_path: Path) -> None:
    store = EmbeddedSlotLeaseStore(tmp_path / "w.db")
    try:
        await store.acquire("ns", Owner(key="a"), 2, timedelta(seconds=5), timedelta(milliseconds=250), 4)
    finally:
        await store.close()
    with sqlite3.connect(tmp_path / "w.db") as conn:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(cosid_slot)")]
        assert cols == [
            "ns",
            "slot",
            "ownerKey",
            "incarnation",
            "lastOwnerKey",
            "fence",
            "expiresAt",
            "floor",
            "ceiling",
            "nextFloor",
            "writtenAt",
        ]
        assert conn.execute('SELECT ns, "limit", toleranceMs, slotOffset FROM cosid_namespace').fetchall() == [
            ("ns", 2, 250, 4)
        ]
        # a namespace row written without slotOffset (older version) reads as offset 0
        conn.execute("INSERT INTO cosid_namespace (ns, \"limit\", toleranceMs) VALUES ('old', 1, 0)")
    store = EmbeddedSlotLeaseStore(tmp_path / "w.db")
    try:
        result = await store.acquire("old", Owner(key="a"), 1, timedelta(seconds=5), timedelta(0))
        assert result.status == "acquired"
    finally:
        await store.close()
    with sqlite3.connect(tmp_path / "w.db") as conn:
        assert conn.execute("SELECT slotOffset FROM cosid_namespace WHERE ns = 'old'").fetchone() == (None,)


# --------------------------------------------------------------------------- the store clock


async def test_a_process_whose_clock_agrees_with_the_file_starts(tmp_path: Path) -> None:
    store = EmbeddedSlotLeaseStore(tmp_path / "w.db")
    try:
        assert (await store.acquire(NS, Owner(key="a"), 2, timedelta(seconds=5), timedelta(seconds=1))).acquired
        await store.heartbeat(NS, "a", ReplicaInfo(instance="i", host="h", pid=1, version="v"), timedelta(seconds=5))
        reading = await store.clock_reading("b")
        assert reading.latest is not None and reading.latest <= reading.after
        assert reading.file_written is not None
        assert clock_disagreement(reading, 0.0) is None  # even with no tolerance
        check_store_clock(reading, 1.0)
        # a second start reads its own probe as the file's latest write: no lease or presence time
        assert clock_disagreement(await store.clock_reading("c"), 0.0) is None
    finally:
        await store.close()


async def test_the_first_process_on_a_new_file_reads_no_latest_write_and_starts(tmp_path: Path) -> None:
    store = EmbeddedSlotLeaseStore(tmp_path / "w.db")
    try:
        reading = await store.clock_reading("a")
    finally:
        await store.close()
    assert (reading.latest, reading.latest_by, reading.latest_what) == (None, "", "")
    assert reading.file_written is not None
    assert clock_disagreement(reading, 0.0) is None
    check_store_clock(reading, 1.0)


@pytest.mark.parametrize("skew_s", [600, -600, 3, -3])
async def test_a_process_whose_clock_is_off_by_more_than_the_tolerance_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skew_s: int
) -> None:
    """Another replica's lease and presence writes, then this process's reading with its clock
    ``skew_s`` off: ahead (the file's modification time is in its past) or behind (the lease's
    write and the file's time are in its future)."""
    store = EmbeddedSlotLeaseStore(tmp_path / "w.db")
    try:
        assert (await store.acquire(NS, Owner(key="a"), 2, timedelta(seconds=5), timedelta(seconds=1))).acquired
        real_now_ms = clock.now_ms
        monkeypatch.setattr(clock, "now_ms", lambda: real_now_ms() + skew_s * 1000)
        reading = await store.clock_reading("b")
    finally:
        await store.close()
    why = clock_disagreement(reading, 1.0)
    assert why is not None
    if skew_s > 0:
        assert f"this process's clock is {skew_s}." in why and "ahead of the host's" in why
    else:
        # stamped the skew ahead, less the time between the write and the reading (a loaded
        # machine's second at most)
        stamped = re.search(r"stamped (\d+)\.\d s", why)
        assert "slot lease last written by a" in why and stamped and -skew_s - 1 <= int(stamped[1]) <= -skew_s, why
    assert clock_disagreement(reading, abs(skew_s) + 1) is None  # within a tolerance that wide
    with pytest.raises(ConfigError, match=r"refusing to start: .* WOWD_LEASE__TOLERANCE_S = 1 s"):
        check_store_clock(reading, 1.0)


def test_a_file_time_in_whole_seconds_is_given_two_seconds_more() -> None:
    reading = ClockReading(path="w.db", before=10_500, after=10_510, file_written=9_000, file_coarse=False)
    assert clock_disagreement(reading, 1.0) is not None
    assert clock_disagreement(replace(reading, file_coarse=True), 1.0) is None
    later = replace(reading, file_written=14_000, file_coarse=True)
    assert "this process's clock is 3.5 s behind the host's" in (clock_disagreement(later, 1.0) or "")


# --------------------------------------------------------------------------- log


@pytest.fixture
async def elog(tmp_path: Path) -> AsyncIterator[EmbeddedLog]:
    store = EmbeddedLog(tmp_path / "log.db", context="ctx", partitions=8)
    await store.prepare()
    try:
        yield store
    finally:
        await store.close()


@pytest.mark.parametrize("asked", [1, 3, 256, 257, 600])
async def test_which_owners_have_a_commit_above_a_version_is_one_seek_each_in_few_statements(
    tmp_path: Path, asked: int
) -> None:
    """The fire rule's question: of many aggregates, which the log holds a commit of above a
    version, whatever the count (chunks and the padding of the last one), answered the same
    inside a transaction and by ``EmbeddedLog.committed_after``."""
    path = tmp_path / "log.db"
    store = EmbeddedLog(path, context="ctx", partitions=8)
    try:
        # every third aggregate has a second commit, appended after all the first ones
        ids = [f"o{i}" for i in range(asked)]
        await store.append_many([commit(i) for i in ids])
        await store.append_many([commit(i, 2) for i in ids[::3]])
        owners = [("ctx", "order", "(0)", "never-committed", 0), ("ctx", "order", "(0)", ids[0], 2)]
        owners += [("ctx", "order", "(0)", i, 1) for i in ids]
        expected = {2 + n for n in range(0, asked, 3)}
        probes = [OwnerProbe(AggregateRef(context=c, aggregate=a, tenant_id=t, id=i), v) for c, a, t, i, v in owners]
        assert await store.committed_after(probes) == expected
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        assert log_module.committed_after(conn, owners) == expected


async def test_log_refuses_tables_of_another_format(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    store = EmbeddedLog(path, context="ctx", partitions=8)
    await store.prepare()
    await store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE log_format SET format = 4")
    store = EmbeddedLog(path, context="ctx", partitions=8)
    try:
        with pytest.raises(FormatError, match="format 4"):
            await store.prepare()
    finally:
        await store.close()


async def test_log_validate_requires_the_tables(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    store = EmbeddedLog(path, context="ctx", partitions=8, ddl=Ddl.VALIDATE)
    try:
        with pytest.raises(FormatError, match="missing"):
            await store.prepare()
        await EmbeddedLog(path, context="ctx", partitions=8).prepare()
        await store.prepare()
    finally:
        await store.close()


async def test_insert_raw_without_a_string_id_lands_in_partition_zero(elog: EmbeddedLog) -> None:
    await elog.insert_raw(ORDER, {"aggregate_id": 42, "version": 1, "events": []})
    found = [e async for b in elog.read({0: None}, follow=False) for e in b.entries]
    assert len(found) == 1
    assert found[0].partition == 0 and found[0].commit is None
    assert found[0].error is not None and found[0].error.startswith("aggregate_id")
    assert found[0].raw["aggregate_id"] == 42


async def test_follow_is_woken_by_an_append_through_another_store_in_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(log_module, "POLL_MIN_S", 60.0)  # only the notification can wake it in time
    monkeypatch.setattr(log_module, "POLL_MAX_S", 60.0)
    reader = EmbeddedLog(tmp_path / "log.db", context="ctx", partitions=8)
    writer = EmbeddedLog(tmp_path / "log.db", context="ctx", partitions=8)
    await reader.prepare()
    p = partition("o-1", 8)
    got = anyio.Event()
    started = anyio.Event()

    async def tail() -> None:
        async for batch in reader.read({p: None}, follow=True):
            if any(e.commit and e.commit.version == 2 for e in batch.entries):
                got.set()
            started.set()

    try:
        await writer.append(commit("o-1", 1))
        async with anyio.create_task_group() as tg:
            tg.start_soon(tail)
            with anyio.fail_after(5):
                await started.wait()
                await writer.append(commit("o-1", 2))
                await got.wait()
            tg.cancel_scope.cancel()
    finally:
        await reader.close()
        await writer.close()


async def test_follow_polls_for_appends_of_other_processes(elog: EmbeddedLog, tmp_path: Path) -> None:
    p = partition("o-1", 8)
    got = anyio.Event()

    async def tail() -> None:
        async for batch in elog.read({p: None}, follow=True):
            if batch.entries:
                got.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(tail)
        # another process's append: straight into the file, no in-process notification
        doc = json.dumps({"aggregate_id": "o-1", "version": 1, "request_id": "x", "create_time": 1, "events": []})
        with sqlite3.connect(tmp_path / "log.db") as conn:
            conn.execute(
                "INSERT INTO log (context, aggregate, tenant_id, aggregate_id, version, partition,"
                " request_id, doc) VALUES ('ctx', 'order', '(0)', 'o-1', 1, ?, 'x', ?)",
                (p, doc),
            )
        with anyio.fail_after(5):
            await got.wait()
        tg.cancel_scope.cancel()


def write_docs(path: Path, p: int, docs: list[Any]) -> None:
    """``docs`` as the log's rows of order ``o-1`` (versions 1, 2, ...) in partition ``p``, written
    as another program would, values as they are."""
    with sqlite3.connect(path) as conn:
        for version, doc in enumerate(docs, 1):
            conn.execute(
                "INSERT INTO log (context, aggregate, tenant_id, aggregate_id, version, partition,"
                " request_id, doc) VALUES ('ctx', 'order', '(0)', 'o-1', ?, ?, ?, ?)",
                (version, p, f"r{version}", doc),
            )


async def test_a_batch_is_read_in_one_statement_and_each_document_as_it_was_written(
    elog: EmbeddedLog, tmp_path: Path
) -> None:
    """The batch comes as one value built by SQLite; every document is read back as its own
    text (any character a JSON string may hold), and a text that is not JSON (written by another
    program) is an entry naming the error, in its place in the log's order."""
    p = partition("o-1", 8)
    odd = ['quote " and \\ backslash', "caf\u00e9 \u4e2d \U0001f600", "line\nbreak\ttab\u2028\u0000", "x" * 5000]
    texts = [
        json.dumps({"aggregate_id": "o-1", "version": 1, "request_id": "a", "create_time": 1, "events": []}),
        "{not json",
        json.dumps(
            {"aggregate_id": "o-1", "version": 2, "request_id": "b", "create_time": 1, "events": []}
            | {"header": {"s": odd}},
            ensure_ascii=False,
        ),
    ]
    write_docs(tmp_path / "log.db", p, texts)
    statements: list[str] = []
    with sqlite3.connect(tmp_path / "log.db") as conn:
        conn.set_trace_callback(statements.append)
        rows = log_module._reader("ctx", [(p,)], {p: 0}, 0, 10)(conn)
    assert len(statements) == 1 and statements[0].startswith("SELECT json_group_array(")
    assert [r[3] for r in rows] == texts
    batch = [e async for b in elog.read({p: None}, follow=False) for e in b.entries]
    assert [e.position["seq"] for e in batch] == [r[0] for r in rows]
    good, bad, last = batch
    assert good.commit is not None and last.commit is not None and bad.commit is None
    assert bad.error is not None and bad.error.startswith("doc: ")
    assert last.commit.header == {"s": odd}


async def test_documents_another_program_wrote_as_a_blob_or_a_number_are_read_in_their_place(
    elog: EmbeddedLog, tmp_path: Path
) -> None:
    """A document JSON cannot hold in one value (a BLOB) makes the batch read row by row: the
    BLOB is read as its text, a number is an entry naming the error; nothing stops the read."""
    p = partition("o-1", 8)
    doc = {"aggregate_id": "o-1", "request_id": "a", "create_time": 1, "events": []}
    values: list[Any] = [json.dumps(doc | {"version": 1}), json.dumps(doc | {"version": 2}).encode(), 42]
    write_docs(tmp_path / "log.db", p, values)
    batch = [e async for b in elog.read({p: None}, follow=False) for e in b.entries]
    assert [e.commit.version if e.commit else None for e in batch] == [1, 2, None]
    assert batch[2].error == "commit: a commit must be a document"


async def test_contexts_sharing_a_file_do_not_mix(tmp_path: Path) -> None:
    a = EmbeddedLog(tmp_path / "log.db", context="ctx", partitions=8)
    b = EmbeddedLog(tmp_path / "log.db", context="other", partitions=8)
    try:
        await a.append(commit("o-1"))
        assert await b.aggregate_types() == []
        assert [e async for batch in b.read({p: None for p in range(8)}, follow=False) for e in batch.entries] == []
    finally:
        await a.close()
        await b.close()


# --------------------------------------------------------------------------- open_embedded


async def test_open_embedded_builds_every_store_on_the_file(tmp_path: Path) -> None:
    from wowd.config import EmbeddedSettings, WowdSettings
    from wowd.stores.base import (
        EventSink,
        Log,
        Outbox,
        SlotLeaseStore,
        SnapshotRebuildStore,
        SnapshotStore,
        TimerFiring,
        TimerQueries,
        TimerView,
    )
    from wowd.stores.embedded import open_embedded

    settings = WowdSettings(context="shop", partitions=4, embedded=EmbeddedSettings(path=tmp_path / "sub" / "wowd.db"))
    backend = await open_embedded(settings)
    try:
        assert backend.name == "embedded"
        assert isinstance(backend.log, Log) and isinstance(backend.leases, SlotLeaseStore)
        assert isinstance(backend.timers, TimerView) and isinstance(backend.outbox, Outbox)
        assert isinstance(backend.firing, TimerFiring) and isinstance(backend.timer_queries, TimerQueries)
        assert isinstance(backend.snapshots, SnapshotStore) and isinstance(backend.rebuilds, SnapshotRebuildStore)
        assert backend.log.context == "shop" and backend.log.partitions == 4
        sink = backend.sink(AggregateType(context="shop", aggregate="order"))
        assert isinstance(sink, EventSink) and backend.sink(AggregateType(context="shop", aggregate="order")) is sink
        lease = await backend.leases.acquire("wowd.shop", Owner(key="a"), 1, timedelta(seconds=5), timedelta(0))
        assert lease.acquired
        ref = AggregateRef(context="shop", aggregate="order", id="o-1")
        c = Commit(ref=ref, version=1, command_id="c", request_id="r", create_time=1)
        assert await backend.log.append(c) == "appended"
    finally:
        await backend.close()
    with sqlite3.connect(tmp_path / "sub" / "wowd.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"log", "log_checkpoint", "log_quarantine", "cosid_slot", "cosid_namespace", "outbox"} <= tables
