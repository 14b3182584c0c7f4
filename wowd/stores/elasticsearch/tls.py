"""A pinned certificate for the Elasticsearch client (``elasticsearch.ssl_assert_fingerprint``).

Elasticsearch prints the SHA-256 fingerprint of its HTTP CA when it sets up security; a client
pins that (or the fingerprint of a node's own certificate) instead of holding the CA's file.
The client's own pinning (aiohttp's ``Fingerprint``) compares the server's certificate only, so
a CA's fingerprint never matches, and it replaces the TLS context, so that a client
certificate is not sent. wowd pins the certificate itself:

- the client's TLS context (:func:`pinned_context`) trusts nothing at first, holds the client
  certificate, and verifies the chain of every connection (``VERIFY_X509_PARTIAL_CHAIN``: a
  node's own certificate may be the anchor); a pinned certificate replaces the host name check,
  as a pin does in every Elasticsearch client;
- before the client's first request (:func:`ensure_pinned`), one TLS connection to a node reads
  the chain it presents, unverified, and the certificate whose SHA-256 is the pin becomes the
  context's only trust anchor. Only a certificate with that fingerprint is ever trusted, and every
  connection of the client then verifies its chain to it.
"""

from __future__ import annotations

import hashlib
import ssl
import weakref
from typing import TYPE_CHECKING

import anyio
from anyio.streams.tls import TLSAttribute

from wowd.errors import ConfigError, StorageUnavailable, StoreRefused

if TYPE_CHECKING:
    from elasticsearch import AsyncElasticsearch

    from wowd.config import ElasticsearchSettings

__all__ = ["Pin", "ensure_pinned", "fingerprint_of", "pinned_context", "register"]

CONNECT_TIMEOUT_S = 10.0


def fingerprint_of(text: str) -> bytes:
    """A SHA-256 fingerprint as given (hex, with or without colons) in bytes."""
    try:
        digest = bytes.fromhex(text.replace(":", "").strip())
    except ValueError:
        digest = b""
    if len(digest) != hashlib.sha256().digest_size:
        raise ConfigError(
            f"elasticsearch.ssl_assert_fingerprint must be a SHA-256 fingerprint (64 hex digits), got {text!r}"
        )
    return digest


class Pin:
    """A pinned fingerprint and the TLS context that trusts the certificate it names, once learned."""

    def __init__(self, fingerprint: bytes, context: ssl.SSLContext, client_chain: tuple[str, str | None] | None):
        self.fingerprint = fingerprint
        self.context = context
        self._client_chain = client_chain
        self.learned = False
        self._lock = anyio.Lock()

    async def learn(self, hosts: list[tuple[str, int]]) -> None:
        """Reads the chain a node presents and trusts the certificate of the pinned fingerprint:
        :class:`StoreRefused` when no certificate of the chain has it (naming the ones seen),
        :class:`StorageUnavailable` when no node answers."""
        async with self._lock:
            if self.learned:
                return
            errors: list[str] = []
            for host, port in hosts:
                try:
                    chain = await _peer_chain(host, port, self._client_chain)
                except (OSError, ssl.SSLError, TimeoutError, anyio.BrokenResourceError) as exc:
                    errors.append(f"{host}:{port}: {exc!r}")
                    continue
                for der in chain:
                    if hashlib.sha256(der).digest() == self.fingerprint:
                        self.context.load_verify_locations(cadata=der)
                        self.learned = True
                        return
                seen = ", ".join(hashlib.sha256(der).hexdigest() for der in chain) or "none"
                raise StoreRefused(
                    f"TLS: no certificate {host}:{port} presents has the pinned fingerprint "
                    f"{self.fingerprint.hex()} (elasticsearch.ssl_assert_fingerprint); its chain's: {seen}"
                )
            raise StorageUnavailable(f"TLS: no node answered to read its certificates: {'; '.join(errors)}")


def pinned_context(settings: ElasticsearchSettings) -> Pin | None:
    """The pin of the settings (None without ``ssl_assert_fingerprint``): a context with the
    client certificate, verifying every chain, trusting nothing until :meth:`Pin.learn`."""
    if not settings.ssl_assert_fingerprint:
        return None
    if settings.ca_certs is not None:
        raise ConfigError("elasticsearch.ssl_assert_fingerprint and elasticsearch.ca_certs: give one")
    if not settings.verify_certs:
        raise ConfigError("elasticsearch.ssl_assert_fingerprint verifies certificates: verify_certs must stay true")
    fingerprint = fingerprint_of(settings.ssl_assert_fingerprint)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the pin names the certificate, as in every Elasticsearch client
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    chain: tuple[str, str | None] | None = None
    if settings.client_cert is not None:
        chain = (str(settings.client_cert), str(settings.client_key) if settings.client_key is not None else None)
        try:
            context.load_cert_chain(*chain)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"elasticsearch.client_cert / client_key: cannot be loaded: {exc}") from exc
    return Pin(fingerprint, context, chain)


async def _peer_chain(host: str, port: int, client_chain: tuple[str, str | None] | None) -> list[bytes]:
    """The certificates a node presents (DER, leaf first), read without verifying them."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    if client_chain is not None:  # a node that asks for a client certificate refuses the handshake without
        probe.load_cert_chain(*client_chain)
    with anyio.fail_after(CONNECT_TIMEOUT_S):
        stream = await anyio.connect_tcp(host, port, ssl_context=probe, tls_standard_compatible=False)
    try:
        obj = stream.extra(TLSAttribute.ssl_object)
        return _chain(obj)
    finally:
        await stream.aclose()


def _chain(obj: ssl.SSLObject) -> list[bytes]:
    public = getattr(obj, "get_unverified_chain", None)  # Python 3.13
    if public is not None:
        return [bytes(c) for c in public() or ()]
    inner = getattr(getattr(obj, "_sslobj", None), "get_unverified_chain", None)  # 3.10-3.12
    if inner is not None:
        return [c.public_bytes(2) for c in inner() or ()]  # _ssl.ENCODING_DER
    leaf = obj.getpeercert(binary_form=True)
    return [leaf] if leaf else []


_PINS: weakref.WeakKeyDictionary[object, Pin] = weakref.WeakKeyDictionary()


def register(client: AsyncElasticsearch, pin: Pin) -> None:
    """Remembers the pin of a client (by its transport, which the client's copies share)."""
    _PINS[client.transport] = pin


async def ensure_pinned(client: AsyncElasticsearch) -> None:
    """Before a client's first request: learns its pin, if it has one (:meth:`Pin.learn`)."""
    pin = _PINS.get(client.transport)
    if pin is None or pin.learned:
        return
    hosts = [(n.host, n.port) for n in client.transport.node_pool.all()]
    await pin.learn(hosts)
