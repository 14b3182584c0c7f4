"""Snapshot reducers: the user's fold of a state over events, loaded from ``module:attribute``."""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from wowd.errors import ConfigError, ReducerFailed
from wowd.model import Commit, DomainEvent, SnapshotRecord

__all__ = ["Reducer", "fold_commit", "load_reducer"]


class Reducer(Protocol):
    state_revision: int

    def fold(self, state: dict[str, Any], event: DomainEvent) -> dict[str, Any]: ...


def fold_commit(reducer: Reducer, current: SnapshotRecord | None, commit: Commit) -> SnapshotRecord:
    """The snapshot after ``commit`` folded on ``current`` (``None``: before version 1), as the feed
    and the rebuilds fold it: the events in order, then the commit's access attributes and deleted
    flag. Raises :class:`~wowd.errors.ReducerFailed`, naming the commit, when the reducer raises."""
    try:
        return _folded(reducer, current, commit)
    except Exception as exc:  # the reducer's own code: its failure is its snapshot type's
        raise ReducerFailed(
            f"reducer of {commit.ref.aggregate} raised on {commit.ref} v{commit.version}: {exc!r}"
        ) from exc


def _folded(reducer: Reducer, current: SnapshotRecord | None, commit: Commit) -> SnapshotRecord:
    state: dict[str, Any] = dict(current.state) if current is not None else {}
    for ev in commit.events:
        state = reducer.fold(state, ev)
    tags = commit.access.get("tags") or ()
    return SnapshotRecord(
        ref=commit.ref,
        version=commit.version,
        state_revision=reducer.state_revision,
        state=state,
        owner_id=commit.owner_id,
        space_id=commit.space_id,
        tags=tuple(str(t) for t in tags) if isinstance(tags, list | tuple) else (),
        access_version=commit.access_version,
        deleted=commit.deleted,
        event_time=commit.create_time,
    )


def load_reducer(path: str) -> Reducer:
    """Imports ``module:attribute``; a missing or incomplete reducer is a :class:`ConfigError`."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reducer {path!r}: expected 'module:attribute'")
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reducer {path!r}: {exc}") from exc
    if not isinstance(getattr(obj, "state_revision", None), int) or not callable(getattr(obj, "fold", None)):
        raise ConfigError(f"reducer {path!r}: needs state_revision: int and fold(state, event)")
    return obj  # type: ignore[no-any-return]
