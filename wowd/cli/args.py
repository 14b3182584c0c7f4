"""Argument types shared by the commands (argparse ``type=`` callables): a value out of range is
refused as argparse refuses any (exit 2, naming the option), never a traceback further on."""

from __future__ import annotations

import argparse
import math

__all__ = ["MAX_INT", "MAX_SECONDS", "non_negative_int", "non_negative_seconds", "positive_int", "seconds"]

MAX_INT = 2**31 - 1
"""The largest count or size an option takes (a store or SQLite would refuse a larger one)."""
MAX_SECONDS = 100 * 365 * 86_400.0
"""The longest time an option takes (a hundred years)."""


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is expected, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_INT}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1 (``--limit``)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (``--misfire-grace-ms``)."""
    return _int_at_least(text, 0)


def seconds(text: str) -> float:
    """A number of seconds, at most a hundred years either way (``--in``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds is expected, got {text!r}") from None
    if not math.isfinite(value) or abs(value) > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"a number of seconds within {MAX_SECONDS:.0f} is expected, got {text!r}")
    return value


def non_negative_seconds(text: str) -> float:
    """A number of seconds of at least 0 (``--older-than-s``)."""
    value = seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
