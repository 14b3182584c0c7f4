"""One world per test session: the replica-set simulator, the sharded simulator (two shards), the
Elasticsearch fake, and an event loop in a thread of its own (an anyio blocking portal) holding
their clients. Each hypothesis example opens new, empty backends on them (a new file, a new
database, new indexes) and runs on that loop (:func:`run`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings

from tests.differential.backends import MONGO, SHARDED, World

T = TypeVar("T")


def sized(examples: int) -> settings:
    """Hypothesis settings of a test that runs ``examples`` examples under the default profile
    (``max_examples`` 100), and proportionally more under a longer one (``--hypothesis-profile
    night``: docs/differential.md). No deadline: an example's time is the simulators'."""
    return settings(
        max_examples=max(1, examples * settings.default.max_examples // 100),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


SHRINKING = pytest.mark.timeout(900 * max(1, settings.default.max_examples // 100))
"""A property test's time limit: a passing run takes seconds, but once a test fails hypothesis
shrinks the stream for up to 5 minutes (each shrink step a run through every backend) before it
reports the minimal one; a longer profile's run takes proportionally longer."""

_SIMULATORS: list[Any] = []


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[World, BlockingPortal]]:
    from tests.elasticsearch.fake_es import EsModel
    from tests.elasticsearch.fake_es import serving as es_serving
    from tests.mongosim import Settings, serving

    tmp: Path = tmp_path_factory.mktemp("differential")
    with (
        serving(Settings(noop_interval=0.2, plan_check=True)) as replica_set,
        serving(Settings(shards=2, noop_interval=0.02, plan_check=True)) as sharded,
        es_serving() as es,
        start_blocking_portal("asyncio") as portal,
    ):
        es.model = EsModel()
        _SIMULATORS[:] = [replica_set.engine, sharded.engine]
        w = World(tmp=tmp, uris={MONGO: replica_set.uri, SHARDED: sharded.uri}, es_fake=es)
        portal.call(w.connect)
        try:
            yield w, portal
        finally:
            portal.call(w.close)


@pytest.fixture(autouse=True)
def _plan_check() -> Iterator[None]:
    """Fails a test that sent a simulator a sorted query a server could not sort through its index
    (as the contract suites do, docs/mongosim.md)."""
    seen = [len(e.plan_findings) for e in _SIMULATORS]
    yield
    found = [f for e, n in zip(_SIMULATORS, seen, strict=False) for f in e.plan_findings[n:]]
    assert not found, f"a sorted query the index cannot sort: {found}"


@pytest.fixture(scope="session")
def run(world: tuple[World, BlockingPortal]) -> Callable[..., Any]:
    """Runs ``fn(world, *args, **kwargs)`` (a coroutine function) on the world's event loop."""
    w, portal = world

    def call(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return portal.call(lambda: fn(w, *args, **kwargs))

    return call
