"""Embedded-only behaviour of the presence records (the contract suite covers the protocol): the
table on a file made without it, and the purge of records expired beyond the retention."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from wowd.model import Owner
from wowd.stores.base import PRESENCE_RETENTION, ReplicaInfo
from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
from wowd.stores.embedded.sqlite import sqlite3

pytestmark = pytest.mark.anyio

NS = "wowd.demo"
TTL = timedelta(seconds=30)
RETENTION_MS = PRESENCE_RETENTION // timedelta(milliseconds=1)


def info(instance: str = "i-1") -> ReplicaInfo:
    return ReplicaInfo(instance=instance, host="h", pid=7, version="1", slots=())


def set_expiry(path: Path, owner_key: str, ms_ago: int) -> None:
    """Moves a record's expiry (and last heartbeat) into the past, as if it stopped long ago."""
    with sqlite3.connect(path) as conn:
        now = conn.execute("SELECT CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)").fetchone()[0]
        conn.execute(
            "UPDATE cosid_replica SET expiresAt = ?, seenAt = ? WHERE ownerKey = ?",
            (now - ms_ago, now - ms_ago - 30_000, owner_key),
        )


async def test_a_file_made_without_the_presence_table_gets_it_on_first_use(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    with sqlite3.connect(path) as conn:  # the lease tables alone, as a file of a version without presence
        conn.execute(
            'CREATE TABLE cosid_namespace (ns TEXT PRIMARY KEY, "limit" INTEGER NOT NULL, '
            "toleranceMs INTEGER NOT NULL, slotOffset INTEGER)"
        )
    store = EmbeddedSlotLeaseStore(path)
    try:
        assert await store.replicas(NS) == []
        await store.heartbeat(NS, "a", info(), TTL)
        assert [r.owner_key for r in await store.replicas(NS)] == ["a"]
        assert (await store.acquire(NS, Owner(key="a"), 1, TTL, timedelta(0))).acquired
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(cosid_replica)")]
    assert cols == [
        "ns",
        "ownerKey",
        "instance",
        "host",
        "pid",
        "version",
        "state",
        "slots",
        "startedAt",
        "seenAt",
        "expiresAt",
    ]


async def test_a_heartbeat_deletes_the_namespaces_records_expired_beyond_the_retention(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    store = EmbeddedSlotLeaseStore(path)
    try:
        for key in ("old", "recent", "alive"):
            await store.heartbeat(NS, key, info(), TTL)
        await store.heartbeat("wowd.other", "old", info(), TTL)
        set_expiry(path, "old", RETENTION_MS + 1_000)  # in both namespaces
        set_expiry(path, "recent", RETENTION_MS - 60_000)

        listed = {r.owner_key: r for r in await store.replicas(NS)}
        assert sorted(listed) == ["alive", "recent"]  # beyond the retention: not listed, even before the purge
        assert not listed["recent"].live and listed["alive"].live

        await store.heartbeat(NS, "alive", info(), TTL)
        with sqlite3.connect(path) as conn:
            rows = sorted(conn.execute("SELECT ns, ownerKey FROM cosid_replica").fetchall())
        # purged in the heartbeat's namespace only; the other namespace's replicas purge their own
        assert rows == [("wowd.demo", "alive"), ("wowd.demo", "recent"), ("wowd.other", "old")]
    finally:
        await store.close()
