"""Signed requests, the Standard Webhooks scheme: what the http gateway adds to each request and
what a target written in Python can check them with (:func:`verify`; the standard library only).

A request carries three headers:

- ``webhook-id``: the message id (the gateway's ``Command-Request-Id``; the same on every retry);
- ``webhook-timestamp``: when it was sent, integer seconds since the Unix epoch;
- ``webhook-signature``: ``v1,<signature>`` per secret, space-separated, where ``<signature>``
  is the standard base64 of HMAC-SHA256 over ``{id}.{timestamp}.{body}`` (the body's bytes as
  sent) keyed with the secret's key.

A secret is ``whsec_`` followed by the standard base64 of its key. While a secret is rotated the
sender signs with the new and the old one: a receiver accepts a request when any signature
matches any of its secrets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "DEFAULT_TOLERANCE_S",
    "SECRET_PREFIX",
    "InvalidSecret",
    "InvalidSignature",
    "Signer",
    "secret_key",
    "sign",
    "verify",
]

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300
"""How far (s) a request's timestamp may be from the receiver's clock, either way."""
MIN_KEY_BYTES = 16
MAX_TIMESTAMP_DIGITS = 12
"""A ``webhook-timestamp`` longer than this (seconds until the year 33658) is refused as it is
read: an integer far beyond a float's range would otherwise fail the comparison with the clock."""


class InvalidSignature(ValueError):
    """A request :func:`verify` refuses; the message says why (never a secret)."""


class InvalidSecret(ValueError):
    """A secret given to :func:`verify` or :class:`Signer` that is not one (the receiver's or
    sender's configuration is at fault, not the request); the message says why, never the
    secret."""


def secret_key(secret: str) -> bytes:
    """The HMAC key of ``whsec_<base64>``: the decoded part after the prefix; raises
    :class:`InvalidSecret` (without the secret in the message) for anything else or a key
    shorter than 16 bytes."""
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise InvalidSecret(f"a signing secret starts with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSecret(f"a signing secret is {SECRET_PREFIX!r} followed by standard base64") from None
    if len(key) < MIN_KEY_BYTES:
        raise InvalidSecret(f"a signing secret's key is at least {MIN_KEY_BYTES} bytes")
    return key


def _keys(secrets: str | bytes | Iterable[str | bytes]) -> list[bytes]:
    """One secret or several: ``bytes`` are keys already; ``str`` are ``whsec_`` secrets."""
    given = [secrets] if isinstance(secrets, str | bytes) else list(secrets)
    keys: list[bytes] = []
    for i, s in enumerate(given):
        try:
            keys.append(s if isinstance(s, bytes) else secret_key(s))
        except InvalidSecret as exc:
            where = f"secret {i + 1} of {len(given)}: " if len(given) > 1 else ""
            raise InvalidSecret(f"{where}{exc}") from None
    return keys


def _signature(key: bytes, signed: bytes) -> str:
    return "v1," + base64.b64encode(hmac.digest(key, signed, hashlib.sha256)).decode("ascii")


def _signed_content(msg_id: str, timestamp: int, body: bytes) -> bytes:
    return f"{msg_id}.{timestamp}.".encode() + body


class Signer:
    """Signs with each of ``secrets`` (a ``whsec_`` secret or key, or several, in their order)."""

    __slots__ = ("_keys",)

    def __init__(self, secrets: str | bytes | Iterable[str | bytes]) -> None:
        self._keys = _keys(secrets)
        if not self._keys:
            raise ValueError("a signer needs at least one secret")

    def headers(self, msg_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
        """The three headers of a request with ``body`` (``timestamp``: now)."""
        ts = int(time.time()) if timestamp is None else timestamp
        signed = _signed_content(msg_id, ts, body)
        return {
            "webhook-id": msg_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": " ".join(_signature(k, signed) for k in self._keys),
        }


def sign(secrets: Sequence[str | bytes], msg_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The headers :class:`Signer` gives (one call)."""
    return Signer(secrets).headers(msg_id, body, timestamp)


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    if value is None:
        raise InvalidSignature(f"no {name} header")
    return value


def verify(
    secrets: str | bytes | Iterable[str | bytes],
    headers: Mapping[str, str],
    body: bytes | str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    *,
    now: float | None = None,
) -> None:
    """Checks a signed request: its timestamp within ``tolerance_s`` of ``now`` (the clock,
    seconds since the epoch; give the request's own time to check a recorded request or the
    test vector of docs/delivery.md), and one of its ``v1`` signatures that of one of
    ``secrets`` (a ``whsec_`` secret or key, or a list of them while one is rotated) over
    ``{webhook-id}.{webhook-timestamp}.{body}``. Raises :class:`InvalidSignature` saying what is
    wrong with the request (answer 401); header names are matched whatever their case. A secret
    that is not one raises :class:`InvalidSecret` whatever the request (fix the configuration)."""
    keys = _keys(secrets)
    msg_id = _header(headers, "webhook-id")
    stamp = _header(headers, "webhook-timestamp")
    given = _header(headers, "webhook-signature")
    if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > MAX_TIMESTAMP_DIGITS:
        raise InvalidSignature(f"webhook-timestamp is not an integer of at most {MAX_TIMESTAMP_DIGITS} digits")
    timestamp = int(stamp)
    at = time.time() if now is None else now
    if abs(at - timestamp) > tolerance_s:
        raise InvalidSignature(f"webhook-timestamp is more than {tolerance_s:g}s away from now")
    signed = _signed_content(msg_id, timestamp, body.encode() if isinstance(body, str) else body)
    offered = [s.encode() for s in given.split() if s.startswith("v1,")]
    for key in keys:
        expected = _signature(key, signed).encode()
        if any(hmac.compare_digest(expected, s) for s in offered):
            return
    raise InvalidSignature("no signature matches a secret")
