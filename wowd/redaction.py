"""The credentials of the settings and their masking: every log line, every message of the
command line and every answer of the status page goes through :func:`redact`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

from wowd.config import WowdSettings
from wowd.signing import SECRET_PREFIX

__all__ = ["MASK", "redact", "secret_values", "unescaped"]

MASK = "**********"


def secret_values(settings: WowdSettings) -> list[str]:
    """Every credential in the settings (tokens and signing secrets of the gateway and of each
    route, the status page's token, the password inside the MongoDB URI and inside the gateway's,
    the routes' and Elasticsearch's URLs), longest first, each also as a JSON text spells it."""
    out: list[str] = []
    gateway = settings.gateway
    candidates = [gateway.token, settings.elasticsearch.api_key, settings.elasticsearch.password, settings.ui.token]
    candidates += gateway.signing_secrets
    for route in gateway.routes:
        candidates += [route.token, *(route.signing_secrets or ())]
    for s in candidates:
        if s is not None and s.get_secret_value():
            value = s.get_secret_value()
            out.append(value)
            if value.startswith(SECRET_PREFIX):
                out.append(value[len(SECRET_PREFIX) :])  # a signing secret's key, as base64
    urls = [gateway.url, settings.elasticsearch.url, *(route.url for route in gateway.routes)]
    if settings.mongodb.uri is not None:
        uri = settings.mongodb.uri.get_secret_value()
        out.append(uri)
        urls.append(uri)
    for url in urls:
        try:
            parts = urlsplit(url) if url else None
            # a token given as the user (https://TOKEN@host) when there is no password
            credential = None if parts is None else parts.password or parts.username
        except ValueError:
            continue
        if credential:
            out += [credential, unquote(credential)]
    # as a JSON text spells them (a quote, a backslash, a non-ASCII character escaped)
    out += [json.dumps(v, ensure_ascii=ascii)[1:-1] for v in out for ascii in (True, False)]
    return sorted({v for v in out if len(v) >= 3}, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s in text:
            text = text.replace(s, MASK)
    return text


_JSON_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\[\\/\"bfnrt]"
)
"""A JSON string escape: a surrogate pair, one ``\\uXXXX``, or one of the short ones."""


def _unescape(match: re.Match[str]) -> str:
    text = match.group()
    try:
        value: str = json.loads(f'"{text}"')
    except ValueError:
        return text
    return text if any("\ud800" <= c <= "\udfff" for c in value) else value  # a lone surrogate stays escaped


def unescaped(text: str) -> str:
    """``text`` with its JSON string escapes (``\\/``, ``\\u0041``, ...) decoded, wherever they
    are: what a target answered in JSON that did not parse (cut short, say) is masked as what it
    says, not as how it spells it."""
    return _JSON_ESCAPE.sub(_unescape, text) if "\\" in text else text
