"""The MongoDB backend's operations object (:class:`~wowd.stores.base.Operations`): made from the
settings, it opens the MongoDB stores and the Elasticsearch sink, reads what ``wowd check`` reads
before that, and offers the timer view rebuild (:data:`~wowd.stores.base.TIMER_VIEW_REBUILD`),
the checks of the servers' privileges and versions (:data:`~wowd.stores.base.SERVER_CHECKS`) and
the spread of the timer collections' chunks (:data:`~wowd.stores.base.CHUNK_PREPARATION`).

MongoDB must be a replica set or a sharded cluster: the log is tailed with change streams.
:meth:`MongoOperations.open` checks that first and refuses a standalone server with a clear
:class:`~wowd.errors.ConfigError` (there is no polling fallback).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import anyio

from wowd.config import uri_hosts, url_host
from wowd.errors import ConfigError, FormatError, StorageError, StorageUnavailable, WowdError
from wowd.model import AggregateType
from wowd.stores.base import (
    CHUNK_PREPARATION,
    SERVER_CHECKS,
    TIMER_VIEW_REBUILD,
    Backend,
    CheckLine,
    Ddl,
    Log,
    Offers,
    Preflight,
    Probe,
    Projection,
    TimerViewRebuild,
)
from wowd.stores.mongo._common import MongoSharding, translate_errors

if TYPE_CHECKING:
    from elasticsearch import AsyncElasticsearch
    from pymongo import AsyncMongoClient

    from wowd.config import LeaseSettings, MongoSettings, WowdSettings
    from wowd.stores.elasticsearch.sink import ElasticsearchEventSink
    from wowd.stores.mongo.timer_docs import TimerDocuments

log = logging.getLogger("wowd.stores.mongo")

__all__ = [
    "DEFAULT_APP_NAME",
    "LEASES_APP_SUFFIX",
    "OPEN_TIMEOUT_S",
    "MongoOperations",
    "app_name",
    "check_replica_set",
    "mongo_client_options",
]

OPEN_TIMEOUT_S = 30.0
"""How long ``wowd check`` waits for a server before its line says it did not answer."""
DEFAULT_APP_NAME = "wowd"
"""The client's ``appName`` (the server's logs, ``currentOp`` and profiler name it) unless the
URI gives one."""
LEASES_APP_SUFFIX = "-leases"
"""The lease client's ``appName`` is the other client's with this suffix."""


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


class MongoOperations(Offers):
    """The operations of the MongoDB backend of ``settings`` (the stores on MongoDB, the event
    index on Elasticsearch)."""

    CAPABILITIES = (TIMER_VIEW_REBUILD, SERVER_CHECKS, CHUNK_PREPARATION)
    name = "mongo"
    recovery = (
        "mongodump (or a managed backup) of the log, checkpoint and outbox collections together "
        "(docs/operations.md, Recovery)"
    )

    def __init__(self, settings: WowdSettings) -> None:
        self._settings = settings
        self._log: Log | None = None
        self._timers: TimerDocuments | None = None
        self._client: AsyncMongoClient[dict[str, Any]] | None = None
        self._lease_client: AsyncMongoClient[dict[str, Any]] | None = None
        self._sink_factory: Callable[[AggregateType], ElasticsearchEventSink] | None = None

    def where(self) -> str:
        return "the MongoDB backend"

    def outbox_where(self) -> str:
        return "the outbox collection"

    def absent(self, how_to_create: str) -> ConfigError | None:
        """None: the stores are a server's, created at the first start."""
        return None

    # ---- wowd check, before opening

    async def preflight(self) -> Preflight:
        """MongoDB answers ``hello`` as a replica-set member or a ``mongos``; Elasticsearch (with
        an event index) answers its root endpoint with wowd's credentials; then, both reached,
        the formats recorded in the database (read-only)."""
        found = Preflight([await self._reach_mongodb()])
        if self._settings.sink != "none":
            found.lines.append(await self._reach_elasticsearch())
        if all(line.ok for line in found.lines):
            found.formats = await self._formats(found.lines)
        return found

    async def _reach_mongodb(self) -> CheckLine:
        from pymongo import AsyncMongoClient

        mongo = self._settings.mongodb
        assert mongo.uri is not None  # the settings require it with the mongo backend
        uri = mongo.uri.get_secret_value()
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, **mongo_client_options(mongo))
        try:
            with anyio.fail_after(OPEN_TIMEOUT_S):
                await check_replica_set(client, hosts=uri_hosts(uri))
        except (WowdError, TimeoutError) as exc:
            return CheckLine(False, f"mongodb: {type(exc).__name__}: {exc}")
        finally:
            with anyio.CancelScope(shield=True):
                await client.close()
        return CheckLine(True, f"mongodb {uri_hosts(uri)}")

    async def _reach_elasticsearch(self) -> CheckLine:
        """Elasticsearch answers its root endpoint with wowd's credentials (one line naming the
        setting and the hosts if not): ``url`` (each of its nodes in turn until one answers) or
        ``cloud_id``; a pinned certificate is learned first."""
        from wowd.stores.elasticsearch.options import new_client
        from wowd.stores.elasticsearch.tls import ensure_pinned

        es_settings = self._settings.elasticsearch
        setting = "WOWD_ELASTICSEARCH__URL" if es_settings.url else "WOWD_ELASTICSEARCH__CLOUD_ID"
        try:
            es = new_client(es_settings)
        except (ConfigError, ValueError) as exc:
            return CheckLine(False, f"elasticsearch: {setting}: {exc}")
        nodes = es.transport.node_pool.all()
        hosts = ", ".join(url_host(n.base_url) for n in nodes)
        quiet = logging.getLogger("elastic_transport")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the transport's warning of the failure this reports in one line
        try:
            with anyio.fail_after(OPEN_TIMEOUT_S):
                await ensure_pinned(es)
                info = await es.options(max_retries=len(nodes) - 1).info()
        except TimeoutError:
            return CheckLine(False, f"elasticsearch: {setting}: no answer from {hosts} in {OPEN_TIMEOUT_S:.0f} s")
        except Exception as exc:  # the client's transport and API errors: one line each
            text = str(getattr(exc, "message", None) or exc)
            reason = text.splitlines()[0] if text else type(exc).__name__
            return CheckLine(False, f"elasticsearch: {setting}: {hosts}: {reason}")
        finally:
            quiet.setLevel(level)
            with anyio.CancelScope(shield=True):
                await es.close()
        return CheckLine(True, f"elasticsearch {hosts} (version {info.get('version', {}).get('number', '?')})")

    async def _formats(self, lines: list[CheckLine]) -> list[Any] | None:
        """The formats recorded in the database and a rebuild of the timer view running or
        interrupted (a line); ``None``, with a failing line, when they cannot be read."""
        from pymongo import AsyncMongoClient
        from pymongo.errors import PyMongoError

        from wowd.stores.mongo.schema import mongo_formats, mongo_rebuild_state

        mongo = self._settings.mongodb
        assert mongo.uri is not None
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            mongo.uri.get_secret_value(), **mongo_client_options(mongo)
        )
        try:
            with anyio.fail_after(OPEN_TIMEOUT_S):
                db = client[mongo.database]
                rebuild = await mongo_rebuild_state(db, self._settings.context)
                if rebuild is not None:
                    lines.append(CheckLine(True, f"timer view rebuild: {rebuild}"))
                return await mongo_formats(db, self._settings.context)
        except (PyMongoError, TimeoutError) as exc:
            lines.append(CheckLine(False, f"formats: {type(exc).__name__}: {exc}"))
            return None
        finally:
            with anyio.CancelScope(shield=True):
                await client.close()

    # ---- the stores

    async def open(self) -> Backend:
        """Every MongoDB store of ``settings.context`` plus the Elasticsearch sink, prepared.

        Opens two ``AsyncMongoClient`` (``settings.mongodb.uri``, ``timeoutMS``, the write
        concern): one for the leases alone (``appName`` :func:`app_name` +
        :data:`LEASES_APP_SUFFIX`), one for every other store (``appName`` :func:`app_name`), so
        that a renewal never waits for a connection of the feed's or the claims' pool, nor behind
        what a server does to that client's connections; and one ``AsyncElasticsearch``. The
        backend's ``close`` closes them. Every store gets the operation timeout (``timeout_ms``;
        0: none), the DDL mode and the sharding mode of ``settings.mongodb``. Raises
        :class:`ConfigError` on a standalone MongoDB server."""
        from pymongo import AsyncMongoClient
        from pymongo.write_concern import WriteConcern

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

        settings = self._settings
        mongo = settings.mongodb
        es_settings = settings.elasticsearch
        indexed = settings.sink != "none"
        if mongo.uri is None or indexed and not (es_settings.url or es_settings.cloud_id):
            raise ConfigError(
                "the mongo backend needs mongodb.uri and elasticsearch.url (or cloud_id, or sink = 'none')"
            )
        if indexed:
            from wowd.stores.elasticsearch.options import client_options

            client_options(es_settings)  # checked before opening anything
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
            await self._log_election_window(lease_client)

            # every store gets every setting: the operation timeout, the DDL mode, the sharding mode
            common: dict[str, Any] = {"operation_timeout": timeout}
            ddl, sharding = Ddl(mongo.ddl), MongoSharding(mongo.sharding)
            write_concern = WriteConcern(w="majority" if mongo.write_concern == "majority" else 1)
            leases = MongoSlotLeaseStore(lease_client, database, write_concern=write_concern, ddl=ddl, **common)
            log_ = MongoLog(
                client, database, context=context, partitions=partitions, ddl=ddl, sharding=sharding, **common
            )
            checkpoints = MongoCheckpoints(client, database, context=context, **common)
            quarantine = MongoQuarantine(client, database, context=context, ddl=ddl, **common)
            timers = MongoTimerView(
                client,
                database,
                context=context,
                partitions=partitions,
                ddl=ddl,
                sharding=sharding,
                tombstone_retention=timedelta(seconds=settings.timers.tombstone_retention_s),
                **common,
            )
            firing = timers.sibling(MongoTimerFiring)  # one registry of the collections for the three
            queries = timers.sibling(MongoTimerQueries)
            snapshots = MongoSnapshotStore(client, database, context=context, ddl=ddl, sharding=sharding, **common)
            rebuilds = MongoSnapshotRebuilds(
                client, database, context=context, ddl=ddl, sharding=sharding, shared_with=snapshots, **common
            )
            outbox = MongoOutbox(client, database, context=context, ddl=ddl, **common)
            history = MongoTimerHistory(client, database, context=context, ddl=ddl, **common)
            stores = (
                leases,
                log_,
                quarantine,
                timers,
                snapshots,
                outbox,
                *((history,) if settings.timers.history else ()),
            )
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
                name=self.name,
                log=log_,
                checkpoints=checkpoints,
                quarantine=quarantine,
                leases=leases,
                timers=timers,
                firing=firing,
                timer_queries=queries,
                snapshots=snapshots,
                rebuilds=rebuilds,
                outbox=outbox,
                history=history if settings.timers.history else None,
                sink_factory=sink_factory,
                # the leases: slots held for a rebuild; and this object's capabilities
                offers=(leases, self),
                # closed in reverse: the stores first, the clients last
                resources=stack.pop_all(),  # success: the backend owns the clients and stores now
            )
        self._client, self._lease_client, self._log, self._timers = client, lease_client, log_, timers
        self._sink_factory = sink_factory
        return backend

    async def _log_election_window(self, client: AsyncMongoClient[Any]) -> None:
        """At start: the lease's time against the replica set's election timeout
        (:func:`~wowd.stores.mongo.election.election_window`), a warning when it is too long."""
        from wowd.stores.mongo.election import election_window

        lease = self._settings.lease
        window = await election_window(
            client, ttl=timedelta(seconds=lease.ttl_s), tolerance=timedelta(seconds=lease.tolerance_s)
        )
        if window.safe is False:
            log.warning("mongodb elections: %s", window.text)
        else:
            log.info("mongodb elections: %s", window.text)

    # ---- capabilities

    def _opened(self) -> tuple[AsyncMongoClient[dict[str, Any]], AsyncMongoClient[dict[str, Any]], Log, TimerDocuments]:
        if self._client is None or self._lease_client is None or self._log is None or self._timers is None:
            raise StorageError("the MongoDB backend is not open")
        return self._client, self._lease_client, self._log, self._timers

    def rebuild(self, *, project: Projection, consumer: str, aggregate: str | None) -> TimerViewRebuild:
        """A rebuild of the timer view in shadow collections renamed in while the slots are held
        (:class:`~wowd.stores.mongo.timer_rebuild.MongoTimerRebuild`; ``consumer`` aside: it
        catches up to the log's head)."""
        from wowd.stores.mongo.timer_rebuild import MongoTimerRebuild

        _client, _leases, log_, timers = self._opened()
        return MongoTimerRebuild(
            timers, log_, database_name=self._settings.mongodb.database, project=project, aggregate=aggregate
        )

    async def prepare_chunks(self) -> dict[str, str]:
        """The spread of each new timer collection's chunks over the shards
        (:meth:`~wowd.stores.mongo.schema.TimerCollections.spread_chunks`)."""
        return await self._opened()[3].spread_chunks()

    def probes(self) -> list[Probe]:
        """The privileges the MongoDB stores need, the lease's time against the election timeout,
        the tombstones' TTL index of every timer collection, and the Elasticsearch cluster's
        version (with an event index)."""
        probes = [
            Probe("mongodb privileges", self._privileges),
            Probe("mongodb elections", self._elections),
            Probe("timers tombstone expiry (TTL index)", self._ttl),
        ]
        if self._sink_factory is not None:
            probes.append(Probe("elasticsearch version", self._es_version))
        return probes

    def type_probes(self, type: AggregateType) -> list[Probe]:
        """The Elasticsearch sink's privileges on the type's index (with an event index)."""
        if self._sink_factory is None:
            return []
        return [Probe(f"sink privileges {type}", functools.partial(self._sink_privileges, type))]

    async def _privileges(self) -> str | None:
        return await privileges_probe(self._opened()[0], self._settings)

    async def _elections(self) -> str:
        return await election_probe(self._opened()[1], self._settings.lease)

    async def _ttl(self) -> None:
        await ttl_probe(self._opened()[3].missing_ttl)

    async def _sink_privileges(self, type: AggregateType) -> str:
        assert self._sink_factory is not None
        return await sink_privileges_probe(self._sink_factory(type))

    async def _es_version(self) -> str:
        """The Elasticsearch cluster's version (:meth:`ElasticsearchEventSink.check_version`), asked
        through the sink of a type of the log (any: the cluster answers)."""
        assert self._sink_factory is not None
        try:
            types = await self._opened()[2].aggregate_types()
        except WowdError:
            types = []
        any_type = types[0] if types else AggregateType(context=self._settings.context, aggregate="wowd")
        return await self._sink_factory(any_type).check_version()


# ---- wowd check's probes of the MongoDB backend


async def privileges_probe(client: AsyncMongoClient[Any], settings: WowdSettings) -> str | None:
    """The privileges the MongoDB stores need (their modes as configured), asked of the server
    with ``connectionStatus``; fails naming each action missing and what it is for."""
    from wowd.stores.mongo.privileges import check_user

    mongo = settings.mongodb
    missing = await check_user(
        client, mongo.database, settings.context, ddl=Ddl(mongo.ddl), sharding=MongoSharding(mongo.sharding)
    )
    if missing is None:
        return "not checked (no authenticated user: access control is off, or no user in the URI)"
    if missing:
        lacks = "; ".join(f"{action} on {need.resource} ({need.store}: {need.why})" for need, action in missing)
        raise ConfigError(f"the user lacks {len(missing)} privilege action(s): {lacks} (docs/stores.md lists them)")
    return None


async def election_probe(client: AsyncMongoClient[Any], lease: LeaseSettings) -> str:
    """The lease's time against the replica set's election timeout: fails when a holder cut off
    with the old primary could go on after a new primary is elected; says so when the setting
    cannot be read (docs/concepts.md, Elections)."""
    from wowd.stores.mongo.election import election_window

    window = await election_window(
        client, ttl=timedelta(seconds=lease.ttl_s), tolerance=timedelta(seconds=lease.tolerance_s)
    )
    if window.safe is False:
        raise ConfigError(window.text)
    return window.text


async def ttl_probe(missing_ttl: Callable[[], Awaitable[list[str]]]) -> None:
    """Fails naming the timer collections whose tombstones never expire (no TTL index)."""
    missing = await missing_ttl()
    if missing:
        raise FormatError(
            f"no TTL index tombstones_ttl on {', '.join(missing)}: their tombstones never expire "
            "(WOWD_MONGODB__DDL=none creates nothing): create it (docs/stores.md), or start once with "
            "WOWD_MONGODB__DDL=auto"
        )


async def sink_privileges_probe(sink: ElasticsearchEventSink) -> str:
    """The Elasticsearch sink's privileges on its type's index, as the cluster answers: each
    missing one named."""
    missing = await sink.missing_privileges()
    if missing:
        raise StorageError(f"wowd's Elasticsearch user lacks {', '.join(missing)} (see docs/stores.md, Elasticsearch)")
    return "security off" if missing is None else "every privilege held"
