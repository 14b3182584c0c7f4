"""Contract suites: every implementation of a protocol runs the same tests, one suite per
protocol of :mod:`wowd.stores.base` (a store fixture each: ``log``, ``checkpoints``,
``quarantine``, ``lease_store``, ``timer_view``, ``timer_firing``, ``timer_queries``,
``snapshot_store``, ``snapshot_rebuilds``, ``outbox``, ``history``, ``sink``). A backend runs them
by its entry in :data:`BACKENDS`: how it makes each store, and the server it runs on.

``embedded`` and ``mongo-sim`` (the MongoDB stores on the simulator of ``tests/mongosim``, one
per test session, a fresh database per test) always; ``mongo`` when ``WOWD_TEST_MONGODB_URI`` is
set and ``elasticsearch`` (the sink) when ``WOWD_TEST_ELASTICSEARCH_URL`` is set. The sink suite also runs against
``fake-elasticsearch`` (``tests/elasticsearch/fake_es.py``, the stateful model the black-pipe
tests rely on), so that the fake is held to the same contract as a real server. With the
variable set and the server absent the fixture fails (it never skips). Each test gets a fresh
database / file / index prefix.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from wowd.model import AggregateType
from wowd.stores.base import (
    Checkpoints,
    Log,
    Outbox,
    Quarantine,
    SlotLeaseStore,
    SnapshotRebuildStore,
    SnapshotStore,
    TimerFiring,
    TimerHistory,
    TimerQueries,
    TimerView,
)

MONGO_URI = os.environ.get("WOWD_TEST_MONGODB_URI")
ES_URL = os.environ.get("WOWD_TEST_ELASTICSEARCH_URL")

CONTEXT = "ctx"
PARTITIONS = 8

MONGO_IMPLS: list[Any] = ["embedded", "mongo-sim"] + (
    [pytest.param("mongo", marks=pytest.mark.mongo)] if MONGO_URI else []
)
"""With ``WOWD_TEST_MONGODB_URI`` set, the real server's runs are marked ``mongo``: ``pytest -m
mongo tests/contract`` runs them alone."""
SHARDED_IMPLS = [*MONGO_IMPLS, "mongo-sim-sharded"]
"""The log (checkpoints included) and timer suites also run through a simulated ``mongos`` of
two shards: the stores shard what they shard, and the log's stream is the shards' merged one."""
SINK_IMPLS: list[Any] = ["embedded", "fake-elasticsearch"] + (
    [pytest.param("elasticsearch", marks=pytest.mark.elasticsearch)] if ES_URL else []
)
"""With ``WOWD_TEST_ELASTICSEARCH_URL`` set, the real server's runs are marked ``elasticsearch``."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "wowd.db"


TABLE_SCAN_LIMIT = 20
"""The contract suites' simulators refuse a query no index can answer on a collection of more
documents than this (as ``notablescan``): a missing or unused index fails the test that sent it."""

_SIMULATORS: list[Any] = []
"""The engines of the session's simulators (their plan checks are read after each test)."""


@pytest.fixture(scope="session")
def mongosim_uri() -> Iterator[str]:
    """The URI of a MongoDB simulator serving the whole test session, its plan check on."""
    from tests.mongosim import Settings, serving

    with serving(Settings(plan_check=True, table_scan_limit=TABLE_SCAN_LIMIT)) as server:
        _SIMULATORS.append(server.engine)
        yield server.uri


@pytest.fixture(autouse=True)
def _plan_check() -> Iterator[None]:
    """Fails a test that sent the simulator a sorted query a server could not sort through its
    index (more than ``internalQueryMaxScansToExplode`` point scans to merge): the server would
    answer it, by a sort in memory, so the simulator answers it too and this fixture tells."""
    seen = [len(e.plan_findings) for e in _SIMULATORS]
    yield
    found = [
        f
        for e, n in zip(_SIMULATORS, seen + [0] * (len(_SIMULATORS) - len(seen)), strict=True)
        for f in e.plan_findings[n:]
    ]
    assert not found, f"a sorted query the index cannot sort: {found}"


@pytest.fixture(scope="session")
def mongosim_sharded_uri() -> Iterator[str]:
    """The URI of a simulated ``mongos`` of two shards serving the whole test session. Its
    shards' no-op writers run every 50 ms: a merged stream waits for its idlest shard's no-op,
    and the suites should not wait the 10 s of a default deployment for it."""
    from tests.mongosim import Settings, serving

    with serving(Settings(shards=2, noop_interval=0.05, plan_check=True, table_scan_limit=TABLE_SCAN_LIMIT)) as server:
        _SIMULATORS.append(server.engine)
        yield server.uri


@asynccontextmanager
async def _fresh_database(uri: str) -> AsyncIterator[Any]:
    """A fresh database on the server of ``uri``; fails if it does not answer."""
    from pymongo import AsyncMongoClient

    # 5 s to find the server, unless the URI says otherwise
    timeout = {} if "serverselectiontimeoutms=" in uri.lower() else {"serverSelectionTimeoutMS": 5000}
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, **timeout)
    try:
        await client.admin.command("ping")  # raises (fails the test) when the server is absent
        name = f"wowd_test_{uuid.uuid4().hex[:12]}"
        try:
            yield client[name]
        finally:
            await client.drop_database(name)
    finally:
        await client.close()


@pytest.fixture
async def mongo_db() -> AsyncIterator[Any]:
    """A fresh database on the server of WOWD_TEST_MONGODB_URI; fails if it does not answer."""
    assert MONGO_URI, "WOWD_TEST_MONGODB_URI is not set"
    async with _fresh_database(MONGO_URI) as db:
        yield db


@dataclass(frozen=True, slots=True)
class Where:
    """Where a test's stores live: the embedded file, or a fresh MongoDB database."""

    path: Path
    mongo: Any = None
    """The test's ``AsyncDatabase`` (MongoDB only)."""


TimerStores = tuple[TimerView, TimerFiring, TimerQueries]
"""The three timer stores of one table (or one registry of collections)."""
SnapshotStores = tuple[SnapshotStore, SnapshotRebuildStore]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreFactories:
    """How one backend makes the stores of the contract suites, one per protocol (``prepare`` is
    the fixtures'). The timer stores come together (one table, or one registry of collections),
    and so do the snapshots and their rebuild control plane."""

    log: Callable[[Where], Log]
    checkpoints: Callable[[Where], Checkpoints]
    quarantine: Callable[[Where], Quarantine]
    leases: Callable[[Where], SlotLeaseStore]
    timers: Callable[[Where], TimerStores]
    snapshots: Callable[[Where], SnapshotStores]
    outbox: Callable[[Where], Outbox]
    history: Callable[[Where], TimerHistory]


def _embedded() -> StoreFactories:
    from wowd.stores.embedded.checkpoints import EmbeddedCheckpoints
    from wowd.stores.embedded.history import EmbeddedTimerHistory
    from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
    from wowd.stores.embedded.log import EmbeddedLog
    from wowd.stores.embedded.outbox import EmbeddedOutbox
    from wowd.stores.embedded.quarantine import EmbeddedQuarantine
    from wowd.stores.embedded.snapshot_rebuilds import EmbeddedSnapshotRebuilds
    from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore
    from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring
    from wowd.stores.embedded.timer_queries import EmbeddedTimerQueries
    from wowd.stores.embedded.timer_view import EmbeddedTimerView

    def timers(w: Where) -> TimerStores:
        kw: dict[str, Any] = {"context": CONTEXT, "partitions": PARTITIONS}
        return EmbeddedTimerView(w.path, **kw), EmbeddedTimerFiring(w.path, **kw), EmbeddedTimerQueries(w.path, **kw)

    return StoreFactories(
        log=lambda w: EmbeddedLog(w.path, context=CONTEXT, partitions=PARTITIONS),
        checkpoints=lambda w: EmbeddedCheckpoints(w.path, context=CONTEXT),
        quarantine=lambda w: EmbeddedQuarantine(w.path, context=CONTEXT),
        leases=lambda w: EmbeddedSlotLeaseStore(w.path),
        timers=timers,
        snapshots=lambda w: (
            EmbeddedSnapshotStore(w.path, context=CONTEXT),
            EmbeddedSnapshotRebuilds(w.path, context=CONTEXT),
        ),
        outbox=lambda w: EmbeddedOutbox(w.path),
        history=lambda w: EmbeddedTimerHistory(w.path, context=CONTEXT),
    )


def _mongo(max_await: timedelta = timedelta(seconds=1)) -> StoreFactories:
    from wowd.stores.mongo.checkpoints import MongoCheckpoints
    from wowd.stores.mongo.history import MongoTimerHistory
    from wowd.stores.mongo.leases import MongoSlotLeaseStore
    from wowd.stores.mongo.log import MongoLog
    from wowd.stores.mongo.outbox import MongoOutbox
    from wowd.stores.mongo.quarantine import MongoQuarantine
    from wowd.stores.mongo.snapshot_rebuilds import MongoSnapshotRebuilds
    from wowd.stores.mongo.snapshots import MongoSnapshotStore
    from wowd.stores.mongo.timer_firing import MongoTimerFiring
    from wowd.stores.mongo.timer_queries import MongoTimerQueries
    from wowd.stores.mongo.timer_view import MongoTimerView

    def timers(w: Where) -> TimerStores:
        view = MongoTimerView(w.mongo.client, w.mongo.name, context=CONTEXT, partitions=PARTITIONS)
        return view, view.sibling(MongoTimerFiring), view.sibling(MongoTimerQueries)

    def snapshots(w: Where) -> SnapshotStores:
        store = MongoSnapshotStore(w.mongo.client, w.mongo.name, context=CONTEXT)
        return store, MongoSnapshotRebuilds(w.mongo.client, w.mongo.name, context=CONTEXT, shared_with=store)

    return StoreFactories(
        log=lambda w: MongoLog(
            w.mongo.client, w.mongo.name, context=CONTEXT, partitions=PARTITIONS, max_await=max_await
        ),
        checkpoints=lambda w: MongoCheckpoints(w.mongo.client, w.mongo.name, context=CONTEXT),
        quarantine=lambda w: MongoQuarantine(w.mongo.client, w.mongo.name, context=CONTEXT),
        leases=lambda w: MongoSlotLeaseStore(w.mongo.client, w.mongo.name),
        timers=timers,
        snapshots=snapshots,
        outbox=lambda w: MongoOutbox(w.mongo.client, w.mongo.name, context=CONTEXT),
        history=lambda w: MongoTimerHistory(w.mongo.client, w.mongo.name, context=CONTEXT),
    )


@dataclass(frozen=True, slots=True)
class Registered:
    """A backend the suites run on: its stores, and the server its tests get a fresh database of
    (``None``: a file in the test's directory)."""

    stores: Callable[[], StoreFactories]
    server: Callable[[pytest.FixtureRequest], str] | None = None


def _mongo_server(request: pytest.FixtureRequest) -> str:
    assert MONGO_URI, "WOWD_TEST_MONGODB_URI is not set"
    return MONGO_URI


BACKENDS: dict[str, Registered] = {
    "embedded": Registered(_embedded),
    "mongo": Registered(_mongo, _mongo_server),
    # the log's empty ``getMore`` held 50 ms (not 1 s): a read that is caught up ends after one
    # empty wait, and the suites wait less on the simulator
    "mongo-sim": Registered(lambda: _mongo(timedelta(milliseconds=50)), lambda r: r.getfixturevalue("mongosim_uri")),
    "mongo-sim-sharded": Registered(
        lambda: _mongo(timedelta(milliseconds=50)), lambda r: r.getfixturevalue("mongosim_sharded_uri")
    ),
}
"""The backends the suites run on, registered here: a new backend adds one entry (its stores'
factories, and its server where it has one). Its modules load when used."""

SHARDED_STORES = frozenset(
    {"log", "checkpoints", "quarantine", "timer_view", "timer_firing", "timer_queries", "snapshot_store",
     "snapshot_rebuilds"}
)  # fmt: skip
"""The stores whose suites also run through the sharded simulator."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test of a store runs on every backend (``backend``): those of :data:`MONGO_IMPLS`,
    and the sharded simulator too for :data:`SHARDED_STORES`."""
    if "backend" in metafunc.fixturenames:
        impls = SHARDED_IMPLS if SHARDED_STORES & set(metafunc.fixturenames) else MONGO_IMPLS
        metafunc.parametrize("backend", impls, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def where(request: pytest.FixtureRequest, backend: str, db_path: Path) -> AsyncIterator[Where]:
    """Where the test's stores live: a fresh file, or a fresh database on the backend's server."""
    server = BACKENDS[backend].server
    if server is None:
        yield Where(db_path)
        return
    async with _fresh_database(server(request)) as db:
        yield Where(db_path, db)


@pytest.fixture
def factories(backend: str) -> StoreFactories:
    return BACKENDS[backend].stores()


def _opened(name: str, kind: str, *, prepare: bool = True) -> Any:
    """The fixture ``name``: the store (or the stores made together) ``factories.KIND`` makes
    where the test's stores live, prepared unless ``prepare`` is false, closed after the test."""

    @pytest.fixture(name=name)
    async def opened(factories: StoreFactories, where: Where) -> AsyncIterator[Any]:
        made = getattr(factories, kind)(where)
        stores = made if isinstance(made, tuple) else (made,)
        try:
            if prepare:
                for s in stores:
                    await s.prepare()
            yield made
        finally:
            for s in stores:
                await s.close()

    return opened


log = _opened("log", "log")
checkpoints = _opened("checkpoints", "checkpoints")
quarantine = _opened("quarantine", "quarantine")
lease_store = _opened("lease_store", "leases", prepare=False)
timer_stores = _opened("timer_stores", "timers")
"""The three timer stores of one table (one registry of collections)."""
snapshot_stores = _opened("snapshot_stores", "snapshots")
outbox = _opened("outbox", "outbox", prepare=False)
history = _opened("history", "history")


@pytest.fixture
def timer_view(timer_stores: TimerStores) -> TimerView:
    return timer_stores[0]


@pytest.fixture
def timer_firing(timer_stores: TimerStores) -> TimerFiring:
    return timer_stores[1]


@pytest.fixture
def timer_queries(timer_stores: TimerStores) -> TimerQueries:
    return timer_stores[2]


@pytest.fixture
def snapshot_store(snapshot_stores: SnapshotStores) -> SnapshotStore:
    return snapshot_stores[0]


@pytest.fixture
def snapshot_rebuilds(snapshot_stores: SnapshotStores) -> SnapshotRebuildStore:
    return snapshot_stores[1]


SINK_TYPE = AggregateType(context=CONTEXT, aggregate="order")


@pytest.fixture(params=SINK_IMPLS)
async def sink(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    """The event sink of ``ctx.order`` (refresh on, for reads right after writes)."""
    if request.param == "embedded":
        from wowd.stores.embedded.sink import EmbeddedEventSink

        store: Any = EmbeddedEventSink(db_path, SINK_TYPE)
    elif request.param == "fake-elasticsearch":
        from elasticsearch import AsyncElasticsearch

        from tests.elasticsearch.fake_es import EsModel, serving
        from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

        with serving() as fake:
            fake.model = EsModel()
            client = AsyncElasticsearch(fake.url, request_timeout=5)
            store = ElasticsearchEventSink(client, SINK_TYPE, refresh=True, owns_client=True)
            await store.prepare()
            try:
                yield store
            finally:
                await store.close()
        return
    else:
        from elasticsearch import AsyncElasticsearch

        from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

        assert ES_URL
        client = AsyncElasticsearch(ES_URL)
        try:
            await client.info()  # fails the test when the server is absent
        except BaseException:
            await client.close()
            raise
        prefix = f"t{uuid.uuid4().hex[:10]}"
        store = ElasticsearchEventSink(
            client, AggregateType(context=prefix, aggregate="order"), refresh=True, owns_client=True
        )
    await store.prepare()
    try:
        yield store
    finally:
        await store.close()
