"""What the commands print: lines on stdout/stderr, tables, JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from wowd.fmt import iso_ms

__all__ = ["at", "confirm", "err", "interactive", "out", "print_json", "print_table", "span"]


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


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


def print_json(doc: Any) -> None:
    out(json.dumps(doc, indent=2))


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]], *, right: Collection[int] = ()) -> None:
    """A header line and one line per row, columns padded to their widest cell (``right``: the
    indexes of right-aligned columns); the last column is not padded."""
    cells = [[str(c) for c in header], *([("-" if c is None else str(c)) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    last = len(header) - 1
    for r in cells:
        parts = []
        for i, c in enumerate(r):
            if i == last:
                parts.append(c.rjust(widths[i]) if i in right else c)
            else:
                parts.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        out("  ".join(parts).rstrip())


def interactive() -> bool:
    """Someone at a terminal answers: standard input and standard error are terminals."""
    try:
        return sys.stdin.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def confirm(question: str, *, yes: bool) -> bool:
    """Asks ``question [y/N]`` at a terminal before a destructive change; True when answered
    yes, when ``yes`` (``--yes``) or when nobody is at a terminal (a script asked for it)."""
    if yes or not interactive():
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    return answer.strip().lower() in ("y", "yes")
