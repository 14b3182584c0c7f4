"""Argument types shared by the commands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "non_negative_seconds", "positive_int"]


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is expected, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1 (``--limit``)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (``--misfire-grace-ms``)."""
    return _int_at_least(text, 0)


def non_negative_seconds(text: str) -> float:
    """A number of seconds of at least 0 (``--older-than-s``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds is expected, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
