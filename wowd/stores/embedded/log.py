"""The context's log on SQLite (docs/schema.md, embedded).

Table ``log`` (shared by the contexts of one file, each row carrying its ``context``): ``seq``
(INTEGER PRIMARY KEY AUTOINCREMENT: the position, assigned at append, in commit order since
SQLite has one writer at a time), ``aggregate``, ``tenant_id``, ``aggregate_id``, ``version``,
``partition``, ``request_id`` and ``doc`` (the commit's document,
:func:`~wowd.model.commit_to_doc`, as JSON). Unique ``(context, aggregate, tenant_id,
aggregate_id, version)`` and ``(context, aggregate, aggregate_id, request_id)``; index
``(context, partition, seq)``. The checkpoints and the quarantine are tables of the same format
(:data:`~wowd.stores.embedded.schema.LOG_FORMAT`, recorded in ``log_format``; their stores are
:mod:`~wowd.stores.embedded.checkpoints` and :mod:`~wowd.stores.embedded.quarantine`).

A position is ``{"seq": n}``. ``read`` sends one query per batch (per :data:`READ_ARMS`
partitions: :func:`read_sql`), each partition read after its own position. When
caught up it waits for an in-process notification from ``append`` (any store of this process on
the same file) or :meth:`EmbeddedLog.nudge`, or, for other processes' appends, a bounded poll
that starts at 2 ms and doubles to 100 ms while nothing comes. The watermark of a batch that
reached the head is the wall-clock time taken just before its query: SQLite assigns ``seq`` in
commit order and a query sees every commit made before it began.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import chain, islice
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import orjson

from wowd.errors import ConflictError, InvalidInput, StorageError, StorageUnavailable, WowdError
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    AggregateType,
    Commit,
    LogBatch,
    LogEntry,
    Position,
    commit_from_doc,
    commit_to_doc,
    partition,
    unchecked,
    validate_name,
)
from wowd.stores.base import AppendOutcome, Ddl, OwnerProbe
from wowd.stores.embedded.db import SqliteDatabase, in_snapshot, json_rows, padded, power_of_two
from wowd.stores.embedded.schema import LogTables
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["POLL_MAX_S", "POLL_MIN_S", "EmbeddedLog", "committed_after", "entries_between", "entry_of"]

log = logging.getLogger(__name__)

T = TypeVar("T")


POLL_MIN_S = 0.002
POLL_MAX_S = 0.1


# --------------------------------------------------------------------------- SQL builders


def insert_sql() -> str:
    return (
        "INSERT INTO log (context, aggregate, tenant_id, aggregate_id, version, partition, request_id, doc) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    )


def find_request_sql() -> str:
    """The commit holding ``(aggregate, aggregate_id, request_id)``: a repeat is a duplicate."""
    return "SELECT seq FROM log WHERE context = ? AND aggregate = ? AND aggregate_id = ? AND request_id = ?"


def last_version_sql() -> str:
    """The highest version of one aggregate (over the ``log_version`` index)."""
    return "SELECT MAX(version) FROM log WHERE context = ? AND aggregate = ? AND tenant_id = ? AND aggregate_id = ?"


READ_ARMS = 64
"""Partitions read by one compound statement of a batch (SQLite allows 500 arms); a slot of more
partitions is read with several, merged here."""


@lru_cache(maxsize=64)
def read_sql(arms: int, limit: int) -> str:
    """One batch of ``arms`` partitions in log order, at most ``limit`` rows: one arm per
    partition (``partition = ?`` and ``seq > ?``, over the ``log_partition`` index), ``UNION
    ALL``, ordered and limited as a whole. SQLite runs an ``ORDER BY`` on a compound select as a
    merge of its arms, each read in index order, and stops at the ``LIMIT``: it reads the rows it
    answers (and one more per partition), however many are unread, instead of sorting them all.
    The limit is written in the statement: SQLite 3.47 and later prepare a compound select again
    at every run when its ``LIMIT`` is a bound parameter (the value may change the plan), which
    costs more than the read.

    Parameters: ``?1`` the context; per arm ``i`` (from 0), ``?(2i + 2)`` its partition and
    ``?(2i + 3)`` the ``seq`` it reads after."""
    if arms < 1:
        raise ValueError("arms must be >= 1")
    arm = "SELECT seq, aggregate, partition, doc FROM log WHERE context = ?1 AND partition = ?{} AND seq > ?{}"
    union = " UNION ALL ".join(arm.format(2 * i + 2, 2 * i + 3) for i in range(arms))
    return f"{union} ORDER BY seq LIMIT {int(limit)}"


READ_COLUMNS = ("seq", "aggregate", "partition", "doc")
"""The columns of :func:`read_sql`'s rows."""


def read_plan(partitions: Iterable[int], arms: int = READ_ARMS) -> list[tuple[int, ...]]:
    """The partitions, sorted, in groups of at most ``arms``: one compound statement each."""
    parts = sorted(partitions)
    return [tuple(parts[i : i + arms]) for i in range(0, len(parts), arms)]


# --------------------------------------------------------------------------- in-process wake-ups


class _Notifier:
    """Wakes the readers of one file in this process when an append commits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[anyio.Event, object] = {}

    def subscribe(self) -> anyio.Event:
        event = anyio.Event()
        with self._lock:
            self._waiters[event] = anyio.lowlevel.current_token()
        return event

    def unsubscribe(self, event: anyio.Event) -> None:
        with self._lock:
            self._waiters.pop(event, None)

    def notify(self) -> None:
        token = anyio.lowlevel.current_token()
        with self._lock:
            mine = [e for e, t in self._waiters.items() if t == token]
        for event in mine:  # readers on another event loop rely on their poll
            event.set()


_NOTIFIERS: dict[str, _Notifier] = {}
_NOTIFIERS_LOCK = threading.Lock()


def _notifier_for(path: str) -> _Notifier:
    key = path if path == ":memory:" else os.path.realpath(path)
    with _NOTIFIERS_LOCK:
        n = _NOTIFIERS.get(key)
        if n is None:
            n = _NOTIFIERS[key] = _Notifier()
        return n


# --------------------------------------------------------------------------- helpers


def _seq(position: Position | None, partition_: int) -> int:
    if position is None:
        return 0
    seq = position.get("seq") if isinstance(position, Mapping) else None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise InvalidInput(f"not an embedded log position: {position!r}", field=f"positions[{partition_}]")
    return seq


BATCH_BYTES = 4 * 1024 * 1024
"""A batch ends after the commit that brings its documents' text past this (commits carrying many
timer events make large batches: what a batch holds decoded is bounded by this, not only by the
number of commits)."""


def _within_bytes(rows: list[Any], limit: int) -> list[Any]:
    """The first rows whose documents (``row[3]``) add up to ``limit`` bytes, at least one."""
    total = 0
    for i, row in enumerate(rows):
        total += len(row[3])
        if total >= limit:
            return rows[: i + 1]
    return rows


def _reader(
    context: str, groups: Sequence[tuple[int, ...]], after: Mapping[int, int], cursor: int, limit: int
) -> Callable[[sqlite3.Connection], list[Any]]:
    """The first ``limit`` rows in log order of the partitions of ``groups``, each after its own
    position and after ``cursor``: one statement per group (:func:`read_sql`), its rows read as
    one value (:func:`~wowd.stores.embedded.db.json_rows`); several groups are read in one
    transaction (one snapshot of the file) and merged here."""
    statements = [
        (read_sql(len(g), limit), (context, *chain.from_iterable((p, max(after[p], cursor)) for p in g)))
        for g in groups
    ]
    if len(statements) == 1:
        sql, params = statements[0]
        return lambda conn: json_rows(conn, sql, READ_COLUMNS, params)

    def merged(conn: sqlite3.Connection) -> list[Any]:
        batches = [json_rows(conn, sql, READ_COLUMNS, params) for sql, params in statements]
        return list(islice(heapq.merge(*batches, key=itemgetter(0)), limit))

    return lambda conn: in_snapshot(conn, merged)


_log_entry = unchecked(LogEntry)


def _entry(type_: AggregateType, row: tuple[Any, ...]) -> LogEntry:
    seq, _aggregate, part, text = row
    try:
        raw = orjson.loads(text)
    except (ValueError, TypeError) as exc:  # TypeError: not a text (a number another program wrote)
        return LogEntry(
            position={"seq": seq}, partition=part, aggregate=type_, commit=None, raw={}, error=f"doc: {exc}"
        )
    if not isinstance(raw, dict):
        return LogEntry(
            position={"seq": seq},
            partition=part,
            aggregate=type_,
            commit=None,
            raw={"doc": raw},
            error="commit: a commit must be a document",
        )
    try:
        commit: Commit | None = commit_from_doc(type_, raw)
        error = None
    except (WowdError, TypeError, ValueError) as exc:
        commit, error = None, str(exc)
    return _log_entry(position={"seq": seq}, partition=part, aggregate=type_, commit=commit, raw=raw, error=error)


class EmbeddedLog(LogTables):
    """:class:`~wowd.stores.base.Log` on a SQLite file shared by several processes (the log's
    tables: :class:`~wowd.stores.embedded.schema.LogTables`)."""

    STORE = "log"

    def __init__(
        self,
        db_or_path: SqliteDatabase | str | Path,
        *,
        context: str,
        partitions: int,
        ddl: Ddl = Ddl.AUTO,
    ) -> None:
        super().__init__(db_or_path, context=context, ddl=ddl)
        if partitions < 1:
            raise InvalidInput(f"must be >= 1, got {partitions}", field="partitions")
        self.partitions = partitions
        self._notifier = _notifier_for(self._db.path)
        # the tail is read on a connection of its own: a read of the log's head never queues
        # behind this store's writes (checkpoints wait for the file's write lock)
        memory = self._db.path == ":memory:"
        self._tail_db = self._db if memory else SqliteDatabase(self._db.path)

    # ------------------------------------------------------------------ plumbing

    async def close(self) -> None:
        if self._tail_db is not self._db:
            await anyio.to_thread.run_sync(self._tail_db.close)
        await super().close()

    async def ping(self) -> None:
        try:
            await self._db.run(lambda conn: conn.execute("SELECT 1").fetchone())
        except StorageError as exc:
            raise StorageUnavailable(f"sqlite {self._db.path}: does not answer: {exc}") from exc

    # ------------------------------------------------------------------ appends

    def _row(self, commit: Commit) -> tuple[Any, ...]:
        if commit.ref.context != self.context:
            raise InvalidInput(f"{commit.ref.context!r} is not the log's context {self.context!r}", field="context")
        doc = commit_to_doc(commit, self.partitions)
        try:
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"is not JSON-serialisable: {exc}", field="events") from exc
        ref = commit.ref
        return (
            self.context,
            ref.aggregate,
            ref.tenant_id,
            ref.id,
            commit.version,
            doc["partition"],
            commit.request_id,
            text,
        )

    def _append_rows(self, conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> list[AppendOutcome]:
        outcomes: list[AppendOutcome] = []
        for row in rows:
            if conn.execute(find_request_sql(), (row[0], row[1], row[3], row[6])).fetchone() is not None:
                outcomes.append("duplicate")
                continue
            try:
                conn.execute(insert_sql(), row)
            except sqlite3.IntegrityError:
                outcomes.append("conflict")
                continue
            outcomes.append("appended")
        return outcomes

    async def append(self, commit: Commit) -> AppendOutcome:
        row = self._row(commit)
        outcome = (await self._run("append", self._db.transaction(lambda c: self._append_rows(c, [row]))))[0]
        if outcome == "appended":
            self._notifier.notify()
        elif outcome == "conflict":
            raise ConflictError(
                f"{commit.ref} already has a commit at version {commit.version} "
                f"(request id {commit.request_id!r} is another one)"
            )
        return outcome

    async def append_many(self, commits: Sequence[Commit]) -> list[AppendOutcome]:
        if not commits:
            return []
        rows = [self._row(c) for c in commits]
        outcomes = await self._run("append_many", self._db.transaction(lambda c: self._append_rows(c, rows)))
        if "appended" in outcomes:
            self._notifier.notify()
        return outcomes

    async def last_version(self, ref: AggregateRef) -> int:
        params = (self.context, ref.aggregate, ref.tenant_id, ref.id)

        def run(conn: sqlite3.Connection) -> int:
            found = conn.execute(last_version_sql(), params).fetchone()[0]
            return int(found) if found is not None else 0

        return await self._run("last_version", run)

    async def committed_after(self, probes: Sequence[OwnerProbe]) -> set[int]:
        """Per aggregate asked, whether its highest version is above the probe's (one seek of
        index ``log_version`` each, :func:`committed_after`, in one read of the file): any commit
        above a probe's version answers it, whatever its key."""
        if not probes:
            return set()
        asked = [(self.context, p.ref.aggregate, p.ref.tenant_id, p.ref.id, p.version) for p in probes]
        return await self._run("committed_after", lambda conn: committed_after(conn, asked))

    async def insert_raw(self, aggregate: AggregateType, document: Mapping[str, Any]) -> None:
        """Stores ``document`` as is (its JSON). Partition: of ``aggregate_id`` when that is a
        string, else 0. Raises :class:`ConflictError` when it collides with a stored commit."""
        validate_name(aggregate.aggregate, field="aggregate")

        def text_or_none(key: str) -> str | None:
            v = document.get(key)
            return v if isinstance(v, str) else None

        agg_id = text_or_none("aggregate_id")
        version = document.get("version")
        row = (
            self.context,
            aggregate.aggregate,
            document.get("tenant_id", DEFAULT_TENANT) if isinstance(document.get("tenant_id", ""), str) else None,
            agg_id,
            version if isinstance(version, int) and not isinstance(version, bool) else None,
            partition(agg_id, self.partitions) if agg_id is not None else 0,
            text_or_none("request_id"),
            json.dumps(dict(document), separators=(",", ":"), default=str),
        )

        def run(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(insert_sql(), row)
            except sqlite3.IntegrityError as exc:
                raise ConflictError(f"raw document collides with a stored commit: {exc}") from exc

        await self._run("insert_raw", run)
        self._notifier.notify()

    # ------------------------------------------------------------------ reads

    async def read(
        self, positions: Mapping[int, Position | None], *, batch_size: int = 500, follow: bool = True
    ) -> AsyncIterator[LogBatch]:
        after = {p: _seq(pos, p) for p, pos in positions.items()}
        if not after:
            if follow:
                await anyio.sleep_forever()
            return
        groups = read_plan(after)
        types: dict[str, AggregateType] = {}
        cursor = min(after.values())
        delay = POLL_MIN_S
        event: anyio.Event | None = None
        try:
            while True:
                if follow:
                    # subscribe before querying: an append committed after the query wakes us
                    event = self._notifier.subscribe()
                # taken before the query starts its read: a commit appended before it is read
                began = int(time.time() * 1000)
                rows = await self._run(
                    "read", _reader(self.context, groups, after, cursor, batch_size), db=self._tail_db
                )
                read = len(rows)
                rows = _within_bytes(rows, BATCH_BYTES)
                if rows:
                    if event is not None:
                        self._notifier.unsubscribe(event)
                        event = None
                    cursor = rows[-1][0]
                    entries = []
                    last: dict[int, Position] = {}
                    for row in rows:
                        seq, part = row[0], row[2]
                        if seq <= after[part]:
                            continue
                        after[part] = seq
                        type_ = types.get(row[1])
                        if type_ is None:
                            type_ = types[row[1]] = AggregateType(context=self.context, aggregate=row[1])
                        entry = _entry(type_, row)
                        entries.append(entry)
                        last[part] = entry.position
                    head = read < batch_size and len(rows) == read
                    if entries or head:
                        yield LogBatch(entries=tuple(entries), positions=last, watermark=began if head else None)
                    delay = POLL_MIN_S
                    continue
                if not follow:
                    return
                yield LogBatch(entries=(), positions={}, watermark=began)
                assert event is not None
                with anyio.move_on_after(delay):
                    await event.wait()
                woken = event.is_set()
                self._notifier.unsubscribe(event)
                event = None
                delay = POLL_MIN_S if woken else min(delay * 2, POLL_MAX_S)
        finally:
            if event is not None:
                self._notifier.unsubscribe(event)

    def nudge(self) -> None:
        self._notifier.notify()

    async def aggregate_types(self) -> list[AggregateType]:
        def run(conn: sqlite3.Connection) -> list[AggregateType]:
            rows = conn.execute(
                "SELECT DISTINCT aggregate FROM log WHERE context = ? ORDER BY aggregate", (self.context,)
            ).fetchall()
            return [AggregateType(context=self.context, aggregate=r[0]) for r in rows]

        return await self._run("aggregate_types", run)


# ---- the fire rule's question to the log: a commit of these aggregates past these versions

COMMITTED_AFTER_CHUNK = 256
"""Aggregates asked about in one statement of :func:`committed_after`."""


@lru_cache(maxsize=16)
def committed_after_sql(rows: int) -> str:
    """Which of ``rows`` aggregates (context, aggregate, tenant, id, version: five parameters
    each) the log holds a commit of above their ``version``: per aggregate, its highest version
    (one seek of index ``log_version``); answers the aggregates' row numbers (from 0)."""
    values = ", ".join(f"({i}, ?, ?, ?, ?, ?)" for i in range(rows))
    return (
        f"WITH o(i, c, a, t, d, v) AS (VALUES {values})"
        " SELECT o.i FROM o WHERE (SELECT MAX(version) FROM log WHERE context = o.c AND aggregate = o.a"
        " AND tenant_id = o.t AND aggregate_id = o.d) > o.v"
    )


def committed_after(conn: sqlite3.Connection, asked: Sequence[tuple[str, str, str, str, int]]) -> set[int]:
    """The fire rule's question (:meth:`~wowd.stores.base.Log.committed_after`) in the caller's
    transaction on ``conn``: the indexes in ``asked`` ((context, aggregate, tenant, id, version)
    each) of the aggregates the log holds a commit of above that version. A few statements: each
    asks about a power of two of aggregates (the last padded with repeats of its last one), so
    that a few statement texts, each prepared once per connection, serve any count."""
    found: set[int] = set()
    for start in range(0, len(asked), COMMITTED_AFTER_CHUNK):
        chunk = asked[start : start + COMMITTED_AFTER_CHUNK]
        rows = power_of_two(len(chunk))
        params = [v for owner in padded(chunk, rows) for v in owner]
        found.update(start + i for (i,) in conn.execute(committed_after_sql(rows), params) if i < len(chunk))
    return found


ENTRIES_BETWEEN_SQL = (
    "SELECT seq, aggregate, partition, doc FROM log WHERE context = ? AND partition = ? AND seq > ? AND seq <= ?"
    " ORDER BY seq"
)
"""One partition's commits after a position, up to another (over the ``log_partition`` index)."""


def entries_between(conn: sqlite3.Connection, context: str, partition_: int, after: int, until: int) -> list[LogEntry]:
    """The log entries of one partition with ``after < seq <= until``, in log order, read in the
    caller's transaction on ``conn`` (a rebuild of the timer view catching up to the feed's
    checkpoint while it holds the file's write lock)."""
    types: dict[str, AggregateType] = {}
    out: list[LogEntry] = []
    for row in conn.execute(ENTRIES_BETWEEN_SQL, (context, partition_, after, until)):
        type_ = types.get(row[1])
        if type_ is None:
            type_ = types[row[1]] = AggregateType(context=context, aggregate=row[1])
        out.append(_entry(type_, tuple(row)))
    return out


def entry_of(type_: AggregateType, row: tuple[Any, ...]) -> LogEntry:
    """A log row (:data:`READ_COLUMNS`) decoded as :meth:`EmbeddedLog.read` answers it."""
    return _entry(type_, row)
