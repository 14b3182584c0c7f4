"""The timers table of one context on SQLite (docs/concepts.md): its rows and their codec, and the
base of the three timer stores (:mod:`~wowd.stores.embedded.timer_view`,
:mod:`~wowd.stores.embedded.timer_firing`, :mod:`~wowd.stores.embedded.timer_queries`).

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
  indexes and invisible to every read; the view's sweep
  (:meth:`~wowd.stores.embedded.timer_view.EmbeddedTimerView.sweep`) deletes them after the
  retention. Format 5 (no tombstones, otherwise the same) is upgraded in place by ``prepare``.

The rule is kept as its JSON text (``{type, ...}``), the claim as flat columns. Every write is
one statement or one short ``BEGIN IMMEDIATE`` transaction (``settle``), its rows written by
statements of many rows each (:func:`~wowd.stores.embedded.db.insert_rows`,
:func:`~wowd.stores.embedded.db.update_rows`): no per-row calls on the hot path (due, claim,
fired, settle).
"""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from wowd.errors import InvalidInput
from wowd.model import (
    AggregateRef,
    Claim,
    OnceRule,
    Rule,
    Timer,
    TimerStatus,
    parse_rule,
    partition,
    validate_name,
)
from wowd.stores.embedded.db import (
    SqliteDatabase,
    SqliteStore,
)
from wowd.stores.embedded.schema import (
    TIMER_FORMAT,
    TOMBSTONES,
    timer_ddl,
    timer_format_sql,
    timer_formats_sql,
    timer_register_sql,
    timer_table,
    timer_upgrade_sql,
)
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.formats import other_format

log = logging.getLogger("wowd.stores.embedded.timers")

T = TypeVar("T")


LIVE = f"status NOT IN {TOMBSTONES}"
NO_CLAIM = "claim_owner_key = NULL, claim_fence = NULL, claim_until = NULL"


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
SELECTED = ", ".join(f'"{c}"' for c in COLUMNS)
KEY_MATCH = '"partition" = ? AND aggregate = ? AND owner_tenant = ? AND owner_id = ? AND "key" = ?'
OWNER_MATCH = '"partition" = ? AND aggregate = ? AND owner_tenant = ? AND owner_id = ?'


# --------------------------------------------------------------------------- pure SQL builders


def due_key(row: Sequence[Any]) -> tuple[Any, Any]:
    return (row[8], row[0])


def merge_due(cursors: Sequence[Iterable[Sequence[Any]]], limit: int) -> list[Sequence[Any]]:
    """The first ``limit`` rows of per-partition row streams sorted by ``(due_at, timer_id)``."""
    return list(islice(heapq.merge(*cursors, key=due_key), limit))


# --------------------------------------------------------------------------- row mapping


@lru_cache(maxsize=1024)
def rule_json(rule: Rule) -> str:
    return json.dumps(rule.to_doc(), separators=(",", ":"), sort_keys=True)


@lru_cache(maxsize=1024)
def _rule_from_json(text: str) -> Rule:
    return parse_rule(json.loads(text))


ONCE_JSON = rule_json(OnceRule())
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
        rule_json(timer.rule),
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


def claimed_from_row(context: str, r: Sequence[Any], claim: Claim) -> Timer:
    """The timer of a row (``COLUMNS`` order) as :func:`claim_rowid_sql` leaves it: exactly
    ``TimerChange.claim(timer_from_row(context, r), ...).applied()``."""
    return _timer(context, r, claim)


# --------------------------------------------------------------------------- the store


class TimerTable(SqliteStore):
    """A store of the context's timers table (the base of the three timer stores: the view the
    feed writes, firing, the operators' reads): the context's and the partitions' checks, the
    table made sure of at first use (or by :meth:`prepare`), each aggregate type's collection
    recorded in the registry at its first put, a format other than
    :data:`~wowd.stores.embedded.schema.TIMER_FORMAT` refused.

    ``db_or_path``: a :class:`~wowd.stores.embedded.db.SqliteDatabase` the caller owns (the
    backend gives the three stores one), or a path this store opens (and closes in
    :meth:`close`)."""

    STORE = "timers"

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str, partitions: int) -> None:
        self.context = validate_name(context, field="context")
        if partitions < 1:
            raise InvalidInput(f"must be >= 1, got {partitions}", field="partitions")
        self.partitions = partitions
        super().__init__(db_or_path)
        self._prepared = False
        self._known: set[str] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._db.path!r}, context={self.context!r})"

    def collection_name(self, aggregate: str) -> str:
        return f"wow_timer__{self.context}__{validate_name(aggregate, field='aggregate')}"

    async def prepare(self) -> None:
        if not self._prepared:
            await self._run("prepare", self._db.transaction(self._prepare_sync))
            self._prepared = True

    def _prepare_sync(self, conn: sqlite3.Connection) -> None:
        for stmt in timer_ddl(self.context):
            conn.execute(stmt)
        conn.execute(timer_upgrade_sql(), (self.context,))
        conn.execute(timer_register_sql(), (timer_table(self.context), self.context, None))
        for collection, fmt in conn.execute(timer_formats_sql(), (self.context,)):
            if fmt != TIMER_FORMAT:
                raise other_format(f"timer collection {collection}", fmt, TIMER_FORMAT)

    async def _register(self, aggregate: str) -> None:
        """Records an aggregate type's collection on its first use; refuses another format."""
        await self.prepare()
        if aggregate in self._known:
            return
        name = self.collection_name(aggregate)

        def work(conn: sqlite3.Connection) -> int:
            conn.execute(timer_register_sql(), (name, self.context, aggregate))
            row = conn.execute(timer_format_sql(), (name,)).fetchone()
            return int(row[0])

        fmt = await self._run("prepare", work)
        if fmt != TIMER_FORMAT:
            raise other_format(f"timer collection {name}", fmt, TIMER_FORMAT)
        self._known.add(aggregate)

    def _owner_key(self, owner: AggregateRef) -> tuple[Any, ...]:
        self._check_owner(owner)
        return (partition(owner.id, self.partitions), owner.aggregate, owner.tenant_id, owner.id)

    def _check_owner(self, owner: AggregateRef) -> None:
        if owner.context != self.context:
            raise InvalidInput(f"owner {owner} is not of this store's context {self.context!r}", field="owner.context")

    def _check_timer(self, timer: Timer) -> None:
        self._check_owner(timer.owner)
        expected = partition(timer.owner.id, self.partitions)
        if timer.partition != expected:
            raise InvalidInput(
                f"{timer.partition} is not the owner's partition {expected} of {self.partitions}",
                field="partition",
            )

    async def record_types(self, aggregates: Iterable[str]) -> None:
        """Records the collections of the aggregate types ``aggregates`` not recorded yet (those
        whose timers :meth:`write_steps` is to put); refuses another format."""
        for aggregate in aggregates:
            if aggregate not in self._known:
                await self._register(aggregate)
        await self.prepare()

    async def _select(self, operation: str, sql: str, params: Sequence[Any]) -> list[Timer]:
        rows = await self._run(operation, lambda conn: conn.execute(sql, params).fetchall())
        ctx = self.context
        return [timer_from_row(ctx, r) for r in rows]

    async def _write(self, operation: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A write: ``fn`` in one write transaction (:meth:`SqliteDatabase.transaction`, which
        holds the file's write lock)."""
        return await self._run(operation, self._db.transaction(fn))
