"""A request and an answer of the status page, as the HTTP listener hands them over."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HttpRequest", "HttpResponse"]


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A request for the ``app``: header names in lower case (a repeated header's last value);
    ``client``: the address of the peer (a proxy's, behind one)."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    client: str = ""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
