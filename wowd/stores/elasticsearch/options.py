"""The Elasticsearch client and sink options of :class:`~wowd.config.ElasticsearchSettings`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wowd.errors import ConfigError

if TYPE_CHECKING:
    from elasticsearch import AsyncElasticsearch

    from wowd.config import ElasticsearchSettings
    from wowd.stores.elasticsearch.tls import Pin

__all__ = ["client_options", "new_client", "sink_options"]


def client_options(settings: ElasticsearchSettings, pin: Pin | None = None) -> dict[str, Any]:
    """The keyword arguments of the ``AsyncElasticsearch`` (besides the hosts): API key or basic
    auth from the secrets, CA file, certificate verification (on unless switched off), a TLS
    client certificate and key, an Elastic Cloud id; with a pinned certificate fingerprint, the
    TLS context of :func:`~wowd.stores.elasticsearch.tls.pinned_context` (``pin``, made here when
    not given) in place of the CA and the client certificate options, which it holds."""
    from wowd.stores.elasticsearch.tls import pinned_context

    options: dict[str, Any] = {"request_timeout": settings.request_timeout_s}
    if settings.api_key is not None:
        options["api_key"] = settings.api_key.get_secret_value()
    elif settings.username:
        if settings.password is None:
            raise ConfigError("elasticsearch.password is required with elasticsearch.username")
        options["basic_auth"] = (settings.username, settings.password.get_secret_value())
    elif settings.password is not None:
        raise ConfigError("elasticsearch.username is required with elasticsearch.password")
    if settings.client_key is not None and settings.client_cert is None:
        raise ConfigError("elasticsearch.client_cert is required with elasticsearch.client_key")
    if settings.cloud_id:
        options["cloud_id"] = settings.cloud_id
    pin = pin or pinned_context(settings)
    if pin is not None:
        options["ssl_context"] = pin.context
        return options
    options["verify_certs"] = settings.verify_certs
    if settings.ca_certs is not None:
        options["ca_certs"] = str(settings.ca_certs)
    if settings.client_cert is not None:
        options["client_cert"] = str(settings.client_cert)
    if settings.client_key is not None:
        options["client_key"] = str(settings.client_key)
    return options


def new_client(settings: ElasticsearchSettings) -> AsyncElasticsearch:
    """The client of the settings: every node of ``url`` (a comma-separated list: a request
    that cannot reach one node is sent to the next), or ``cloud_id``."""
    from elasticsearch import AsyncElasticsearch

    from wowd.stores.elasticsearch.tls import pinned_context, register

    if not settings.url and not settings.cloud_id:
        raise ConfigError("elasticsearch.url or elasticsearch.cloud_id is required")
    pin = pinned_context(settings)
    options = client_options(settings, pin)
    client = AsyncElasticsearch(settings.hosts() or None, **options)
    if pin is not None:
        register(client, pin)
    return client


def sink_options(settings: ElasticsearchSettings) -> dict[str, Any]:
    """The keyword arguments of :class:`~wowd.stores.elasticsearch.sink.ElasticsearchEventSink`
    (besides the client and the type) that the settings give."""
    return {
        "ddl": settings.ddl,
        "request_timeout_s": settings.request_timeout_s,
        "refresh_interval_s": settings.refresh_interval_s,
        "bulk_bytes": settings.bulk_bytes,
        "max_request_bytes": settings.max_request_bytes,
        "max_document_bytes": settings.max_document_bytes,
        "max_document_events": settings.max_document_events,
    }
