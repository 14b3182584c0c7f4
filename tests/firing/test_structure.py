"""Firing is one component: the shape that keeps it so, read from the source.

The fire rule and its round strategies live in ``wowd/daemon/firing.py``; the outbox shortcut is
a capability one store declares and the assembly chooses; gateways only send, and every limit of
the deliveries is the delivery stream's; the feed applies the log and fires nothing."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from wowd.daemon.timers import TimerLoop

ROOT = Path(__file__).resolve().parents[2] / "wowd"
SHORTCUT = re.compile(
    r"\b(OUTBOX_SHORTCUT|OutboxShortcut|OutboxRound|OutboxFired|fire_into_outbox|fast_path)\b|shortcut"
)
"""How code names the outbox shortcut: its capability, its protocol and calls, its setting, or the word."""


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_the_outbox_shortcut_is_named_in_four_modules_only() -> None:
    # the protocol (stores/base.py), the store that offers it (embedded/timer_firing.py), the round
    # strategy that uses it (daemon/firing.py) and its setting (config.py)
    naming = sorted(path for path, text in _sources().items() if SHORTCUT.search(text))
    assert naming == [
        "wowd/config.py",
        "wowd/daemon/firing.py",
        "wowd/stores/base.py",
        "wowd/stores/embedded/timer_firing.py",
    ]


def _imported(text: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_feed_applies_the_log_and_knows_no_delivery() -> None:
    feed = [p for p in _sources() if p.startswith("wowd/daemon/feed")]
    assert feed, "the feed's modules moved"
    for path in feed:
        imported = _imported((ROOT.parent / path).read_text())
        assert not {m for m in imported if m == "wowd.delivery" or m.startswith("wowd.delivery.")}, path
        assert not {m for m in imported if m == "wowd.daemon.firing"}, path


SCHEDULING = re.compile(
    r"\b(Semaphore|BoundedSemaphore|CapacityLimiter|create_memory_object_stream|Queue|LifoQueue|PriorityQueue"
    r"|create_task_group|TaskGroup|ThreadPoolExecutor|gather)\b"
)
"""What schedules work: a limit, a queue, a pool of workers."""


def test_gateways_only_send_the_stream_schedules() -> None:
    scheduling = {
        path: sorted(set(SCHEDULING.findall(text)))
        for path, text in _sources().items()
        if path.startswith("wowd/delivery/") and SCHEDULING.search(text)
    }
    assert scheduling == {}


def test_the_timer_loop_takes_a_strategy_and_no_firing_mode() -> None:
    params = inspect.signature(TimerLoop.__init__).parameters
    assert "strategy" in params
    assert not set(params) & {"fused", "check_log", "gate", "fast_path", "shortcut", "outbox", "gateway"}
    assert [n for n, p in params.items() if p.annotation in (bool, "bool")] == []
