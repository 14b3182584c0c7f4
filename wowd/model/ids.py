"""Identities: names, aggregate types and references, partitions, stream ids."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from operator import mul
from urllib.parse import quote

from wowd.errors import ConfigError, InvalidInput

DEFAULT_TENANT = "(0)"
"""Wow's default tenant id."""

MAX_BODY_BYTES = 64 * 1024
"""Default limit of a timer command's JSON text (configurable in the daemon)."""

MAX_COMMIT_EVENTS = 10_000
"""Events of one commit, at most, on every backend: its event-index document holds them as nested
documents, and Elasticsearch refuses more than ``index.mapping.nested_objects.limit`` (10,000)."""

MAX_COMMIT_DOCUMENT_BYTES = 10 * 1024 * 1024
"""The event-index document of one commit, at most, on every backend (10 MiB): Elasticsearch's
indexing pressure refuses an operation over 10 % of a node's heap (a 100 MiB heap's worth here),
and it stays under MongoDB's 16 MiB document."""

MAX_STREAM_KEY_BYTES = 512 - len("::") - len(str(2**63 - 1))
"""The percent-encoded tenant id and aggregate id of an aggregate, together, at most (491
bytes): its commits' event-index document id (:func:`stream_id`, with a version of up to 19
digits) stays within Elasticsearch's 512 bytes. Checked when an :class:`AggregateRef` is made,
so that a commit gets the same fate on every backend (refused by the client, quarantined by the
feed), not only on the one whose index would refuse it."""

_FAST_KEY_CHARS = MAX_STREAM_KEY_BYTES // 12
"""A tenant id and an aggregate id of at most this many characters together are within
:data:`MAX_STREAM_KEY_BYTES` whatever they hold (a character percent-encodes to 12 bytes at most)."""

_NAME = re.compile(r"[a-z0-9_-]+")
"""A name's characters, the whole name (``fullmatch``: ``$`` would let a final newline pass)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""The control characters (Unicode's ``Cc``: C0, DEL, C1), refused in ids and keys."""


def refuse_controls(value: str, *, field: str) -> str:
    """``value`` when it holds no control character; else :class:`InvalidInput` naming ``field``
    and the first one. An id or a key is joined with others by ``\\x1f`` into a timer's id,
    and is shown in logs and terminals: a control character in it could make two timers one,
    or rewrite what an operator reads."""
    if not value.isprintable():  # an ASCII string is printable exactly when it has none
        found = _CONTROL.search(value)
        if found is not None:
            raise InvalidInput(
                f"holds the control character {found.group()!r} at {found.start()}: ids and keys may not", field=field
            )
    return value


_VALID_NAMES: set[str] = set()
"""Names already found valid (a context has a handful; every commit read names them again)."""


def validate_name(value: str, *, field: str = "name") -> str:
    """A context or aggregate name: ``[a-z0-9_-]+``, lower case, at most 64 characters.

    It becomes part of collection and index names, so anything else is refused.
    """
    if value.__class__ is str and value in _VALID_NAMES:
        return value
    if not isinstance(value, str) or not _NAME.fullmatch(value) or len(value) > 64:
        raise ConfigError(f"{field}: {value!r} is not a valid name (lower-case [a-z0-9_-], 1..64 characters)")
    if len(_VALID_NAMES) < 10_000:
        _VALID_NAMES.add(value)
    return value


_HASH_POWERS = [pow(31, i, 1 << 32) for i in range(1024)][::-1]
"""``31 ** k mod 2 ** 32`` for k = 1023 .. 0: the weights of Java's string hash, last unit last."""


@lru_cache(maxsize=65_536)
def java_string_hash(s: str) -> int:
    """Java's ``String.hashCode`` over the UTF-16 code units of ``s``, as a signed 32-bit int.

    ``sum(unit_i * 31 ** (n - 1 - i)) mod 2 ** 32``: an ASCII string's bytes are its code units,
    weighed in one ``sum`` over the precomputed powers; any other string unit by unit."""
    if s.isascii() and len(s) <= len(_HASH_POWERS):
        data = s.encode()
        weighed: int = sum(map(mul, data, _HASH_POWERS[len(_HASH_POWERS) - len(data) :]))
        h = weighed & 0xFFFFFFFF
    else:
        units = s.encode("utf-16-be", "surrogatepass")
        h = 0
        for i in range(0, len(units), 2):
            h = (31 * h + ((units[i] << 8) | units[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def partition(aggregate_id: str, n: int) -> int:
    """``floorMod(javaStringHashCode(aggregate_id), n)``: Wow's ``AggregateId.mod``."""
    if n < 1:
        raise ConfigError(f"partitions: must be >= 1, got {n}")
    return java_string_hash(aggregate_id) % n  # Python's % is a floor mod


# --------------------------------------------------------------------------- identities


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class AggregateType:
    """An aggregate type of a bounded context."""

    context: str
    aggregate: str

    def __post_init__(self) -> None:
        validate_name(self.context, field="context")
        validate_name(self.aggregate, field="aggregate")

    def __str__(self) -> str:
        return f"{self.context}.{self.aggregate}"


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class AggregateRef:
    """One aggregate: ``(context, aggregate, tenant_id, id)``."""

    context: str
    aggregate: str
    id: str
    tenant_id: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        validate_name(self.context, field="context")
        validate_name(self.aggregate, field="aggregate")
        if not isinstance(self.id, str):
            raise InvalidInput("must be a string", field="aggregate_id")
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise InvalidInput("must be a non-empty string", field="tenant_id")
        refuse_controls(self.id, field="aggregate_id")
        refuse_controls(self.tenant_id, field="tenant_id")
        if len(self.id) + len(self.tenant_id) > _FAST_KEY_CHARS:
            size = len(_percent_encoded(self.tenant_id)) + len(_percent_encoded(self.id))
            if size > MAX_STREAM_KEY_BYTES:
                raise InvalidInput(
                    f"is too long: {size} bytes percent-encoded with its tenant id, at most {MAX_STREAM_KEY_BYTES}"
                    " on every backend (the event index's document id)",
                    field="aggregate_id",
                )

    @property
    def type(self) -> AggregateType:
        return AggregateType(context=self.context, aggregate=self.aggregate)

    def partition(self, n: int) -> int:
        return partition(self.id, n)

    def __str__(self) -> str:
        return f"{self.context}.{self.aggregate}/{self.tenant_id}/{self.id}"


_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]*")


@lru_cache(maxsize=4096)
def _percent_encoded(part: str) -> str:
    # quote(safe="") leaves exactly the unreserved characters alone: skip it when that is all
    return part if _UNRESERVED.fullmatch(part) else quote(part, safe="")


def stream_id(ref: AggregateRef, version: int) -> str:
    """The event document id: tenant, aggregate id and version, each percent-encoded, joined by ``:``."""
    return f"{_percent_encoded(ref.tenant_id)}:{_percent_encoded(ref.id)}:{version}"
