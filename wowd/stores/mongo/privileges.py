"""The MongoDB privileges each store needs, and the check of a user's (``wowd check``).

:func:`required_privileges` lists, per store, the privilege actions and the resources they are
needed on, as the DDL and sharding modes ask; :func:`missing_privileges` compares them with the
privileges of ``connectionStatus`` with ``showPrivileges`` (the user's roles resolved by the
server) by the server's resource rules (manual, "Resource Document on Self-Managed
Deployments"): ``{db: D, collection: ""}`` is every collection of ``D`` but the system ones,
``{db: "", collection: ""}`` every such collection of every database, ``{cluster: true}`` the
cluster, ``{anyResource: true}`` everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pymongo import AsyncMongoClient

from wowd.stores.base import Ddl
from wowd.stores.mongo._common import (
    NAMESPACE_COLLECTION,
    REPLICA_COLLECTION,
    SLOT_COLLECTION,
    SNAPSHOT_TABLES,
    TIMER_REGISTRY,
    MongoSharding,
    checkpoint_collection,
    outbox_collection,
    quarantine_collection,
    translate_errors,
)
from wowd.stores.mongo.history import history_collection

__all__ = ["Need", "check_privileges", "check_user", "missing_privileges", "required_privileges"]

ANY = ""
"""``collection: ""``: every (non-system) collection of the database."""


@dataclass(frozen=True, slots=True)
class Need:
    """Privilege ``actions`` a ``store`` needs on a resource: the collection ``collection`` of
    ``db`` (``""``: every collection of it, the per-type collections of the store among them),
    or the cluster. ``why`` says what for."""

    store: str
    actions: tuple[str, ...]
    db: str = ""
    collection: str = ANY
    cluster: bool = False
    why: str = ""

    @property
    def resource(self) -> str:
        if self.cluster:
            return "the cluster"
        return f"{self.db}.{self.collection}" if self.collection else f"every collection of {self.db}"


def required_privileges(database: str, context: str, *, ddl: Ddl, sharded: bool) -> list[Need]:
    """What the log, leases, timers, snapshots and outbox of ``context`` need on ``database``.
    ``sharded``: on a sharded cluster with sharding on (``auto`` on ``mongos``, or ``on``)."""
    d = database
    rw = ("find", "insert", "update")
    needs = [
        Need("log", ("find", "insert"), d, why="append and read the commits (wow_log__<context>__*)"),
        Need("log", ("listCollections", "changeStream", "find"), d, why="list the log collections and watch them"),
        Need("log", rw, d, checkpoint_collection(context), why="the feed's checkpoints"),
        Need("log", (*rw, "remove"), d, quarantine_collection(context), why="quarantine, its listing and release"),
        Need("leases", (*rw, "remove"), d, SLOT_COLLECTION, why="slot leases"),
        Need("leases", rw, d, NAMESPACE_COLLECTION, why="lease namespaces"),
        Need("leases", (*rw, "remove"), d, REPLICA_COLLECTION, why="presence records"),
        Need("timers", (*rw, "remove"), d, TIMER_REGISTRY, why="the timer registry"),
        Need("timers", rw, d, why="the timers (wow_timer__<context>__*)"),
        Need("snapshots", rw, d, SNAPSHOT_TABLES, why="the snapshots' control plane"),
        Need("snapshots", rw, d, why="the snapshots (wow_snapshot__<context>__*)"),
        Need("outbox", (*rw, "remove"), d, outbox_collection(context), why="put, take (its leases), ack, trim"),
        Need("history", rw, d, history_collection(context), why="the timers' history"),
    ]
    if ddl is Ddl.AUTO:
        needs += [
            Need("all", ("createCollection", "createIndex"), d, why="ddl=auto creates collections and indexes"),
            Need("timers", ("dropCollection",), d, why="ddl=auto drops a timer collection of another format"),
        ]
    if ddl is not Ddl.AUTO:
        needs.append(Need("all", ("listIndexes",), d, why=f"ddl={ddl.value} checks the indexes"))
    if sharded:
        needs += [
            Need("log, timers, snapshots", ("enableSharding",), d, why="shardCollection of a new collection"),
            Need("timers", ("listShards",), cluster=True, why="the chunk spread (wowd check --prepare)"),
            Need("timers", ("find",), "config", "collections", why="the chunk spread counts a collection's chunks"),
            Need("timers", ("find",), "config", "chunks", why="the chunk spread counts a collection's chunks"),
            Need("timers", ("splitChunk", "moveChunk"), d, why="the chunk spread (split, moveRange)"),
        ]
    return needs


def _covers(resource: Mapping[str, Any], need: Need) -> bool:
    if resource.get("anyResource"):
        return True
    if need.cluster:
        return bool(resource.get("cluster"))
    db, coll = resource.get("db"), resource.get("collection")
    if not isinstance(db, str) or not isinstance(coll, str) or db not in ("", need.db):
        return False
    return coll == ANY or coll == need.collection


def missing_privileges(needs: Iterable[Need], privileges: Sequence[Mapping[str, Any]]) -> list[tuple[Need, str]]:
    """Each action of ``needs`` that no privilege of ``privileges`` (``connectionStatus``'s
    ``authenticatedUserPrivileges``) grants on its resource, with its need."""
    missing: list[tuple[Need, str]] = []
    for need in needs:
        granted = {a for p in privileges if _covers(p.get("resource") or {}, need) for a in p.get("actions") or ()}
        missing += [(need, action) for action in need.actions if action not in granted]
    return missing


async def check_privileges(client: AsyncMongoClient[Any], needs: Sequence[Need]) -> list[tuple[Need, str]] | None:
    """``connectionStatus`` with ``showPrivileges``: the actions of ``needs`` the connected user
    lacks; ``None`` when no user is authenticated (access control is off, or the URI names no
    user: nothing to compare)."""
    with translate_errors("connectionStatus"):
        reply = await client.admin.command("connectionStatus", showPrivileges=True)
    info = reply.get("authInfo") or {}
    if not info.get("authenticatedUsers"):
        return None
    return missing_privileges(needs, info.get("authenticatedUserPrivileges") or [])


async def check_user(
    client: AsyncMongoClient[Any], database: str, context: str, *, ddl: Ddl, sharding: MongoSharding
) -> list[tuple[Need, str]] | None:
    """:func:`check_privileges` of what the stores need as the modes ask (``sharding=auto``:
    sharded when the server is a ``mongos``)."""
    sharded = sharding is MongoSharding.ON
    if sharding is MongoSharding.AUTO:
        with translate_errors("hello"):
            hello = await client.admin.command("hello")
        sharded = hello.get("msg") == "isdbgrid"
    return await check_privileges(client, required_privileges(database, context, ddl=ddl, sharded=sharded))
