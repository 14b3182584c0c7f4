"""The sink over TLS, against the fake serving the certificates of ``tests/certs.py``: a
certificate that expires or is rotated while wowd runs stalls the index view and sets nothing
aside; a pinned fingerprint (the CA's, as Elasticsearch prints it, or the node's own) works with a
client certificate; several node URLs fail over."""

from __future__ import annotations

import hashlib
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from elasticsearch import AsyncElasticsearch

from tests.certs import Pki, make_expired_server_cert, make_pki
from tests.elasticsearch.conftest import order_commit
from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, serving
from tests.elasticsearch.feeding import embedded_with_sink, index_view_stalls_and_catches_up
from wowd.config import ElasticsearchSettings
from wowd.errors import StoreRefused
from wowd.model import AggregateType, stream_id
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.options import new_client
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Another CA: a certificate rotated to it is not the one wowd trusts."""
    return make_pki(tmp_path_factory.mktemp("other-pki"))


def server_context(cert: Path, key: Path, *, client_ca: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=client_ca)
    return ctx


@pytest.fixture
def tls_fake(pki: Pki) -> Iterator[FakeElasticsearch]:
    with serving(server_context(pki.server_cert, pki.server_key)) as server:
        server.model = EsModel()
        yield server


@pytest.fixture
async def tls_client(tls_fake: FakeElasticsearch, pki: Pki) -> AsyncIterator[AsyncElasticsearch]:
    es = new_client(ElasticsearchSettings(url=tls_fake.url, ca_certs=pki.ca, request_timeout_s=5))
    try:
        yield es
    finally:
        await es.close()


def sha256_of(pem: Path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.read_text())).hexdigest()


@pytest.mark.parametrize("change", ["expired", "rotated"])
async def test_a_certificate_that_expires_or_is_rotated_while_wowd_writes_stalls_the_index_and_sets_nothing_aside(
    tmp_path: Path, tls_fake: FakeElasticsearch, tls_client: AsyncElasticsearch, pki: Pki, other_pki: Pki, change: str
) -> None:
    model = tls_fake.model
    assert model is not None
    async with embedded_with_sink(tmp_path, tls_client) as (settings, backend):
        await backend.sink(TYPE).prepare()  # the index made over TLS, then the node restarts
        if change == "expired":
            expired = make_expired_server_cert(pki.ca.parent)
            tls_fake.restart_with(server_context(*expired))
        else:
            tls_fake.restart_with(server_context(other_pki.server_cert, other_pki.server_key))
        commits = [order_commit(f"order-{i}") for i in range(6)]
        await index_view_stalls_and_catches_up(
            settings,
            backend,
            commits,
            cause=r"TLS with the cluster fails .*certificate",
            lift=lambda: tls_fake.restart_with(server_context(pki.server_cert, pki.server_key)),
        )
    assert sorted(model.indices[INDEX].live) == sorted(stream_id(c.ref, 1) for c in commits)


async def test_a_pinned_ca_fingerprint_trusts_the_nodes_it_signed_and_sends_the_client_certificate(
    pki: Pki, other_pki: Pki
) -> None:
    # a node that asks for a client certificate, as a cluster authenticating clients by PKI does
    with serving(server_context(pki.server_cert, pki.server_key, client_ca=pki.ca)) as fake:
        fake.model = EsModel()
        for pinned in (pki.ca, pki.server_cert):  # the CA's fingerprint (Elasticsearch prints it) or the node's
            settings = ElasticsearchSettings(
                url=fake.url,
                ssl_assert_fingerprint=sha256_of(pinned),
                client_cert=pki.client_cert,
                client_key=pki.client_key,
                request_timeout_s=5,
            )
            es = new_client(settings)
            try:
                sink = ElasticsearchEventSink(es, TYPE, ddl=Ddl.AUTO)
                assert await sink.check_version() == "Elasticsearch 9.1.0 (supported: 9.x)"
                await sink.write([order_commit("a")])
            finally:
                await es.close()
        # a fingerprint no certificate of the node has: refused, naming the ones it has
        wrong = ElasticsearchSettings(url=fake.url, ssl_assert_fingerprint=sha256_of(other_pki.ca))
        es = new_client(wrong)
        try:
            with pytest.raises(
                StoreRefused, match=f"no certificate .* has the pinned fingerprint.*{sha256_of(pki.ca)}"
            ):
                await ElasticsearchEventSink(es, TYPE, ddl=Ddl.AUTO).write([order_commit("b")])
        finally:
            await es.close()


async def test_a_node_that_does_not_answer_is_passed_over_for_the_next(fake: FakeElasticsearch, model: EsModel) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    es = new_client(ElasticsearchSettings(url=f"{dead},{fake.url}", request_timeout_s=5))
    try:
        assert sorted(n.base_url for n in es.transport.node_pool.all()) == sorted([dead, fake.url])
        sink = ElasticsearchEventSink(es, TYPE, ddl=Ddl.AUTO)
        for i in range(3):  # whichever node the pool picks first
            await sink.write([order_commit(f"o{i}")])
        assert len(model.indices[INDEX].live) == 3
    finally:
        await es.close()
    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        ElasticsearchSettings(url=f"{fake.url},es:9200")
