"""The MongoDB backend: log, leases, timers, snapshots and outbox on MongoDB, the event sink on
Elasticsearch (docs/stores.md).

MongoDB must be a replica set or a sharded cluster: the log is tailed with change streams.
:func:`open_mongo` checks that first and refuses a standalone server with a clear
:class:`~wowd.errors.ConfigError` (there is no polling fallback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from wowd.config import uri_hosts
from wowd.errors import ConfigError, StorageUnavailable
from wowd.stores.base import Backend
from wowd.stores.mongo._common import MongoSharding, translate_errors
from wowd.stores.mongo.log import MongoLog
from wowd.stores.mongo.outbox import MongoOutbox

if TYPE_CHECKING:
    from elasticsearch import AsyncElasticsearch
    from pymongo import AsyncMongoClient

    from wowd.config import ElasticsearchSettings, MongoSettings, WowdSettings
    from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_APP_NAME",
    "LEASES_APP_SUFFIX",
    "MongoLog",
    "MongoOutbox",
    "app_name",
    "check_replica_set",
    "elasticsearch_client_options",
    "mongo_client_options",
    "open_mongo",
]


async def check_replica_set(client: AsyncMongoClient[Any], *, hosts: str | None = None) -> None:
    """Raises :class:`ConfigError` unless the server is a replica-set member or a ``mongos``:
    the log is tailed with change streams, which a standalone server does not have. With
    ``hosts`` (those of ``WOWD_MONGODB__URI``), a server that does not answer is one
    :class:`StorageUnavailable` line naming the setting and the hosts, not the driver's
    topology."""
    try:
        with translate_errors("hello"):
            hello: Mapping[str, Any] = await client.admin.command("hello")
    except StorageUnavailable as exc:
        if hosts is None:
            raise
        reason = str(exc.__cause__ or exc).split(" (configured timeouts")[0].split(", Timeout: ")[0]
        reason = reason.removeprefix(f"{hosts}: ")
        raise StorageUnavailable(f"WOWD_MONGODB__URI: no MongoDB server answered at {hosts}: {reason}") from exc
    if hello.get("setName") or hello.get("msg") == "isdbgrid":
        return
    raise ConfigError(
        "MongoDB is a standalone server: wowd tails the log with change streams, which need a "
        "replica set or a sharded cluster. Start mongod with --replSet and run rs.initiate() "
        "(a one-node replica set will do; the compose file runs one)."
    )


DEFAULT_APP_NAME = "wowd"
"""The client's ``appName`` (the server's logs, ``currentOp`` and profiler name it) unless the
URI gives one."""
LEASES_APP_SUFFIX = "-leases"
"""The lease client's ``appName`` is the other client's with this suffix."""


def app_name(uri: str) -> str:
    """The URI's ``appName`` option (its name in any case, as the driver reads URI options), else
    :data:`DEFAULT_APP_NAME`. Read from the query string alone: an ``mongodb+srv`` URI is not
    resolved here."""
    for part in urlsplit(uri).query.split("&"):
        key, _, value = part.partition("=")
        if key.lower() == "appname" and value:
            return unquote(value)
    return DEFAULT_APP_NAME


def mongo_client_options(settings: MongoSettings) -> dict[str, Any]:
    """The keyword arguments of the ``AsyncMongoClient`` (besides the URI)."""
    options: dict[str, Any] = {"w": "majority" if settings.write_concern == "majority" else 1}
    if settings.timeout_ms > 0:
        options["timeoutMS"] = settings.timeout_ms
    return options


async def _log_election_window(client: AsyncMongoClient[Any], settings: WowdSettings) -> None:
    """At start: the lease's time against the replica set's election timeout
    (:func:`~wowd.stores.mongo.election.election_window`), a warning when it is too long."""
    from wowd.stores.mongo.election import election_window

    lease = settings.lease
    window = await election_window(
        client, ttl=timedelta(seconds=lease.ttl_s), tolerance=timedelta(seconds=lease.tolerance_s)
    )
    if window.safe is False:
        log.warning("mongodb elections: %s", window.text)
    else:
        log.info("mongodb elections: %s", window.text)


def elasticsearch_client_options(settings: ElasticsearchSettings) -> dict[str, Any]:
    """The keyword arguments of the ``AsyncElasticsearch`` (besides the hosts):
    :func:`wowd.stores.elasticsearch.options.client_options`."""
    from wowd.stores.elasticsearch.options import client_options

    return client_options(settings)


async def open_mongo(settings: WowdSettings) -> Backend:
    """Every MongoDB store of ``settings.context`` plus the Elasticsearch sink, prepared.

    Opens two ``AsyncMongoClient`` (``settings.mongodb.uri``, ``timeoutMS``, the write concern):
    one for the leases alone (``appName`` :func:`app_name` + :data:`LEASES_APP_SUFFIX`), one for
    every other store (``appName`` :func:`app_name`), so that a renewal never waits for a
    connection of the feed's or the claims' pool, nor behind what a server does to that client's
    connections; and one ``AsyncElasticsearch``. The backend's ``close`` closes them. Every store
    gets the operation timeout (``timeout_ms``; 0: none), the DDL mode and the sharding mode of
    ``settings.mongodb``. Raises :class:`ConfigError` on a standalone MongoDB server."""
    from pymongo import AsyncMongoClient
    from pymongo.write_concern import WriteConcern

    from wowd.model import AggregateType
    from wowd.stores.base import Ddl
    from wowd.stores.mongo.history import MongoTimerHistory
    from wowd.stores.mongo.leases import MongoSlotLeaseStore
    from wowd.stores.mongo.snapshots import MongoSnapshotStore
    from wowd.stores.mongo.timers import MongoTimerStore

    mongo = settings.mongodb
    es_settings = settings.elasticsearch
    indexed = settings.sink != "none"
    if mongo.uri is None or indexed and not (es_settings.url or es_settings.cloud_id):
        raise ConfigError("the mongo backend needs mongodb.uri and elasticsearch.url (or cloud_id, or sink = 'none')")
    if indexed:
        elasticsearch_client_options(es_settings)  # checked before opening anything
    context, partitions, database = settings.context, settings.partitions, mongo.database
    timeout = timedelta(milliseconds=mongo.timeout_ms) if mongo.timeout_ms > 0 else None

    async with AsyncExitStack() as stack:
        uri, options = mongo.uri.get_secret_value(), mongo_client_options(mongo)
        app = app_name(uri)
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, appname=app, **options)
        stack.push_async_callback(client.close)
        lease_client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            uri, appname=app + LEASES_APP_SUFFIX, **options
        )
        stack.push_async_callback(lease_client.close)
        es: AsyncElasticsearch | None = None
        if indexed:  # the Elasticsearch client's modules only then (they take a while to import)
            from wowd.stores.elasticsearch.options import new_client

            es = new_client(es_settings)
            stack.push_async_callback(es.close)

        await check_replica_set(client, hosts=uri_hosts(uri))
        await _log_election_window(lease_client, settings)

        # every store gets every setting: the operation timeout, the DDL mode, the sharding mode
        common: dict[str, Any] = {"operation_timeout": timeout}
        ddl, sharding = Ddl(mongo.ddl), MongoSharding(mongo.sharding)
        write_concern = WriteConcern(w="majority" if mongo.write_concern == "majority" else 1)
        leases = MongoSlotLeaseStore(lease_client, database, write_concern=write_concern, ddl=ddl, **common)
        log = MongoLog(client, database, context=context, partitions=partitions, ddl=ddl, sharding=sharding, **common)
        timers = MongoTimerStore(
            client,
            database,
            context=context,
            partitions=partitions,
            ddl=ddl,
            sharding=sharding,
            tombstone_retention=timedelta(seconds=settings.timers.tombstone_retention_s),
            **common,
        )
        snapshots = MongoSnapshotStore(client, database, context=context, ddl=ddl, sharding=sharding, **common)
        outbox = MongoOutbox(client, database, context=context, ddl=ddl, **common)
        history = MongoTimerHistory(client, database, context=context, ddl=ddl, **common)
        stores = (leases, log, timers, snapshots, outbox, *((history,) if settings.timers.history else ()))
        for store in stores:
            stack.push_async_callback(store.close)
        for store in stores:
            await store.prepare()

        sink_factory: Callable[[AggregateType], ElasticsearchEventSink] | None = None
        if es is not None:
            from wowd.stores.elasticsearch.options import sink_options
            from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

            sink_kwargs, client_es = sink_options(es_settings), es

            def sink_factory(type: AggregateType) -> ElasticsearchEventSink:
                return ElasticsearchEventSink(client_es, type, owns_client=False, **sink_kwargs)

        backend = Backend(
            name="mongo",
            log=log,
            leases=leases,
            timers=timers,
            snapshots=snapshots,
            rebuilds=snapshots,
            outbox=outbox,
            history=history if settings.timers.history else None,
            sink_factory=sink_factory,
            # closed in reverse: the stores first, the clients last
            resources=stack.pop_all(),  # success: the backend owns the clients and stores now
        )
    return backend
