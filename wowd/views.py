"""The views a slot's feed keeps from the log, each with checkpoints of its own (docs/concepts.md).

- ``timers``: the timer view (timer events projected, PARKED timers resumed when their aggregate
  commits). Its checkpoint consumer is ``wowd``, the name the feed's single checkpoint had, so an
  existing store carries on from it.
- ``index``: the event index (each commit as a document of its type's sink), consumer
  ``wowd.index``.
- ``snapshots.<aggregate>``: the snapshots of one aggregate type with a reducer, consumer
  ``wowd.snapshots.<aggregate>``.

A view with no checkpoint for a partition starts where the ``wowd`` checkpoint is (the timer
view's, and the one checkpoint all views shared before they had their own): an upgraded store
carries on in place, and a view switched on later starts at the log's present, as a view added
to a running feed always has (snapshots of earlier commits are a rebuild's work). A checkpoint
whose position is empty (:data:`FROM_START`) starts the view at the log's first commit: that is
how one view is replayed alone (:func:`reset_view`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wowd.config import WowdSettings
from wowd.errors import ConfigError
from wowd.model import Checkpoint, Position
from wowd.stores.base import Checkpoints

__all__ = [
    "FROM_START",
    "INDEX",
    "LEGACY_CONSUMER",
    "SNAPSHOTS",
    "TIMERS",
    "View",
    "enabled_views",
    "reset_view",
    "start_positions",
    "stored_checkpoints",
    "view_named",
]

TIMERS = "timers"
INDEX = "index"
SNAPSHOTS = "snapshots"
LEGACY_CONSUMER = "wowd"
"""The timer view's checkpoint consumer, where a view without checkpoints of its own starts."""
FROM_START: Position = {}
"""The position of a reset checkpoint: the view reads the log from its first commit."""


@dataclass(frozen=True, slots=True)
class View:
    """One view: ``name`` (``timers``, ``index`` or ``snapshots.<aggregate>``), its checkpoint
    ``consumer``, and for a snapshot view the ``aggregate`` it folds."""

    name: str
    consumer: str
    aggregate: str | None = None


def view_named(name: str) -> View:
    """The view called ``name``; a :class:`ConfigError` for a name that is none."""
    if name == TIMERS:
        return View(TIMERS, LEGACY_CONSUMER)
    if name == INDEX:
        return View(INDEX, "wowd.index")
    kind, dot, aggregate = name.partition(".")
    if kind == SNAPSHOTS and dot and aggregate:
        return View(name, f"wowd.snapshots.{aggregate}", aggregate)
    raise ConfigError(f"{name!r} is not a view: timers, index or snapshots.<aggregate>")


def enabled_views(settings: WowdSettings, reducers: Iterable[str]) -> tuple[View, ...]:
    """The views the feed keeps, in the order it applies them: the timer view, the event index
    (unless ``sink`` is ``none``), a snapshot view per reducer; less those ``feed.views_off``
    names (``snapshots`` names every snapshot view)."""
    off = set(settings.feed.views_off)
    names = [TIMERS]
    if settings.sink != "none":
        names.append(INDEX)
    names += [f"{SNAPSHOTS}.{a}" for a in sorted(reducers)]
    return tuple(
        view_named(n) for n in names if n not in off and not (n.startswith(f"{SNAPSHOTS}.") and SNAPSHOTS in off)
    )


async def stored_checkpoints(
    checkpoints: Checkpoints, views: Iterable[View], partitions: Sequence[int]
) -> tuple[dict[int, Checkpoint], dict[View, dict[int, Checkpoint]]]:
    """The ``wowd`` checkpoints of ``partitions`` and each view's own (the timer view's are the
    ``wowd`` ones, read once)."""
    legacy = await checkpoints.read(LEGACY_CONSUMER, partitions)
    own = {
        v: legacy if v.consumer == LEGACY_CONSUMER else await checkpoints.read(v.consumer, partitions) for v in views
    }
    return legacy, own


def start_positions(
    own: Mapping[int, Checkpoint], legacy: Mapping[int, Checkpoint], partitions: Sequence[int]
) -> dict[int, Position | None]:
    """Where a view reads each partition from: its own checkpoint (:data:`FROM_START`: the
    first commit), else the ``wowd`` one (``legacy``), else the first commit."""
    out: dict[int, Position | None] = {}
    for p in partitions:
        cp = own.get(p) or legacy.get(p)
        out[p] = cp.position if cp is not None and cp.position else None
    return out


async def reset_view(checkpoints: Checkpoints, view: View, partitions: Sequence[int], fence: int) -> bool:
    """Makes ``view`` read ``partitions`` again from the log's first commit, at the next start
    of their feed (a replica taking the slot, a restart): a :data:`FROM_START` checkpoint under
    ``fence``, with no feed of these partitions running (a running one saves its own position
    over it). Replaying the timer view is safe: the tombstones keep what fired or was cancelled
    within their retention from firing again. False when a higher fence holds one."""
    return await checkpoints.save_all(view.consumer, dict.fromkeys(partitions, FROM_START), fence)


async def views_status(
    settings: WowdSettings, checkpoints: Checkpoints, reducers: Iterable[str]
) -> list[dict[str, Any]]:
    """Each view kept by the replicas of ``settings``, from the stores: its checkpoint consumer
    and the partitions where its checkpoint is not the timer view's (``behind``: a view that
    fell behind, or is catching up, reads them on its own; an index or snapshot view ahead of
    a stalled timer view counts too)."""
    parts = list(range(settings.partitions))
    legacy, own = await stored_checkpoints(checkpoints, enabled_views(settings, reducers), parts)
    lead = start_positions(legacy, legacy, parts)
    out: list[dict[str, Any]] = []
    for v, stored in own.items():
        at = start_positions(stored, legacy, parts)
        behind = [p for p in parts if at[p] != lead[p]]
        out.append({"view": v.name, "consumer": v.consumer, "partitions_behind": behind})
    return out
