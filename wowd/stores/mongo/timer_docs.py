"""The timer documents of one context on MongoDB (docs/concepts.md): their codec, the reads that
unite the context's collections, and the base of the three timer stores
(:mod:`~wowd.stores.mongo.timer_view`, :mod:`~wowd.stores.mongo.timer_firing`,
:mod:`~wowd.stores.mongo.timer_queries`).

One collection per owner aggregate type, ``wow_timer__<context>__<aggregate>``, recorded in the
registry ``wow_timer_aggregate`` (``{_id: collection, context, aggregate, format: 6, created_at}``).
One document per timer::

    {timer_id, partition, owner {tenant_id, id}, key, version, status, due_at, scheduled_at,
     target {context, aggregate, tenant_id, id}, body, rule {type, ...}, attempts, fired,
     claim {owner_key, fence, until}?, last_error?, revision}

Tombstones: a fired one-shot timer (``DONE``) or a cancelled one (``CANCELLED``) stays the same
document (one per key, so the conditional upserts stay atomic) with that status, the version it
ended at and ``expires_at``, a Date (server time + the retention) that the partial TTL index
``tombstones_ttl`` (``expireAfterSeconds: 0``) expires. A cancel of a key that holds nothing
upserts a bare tombstone ``{partition, owner, key, version, status, expires_at, revision}``. A put
at or below a tombstone's version is refused, so replaying the log re-delivers nothing. Tombstones
are outside the due and parked indexes and every read filters them out. The registry, the DDL and
the format's upgrade are :class:`~wowd.stores.mongo.schema.TimerCollections`'.

Times (``due_at``, ``scheduled_at``, ``claim.until``) are int64 milliseconds since the epoch.
``body`` is the command's JSON text; ``rule`` the subdocument Wow's JSON writes.

Every filter by owner carries the owner's partition (the shard key), so on a sharded cluster the
reads and writes by owner reach one shard. The documents each method sends are built by the pure
functions next to it (the black-pipe tests assert them on the wire).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from wowd.errors import InvalidInput, StorageError
from wowd.model import (
    DEFAULT_TENANT,
    AggregateRef,
    Claim,
    Timer,
    TimerStatus,
    parse_rule,
)
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import (
    DEFAULT_OPERATION_TIMEOUT,
    MongoSharding,
)
from wowd.stores.mongo.schema import REGISTRY, TimerCollections

SORT = {"due_at": 1, "timer_id": 1}

log = logging.getLogger(__name__)


PIPELINE_LENGTH_LIMIT = 1000
"""The server's ``internalPipelineLengthLimit``: an aggregation pipeline of more stages is refused
(``FailedToParse``, code 9, or 7749501 before parsing: src/mongo/db/pipeline/pipeline.cpp) and
every due, claim and next-due read with it."""


MAX_UNIONS = PIPELINE_LENGTH_LIMIT - 10
"""The ``$unionWith`` stages of one union aggregation: the limit less the stages around them
(``$match``, ``$count``, which the server parses into two, ``$sort``, ``$limit``) and a margin.
More (collections x partition groups) are read in as many aggregations as needed."""


MAX_RELOADS = 3
"""Reloads of the registry a union read makes when it counts another number of collections."""


def timer_to_doc(timer: Timer) -> dict[str, Any]:
    """The stored document of ``timer`` (no ``_id``: the server assigns one on insert and a
    replacement keeps it). ``claim`` and ``last_error`` are absent when None."""
    doc: dict[str, Any] = {
        "timer_id": timer.timer_id,
        "partition": timer.partition,
        "owner": {"tenant_id": timer.owner.tenant_id, "id": timer.owner.id},
        "key": timer.key,
        "version": timer.version,
        "status": timer.status.value,
        "due_at": timer.due_at,
        "scheduled_at": timer.scheduled_at,
        "target": {
            "context": timer.target.context,
            "aggregate": timer.target.aggregate,
            "tenant_id": timer.target.tenant_id,
            "id": timer.target.id,
        },
        "body": timer.body,
        "rule": timer.rule.to_doc(),
        "attempts": timer.attempts,
        "fired": timer.fired,
        "revision": timer.revision,
    }
    if timer.claim is not None:
        claim = timer.claim
        doc["claim"] = {"owner_key": claim.owner_key, "fence": claim.fence, "until": claim.until}
    if timer.last_error is not None:
        doc["last_error"] = timer.last_error
    return doc


def timer_from_doc(doc: Mapping[str, Any], *, context: str, aggregate: str) -> Timer:
    """Reads a stored timer of ``context.aggregate``; a malformed document is a :class:`StorageError`."""
    try:
        owner = doc["owner"]
        target = doc["target"]
        claim = doc.get("claim")
        return Timer(
            timer_id=doc["timer_id"],
            partition=int(doc["partition"]),
            owner=AggregateRef(
                context=context,
                aggregate=aggregate,
                tenant_id=owner.get("tenant_id", DEFAULT_TENANT),
                id=owner["id"],
            ),
            key=doc["key"],
            version=int(doc["version"]),
            due_at=int(doc["due_at"]),
            scheduled_at=int(doc["scheduled_at"]),
            target=AggregateRef(
                context=target["context"],
                aggregate=target["aggregate"],
                tenant_id=target.get("tenant_id", DEFAULT_TENANT),
                id=target["id"],
            ),
            body=doc["body"],
            rule=parse_rule(doc.get("rule", {"type": "once"})),
            status=TimerStatus(doc["status"]),
            attempts=int(doc.get("attempts", 0)),
            fired=int(doc.get("fired", 0)),
            claim=None
            if claim is None
            else Claim(owner_key=claim["owner_key"], fence=int(claim["fence"]), until=int(claim["until"])),
            last_error=doc.get("last_error"),
            revision=int(doc.get("revision", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError, InvalidInput) as exc:
        raise StorageError(f"mongodb timers: malformed timer document in {context}.{aggregate}: {exc!r}") from exc


def union_batch_size(limit: int | None) -> int | None:
    """The aggregation's ``cursor.batchSize``: one more than the most documents the pipeline can
    answer (the count document and ``limit`` timers), so the first batch ends at EOF.

    The server fills the first batch with up to ``batchSize`` documents and closes the cursor
    only when it met EOF while filling it; a batch filled exactly leaves the cursor open (id != 0)
    and the driver pays a ``getMore`` round trip that answers nothing. ``None`` (no limit: the
    parked read) keeps the server's default and reads on with ``getMore``."""
    return None if limit is None else limit + 2


def union_pipeline(
    context: str,
    collections: Mapping[str, str],
    match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    limit: int | None,
    *,
    keep_id: bool = False,
) -> list[dict[str, Any]]:
    """ONE aggregation on the registry: the count of ``context``'s collections (``{registered:
    n}``, absent when there are none), then each known collection's matching timers through
    ``$unionWith`` (``$match``, ``$sort``, ``$limit`` inside, then the owner's aggregate, which
    the document leaves to its collection), merged by ``(due_at, timer_id)``.

    The count document has no ``due_at`` and sorts first (a missing field sorts as null, before
    numbers); the final ``$limit`` keeps it with ``limit`` timers after it. A list of matches (the
    groups of :func:`partition_groups`) gives one ``$unionWith`` per collection and match.
    ``keep_id``: each timer keeps its ``_id`` (a document that cannot be decoded is then written
    back by it). More unions than :data:`MAX_UNIONS`: see :func:`union_pipelines`.
    """
    return _union_around(context, _unions(collections, match, limit, keep_id=keep_id), limit)


def union_pipelines(
    context: str,
    collections: Mapping[str, str],
    match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    limit: int | None,
    *,
    keep_id: bool = False,
) -> list[list[dict[str, Any]]]:
    """:func:`union_pipeline` in as many aggregations as keep each within the server's pipeline
    length (:data:`MAX_UNIONS` unions each; one when they fit), each with the count and the final
    sort and limit: the first ``limit`` timers of all are among the first ``limit`` of each."""
    unions = _unions(collections, match, limit, keep_id=keep_id)
    return [_union_around(context, part, limit) for part in union_parts(unions)]


def union_parts(unions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [unions[i : i + MAX_UNIONS] for i in range(0, len(unions), MAX_UNIONS)] or [[]]


def _unions(
    collections: Mapping[str, str],
    match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    limit: int | None,
    *,
    keep_id: bool,
) -> list[dict[str, Any]]:
    matches = [match] if isinstance(match, Mapping) else list(match)
    unions: list[dict[str, Any]] = []
    for name in sorted(collections):
        for m in matches:
            sub: list[dict[str, Any]] = [{"$match": dict(m)}, {"$sort": dict(SORT)}]
            if limit is not None:
                sub.append({"$limit": limit})
            sub.append({"$set": {"owner.aggregate": {"$literal": collections[name]}}})
            if not keep_id:
                sub.append({"$unset": "_id"})
            unions.append({"$unionWith": {"coll": name, "pipeline": sub}})
    return unions


def _union_around(context: str, unions: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    pipeline: list[dict[str, Any]] = [{"$match": {"context": context}}, {"$count": "registered"}, *unions]
    pipeline.append({"$sort": dict(SORT)})
    if limit is not None:
        pipeline.append({"$limit": limit + 1})
    return pipeline


def owner_filter(owner: AggregateRef, partition: int) -> dict[str, Any]:
    """An owner's timers: the partition (shard key) first, then the unique index's owner keys."""
    return {"partition": partition, "owner.tenant_id": owner.tenant_id, "owner.id": owner.id}


def key_filter(owner: AggregateRef, partition: int, key: str) -> dict[str, Any]:
    return {**owner_filter(owner, partition), "key": key}


TOMBSTONE_DROPS = ["claim", "body", "target", "rule", "last_error"]
"""What a tombstone does not keep: it answers for its key and version only (the command's body,
up to ``timers.max_body_bytes``, would otherwise be kept for the whole retention)."""


def tombstone_update(status: str, version: int | None, retention_ms: int) -> list[dict[str, Any]]:
    """The update (a pipeline) that makes the matched or upserted document a tombstone: ``status``,
    at ``version`` (``None``: the version it has), ``expires_at`` = the server's ``$$NOW`` + the
    retention (``$add`` of a Date and milliseconds is a Date: what a TTL index reads), revision +
    1 (0 for an inserted tombstone), and nothing of :data:`TOMBSTONE_DROPS` (no claim, command,
    target or rule): a small document."""
    fields: dict[str, Any] = {"status": status}
    if version is not None:
        fields["version"] = {"$literal": version}
    fields["expires_at"] = {"$add": ["$$NOW", retention_ms]}
    fields["revision"] = {"$add": [{"$ifNull": ["$revision", -1]}, 1]}
    return [{"$set": fields}, {"$unset": list(TOMBSTONE_DROPS)}]


D = TypeVar("D", bound="TimerDocuments")


class TimerDocuments(TimerCollections):
    """The base of the three timer stores of one context on MongoDB: the collections of
    :class:`~wowd.stores.mongo.schema.TimerCollections` (whose registry the three share in a
    backend: ``shared_with``), the owner's checks, and the union read across the context's
    collections.

    The :class:`~wowd.stores.mongo._common.MongoStore` constructor (client or URI, database,
    ``operation_timeout``). No I/O in the constructor; ``prepare`` reads the registry, each
    type's collection is created (``ddl``) on its first put. ``drop_other_format``: a collection
    recorded in another format is dropped and re-registered (the timers are a view of the log:
    the caller resets the timer view's checkpoints) instead of refused with
    :class:`~wowd.errors.FormatError`; format 5 is upgraded in place instead.
    ``tombstone_retention``: how long a fired or cancelled timer is remembered (its ``expires_at``).
    ``kind`` and ``registry``: the collections' ``wow_<kind>__...`` names and their registry (a
    timer view rebuild writes its shadow view through a store of other names).
    """

    _label = "timers"  # the same label as the embedded twin: one dashboard for both backends

    def __init__(
        self,
        client_or_uri: AsyncMongoClient[Any] | str,
        database_name: str,
        *,
        context: str,
        partitions: int,
        ddl: Ddl = Ddl.AUTO,
        sharding: MongoSharding = MongoSharding.AUTO,
        operation_timeout: timedelta | None = DEFAULT_OPERATION_TIMEOUT,
        drop_other_format: bool = False,
        tombstone_retention: timedelta = timedelta(days=7),
        kind: str = "timer",
        registry: str = REGISTRY,
        shared_with: TimerCollections | None = None,
    ) -> None:
        super().__init__(
            client_or_uri,
            database_name,
            context=context,
            partitions=partitions,
            ddl=ddl,
            sharding=sharding,
            operation_timeout=operation_timeout,
            drop_other_format=drop_other_format,
            kind=kind,
            registry=registry,
            shared_with=shared_with,
        )
        self.tombstone_retention = tombstone_retention
        self._retention_ms = int(tombstone_retention.total_seconds() * 1000)

    def sibling(self, store: type[D]) -> D:
        """A store of another concern (``store``: :class:`~wowd.stores.mongo.timer_view.MongoTimerView`,
        ...) on the same collections, with this one's client (never closed by it), settings and
        registry: what one registers, the other reads at once."""
        return store(
            self._client,
            self._db.name,
            context=self.context,
            partitions=self.partitions,
            ddl=self.ddl,
            sharding=self.sharding,
            operation_timeout=self.operation_timeout,
            drop_other_format=self.drop_other_format,
            tombstone_retention=self.tombstone_retention,
            kind=self._kind,
            registry=self.registry_name,
            shared_with=self,
        )

    def _collection(self, owner: AggregateRef) -> AsyncCollection[Any]:
        if owner.context != self.context:
            raise InvalidInput(f"{owner} is not of context {self.context!r}", field="owner.context")
        return self._db[self.collection_name(owner.aggregate)]

    def _partition(self, owner: AggregateRef) -> int:
        return owner.partition(self.partitions)

    def _check_partition(self, timer: Timer) -> None:
        if timer.partition != self._partition(timer.owner):
            raise InvalidInput(
                f"is {timer.partition}, the owner's partition is {self._partition(timer.owner)}",
                field="partition",
            )

    async def _union(
        self,
        operation: str,
        match: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        limit: int | None,
        *,
        keep_id: bool = False,
        undecodable: Callable[[dict[str, Any], Exception], None] | None = None,
    ) -> list[Timer]:
        """Runs :func:`union_pipelines` over the known collections; when the registry counts
        another number of the context's collections, reloads the registry and reads again.
        ``undecodable``: a document that cannot be decoded is given to it and skipped (else the
        read raises)."""
        for attempt in range(MAX_RELOADS + 1):
            known = dict(self._known)
            bad: list[tuple[dict[str, Any], Exception]] = []
            batch = union_batch_size(limit)
            kwargs: dict[str, Any] = {} if batch is None else {"batchSize": batch}
            docs: list[dict[str, Any]] = []
            for pipeline in union_pipelines(self.context, known, match, limit, keep_id=keep_id):
                cursor = await self._registry.aggregate(pipeline, **kwargs)
                docs.extend(await cursor.to_list(None))
            registered = 0
            timers: list[Timer] = []
            for doc in docs:
                if "registered" in doc and "timer_id" not in doc:
                    registered = max(registered, int(doc["registered"]))
                    continue
                if undecodable is None:
                    aggregate = str(doc.get("owner", {}).get("aggregate", ""))
                    timers.append(timer_from_doc(doc, context=self.context, aggregate=aggregate))
                    continue
                try:
                    aggregate = str(doc["owner"]["aggregate"])
                    timers.append(timer_from_doc(doc, context=self.context, aggregate=aggregate))
                except Exception as exc:  # a document this version cannot read: the caller fails it
                    bad.append((doc, exc))
            if registered == len(known) or attempt == MAX_RELOADS:
                if undecodable is not None:
                    for doc, error in bad:
                        undecodable(doc, error)
                if registered != len(known):
                    log.warning(
                        "timers %s: the registry still counts %d collections of %s, %d read",
                        operation,
                        registered,
                        self.context,
                        len(known),
                    )
                timers.sort(key=lambda t: (t.due_at, t.timer_id))
                return timers if limit is None else timers[:limit]
            log.info(
                "timers %s: registry counts %d collections of %s, %d known: reloading",
                operation,
                registered,
                self.context,
                len(known),
            )
            await self._load_registry()
        raise AssertionError("unreachable")  # pragma: no cover
