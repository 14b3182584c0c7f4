"""The fake Elasticsearch server of the sink tests, a client of it as production configures one,
and the commits they write."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, serving
from wowd.model import AggregateRef, Commit, DomainEvent


@pytest.fixture
def fake() -> Iterator[FakeElasticsearch]:
    with serving() as server:
        server.model = EsModel()
        yield server


@pytest.fixture
def model(fake: FakeElasticsearch) -> EsModel:
    assert fake.model is not None
    return fake.model


async def _client(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    """The client's defaults (max_retries 3, retry_on_status 429/502/503/504), as in production."""
    es = AsyncElasticsearch(fake.url, request_timeout=5)
    try:
        yield es
    finally:
        await es.close()


@pytest.fixture
async def client(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    async for es in _client(fake):
        yield es


@pytest.fixture
async def second_client(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    """Another replica's client of the same cluster."""
    async for es in _client(fake):
        yield es


def order_commit(
    id: str,
    version: int = 1,
    *,
    access: dict[str, Any] | None = None,
    access_version: int = 1,
    body: Any = None,
    context: str = "ctx",
) -> Commit:
    """Version ``version`` of ``ctx.order`` ``id``: one ``OrderChanged`` event (``body``, else
    ``{"n": version}``), with ``access`` attributes when given."""
    return Commit(
        ref=AggregateRef(context=context, aggregate="order", id=id),
        version=version,
        command_id=f"cmd-{id}-{version}",
        request_id=f"req-{id}-{version}",
        create_time=1_700_000_000_000 + version,
        events=(DomainEvent(id=f"ev-{id}-{version}", name="OrderChanged", body=body or {"n": version}),),
        **({"access": access, "access_version": access_version} if access is not None else {}),
    )
