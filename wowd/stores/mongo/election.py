"""The lease's time against the replica set's election timeout (docs/concepts.md, "Elections").

A holder cut off from the majority together with the old primary keeps its lease, on its own
clock, until ``sent + ttl - tolerance`` of its last renewal; the old primary goes on answering
its reads (the log check among them) from its own, no longer current, state. Only once a new
primary is elected can another writer commit a cancel the holder does not see, and an election
takes at least ``electionTimeoutMillis``. So the holder is harmless while ``ttl - tolerance <
electionTimeoutMillis``: it stops before a new primary can take any write.
:func:`election_window` reads the replica set's setting (``replSetGetConfig``) and says whether
the lease settings keep to it; where the setting cannot be read it says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure, PyMongoError

from wowd.stores.mongo._common import UNAUTHORIZED

__all__ = ["DEFAULT_ELECTION_TIMEOUT_MS", "ElectionWindow", "election_window"]

DEFAULT_ELECTION_TIMEOUT_MS = 10_000
"""``settings.electionTimeoutMillis`` when a replica set's configuration does not set it."""
COMMAND_NOT_FOUND = 59


@dataclass(frozen=True, slots=True)
class ElectionWindow:
    """``safe``: the lease stops before an election can end (None: not known); ``text``: the
    arithmetic, or why it could not be made."""

    safe: bool | None
    text: str


async def election_window(client: AsyncMongoClient[Any], *, ttl: timedelta, tolerance: timedelta) -> ElectionWindow:
    """``ttl - tolerance`` against the replica set's ``electionTimeoutMillis`` (one
    ``replSetGetConfig`` on ``admin``: the ``replSetGetConfig`` privilege action on the cluster,
    which the ``clusterMonitor`` role has; a ``mongos`` has no such command: each shard's replica
    set has its own setting)."""
    held_ms = int((ttl - tolerance).total_seconds() * 1000)
    try:
        reply = await client.admin.command("replSetGetConfig")
    except OperationFailure as exc:
        if exc.code == UNAUTHORIZED:
            return ElectionWindow(
                None,
                "not checked: the user may not run replSetGetConfig; grant the replSetGetConfig action on the "
                f"cluster (the clusterMonitor role has it) to check lease ttl_s - tolerance_s ({held_ms} ms) "
                "against the replica set's electionTimeoutMillis",
            )
        if exc.code == COMMAND_NOT_FOUND:
            return ElectionWindow(
                None,
                "not checked: a mongos has no replSetGetConfig; keep lease ttl_s - tolerance_s "
                f"({held_ms} ms) below each shard replica set's settings.electionTimeoutMillis",
            )
        return ElectionWindow(None, f"not checked: replSetGetConfig answered {exc}")
    except PyMongoError as exc:
        return ElectionWindow(None, f"not checked: replSetGetConfig failed: {exc}")
    config = reply.get("config") or {}
    timeout = (config.get("settings") or {}).get("electionTimeoutMillis", DEFAULT_ELECTION_TIMEOUT_MS)
    name = config.get("_id", "?")
    if held_ms < timeout:
        return ElectionWindow(
            True,
            f"lease ttl_s - tolerance_s = {held_ms} ms < electionTimeoutMillis {timeout} ms of replica set {name}: "
            "a holder cut off with the old primary stops before a new primary can be elected",
        )
    return ElectionWindow(
        False,
        f"lease ttl_s - tolerance_s = {held_ms} ms >= electionTimeoutMillis {timeout} ms of replica set {name}: a "
        f"holder cut off with the old primary may go on firing for up to {held_ms - timeout} ms after a new primary "
        "could take a cancel it does not see; lower WOWD_LEASE__TTL_S (or raise WOWD_LEASE__TOLERANCE_S), or raise "
        "the replica set's settings.electionTimeoutMillis (docs/concepts.md, Elections)",
    )
