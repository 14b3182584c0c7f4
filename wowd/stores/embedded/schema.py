"""The layout of the embedded file (docs/stores.md, "Embedded"): every table's and index's DDL,
the formats the stores record and the upgrade of an older one, the checks of a file's format at
start, and the formats read without changing anything (``wowd check``). The statements of each
store are beside the calls that send them, in its module.
"""

from __future__ import annotations

import time
from pathlib import Path

from wowd.errors import FormatError
from wowd.metrics import STORE_CALL_SECONDS
from wowd.model import validate_name
from wowd.model.history import SCHEDULED
from wowd.stores.base import Ddl
from wowd.stores.embedded.db import NOW_MS, SqliteDatabase, SqliteStore
from wowd.stores.embedded.sqlite import sqlite3
from wowd.stores.formats import StoreFormat, too_new

# ---- the log: its commits, the checkpoints of its consumers and the quarantine (one format)


LOG_FORMAT = 6
"""The layout version of the embedded log tables, recorded in ``log_format``."""


LOG_UPGRADES_FROM = 5
"""The format ``prepare`` upgrades in place: the quarantine without its dismissal columns."""


QUARANTINE_DISMISSAL_COLUMNS = (
    ("dismissed_at", "INTEGER"),
    ("dismissed_reason", "TEXT"),
    ("dismissed_by", "TEXT"),
)
"""An item an operator dismissed: when (ms since the epoch), why and who (all NULL until then)."""


LOG_TABLES = ("log", "log_checkpoint", "log_quarantine", "log_format")


LOG_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS log (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        context TEXT NOT NULL,
        aggregate TEXT NOT NULL,
        tenant_id TEXT,
        aggregate_id TEXT,
        version INTEGER,
        partition INTEGER NOT NULL,
        request_id TEXT,
        doc TEXT NOT NULL
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS log_version ON log (context, aggregate, tenant_id, aggregate_id, version)",
    "CREATE UNIQUE INDEX IF NOT EXISTS log_request ON log (context, aggregate, aggregate_id, request_id)",
    "CREATE INDEX IF NOT EXISTS log_partition ON log (context, partition, seq)",
    """CREATE TABLE IF NOT EXISTS log_checkpoint (
        context TEXT NOT NULL,
        consumer TEXT NOT NULL,
        partition INTEGER NOT NULL,
        position TEXT NOT NULL,
        fence INTEGER NOT NULL,
        written_at INTEGER NOT NULL,
        PRIMARY KEY (context, consumer, partition)
    )""",
    """CREATE TABLE IF NOT EXISTS log_quarantine (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        context TEXT NOT NULL,
        consumer TEXT NOT NULL,
        partition INTEGER NOT NULL,
        aggregate TEXT NOT NULL,
        raw TEXT NOT NULL,
        raw_hash TEXT NOT NULL,
        reason TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        dismissed_at INTEGER,
        dismissed_reason TEXT,
        dismissed_by TEXT,
        UNIQUE (context, consumer, aggregate, raw_hash)
    )""",
    """CREATE TABLE IF NOT EXISTS log_format (
        name TEXT PRIMARY KEY,
        format INTEGER NOT NULL,
        created_at INTEGER NOT NULL
    )""",
)


class LogTables(SqliteStore):
    """A store of the log's tables (the log, the checkpoints, the quarantine), of one context.

    ``db_or_path``: a :class:`~wowd.stores.embedded.db.SqliteDatabase` the caller owns, or a path
    this store opens (and closes in :meth:`close`). ``ddl``: ``auto`` creates the tables and
    records :data:`LOG_FORMAT`, ``validate`` requires them (and the format), ``none`` assumes them;
    a file recorded in another format is refused (:class:`FormatError`)."""

    STORE = "log"

    def __init__(self, db_or_path: SqliteDatabase | str | Path, *, context: str, ddl: Ddl = Ddl.AUTO) -> None:
        self.context = validate_name(context, field="context")
        self.ddl = Ddl(ddl)
        super().__init__(db_or_path)
        self._prepared = False

    async def _ensure_ready(self) -> None:
        if not self._prepared:
            await self._prepare()

    async def _prepare(self) -> None:
        if self.ddl is Ddl.AUTO:
            await self._db.run(self._db.transaction(create_log))
        elif self.ddl is Ddl.VALIDATE:
            await self._db.run(validate_log)
        self._prepared = True

    async def prepare(self) -> None:
        """Creates the tables and records :data:`LOG_FORMAT` (``auto``), or checks them
        (``validate``); raises :class:`FormatError` for tables recorded in another format."""
        started = time.perf_counter()
        try:
            await self._prepare()
        finally:
            STORE_CALL_SECONDS.labels(self.STORE, "prepare").observe(time.perf_counter() - started)


def create_log(conn: sqlite3.Connection) -> None:
    for statement in LOG_SCHEMA:
        conn.execute(statement)
    conn.execute(
        f"INSERT INTO log_format (name, format, created_at) VALUES ('log', ?, {NOW_MS}) ON CONFLICT (name) DO NOTHING",
        (LOG_FORMAT,),
    )
    upgrade_log(conn)
    check_log_format(conn)


def upgrade_log(conn: sqlite3.Connection) -> None:
    """Upgrades tables recorded in :data:`LOG_UPGRADES_FROM` in place (in the caller's
    transaction): the quarantine's dismissal columns added (``ALTER TABLE ... ADD COLUMN``, no
    row rewritten), then :data:`LOG_FORMAT` recorded."""
    row = conn.execute("SELECT format FROM log_format WHERE name = 'log'").fetchone()
    if row is None or row[0] != LOG_UPGRADES_FROM:
        return
    have = {str(r[1]) for r in conn.execute("PRAGMA table_info(log_quarantine)")}
    for name, kind in QUARANTINE_DISMISSAL_COLUMNS:
        if name not in have:
            conn.execute(f"ALTER TABLE log_quarantine ADD COLUMN {name} {kind}")
    conn.execute("UPDATE log_format SET format = ? WHERE name = 'log' AND format = ?", (LOG_FORMAT, LOG_UPGRADES_FROM))


def validate_log(conn: sqlite3.Connection) -> None:
    present = {
        r[0]
        for r in conn.execute(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({', '.join('?' * len(LOG_TABLES))})",
            LOG_TABLES,
        ).fetchall()
    }
    missing = [t for t in LOG_TABLES if t not in present]
    if missing:
        raise FormatError(f"embedded log: tables missing (ddl=validate): {', '.join(missing)}")
    check_log_format(conn)


def check_log_format(conn: sqlite3.Connection) -> None:
    row = conn.execute("SELECT format FROM log_format WHERE name = 'log'").fetchone()
    if row is not None and isinstance(row[0], int) and row[0] > LOG_FORMAT:
        raise too_new("embedded log", row[0], LOG_FORMAT)
    if row is None or row[0] != LOG_FORMAT:
        found = "no format" if row is None else f"format {row[0]}"
        raise FormatError(f"embedded log: tables recorded with {found}, this wowd reads format {LOG_FORMAT}")


# ---- the timers: one table per context, every aggregate type's collection recorded in the registry


TIMER_FORMAT = 6
"""The layout version recorded in the registry."""


TIMER_UPGRADES_FROM = 5
"""The format ``prepare`` upgrades in place: the same table without tombstones."""


TOMBSTONES = "('DONE', 'CANCELLED')"
"""The statuses of a tombstone row (SQL list)."""


STUCK = "('PARKED', 'FAILED')"
"""The statuses an operator repairs (SQL list): the partial index ``__stuck`` lists them."""


TIMER_REGISTRY = "wow_timer_aggregate"


def timer_table(context: str) -> str:
    """The context's timers table (every aggregate type's timers, by column ``aggregate``)."""
    return f"wow_timer__{validate_name(context, field='context')}"


def timer_shadow_table(context: str) -> str:
    """The table a rebuild of the context's timer view fills beside the live one (``wowd timers
    rebuild``), then renames in its place."""
    return f"{timer_table(context)}__rebuild"


def timer_ddl(context: str) -> list[str]:
    """The statements that create the registry, the timers table and its indexes."""
    t = timer_table(context)
    return [
        f"CREATE TABLE IF NOT EXISTS {TIMER_REGISTRY} ("
        " collection TEXT PRIMARY KEY, context TEXT NOT NULL, aggregate TEXT,"
        " format INTEGER NOT NULL, created_at INTEGER NOT NULL)",
        timer_table_sql(t),
        *timer_index_sql(context),
    ]


def timer_table_sql(t: str) -> str:
    """The ``CREATE TABLE`` of a timers table named ``t`` (its unique key; no other index)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {t} ("
        ' timer_id TEXT NOT NULL, "partition" INTEGER NOT NULL, aggregate TEXT NOT NULL,'
        ' owner_tenant TEXT NOT NULL, owner_id TEXT NOT NULL, "key" TEXT NOT NULL,'
        " version INTEGER NOT NULL, status TEXT NOT NULL, due_at INTEGER NOT NULL,"
        " scheduled_at INTEGER NOT NULL, target_context TEXT NOT NULL, target_aggregate TEXT NOT NULL,"
        " target_tenant TEXT NOT NULL, target_id TEXT NOT NULL, body TEXT NOT NULL, rule TEXT NOT NULL,"
        " attempts INTEGER NOT NULL, fired INTEGER NOT NULL, claim_owner_key TEXT, claim_fence INTEGER,"
        " claim_until INTEGER, last_error TEXT, revision INTEGER NOT NULL,"
        ' UNIQUE ("partition", aggregate, owner_tenant, owner_id, "key"))'
    )


def timer_index_sql(context: str) -> list[str]:
    """The ``CREATE INDEX`` statements of the context's timers table."""
    t = timer_table(context)
    return [
        f'CREATE INDEX IF NOT EXISTS {t}__due ON {t} ("partition", due_at, timer_id)'
        " WHERE status IN ('PENDING', 'FIRING')",
        f"CREATE INDEX IF NOT EXISTS {t}__parked ON {t}"
        " (target_id, target_aggregate, target_tenant, target_context) WHERE status = 'PARKED'",
        f"CREATE INDEX IF NOT EXISTS {t}__tombstones ON {t} (due_at) WHERE status IN {TOMBSTONES}",
        f"CREATE INDEX IF NOT EXISTS {t}__stuck ON {t} (status, due_at, timer_id) WHERE status IN {STUCK}",
    ]


def timer_upgrade_sql() -> str:
    """Records format 6 over the context's format-5 collections (``prepare``, after the DDL)."""
    return f"UPDATE {TIMER_REGISTRY} SET format = {TIMER_FORMAT} WHERE context = ? AND format = {TIMER_UPGRADES_FROM}"


def registry_format_sql(registry: str) -> str:
    """The format a registry (of the timers, of the snapshots) records for one collection."""
    return f"SELECT format FROM {registry} WHERE collection = ?"


def registry_formats_sql(registry: str) -> str:
    """The format a registry records for each of a context's collections."""
    return f"SELECT collection, format FROM {registry} WHERE context = ?"


def registry_insert_sql(registry: str, format: int) -> str:
    """Records a collection (collection, context, aggregate) in a registry at ``format`` unless
    recorded already."""
    return (
        f"INSERT INTO {registry} (collection, context, aggregate, format, created_at)"
        f" VALUES (?, ?, ?, {format}, {NOW_MS}) ON CONFLICT (collection) DO NOTHING"
    )


def timer_format_sql() -> str:
    return registry_format_sql(TIMER_REGISTRY)


def timer_register_sql() -> str:
    return registry_insert_sql(TIMER_REGISTRY, TIMER_FORMAT)


def timer_formats_sql() -> str:
    return registry_formats_sql(TIMER_REGISTRY)


# ---- the snapshots


SNAPSHOT_FORMAT = 5


SNAPSHOT_REGISTRY = "wow_snapshot_aggregate"


SNAPSHOT_TABLES = "wow_snapshot_tables"


def snapshot_table(context: str) -> str:
    return f"wow_snapshot__{validate_name(context, field='context')}"


def snapshot_ddl(context: str) -> list[str]:
    t = snapshot_table(context)
    return [
        f"CREATE TABLE IF NOT EXISTS {SNAPSHOT_REGISTRY} ("
        " collection TEXT PRIMARY KEY, context TEXT NOT NULL, aggregate TEXT NOT NULL,"
        " format INTEGER NOT NULL, created_at INTEGER NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {SNAPSHOT_TABLES} ("
        " collection TEXT PRIMARY KEY, context TEXT NOT NULL, aggregate TEXT NOT NULL,"
        " revision INTEGER NOT NULL, rebuilding INTEGER NOT NULL, backfilled INTEGER NOT NULL,"
        " updated_at INTEGER NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {t} ("
        " aggregate TEXT NOT NULL, tenant_id TEXT NOT NULL, aggregate_id TEXT NOT NULL,"
        " version INTEGER NOT NULL, state_revision INTEGER NOT NULL, state TEXT NOT NULL,"
        " owner_id TEXT NOT NULL, space_id TEXT NOT NULL, tags TEXT NOT NULL,"
        " access_version INTEGER NOT NULL, deleted INTEGER NOT NULL, event_time INTEGER NOT NULL,"
        " stale_version INTEGER, written_at INTEGER NOT NULL,"
        " PRIMARY KEY (aggregate, tenant_id, aggregate_id))",
        f"CREATE INDEX IF NOT EXISTS {t}__owner ON {t} (aggregate, tenant_id, owner_id) WHERE deleted = 0",
        f"CREATE INDEX IF NOT EXISTS {t}__space ON {t} (aggregate, tenant_id, space_id) WHERE deleted = 0",
    ]


def snapshot_format_sql() -> str:
    return registry_format_sql(SNAPSHOT_REGISTRY)


def snapshot_formats_sql() -> str:
    return registry_formats_sql(SNAPSHOT_REGISTRY)


def snapshot_register_sql() -> str:
    return registry_insert_sql(SNAPSHOT_REGISTRY, SNAPSHOT_FORMAT)


# ---- the outbox


OUTBOX_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS outbox (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        request_id TEXT NOT NULL UNIQUE,
        timer_id TEXT NOT NULL,
        target TEXT NOT NULL,
        command TEXT NOT NULL,
        scheduled_at INTEGER NOT NULL,
        fence INTEGER NOT NULL,
        owner_key TEXT NOT NULL,
        created_at INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS outbox_created ON outbox (created_at)",
    # A re-delivery of a request id already in the outbox (a re-fire after a crash between send
    # and settle, or by a new slot holder): kept so that tests and operators can see who re-fired.
    """CREATE TABLE IF NOT EXISTS outbox_redelivery (
        request_id TEXT NOT NULL,
        fence INTEGER NOT NULL,
        owner_key TEXT NOT NULL,
        created_at INTEGER NOT NULL
    )""",
    # The take that holds an entry until ``until`` (store clock, ms); a lease that ran out frees it.
    """CREATE TABLE IF NOT EXISTS outbox_lease (
        request_id TEXT PRIMARY KEY,
        lease TEXT NOT NULL,
        until INTEGER NOT NULL
    )""",
)

# ---- the timers' history


def history_table(context: str) -> str:
    """The context's history table."""
    return f"wow_timer_history__{validate_name(context, field='context')}"


def history_ddl(context: str) -> list[str]:
    """The table and its indexes."""
    t = history_table(context)
    return [
        f"CREATE TABLE IF NOT EXISTS {t} ("
        " timer_id TEXT NOT NULL, slot INTEGER NOT NULL, kind TEXT NOT NULL, aggregate TEXT NOT NULL,"
        ' owner_tenant TEXT NOT NULL, owner_id TEXT NOT NULL, "key" TEXT NOT NULL, at INTEGER NOT NULL,'
        " version INTEGER NOT NULL, request_id TEXT NOT NULL, expires_at INTEGER, scheduled_at INTEGER,"
        " position INTEGER, outcome TEXT, status INTEGER, latency_ms REAL, reason TEXT, answer TEXT)",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {t}__record ON {t} (timer_id, slot)",
        f'CREATE INDEX IF NOT EXISTS {t}__key ON {t} (owner_id, aggregate, owner_tenant, "key", at) WHERE slot < 0',
        f"CREATE INDEX IF NOT EXISTS {t}__request ON {t} (request_id)",
        f"CREATE INDEX IF NOT EXISTS {t}__expires ON {t} (expires_at) WHERE expires_at IS NOT NULL",
        f'CREATE INDEX IF NOT EXISTS {t}__open ON {t} (owner_id, aggregate, owner_tenant, "key")'
        f" WHERE slot = {SCHEDULED} AND expires_at IS NULL",
    ]


# ---- the event sink


EVENTS_TABLE = "events"


def events_ddl() -> list[str]:
    return [
        f"CREATE TABLE IF NOT EXISTS {EVENTS_TABLE} ("
        " context TEXT NOT NULL, aggregate TEXT NOT NULL, tenant_id TEXT NOT NULL,"
        " aggregate_id TEXT NOT NULL, version INTEGER NOT NULL, id TEXT NOT NULL,"
        " document TEXT NOT NULL, access TEXT, access_version INTEGER,"
        " PRIMARY KEY (context, aggregate, tenant_id, aggregate_id, version))",
    ]


# ---- the slot leases and the presence records


LEASE_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS cosid_namespace (
        ns TEXT PRIMARY KEY,
        "limit" INTEGER NOT NULL,
        toleranceMs INTEGER NOT NULL,
        slotOffset INTEGER
    )""",
    """CREATE TABLE IF NOT EXISTS cosid_slot (
        ns TEXT NOT NULL,
        slot INTEGER NOT NULL,
        ownerKey TEXT,
        incarnation INTEGER NOT NULL DEFAULT 0,
        lastOwnerKey TEXT,
        fence INTEGER NOT NULL DEFAULT 0,
        expiresAt INTEGER NOT NULL DEFAULT 0,
        floor INTEGER NOT NULL DEFAULT 0,
        ceiling INTEGER NOT NULL DEFAULT 0,
        nextFloor INTEGER,
        writtenAt INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (ns, slot)
    )""",
    """CREATE TABLE IF NOT EXISTS cosid_replica (
        ns TEXT NOT NULL,
        ownerKey TEXT NOT NULL,
        instance TEXT NOT NULL,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        version TEXT NOT NULL,
        state TEXT NOT NULL,
        slots TEXT NOT NULL,
        startedAt INTEGER NOT NULL,
        seenAt INTEGER NOT NULL,
        expiresAt INTEGER NOT NULL,
        PRIMARY KEY (ns, ownerKey)
    )""",
    """CREATE TABLE IF NOT EXISTS clock_probe (
        id INTEGER PRIMARY KEY CHECK (id = 0),
        ownerKey TEXT NOT NULL,
        writtenAt INTEGER NOT NULL
    )""",
)

# ---- a rebuild of the timer view


REBUILD_LOCK_TABLE = "wow_timer_rebuild"
"""One row per context whose timer view is being rebuilt."""


REBUILD_LOCK_DDL = (
    f"CREATE TABLE IF NOT EXISTS {REBUILD_LOCK_TABLE} (context TEXT PRIMARY KEY, owner TEXT NOT NULL,"
    " started_at INTEGER NOT NULL, expires_at INTEGER NOT NULL)"
)

# ---- the formats recorded, read without changing anything (``wowd check``)


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}


def embedded_formats(conn: sqlite3.Connection, context: str) -> list[StoreFormat]:
    """The log's format, then that of each timer and snapshot collection of ``context`` recorded
    in the file (a store with nothing recorded yet is one line with ``found`` None). Reads only."""
    tables = _tables(conn)
    found: list[StoreFormat] = []
    row = (
        conn.execute("SELECT format FROM log_format WHERE name = 'log'").fetchone() if "log_format" in tables else None
    )
    found.append(StoreFormat("embedded log", None if row is None else int(row[0]), LOG_FORMAT, LOG_UPGRADES_FROM))
    timers = conn.execute(timer_formats_sql(), (context,)).fetchall() if TIMER_REGISTRY in tables else []
    if not timers:
        timers = [(timer_table(context), None)]
    for name, fmt in sorted(timers):
        found.append(StoreFormat(f"timer collection {name}", fmt, TIMER_FORMAT, TIMER_UPGRADES_FROM))
    snapshots = conn.execute(snapshot_formats_sql(), (context,)).fetchall() if SNAPSHOT_REGISTRY in tables else []
    for name, fmt in sorted(snapshots):
        found.append(StoreFormat(f"snapshot collection {name}", fmt, SNAPSHOT_FORMAT))
    return found


def rebuild_state(conn: sqlite3.Connection, context: str) -> str | None:
    """A rebuild of the context's timer view that runs or was interrupted (``wowd timers
    rebuild``): its lock row and its shadow table, in one line (a lock of a process of this host
    that is gone is an interrupted rebuild's); ``None`` when there is neither."""
    from wowd.fmt import iso_ms
    from wowd.stores.timer_rebuild import lock_gone

    tables = _tables(conn)
    shadow = timer_shadow_table(context)
    row = None
    if REBUILD_LOCK_TABLE in tables:
        row = conn.execute(
            f"SELECT owner, started_at, expires_at FROM {REBUILD_LOCK_TABLE} WHERE context = ?", (context,)
        ).fetchone()
    if row is None and shadow not in tables:
        return None
    if row is not None and row[2] > time.time() * 1000 and not lock_gone(str(row[0])):
        return f"runs: lock held by {row[0]} since {iso_ms(row[1])}, until {iso_ms(row[2])} unless renewed"
    return (
        f"an interrupted rebuild left {shadow if shadow in tables else 'its lock'}: the live view is as it was; "
        "wowd timers rebuild runs it again (and drops what it left)"
    )
