from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pymongo.common
import pytest
from hypothesis import settings

from tests.factories import CONTEXT, PARTITIONS
from tests.processes import Replica
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.stores.base import Backend

# A night's run of the property tests (docs/differential.md): each test's examples times 500.
settings.register_profile("night", max_examples=50_000)

# After a network error the driver checks the server again at most every 0.5 s (its minimum
# heartbeat interval); the black-pipe servers answer at once, so the tests' drivers check again
# after 50 ms. What a test asserts (the retry, its documents, the outcome) does not depend on it.
pymongo.common.MIN_HEARTBEAT_INTERVAL = 0.05


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests, then the ones starting processes, first: run on several workers
    (``-n``), the longest start early instead of ending the run alone."""

    def rank(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("process") else 2

    items.sort(key=rank)


def pytest_collection_finish(session: pytest.Session) -> None:
    """When any test to run starts wowd processes, the fork server they are forked from
    (:mod:`tests.forkserver`) starts importing now, beside the first tests."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("process") for item in session.items):
        from tests import forkserver

        forkserver.start()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    """Starts ``wowd run`` replicas (:class:`~tests.processes.Replica`) in ``tmp_path``; each is
    killed at the test's end if still running."""
    started: list[Replica] = []

    def _spawn(name: str, env: dict[str, str]) -> Replica:
        r = Replica(tmp_path, name, env)
        started.append(r)
        return r

    yield _spawn
    for r in started:
        r.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """The embedded file the process tests' replicas share."""
    return tmp_path / "wowd.db"


@pytest.fixture
async def stores(db: Path, request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The test's own view of ``db`` (the module's ``LEASE_LIMIT`` slots, 1 by default)."""
    from wowd.stores.embedded import open_embedded

    limit = getattr(request.module, "LEASE_LIMIT", 1)
    settings = WowdSettings(
        context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=db), lease=LeaseSettings(limit=limit)
    )
    backend = await open_embedded(settings)
    try:
        yield backend
    finally:
        await backend.close()
