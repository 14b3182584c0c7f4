"""The timers of one context on SQLite (docs/concepts.md).

Layout (format 6):

- ``wow_timer_aggregate``: the registry, one row per aggregate type's (virtual) collection
  ``wow_timer__<context>__<aggregate>`` with its ``format``; prepare records the context's own
  row. A row of another format is refused (:class:`FormatError`): the view is then dropped and
  rebuilt from the log by the daemon.
- ``wow_timer__<context>``: one table for every aggregate type of the context (column
  ``aggregate`` for the owner's type), unique on ``(partition, aggregate, owner_tenant, owner_id,
  key)``, with a partial index ``(partition, due_at, timer_id) WHERE status IN ('PENDING',
  'FIRING')`` for ``due``, a partial index over PARKED timers by target for ``parked`` and a
  partial index ``(due_at)`` over tombstones for their sweep.
- Tombstones: a fired one-shot timer (``DONE``), a cancelled one (``CANCELLED``) keeps its row with
  that status, the version it was ended at and ``due_at`` = when; a put at or below that version
  is refused, so replaying the log re-delivers nothing. They are outside the due and parked
  indexes and invisible to every read; :meth:`EmbeddedTimerStore.sweep` deletes them after the
  retention. Format 5 (no tombstones, otherwise the same) is upgraded in place by ``prepare``.

The rule is kept as its JSON text (``{type, ...}``), the claim as flat columns. Every write is
one statement or one short ``BEGIN IMMEDIATE`` transaction (``settle``), its rows written by
statements of many rows each (:func:`~wowd.stores.embedded.db.insert_rows`,
:func:`~wowd.stores.embedded.db.update_rows`): no per-row calls on the hot path (due, claim,
fired, settle).

The hot path (docs/architecture.md, "Timer loop"): ``due`` is one compound statement per up to
:data:`DUE_ARMS` partitions (one arm per partition over the partial index; SQLite merges the arms
in ``(due_at, timer_id)`` order and stops at the limit), and :meth:`EmbeddedTimerStore.claim_due`
reads and claims a batch in one write transaction (the claim by ``rowid``), answering the
timers as claimed. ``next_due`` (the timer loop's sleep) is one compound statement of a
``MIN(due_at)`` per partition over the same partial index. Rows are decoded into
:class:`Timer` objects without re-validating what the store wrote itself.

The fast path into the outbox table of the same file (:meth:`EmbeddedTimerStore.fire_into_outbox`,
the ``outbox`` gateway's on the embedded backend): the due read of ``claim_due``, the outbox rows
and the fired settle of each timer by ``rowid`` in one write transaction, with no claim: nothing
can move between the read and the settle, and a crash leaves all of it or none. A feed batch's
transaction fires the same way the due one-shot timers it puts
(:meth:`EmbeddedTimerStore.write_firing`), each written once, as the DONE tombstone a fire leaves.

The SQL each method sends is built by the pure ``*_sql`` functions next to it.
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import time
from collections.abc import Callable, Collection, Generator, Iterable, Mapping, Sequence
from contextlib import closing
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from wowd.errors import FormatError, InvalidInput, LeaseLost, StorageError
from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    AggregateRef,
    Claim,
    OnceRule,
    Rule,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
    deterministic_timer_id,
    parse_rule,
    partition,
    request_id_for,
    validate_name,
)
from wowd.stores.base import FiredTimer, FireRequest, LogCheck
from wowd.stores.embedded.db import (
    NOW_MS,
    SqliteDatabase,
    SqliteStore,
    insert_rows,
    json_rows,
    merged_read,
    padded,
    power_of_two,
    update_rows,
)
from wowd.stores.embedded.outbox import SCHEMA as OUTBOX_SCHEMA
from wowd.stores.embedded.outbox import put_rows, target_json
from wowd.stores.embedded.sqlite import sqlite3, variable_limit

__all__ = [
    "DUE_ARMS",
    "FORMAT",
    "REGISTRY",
    "EmbeddedTimerStore",
    "next_due_sql",
    "parked_params",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

FORMAT = 6
"""The layout version recorded in the registry."""
UPGRADES_FROM = 5
"""The format ``prepare`` upgrades in place: the same table without tombstones."""

TOMBSTONES = "('DONE', 'CANCELLED')"
"""The statuses of a tombstone row (SQL list)."""
_LIVE = f"status NOT IN {TOMBSTONES}"
_NO_CLAIM = "claim_owner_key = NULL, claim_fence = NULL, claim_until = NULL"

REGISTRY = "wow_timer_aggregate"

COLUMNS = (
    "timer_id",
    "partition",
    "aggregate",
    "owner_tenant",
    "owner_id",
    "key",
    "version",
    "status",
    "due_at",
    "scheduled_at",
    "target_context",
    "target_aggregate",
    "target_tenant",
    "target_id",
    "body",
    "rule",
    "attempts",
    "fired",
    "claim_owner_key",
    "claim_fence",
    "claim_until",
    "last_error",
    "revision",
)
_COLS = ", ".join(f'"{c}"' for c in COLUMNS)
_KEY = '"partition" = ? AND aggregate = ? AND owner_tenant = ? AND owner_id = ? AND "key" = ?'
_OWNER = '"partition" = ? AND aggregate = ? AND owner_tenant = ? AND owner_id = ?'


# --------------------------------------------------------------------------- pure SQL builders


def table_name(context: str) -> str:
    """The context's timers table (every aggregate type's timers, by column ``aggregate``)."""
    return f"wow_timer__{validate_name(context, field='context')}"


def ddl_sql(context: str) -> list[str]:
    """The statements that create the registry, the timers table and its indexes."""
    t = table_name(context)
    return [
        f"CREATE TABLE IF NOT EXISTS {REGISTRY} ("
        " collection TEXT PRIMARY KEY, context TEXT NOT NULL, aggregate TEXT,"
        " format INTEGER NOT NULL, created_at INTEGER NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {t} ("
        ' timer_id TEXT NOT NULL, "partition" INTEGER NOT NULL, aggregate TEXT NOT NULL,'
        ' owner_tenant TEXT NOT NULL, owner_id TEXT NOT NULL, "key" TEXT NOT NULL,'
        " version INTEGER NOT NULL, status TEXT NOT NULL, due_at INTEGER NOT NULL,"
        " scheduled_at INTEGER NOT NULL, target_context TEXT NOT NULL, target_aggregate TEXT NOT NULL,"
        " target_tenant TEXT NOT NULL, target_id TEXT NOT NULL, body TEXT NOT NULL, rule TEXT NOT NULL,"
        " attempts INTEGER NOT NULL, fired INTEGER NOT NULL, claim_owner_key TEXT, claim_fence INTEGER,"
        " claim_until INTEGER, last_error TEXT, revision INTEGER NOT NULL,"
        ' UNIQUE ("partition", aggregate, owner_tenant, owner_id, "key"))',
        f'CREATE INDEX IF NOT EXISTS {t}__due ON {t} ("partition", due_at, timer_id)'
        " WHERE status IN ('PENDING', 'FIRING')",
        f"CREATE INDEX IF NOT EXISTS {t}__parked ON {t}"
        " (target_id, target_aggregate, target_tenant, target_context) WHERE status = 'PARKED'",
        f"CREATE INDEX IF NOT EXISTS {t}__tombstones ON {t} (due_at) WHERE status IN {TOMBSTONES}",
    ]


def upgrade_sql() -> str:
    """Records format 6 over the context's format-5 collections (``prepare``, after the DDL)."""
    return f"UPDATE {REGISTRY} SET format = {FORMAT} WHERE context = ? AND format = {UPGRADES_FROM}"


def format_sql() -> str:
    """The format recorded for one collection."""
    return f"SELECT format FROM {REGISTRY} WHERE collection = ?"


def register_sql() -> str:
    """Records a collection in the registry at format 5 unless recorded already."""
    return (
        f"INSERT INTO {REGISTRY} (collection, context, aggregate, format, created_at)"
        f" VALUES (?, ?, ?, {FORMAT}, {NOW_MS}) ON CONFLICT (collection) DO NOTHING"
    )


def registry_formats_sql() -> str:
    """The recorded format of each of a context's collections."""
    return f"SELECT collection, format FROM {REGISTRY} WHERE context = ?"


def put_sql(context: str) -> str:
    """The conditional upsert of ``put``: replaces a stored timer or tombstone of an earlier
    version (bumping its revision so that a change made against the old one is skipped); the
    same or a later version stored changes nothing."""
    t = table_name(context)
    placeholders = ", ".join("?" for _ in COLUMNS)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in COLUMNS if c != "revision")
    return (
        f"INSERT INTO {t} ({_COLS}) VALUES ({placeholders})"
        f' ON CONFLICT ("partition", aggregate, owner_tenant, owner_id, "key") DO UPDATE SET {updates},'
        f" revision = MAX({t}.revision + 1, excluded.revision)"
        f" WHERE {t}.version < excluded.version"
    )


def live_at_sql(context: str) -> str:
    """Whether the key holds a live timer at exactly a version (a put that changed nothing)."""
    return f"SELECT 1 FROM {table_name(context)} WHERE {_KEY} AND version = ? AND {_LIVE}"


def cancel_sql(context: str) -> str:
    """A live timer at or below the version becomes a CANCELLED tombstone at that version."""
    return (
        f"UPDATE {table_name(context)} SET status = 'CANCELLED', version = ?1, due_at = {NOW_MS},"
        f" {_NO_CLAIM}, revision = revision + 1"
        f' WHERE "partition" = ?2 AND aggregate = ?3 AND owner_tenant = ?4 AND owner_id = ?5 AND "key" = ?6'
        f" AND version <= ?1 AND {_LIVE}"
    )


def tombstone_sql(context: str) -> str:
    """A CANCELLED tombstone for a key with no timer, or raising an earlier tombstone's version
    (parameters as ``COLUMNS``; ``due_at`` is replaced by the store's now)."""
    t = table_name(context)
    placeholders = ", ".join(f"{NOW_MS}" if c == "due_at" else "?" for c in COLUMNS)
    return (
        f"INSERT INTO {t} ({_COLS}) VALUES ({placeholders})"
        f' ON CONFLICT ("partition", aggregate, owner_tenant, owner_id, "key") DO UPDATE SET'
        f" status = 'CANCELLED', version = excluded.version, due_at = excluded.due_at,"
        f" revision = {t}.revision + 1"
        f" WHERE {t}.status IN {TOMBSTONES} AND {t}.version < excluded.version"
    )


def cancel_all_sql(context: str) -> str:
    """Every live timer of an owner at or below the version becomes a CANCELLED tombstone."""
    return (
        f"UPDATE {table_name(context)} SET status = 'CANCELLED', version = ?1, due_at = {NOW_MS},"
        f" {_NO_CLAIM}, revision = revision + 1"
        f' WHERE "partition" = ?2 AND aggregate = ?3 AND owner_tenant = ?4 AND owner_id = ?5'
        f" AND version <= ?1 AND {_LIVE}"
    )


def sweep_sql(context: str) -> str:
    """Deletes up to ``?2`` tombstones made before ``?1`` (over the tombstones' partial index)."""
    t = table_name(context)
    return (
        f"DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE status IN {TOMBSTONES}"
        " AND due_at < ?1 ORDER BY due_at LIMIT ?2)"
    )


def reclaim_sql(context: str, partitions: int) -> str:
    """A previous holder's claims (fence below ``?1``) of some partitions back to PENDING."""
    marks = ", ".join(f"?{i + 2}" for i in range(partitions))
    return (
        f"UPDATE {table_name(context)} SET status = 'PENDING', due_at = scheduled_at, {_NO_CLAIM},"
        " last_error = 'claim of a previous holder (fence ' || claim_fence || ') ended by a takeover',"
        f" revision = revision + 1"
        # (the IN term lets SQLite read the due index, whose WHERE it implies)
        f" WHERE \"partition\" IN ({marks}) AND status IN ('PENDING', 'FIRING') AND status = 'FIRING'"
        " AND claim_fence < ?1"
    )


def fail_rowid_sql(context: str) -> str:
    """A stored timer that cannot be decoded: FAILED with the reason, by ``rowid`` at its revision."""
    return (
        f"UPDATE {table_name(context)} SET status = 'FAILED', {_NO_CLAIM}, last_error = ?1,"
        " revision = revision + 1 WHERE rowid = ?2 AND revision = ?3"
    )


def find_sql(context: str) -> str:
    return f"SELECT {_COLS} FROM {table_name(context)} WHERE {_KEY} AND {_LIVE}"


def parked_sql(context: str) -> str:
    return (
        f"SELECT {_COLS} FROM {table_name(context)} WHERE status = 'PARKED'"
        " AND target_id = ? AND target_aggregate = ? AND target_tenant = ? AND target_context = ?"
        " ORDER BY due_at, timer_id"
    )


PARKED_TARGET = ("target_id", "target_aggregate", "target_tenant", "target_context")
"""A target's columns in the parked index's order (the parameters of one target, in order)."""


def parked_many_sql(context: str, targets: int) -> str:
    """The PARKED timers of ``targets`` targets (:data:`PARKED_TARGET` parameters each): a
    ``VALUES`` list of the targets ``CROSS JOIN``ed to the table (SQLite keeps that loop order),
    so each target is one search of the parked index (its partial filter and its four keys).
    (A row value ``IN (VALUES ...)`` is planned as a scan of the whole index instead.)"""
    rows = ", ".join(["(?, ?, ?, ?)"] * targets)
    on = " AND ".join(f"t.{c} = k.column{i}" for i, c in enumerate(PARKED_TARGET, start=1))
    cols = ", ".join(f't."{c}"' for c in COLUMNS)
    return (
        f"SELECT {cols} FROM (VALUES {rows}) AS k CROSS JOIN {table_name(context)} AS t"
        f" ON t.status = 'PARKED' AND {on} ORDER BY t.due_at, t.timer_id"
    )


_SETTLE_SET = {
    "claim": "status = 'FIRING', due_at = ?, claim_owner_key = ?, claim_fence = ?, claim_until = ?",
    "fired": f"status = 'PENDING', due_at = ?, scheduled_at = ?, attempts = 0, fired = fired + 1, {_NO_CLAIM},"
    " last_error = NULL",
    "retry": f"status = 'PENDING', due_at = ?, attempts = attempts + 1, {_NO_CLAIM}, last_error = ?",
    "release": f"status = 'PENDING', due_at = ?, {_NO_CLAIM}, last_error = ?",
    "park": f"status = 'PARKED', due_at = COALESCE(?, due_at), {_NO_CLAIM}, last_error = ?",
    "resume": f"status = 'PENDING', due_at = ?, attempts = 0, {_NO_CLAIM}",
    "fail": f"status = 'FAILED', {_NO_CLAIM}, last_error = ?",
    "done": f"status = 'DONE', due_at = {NOW_MS}, {_NO_CLAIM}",
}
"""What each :class:`TimerChange` kind writes: exactly the columns its ``applied()`` changes
(revision + 1 in every case), over the row as loaded; ``done`` is a fired timer with no next
occurrence (``applied()`` is None: it leaves the view as a DONE tombstone)."""


def settle_sql(context: str, kind: str) -> str:
    """The statement of one change kind, filtered on the timer as loaded (its key,
    ``timer_id`` and ``revision``)."""
    t = table_name(context)
    where = f"WHERE {_KEY} AND timer_id = ? AND revision = ?"
    return f"UPDATE {t} SET {_SETTLE_SET[kind]}, revision = revision + 1 {where}"


def due_sql(context: str) -> str:
    """One partition's due timers (``partition``, ``until``) in ``(due_at, timer_id)`` order, read
    over the partial index ``(partition, due_at, timer_id)``; ``due`` merges these, stepping
    each lazily, so it reads about ``limit`` index entries plus one per partition."""
    return (
        f'SELECT {_COLS} FROM {table_name(context)} WHERE "partition" = ?'
        " AND status IN ('PENDING', 'FIRING') AND due_at <= ? ORDER BY due_at, timer_id"
    )


def parked_params(targets: Sequence[AggregateRef]) -> list[tuple[Any, ...]]:
    """The parameters of :func:`parked_many_sql` for ``targets`` (each once)."""
    return [(t.id, t.aggregate, t.tenant_id, t.context) for t in dict.fromkeys(targets)]


def _due_key(row: Sequence[Any]) -> tuple[Any, Any]:
    return (row[8], row[0])


def merge_due(cursors: Sequence[Iterable[Sequence[Any]]], limit: int) -> list[Sequence[Any]]:
    """The first ``limit`` rows of per-partition row streams sorted by ``(due_at, timer_id)``."""
    return list(islice(heapq.merge(*cursors, key=_due_key), limit))


WRITE_CHUNK = 2000
"""Timer writes per transaction of :meth:`EmbeddedTimerStore.write`."""

DUE_ARMS = 64
"""Partitions read by one compound ``due`` statement; more are read in several, merged here."""


def statement_limit(limit: int) -> int:
    """The ``LIMIT`` written in a due read for a caller that needs ``limit`` rows: the next power
    of two, so that a few statement texts (each prepared once per connection) serve every limit,
    the readers stopping at what they need."""
    return power_of_two(limit)


@lru_cache(maxsize=64)
def due_union_sql(context: str, arms: int, limit: int, *, rowid: bool = False) -> str:
    """The due timers of ``arms`` partitions in ``(due_at, timer_id)`` order, at most ``limit``:
    one arm per partition (as :func:`due_sql`, over the partial index), ``UNION ALL``, ordered
    and limited as a whole. SQLite runs an ``ORDER BY`` on a compound select as a merge of its
    arms, each read in index order, and stops at the ``LIMIT``: about ``limit`` index entries
    plus one per partition are read, however many timers are due or stored. The limit is written
    in the statement, as in :func:`~wowd.stores.embedded.log.read_sql` (a bound one makes SQLite
    3.47 and later prepare the statement again at every run).

    Parameters: ``?1`` the ``until`` bound, ``?2 .. ?(arms + 1)`` the partitions. With ``rowid``
    each row ends with the row's ``rowid`` (column ``rid``)."""
    if arms < 1:
        raise ValueError("arms must be >= 1")
    cols = f"{_COLS}, rowid AS rid" if rowid else _COLS
    t = table_name(context)
    arm = f"SELECT {cols} FROM {t} WHERE \"partition\" = ?{{}} AND status IN ('PENDING', 'FIRING') AND due_at <= ?1"
    union = " UNION ALL ".join(arm.format(i + 2) for i in range(arms))
    return f"{union} ORDER BY due_at, timer_id LIMIT {int(limit)}"


ROWID_COLUMNS = (*(f'"{c}"' for c in COLUMNS), "rid")
"""The columns of :func:`due_union_sql`'s rows with their ``rowid``."""


@lru_cache(maxsize=64)
def next_due_sql(context: str, arms: int) -> str:
    """The earliest ``due_at`` above ``?1`` of the PENDING and FIRING timers of ``arms``
    partitions (``?2 .. ?(arms + 1)``), NULL when there is none: one arm per partition, each a
    ``MIN(due_at)`` with an equality on ``partition`` and a range on ``due_at`` over the partial
    index ``(partition, due_at, timer_id)``, which SQLite answers with one index seek (its min/max
    optimisation), then the least of the arms. About one index entry read per partition (each
    with its row, for the ``status`` term the partial index implies), however many are stored."""
    if arms < 1:
        raise ValueError("arms must be >= 1")
    t = table_name(context)
    arm = (
        f'SELECT MIN(due_at) AS m FROM {t} WHERE "partition" = ?{{}}'
        " AND status IN ('PENDING', 'FIRING') AND due_at > ?1"
    )
    union = " UNION ALL ".join(arm.format(i + 2) for i in range(arms))
    return f"SELECT MIN(m) FROM ({union})"


def claim_rowid_sql(context: str) -> str:
    """The claim of ``claim_due``, one row by ``rowid`` (``?4``) at its loaded revision (``?5``):
    FIRING, ``due_at = claim_until = ?1``, owner key ``?2``, fence ``?3``, revision + 1 (as
    :func:`settle_sql` ``claim`` writes); run in the transaction that read the row, for many rows
    at once by :func:`~wowd.stores.embedded.db.update_rows`."""
    return (
        f"UPDATE {table_name(context)} SET status = 'FIRING', due_at = ?1, claim_owner_key = ?2,"
        " claim_fence = ?3, claim_until = ?1, revision = revision + 1 WHERE rowid = ?4 AND revision = ?5"
    )


def fired_rowid_sql(context: str, kind: str) -> str:
    """The settle of a fired timer (``kind`` ``fired``: ``?1`` and ``?2`` its next occurrence;
    ``done``: a DONE tombstone) by ``rowid`` at its revision as read (the last two parameters),
    in the transaction that read it (``fire_into_outbox``): the columns :func:`settle_sql` of
    that kind writes."""
    return (
        f"UPDATE {table_name(context)} SET {_SETTLE_SET[kind]}, revision = revision + 1"
        " WHERE rowid = ? AND revision = ?"
    )


CHECKPOINT_SEQS_SQL = (
    "SELECT partition, json_extract(position, '$.seq') FROM log_checkpoint WHERE context = ? AND consumer = ?"
)
"""The log position (``seq``) of each partition's checkpoint of a consumer."""
LAST_COMMIT_SQL = (
    "SELECT seq FROM log WHERE context = ? AND aggregate = ? AND tenant_id = ? AND aggregate_id = ?"
    " ORDER BY version DESC LIMIT 1"
)
"""The position of an aggregate's last commit: one seek of index ``log_version`` (an aggregate's
versions are appended in order, so its last version is its last commit)."""


def _committed_past(conn: sqlite3.Connection, owner: tuple[str, str, str, str], seq: int) -> bool:
    """Whether the log holds a commit of ``owner`` (context, aggregate, tenant, id) past ``seq``:
    its last commit, one seek of :data:`LAST_COMMIT_SQL`."""
    last = conn.execute(LAST_COMMIT_SQL, owner).fetchone()
    return last is not None and last[0] > seq


COMMITTED_PAST_CHUNK = 256
"""Owners asked about in one statement of :func:`committed_past_many`."""


@lru_cache(maxsize=16)
def committed_past_sql(rows: int) -> str:
    """Which of ``rows`` owners (context, aggregate, tenant, id, seq: five parameters each) the
    log holds a commit of past their ``seq``: per owner, its last commit (one seek of index
    ``log_version``, as :data:`LAST_COMMIT_SQL`); answers the owners' row numbers (from 0)."""
    values = ", ".join(f"({i}, ?, ?, ?, ?, ?)" for i in range(rows))
    return (
        f"WITH o(i, c, a, t, d, s) AS (VALUES {values})"
        " SELECT o.i FROM o WHERE (SELECT seq FROM log WHERE context = o.c AND aggregate = o.a"
        " AND tenant_id = o.t AND aggregate_id = o.d ORDER BY version DESC LIMIT 1) > o.s"
    )


def committed_past_many(conn: sqlite3.Connection, owners: Sequence[tuple[str, str, str, str, int]]) -> set[int]:
    """:func:`_committed_past` of many owners ((context, aggregate, tenant, id, seq) each) in a few
    statements: the indexes in ``owners`` of those the log holds a commit of past their ``seq``.
    A statement asks about a power of two of owners (the last padded with repeats of its last
    owner), so that a few statement texts, each prepared once per connection, serve any count."""
    past: set[int] = set()
    for start in range(0, len(owners), COMMITTED_PAST_CHUNK):
        chunk = owners[start : start + COMMITTED_PAST_CHUNK]
        rows = power_of_two(len(chunk))
        params = [v for owner in padded(chunk, rows) for v in owner]
        past.update(start + i for (i,) in conn.execute(committed_past_sql(rows), params) if i < len(chunk))
    return past


def _report_failed(failed: Iterable[tuple[Sequence[Any], str]]) -> None:
    """Counts and logs the rows (``COLUMNS`` order) a claim or a fire set FAILED, with why."""
    for r, reason in failed:
        TIMERS_FAILED.labels(aggregate=r[2]).inc()
        log.error("timer %s of %s %s/%s (partition %d) set FAILED: %s", r[5], r[2], r[3], r[4], r[1], reason)


class _LogChecker:
    """A :class:`LogCheck` in the transaction that takes due rows: whether the log may have
    changed a row's timer since the feed's checkpoint, i.e. whether its aggregate's last commit
    is past the checkpoint of its partition (one index seek per row due after the watermark; the
    checkpoints are read once, when the first row needs them)."""

    __slots__ = ("_check", "_checkpoints", "_conn", "_context")

    def __init__(self, conn: sqlite3.Connection, context: str, check: LogCheck) -> None:
        self._conn = conn
        self._context = context
        self._check = check
        self._checkpoints: dict[int, int] | None = None

    def stale(self, r: Sequence[Any]) -> bool:
        """Whether the row (``COLUMNS`` order) is left for the feed (counted in ``skipped``)."""
        if r[8] <= self._check.watermark:
            return False
        if self._checkpoints is None:
            rows = self._conn.execute(CHECKPOINT_SEQS_SQL, (self._context, self._check.consumer)).fetchall()
            self._checkpoints = {p: int(seq) for p, seq in rows if seq is not None}
        if not _committed_past(self._conn, (self._context, r[2], r[3], r[4]), self._checkpoints.get(r[1], 0)):
            return False
        self._check.skipped += 1
        return True


def due_plan(partitions: Iterable[int], arms: int = DUE_ARMS) -> list[tuple[int, ...]]:
    """The partitions, sorted, in groups of at most ``arms``: one compound statement each."""
    parts = sorted(partitions)
    return [tuple(parts[i : i + arms]) for i in range(0, len(parts), arms)]


def scan_sql(context: str, *, status: bool, partitions: int | None) -> str:
    where = []
    if status:
        where.append("status = ?")
    if partitions is not None:
        where.append('"partition" IN (' + ", ".join("?" for _ in range(partitions)) + ")")
    where.append(_LIVE)
    clause = " WHERE " + " AND ".join(where)
    return f"SELECT {_COLS} FROM {table_name(context)}{clause} ORDER BY due_at, timer_id LIMIT ?"


# --------------------------------------------------------------------------- row mapping


@lru_cache(maxsize=1024)
def _rule_json(rule: Rule) -> str:
    return json.dumps(rule.to_doc(), separators=(",", ":"), sort_keys=True)


@lru_cache(maxsize=1024)
def _rule_from_json(text: str) -> Rule:
    return parse_rule(json.loads(text))


_ONCE_JSON = _rule_json(OnceRule())
"""The rule text of a one-shot timer as this store writes it."""


def _listed_rule(text: str) -> Rule:
    """The rule of a row for the reads that list timers: one this version cannot decode (a
    FAILED timer, see ``claim_due``) reads as a one-shot rule, its text kept in the row."""
    try:
        return _rule_from_json(text)
    except Exception:
        return OnceRule()


def timer_params(timer: Timer) -> tuple[Any, ...]:
    """A timer as the row ``COLUMNS`` describes."""
    c = timer.claim
    o = timer.owner
    g = timer.target
    return (
        timer.timer_id,
        timer.partition,
        o.aggregate,
        o.tenant_id,
        o.id,
        timer.key,
        timer.version,
        timer.status.value,
        timer.due_at,
        timer.scheduled_at,
        g.context,
        g.aggregate,
        g.tenant_id,
        g.id,
        timer.body,
        _rule_json(timer.rule),
        timer.attempts,
        timer.fired,
        c.owner_key if c else None,
        c.fence if c else None,
        c.until if c else None,
        timer.last_error,
        timer.revision,
    )


_STATUS = {s.value: s for s in TimerStatus}
_new = object.__new__
_VALID_TYPES: set[tuple[str, str]] = set()
"""(context, aggregate) pairs that passed :func:`validate_name` (refs read back are rebuilt
without validating the same names again: the hot path reads thousands per second)."""


_REF_SLOTS = tuple(getattr(AggregateRef, name).__set__ for name in ("context", "aggregate", "tenant_id", "id"))
_set_context, _set_aggregate, _set_tenant, _set_id = _REF_SLOTS


def _ref(context: str, aggregate: str, tenant_id: str, id: str) -> AggregateRef:
    """An :class:`AggregateRef` read from a row; the names are validated once per pair (its
    ``__post_init__`` runs then), later refs of the pair get their slots set directly."""
    if (context, aggregate) not in _VALID_TYPES or not tenant_id or id.__class__ is not str:
        ref = AggregateRef(context=context, aggregate=aggregate, tenant_id=tenant_id, id=id)
        _VALID_TYPES.add((context, aggregate))
        return ref
    ref = _new(AggregateRef)
    _set_context(ref, context)
    _set_aggregate(ref, aggregate)
    _set_tenant(ref, tenant_id)
    _set_id(ref, id)
    return ref


def _timer(context: str, r: Sequence[Any], claimed: Claim | None, *, strict: bool = False) -> Timer:
    """The timer of a row in ``COLUMNS`` order (a trailing ``rowid`` aside); with ``claimed``, as
    :func:`claim_rowid_sql` leaves it (FIRING under that claim, due at its expiry, revision + 1).
    A rule this version cannot decode raises when ``claimed`` or ``strict``, else reads as a
    one-shot rule (listing reads)."""
    (
        timer_id,
        part,
        aggregate,
        owner_tenant,
        owner_id,
        key,
        version,
        status,
        due_at,
        scheduled_at,
        target_context,
        target_aggregate,
        target_tenant,
        target_id,
        body,
        rule,
        attempts,
        fired,
        claim_owner_key,
        claim_fence,
        claim_until,
        last_error,
        revision,
        *_rowid,
    ) = r
    claim: Claim | None = None
    if claimed is None:
        if claim_owner_key is not None:
            claim = Claim(owner_key=claim_owner_key, fence=claim_fence, until=claim_until)
        decoded, state = (_rule_from_json(rule) if strict else _listed_rule(rule)), _STATUS[status]
    else:
        claim, due_at, revision = claimed, claimed.until, revision + 1
        decoded, state = _rule_from_json(rule), TimerStatus.FIRING
    return Timer(
        timer_id=timer_id,
        partition=part,
        owner=_ref(context, aggregate, owner_tenant, owner_id),
        key=key,
        version=version,
        due_at=due_at,
        scheduled_at=scheduled_at,
        target=_ref(target_context, target_aggregate, target_tenant, target_id),
        body=body,
        rule=decoded,
        status=state,
        attempts=attempts,
        fired=fired,
        claim=claim,
        last_error=last_error,
        revision=revision,
    )


def timer_from_row(context: str, r: Sequence[Any]) -> Timer:
    """The timer of a row in ``COLUMNS`` order."""
    return _timer(context, r, None)


def fired_from_row(context: str, r: Sequence[Any]) -> Timer:
    """The timer of a row (``COLUMNS`` order) as stored, to fire: its rule decoded or raising."""
    return _timer(context, r, None, strict=True)


def outbox_row(r: Sequence[Any], fence: int, owner_key: str, created_at: int) -> tuple[Any, ...]:
    """The outbox row (``wowd.stores.embedded.outbox.entry_row``) of the entry the ``outbox``
    gateway makes of the timer of row ``r`` (``COLUMNS`` order), written under ``fence`` and
    ``owner_key`` at ``created_at``: its request id, id, target, command and scheduled time."""
    return (
        request_id_for(r[0], r[9]),
        r[0],
        target_json(r[10], r[11], r[12], r[13]),
        r[14],
        r[9],
        fence,
        owner_key,
        created_at,
    )


def claimed_from_row(context: str, r: Sequence[Any], claim: Claim) -> Timer:
    """The timer of a row (``COLUMNS`` order) as :func:`claim_rowid_sql` leaves it: exactly
    ``TimerChange.claim(timer_from_row(context, r), ...).applied()``."""
    return _timer(context, r, claim)


def settle_params(change: TimerChange) -> tuple[str, tuple[Any, ...]]:
    """``(statement kind, params)`` of one change for :func:`settle_sql`: the values its kind
    sets (as ``applied()`` computes them) followed by the row as loaded."""
    t = change.timer
    o = t.owner
    loaded = (t.partition, o.aggregate, o.tenant_id, o.id, t.key, t.timer_id, t.revision)
    kind = change.kind
    if kind == "claim":
        return kind, (change.due_at, change.owner_key, change.fence, change.due_at, *loaded)
    if kind == "fired":
        if change.next_due is None:
            return "done", loaded
        return kind, (change.next_due, change.next_due, *loaded)
    if kind in ("retry", "release"):
        return kind, (change.due_at, change.error, *loaded)
    if kind == "resume":
        return kind, (change.due_at, *loaded)
    if kind == "park":
        return kind, (change.due_at, change.error, *loaded)
    return kind, (change.error, *loaded)  # fail


def _tombstone_params(owner: AggregateRef, part: int, key: str, version: int) -> tuple[Any, ...]:
    """A CANCELLED tombstone of a key that holds no timer: the row ``COLUMNS`` describes, less
    ``due_at`` (the store's now, see :func:`tombstone_sql`)."""
    return (
        deterministic_timer_id(owner, key, version),
        part,
        owner.aggregate,
        owner.tenant_id,
        owner.id,
        key,
        version,
        "CANCELLED",
        0,
        owner.context,
        owner.aggregate,
        owner.tenant_id,
        owner.id,
        "",
        _rule_json(OnceRule()),
        0,
        0,
        None,
        None,
        None,
        None,
        0,
    )


# --------------------------------------------------------------------------- the store


class EmbeddedTimerStore(SqliteStore):
    """:class:`~wowd.stores.base.TimerStore` on SQLite.

    ``db_or_path``: a :class:`SqliteDatabase` the caller owns, or a path this store opens (and
    closes in :meth:`close`). The tables are created on first use (or by :meth:`prepare`).
    """

    STORE = "timers"

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str, partitions: int) -> None:
        self.context = validate_name(context, field="context")
        if partitions < 1:
            raise InvalidInput(f"must be >= 1, got {partitions}", field="partitions")
        self.partitions = partitions
        super().__init__(db_or_path)
        self._prepared = False
        self._known: set[str] = set()
        t = context
        self._put_sql = put_sql(t)
        self._settle_sql = {k: settle_sql(t, k) for k in _SETTLE_SET}
        self._claim_sql = claim_rowid_sql(t)
        self._fired_sql = {k: fired_rowid_sql(t, k) for k in ("fired", "done")}
        self._outbox_ready = False
        self._write_sql = {
            "put": put_sql(t),
            "live_at": live_at_sql(t),
            "cancel": cancel_sql(t),
            "tombstone": tombstone_sql(t),
            "cancel_all": cancel_all_sql(t),
        }

    def __repr__(self) -> str:
        return f"EmbeddedTimerStore({self._db.path!r}, context={self.context!r})"

    def collection_name(self, aggregate: str) -> str:
        return f"wow_timer__{self.context}__{validate_name(aggregate, field='aggregate')}"

    # ---- DDL

    async def prepare(self) -> None:
        if not self._prepared:
            await self._run("prepare", self._db.transaction(self._prepare_sync))
            self._prepared = True

    def _prepare_sync(self, conn: sqlite3.Connection) -> None:
        for stmt in ddl_sql(self.context):
            conn.execute(stmt)
        conn.execute(upgrade_sql(), (self.context,))
        conn.execute(register_sql(), (table_name(self.context), self.context, None))
        for collection, fmt in conn.execute(registry_formats_sql(), (self.context,)):
            if fmt != FORMAT:
                raise FormatError(
                    f"timer collection {collection} is recorded in format {fmt}, this store writes {FORMAT}"
                )

    async def _register(self, aggregate: str) -> None:
        """Records an aggregate type's collection on its first use; refuses another format."""
        await self.prepare()
        if aggregate in self._known:
            return
        name = self.collection_name(aggregate)

        def work(conn: sqlite3.Connection) -> int:
            conn.execute(register_sql(), (name, self.context, aggregate))
            row = conn.execute(format_sql(), (name,)).fetchone()
            return int(row[0])

        fmt = await self._run("prepare", work)
        if fmt != FORMAT:
            raise FormatError(f"timer collection {name} is recorded in format {fmt}, this store writes {FORMAT}")
        self._known.add(aggregate)

    # ---- validation

    def _owner_key(self, owner: AggregateRef) -> tuple[Any, ...]:
        self._check_owner(owner)
        return (partition(owner.id, self.partitions), owner.aggregate, owner.tenant_id, owner.id)

    def _check_owner(self, owner: AggregateRef) -> None:
        if owner.context != self.context:
            raise InvalidInput(f"owner {owner} is not of this store's context {self.context!r}", field="owner.context")

    # ---- writes

    def _check_timer(self, timer: Timer) -> None:
        self._check_owner(timer.owner)
        expected = partition(timer.owner.id, self.partitions)
        if timer.partition != expected:
            raise InvalidInput(
                f"{timer.partition} is not the owner's partition {expected} of {self.partitions}",
                field="partition",
            )

    async def put(self, timer: Timer) -> bool:
        return bool((await self.write([TimerWrite.put(timer)]))[0])

    async def cancel(self, owner: AggregateRef, key: str, version: int) -> bool:
        return bool((await self.write([TimerWrite.cancel(owner, key, version)]))[0])

    async def cancel_all(self, owner: AggregateRef, version: int) -> int:
        return (await self.write([TimerWrite.cancel_all(owner, version)]))[0]

    async def write(self, writes: Sequence[TimerWrite]) -> list[int]:
        if not writes:
            return []
        steps = await self.plan_write(writes)
        # a transaction per chunk: the file's write lock is not held for a long batch (a lease
        # renewal waits for it); the writes commute, so a batch applied in parts is the same
        answers: list[int] = []
        for k in range(0, len(steps), WRITE_CHUNK):
            chunk = steps[k : k + WRITE_CHUNK]
            answers += await self._write("write", functools.partial(self.write_steps, chunk))
        return answers

    async def plan_write(self, writes: Sequence[TimerWrite]) -> list[tuple[str, tuple[Any, ...]]]:
        """``writes`` checked and made ready for :meth:`write_steps` (an aggregate type's
        collection recorded on its first use)."""
        steps: list[tuple[str, tuple[Any, ...]]] = []
        for w in writes:
            if w.kind == "put":
                assert w.timer is not None
                self._check_timer(w.timer)
                if w.owner.aggregate not in self._known:
                    await self._register(w.owner.aggregate)
                steps.append(("put", timer_params(w.timer)))
            elif w.kind == "cancel":
                steps.append(("cancel", (w.version, *self._owner_key(w.owner), w.key)))
            else:
                steps.append(("cancel_all", (w.version, *self._owner_key(w.owner))))
        await self.prepare()
        return steps

    def write_steps(self, steps: Sequence[tuple[str, tuple[Any, ...]]], conn: sqlite3.Connection) -> list[int]:
        """The writes of :meth:`plan_write` in the caller's transaction on ``conn``, in order;
        each one's answer as :meth:`write` gives it."""
        sql = self._write_sql
        ctx = self.context

        def one(kind: str, params: tuple[Any, ...]) -> int:
            if kind == "put":
                if conn.execute(sql["put"], params).rowcount == 1:
                    return 1
                # the same version stored live: changes nothing, admitted
                return 1 if conn.execute(sql["live_at"], (*params[1:6], params[6])).fetchone() else 0
            if kind == "cancel":
                n = int(conn.execute(sql["cancel"], params).rowcount)
                if n == 0:
                    version, part, agg, tenant, oid, key = params
                    owner = AggregateRef(context=ctx, aggregate=agg, tenant_id=tenant, id=oid)
                    conn.execute(sql["tombstone"], _tombstone_params(owner, part, key, version))
                return n
            return int(conn.execute(sql["cancel_all"], params).rowcount)

        out: list[int] = []
        i = 0
        while i < len(steps):
            kind = steps[i][0]
            j = i
            while j < len(steps) and steps[j][0] == kind:
                j += 1
            if kind == "put" and j - i > 1:
                # a run of puts in few statements (insert_rows); when one of them changed nothing (a
                # replay), the run is answered one by one (a repeat of a put is harmless)
                if insert_rows(conn, sql["put"], [p for _k, p in steps[i:j]]) == j - i:
                    out += [1] * (j - i)
                else:
                    out += [one(kind, p) for _k, p in steps[i:j]]
            else:
                out += [one(kind, p) for _k, p in steps[i:j]]
            i = j
        return out

    def write_firing(
        self,
        writes: Sequence[TimerWrite],
        steps: Sequence[tuple[str, tuple[Any, ...]]],
        seqs: Mapping[int, int],
        conn: sqlite3.Connection,
        *,
        fence: int,
        owner_key: str,
        created_at: int,
        limit: int,
    ) -> tuple[list[int], list[FiredTimer]]:
        """:meth:`write_steps` of ``writes`` (planned as ``steps``) in the caller's (a feed
        batch's) transaction on ``conn``, firing into the outbox the one-shot timers they put
        that are due by ``created_at`` and that no later commit can cancel, at most ``limit``:
        those whose aggregate has no commit in the log past ``seqs`` (the position the batch
        applied, per partition; :func:`committed_past_many`). Such a put is written as the DONE
        tombstone a fire leaves (at ``created_at``) with its outbox entry under ``fence`` and
        ``owner_key``, as :meth:`fire_into_outbox` fires it; one that changes nothing (the same
        or a later version is stored) fires nothing. Every other timer is left to the timer
        loop. Answers each write's answer and the timers fired. The fired puts go in few
        statements (:func:`~wowd.stores.embedded.db.insert_rows`, in a savepoint: when one of
        them changed nothing, they are written again one by one).

        The fired puts are written after the other steps: a batch holds at most one write per
        key (:func:`~wowd.model.net_writes`), and a ``cancel_all`` of the batch is at a version
        below every put of its owner that remains, so the order does not change the view."""
        candidates: list[tuple[int, int]] = []  # due one-shot puts: index in writes, owner's in asked
        owners: dict[AggregateRef, int] = {}
        asked: list[tuple[str, str, str, str, int]] = []
        for i, w in enumerate(writes):
            t = w.timer
            if w.kind != "put" or t is None or t.due_at > created_at or not isinstance(t.rule, OnceRule):
                continue
            o = t.owner
            n = owners.get(o)
            if n is None:
                n = owners[o] = len(asked)
                asked.append((o.context, o.aggregate, o.tenant_id, o.id, seqs.get(t.partition, 0)))
            candidates.append((i, n))
        # fired only where the batch applied the owner's last commit in the log
        past = committed_past_many(conn, asked) if asked else set()
        firing = [i for i, n in candidates if n not in past][:limit]
        if not firing:
            return self.write_steps(steps, conn), []
        chosen = set(firing)
        answers = self.write_steps([st for i, st in enumerate(steps) if i not in chosen], conn)
        put = self._write_sql["put"]
        fired: list[FiredTimer] = []
        rows: list[tuple[Any, ...]] = []
        out: dict[int, int] = {}
        # each row as a fire leaves it: a DONE tombstone since created_at
        done_rows = [(*steps[i][1][:7], "DONE", created_at, *steps[i][1][9:]) for i in firing]
        conn.execute("SAVEPOINT fire")
        every = insert_rows(conn, put, done_rows) == len(done_rows)
        if not every:  # some put changed nothing (a replay): the puts one by one, to tell which
            conn.execute("ROLLBACK TO fire")
        conn.execute("RELEASE fire")
        for i, done_params in zip(firing, done_rows, strict=True):
            t = writes[i].timer
            assert t is not None
            params = steps[i][1]
            if every or conn.execute(put, done_params).rowcount == 1:
                out[i] = 1
                fired.append(FiredTimer(t.timer_id, t.owner.aggregate, t.scheduled_at, None))
                rows.append(outbox_row(params, fence, owner_key, created_at))
            else:  # the same version stored live (admitted, changes nothing) or a tombstone
                out[i] = 1 if conn.execute(self._write_sql["live_at"], (*params[1:6], params[6])).fetchone() else 0
        if rows:
            put_rows(conn, rows)
        rest = iter(answers)
        return [out[i] if i in out else next(rest) for i in range(len(steps))], fired

    async def sweep(self, before: int, limit: int) -> int:
        await self.prepare()
        sql = sweep_sql(self.context)
        return await self._write("sweep", lambda conn: int(conn.execute(sql, (before, limit)).rowcount))

    async def reclaim(self, partitions: set[int] | frozenset[int], fence: int) -> int:
        if not partitions:
            return 0
        await self.prepare()
        parts = sorted(partitions)
        sql = reclaim_sql(self.context, len(parts))
        return await self._write("reclaim", lambda conn: int(conn.execute(sql, (fence, *parts)).rowcount))

    async def settle(self, changes: Sequence[TimerChange]) -> int:
        if not changes:
            return 0
        for ch in changes:
            if ch.timer.owner.context != self.context:
                self._check_owner(ch.timer.owner)
        await self.prepare()
        written: int = await self._write("settle", functools.partial(self.settle_changes, changes))
        if written < len(changes):
            log.debug("settle: %d of %d changes skipped (timer moved on)", len(changes) - written, len(changes))
        return written

    def settle_changes(self, changes: Sequence[TimerChange], conn: sqlite3.Connection) -> int:
        """``changes`` (of this store's context, each of another timer) in the caller's transaction
        on ``conn``: one :func:`~wowd.stores.embedded.db.update_rows` per change kind, kinds in the
        order they first appear; how many rows changed."""
        groups: dict[str, list[tuple[Any, ...]]] = {}
        for ch in changes:
            kind, params = settle_params(ch)
            groups.setdefault(kind, []).append(params)
        return sum(update_rows(conn, self._settle_sql[kind], rows) for kind, rows in groups.items())

    # ---- reads

    async def find(self, owner: AggregateRef, key: str) -> Timer | None:
        params = (*self._owner_key(owner), key)
        await self.prepare()
        sql = find_sql(self.context)
        row = await self._run("find", lambda conn: conn.execute(sql, params).fetchone())
        return timer_from_row(self.context, row) if row is not None else None

    async def parked(self, target: AggregateRef) -> list[Timer]:
        params = (target.id, target.aggregate, target.tenant_id, target.context)
        await self.prepare()
        return await self._select("parked", parked_sql(self.context), params)

    async def parked_many(self, targets: Sequence[AggregateRef]) -> list[Timer]:
        """One :func:`parked_many_sql` statement per as many targets as SQLite's variable limit
        allows (all of a feed batch's in one), read in one transaction."""
        params = parked_params(targets)
        if not params:
            return []
        await self.prepare()
        return await self._run("parked_many", functools.partial(self.parked_timers, params))

    def parked_timers(self, params: Sequence[tuple[Any, ...]], conn: sqlite3.Connection) -> list[Timer]:
        """The PARKED timers of the targets of :func:`parked_params`, in due order, on ``conn`` (in
        the caller's transaction, or in one of their own)."""
        return [timer_from_row(self.context, r) for r in self._parked_rows(params, conn)]

    def _parked_rows(self, params: Sequence[tuple[Any, ...]], conn: sqlite3.Connection) -> list[Sequence[Any]]:
        ctx = self.context
        per = max(1, variable_limit(conn) // len(PARKED_TARGET))
        chunks = [params[i : i + per] for i in range(0, len(params), per)]
        if len(chunks) == 1:
            return conn.execute(parked_many_sql(ctx, len(params)), [v for p in params for v in p]).fetchall()
        began = not conn.in_transaction
        if began:
            conn.execute("BEGIN")
        try:
            rows = [
                r
                for chunk in chunks
                for r in conn.execute(parked_many_sql(ctx, len(chunk)), [v for p in chunk for v in p])
            ]
        finally:
            if began:
                conn.execute("COMMIT")
        rows.sort(key=_due_key)
        return rows

    async def due(self, partitions: set[int] | frozenset[int], until: int, limit: int) -> list[Timer]:
        if not partitions or limit <= 0:
            return []
        await self.prepare()
        read = self._due_reader(partitions, until, limit, rowid=False)
        rows = await self._run("due", read)
        ctx = self.context
        return [timer_from_row(ctx, r) for r in rows]

    async def claim_due(
        self,
        partitions: set[int] | frozenset[int],
        until: int,
        limit: int,
        *,
        owner_key: str,
        fence: int,
        claim_until: int,
        exclude: Collection[str] = (),
    ) -> list[Timer]:
        """The due read and the claim of what it read in one write transaction: nothing can
        move between them, so every timer read is claimed (or, undecodable, failed)."""
        if not partitions or limit <= 0:
            return []
        await self.prepare()
        skip = frozenset(exclude)
        read = self._due_rows(partitions, until, limit + len(skip))
        claim = Claim(owner_key=owner_key, fence=fence, until=claim_until)
        claim_sql = self._claim_sql
        fail_sql = fail_rowid_sql(self.context)
        ctx = self.context
        failed: list[tuple[Sequence[Any], str]] = []

        def work(conn: sqlite3.Connection) -> list[Timer]:
            out: list[Timer] = []
            params: list[tuple[Any, ...]] = []
            undecodable: list[tuple[str, Any, Any]] = []
            with closing(read(conn)) as rows:
                for r in rows:
                    if r[0] in skip:
                        continue
                    if len(out) >= limit:
                        break
                    try:
                        t = claimed_from_row(ctx, r, claim)
                    except Exception as exc:  # a row this version cannot decode: FAILED, not a crash
                        reason = f"undecodable timer: {type(exc).__name__}: {exc}"
                        undecodable.append((reason, r[-1], r[22]))
                        failed.append((r, reason))
                        continue
                    out.append(t)
                    params.append((claim_until, owner_key, fence, r[-1], r[22]))
            if undecodable:
                conn.executemany(fail_sql, undecodable)
            if params:
                claimed = update_rows(conn, claim_sql, params)
                if claimed != len(params):  # cannot happen: the rows were read in this transaction
                    raise StorageError(f"claim_due: claimed {claimed} of the {len(params)} timers read")
            return out

        timers = await self._write("claim_due", work)
        _report_failed(failed)
        return timers

    async def fire_into_outbox(self, request: FireRequest) -> list[FiredTimer]:
        """:class:`~wowd.stores.base.OutboxFiring` into the ``outbox`` table of this store's file:
        the due read of ``claim_due`` (a claim another holder made is due only once expired),
        the outbox rows (:func:`outbox_row`, :func:`~wowd.stores.embedded.outbox.put_rows`: a
        request id in the outbox already, a re-fire, is recorded as a re-delivery) and the fired
        settle by ``rowid``, one :func:`~wowd.stores.embedded.db.update_rows` per kind
        (:func:`fired_rowid_sql`), in one ``BEGIN IMMEDIATE`` transaction. A one-shot timer is
        handled from its row alone; a recurring one is decoded for ``next_due``."""
        partitions, limit, check, at = request.partitions, request.limit, request.check, request.at
        fence, owner_key, deadline = request.fence, request.owner_key, request.deadline
        next_due = request.next_due
        if not partitions or limit <= 0:
            return []
        await self.prepare()
        await self.prepare_outbox()
        skip = frozenset(request.exclude)
        read = self._due_rows(partitions, request.due_by, limit + len(skip))
        fail_sql = fail_rowid_sql(self.context)
        done_sql, fired_sql = self._fired_sql["done"], self._fired_sql["fired"]
        ctx = self.context
        failed: list[tuple[Sequence[Any], str]] = []

        def work(conn: sqlite3.Connection) -> list[FiredTimer]:
            failed.clear()
            fired: list[FiredTimer] = []
            rows: list[tuple[Any, ...]] = []
            done: list[tuple[Any, ...]] = []
            moved: list[tuple[Any, ...]] = []
            undecodable: list[tuple[str, Any, Any]] = []
            if check is not None:
                check.skipped = 0  # a transaction run again (its store busy) counts anew
            checker = None if check is None else _LogChecker(conn, ctx, check)
            with closing(read(conn)) as due:
                for r in due:
                    if r[0] in skip:
                        continue
                    if len(fired) >= limit:
                        break
                    if checker is not None and checker.stale(r):
                        continue
                    nxt: int | None = None
                    if r[15] != _ONCE_JSON:
                        try:
                            nxt = next_due(fired_from_row(ctx, r), at)
                        except Exception as exc:  # a row this version cannot fire: FAILED, not a crash
                            reason = f"undecodable timer: {type(exc).__name__}: {exc}"
                            undecodable.append((reason, r[-1], r[22]))
                            failed.append((r, reason))
                            continue
                    fired.append(FiredTimer(r[0], r[2], r[9], nxt))
                    rows.append(outbox_row(r, fence, owner_key, at))
                    if nxt is None:
                        done.append((r[-1], r[22]))
                    else:
                        moved.append((nxt, nxt, r[-1], r[22]))
            if undecodable:
                conn.executemany(fail_sql, undecodable)
            if rows:
                put_rows(conn, rows)
                settled = update_rows(conn, done_sql, done) + update_rows(conn, fired_sql, moved)
                if settled != len(fired):  # cannot happen: the rows were read in this transaction
                    raise StorageError(f"fire_into_outbox: settled {settled} of the {len(fired)} timers read")
            if deadline is not None and time.monotonic() >= deadline:
                raise LeaseLost("lease no longer valid: the fired batch is rolled back")
            return fired

        fired = await self._write("fire_into_outbox", work)
        _report_failed(failed)
        return fired

    async def prepare_outbox(self) -> None:
        """Creates the outbox table of this file when missing (once; the outbox store's DDL)."""
        if not self._outbox_ready:

            def create(conn: sqlite3.Connection) -> None:
                for statement in OUTBOX_SCHEMA:
                    conn.execute(statement)

            await self._run("prepare", self._db.transaction(create))
            self._outbox_ready = True

    async def next_due(self, partitions: set[int] | frozenset[int], after: int) -> int | None:
        if not partitions:
            return None
        await self.prepare()
        statements = [(next_due_sql(self.context, len(g)), (after, *g)) for g in due_plan(partitions)]

        def read(conn: sqlite3.Connection) -> int | None:
            found = [row[0] for sql, params in statements for row in conn.execute(sql, params)]
            return min((x for x in found if x is not None), default=None)

        return await self._run("next_due", read)

    def _due_rows(
        self, partitions: Iterable[int], until: int, limit: int
    ) -> Callable[[sqlite3.Connection], Generator[Sequence[Any], None, None]]:
        """The due rows (with their ``rowid``) as :meth:`_due_reader` reads them, in the
        transaction the caller holds: each statement's rows read as one value (at most the
        written limit, ``limit`` rounded up), merged as they are consumed (a claim that skips its
        timers in flight stops once it has its batch)."""
        written = statement_limit(limit)
        statements = [
            (due_union_sql(self.context, len(group), written, rowid=True), (until, *group))
            for group in due_plan(partitions)
        ]

        def rows(conn: sqlite3.Connection) -> Generator[Sequence[Any], None, None]:
            batches = [json_rows(conn, sql, ROWID_COLUMNS, params) for sql, params in statements]
            if len(batches) == 1:
                yield from batches[0]
            else:
                yield from heapq.merge(*batches, key=_due_key)

        return rows

    def _due_reader(
        self, partitions: Iterable[int], until: int, limit: int, *, rowid: bool
    ) -> Callable[[sqlite3.Connection], list[Sequence[Any]]]:
        """Reads the due rows: one compound statement per group of :data:`DUE_ARMS` partitions;
        several groups are merged here, read in one transaction (one snapshot)."""
        ctx = self.context
        written = statement_limit(limit)
        statements = [
            (due_union_sql(ctx, len(group), written, rowid=rowid), (until, *group)) for group in due_plan(partitions)
        ]
        return merged_read(statements, merge_due, limit)

    async def scan(
        self, *, status: TimerStatus | None = None, limit: int = 100, partitions: set[int] | None = None
    ) -> list[Timer]:
        await self.prepare()
        params: list[Any] = []
        if status is not None:
            params.append(status.value)
        if partitions is not None:
            params += sorted(partitions)
        params.append(limit)
        sql = scan_sql(
            self.context, status=status is not None, partitions=None if partitions is None else len(partitions)
        )
        return await self._select("scan", sql, params)

    async def _select(self, operation: str, sql: str, params: Sequence[Any]) -> list[Timer]:
        rows = await self._run(operation, lambda conn: conn.execute(sql, params).fetchall())
        ctx = self.context
        return [timer_from_row(ctx, r) for r in rows]

    async def _write(self, operation: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A write: ``fn`` in one write transaction (:meth:`SqliteDatabase.transaction`, which
        holds the file's write lock)."""
        return await self._run(operation, self._db.transaction(fn))
