"""CosId-style slot leases on SQLite (docs/concepts.md).

Tables (the seed's documents as rows, the seed's field names as columns):

- ``cosid_slot``: ``(ns, slot)`` primary key, ``ownerKey``, ``incarnation``, ``lastOwnerKey``,
  ``fence``, ``expiresAt``, ``floor``, ``ceiling``, ``nextFloor``, ``writtenAt``;
- ``cosid_namespace``: ``ns`` primary key, ``limit``, ``toleranceMs``, ``slotOffset`` (NULL reads
  as 0 and is never rewritten);
- ``clock_probe``: one row, the owner key and this process's clock at the last start-up clock
  check (:meth:`EmbeddedSlotLeaseStore.clock_reading`), written so that the file's modification
  time can be compared with the process's clock;
- ``cosid_replica``: the presence record of each replica, ``(ns, ownerKey)`` primary key,
  ``instance``, ``host``, ``pid``, ``version``, ``state``, ``slots`` (a JSON array),
  ``startedAt``, ``seenAt``, ``expiresAt`` (store clock). A heartbeat is one upsert stamped with
  the store's now, and deletes the namespace's records expired more than
  :data:`~wowd.stores.base.PRESENCE_RETENTION` ago in the same transaction.

The store clock is SQLite's ``now`` (:data:`~wowd.stores.embedded.db.NOW_MS`): the clock of the
process that runs the statement, so replicas sharing the file must agree on the time (they share
the host's clock; :meth:`EmbeddedSlotLeaseStore.clock_reading` lets a replica check at start). It is
evaluated once per statement (``UPDATE ... FROM (SELECT now) AS clk``), so ``writtenAt`` and ``expiresAt`` come from
the same write. An acquire runs in one short ``BEGIN IMMEDIATE`` transaction (processes sharing
the file serialise on SQLite's write lock), and each step that takes a slot is one conditional
``UPDATE ... RETURNING`` whose ``WHERE`` holds the whole condition (free by the store clock, the
fence read for the sticky step), so it stays right even without the transaction.

The idempotent step (the owner key holds a live slot) writes nothing: it answers the stored
lease with the store's now of the read (``SlotLease.store_now``), so the holder counts only the
lease's remaining time.

Fence: +1 on every take, i.e. on every acquire that is not the holder's idempotent re-acquire of
its live lease. That includes the same owner key taking back the slot it released (or let expire):
anything written under the earlier fence belongs to a finished tenure. Incarnation: +1 on every
take as well, so the renew/release of an earlier process with the same owner key fails.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from wowd import clock
from wowd.errors import StorageError
from wowd.model import AcquireResult, Owner, SlotLease, SlotState
from wowd.stores.base import PRESENCE_RETENTION, PROCESS_CLOCK, ClockReading, ReplicaInfo, ReplicaState
from wowd.stores.embedded.db import NOW_MS, SqliteStore
from wowd.stores.embedded.schema import LEASE_SCHEMA
from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["EmbeddedSlotLeaseStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")


_LEASE_COLUMNS = "ns, slot, ownerKey, incarnation, fence, expiresAt, floor, ceiling, writtenAt"

# A slot is free for :owner when nobody holds it, its lease expired beyond the tolerance, or
# :owner itself holds it with an expired lease (a live one is returned by the idempotent step).
_FREE = "(ownerKey IS NULL OR expiresAt + :tol < clk.now OR (ownerKey = :owner AND expiresAt <= clk.now))"

# One take: the owner, incarnation + 1, fence + 1, the store clock's now stamped once.
_TAKE_SET = (
    "SET ownerKey = :owner, lastOwnerKey = :owner, incarnation = incarnation + 1, fence = fence + 1, "
    "writtenAt = clk.now, expiresAt = clk.now + :ttl, ceiling = clk.now + :ttl, "
    "floor = COALESCE(nextFloor, clk.now), "
    "nextFloor = MAX(clk.now + :ttl, COALESCE(nextFloor, clk.now)) "
    f"FROM (SELECT {NOW_MS} AS now) AS clk "
)


def take_sticky_sql() -> str:
    """The owner's last slot, guarded by the fence it was read with."""
    return (
        f"UPDATE cosid_slot {_TAKE_SET}"
        f"WHERE ns = :ns AND slot = :slot AND fence = :fence AND {_FREE} "
        f"RETURNING {_LEASE_COLUMNS}"
    )


def take_slot_sql() -> str:
    """A named slot (the preferred one) when free."""
    return f"UPDATE cosid_slot {_TAKE_SET}WHERE ns = :ns AND slot = :slot AND {_FREE} RETURNING {_LEASE_COLUMNS}"


def take_first_free_sql() -> str:
    """The first free slot of the namespace's range, in slot order."""
    return (
        f"UPDATE cosid_slot {_TAKE_SET}"
        "WHERE ns = :ns AND slot = ("
        f"  SELECT s.slot FROM cosid_slot AS s, (SELECT {NOW_MS} AS now) AS clk"
        "   WHERE s.ns = :ns AND s.slot >= :lo AND s.slot < :hi"
        "     AND (s.ownerKey IS NULL OR s.expiresAt + :tol < clk.now"
        "          OR (s.ownerKey = :owner AND s.expiresAt <= clk.now))"
        "   ORDER BY s.slot LIMIT 1"
        f") AND {_FREE} "
        f"RETURNING {_LEASE_COLUMNS}"
    )


def owner_slots_sql() -> str:
    """The slots the owner key holds or held last, newest first, with liveness and the store's
    now (``clk.now``) by the store clock."""
    return (
        "SELECT slot, ownerKey, fence, expiresAt > clk.now AS live, clk.now, "
        f"{_LEASE_COLUMNS} FROM cosid_slot, (SELECT {NOW_MS} AS now) AS clk "
        "WHERE ns = :ns AND slot >= :lo AND slot < :hi AND (ownerKey = :owner OR lastOwnerKey = :owner) "
        "ORDER BY (ownerKey = :owner AND expiresAt > clk.now) DESC, writtenAt DESC, slot"
    )


def renew_sql() -> str:
    """Extends a matching lease not yet expired by the store clock."""
    return (
        "UPDATE cosid_slot SET writtenAt = clk.now, expiresAt = clk.now + :ttl, ceiling = clk.now + :ttl, "
        "nextFloor = MAX(clk.now + :ttl, floor, COALESCE(nextFloor, 0)) "
        f"FROM (SELECT {NOW_MS} AS now) AS clk "
        "WHERE ns = :ns AND slot = :slot AND ownerKey = :owner AND incarnation = :incarnation "
        "AND fence = :fence AND expiresAt > clk.now "
        f"RETURNING {_LEASE_COLUMNS}"
    )


def release_sql() -> str:
    """Clears the owner of a matching lease, keeps lastOwnerKey, stores nextFloor."""
    return (
        "UPDATE cosid_slot SET ownerKey = NULL, writtenAt = clk.now, expiresAt = MIN(expiresAt, clk.now), "
        "nextFloor = MAX(:last_issued + 1, floor) "
        f"FROM (SELECT {NOW_MS} AS now) AS clk "
        "WHERE ns = :ns AND slot = :slot AND ownerKey = :owner AND incarnation = :incarnation "
        "AND fence = :fence"
    )


def heartbeat_sql() -> str:
    """The presence upsert: ``seenAt`` and ``expiresAt`` from one store-clock now; ``startedAt``
    kept while the instance is the same (``SET`` reads the row as it was). The ``WHERE true``
    lets SQLite parse ``ON CONFLICT`` after ``INSERT ... SELECT``."""
    return (
        "INSERT INTO cosid_replica "
        "(ns, ownerKey, instance, host, pid, version, state, slots, startedAt, seenAt, expiresAt) "
        "SELECT :ns, :owner, :instance, :host, :pid, :version, :state, :slots, clk.now, clk.now, clk.now + :ttl "
        f"FROM (SELECT {NOW_MS} AS now) AS clk WHERE true "
        "ON CONFLICT (ns, ownerKey) DO UPDATE SET "
        "startedAt = CASE WHEN instance = excluded.instance THEN startedAt ELSE excluded.startedAt END, "
        "instance = excluded.instance, host = excluded.host, pid = excluded.pid, version = excluded.version, "
        "state = excluded.state, slots = excluded.slots, seenAt = excluded.seenAt, expiresAt = excluded.expiresAt"
    )


def purge_replicas_sql() -> str:
    """The namespace's presence records expired more than the retention ago."""
    return f"DELETE FROM cosid_replica WHERE ns = :ns AND expiresAt + :retention <= {NOW_MS}"


def replicas_sql() -> str:
    """The namespace's presence records, live or expired within the retention, with the store's now."""
    return (
        "SELECT ns, ownerKey, instance, host, pid, version, state, slots, startedAt, seenAt, expiresAt, clk.now "
        f"FROM cosid_replica, (SELECT {NOW_MS} AS now) AS clk "
        "WHERE ns = :ns AND expiresAt + :retention > clk.now ORDER BY ownerKey"
    )


def probe_sql() -> str:
    """The start-up clock check's write: the one ``clock_probe`` row, stamped with the store clock."""
    return (
        "INSERT INTO clock_probe (id, ownerKey, writtenAt) "
        f"VALUES (0, :owner, {NOW_MS}) "
        "ON CONFLICT (id) DO UPDATE SET ownerKey = excluded.ownerKey, writtenAt = excluded.writtenAt"
    )


def latest_writes_sql() -> str:
    """The latest lease and presence writes of the file, any namespace: (time, owner key, what)."""
    return (
        "SELECT writtenAt, COALESCE(ownerKey, lastOwnerKey, ''), 'slot lease' FROM cosid_slot "
        "WHERE writtenAt > 0 "
        "UNION ALL SELECT seenAt, ownerKey, 'presence record' FROM cosid_replica "
        "ORDER BY 1 DESC LIMIT 1"
    )


def file_written(path: str) -> tuple[int, bool] | None:
    """The modification time (ms) of the file's WAL, where a commit writes (of the file itself
    when it has none), and whether it is a whole second; None when neither is there."""
    for name in (path + "-wal", path):
        try:
            mtime = os.stat(name).st_mtime_ns
        except FileNotFoundError:
            continue
        return mtime // 1_000_000, mtime % 1_000_000_000 == 0
    return None


def _replica(row: sqlite3.Row | tuple[Any, ...]) -> ReplicaState:
    ns, owner, instance, host, pid, version, state, slots, started_at, seen_at, expires_at, now = tuple(row)
    try:
        held = tuple(int(s) for s in json.loads(slots))
    except (ValueError, TypeError) as exc:
        raise StorageError(f"sqlite cosid_replica: slots of {owner!r} is not a list of integers: {slots!r}") from exc
    return ReplicaState(
        namespace=ns,
        owner_key=owner,
        instance=instance,
        host=host,
        pid=pid,
        version=version,
        state="holding" if state == "holding" else "standby",
        slots=held,
        started_at=started_at,
        seen_at=seen_at,
        expires_at=expires_at,
        store_now=now,
    )


def _nothing(conn: sqlite3.Connection) -> None:
    return None


def _ms(d: timedelta) -> int:
    return int(d.total_seconds() * 1000)


def _lease(row: sqlite3.Row | tuple[Any, ...]) -> SlotLease:
    ns, slot, owner, incarnation, fence, expires_at, floor, ceiling, written_at = tuple(row)[-9:]
    return SlotLease(
        namespace=ns,
        slot=slot,
        owner_key=owner,
        incarnation=incarnation,
        fence=fence,
        expires_at=expires_at,
        floor=floor,
        ceiling=ceiling,
        written_at=written_at,
    )


class EmbeddedSlotLeaseStore(SqliteStore):
    """:class:`~wowd.stores.base.SlotLeaseStore` on a SQLite file shared by several processes.

    ``db_or_path``: a :class:`SqliteDatabase` the caller owns, or a path this store opens (and
    closes in :meth:`close`). The tables are created on first use.
    """

    STORE = "leases"
    SCHEMA = LEASE_SCHEMA
    CAPABILITIES = (PROCESS_CLOCK,)
    """The store clock is each process's own: a replica compares its clock with the file's last
    writes before it takes a slot (:meth:`clock_reading`)."""

    async def prepare(self) -> None:
        """Creates the tables when missing (idempotent)."""
        await self._run("prepare", lambda conn: None)

    async def acquire(
        self,
        namespace: str,
        owner: Owner,
        limit: int,
        ttl: timedelta,
        tolerance: timedelta,
        slot_offset: int = 0,
        preferred_slot: int | None = None,
    ) -> AcquireResult:
        params: dict[str, Any] = {
            "ns": namespace,
            "owner": owner.key,
            "ttl": _ms(ttl),
            "tol": _ms(tolerance),
            "lo": slot_offset,
            "hi": slot_offset + limit,
            "limit": limit,
            "offset": slot_offset,
        }

        def run(conn: sqlite3.Connection) -> AcquireResult:
            conn.execute(
                'INSERT INTO cosid_namespace (ns, "limit", toleranceMs, slotOffset) '
                "VALUES (:ns, :limit, :tol, :offset) ON CONFLICT (ns) DO NOTHING",
                params,
            )
            rec_limit, rec_offset = conn.execute(
                'SELECT "limit", COALESCE(slotOffset, 0) FROM cosid_namespace WHERE ns = :ns', params
            ).fetchone()
            if rec_limit != limit or rec_offset != slot_offset:
                return AcquireResult(
                    status="refused",
                    reason=f"namespace {namespace!r} is recorded with limit {rec_limit} and slot offset "
                    f"{rec_offset}, not limit {limit} and slot offset {slot_offset}",
                )
            conn.executemany(
                "INSERT INTO cosid_slot (ns, slot) VALUES (?, ?) ON CONFLICT (ns, slot) DO NOTHING",
                [(namespace, s) for s in range(slot_offset, slot_offset + limit)],
            )
            mine = conn.execute(owner_slots_sql(), params).fetchall()
            for row in mine:
                if row[1] == owner.key and row[3]:  # idempotent: the stored lease, seen now
                    return AcquireResult(status="acquired", lease=replace(_lease(row), store_now=row[4]))
            steps: list[tuple[str, dict[str, Any]]] = []
            if mine:
                steps.append((take_sticky_sql(), {**params, "slot": mine[0][0], "fence": mine[0][2]}))
            if preferred_slot is not None and slot_offset <= preferred_slot < slot_offset + limit:
                steps.append((take_slot_sql(), {**params, "slot": preferred_slot}))
            steps.append((take_first_free_sql(), params))
            for sql, p in steps:
                taken = conn.execute(sql, p).fetchall()
                if taken:
                    return AcquireResult(status="acquired", lease=_lease(taken[0]))
            return AcquireResult(status="exhausted", reason=f"all {limit} slots of {namespace!r} are held")

        result = await self._run("acquire", self._db.transaction(run))
        if result.lease is not None:
            log.debug(
                "acquired slot %s of %s for %s (incarnation %s, fence %s)",
                result.lease.slot,
                namespace,
                owner.key,
                result.lease.incarnation,
                result.lease.fence,
            )
        return result

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        params = _match(lease) | {"ttl": _ms(ttl)}

        def run(conn: sqlite3.Connection) -> SlotLease | None:
            rows = conn.execute(renew_sql(), params).fetchall()
            return _lease(rows[0]) if rows else None

        return await self._run("renew", run)

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        params = _match(lease) | {"last_issued": last_issued}

        def run(conn: sqlite3.Connection) -> bool:
            return conn.execute(release_sql(), params).rowcount == 1

        return await self._run("release", run)

    async def slots(self, namespace: str) -> list[SlotState]:
        def run(conn: sqlite3.Connection) -> list[SlotState]:
            rows = conn.execute(
                "SELECT ns, slot, ownerKey, lastOwnerKey, incarnation, fence, expiresAt, "
                f"COALESCE(nextFloor, 0), {NOW_MS} FROM cosid_slot WHERE ns = ? ORDER BY slot",
                (namespace,),
            ).fetchall()
            return [
                SlotState(
                    namespace=r[0],
                    slot=r[1],
                    owner_key=r[2],
                    last_owner_key=r[3],
                    incarnation=r[4],
                    fence=r[5],
                    expires_at=r[6],
                    next_floor=r[7],
                    store_now=r[8],
                )
                for r in rows
            ]

        return await self._run("slots", run)

    async def clock_reading(self, owner_key: str = "") -> ClockReading:
        """This process's clock (``wowd.clock``, the clock SQLite's ``now`` reads too) beside the
        file's: read around a write of the ``clock_probe`` row (under ``owner_key``), then the
        file's modification time and its latest lease or presence write (:class:`ClockReading`)."""
        path = self._db.path

        def probe(conn: sqlite3.Connection) -> None:
            conn.execute(probe_sql(), {"owner": owner_key})

        def run(conn: sqlite3.Connection) -> ClockReading:
            latest = conn.execute(latest_writes_sql()).fetchone()
            before = clock.now_ms()
            self._db.transaction(probe)(conn)
            written = file_written(path) if path != ":memory:" else None
            after = clock.now_ms()
            return ClockReading(
                path=path,
                before=before,
                after=after,
                file_written=written[0] if written else None,
                file_coarse=written[1] if written else False,
                latest=latest[0] if latest else None,
                latest_by=latest[1] if latest else "",
                latest_what=latest[2] if latest else "",
            )

        return await self._run("clock_reading", run)

    # ------------------------------------------------------------------ presence

    async def heartbeat(self, namespace: str, owner_key: str, info: ReplicaInfo, ttl: timedelta) -> None:
        params: dict[str, Any] = {
            "ns": namespace,
            "owner": owner_key,
            "instance": info.instance,
            "host": info.host,
            "pid": info.pid,
            "version": info.version,
            "state": info.state,
            "slots": json.dumps(sorted(info.slots)),
            "ttl": _ms(ttl),
            "retention": _ms(PRESENCE_RETENTION),
        }

        def run(conn: sqlite3.Connection) -> None:
            conn.execute(heartbeat_sql(), params)
            conn.execute(purge_replicas_sql(), params)

        await self._run("heartbeat", self._db.transaction(run))

    async def replicas(self, namespace: str) -> list[ReplicaState]:
        params = {"ns": namespace, "retention": _ms(PRESENCE_RETENTION)}

        def run(conn: sqlite3.Connection) -> list[ReplicaState]:
            return [_replica(r) for r in conn.execute(replicas_sql(), params).fetchall()]

        return await self._run("replicas", run)

    async def leave(self, namespace: str, owner_key: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute("DELETE FROM cosid_replica WHERE ns = ? AND ownerKey = ?", (namespace, owner_key))
            return cur.rowcount == 1

        return await self._run("leave", run)


def _match(lease: SlotLease) -> dict[str, Any]:
    return {
        "ns": lease.namespace,
        "slot": lease.slot,
        "owner": lease.owner_key,
        "incarnation": lease.incarnation,
        "fence": lease.fence,
    }
