"""The outbox on SQLite: where the ``outbox`` gateway delivers fired commands.

Table ``outbox``: ``seq`` (insertion order, AUTOINCREMENT), ``request_id`` unique, the timer,
target (JSON ``{context, aggregate, tenant_id, id}``), the command's JSON text, the occurrence's
``scheduled_at``, the writer's fence and owner key, ``created_at``.

``put_many`` (the gateway's batch path) inserts the batch in one transaction, one ``executemany``
of the row statement that skips a request id already there (no savepoint, no multi-row
statement: either makes SQLite journal every index page the random request ids touch). Only when
some request id was there already are the rows it inserted read back (by ``seq``) and the others
recorded as re-deliveries (:func:`put_rows`). A timer store that fires into this table in the
transaction that settles the timers writes the same rows the same way (:func:`entry_row`,
:func:`put_rows`).

A take holds what it read: table ``outbox_lease`` (request id, the take's id, ``until`` on the
store clock). A take reads the oldest rows no live lease holds and leases them in the same write
transaction; ``ack`` deletes the rows and their leases.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import timedelta
from json.encoder import encode_basestring_ascii
from typing import Any, TypeVar

from wowd.errors import InvalidInput
from wowd.model import AggregateRef, OutboxBatch, OutboxEntry
from wowd.stores.base import OUTBOX_TAKE_LEASE
from wowd.stores.embedded.db import NOW_MS, SqliteStore, insert_rows
from wowd.stores.embedded.schema import OUTBOX_SCHEMA
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["EmbeddedOutbox", "entry_row", "put_rows", "target_json"]

T = TypeVar("T")


_COLUMNS = "request_id, timer_id, target, command, scheduled_at, fence, owner_key, created_at"


def put_sql() -> str:
    return f"INSERT INTO outbox ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO NOTHING"


def last_seq_sql() -> str:
    """The largest ``seq`` in the table (0 when empty): one seek of its key."""
    return "SELECT COALESCE(MAX(seq), 0) FROM outbox"


def inserted_sql() -> str:
    """The request ids of the rows past a ``seq``."""
    return "SELECT request_id FROM outbox WHERE seq > ?"


def redelivery_sql() -> str:
    return "INSERT INTO outbox_redelivery (request_id, fence, owner_key, created_at) VALUES (?, ?, ?, ?)"


def entries_sql() -> str:
    """Entries in insertion order, skipping the first ``after`` ones."""
    return f"SELECT {_COLUMNS} FROM outbox ORDER BY seq LIMIT ? OFFSET ?"


def take_sql() -> str:
    """The oldest entries no live lease holds, in insertion order."""
    return (
        f"SELECT {_COLUMNS} FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM outbox_lease l "
        f"WHERE l.request_id = o.request_id AND l.until > {NOW_MS}) ORDER BY seq LIMIT ?"
    )


def lease_sql() -> str:
    """Leases one entry to a take for a number of ms from the store's now."""
    return (
        f"INSERT INTO outbox_lease (request_id, lease, until) VALUES (?, ?, {NOW_MS} + ?) "
        "ON CONFLICT (request_id) DO UPDATE SET lease = excluded.lease, until = excluded.until"
    )


def ack_sql(n: int) -> str:
    return f"DELETE FROM outbox WHERE request_id IN ({', '.join('?' * n)})"


def ack_lease_sql(n: int) -> str:
    return f"DELETE FROM outbox_lease WHERE request_id IN ({', '.join('?' * n)})"


def trim_sql() -> str:
    return "DELETE FROM outbox WHERE created_at < ?"


def trim_lease_sql() -> str:
    """The leases that ran out on entries no longer there (trimmed)."""
    return (
        f"DELETE FROM outbox_lease WHERE until <= {NOW_MS} AND NOT EXISTS "
        "(SELECT 1 FROM outbox o WHERE o.request_id = outbox_lease.request_id)"
    )


def target_json(context: str, aggregate: str, tenant_id: str, id: str) -> str:
    """``{"context":..,"aggregate":..,"tenant_id":..,"id":..}``: the text ``json.dumps`` writes
    with ``separators=(",", ":")`` (each string escaped by the encoder json uses for it)."""
    e = encode_basestring_ascii
    return f'{{"context":{e(context)},"aggregate":{e(aggregate)},"tenant_id":{e(tenant_id)},"id":{e(id)}}}'


def _target_json(ref: AggregateRef) -> str:
    return target_json(ref.context, ref.aggregate, ref.tenant_id, ref.id)


def entry_row(e: OutboxEntry) -> tuple[Any, ...]:
    """An entry as the row :func:`put_sql` inserts (the timer store builds the same row from a
    timer's row: ``outbox_row`` in ``wowd.stores.embedded.timer_sql``)."""
    return (
        e.request_id,
        e.timer_id,
        _target_json(e.target),
        e.command,
        e.scheduled_at,
        e.fence,
        e.owner_key,
        e.created_at,
    )


def _entry(row: tuple[Any, ...]) -> OutboxEntry:
    t = json.loads(row[2])
    return OutboxEntry(
        request_id=row[0],
        timer_id=row[1],
        target=AggregateRef(context=t["context"], aggregate=t["aggregate"], tenant_id=t["tenant_id"], id=t["id"]),
        command=row[3],
        scheduled_at=row[4],
        fence=row[5],
        owner_key=row[6],
        created_at=row[7],
    )


class EmbeddedOutbox(SqliteStore):
    """:class:`~wowd.stores.base.Outbox` on SQLite; ``db_or_path`` as the other embedded stores."""

    STORE = "outbox"
    SCHEMA = OUTBOX_SCHEMA

    async def prepare(self) -> None:
        """Creates the table when missing (idempotent)."""
        await self._run("prepare", lambda conn: None)

    async def put(self, entry: OutboxEntry) -> bool:
        values = entry_row(entry)
        sql = put_sql()
        return await self._run("put", self._db.transaction(lambda conn: conn.execute(sql, values).rowcount == 1))

    async def put_many(self, entries: Sequence[OutboxEntry]) -> list[bool]:
        """Inserts a batch in one transaction; per entry, False when its request id was there
        (that re-delivery is recorded in ``outbox_redelivery``)."""
        rows = [entry_row(e) for e in entries]
        if not rows:
            return []
        return await self._run("put_many", self._db.transaction(lambda conn: put_rows(conn, rows)))

    async def entries(self, limit: int = 1000, after: int = 0) -> list[OutboxEntry]:
        """At most ``limit`` entries in insertion order, after the first ``after`` ones."""

        def run(conn: sqlite3.Connection) -> list[OutboxEntry]:
            return [_entry(r) for r in conn.execute(entries_sql(), (limit, max(after, 0))).fetchall()]

        return await self._run("entries", run)

    async def count(self) -> int:
        """``COUNT(*)``, which SQLite answers by scanning the table's smallest index (``outbox_created``,
        an integer a row), on this store's own connection: a read of the WAL snapshot, which no
        writer blocks."""

        def run(conn: sqlite3.Connection) -> int:
            return int(conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

        return await self._run("count", run)

    async def take(self, limit: int = 100, *, lease: timedelta = OUTBOX_TAKE_LEASE) -> OutboxBatch:
        """One write transaction: the oldest rows no live lease holds, each leased to this take
        (``outbox_lease``) until the store's now + ``lease``."""
        lease_ms = int(lease.total_seconds() * 1000)
        if lease_ms <= 0:
            raise InvalidInput(f"the lease of a take must be at least 1 ms, got {lease}", field="lease")
        if limit <= 0:
            return OutboxBatch(entries=(), cursor=None)
        lease_id = uuid.uuid4().hex

        def run(conn: sqlite3.Connection) -> OutboxBatch:
            rows = conn.execute(take_sql(), (limit,)).fetchall()
            if not rows:
                return OutboxBatch(entries=(), cursor=None)
            conn.executemany(lease_sql(), [(r[0], lease_id, lease_ms) for r in rows])
            return OutboxBatch(entries=tuple(_entry(r) for r in rows), cursor=lease_id)

        return await self._run("take", self._db.transaction(run))

    async def ack(self, request_ids: Sequence[str]) -> int:
        ids = list(dict.fromkeys(request_ids))

        def run(conn: sqlite3.Connection) -> int:
            removed = 0
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                removed += conn.execute(ack_sql(len(chunk)), chunk).rowcount
                conn.execute(ack_lease_sql(len(chunk)), chunk)
            return removed

        if not ids:
            return 0
        return await self._run("ack", self._db.transaction(run))

    async def trim(self, before: int) -> int:
        def run(conn: sqlite3.Connection) -> int:
            removed = int(conn.execute(trim_sql(), (before,)).rowcount)
            conn.execute(trim_lease_sql())
            return removed

        return await self._run("trim", self._db.transaction(run))


def put_rows(conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> list[bool]:
    """Inserts ``rows`` (:func:`entry_row`) in the caller's write transaction, one ``executemany``
    skipping a request id that is there already; per row, False for such a re-delivery (or a
    request id the batch repeats), recorded in ``outbox_redelivery``. Only then are the rows the
    statement inserted told apart, by their ``seq`` past the table's largest before it (a new
    row's ``seq`` is always larger: AUTOINCREMENT)."""
    top = conn.execute(last_seq_sql()).fetchone()[0]
    if insert_rows(conn, put_sql(), rows) == len(rows):
        return [True] * len(rows)
    inserted = {r[0] for r in conn.execute(inserted_sql(), (top,))}
    answers: list[bool] = []
    again: list[tuple[Any, ...]] = []
    for r in rows:
        new = r[0] in inserted
        answers.append(new)
        if new:
            inserted.discard(r[0])  # a repeat later in the batch is a re-delivery
        else:
            again.append((r[0], r[5], r[6], r[7]))
    conn.executemany(redelivery_sql(), again)
    return answers
