"""The due timers on SQLite (:class:`~wowd.stores.base.TimerFiring`): the timer loop's reads,
claims and settles, and the outbox shortcut (:class:`~wowd.stores.base.OutboxShortcut`), each
statement built beside the call that sends it.
"""

from __future__ import annotations

import functools
import heapq
import time
from collections.abc import Callable, Collection, Generator, Iterable, Sequence
from contextlib import closing
from functools import lru_cache
from pathlib import Path
from typing import Any

from wowd.errors import LeaseLost, StorageError
from wowd.metrics import TIMERS_FAILED
from wowd.model import (
    Claim,
    Timer,
    TimerChange,
    misfire_reason,
    misfired,
    request_id_for,
)
from wowd.model.history import expiry
from wowd.stores.base import OUTBOX_SHORTCUT, FiredTimer, OutboxFired, OutboxRound
from wowd.stores.embedded.db import (
    NOW_MS,
    SqliteDatabase,
    json_rows,
    merged_read,
    power_of_two,
    update_rows,
)
from wowd.stores.embedded.history import attempt_row, write_records
from wowd.stores.embedded.log import committed_after
from wowd.stores.embedded.outbox import put_rows, target_json
from wowd.stores.embedded.schema import (
    OUTBOX_SCHEMA,
    TOMBSTONES,
    timer_table,
)
from wowd.stores.embedded.schema import history_ddl as history_schema
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.embedded.timer_rows import (
    C_AGGREGATE,
    C_BODY,
    C_DUE_AT,
    C_KEY,
    C_OWNER_ID,
    C_OWNER_TENANT,
    C_PARTITION,
    C_REVISION,
    C_ROWID,
    C_RULE,
    C_SCHEDULED_AT,
    C_TARGET_AGGREGATE,
    C_TARGET_CONTEXT,
    C_TARGET_ID,
    C_TARGET_TENANT,
    C_TIMER_ID,
    C_VERSION,
    COLUMNS,
    KEY_MATCH,
    NO_CLAIM,
    ONCE_JSON,
    SELECTED,
    TimerTable,
    claimed_from_row,
    due_key,
    fired_from_row,
    log,
    merge_due,
    timer_from_row,
)


def reclaim_sql(context: str, partitions: int) -> str:
    """A previous holder's claims (fence below ``?1``) of some partitions back to PENDING."""
    marks = ", ".join(f"?{i + 2}" for i in range(partitions))
    return (
        f"UPDATE {timer_table(context)} SET status = 'PENDING', due_at = scheduled_at, {NO_CLAIM},"
        " last_error = 'claim of a previous holder (fence ' || claim_fence || ') ended by a takeover',"
        f" revision = revision + 1"
        # (the IN term lets SQLite read the due index, whose WHERE it implies)
        f" WHERE \"partition\" IN ({marks}) AND status IN ('PENDING', 'FIRING') AND status = 'FIRING'"
        " AND claim_fence < ?1"
    )


def fail_rowid_sql(context: str) -> str:
    """A stored timer that cannot be decoded: FAILED with the reason, by ``rowid`` at its revision."""
    return (
        f"UPDATE {timer_table(context)} SET status = 'FAILED', {NO_CLAIM}, last_error = ?1,"
        " revision = revision + 1 WHERE rowid = ?2 AND revision = ?3"
    )


SETTLE_SET = {
    "claim": "status = 'FIRING', due_at = ?, claim_owner_key = ?, claim_fence = ?, claim_until = ?",
    "fired": f"status = 'PENDING', due_at = ?, scheduled_at = ?, attempts = 0, fired = fired + 1, {NO_CLAIM},"
    " last_error = NULL",
    "retry": f"status = 'PENDING', due_at = ?, attempts = attempts + 1, {NO_CLAIM}, last_error = ?",
    "release": f"status = 'PENDING', due_at = ?, {NO_CLAIM}, last_error = ?",
    "park": f"status = 'PARKED', due_at = COALESCE(?, due_at), {NO_CLAIM}, last_error = ?",
    "resume": f"status = 'PENDING', due_at = ?, attempts = 0, {NO_CLAIM}",
    "fail": f"status = 'FAILED', {NO_CLAIM}, last_error = ?",
    "done": f"status = 'DONE', due_at = {NOW_MS}, {NO_CLAIM}",
}
"""What each :class:`TimerChange` kind writes: exactly the columns its ``applied()`` changes
(revision + 1 in every case), over the row as loaded; ``done`` is a fired timer with no next
occurrence (``applied()`` is None: it leaves the view as a DONE tombstone)."""


def settle_sql(context: str, kind: str) -> str:
    """The statement of one change kind, filtered on the timer as loaded (its key,
    ``timer_id`` and ``revision``)."""
    t = timer_table(context)
    where = f"WHERE {KEY_MATCH} AND timer_id = ? AND revision = ?"
    return f"UPDATE {t} SET {SETTLE_SET[kind]}, revision = revision + 1 {where}"


def due_sql(context: str) -> str:
    """One partition's due timers (``partition``, ``until``) in ``(due_at, timer_id)`` order, read
    over the partial index ``(partition, due_at, timer_id)``; ``due`` merges these, stepping
    each lazily, so it reads about ``limit`` index entries plus one per partition."""
    return (
        f'SELECT {SELECTED} FROM {timer_table(context)} WHERE "partition" = ?'
        " AND status IN ('PENDING', 'FIRING') AND due_at <= ? ORDER BY due_at, timer_id"
    )


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
    cols = f"{SELECTED}, rowid AS rid" if rowid else SELECTED
    t = timer_table(context)
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
    t = timer_table(context)
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
        f"UPDATE {timer_table(context)} SET status = 'FIRING', due_at = ?1, claim_owner_key = ?2,"
        " claim_fence = ?3, claim_until = ?1, revision = revision + 1 WHERE rowid = ?4 AND revision = ?5"
    )


def fired_rowid_sql(context: str, kind: str) -> str:
    """The settle of a fired timer (``kind`` ``fired``: ``?1`` and ``?2`` its next occurrence;
    ``done``: a DONE tombstone) by ``rowid`` at its revision as read (the last two parameters),
    in the transaction that read it: the columns :func:`settle_sql` of that kind writes."""
    return (
        f"UPDATE {timer_table(context)} SET {SETTLE_SET[kind]}, revision = revision + 1"
        " WHERE rowid = ? AND revision = ?"
    )


def report_failed(failed: Iterable[tuple[Sequence[Any], str]]) -> None:
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


class EmbeddedTimerFiring(TimerTable):
    """:class:`~wowd.stores.base.TimerFiring` on SQLite, and the outbox shortcut
    (:class:`~wowd.stores.base.OutboxShortcut`) into the outbox table of the same file.

    ``due`` is one compound statement per up to :data:`DUE_ARMS` partitions (one arm per
    partition over the partial index; SQLite merges the arms in ``(due_at, timer_id)`` order and
    stops at the limit), and :meth:`claim_due` reads and claims a batch in one write transaction
    (the claim by ``rowid``), answering the timers as claimed. ``next_due`` (the timer loop's
    sleep) is one compound statement of a ``MIN(due_at)`` per partition over the same partial
    index. Rows are decoded into :class:`~wowd.model.Timer` objects without re-validating what
    the store wrote itself. :meth:`fire_into_outbox`: the due read of ``claim_due``, the fire
    rule's question to the log, the outbox rows and the fired settle of each timer by ``rowid``
    in one write transaction, with no claim: nothing can move between the read and the settle,
    and a crash leaves all of it or none."""

    CAPABILITIES = (OUTBOX_SHORTCUT,)
    """The outbox table and the log are in this store's file: a round fires into the outbox in
    the transaction that settles its timers (:meth:`fire_into_outbox`)."""

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str, partitions: int) -> None:
        super().__init__(db_or_path, context=context, partitions=partitions)
        self._settle_sql = {k: settle_sql(context, k) for k in SETTLE_SET}
        self._claim_sql = claim_rowid_sql(context)
        self._fired_sql = {k: fired_rowid_sql(context, k) for k in ("fired", "done")}
        self._outbox_ready = False
        self._history_ready = False

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
                    if r[C_TIMER_ID] in skip:
                        continue
                    if len(out) >= limit:
                        break
                    try:
                        t = claimed_from_row(ctx, r, claim)
                    except Exception as exc:  # a row this version cannot decode: FAILED, not a crash
                        reason = f"undecodable timer: {type(exc).__name__}: {exc}"
                        undecodable.append((reason, r[C_ROWID], r[C_REVISION]))
                        failed.append((r, reason))
                        continue
                    out.append(t)
                    params.append((claim_until, owner_key, fence, r[C_ROWID], r[C_REVISION]))
            if undecodable:
                conn.executemany(fail_sql, undecodable)
            if params:
                claimed = update_rows(conn, claim_sql, params)
                if claimed != len(params):  # cannot happen: the rows were read in this transaction
                    raise StorageError(f"claim_due: claimed {claimed} of the {len(params)} timers read")
            return out

        timers = await self._write("claim_due", work)
        report_failed(failed)
        return timers

    async def fire_into_outbox(self, round: OutboxRound) -> OutboxFired:
        """:class:`~wowd.stores.base.OutboxShortcut` into the ``outbox`` table of this store's
        file: the due read of ``claim_due`` (a claim another holder made is due only once
        expired), the fire rule's question to the log for the timers due after ``read_to``
        (:func:`~wowd.stores.embedded.log.committed_after`, the statement of
        :meth:`EmbeddedLog.committed_after`), the outbox rows (:func:`outbox_row`,
        :func:`~wowd.stores.embedded.outbox.put_rows`: a request id in the outbox already, a
        re-fire, is recorded as a re-delivery) and the fired settle by ``rowid``, one
        :func:`~wowd.stores.embedded.db.update_rows` per kind (:func:`fired_rowid_sql`), in one
        ``BEGIN IMMEDIATE`` transaction. A one-shot timer is handled from its row alone; a
        recurring one is decoded for ``next_due``."""
        partitions, limit, at, read_to = round.partitions, round.limit, round.at, round.read_to
        fence, owner_key, deadline = round.fence, round.owner_key, round.deadline
        next_due = round.next_due
        if not partitions or limit <= 0:
            return OutboxFired([])
        await self.prepare()
        await self.prepare_outbox()
        skip = frozenset(round.exclude)
        read = self._due_rows(partitions, at, limit + len(skip))
        fail_sql = fail_rowid_sql(self.context)
        done_sql, fired_sql = self._fired_sql["done"], self._fired_sql["fired"]
        ctx = self.context
        failed: list[tuple[Sequence[Any], str]] = []
        retention_ms = round.history_retention_ms
        if retention_ms is not None:
            await self.prepare_history()

        def work(conn: sqlite3.Connection) -> OutboxFired:
            failed.clear()
            fired: list[FiredTimer] = []
            history: list[tuple[Any, ...]] = []
            rows: list[tuple[Any, ...]] = []
            done: list[tuple[Any, ...]] = []
            moved: list[tuple[Any, ...]] = []
            undecodable: list[tuple[str, Any, Any]] = []
            with closing(read(conn)) as due:
                candidates = [r for r in due if r[C_TIMER_ID] not in skip]
            # due after read_to: fired only where the log holds no commit of the owner above the
            # timer's version (a cancel, a put or a delete the feed has not applied yet)
            asked = [
                (n, (ctx, r[C_AGGREGATE], r[C_OWNER_TENANT], r[C_OWNER_ID], r[C_VERSION]))
                for n, r in enumerate(candidates)
                if r[C_DUE_AT] > read_to
            ]
            held = committed_after(conn, [q for _, q in asked]) if asked else set()
            left = {asked[i][0] for i in held}
            for n, r in enumerate(candidates):
                if n in left:
                    continue
                if len(fired) >= limit:
                    break
                nxt: int | None = None
                late = False
                timer: Timer | None = None
                if r[C_RULE] != ONCE_JSON:
                    try:
                        timer = fired_from_row(ctx, r)
                        nxt = next_due(timer, at)
                        late = misfired(timer.rule, timer.scheduled_at, at)
                    except Exception as exc:  # a row this version cannot fire: FAILED, not a crash
                        reason = f"undecodable timer: {type(exc).__name__}: {exc}"
                        undecodable.append((reason, r[C_ROWID], r[C_REVISION]))
                        failed.append((r, reason))
                        continue
                target = f"{r[C_TARGET_CONTEXT]}.{r[C_TARGET_AGGREGATE]}"
                if late:  # past its misfire grace: settled, not delivered
                    fired.append(FiredTimer(r[C_TIMER_ID], target, r[C_SCHEDULED_AT], nxt, True, timer))
                    if retention_ms is not None:
                        assert timer is not None
                        why = misfire_reason(timer.rule, timer.scheduled_at, at)
                        rid = request_id_for(r[C_TIMER_ID], r[C_SCHEDULED_AT])
                        history.append(attempt_row(r, rid, at, expiry(at, retention_ms), "misfired", why))
                else:
                    fired.append(FiredTimer(r[C_TIMER_ID], target, r[C_SCHEDULED_AT], nxt))
                    row = outbox_row(r, fence, owner_key, at)
                    rows.append(row)
                    if retention_ms is not None:
                        history.append(attempt_row(r, row[0], at, expiry(at, retention_ms), "delivered", None))
                if nxt is None:
                    done.append((r[C_ROWID], r[C_REVISION]))
                else:
                    moved.append((nxt, nxt, r[C_ROWID], r[C_REVISION]))
            if undecodable:
                conn.executemany(fail_sql, undecodable)
            if fired:
                if rows:
                    put_rows(conn, rows)
                if history:
                    write_records(ctx, history, conn)
                settled = update_rows(conn, done_sql, done) + update_rows(conn, fired_sql, moved)
                if settled != len(fired):  # cannot happen: the rows were read in this transaction
                    raise StorageError(f"fire_into_outbox: settled {settled} of the {len(fired)} timers read")
            if deadline is not None and time.monotonic() >= deadline:
                raise LeaseLost("lease no longer valid: the fired batch is rolled back")
            return OutboxFired(fired, len(left))

        out = await self._write("fire_into_outbox", work)
        report_failed(failed)
        return out

    async def prepare_history(self) -> None:
        """Creates the timer history table of this file when missing (once; the history store's
        DDL)."""
        if not self._history_ready:
            await self._create(history_schema(self.context))
            self._history_ready = True

    async def prepare_outbox(self) -> None:
        """Creates the outbox table of this file when missing (once; the outbox store's DDL)."""
        if not self._outbox_ready:
            await self._create(OUTBOX_SCHEMA)
            self._outbox_ready = True

    async def _create(self, statements: Iterable[str]) -> None:
        def create(conn: sqlite3.Connection) -> None:
            for statement in statements:
                conn.execute(statement)

        await self._run("prepare", self._db.transaction(create))

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
                yield from heapq.merge(*batches, key=due_key)

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

    async def sweep(self, before: int, limit: int) -> int:
        await self.prepare()
        sql = sweep_sql(self.context)
        return await self._write("sweep", lambda conn: int(conn.execute(sql, (before, limit)).rowcount))


def sweep_sql(context: str) -> str:
    """Deletes up to ``?2`` tombstones made before ``?1`` (over the tombstones' partial index)."""
    t = timer_table(context)
    return (
        f"DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE status IN {TOMBSTONES}"
        " AND due_at < ?1 ORDER BY due_at LIMIT ?2)"
    )
