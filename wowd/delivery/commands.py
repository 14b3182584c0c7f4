"""A command's request: its URL in Wow's REST shape and its body."""

from __future__ import annotations

import functools
import json
import re
from typing import Any
from urllib.parse import quote

import orjson

from wowd.model import DEFAULT_TENANT, AggregateRef, Command, Timer


class UnsafeSegment(ValueError):
    """A part of a command's URL that would not stay one path segment under the route's base:
    empty, ``.`` or ``..`` (a server or proxy in front of the target removes it, or goes up a
    level, however it is encoded: RFC 3986 reads ``%2E`` as ``.``)."""


def command_url(base: str, timer: Timer, command: Command | None = None) -> str:
    """``{base}/[tenant/{tenant_id}/]{aggregate}/{id}/{command}`` (Wow's REST shape); each path
    part percent-encoded; the tenant part only for a tenant other than the default. ``command``:
    the timer's, when already read. Raises :class:`UnsafeSegment` for a part that is empty,
    ``.`` or ``..``: every URL stays under ``base``."""
    return target_command_url(base, timer.target, (command or timer.command).name)


def target_command_url(base: str, target: AggregateRef, name: str) -> str:
    return (
        _url_prefix(base, target.tenant_id, target.aggregate)
        + _segment(target.id, "target id")
        + "/"
        + _segment(name, "command name")
    )


_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+").fullmatch
"""A path segment ``quote(..., safe="")`` leaves as it is."""


def _segment(part: str, what: str) -> str:
    """``part`` percent-encoded as one path segment; :class:`UnsafeSegment` for one that would
    not stay a segment (``what`` names the part)."""
    if part in ("", ".", ".."):
        raise UnsafeSegment(f"the {what} {part!r} is not a path segment of its own (empty, '.' or '..')")
    return part if _UNRESERVED(part) else quote(part, safe="")


@functools.lru_cache(maxsize=1024)
def _url_prefix(base: str, tenant_id: str, aggregate: str) -> str:
    prefix = base.rstrip("/") + "/"
    if tenant_id != DEFAULT_TENANT:
        prefix += "tenant/" + _segment(tenant_id, "tenant id") + "/"
    return prefix + aggregate + "/"  # a name: [a-z0-9_-]+


class _NotJson(ValueError):
    """NaN or an infinity in a command body (the standard encoder writes them as they were)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_LONG_NUMBER = re.compile(r"\d{16}").search
"""A run of digits a 64-bit integer or a double may not hold exactly."""


def request_parts(text: str) -> tuple[str, bytes, str | None]:
    """A timer's command JSON text (``{name, body_type?, body}``) as the request's name, body
    (compact JSON bytes) and ``Command-Type``; raises ``ValueError``, ``KeyError`` or
    ``TypeError`` for an unreadable one. Numbers keep their precision (integers of any size)."""
    if _LONG_NUMBER(text) is None:  # orjson reads an integer past 64 bits as a float
        try:
            doc = orjson.loads(text)  # the usual body; what it refuses goes the standard way below
        except orjson.JSONDecodeError:
            pass
        else:
            return doc["name"], orjson.dumps(_body(doc)), doc.get("body_type")
    try:
        doc = _DECODER.decode(text)
    except _NotJson:
        command = Command.from_json(text)
        body_text = json.dumps(dict(command.body), separators=(",", ":"))
        return command.name, body_text.encode(), command.body_type
    name = doc["name"]
    body = _body(doc)
    try:
        payload = orjson.dumps(body)
    except TypeError:  # an integer beyond 64 bits, a lone surrogate: the standard encoder
        payload = json.dumps(body, separators=(",", ":")).encode()
    return name, payload, doc.get("body_type")


def _body(doc: Any) -> dict[str, Any]:
    body = doc.get("body", {})
    return body if type(body) is dict else dict(body)
