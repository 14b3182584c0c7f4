"""The SQL of the embedded timer store (:mod:`wowd.stores.embedded.timers`): pure builders of
the statements it sends, the column layout of its rows and their codecs."""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Iterable, Sequence
from functools import lru_cache
from itertools import islice
from typing import Any, TypeVar

from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    AggregateRef,
    Claim,
    OnceRule,
    Rule,
    Timer,
    TimerChange,
    TimerStatus,
    deterministic_timer_id,
    parse_rule,
    request_id_for,
    validate_name,
)
from wowd.stores.base import TimerSearch
from wowd.stores.embedded.db import (
    NOW_MS,
    power_of_two,
)
from wowd.stores.embedded.outbox import target_json

log = logging.getLogger("wowd.stores.embedded.timers")

T = TypeVar("T")

FORMAT = 6
"""The layout version recorded in the registry."""
UPGRADES_FROM = 5
"""The format ``prepare`` upgrades in place: the same table without tombstones."""

TOMBSTONES = "('DONE', 'CANCELLED')"
"""The statuses of a tombstone row (SQL list)."""
STUCK = "('PARKED', 'FAILED')"
"""The statuses an operator repairs (SQL list): the partial index ``__stuck`` lists them."""
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
# the positions of COLUMNS in a row read (a row of the due reads has its rowid last: C_ROWID)
(
    C_TIMER_ID,
    C_PARTITION,
    C_AGGREGATE,
    C_OWNER_TENANT,
    C_OWNER_ID,
    C_KEY,
    C_VERSION,
    C_STATUS,
    C_DUE_AT,
    C_SCHEDULED_AT,
    C_TARGET_CONTEXT,
    C_TARGET_AGGREGATE,
    C_TARGET_TENANT,
    C_TARGET_ID,
    C_BODY,
    C_RULE,
    C_ATTEMPTS,
    C_FIRED,
    C_CLAIM_OWNER_KEY,
    C_CLAIM_FENCE,
    C_CLAIM_UNTIL,
    C_LAST_ERROR,
    C_REVISION,
) = range(len(COLUMNS))
C_ROWID = -1
_COLS = ", ".join(f'"{c}"' for c in COLUMNS)
_KEY = '"partition" = ? AND aggregate = ? AND owner_tenant = ? AND owner_id = ? AND "key" = ?'
_OWNER = '"partition" = ? AND aggregate = ? AND owner_tenant = ? AND owner_id = ?'


# --------------------------------------------------------------------------- pure SQL builders


def table_name(context: str) -> str:
    """The context's timers table (every aggregate type's timers, by column ``aggregate``)."""
    return f"wow_timer__{validate_name(context, field='context')}"


def shadow_table_name(context: str) -> str:
    """The table a rebuild of the context's timer view fills beside the live one (``wowd timers
    rebuild``), then renames in its place."""
    return f"{table_name(context)}__rebuild"


def ddl_sql(context: str) -> list[str]:
    """The statements that create the registry, the timers table and its indexes."""
    t = table_name(context)
    return [
        f"CREATE TABLE IF NOT EXISTS {REGISTRY} ("
        " collection TEXT PRIMARY KEY, context TEXT NOT NULL, aggregate TEXT,"
        " format INTEGER NOT NULL, created_at INTEGER NOT NULL)",
        table_sql(t),
        *index_sql(context),
    ]


def table_sql(t: str) -> str:
    """The ``CREATE TABLE`` of a timers table named ``t`` (its unique key; no other index)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {t} ("
        ' timer_id TEXT NOT NULL, "partition" INTEGER NOT NULL, aggregate TEXT NOT NULL,'
        ' owner_tenant TEXT NOT NULL, owner_id TEXT NOT NULL, "key" TEXT NOT NULL,'
        " version INTEGER NOT NULL, status TEXT NOT NULL, due_at INTEGER NOT NULL,"
        " scheduled_at INTEGER NOT NULL, target_context TEXT NOT NULL, target_aggregate TEXT NOT NULL,"
        " target_tenant TEXT NOT NULL, target_id TEXT NOT NULL, body TEXT NOT NULL, rule TEXT NOT NULL,"
        " attempts INTEGER NOT NULL, fired INTEGER NOT NULL, claim_owner_key TEXT, claim_fence INTEGER,"
        " claim_until INTEGER, last_error TEXT, revision INTEGER NOT NULL,"
        ' UNIQUE ("partition", aggregate, owner_tenant, owner_id, "key"))'
    )


def index_sql(context: str) -> list[str]:
    """The ``CREATE INDEX`` statements of the context's timers table."""
    t = table_name(context)
    return [
        f'CREATE INDEX IF NOT EXISTS {t}__due ON {t} ("partition", due_at, timer_id)'
        " WHERE status IN ('PENDING', 'FIRING')",
        f"CREATE INDEX IF NOT EXISTS {t}__parked ON {t}"
        " (target_id, target_aggregate, target_tenant, target_context) WHERE status = 'PARKED'",
        f"CREATE INDEX IF NOT EXISTS {t}__tombstones ON {t} (due_at) WHERE status IN {TOMBSTONES}",
        f"CREATE INDEX IF NOT EXISTS {t}__stuck ON {t} (status, due_at, timer_id) WHERE status IN {STUCK}",
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


def put_sql(context: str, table: str | None = None) -> str:
    """The conditional upsert of ``put``: replaces a stored timer or tombstone of an earlier
    version (bumping its revision so that a change made against the old one is skipped); the
    same or a later version stored changes nothing. ``table``: another table than the
    context's (as the write builders below take it)."""
    t = table or table_name(context)
    placeholders = ", ".join("?" for _ in COLUMNS)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in COLUMNS if c != "revision")
    return (
        f"INSERT INTO {t} ({_COLS}) VALUES ({placeholders})"
        f' ON CONFLICT ("partition", aggregate, owner_tenant, owner_id, "key") DO UPDATE SET {updates},'
        f" revision = MAX({t}.revision + 1, excluded.revision)"
        f" WHERE {t}.version < excluded.version"
    )


def live_at_sql(context: str, table: str | None = None) -> str:
    """Whether the key holds a live timer at exactly a version (a put that changed nothing)."""
    return f"SELECT 1 FROM {table or table_name(context)} WHERE {_KEY} AND version = ? AND {_LIVE}"


def cancel_sql(context: str, table: str | None = None) -> str:
    """A live timer at or below the version becomes a CANCELLED tombstone at that version."""
    return (
        f"UPDATE {table or table_name(context)} SET status = 'CANCELLED', version = ?1, due_at = {NOW_MS},"
        f" {_NO_CLAIM}, revision = revision + 1"
        f' WHERE "partition" = ?2 AND aggregate = ?3 AND owner_tenant = ?4 AND owner_id = ?5 AND "key" = ?6'
        f" AND version <= ?1 AND {_LIVE}"
    )


def tombstone_sql(context: str, table: str | None = None) -> str:
    """A CANCELLED tombstone for a key with no timer, or raising an earlier tombstone's version
    (parameters as ``COLUMNS``; ``due_at`` is replaced by the store's now)."""
    t = table or table_name(context)
    placeholders = ", ".join(f"{NOW_MS}" if c == "due_at" else "?" for c in COLUMNS)
    return (
        f"INSERT INTO {t} ({_COLS}) VALUES ({placeholders})"
        f' ON CONFLICT ("partition", aggregate, owner_tenant, owner_id, "key") DO UPDATE SET'
        f" status = 'CANCELLED', version = excluded.version, due_at = excluded.due_at,"
        f" revision = {t}.revision + 1"
        f" WHERE {t}.status IN {TOMBSTONES} AND {t}.version < excluded.version"
    )


def cancel_all_sql(context: str, table: str | None = None) -> str:
    """Every live timer of an owner at or below the version becomes a CANCELLED tombstone."""
    return (
        f"UPDATE {table or table_name(context)} SET status = 'CANCELLED', version = ?1, due_at = {NOW_MS},"
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
    in the transaction that read it: the columns :func:`settle_sql` of that kind writes."""
    return (
        f"UPDATE {table_name(context)} SET {_SETTLE_SET[kind]}, revision = revision + 1"
        " WHERE rowid = ? AND revision = ?"
    )


def _report_failed(failed: Iterable[tuple[Sequence[Any], str]]) -> None:
    """Counts and logs the rows (``COLUMNS`` order) a claim or a fire set FAILED, with why."""
    for r, reason in failed:
        TIMERS_FAILED.labels(target=f"{r[C_TARGET_CONTEXT]}.{r[C_TARGET_AGGREGATE]}").inc()
        log.error(
            "timer %s of %s %s/%s (partition %d) set FAILED: %s",
            r[C_KEY],
            r[C_AGGREGATE],
            r[C_OWNER_TENANT],
            r[C_OWNER_ID],
            r[C_PARTITION],
            reason,
        )


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


def search_statements(
    context: str, query: TimerSearch, partitions: int, owner_keys: Sequence[tuple[Any, ...]], limit: int
) -> list[tuple[str, list[Any]]]:
    """The statements of ``search``, each in ``(due_at, timer_id)`` order over an index, merged
    by the caller: one per owner (``owner_keys``, over the unique index's owner prefix), else one
    per partition for PENDING and FIRING timers (the due index) and one for PARKED and FAILED
    timers (the ``__stuck`` index); the filters of ``query`` on each."""
    statuses = query.statuses()
    common: list[str] = []
    params: list[Any] = []
    if query.key is not None:
        common.append('"key" = ?')
        params.append(query.key)
    if query.target is not None:
        common.append("target_id = ? AND target_aggregate = ? AND target_tenant = ? AND target_context = ?")
        tg = query.target
        params += [tg.id, tg.aggregate, tg.tenant_id, tg.context]
    if query.due_from is not None:
        common.append("due_at >= ?")
        params.append(query.due_from)
    if query.due_until is not None:
        common.append("due_at <= ?")
        params.append(query.due_until)
    if query.after is not None:
        common.append("due_at >= ? AND (due_at, timer_id) > (?, ?)")
        params += [query.after[0], query.after[0], query.after[1]]
    marks = ", ".join("?" for _ in statuses)
    values = [s.value for s in statuses]
    head = f"SELECT {_COLS} FROM {table_name(context)} WHERE "
    tail = " ORDER BY due_at, timer_id LIMIT ?"

    def statement(first: list[str], first_params: list[Any]) -> tuple[str, list[Any]]:
        return head + " AND ".join([*first, *common]) + tail, [*first_params, *params, limit]

    if owner_keys:
        return [statement([_OWNER, f"status IN ({marks})"], [*key, *values]) for key in owner_keys]
    out: list[tuple[str, list[Any]]] = []
    due = [s for s in values if s in ("PENDING", "FIRING")]
    stuck = [s for s in values if s in ("PARKED", "FAILED")]
    if due:
        # the IN term is the due index's WHERE: SQLite reads the index only when the query repeats it
        narrow = ["status = ?"] if len(due) == 1 else []
        for p in range(partitions):
            out.append(
                statement(
                    ['"partition" = ?', "status IN ('PENDING', 'FIRING')", *narrow], [p, *due[:1]] if narrow else [p]
                )
            )
    if stuck:
        narrow = ["status = ?"] if len(stuck) == 1 else []
        out.append(statement([f"status IN {STUCK}", *narrow], stuck[:1] if narrow else []))
    return out


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
        request_id_for(r[C_TIMER_ID], r[C_SCHEDULED_AT]),
        r[C_TIMER_ID],
        target_json(r[C_TARGET_CONTEXT], r[C_TARGET_AGGREGATE], r[C_TARGET_TENANT], r[C_TARGET_ID]),
        r[C_BODY],
        r[C_SCHEDULED_AT],
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
