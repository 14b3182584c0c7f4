"""The MongoDB backend as ``wowd run`` opens it (:func:`~wowd.stores.mongo.open_mongo`), on the
simulator: what its clients do when the server holds some of their connections back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import anyio
import pytest
from pydantic import SecretStr

from tests.mongosim import Settings, WireServer, serving
from wowd.config import MongoSettings, WowdSettings
from wowd.model import Owner
from wowd.stores.base import Backend
from wowd.stores.mongo import open_mongo

pytestmark = pytest.mark.anyio

TTL, TOLERANCE = timedelta(seconds=10), timedelta(seconds=1)


@pytest.fixture
async def backend(sim: WireServer, request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    settings = WowdSettings(
        backend="mongo",
        context="ctx",
        partitions=8,
        sink="none",
        mongodb=MongoSettings(uri=SecretStr(sim.uri), database=f"b_{request.node.name[:40]}"),
    )
    opened = await open_mongo(settings)
    try:
        yield opened
    finally:
        await opened.close()


def fail_point(server: WireServer, data: dict[str, Any]) -> None:
    """``configureFailPoint failCommand`` as a test sets it on a server (``alwaysOn``)."""
    server.engine.run(
        server.engine.connect(None),
        {"configureFailPoint": "failCommand", "mode": "alwaysOn", "data": data, "$db": "admin"},
    )


async def test_a_renewal_answers_while_the_feed_and_the_claims_connections_are_held(
    sim: WireServer, backend: Backend
) -> None:
    """The server holds every command of the feed's and the claims' client (``failCommand``
    with ``blockConnection`` on that client's ``appName``, as a busy server holds their
    connections): a read of the log and a claim are stuck, and a renewal still answers within a
    second, on a client of its own."""
    lease = (await backend.leases.acquire("ns", Owner(key="o"), 1, TTL, TOLERANCE)).lease
    assert lease is not None
    app = backend.log.client.options.pool_options.metadata.get("application")  # type: ignore[attr-defined]
    commands = ["find", "aggregate", "getMore", "update", "insert", "findAndModify", "listCollections"]
    fail_point(sim, {"failCommands": commands, "appName": app and app["name"], "blockConnection": True,
                        "blockTimeMS": 3000})  # fmt: skip
    engine = sim.engine

    def held(n: int) -> bool:
        with engine.changed:
            return engine.changed.wait_for(lambda: engine.failpoints["failCommand"]["count"] >= n, 5)

    async def feed() -> None:
        async for _ in backend.log.read({p: None for p in range(8)}, follow=True):
            pass

    async def claim() -> None:
        await backend.firing.claim_due(set(range(8)), 10**13, 100, owner_key="o", fence=1, claim_until=10**14)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            tg.start_soon(claim)
            assert await anyio.to_thread.run_sync(held, 2)  # both are held by the server now
            with anyio.fail_after(1):
                renewed = await backend.leases.renew(lease, TTL, TOLERANCE)
            assert renewed is not None and renewed.expires_at > lease.expires_at
            tg.cancel_scope.cancel()
    finally:
        sim.engine.failpoints.pop("failCommand", None)


async def test_the_lease_time_is_held_against_the_election_timeout_at_start_and_by_wowd_check(
    sim: WireServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder cut off with the old primary works on until its lease's ``ttl - tolerance`` is
    spent; a new primary can take a cancel it does not see after ``electionTimeoutMillis``.
    Longer (15 s - 1 s against 10 s): a warning at start with the arithmetic, and ``wowd
    check`` fails; shorter (the defaults): said; a ``mongos`` (no ``replSetGetConfig``): not
    checked, and why."""
    import logging

    from wowd.config import LeaseSettings
    from wowd.errors import ConfigError
    from wowd.stores.mongo.operations import election_probe

    def settings(uri: str, lease: LeaseSettings) -> WowdSettings:
        return WowdSettings(backend="mongo", context="ctx", sink="none", lease=lease,
                            mongodb=MongoSettings(uri=SecretStr(uri), database="elections"))  # fmt: skip

    long = settings(sim.uri, LeaseSettings(ttl_s=15, tolerance_s=1))
    with caplog.at_level(logging.WARNING, logger="wowd.stores.mongo"):
        opened = await open_mongo(long)
    try:
        assert "14000 ms >= electionTimeoutMillis 10000 ms" in caplog.text
        with pytest.raises(ConfigError, match="WOWD_LEASE__TTL_S"):
            await election_probe(opened.leases.client, long.lease)
        assert "9000 ms < electionTimeoutMillis 10000 ms" in await election_probe(opened.leases.client, LeaseSettings())
    finally:
        await opened.close()
    with serving(Settings(shards=2, noop_interval=0.05)) as mongos:
        sharded = settings(mongos.uri, LeaseSettings())
        opened = await open_mongo(sharded)
        try:
            assert "not checked: a mongos" in await election_probe(opened.leases.client, sharded.lease)
        finally:
            await opened.close()
