"""The event sink of one aggregate type on SQLite (docs/stores.md).

Table ``events``, shared by every type of every context on the file: one row per commit, keyed
``(context, aggregate, tenant_id, aggregate_id, version)``, with ``id`` the commit's stream id
(:func:`wowd.model.stream_id`), ``document`` the commit's fields as JSON text, and the access
attributes (``access``, canonical JSON text) with the version they are of (``access_version``)
in their own columns, which stamps rewrite.

A write is one transaction, run holding the file's in-process write lock
(:func:`~wowd.stores.embedded.db.file_write_lock`: queued behind the firing path's writes rather
than retried by SQLite's busy handler): ``INSERT OR IGNORE`` of every record (a record written
before is ignored and counts as written: "409"), then the access stamps: per aggregate, the last
record whose attributes differ from the record before it (in the write, else the last one this
sink wrote of the aggregate, as its :class:`AccessMemory` remembers it, else the stream's latest
stored document, none before version 1) stamps its attributes over the aggregate's earlier
documents under the guard of :meth:`EmbeddedEventSink.stamp`.

The backend gives the sinks of every aggregate type one connection and one :class:`AccessMemory`
(:func:`~wowd.stores.embedded.open_embedded`): what they hold does not grow with the number of
types.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from wowd.errors import InvalidInput, SinkWriteError
from wowd.metrics import SINK_BULK_SECONDS, SINK_ITEMS
from wowd.model import (
    MAX_COMMIT_DOCUMENT_BYTES,
    MAX_COMMIT_EVENTS,
    AccessStamp,
    AggregateRef,
    AggregateType,
    Commit,
    commit_fields,
    sorted_json,
    stream_id,
)
from wowd.stores.embedded.db import SqliteDatabase, SqliteStore, insert_rows
from wowd.stores.embedded.schema import EVENTS_TABLE, events_ddl
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["AccessMemory", "EmbeddedEventSink", "SinkWrite"]

T = TypeVar("T")

_STREAM = "context = ? AND aggregate = ? AND tenant_id = ? AND aggregate_id = ?"


# --------------------------------------------------------------------------- pure SQL builders


def insert_sql() -> str:
    """Creates a document unless its id (its key) is there: a repeat is ignored."""
    return (
        f"INSERT OR IGNORE INTO {EVENTS_TABLE}"
        " (context, aggregate, tenant_id, aggregate_id, version, id, document, access, access_version)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )


def stamp_sql() -> str:
    """Writes attributes of an access version over a stream's documents in a version range,
    guarded: a document without ``access_version``, with one below, or with the same one and
    other attributes. Parameters: access, as_of, stream (4), from, until, as_of, as_of, access."""
    return (
        f"UPDATE {EVENTS_TABLE} SET access = ?, access_version = ? WHERE {_STREAM} AND version BETWEEN ? AND ?"
        " AND (access_version IS NULL OR access_version < ? OR (access_version = ? AND access IS NOT ?))"
    )


def previous_sql() -> str:
    """The stream's latest stored document before a version: its attributes."""
    return f"SELECT access FROM {EVENTS_TABLE} WHERE {_STREAM} AND version < ? ORDER BY version DESC LIMIT 1"


def documents_sql() -> str:
    return f"SELECT document, access, access_version FROM {EVENTS_TABLE} WHERE {_STREAM} ORDER BY version"


# --------------------------------------------------------------------------- documents


def _document_json(doc: Mapping[str, Any]) -> str:
    """A stored document's JSON text (orjson; the standard encoder for what orjson refuses);
    :class:`InvalidInput` over :data:`~wowd.model.MAX_COMMIT_DOCUMENT_BYTES`, as the event index
    of the other backend refuses it."""
    try:
        data = orjson.dumps(doc)
    except TypeError:
        data = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    if len(data) > MAX_COMMIT_DOCUMENT_BYTES:
        raise InvalidInput(
            f"the document is {len(data)} bytes, over the cap of {MAX_COMMIT_DOCUMENT_BYTES} bytes a document "
            "of the event index (the same on every backend)",
            field="commit",
        )
    return data.decode()


def access_json(access: Mapping[str, Any]) -> str:
    """Canonical text of access attributes (sorted keys): equal attributes, equal text."""
    if not access:
        return "{}"  # what the encoder writes for none, without encoding
    return sorted_json(dict(access), ascii=False)


def commit_document(commit: Commit, id: str | None = None) -> dict[str, Any]:
    """The stored document of a commit, without its access attributes (kept in columns);
    ``id``: its stream id when the caller has it."""
    ref = commit.ref
    return {
        "id": stream_id(ref, commit.version) if id is None else id,
        "context": ref.context,
        "aggregate": ref.aggregate,
        **commit_fields(commit),
        "deleted": commit.deleted,
    }


def _stamp_params(s: AccessStamp, access: str) -> tuple[Any, ...]:
    r = s.ref
    return (access, s.as_of, r.context, r.aggregate, r.tenant_id, r.id, s.from_, s.until, s.as_of, s.as_of, access)


class AccessMemory:
    """The version and attributes' text of the last record written of each aggregate, for at most
    ``capacity`` aggregates (the least recently written forgotten first), whatever their types:
    one memory may serve the sinks of every type. What it forgets is read from the stream."""

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 0:
            raise InvalidInput(f"must be >= 0, got {capacity}", field="capacity")
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, str, str, str], tuple[int, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def get(self, key: tuple[str, str, str, str]) -> tuple[int, str] | None:
        """What is remembered of the aggregate ``(context, aggregate, tenant_id, id)``."""
        return self._last.get(key)

    def put(self, key: tuple[str, str, str, str], version: int, access: str) -> None:
        """Remembers the record ``version`` with attributes ``access`` (unless a later one is)."""
        last = self._last
        seen = last.get(key)
        if seen is None or seen[0] <= version:
            last[key] = (version, access)
        last.move_to_end(key)
        while len(last) > self.capacity:
            last.popitem(last=False)


_CREATED = SINK_ITEMS.labels("201")
_EXISTING = SINK_ITEMS.labels("409")


@dataclass(slots=True)
class SinkWrite:
    """A sink write made ready (:meth:`EmbeddedEventSink.plan_write`): the rows to insert, per
    aggregate its records and their attributes' text, what the sink remembered of each before,
    and the records refused (a document that cannot be encoded)."""

    rows: list[tuple[Any, ...]]
    streams: dict[tuple[str, str], list[tuple[Commit, str]]]
    remembered: dict[tuple[str, str], tuple[int, str] | None]
    bad: list[tuple[Commit, str]]

    def work(self, conn: sqlite3.Connection) -> int:
        """Inserts the rows (an existing document is left as it is) and stamps the attributes
        that changed over the documents before; the number of documents created."""
        created = insert_rows(conn, insert_sql(), self.rows)
        conn.executemany(stamp_sql(), _stamps(conn, self.streams, self.remembered))
        return created


class EmbeddedEventSink(SqliteStore):
    """:class:`~wowd.stores.base.EventSink` of ``type`` on SQLite.

    ``db_or_path``: a :class:`SqliteDatabase` the caller owns (the backend's, shared by the
    sinks of every type), or a path this sink opens (and closes in :meth:`close`). ``memory``:
    where the last written attributes of aggregates are remembered, to tell an access change
    without reading the stream (the backend's, shared; default: one of ``capacity`` aggregates
    of this sink's own).
    """

    STORE = "sink"

    def __init__(
        self,
        db_or_path: SqliteDatabase | str | Path,
        type: AggregateType,
        *,
        capacity: int = 1024,
        memory: AccessMemory | None = None,
    ) -> None:
        self.type = type
        self._memory = memory if memory is not None else AccessMemory(capacity)
        super().__init__(db_or_path)
        self._prepared = False

    def __repr__(self) -> str:
        return f"EmbeddedEventSink({self._db.path!r}, {self.type})"

    @property
    def index(self) -> str:
        """The Elasticsearch index name of the type, ``wow.<context>.<aggregate>.events``."""
        return f"wow.{self.type.context}.{self.type.aggregate}.events"

    async def prepare(self) -> None:
        if not self._prepared:

            def work(conn: sqlite3.Connection) -> None:
                for stmt in events_ddl():
                    conn.execute(stmt)

            await self._run("prepare", self._db.transaction(work))
            self._prepared = True

    def _check(self, ref: AggregateRef) -> None:
        if ref.context != self.type.context or ref.aggregate != self.type.aggregate:
            raise InvalidInput(f"{ref} is not of this sink's type {self.type}", field="ref")

    # ---- write

    async def write(self, records: Sequence[Commit]) -> None:
        if not records:
            return
        await self.prepare()
        plan = self.plan_write(records)
        started = time.perf_counter()
        created = await self._run("write", self._db.transaction(plan.work))
        SINK_BULK_SECONDS.observe(time.perf_counter() - started)
        self.written(plan, created)

    def plan_write(self, records: Sequence[Commit]) -> SinkWrite:
        """A write of ``records`` made ready for a transaction (:meth:`SinkWrite.work`); the
        caller runs it on a connection to this sink's file, then calls :meth:`written`."""
        return self.remember(self.plan_rows(records))

    def plan_rows(self, records: Sequence[Commit]) -> SinkWrite:
        """:meth:`plan_write` but for what this sink remembers (:meth:`remember`, right before the
        transaction): the documents, encoded ahead of the writes before them."""
        rows: list[tuple[Any, ...]] = []
        # per aggregate (tenant and id: the sink is of one type), its records in the log's order
        streams: dict[tuple[str, str], list[tuple[Commit, str]]] = {}
        bad: list[tuple[Commit, str]] = []
        context, aggregate = self.type.context, self.type.aggregate
        for c in records:
            ref = c.ref
            try:
                if ref.context != context or ref.aggregate != aggregate:
                    self._check(ref)
                if len(c.events) > MAX_COMMIT_EVENTS:
                    raise InvalidInput(
                        f"{len(c.events)} events, over the cap of {MAX_COMMIT_EVENTS} events a document of the "
                        "event index (the same on every backend)",
                        field="events",
                    )
                access = access_json(c.access)
                sid = stream_id(ref, c.version)
                doc = _document_json(commit_document(c, sid))
            except (InvalidInput, TypeError, ValueError) as exc:
                bad.append((c, str(exc)))
                continue
            rows.append((context, aggregate, ref.tenant_id, ref.id, c.version, sid, doc, access, c.access_version))
            key = (ref.tenant_id, ref.id)
            items = streams.get(key)
            if items is None:
                streams[key] = [(c, access)]
            else:
                items.append((c, access))
        return SinkWrite(rows=rows, streams=streams, remembered={}, bad=bad)

    def remember(self, plan: SinkWrite) -> SinkWrite:
        """``plan`` with the attributes this sink remembers of its aggregates now."""
        get, context, aggregate = self._memory.get, self.type.context, self.type.aggregate
        plan.remembered = {key: get((context, aggregate, *key)) for key in plan.streams}
        return plan

    def written(self, plan: SinkWrite, created: int) -> None:
        """After the transaction of ``plan`` committed (``created`` documents were new): the
        counts, the attributes remembered per aggregate; raises :class:`SinkWriteError` when
        the plan left records out."""
        _CREATED.inc(created)
        _EXISTING.inc(len(plan.rows) - created)
        put, context, aggregate = self._memory.put, self.type.context, self.type.aggregate
        for key, items in plan.streams.items():
            last, access = items[-1]
            put((context, aggregate, *key), last.version, access)
        if plan.bad:
            SINK_ITEMS.labels("400").inc(len(plan.bad))
            c, reason = plan.bad[0]
            raise SinkWriteError(
                f"sink {self.type}: {len(plan.bad)} record(s) refused, first {stream_id(c.ref, c.version)}: {reason}"
            )

    # ---- stamps

    async def stamp(self, ref: AggregateRef, access: Mapping[str, Any], as_of: int, from_: int, until: int) -> int:
        return await self.stamp_all([AccessStamp(ref=ref, access=access, as_of=as_of, from_=from_, until=until)])

    async def stamp_all(self, stamps: Sequence[AccessStamp]) -> int:
        if not stamps:
            return 0
        for s in stamps:
            self._check(s.ref)
        params = [_stamp_params(s, access_json(s.access)) for s in stamps]
        await self.prepare()

        def work(conn: sqlite3.Connection) -> int:
            before = conn.total_changes
            conn.executemany(stamp_sql(), params)  # in order: stamps of one aggregate one at a time
            return conn.total_changes - before

        return await self._run("stamp", self._db.transaction(work))

    # ---- reads

    async def documents(self, ref: AggregateRef) -> list[dict[str, Any]]:
        self._check(ref)
        await self.prepare()
        key = (ref.context, ref.aggregate, ref.tenant_id, ref.id)
        rows = await self._run("documents", lambda conn: conn.execute(documents_sql(), key).fetchall())
        out = []
        for document, access, access_version in rows:
            doc: dict[str, Any] = json.loads(document)
            attrs = json.loads(access) if access is not None else {}
            doc["access"] = attrs
            doc["owner_id"] = str(attrs.get("owner_id", ""))
            doc["space_id"] = str(attrs.get("space_id", ""))
            if access_version is not None:
                doc["access_version"] = access_version
            out.append(doc)
        return out

    # ---- plumbing


def _stamps(
    conn: sqlite3.Connection,
    streams: Mapping[tuple[str, str], list[tuple[Commit, str]]],
    remembered: Mapping[tuple[str, str], tuple[int, str] | None],
) -> list[tuple[Any, ...]]:
    """The stamp of each aggregate of a write: its last record whose attributes differ from
    the record before it, over the aggregate's documents before that record."""
    out: list[tuple[Any, ...]] = []
    for key, items in streams.items():
        first = items[0][0]
        ref = first.ref
        seen = remembered.get(key)
        previous: str | None
        if seen is not None and seen[0] < first.version:
            previous = seen[1]
        elif first.version == 1:
            previous = None  # no document before the first one: nothing to read
        else:
            row = conn.execute(previous_sql(), (ref.context, ref.aggregate, ref.tenant_id, ref.id, first.version))
            found = row.fetchone()
            previous = None if found is None else (found[0] if found[0] is not None else access_json({}))
        change: tuple[Commit, str] | None = None
        for c, access in items:
            if previous is not None and access != previous:
                change = (c, access)
            previous = access
        if change is not None:
            c, access = change
            stamp = AccessStamp(ref=ref, access=c.access, as_of=c.access_version, from_=1, until=c.version - 1)
            out.append(_stamp_params(stamp, access))
    return out
