"""Snapshot rebuilds (docs/stores.md).

Raising a reducer's ``state_revision`` makes the replicas claim the new revision and rebuild the
snapshots of that aggregate type from the log, each partition by its owner:

1. **Claim.** For each configured reducer type, the type's table (``SnapshotRebuildStore.table``)
   is read; when there is none, or its revision is below the reducer's, the reducer's revision is
   claimed (``claim``). A table claimed at a *higher* revision means newer replicas own the type:
   this one rebuilds nothing (``superseded``). A table at the reducer's revision already
   ``backfilled`` needs nothing (``current``).
2. **Rebuild a partition.** ``mark(rebuilding=True)``, then the partition's log is re-read from the
   start (``log.read({p: None}, follow=False)``), one partition at a time (memory holds the states
   of one partition's aggregates of the types rebuilt), every aggregate of each type is folded from
   version 1 with its reducer, and each snapshot is written in place with ``rewrite`` in batches;
   the caller's fence check (the held slot's validity) runs before each batch. An aggregate whose
   log has a gap (a malformed or missing commit) is skipped and left pending, as the feed leaves it.
   A reducer that raises ends its type's rebuild (``failed``, with the reducer's error): that
   partition is not recorded (a fixed reducer rebuilds it), and the other types go on.
3. **Progress.** A rebuilt partition is recorded as a checkpoint of the consumer
   ``wowd.rebuild.<aggregate>.<revision>`` (the log's fenced checkpoints: no other table),
   so a replica taking a slot over skips the partitions already rebuilt at that revision, and
   the type is done when every partition of the context has one.
4. **Done.** Whoever records the last partition marks the table
   ``mark(rebuilding=False, backfilled=True)``.

The daemon runs :meth:`Rebuilder.rebuild_slot` for a newly held slot before its feed starts (the
feed then folds on top of the rebuilt snapshots); ``wowd snapshots rebuild`` runs
:meth:`Rebuilder.rebuild` for given partitions and ``wowd snapshots status`` :meth:`Rebuilder.status`.
Every write is idempotent and guarded (``rewrite`` never moves a snapshot back), so a rebuild
retried after a transient failure or done twice converges to the same snapshots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from wowd import metrics
from wowd.config import WowdSettings
from wowd.errors import ConfigError, InvalidInput, LeaseLost, ReducerFailed, StorageError
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    AggregateType,
    Commit,
    SnapshotRecord,
    SnapshotTable,
)
from wowd.reducers import Reducer, fold_commit
from wowd.retry import Backoff, RetryStopped, retrying
from wowd.stores.base import Backend

from .leases import HeldSlot

__all__ = [
    "PROGRESS_PREFIX",
    "Rebuilder",
    "RebuildReport",
    "RebuildStatus",
    "progress_consumer",
]

log = logging.getLogger(__name__)

PROGRESS_PREFIX = "wowd.rebuild"
"""Checkpoint consumers ``wowd.rebuild.<aggregate>.<revision>`` record the rebuilt partitions."""

PAGE = 1000
"""Page size of ``pending`` when counting."""
RETRY_BACKOFF = Backoff(0.1, 10.0)
"""The pause before retrying a rebuild the stores could not answer."""


def progress_consumer(aggregate: str, revision: int) -> str:
    """The checkpoint consumer recording which partitions of ``aggregate`` are rebuilt at ``revision``."""
    return f"{PROGRESS_PREFIX}.{aggregate}.{revision}"


def _no_check() -> None:
    return None


def _never() -> bool:
    return False


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class RebuildStatus:
    """One configured reducer type as ``wowd snapshots status`` shows it."""

    type: AggregateType
    reducer_revision: int
    """The state revision of this replica's configured reducer."""
    table: SnapshotTable | None
    """The type's table as stored (``None``: never claimed)."""
    target: int
    """The revision counted against: the higher of the table's and the reducer's."""
    pending: int
    """Snapshots whose state revision is below ``target``."""
    partitions_done: int
    """Partitions recorded rebuilt at ``target``."""
    partitions: int


@dataclass(slots=True, kw_only=True)
class RebuildReport:
    """What one rebuild did for one type."""

    type: AggregateType
    revision: int
    outcome: Literal["rebuilt", "current", "superseded", "stopped", "failed"]
    """``rebuilt``: the partitions asked were rebuilt; ``current``: nothing to do (backfilled);
    ``superseded``: the table is claimed at a higher revision; ``stopped``: stopped before the end;
    ``failed``: the reducer raised (``error``), the partition it raised in not recorded."""
    partitions: list[int] = field(default_factory=list)
    """The partitions rebuilt by this call."""
    aggregates: int = 0
    rewritten: int = 0
    unchanged: int = 0
    """Folded snapshots the store kept (it holds the same or a later version at this revision)."""
    skipped: int = 0
    """Aggregates whose log has a gap or a malformed commit: left pending."""
    failed: int = 0
    """Snapshots whose state the store cannot hold (``InvalidInput``)."""
    backfilled: bool = False
    """The table is marked backfilled at ``revision`` after this call."""
    table: SnapshotTable | None = None
    first: bool = False
    """The type had no snapshot table: the first build, with no earlier revision to replace
    (logged at DEBUG: every new file has one)."""
    error: str | None = None
    """Why the outcome is ``failed``: the reducer's exception and the commit it raised on."""


@dataclass(slots=True)
class _Job:
    type: AggregateType
    reducer: Reducer
    revision: int
    todo: set[int]
    report: RebuildReport


@dataclass(slots=True)
class _Fold:
    """The folded snapshots of one type in one partition."""

    job: _Job
    snapshots: dict[AggregateRef, SnapshotRecord] = field(default_factory=dict)
    broken: set[AggregateRef] = field(default_factory=set)


def _summary(r: RebuildReport) -> str:
    return (
        f"{r.type} at revision {r.revision}: {r.outcome}, {len(r.partitions)} partition(s), {r.rewritten} rewritten,"
        f" {r.unchanged} unchanged, {r.skipped} skipped, {r.failed} failed{', backfilled' if r.backfilled else ''}"
        + (f" ({r.error})" if r.error else "")
    )


# --------------------------------------------------------------------------- the rebuilder


class Rebuilder:
    """Claims, rebuilds and reports snapshot revisions of the configured reducer types."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        reducers: Mapping[str, Reducer],
        *,
        batch_size: int = 500,
        rewrite_batch: int = 200,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._reducers = dict(reducers)
        self._batch_size = batch_size
        self._rewrite_batch = max(1, rewrite_batch)

    def _type(self, aggregate: str) -> AggregateType:
        return AggregateType(context=self._settings.context, aggregate=aggregate)

    def _selected(self, aggregates: Collection[str] | None) -> list[str]:
        if aggregates is None:
            return sorted(self._reducers)
        unknown = sorted(set(aggregates) - set(self._reducers))
        if unknown:
            known = ", ".join(sorted(self._reducers)) or "-"
            raise ConfigError(f"no reducer configured for {', '.join(unknown)} (reducers: {known})")
        return sorted(set(aggregates))

    # ------------------------------------------------------------------ status

    async def status(self, *, page: int = PAGE) -> list[RebuildStatus]:
        """Per configured reducer type: its table, the pending snapshots (counted by paging
        ``pending``) and the partitions recorded rebuilt, against the higher of the table's and
        the reducer's revision. Reads only."""
        rebuilds = self._backend.rebuilds
        n = self._settings.partitions
        out: list[RebuildStatus] = []
        for aggregate in sorted(self._reducers):
            type_ = self._type(aggregate)
            reducer_revision = self._reducers[aggregate].state_revision
            table = await rebuilds.table(type_)
            target = max(reducer_revision, table.revision if table is not None else reducer_revision)
            pending = 0
            after: AggregateRef | None = None
            while True:
                refs = await rebuilds.pending(type_, target, after, page)
                pending += len(refs)
                if len(refs) < page:
                    break
                after = refs[-1]
            done = await self._backend.checkpoints.read(progress_consumer(aggregate, target), list(range(n)))
            out.append(
                RebuildStatus(
                    type=type_,
                    reducer_revision=reducer_revision,
                    table=table,
                    target=target,
                    pending=pending,
                    partitions_done=len(done),
                    partitions=n,
                )
            )
        return out

    # ------------------------------------------------------------------ rebuild

    async def rebuild(
        self,
        partitions: Iterable[int],
        *,
        aggregates: Collection[str] | None = None,
        check: Callable[[], None] = _no_check,
        stopping: Callable[[], bool] = _never,
        fence: int = 0,
        skip_done: bool = False,
        force: bool = False,
    ) -> list[RebuildReport]:
        """Claims the reducers' revisions and rebuilds ``partitions`` of the types that need it.

        ``check`` raises (:class:`~wowd.errors.LeaseLost`) when the caller may no longer write:
        it runs before every batch of rewrites and before recording a partition. ``stopping``
        ends the rebuild at the next batch boundary (the partition in progress is not recorded).
        ``fence`` guards the progress checkpoints. ``skip_done`` skips partitions already
        recorded rebuilt at the revision; ``force`` rebuilds a type whose table is backfilled.
        A refused progress checkpoint (a holder with a higher fence has the partition) raises
        :class:`~wowd.errors.LeaseLost`: that partition is not recorded as rebuilt by this call.
        Raises :class:`~wowd.errors.StorageUnavailable` (retry: every write is idempotent) and
        other :class:`~wowd.errors.StorageError`; a :class:`~wowd.errors.ConfigError` for an
        aggregate without a reducer or a partition out of range."""
        n = self._settings.partitions
        parts = sorted(set(partitions))
        bad = [p for p in parts if not 0 <= p < n]
        if bad:
            raise ConfigError(f"partitions out of range [0, {n}): {', '.join(map(str, bad))}")
        reports: list[RebuildReport] = []
        jobs: list[_Job] = []
        for aggregate in self._selected(aggregates):
            job = await self._plan(aggregate, parts, skip_done=skip_done, force=force)
            reports.append(job.report)
            if job.report.outcome == "rebuilt":
                jobs.append(job)
        todo = sorted(set().union(*(j.todo for j in jobs))) if jobs else []
        for p in todo:
            if stopping():
                break
            wanted = [j for j in jobs if p in j.todo and j.report.outcome != "failed"]
            if wanted and not await self._rebuild_partition(p, wanted, check, stopping, fence):
                break
        for job in jobs:
            if job.report.outcome == "failed":
                continue
            if job.todo:
                job.report.outcome = "stopped"
                continue
            await self._finish(job)
        return reports

    async def _plan(self, aggregate: str, parts: list[int], *, skip_done: bool, force: bool) -> _Job:
        rebuilds = self._backend.rebuilds
        type_ = self._type(aggregate)
        reducer = self._reducers[aggregate]
        revision = reducer.state_revision
        table = await rebuilds.table(type_)
        first = table is None
        if table is None or table.revision < revision:
            table = await rebuilds.claim(type_, revision)
            log.log(
                logging.DEBUG if first else logging.INFO,
                "snapshots of %s: claimed state revision %d",
                type_,
                table.revision,
            )
        report = RebuildReport(type=type_, revision=revision, outcome="rebuilt", table=table, first=first)
        job = _Job(type=type_, reducer=reducer, revision=revision, todo=set(), report=report)
        if table.revision > revision:
            report.outcome = "superseded"
            log.warning(
                "snapshots of %s are claimed at state revision %d, above this reducer's %d: left to the"
                " replicas running it",
                type_,
                table.revision,
                revision,
            )
            return job
        if table.backfilled and not force:
            report.outcome = "current"
            report.backfilled = True
            return job
        todo = set(parts)
        if skip_done and todo:
            done = await self._backend.checkpoints.read(progress_consumer(aggregate, revision), sorted(todo))
            todo -= set(done)
        job.todo = todo
        if todo and not table.rebuilding:
            marked = await rebuilds.mark(type_, revision, rebuilding=True)
            if marked is not None:
                report.table = marked
        return job

    async def _rebuild_partition(
        self,
        p: int,
        jobs: list[_Job],
        check: Callable[[], None],
        stopping: Callable[[], bool],
        fence: int,
    ) -> bool:
        """Folds and rewrites one partition for ``jobs``; False when stopped before the end."""
        folds = {j.type: _Fold(j) for j in jobs}
        reader = self._backend.log.read({p: None}, batch_size=self._batch_size, follow=False)
        async with aclosing(reader) as batches:  # type: ignore[type-var]
            async for batch in batches:
                for entry in batch.entries:
                    f = folds.get(entry.aggregate)
                    if f is None:
                        continue
                    c = entry.commit
                    if c is None:
                        # a malformed commit: its aggregate (when it names one) cannot be rebuilt
                        agg_id = entry.raw.get("aggregate_id")
                        tenant = entry.raw.get("tenant_id")
                        tenant = tenant if isinstance(tenant, str) else None
                        if isinstance(agg_id, str):
                            f.broken.add(
                                AggregateRef(
                                    context=entry.aggregate.context,
                                    aggregate=entry.aggregate.aggregate,
                                    id=agg_id,
                                    tenant_id=tenant or DEFAULT_TENANT,
                                )
                            )
                        continue
                    self._fold(f, c)
                    if f.job.report.outcome == "failed":
                        del folds[entry.aggregate]  # nothing more of its type is folded, written or recorded
                if stopping():
                    return False
        for f in folds.values():
            job, report = f.job, f.job.report
            for ref in f.broken:
                f.snapshots.pop(ref, None)
            if f.broken:
                report.skipped += len(f.broken)
                log.warning(
                    "snapshots of %s, partition %d: %d aggregate(s) with a gap or a malformed commit in the"
                    " log left pending (e.g. %s)",
                    job.type,
                    p,
                    len(f.broken),
                    min(f.broken),
                )
            report.aggregates += len(f.snapshots)
            items = list(f.snapshots.values())
            for start in range(0, len(items), self._rewrite_batch):
                if stopping():
                    return False
                check()
                for snap in items[start : start + self._rewrite_batch]:
                    try:
                        written = await self._backend.rebuilds.rewrite(snap)
                    except InvalidInput as exc:
                        report.failed += 1
                        log.warning("snapshot of %s v%d not rewritten: %s", snap.ref, snap.version, exc)
                        continue
                    if written:
                        report.rewritten += 1
                    else:
                        report.unchanged += 1
        check()
        for f in folds.values():
            job = f.job
            position = {"revision": job.revision, "aggregates": len(f.snapshots), "skipped": len(f.broken)}
            consumer = progress_consumer(job.type.aggregate, job.revision)
            if not await self._backend.checkpoints.save(consumer, p, position, fence):
                raise LeaseLost(
                    f"snapshots of {job.type}: the progress checkpoint of partition {p} was refused under "
                    f"fence {fence} (a holder with a higher fence has the partition): not recorded as rebuilt"
                )
            job.todo.discard(p)
            job.report.partitions.append(p)
        log.debug("snapshots rebuilt in partition %d for %s", p, ", ".join(str(j.type) for j in jobs))
        return True

    @staticmethod
    def _fold(f: _Fold, c: Commit) -> None:
        ref = c.ref
        if ref in f.broken:
            return
        cur = f.snapshots.get(ref)
        if cur is not None and c.version <= cur.version:
            return  # read twice (cannot happen in one read; harmless)
        if (cur is None and c.version != 1) or (cur is not None and c.version != cur.version + 1):
            f.broken.add(ref)
            return
        try:
            f.snapshots[ref] = fold_commit(f.job.reducer, cur, c)
        except ReducerFailed as exc:
            f.job.report.outcome = "failed"
            f.job.report.error = str(exc)

    async def _finish(self, job: _Job) -> None:
        n = self._settings.partitions
        done = await self._backend.checkpoints.read(progress_consumer(job.type.aggregate, job.revision), list(range(n)))
        if len(done) < n:
            return
        marked = await self._backend.rebuilds.mark(job.type, job.revision, rebuilding=False, backfilled=True)
        if marked is not None:
            job.report.table = marked
            job.report.backfilled = True
            log.log(
                logging.DEBUG if job.report.first else logging.INFO,
                "snapshots of %s: every partition rebuilt at state revision %d",
                job.type,
                job.revision,
            )

    # ------------------------------------------------------------------ the daemon's

    async def rebuild_slot(self, held: HeldSlot) -> list[RebuildReport]:
        """The daemon's rebuild of a newly held slot's partitions, before its feed starts: skips
        the partitions already rebuilt, writes under the slot's fence after checking its
        validity, retries a transient failure with backoff until the slot stops. A non-transient
        store failure is logged and ends the rebuild (the feed still runs; the snapshots stay
        pending, visible in ``wowd snapshots status``); so does a reducer that raises, for its
        type (``wowd_snapshot_rebuild_failed{slot,aggregate}`` is 1 while the slot is held).
        :class:`~wowd.errors.LeaseLost` propagates."""
        if not self._reducers:
            return []
        extra = held.log_extra()
        try:
            async for attempt in retrying(
                "snapshot rebuild",
                backoff=RETRY_BACKOFF,
                stop=held.stop_event,
                logger=logging.LoggerAdapter(log, extra),
            ):
                with attempt:
                    reports = await self.rebuild(
                        held.partitions,
                        check=held.check,
                        stopping=lambda: held.stopping,
                        fence=held.fence,
                        skip_done=True,
                    )
        except RetryStopped:
            return []
        except StorageError as exc:
            log.error("snapshot rebuild stopped on a non-transient error: %s", exc, extra=extra)
            return []
        for r in reports:
            failed = r.outcome == "failed"
            metrics.SNAPSHOT_REBUILD_FAILED.labels(slot=str(held.slot), aggregate=r.type.aggregate).set(int(failed))
            if failed:
                log.error(
                    "snapshots of %s not rebuilt at state revision %d: %s; they stay pending (wowd snapshots"
                    " status) until a fixed reducer is deployed",
                    r.type,
                    r.revision,
                    r.error,
                    extra=extra,
                )
        shown = [r for r in reports if r.partitions or r.outcome == "stopped"]
        if shown:
            routine = all(r.first and r.outcome == "rebuilt" and not (r.skipped or r.failed) for r in shown)
            log.log(
                logging.DEBUG if routine else logging.INFO,
                "snapshots rebuilt for slot %d: %s",
                held.slot,
                "; ".join(_summary(r) for r in shown),
                extra=extra,
            )
        return reports
