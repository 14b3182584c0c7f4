"""Contract suites: every implementation of a protocol runs the same tests.

``embedded`` always; ``mongo`` when ``WOWD_TEST_MONGODB_URI`` is set and ``elasticsearch`` (the
sink) when ``WOWD_TEST_ELASTICSEARCH_URL`` is set. The sink suite also runs against
``fake-elasticsearch`` (``tests/elasticsearch/fake_es.py``, the stateful model the black-pipe
tests rely on), so that the fake is held to the same contract as a real server. With the
variable set and the server absent the fixture fails (it never skips). Each test gets a fresh
database / file / index prefix.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from wowd.model import AggregateType

MONGO_URI = os.environ.get("WOWD_TEST_MONGODB_URI")
ES_URL = os.environ.get("WOWD_TEST_ELASTICSEARCH_URL")

CONTEXT = "ctx"
PARTITIONS = 8

MONGO_IMPLS = ["embedded"] + (["mongo"] if MONGO_URI else [])
SINK_IMPLS = ["embedded", "fake-elasticsearch"] + (["elasticsearch"] if ES_URL else [])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "wowd.db"


@pytest.fixture
async def mongo_db() -> AsyncIterator[Any]:
    """A fresh database on the server of WOWD_TEST_MONGODB_URI; fails if it does not answer."""
    assert MONGO_URI, "WOWD_TEST_MONGODB_URI is not set"
    from pymongo import AsyncMongoClient

    client: AsyncMongoClient[Any] = AsyncMongoClient(MONGO_URI, serverSelectionTimeoutMS=5000)
    await client.admin.command("ping")  # raises (fails the test) when the server is absent
    name = f"wowd_test_{uuid.uuid4().hex[:12]}"
    try:
        yield client[name]
    finally:
        await client.drop_database(name)
        await client.close()


async def _closing(store: Any) -> AsyncIterator[Any]:
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture(params=MONGO_IMPLS)
async def lease_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    if request.param == "embedded":
        from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore

        store: Any = EmbeddedSlotLeaseStore(db_path)
    else:
        from wowd.stores.mongo.leases import MongoSlotLeaseStore

        db = request.getfixturevalue("mongo_db")
        store = MongoSlotLeaseStore(db.client, db.name)
    async for s in _closing(store):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def timer_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    if request.param == "embedded":
        from wowd.stores.embedded.timers import EmbeddedTimerStore

        store: Any = EmbeddedTimerStore(db_path, context=CONTEXT, partitions=PARTITIONS)
    else:
        from wowd.stores.mongo.timers import MongoTimerStore

        db = request.getfixturevalue("mongo_db")
        store = MongoTimerStore(db.client, db.name, context=CONTEXT, partitions=PARTITIONS)
    await store.prepare()
    async for s in _closing(store):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def snapshot_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    """A SnapshotStore that is also its own SnapshotRebuildStore."""
    if request.param == "embedded":
        from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore

        store: Any = EmbeddedSnapshotStore(db_path, context=CONTEXT)
    else:
        from wowd.stores.mongo.snapshots import MongoSnapshotStore

        db = request.getfixturevalue("mongo_db")
        store = MongoSnapshotStore(db.client, db.name, context=CONTEXT)
    await store.prepare()
    async for s in _closing(store):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def log(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    if request.param == "embedded":
        from wowd.stores.embedded.log import EmbeddedLog

        store: Any = EmbeddedLog(db_path, context=CONTEXT, partitions=PARTITIONS)
    else:
        from wowd.stores.mongo.log import MongoLog

        db = request.getfixturevalue("mongo_db")
        store = MongoLog(db.client, db.name, context=CONTEXT, partitions=PARTITIONS)
    await store.prepare()
    async for s in _closing(store):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def outbox(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    if request.param == "embedded":
        from wowd.stores.embedded.outbox import EmbeddedOutbox

        store: Any = EmbeddedOutbox(db_path)
    else:
        from wowd.stores.mongo.outbox import MongoOutbox

        db = request.getfixturevalue("mongo_db")
        store = MongoOutbox(db.client, db.name, context=CONTEXT)
    async for s in _closing(store):
        yield s


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
            async for s in _closing(store):
                yield s
        return
    else:
        from elasticsearch import AsyncElasticsearch

        from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

        assert ES_URL
        client = AsyncElasticsearch(ES_URL)
        await client.info()  # fails the test when the server is absent
        prefix = f"t{uuid.uuid4().hex[:10]}"
        store = ElasticsearchEventSink(
            client, AggregateType(context=prefix, aggregate="order"), refresh=True, owns_client=True
        )
    await store.prepare()
    async for s in _closing(store):
        yield s
