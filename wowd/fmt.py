"""Short human forms for log lines and the command line."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime

__all__ = ["at", "compact_partitions", "iso_ms", "one_line", "span"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Control characters (C0, DEL, C1) and the Unicode line and paragraph separators."""
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    return _SHORT.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def one_line(text: str) -> str:
    """``text`` with each control character written as its escape (``\\n``, ``\\x1b``): what an
    id, a key or a target's answer holds stays on its line of a log or a table, and never
    moves a terminal's cursor or colours (``repr``'s spelling; printable text is unchanged)."""
    return text if text.isprintable() or not _CONTROL.search(text) else _CONTROL.sub(_escape, text)


def iso_ms(ms: int) -> str:
    """``2024-05-01T12:00:00.000+00:00`` for epoch milliseconds."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def compact_partitions(parts: Iterable[int], *, max_chars: int = 120) -> str:
    """A set of partitions in a few characters, with its size: ``0..7 (8 partitions)``,
    ``1,5..61 (16 partitions)`` (arithmetic runs as ``first,second..last``), ``3,9,12 (3
    partitions)``. Runs beyond ``max_chars`` characters are elided with ``...``, so a line
    carrying it stays short whatever the number of partitions."""
    ps = sorted(set(parts))
    n = len(ps)
    if n == 0:
        return "none (0 partitions)"
    pieces: list[str] = []
    i = 0
    while i < n:
        j = i + 1
        if j < n:
            step = ps[j] - ps[i]
            while j + 1 < n and ps[j + 1] - ps[j] == step:
                j += 1
            if j - i >= 2:  # three or more in one arithmetic run
                first, last = ps[i], ps[j]
                pieces.append(f"{first}..{last}" if step == 1 else f"{first},{first + step}..{last}")
                i = j + 1
                continue
        pieces.append(str(ps[i]))
        i += 1
    text = ""
    for k, piece in enumerate(pieces):
        candidate = piece if k == 0 else f"{text},{piece}"
        if len(candidate) > max_chars and k > 0:
            text += ",..."
            break
        text = candidate
    return f"{text} ({n} partition{'s' if n != 1 else ''})"


def span(ms: int) -> str:
    """``0.4 s``, ``12 min``, ``3.5 h``, ``2.0 d``: a human span (never negative)."""
    s = max(0, ms) / 1000
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s // 60:.0f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def at(ms: int, now_ms: int | None = None) -> str:
    """An instant for a table: ISO 8601 in UTC and how far from now (``... (in 5.0 s)``,
    ``... (3 min ago)``); ``--json`` gives epoch milliseconds instead."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rel = f"in {span(ms - now)}" if ms > now else f"{span(now - ms)} ago"
    return f"{iso_ms(ms)} ({rel})"
