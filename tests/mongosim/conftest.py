"""Fixtures of the simulator's tests: a simulator per test for the synchronous tests of its own
behaviour, one per module for the stores' tests on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

from tests.mongosim import Settings, WireServer, serving


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def server() -> Iterator[WireServer]:
    """A simulator of its own (its no-op writer off: a test writes the no-ops it needs)."""
    with serving(Settings(noop_interval=0)) as s:
        yield s


@pytest.fixture
def client(server: WireServer) -> Iterator[MongoClient[dict[str, Any]]]:
    c: MongoClient[dict[str, Any]] = MongoClient(server.uri, serverSelectionTimeoutMS=5000)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def sim() -> Iterator[WireServer]:
    """One simulator for a module's tests (each in a database of its own), its no-op writer every
    50 ms: a change stream's watermark moves on a quiet log without waiting 10 s."""
    with serving(Settings(noop_interval=0.05)) as s:
        yield s


@pytest.fixture
async def sim_client(sim: WireServer) -> AsyncIterator[AsyncMongoClient[Any]]:
    c: AsyncMongoClient[Any] = AsyncMongoClient(sim.uri)
    try:
        yield c
    finally:
        await c.close()
