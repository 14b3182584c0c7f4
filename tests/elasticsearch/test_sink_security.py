"""What wowd's Elasticsearch user must hold, and how ``wowd check`` asks the cluster for it
(``_security/user/_has_privileges``), against the stateful fake (``fake_es.EsModel``)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from elasticsearch import AsyncElasticsearch

from tests.elasticsearch.conftest import order_commit
from tests.elasticsearch.fake_es import EsModel
from wowd.config import ElasticsearchSettings, load_settings
from wowd.errors import ConfigError, StorageError, StoreRefused
from wowd.model import AggregateType, Commit
from wowd.stores.base import Ddl
from wowd.stores.elasticsearch.options import client_options, new_client
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink
from wowd.stores.mongo.operations import sink_privileges_probe

pytestmark = pytest.mark.anyio

TYPE = AggregateType(context="ctx", aggregate="order")
INDEX = "wow.ctx.order.events"
A = {"owner_id": "u1", "space_id": "s1", "tags": ["x"]}
B = {"owner_id": "u2", "space_id": "s1", "tags": ["x"]}

DOCUMENTED_INDEX = {"create_doc", "read", "index", "maintenance", "view_index_metadata", "create_index"}
"""The index privileges docs/stores.md lists (with the cluster privileges below)."""
DOCUMENTED_CLUSTER = {"monitor", "manage_index_templates"}


def commit(id: str, version: int, access: dict[str, Any] = A, access_version: int = 1) -> Commit:
    return order_commit(id, version, access=access, access_version=access_version)


async def test_the_documented_privileges_run_writes_stamps_and_checks(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    model.index_privileges, model.cluster_privileges = set(DOCUMENTED_INDEX), set(DOCUMENTED_CLUSTER)
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    await sink.write([commit("a", 1), commit("a", 2)])
    await sink.write([commit("a", 3, B, 3)])  # an access change: refresh, look-ups, a stamp
    model.indices[INDEX].refresh()
    assert [d["owner_id"] for d in await sink.documents(commit("a", 1).ref)] == ["u2"] * 3
    assert await sink.missing_privileges() == []
    assert await sink_privileges_probe(sink) == "every privilege held"


async def test_without_maintenance_and_monitor_the_stamps_fail_and_check_names_what_is_missing(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    await sink.write([commit("a", 1)])
    # what was documented before: no maintenance (refresh), no cluster monitor (health)
    model.index_privileges = {"create_doc", "read", "write", "view_index_metadata", "monitor", "create_index"}
    model.cluster_privileges = set()
    with pytest.raises(StoreRefused, match=r"lacks a privilege.*indices:admin/refresh"):
        await sink.write([commit("a", 2, B, 2)])
    assert await sink.missing_privileges() == [
        "cluster monitor",
        "cluster manage_index_templates",
        f"index maintenance on {INDEX}",
    ]
    with pytest.raises(StorageError, match=r"lacks cluster monitor, cluster manage_index_templates, index maintenance"):
        await sink_privileges_probe(sink)
    model.security_enabled = False
    assert await sink.missing_privileges() is None


# --------------------------------------------------------------------------- versions


async def test_an_8x_cluster_refuses_the_9x_client_and_the_write_stalls_naming_it(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    model.version = "8.17.0"
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    with pytest.raises(StoreRefused, match=r"an older server.*\[400\] media_type_header_exception"):
        await sink.write([commit("a", 1)])
    with pytest.raises(
        StorageError, match=r"Elasticsearch 8.17.0: wowd supports Elasticsearch 9.x .*compatible-with=9"
    ):
        await sink.check_version()


async def test_check_reads_the_servers_version_and_says_which_it_supports(
    client: AsyncElasticsearch, model: EsModel
) -> None:
    sink = ElasticsearchEventSink(client, TYPE, ddl=Ddl.AUTO)
    assert await sink.server_version() == ("9.1.0", "elasticsearch")
    assert await sink.check_version() == "Elasticsearch 9.1.0 (supported: 9.x)"
    model.version = "10.0.0"
    with pytest.raises(StorageError, match=r"Elasticsearch 10.0.0: wowd supports Elasticsearch 9.x"):
        await sink.check_version()


def test_tls_client_certificate_fingerprint_and_cloud_id_are_settings(tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    settings = ElasticsearchSettings(url="https://es:9200", api_key="k", client_cert=cert, client_key=key)
    options = client_options(settings)
    assert options["client_cert"] == str(cert) and options["client_key"] == str(key)
    # a pinned certificate is a SHA-256 fingerprint (tests/elasticsearch/test_sink_tls.py pins one)
    with pytest.raises(ConfigError, match="must be a SHA-256 fingerprint"):
        client_options(ElasticsearchSettings(url="https://es:9200", ssl_assert_fingerprint="AB:CD"))
    pinned = ElasticsearchSettings(url="https://es:9200", ssl_assert_fingerprint="ab" * 32, client_cert=cert)
    with pytest.raises(ConfigError, match="client_cert / client_key: cannot be loaded"):
        client_options(pinned)  # the settings' check before anything is opened
    with pytest.raises(ConfigError, match="client_cert is required with elasticsearch.client_key"):
        client_options(ElasticsearchSettings(url="https://es:9200", client_key=key))
    # an Elastic Cloud id instead of a URL: <name>:base64(<host>$<es uuid>$<kibana uuid>)
    cloud_id = "prod:" + base64.b64encode(b"eu-west-1.aws.found.io$abc123$def456").decode()
    es = new_client(ElasticsearchSettings(cloud_id=cloud_id, api_key="k"))
    assert [n.base_url for n in es.transport.node_pool.all()] == ["https://abc123.eu-west-1.aws.found.io:443"]
    with pytest.raises(ValueError, match="give one"):
        ElasticsearchSettings(url="https://es:9200", cloud_id=cloud_id)
    load_settings(backend="mongo", mongodb={"uri": "mongodb://m/?replicaSet=rs"}, elasticsearch={"cloud_id": cloud_id})
