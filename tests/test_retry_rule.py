"""Every retry of wowd goes through ``wowd.retry``: no module sleeps in a loop's error handler
or computes a backoff itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "wowd"
SLEEPS = {"sleep", "move_on_after"}


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _retry_loops(tree: ast.AST) -> list[int]:
    """Lines of loops whose error handler sleeps (a hand-written retry)."""
    found = []
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.While, ast.For, ast.AsyncFor)):
            continue
        for handler in (n for n in ast.walk(loop) if isinstance(n, ast.ExceptHandler)):
            if any(_called(n) in SLEEPS for n in ast.walk(handler)):
                found.append(loop.lineno)
    return found


def _backoffs_called(tree: ast.AST) -> list[int]:
    """Lines where a backoff is computed by hand (a name ending in BACKOFF or backoff, called)."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and (_called(n) or "").lower().endswith("backoff") and _called(n) != "Backoff"
    ]


@pytest.mark.parametrize("path", sorted(p for p in ROOT.rglob("*.py") if p.name != "retry.py"), ids=str)
def test_no_hand_written_retry_loop(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    assert not _retry_loops(tree), f"{path}: a loop sleeps in its error handler; use wowd.retry"
    assert not _backoffs_called(tree), f"{path}: a backoff computed by hand; use wowd.retry"


def test_the_rule_finds_a_hand_written_retry() -> None:
    code = """
async def f():
    attempt = 0
    while True:
        try:
            return await g()
        except StorageUnavailable:
            await anyio.sleep(RETRY_BACKOFF(attempt))
            attempt += 1
"""
    tree = ast.parse(code)
    assert _retry_loops(tree) == [4]
    assert _backoffs_called(tree) == [8]
