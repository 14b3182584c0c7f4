"""The backends a stream goes through, and what each holds after it (:class:`Holdings`).

- ``embedded``: the embedded backend (:func:`~wowd.stores.embedded.open_embedded`) on a new file
  per example: the oracle.
- ``mongo``: the MongoDB stores on the replica-set simulator (``tests/mongosim``), the event index
  on the Elasticsearch fake (``tests/elasticsearch/fake_es.py``); a new database per example.
- ``mongo-sharded``: the same stores through a simulated ``mongos`` of two shards.

The stores of a MongoDB backend are those :func:`~wowd.stores.mongo.open_mongo` makes, with its
defaults, on the world's one client per simulator (and one Elasticsearch client); only the log's
empty ``getMore`` is held 5 ms instead of 1 s (a read that is caught up ends sooner; the contract
suites do the same), the sink refreshes at most every millisecond instead of every second (its
stamps wait for that), and the leases and the outbox, which the feed does not use, are not
prepared.

A stream's documents are appended as they are (``Log.insert_raw``, what a producer writes), then
fed by the daemon's own feed (:class:`~wowd.daemon.feed.Feeder`, the views of a replica holding
every partition) until every document appended is read and applied (:func:`feed`). The fire
decision asks the log through :func:`gate`, the one call of the fire gate.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from tests.differential.schema_draw import CONTEXT, PARTITIONS, Append, Stream
from tests.helpers import held_slot
from wowd.clock import now_ms
from wowd.config import WowdSettings
from wowd.daemon.feed import Feeder
from wowd.daemon.waker import Waker
from wowd.errors import ConfigError, InvalidInput
from wowd.model import DEFAULT_TENANT, AggregateRef, AggregateType, SnapshotRecord, Timer, misfired
from wowd.reducers import Reducer
from wowd.stores.base import Backend, OwnerProbe

EMBEDDED, MONGO, SHARDED = "embedded", "mongo", "mongo-sharded"
BACKENDS = (EMBEDDED, MONGO, SHARDED)
ALL_PARTITIONS = frozenset(range(PARTITIONS))
FEED_WITHIN_S = 30.0
EXAMPLE_WITHIN_S = 60.0


@dataclass
class World:
    """What the examples share: a directory for the embedded files, the simulators' and the
    Elasticsearch fake's addresses and the clients of them (made on the portal's event loop)."""

    tmp: Path
    uris: dict[str, str]
    es_fake: Any
    """The Elasticsearch fake (its model is made anew for each example that indexes)."""
    es: Any = None
    clients: dict[str, Any] = field(default_factory=dict)

    async def connect(self) -> None:
        from elasticsearch import AsyncElasticsearch
        from pymongo import AsyncMongoClient

        for name, uri in self.uris.items():
            client: AsyncMongoClient[Any] = AsyncMongoClient(uri, w="majority")
            await client.admin.command("ping")
            self.clients[name] = client
        self.es = AsyncElasticsearch(self.es_fake.url, request_timeout=10)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        if self.es is not None:
            await self.es.close()


@dataclass
class Opened:
    name: str
    backend: Backend
    settings: WowdSettings
    es: Any = None
    """The Elasticsearch client of its event index (MongoDB with a sink)."""


@asynccontextmanager
async def opened(world: World, name: str, *, sink: bool) -> AsyncIterator[Opened]:
    """Backend ``name``, empty (a new file or database); ``sink``: with the event index."""
    tag = uuid.uuid4().hex[:12]
    sink_mode = "default" if sink else "none"
    if name == EMBEDDED:
        from wowd.stores.embedded import open_embedded

        path = world.tmp / f"{tag}.db"
        settings = WowdSettings(context=CONTEXT, partitions=PARTITIONS, embedded={"path": path}, sink=sink_mode)
        backend = await open_embedded(settings)
        try:
            yield Opened(name, backend, settings)
        finally:
            await backend.close()
            for suffix in ("", "-wal", "-shm"):
                await anyio.Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    database = f"diff_{tag}"
    settings = WowdSettings(
        context=CONTEXT,
        partitions=PARTITIONS,
        backend="mongo",
        mongodb={"uri": world.uris[name], "database": database},
        elasticsearch={"url": world.es_fake.url, "refresh_interval_s": 0.001},
        sink=sink_mode,
    )
    client = world.clients[name]
    backend = await _mongo_backend(client, database, world.es if sink else None, settings)
    try:
        yield Opened(name, backend, settings, world.es if sink else None)
    finally:
        await backend.close()
        await client.drop_database(database)


async def _mongo_backend(client: Any, database: str, es: Any, settings: WowdSettings) -> Backend:
    """The stores :func:`~wowd.stores.mongo.open_mongo` makes of ``settings`` (on ``client``),
    the log's empty ``getMore`` held 5 ms."""
    from tests.timer_stores import mongo_timers
    from wowd.stores.elasticsearch.options import sink_options
    from wowd.stores.elasticsearch.sink import ElasticsearchEventSink
    from wowd.stores.mongo.checkpoints import MongoCheckpoints
    from wowd.stores.mongo.leases import MongoSlotLeaseStore
    from wowd.stores.mongo.log import MongoLog
    from wowd.stores.mongo.outbox import MongoOutbox
    from wowd.stores.mongo.quarantine import MongoQuarantine
    from wowd.stores.mongo.snapshot_rebuilds import MongoSnapshotRebuilds
    from wowd.stores.mongo.snapshots import MongoSnapshotStore

    context, partitions = settings.context, settings.partitions
    log = MongoLog(client, database, context=context, partitions=partitions, max_await=timedelta(milliseconds=5))
    timers = mongo_timers(
        client, database, context=context, partitions=partitions,
        tombstone_retention=timedelta(seconds=settings.timers.tombstone_retention_s),
    )  # fmt: skip
    checkpoints = MongoCheckpoints(client, database, context=context)
    quarantine = MongoQuarantine(client, database, context=context)
    snapshots = MongoSnapshotStore(client, database, context=context)
    rebuilds = MongoSnapshotRebuilds(client, database, context=context, shared_with=snapshots)
    leases, outbox = MongoSlotLeaseStore(client, database), MongoOutbox(client, database, context=context)
    stack = AsyncExitStack()
    for store in (leases, log, checkpoints, quarantine, timers, snapshots, outbox):
        stack.push_async_callback(store.close)
    # the feed's (the leases and the outbox stay unused)
    for store in (log, checkpoints, quarantine, timers, snapshots):
        await store.prepare()
    kwargs = sink_options(settings.elasticsearch)

    def sink(type: AggregateType) -> ElasticsearchEventSink:
        return ElasticsearchEventSink(es, type, owns_client=False, **kwargs)

    return Backend(
        name="mongo", log=log, checkpoints=checkpoints, quarantine=quarantine, leases=leases, timers=timers.view,
        firing=timers.firing, timer_queries=timers.queries, snapshots=snapshots, rebuilds=rebuilds, outbox=outbox,
        sink_factory=sink if es is not None else None, resources=stack,
    )  # fmt: skip


# --------------------------------------------------------------------------- appending, feeding


async def append(backend: Backend, appends: Sequence[Append]) -> None:
    """Each document written to its type's log as it is, in order (a producer's writes)."""
    for a in appends:
        await backend.log.insert_raw(AggregateType(context=CONTEXT, aggregate=a.aggregate), a.doc)


class CountingLog:
    """A backend's log as it is, counting what its reads yield: the entries, and the batches (as
    the feed's waker numbers them, one for each batch read)."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self.entries = 0
        self.batches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    def read(self, positions: Mapping[int, Any], *, batch_size: int = 500, follow: bool = True) -> AsyncIterator[Any]:
        return self._counted(self._log.read(positions, batch_size=batch_size, follow=follow))

    async def _counted(self, reader: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async with aclosing(reader) as batches:  # type: ignore[type-var]
            async for batch in batches:
                self.batches += 1
                self.entries += len(batch.entries)
                yield batch


async def feed(o: Opened, stream: Stream, reducers: Mapping[str, Reducer] | None = None) -> None:
    """The daemon's feed of a replica holding every partition: the documents ``stream.before``
    appended before it starts, the rest of ``stream.prefix`` while it follows the log; run until
    it has applied every document appended (each read as an entry and its batch applied, or the
    watermark past the appends: a log that never reads a document is waited for that long, and
    what it holds then is compared), then stopped at a batch boundary."""
    before, during = stream.before, stream.prefix[len(stream.before) :]
    await append(o.backend, before)
    log = o.backend.log
    counted = CountingLog(log)
    o.backend.log = counted  # type: ignore[assignment]
    held = held_slot(PARTITIONS, valid_for=FEED_WITHIN_S * 2)
    waker = Waker(partitions=held.partitions)
    feeder = Feeder(o.settings, o.backend, reducers=reducers)
    try:
        with anyio.fail_after(FEED_WITHIN_S):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, waker)
                while waker.watermark is None:  # the log read up to its head, every batch applied
                    await waker.wait_applied(waker.applied_batches, FEED_WITHIN_S)
                if during:
                    await append(o.backend, during)
                    past = (now_ms() // 1000 + 1) * 1000  # a MongoDB watermark is the start of a second
                    read_all = len(stream.prefix)
                    last_batch: int | None = None
                    while waker.watermark < past:
                        if last_batch is None and counted.entries >= read_all:
                            last_batch = counted.batches
                        if last_batch is not None and waker.applied_batches >= last_batch:
                            break
                        await waker.wait_applied(waker.applied_batches, FEED_WITHIN_S)
                held.request_stop()
    finally:
        o.backend.log = log
    views = [v.name for v in feeder.views]
    assert feeder.following() == views, f"{o.name}: views {views} fell behind the log (its log says why)"
    assert feeder.view_stalls() == {}, f"{o.name}: a view stalled: {feeder.view_stalls()}"


async def gate(backend: Backend, timers: Sequence[Timer]) -> set[int]:
    """The fire gate at a due time: the indexes of ``timers`` the log holds back (a commit of
    their aggregate past the version the view applied may change them). The one call of the
    gate: the timer loop's log check (:meth:`~wowd.stores.base.Log.committed_after`, asked as
    the loop asks it)."""
    return await backend.log.committed_after([OwnerProbe(t.owner, t.version, t.key) for t in timers])


# --------------------------------------------------------------------------- what a backend holds


OwnerKey = tuple[str, str, str]
"""An aggregate: its type, tenant and id."""
TimerKey = tuple[str, str, str, str]
"""A timer: its owner's type, tenant and id, and its key."""


@dataclass
class Holdings:
    """What one backend holds after a stream."""

    backend: str
    timers: dict[TimerKey, Timer] = field(default_factory=dict)
    last_versions: dict[OwnerKey, int] = field(default_factory=dict)
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    snapshots: dict[OwnerKey, SnapshotRecord | None] = field(default_factory=dict)
    index: dict[OwnerKey, list[dict[str, Any]]] = field(default_factory=dict)
    decisions: dict[TimerKey, str] = field(default_factory=dict)
    """At the stream's time, for each due timer: ``held``, ``fire`` or ``skip``."""


def timer_key(t: Timer) -> TimerKey:
    return (t.owner.aggregate, t.owner.tenant_id, t.owner.id, t.key)


def refs_of(stream: Stream) -> dict[OwnerKey, AggregateRef]:
    """The aggregates a stream's documents name (those an aggregate can be: others are quarantined)."""
    out: dict[OwnerKey, AggregateRef] = {}
    for a in stream.appends:
        tenant, agg_id = a.doc.get("tenant_id", DEFAULT_TENANT), a.doc.get("aggregate_id")
        try:
            ref = AggregateRef(context=CONTEXT, aggregate=a.aggregate, tenant_id=tenant, id=agg_id)
        except (InvalidInput, ConfigError):
            continue
        out[(a.aggregate, ref.tenant_id, ref.id)] = ref
    return out


async def holdings(
    o: Opened, stream: Stream, *, snapshots: bool = False, index: bool = False, decide: bool = False
) -> Holdings:
    """What ``o`` holds: its live timers, each aggregate's last version, its quarantine, and as
    asked the snapshots, the event index's documents, the fire decisions at ``stream.at``."""
    b = o.backend
    h = Holdings(o.name)
    h.timers = {timer_key(t): t for t in await b.timer_queries.scan(limit=100_000)}
    refs = refs_of(stream)
    for k, ref in refs.items():
        h.last_versions[k] = await b.log.last_version(ref)
        if snapshots:
            h.snapshots[k] = await b.snapshots.load(ref)
    h.quarantined = await b.quarantine.items(limit=100_000)
    if index:
        if o.es is not None:  # documents are searchable once refreshed
            from elasticsearch import NotFoundError

            from wowd.stores.elasticsearch.documents import index_name

            for type_ in sorted({ref.type for ref in refs.values()}):
                with contextlib.suppress(NotFoundError):  # no document of the type was indexed
                    await o.es.indices.refresh(index=index_name(type_))
        for k, ref in refs.items():
            h.index[k] = await b.sink(ref.type).documents(ref)
    if decide:
        due = await b.firing.due(ALL_PARTITIONS, stream.at, 100_000)
        held = await gate(b, due)
        for i, t in enumerate(due):
            h.decisions[timer_key(t)] = (
                "held" if i in held else "skip" if misfired(t.rule, t.scheduled_at, stream.at) else "fire"
            )
    return h


async def run(
    world: World,
    stream: Stream,
    backends: Sequence[str] = BACKENDS,
    *,
    reducers: Mapping[str, Reducer] | None = None,
    index: bool = False,
    decide: bool = False,
) -> dict[str, Holdings]:
    """``stream`` through each of ``backends`` side by side: appended, fed (with ``decide``,
    only its ``fed`` first documents: the rest are appended after the feed stopped), then
    what each holds. ``index``: with the event index (the one Elasticsearch fake: with one
    MongoDB backend)."""
    assert not (index and MONGO in backends and SHARDED in backends), "one Elasticsearch fake, one MongoDB backend"
    out: dict[str, Holdings] = {}
    if index:
        from tests.elasticsearch.fake_es import EsModel

        world.es_fake.model = EsModel()

    async def one(name: str) -> None:
        async with opened(world, name, sink=index) as o:
            await feed(o, stream, reducers)
            if decide:
                await append(o.backend, stream.appends[len(stream.prefix) :])
            out[name] = await holdings(o, stream, snapshots=bool(reducers), index=index, decide=decide)

    with anyio.fail_after(EXAMPLE_WITHIN_S):
        async with anyio.create_task_group() as tg:
            for name in backends:
                tg.start_soon(one, name)
    return out
