"""The checkpoints of the log's consumers on SQLite (:class:`~wowd.stores.base.Checkpoints`): each
view's and rebuild's position per partition, fenced, in the log's file."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from wowd.model import (
    Checkpoint,
    Position,
)
from wowd.stores.base import consumers_of
from wowd.stores.embedded.db import NOW_MS
from wowd.stores.embedded.schema import LogTables
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["CHECKPOINT_SEQS_SQL", "EmbeddedCheckpoints", "save_checkpoint_rows"]


def save_checkpoint_sql() -> str:
    """One upsert, admitted over a stored checkpoint of the same or a lower fence."""
    return (
        "INSERT INTO log_checkpoint (context, consumer, partition, position, fence, written_at) "
        f"VALUES (?, ?, ?, ?, ?, {NOW_MS}) "
        "ON CONFLICT (context, consumer, partition) DO UPDATE SET position = excluded.position, "
        "fence = excluded.fence, written_at = excluded.written_at "
        "WHERE log_checkpoint.fence <= excluded.fence"
    )


_POSITION_JSON = json.JSONEncoder(separators=(",", ":"))
"""A checkpoint's position as stored (``json.dumps(position, separators=(",", ":"))``, without an
encoder made per call)."""


def save_checkpoints_sql() -> str:
    """:func:`save_checkpoint_sql` of several partitions in one statement. Parameters: context,
    consumer, fence, and a JSON array of ``[partition, position text]``."""
    return (
        "INSERT INTO log_checkpoint (context, consumer, partition, position, fence, written_at) "
        f"SELECT ?1, ?2, json_extract(j.value, '$[0]'), json_extract(j.value, '$[1]'), ?3, {NOW_MS}"
        " FROM json_each(?4) AS j WHERE true "
        "ON CONFLICT (context, consumer, partition) DO UPDATE SET position = excluded.position, "
        "fence = excluded.fence, written_at = excluded.written_at "
        "WHERE log_checkpoint.fence <= excluded.fence"
    )


def save_checkpoint_rows(rows: Sequence[tuple[Any, ...]], conn: sqlite3.Connection) -> int:
    """Saves the checkpoints of :meth:`EmbeddedLog.checkpoint_rows` (under one fence) on ``conn``
    (in the caller's transaction), one statement per consumer; how many were admitted (each one
    refused had a higher fence)."""
    if len(rows) == 1:
        return int(conn.execute(save_checkpoint_sql(), rows[0]).rowcount)
    if not rows:
        return 0
    before = conn.total_changes
    context, _consumer, _partition, _position, fence = rows[0]
    for consumer in dict.fromkeys(r[1] for r in rows):
        pairs = orjson.dumps([(r[2], r[3]) for r in rows if r[1] == consumer]).decode()
        conn.execute(save_checkpoints_sql(), (context, consumer, fence, pairs))
    return conn.total_changes - before


def checkpoints_sql(partitions: int) -> str:
    marks = ", ".join("?" * partitions)
    return (
        "SELECT partition, position, fence, written_at FROM log_checkpoint "
        f"WHERE context = ? AND consumer = ? AND partition IN ({marks})"
    )


CHECKPOINT_SEQS_SQL = (
    "SELECT partition, json_extract(position, '$.seq') FROM log_checkpoint WHERE context = ? AND consumer = ?"
)
"""The log position (``seq``) of each partition's checkpoint of a consumer."""


log = logging.getLogger(__name__)


class EmbeddedCheckpoints(LogTables):
    """:class:`~wowd.stores.base.Checkpoints` in the table ``log_checkpoint`` of the log's file:
    ``(context, consumer, partition)`` -> ``position`` (JSON), ``fence``, ``written_at``; a save is
    one upsert admitted only when the stored fence is <= the new one."""

    async def read(self, consumer: str, partitions: Sequence[int]) -> dict[int, Checkpoint]:
        parts = list(dict.fromkeys(partitions))
        if not parts:
            return {}
        params = (self.context, consumer, *parts)

        def run(conn: sqlite3.Connection) -> dict[int, Checkpoint]:
            return {
                r[0]: Checkpoint(
                    consumer=consumer, partition=r[0], position=json.loads(r[1]), fence=r[2], written_at=r[3]
                )
                for r in conn.execute(checkpoints_sql(len(parts)), params).fetchall()
            }

        return await self._run("checkpoints", run)

    async def save_all(self, consumer: str | Sequence[str], positions: Mapping[int, Position], fence: int) -> bool:
        if not positions:
            return True
        rows = self.checkpoint_rows(consumer, positions, fence)
        # holding the file's write lock: queued behind this process's other writers, not retried
        saved = await self._run("save_checkpoint", self._db.transaction(functools.partial(save_checkpoint_rows, rows)))
        if saved != len(rows):
            log.info("checkpoints of %s refused: a higher fence than %s wrote one of them", consumer, fence)
            return False
        return True

    def checkpoint_rows(
        self, consumer: str | Sequence[str], positions: Mapping[int, Position], fence: int
    ) -> list[tuple[Any, ...]]:
        """The parameters of :func:`save_checkpoint_rows` for ``positions`` of ``consumer`` (each
        of several) under ``fence``."""
        encoded = [(p, _POSITION_JSON.encode(pos)) for p, pos in sorted(positions.items())]
        return [(self.context, c, p, text, fence) for c in consumers_of(consumer) for p, text in encoded]

    async def save(self, consumer: str, partition: int, position: Position, fence: int) -> bool:
        (params,) = self.checkpoint_rows(consumer, {partition: position}, fence)
        saved = await self._run("save_checkpoint", lambda c: c.execute(save_checkpoint_sql(), params).rowcount)
        if not saved:
            log.info(
                "checkpoint of %s partition %s refused: a higher fence than %s wrote it",
                consumer,
                partition,
                fence,
            )
        return saved == 1
