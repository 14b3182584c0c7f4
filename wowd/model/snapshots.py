"""Snapshots: what a reducer folds into a stored state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from wowd.model.ids import AggregateRef, AggregateType


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    """The state of one aggregate at ``version``, folded by a reducer of ``state_revision``."""

    ref: AggregateRef
    version: int
    state_revision: int
    state: Mapping[str, Any]
    owner_id: str = ""
    space_id: str = ""
    tags: tuple[str, ...] = ()
    access_version: int = 0
    deleted: bool = False
    event_time: int = 0
    stale_version: int | None = None
    """Set by ``mark_stale``/a refused save: the log is at this version, the snapshot behind it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotTable:
    """The rebuild control plane's record of one aggregate type's snapshot collection."""

    type: AggregateType
    revision: int
    """The claimed state revision."""
    rebuilding: bool = False
    backfilled: bool = False
    updated_at: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotSaveOutcome:
    """What ``save_all`` did with one snapshot: ``saved``, ``unchanged`` (the guard kept a newer
    one, possibly marking it stale) or ``failed`` (``reason`` says why; the others still saved)."""

    ref: AggregateRef
    version: int
    status: Literal["saved", "unchanged", "failed"]
    reason: str | None = None

    @staticmethod
    def rounds(snapshots: Sequence[SnapshotRecord]) -> list[list[SnapshotRecord]]:
        """Splits a batch into rounds holding at most one snapshot per aggregate, in order,
        so one bulk write never carries two upserts of one key."""
        rounds: list[list[SnapshotRecord]] = []
        seen: dict[AggregateRef, int] = {}
        for s in snapshots:
            k = seen.get(s.ref, 0)
            seen[s.ref] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(s)
        return rounds
