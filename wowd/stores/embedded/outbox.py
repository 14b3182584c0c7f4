"""The outbox on SQLite: where the ``outbox`` gateway delivers fired commands.

Table ``outbox``: ``seq`` (insertion order, AUTOINCREMENT), ``request_id`` unique, the timer,
target (JSON ``{context, aggregate, tenant_id, id}``), the command's JSON text, the occurrence's
``scheduled_at``, the writer's fence and owner key, ``created_at``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread

from wowd.errors import StorageUnavailable
from wowd.metrics import STORE_CALL_SECONDS, STORE_UNAVAILABLE
from wowd.model import AggregateRef, OutboxEntry
from wowd.stores.embedded.db import SqliteDatabase

__all__ = ["EmbeddedOutbox"]

T = TypeVar("T")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS outbox (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        request_id TEXT NOT NULL UNIQUE,
        timer_id TEXT NOT NULL,
        target TEXT NOT NULL,
        command TEXT NOT NULL,
        scheduled_at INTEGER NOT NULL,
        fence INTEGER NOT NULL,
        owner_key TEXT NOT NULL,
        created_at INTEGER NOT NULL
    )""",
    # A re-delivery of a request id already in the outbox (a re-fire after a crash between send
    # and settle, or by a new slot holder): kept so that tests and operators can see who re-fired.
    """CREATE TABLE IF NOT EXISTS outbox_redelivery (
        request_id TEXT NOT NULL,
        fence INTEGER NOT NULL,
        owner_key TEXT NOT NULL,
        created_at INTEGER NOT NULL
    )""",
)

_COLUMNS = "request_id, timer_id, target, command, scheduled_at, fence, owner_key, created_at"


def put_sql() -> str:
    return (
        f"INSERT INTO outbox ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO NOTHING"
    )


def entries_sql() -> str:
    """Entries in insertion order, skipping the first ``after`` ones."""
    return f"SELECT {_COLUMNS} FROM outbox ORDER BY seq LIMIT ? OFFSET ?"


def _target_json(ref: AggregateRef) -> str:
    return json.dumps(
        {"context": ref.context, "aggregate": ref.aggregate, "tenant_id": ref.tenant_id, "id": ref.id},
        separators=(",", ":"),
    )


def _entry(row: tuple[Any, ...]) -> OutboxEntry:
    t = json.loads(row[2])
    return OutboxEntry(
        request_id=row[0],
        timer_id=row[1],
        target=AggregateRef(
            context=t["context"], aggregate=t["aggregate"], tenant_id=t["tenant_id"], id=t["id"]
        ),
        command=row[3],
        scheduled_at=row[4],
        fence=row[5],
        owner_key=row[6],
        created_at=row[7],
    )


class EmbeddedOutbox:
    """:class:`~wowd.stores.base.Outbox` on SQLite; ``db_or_path`` as the other embedded stores."""

    def __init__(self, db_or_path: SqliteDatabase | str | Path) -> None:
        if isinstance(db_or_path, SqliteDatabase):
            self._db, self._owns = db_or_path, False
        else:
            self._db, self._owns = SqliteDatabase(db_or_path), True
        self._ready = False

    async def _call(self, operation: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        started = time.perf_counter()
        try:
            if not self._ready:
                await self._db.run(self._db.transaction(_create_schema))
                self._ready = True
            return await self._db.run(fn)
        except StorageUnavailable:
            STORE_UNAVAILABLE.labels("outbox", operation).inc()
            raise
        finally:
            STORE_CALL_SECONDS.labels("outbox", operation).observe(time.perf_counter() - started)

    async def prepare(self) -> None:
        """Creates the table when missing (idempotent)."""
        await self._call("prepare", lambda conn: None)

    async def put(self, entry: OutboxEntry) -> bool:
        values = (
            entry.request_id,
            entry.timer_id,
            _target_json(entry.target),
            entry.command,
            entry.scheduled_at,
            entry.fence,
            entry.owner_key,
            entry.created_at,
        )
        return await self._call("put", lambda conn: conn.execute(put_sql(), values).rowcount == 1)

    async def put_many(self, entries: Sequence[OutboxEntry]) -> list[bool]:
        """Inserts a batch in one transaction; per entry, False when its request id was there
        (that re-delivery is recorded in ``outbox_redelivery``)."""
        rows = [
            (
                e.request_id,
                e.timer_id,
                _target_json(e.target),
                e.command,
                e.scheduled_at,
                e.fence,
                e.owner_key,
                e.created_at,
            )
            for e in entries
        ]

        def run(conn: sqlite3.Connection) -> list[bool]:
            existing: set[str] = set()
            ids = [r[0] for r in rows]
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                marks = ",".join("?" * len(chunk))
                existing.update(
                    r[0] for r in conn.execute(f"SELECT request_id FROM outbox WHERE request_id IN ({marks})", chunk)
                )
            answers: list[bool] = []
            fresh: list[tuple[Any, ...]] = []
            again: list[tuple[Any, ...]] = []
            for r in rows:
                new = r[0] not in existing
                answers.append(new)
                if new:
                    existing.add(r[0])
                    fresh.append(r)
                else:
                    again.append((r[0], r[5], r[6], r[7]))
            conn.executemany(put_sql(), fresh)
            if again:
                conn.executemany(
                    "INSERT INTO outbox_redelivery (request_id, fence, owner_key, created_at) VALUES (?, ?, ?, ?)",
                    again,
                )
            return answers

        if not rows:
            return []
        return await self._call("put_many", self._db.transaction(run))

    async def entries(self, limit: int = 1000, after: int = 0) -> list[OutboxEntry]:
        """At most ``limit`` entries in insertion order, after the first ``after`` ones."""

        def run(conn: sqlite3.Connection) -> list[OutboxEntry]:
            return [_entry(r) for r in conn.execute(entries_sql(), (limit, max(after, 0))).fetchall()]

        return await self._call("entries", run)

    async def count(self) -> int:
        def run(conn: sqlite3.Connection) -> int:
            return int(conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

        return await self._call("count", run)

    async def close(self) -> None:
        if self._owns:
            await anyio.to_thread.run_sync(self._db.close)


def _create_schema(conn: sqlite3.Connection) -> None:
    for statement in SCHEMA:
        conn.execute(statement)
