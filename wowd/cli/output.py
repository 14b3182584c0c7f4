"""What the commands print: lines on stdout/stderr, tables, JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from wowd.fmt import at, one_line, span
from wowd.redaction import redact

__all__ = ["at", "confirm", "err", "interactive", "mask", "out", "print_json", "print_table", "span"]

_SECRETS: list[str] = []
"""The credentials of the command's settings (:func:`mask`), masked in everything it prints."""


def mask(secrets: Collection[str]) -> None:
    """Masks ``secrets`` (:func:`wowd.redaction.secret_values` of the settings) in every line
    printed from now on, as the log lines and the status page mask them: a stored value (a
    timer's last error) may hold what a target echoed."""
    _SECRETS[:] = secrets


def out(text: str = "") -> None:
    sys.stdout.write((redact(text, _SECRETS) if _SECRETS else text) + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write((redact(text, _SECRETS) if _SECRETS else text) + "\n")
    sys.stderr.flush()


def print_json(doc: Any) -> None:
    out(json.dumps(doc, indent=2))


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]], *, right: Collection[int] = ()) -> None:
    """A header line and one line per row, columns padded to their widest cell (``right``: the
    indexes of right-aligned columns); the last column is not padded. A control character in a
    cell is written as its escape (:func:`~wowd.fmt.one_line`)."""
    cells = [[str(c) for c in header], *([("-" if c is None else one_line(str(c))) for c in row] for row in rows)]
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
