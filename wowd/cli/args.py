"""Argument types shared by the commands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_seconds", "positive_int"]


def positive_int(text: str) -> int:
    """An integer of at least 1 (``--limit``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is expected, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_seconds(text: str) -> float:
    """A number of seconds of at least 0 (``--older-than-s``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds is expected, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
