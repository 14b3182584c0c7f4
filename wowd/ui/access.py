"""Who may read and do what on the status page: the token a request carries, the tries of a wrong
one (limited per client), command bodies hidden from a reader without it, and the notices a page
shows after an action (signed, so that a link cannot make a page say what wowd did not).

A command's body (and a quarantined commit's events) may hold what the application keeps from
anyone: a card number, an address. A request reads them when the settings open them to anyone
(``ui.open_bodies``) or when it carries the token: ``Authorization: Bearer TOKEN``, or HTTP Basic
with the token as the password (what a browser sends once asked, ``/ui/login``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from wowd.ui.http import HttpRequest

__all__ = ["TokenTries", "compare", "hide_bodies", "offered_token", "sign_notice", "signed_notice"]

TRIES = 10
"""Wrong tokens a client may offer at once, before it is slowed down."""
TRY_EVERY_S = 2.0
"""Then one more try every this many seconds (a 16-character token is not guessed at that rate)."""
CLIENTS = 1024
"""Clients whose tries are remembered (the least recently refused are forgotten first)."""


def offered_token(request: HttpRequest) -> str | None:
    """The token ``request`` carries in ``Authorization``: ``Bearer TOKEN``, or ``Basic`` with
    the token as the password (any user name); ``None`` when it carries none."""
    scheme, _, value = request.headers.get("authorization", "").strip().partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return ""
        return decoded.partition(":")[2]
    return None


class TokenTries:
    """Wrong tokens per client address: :data:`TRIES` at once, then one every
    :data:`TRY_EVERY_S` (a token bucket per client, :data:`CLIENTS` remembered). A client out of
    tries is refused before its token is compared; every refusal is counted by the caller."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tries left, at)

    def wait_s(self, client: str) -> float:
        """How long ``client`` must wait before its next try (0: it may try now)."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return 0.0
        left = self._left(bucket)
        return 0.0 if left >= 1 else (1 - left) * TRY_EVERY_S

    def failed(self, client: str) -> None:
        """Counts a wrong token offered by ``client``."""
        bucket = self._buckets.get(client)
        left = self._left(bucket) if bucket is not None else float(TRIES)
        self._buckets[client] = (max(0.0, left - 1), self._clock())
        self._buckets.move_to_end(client)
        while len(self._buckets) > CLIENTS:
            self._buckets.popitem(last=False)

    def _left(self, bucket: tuple[float, float]) -> float:
        left, at = bucket
        return min(float(TRIES), left + (self._clock() - at) / TRY_EVERY_S)

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """The ``Retry-After`` of a refusal for ``wait_s`` (whole seconds, at least 1)."""
        return str(max(1, math.ceil(wait_s)))


def compare(given: str, token: str) -> bool:
    """Whether ``given`` is ``token``, in a time that does not depend on where they differ."""
    return hmac.compare_digest(given.encode(), token.encode())


def hide_bodies(value: Any) -> Any:
    """``value`` (an answer's data) with every command body and every quarantined commit's event
    bodies replaced by ``null`` and marked ``body_hidden``: a ``command`` document's ``body``, a
    ``raw`` commit's ``events[].body`` (a ``raw`` that is no commit is hidden whole)."""
    if isinstance(value, list):
        return [hide_bodies(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k == "command" and isinstance(v, dict) and "body" in v:
            out[k] = {**v, "body": None, "body_hidden": True}
        elif k == "raw":
            out[k] = _hidden_commit(v)
        else:
            out[k] = hide_bodies(v)
    return out


def _hidden_commit(raw: Any) -> Any:
    if not isinstance(raw, dict) or not isinstance(raw.get("events"), list):
        return {"body_hidden": True}
    events = [
        {**e, "body": None, "body_hidden": True} if isinstance(e, dict) else {"body_hidden": True}
        for e in raw["events"]
    ]
    return {**raw, "events": events}


def sign_notice(key: str, text: str) -> str:
    """The signature of a page's notice ``text`` under ``key`` (the process's form key)."""
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()[:32]


def signed_notice(key: str, text: str | None, signature: str | None) -> str | None:
    """``text`` when ``signature`` is its signature under ``key``; else ``None`` (shown not)."""
    if text is None or signature is None:
        return None
    return text if hmac.compare_digest(sign_notice(key, text), signature) else None
