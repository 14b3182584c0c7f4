"""The quarantine of the log on SQLite (:class:`~wowd.stores.base.Quarantine`): the documents the
feed cannot read or apply, with the reason, in the log's file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from wowd.errors import InvalidInput
from wowd.model import (
    AggregateType,
)
from wowd.stores.base import dismissal
from wowd.stores.embedded.db import NOW_MS
from wowd.stores.embedded.schema import LogTables
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["EmbeddedQuarantine"]


def quarantine_sql() -> str:
    return (
        "INSERT INTO log_quarantine"
        " (context, consumer, partition, aggregate, raw, raw_hash, reason, created_at) "
        f"VALUES (?, ?, ?, ?, ?, ?, ?, {NOW_MS}) "
        "ON CONFLICT (context, consumer, aggregate, raw_hash) DO UPDATE SET reason = excluded.reason"
    )


QUARANTINE_COLUMNS = (
    "id",
    "created_at",
    "consumer",
    "partition",
    "aggregate",
    "raw",
    "reason",
    "dismissed_at",
    "dismissed_reason",
    "dismissed_by",
)


RELEASE_CHUNK = 500
"""Ids per statement of a release, a dismissal and an ``ids`` read (far
below SQLite's limit of bound parameters)."""


def quarantined_sql(*, after: bool, ids: int | None, dismissed: bool = False) -> str:
    """The quarantined items of a context in id order: after an id and/or among ``ids`` ids
    (dismissed or not); without ids, those not dismissed (``dismissed``: the dismissed ones)."""
    where = "context = ?" + (" AND id > ?" if after else "")
    if ids is not None:
        where += f" AND id IN ({', '.join('?' * ids)})"
    else:
        where += f" AND dismissed_at IS {'NOT ' if dismissed else ''}NULL"
    return f"SELECT {', '.join(QUARANTINE_COLUMNS)} FROM log_quarantine WHERE {where} ORDER BY id LIMIT ?"


def dismiss_sql(ids: int) -> str:
    """Marks the items among ``ids`` ids not dismissed yet as dismissed (reason, by)."""
    return (
        f"UPDATE log_quarantine SET dismissed_at = {NOW_MS}, dismissed_reason = ?, dismissed_by = ?"
        f" WHERE context = ? AND dismissed_at IS NULL AND id IN ({', '.join('?' * ids)})"
    )


def release_quarantined_sql(ids: int) -> str:
    return f"DELETE FROM log_quarantine WHERE context = ? AND id IN ({', '.join('?' * ids)})"


def _row_ids(ids: Collection[str]) -> list[int]:
    """The row ids among ``ids`` (a string that is not one, or beyond SQLite's integers, names
    nothing)."""
    out: set[int] = set()
    for i in ids:
        text = str(i).strip()
        if text.isascii() and text.isdigit() and len(text) <= 19 and int(text) < 2**63:
            out.add(int(text))
    return sorted(out)


def _canonical(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)


class EmbeddedQuarantine(LogTables):
    """:class:`~wowd.stores.base.Quarantine` in the table ``log_quarantine`` of the log's file:
    ``id`` (INTEGER PRIMARY KEY AUTOINCREMENT) names an item; unique per ``(context, consumer,
    aggregate, sha256 of the raw document's canonical JSON)`` (quarantining a document again
    replaces its reason)."""

    async def put(
        self, consumer: str, partition: int, aggregate: AggregateType, raw: Mapping[str, Any], reason: str
    ) -> None:
        text = _canonical(raw)
        digest = hashlib.sha256(text.encode()).hexdigest()
        params = (self.context, consumer, partition, aggregate.aggregate, text, digest, reason)
        await self._run("quarantine", lambda c: c.execute(quarantine_sql(), params))

    async def items(
        self,
        limit: int = 1000,
        after: str | None = None,
        *,
        ids: Collection[str] | None = None,
        dismissed: bool = False,
    ) -> list[dict[str, Any]]:
        if limit <= 0:
            return []
        after_ids = _row_ids([after]) if after is not None else []
        if after is not None and not after_ids:
            raise InvalidInput(f"is not a quarantine id of the embedded log: {after!r}", field="after")
        wanted = _row_ids(ids) if ids is not None else None

        def run(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            chunks = (
                [None]
                if wanted is None
                else [wanted[i : i + RELEASE_CHUNK] for i in range(0, len(wanted), RELEASE_CHUNK)]
            )
            rows: list[tuple[Any, ...]] = []
            for chunk in chunks:
                sql = quarantined_sql(
                    after=bool(after_ids), ids=None if chunk is None else len(chunk), dismissed=dismissed
                )
                params = (self.context, *after_ids, *(chunk or ()), limit)
                rows += conn.execute(sql, params).fetchall()
            rows.sort(key=lambda r: int(r[0]))
            return [
                {
                    "id": str(r[0]),
                    "created_at": r[1],
                    "consumer": r[2],
                    "partition": r[3],
                    "aggregate": r[4],
                    "raw": json.loads(r[5]),
                    "reason": r[6],
                    "dismissed": None if r[7] is None else {"at": r[7], "reason": r[8], "by": r[9]},
                }
                for r in rows[:limit]
            ]

        return await self._run("quarantined", run)

    async def dismiss(self, ids: Collection[str], reason: str, by: str) -> int:
        why, who = dismissal(reason, by)
        return await self._by_ids("dismiss_quarantined", ids, dismiss_sql, why, who, self.context)

    async def release(self, ids: Collection[str]) -> int:
        return await self._by_ids("release_quarantined", ids, release_quarantined_sql, self.context)

    async def _by_ids(self, name: str, ids: Collection[str], statement: Callable[[int], str], *head: Any) -> int:
        """``statement(n)`` over the row ids among ``ids``, :data:`RELEASE_CHUNK` at a time, its
        parameters ``head`` then a chunk's ids, in one transaction; the rows it changed."""
        wanted = _row_ids(ids)
        if not wanted:
            return 0

        def run(conn: sqlite3.Connection) -> int:
            changed = 0
            for i in range(0, len(wanted), RELEASE_CHUNK):
                chunk = wanted[i : i + RELEASE_CHUNK]
                changed += conn.execute(statement(len(chunk)), (*head, *chunk)).rowcount
            return changed

        return await self._run(name, self._db.transaction(run))
