"""The chaos harness: K ``python -m wowd run`` replicas on one SQLite file (or, with
``backend="mongo-sim"``, on the MongoDB simulator of ``tests/mongosim`` with the sink on the
Elasticsearch fake), a producer, faults.

:func:`run_chaos` starts ``replicas`` processes (HTTP on port 0, short lease ttl) on one SQLite
file, and in this process a command target (:class:`~tests.chaos.target.CommandTarget`, counting
deliveries per ``Command-Request-Id``, some targets slower than a claim lives) and a producer that
appends commits carrying timer events (``append_many`` on the embedded log), a few of them
malformed on purpose (``insert_raw`` documents that are not commits, and commits whose timer event
is refused), and cancels of some timers appended before, around or after their due time (the
producer records which cancels were in the log before the due time). Each start of a replica
delivers to the target (``http`` gateway, its own URL tag) or to the outbox, in turn (``gateway``).
Meanwhile a seeded schedule of faults hits the replicas:

- ``kill``: SIGKILL of a random replica, restarted (same owner key) a moment later;
- ``stop``: SIGSTOP of a slot holder for longer than the ttl, then SIGCONT; the paused holder must
  find its lease gone and stop its slot's work (its log says ``lost slot``);
- ``restart``: SIGTERM (graceful: exit 0), then a start under the same owner key;
- ``join``: a new replica (a standby while every slot is held) joins;
- ``rebuild`` (with ``rebuild_gap_s``): ``python -m wowd timers rebuild`` with the replicas'
  environment, one at a time, the next a while after the last one ended. On the embedded file it
  swaps the rebuilt view in under the file's write lock; on MongoDB it holds every slot (the
  replicas drain, release them and stand by) and renames the shadow collections over the live
  ones. Some rebuilds (``rebuild_kill_share``) are SIGKILLed partway, at a point drawn after
  their first progress line (on MongoDB, also after the hold line: the slots stay held until the
  hold lapses, ``HOLD_TTL_S``, the next rebuild waits for that), to check that an interrupted
  rebuild leaves the live view working. Each rebuild's exit code and last line are recorded; one
  that exits non-zero other than by the harness's kill is a violation.

When the producer stops, the harness waits (polling the stores inside ``fail_after``) for the
replicas to catch up, stops them with SIGTERM and checks, from the stores only:

- every timer scheduled and not cancelled fired at least once (its request id reached the target
  or the outbox), none FAILED or PARKED, every cancelled timer gone from the timer store;
- no timer whose cancel was appended before its due time was delivered;
- a request id delivered more than once only for a delivery in flight at a fault: at each kill,
  and at each pause, the replica's claimed and unsettled timers are read from the timer store
  (the process cannot move them); each such fault allows its timers one more delivery. A replica
  sending one request id twice, or any other repeat, is a duplicate beyond the allowance;
- no request id delivered by two different fences, and no (slot, fence) used by two owner keys;
- every commit is in the sink exactly once (versions 1..n of each aggregate, no more);
- no checkpoint went backwards: sampled during the run, a partition's fence never decreases and
  its position never decreases under one fence (nor does a slot's fence in the lease table);
- the quarantine holds exactly the malformed documents injected, each reason naming its field;
- no replica exited unless the harness made it (no crash), and each graceful stop exited 0;
- every rebuild exited 0 unless the harness killed it.

A rebuild adds nothing to the duplicate allowance: the replicas a MongoDB hold drains settle or
release their claims as on a graceful stop, and the embedded swap carries every claim over.

:class:`ChaosReport` holds the counts and :meth:`ChaosReport.violations` the broken promises.
``tests/chaos/test_chaos.py`` runs a short schedule; ``tests/chaos/soak.py`` a long one.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import anyio
from anyio.abc import Process

from tests import forkserver
from tests.chaos.stopping_rebuild import STOPPED_LINE, stopped
from tests.chaos.target import CommandTarget
from wowd.daemon.feed import CONSUMER
from wowd.errors import ConflictError, StorageUnavailable
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
    DomainEvent,
    Timer,
    TimerStatus,
    deterministic_timer_id,
    partition,
    request_id_for,
)

__all__ = ["CONTEXT", "ChaosConfig", "ChaosReport", "run_chaos"]

log = logging.getLogger(__name__)

CONTEXT = "chaos"
AGGREGATE = "order"
TYPE = AggregateType(context=CONTEXT, aggregate=AGGREGATE)
MAX_BODY_BYTES = 1024
FAULTS = ("kill", "stop", "restart", "join")
HOLD_LINE = "rebuild: holding the slots"
"""The MongoDB rebuild's line once it holds the replicas' slots (``timer_rebuild_mongo``)."""
MONGO_DATABASE = "wowd_chaos"
LAPSE_CLAIMS_EVERY_S = 1.0
"""How often the claims of each replica are read for the ``lapse`` marks."""
LAPSE_AFTER_PAUSE_S = 15.0
"""A lost slot this soon after a pause or a kill of the replica is that fault's, not a lapse."""
ROOT = Path(__file__).resolve().parents[2]
"""The repository (``python -m tests.mongosim`` runs from it)."""


def progress(position: Any) -> tuple[int, ...]:
    """A checkpoint position as an ordered key: the embedded log's ``seq``, the MongoDB log's
    cluster time."""
    if isinstance(position, dict) and "seq" in position:
        return (int(position["seq"]),)
    ct = position.get("cluster_time") if isinstance(position, dict) else None
    return tuple(int(v) for v in ct) if isinstance(ct, list | tuple) else (0, 0)


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    seed: int = 1
    replicas: int = 3
    """Replicas started at once (more than ``limit``: the others are standbys)."""
    max_replicas: int = 5
    limit: int = 2
    partitions: int = 8
    ttl_s: float = 2.0
    tolerance_s: float = 0.5
    claim_ttl_s: float = 1.5
    gateway: Literal["http", "outbox", "mixed"] = "mixed"
    """Where the replicas deliver: the HTTP command target, the outbox, or each start in turn
    (the first ``http``)."""
    slow_share: float = 0.125
    """The share of aggregates whose commands the target answers only after ``slow_s``."""
    slow_s: float | None = None
    """The slow target's latency; default ``claim_ttl_s + 0.5`` (longer than a claim lives)."""
    cancel_share: float = 0.2
    """The share of timers cancelled by a later commit appended around their due time."""
    duration_s: float = 20.0
    """How long the producer writes and faults are applied."""
    rate_per_s: float = 20.0
    aggregates: int = 24
    due_in_ms: tuple[int, int] = (100, 2500)
    """How far ahead of its commit a timer comes due (drawn in the range)."""
    malformed_every: int = 30
    """One malformed input per this many commits."""
    fault_gap_s: tuple[float, float] = (1.0, 2.5)
    faults_for_s: float | None = None
    """How long after the start faults begin (each kind at least once, whatever it says);
    ``None``: while the producer writes. A shorter time lets the last pause end before the
    producer stops, instead of the run waiting for it."""
    drain_s: float = 60.0
    """How long the replicas get to catch up once the producer stopped."""
    sample_every_s: float = 0.25
    backend: Literal["embedded", "mongo-sim"] = "embedded"
    """The replicas' stores: the embedded file, or MongoDB on the simulator (``tests/mongosim``,
    a process) with the sink on the Elasticsearch fake (``tests/elasticsearch``, in this process)."""
    sink_outages: bool = True
    """On ``mongo-sim``: the event index refuses every write now and then (``_sink_outages``)."""
    rebuild_gap_s: tuple[float, float] | None = None
    rebuild_kill_first: bool = False
    """The first rebuild is SIGKILLed right after its first line (the shadow made, the lock held),
    and the rebuilds go on after the producer stopped until one ended by itself: a short run is
    sure to have one rebuild killed partway and one run to its end after it, however long the
    first one took to start on a busy machine."""
    """Rebuilds of the timer view while the producer writes, one at a time: the first this long
    after the start, each next one this long after the last one ended (drawn in the range);
    ``None``: no rebuild."""
    rebuild_kill_share: float = 1 / 3
    """The share of rebuilds SIGKILLed partway (after their first progress line)."""
    rebuild_within_s: float = 60.0
    """How long a rebuild may take: one still running then is killed and counted as failed (the
    run's log is a few thousand commits; a rebuild that cannot reach the log's head while the
    producer writes shows here)."""

    @property
    def slow_latency_s(self) -> float:
        return self.claim_ttl_s + 0.5 if self.slow_s is None else self.slow_s

    @property
    def grace_s(self) -> float:
        """The replicas' shutdown grace: a graceful stop lets a slow delivery finish."""
        return self.slow_latency_s + 3.0


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class RebuildRun:
    """One ``wowd timers rebuild`` of the run."""

    at: float
    """Seconds since the run's start."""
    took_s: float
    exit_code: int | None
    killed: str
    """Where the harness SIGKILLed it (the last line it had printed); empty: not killed."""
    held: bool
    """It had printed the hold line (MongoDB: the slots were held when it ended)."""
    last_line: str
    """Its summary line (or its last line of output, or of its errors when it failed)."""

    def text(self) -> str:
        if self.killed:
            return f"at {self.at:.0f}s, {self.took_s:.1f}s: SIGKILLed after {self.killed!r}"
        return f"at {self.at:.0f}s, {self.took_s:.1f}s: exit {self.exit_code}: {self.last_line}"


@dataclass
class ChaosReport:
    config: ChaosConfig
    faults: Counter[str] = field(default_factory=Counter)
    commits_fed: int = 0
    commits_expected: int = 0
    timers_expected: int = 0
    timers_fired: int = 0
    cancelled: int = 0
    cancelled_in_time: int = 0
    """Timers whose cancel was appended (the append returned) before their due time."""
    cancelled_raced: int = 0
    """Timers whose cancel was appended around or after their due time (delivery optional)."""
    cancelled_delivered: list[str] = field(default_factory=list)
    deliveries: int = 0
    """Every delivery seen: the target's requests plus the outbox's entries."""
    http_deliveries: int = 0
    slow_targets: int = 0
    slow_deliveries: int = 0
    duplicates: int = 0
    """Deliveries beyond the first of their request id."""
    duplicates_allowed: int = 0
    """Of those, the ones of a timer claimed and unsettled by a replica when it was killed (or
    paused past its lease): a delivery in flight at the fault, sent again by the next holder."""
    duplicates_beyond: list[str] = field(default_factory=list)
    duplicates_beyond_n: int = 0
    unsettled_at_faults: int = 0
    """Timers claimed and unsettled by the killed or paused replicas at the fault (the allowance)."""
    claims_left_by_graceful_stops: int = 0
    target_refused: list[str] = field(default_factory=list)
    malformed_injected: int = 0
    quarantined: int = 0
    lost_timers: list[str] = field(default_factory=list)
    lost_commits: list[str] = field(default_factory=list)
    extra_documents: list[str] = field(default_factory=list)
    dead_timers: list[str] = field(default_factory=list)
    cancelled_left: list[str] = field(default_factory=list)
    duplicate_fences: list[str] = field(default_factory=list)
    fence_owner_conflicts: list[str] = field(default_factory=list)
    checkpoint_regressions: list[str] = field(default_factory=list)
    checkpoint_samples: int = 0
    handover_rewinds: int = 0
    quarantine_mismatch: list[str] = field(default_factory=list)
    paused_holders_kept_acting: list[str] = field(default_factory=list)
    paused_holders: int = 0
    lapses: int = 0
    """Leases a replica lost while running (not paused or killed by the soak: the store answered
    its renewals too late), each a fault of its own for the allowance (``lapse`` marks)."""
    crashes: list[str] = field(default_factory=list)
    unclean_exits: list[str] = field(default_factory=list)
    rebuilds: list[RebuildRun] = field(default_factory=list)
    rebuild_failures: list[str] = field(default_factory=list)
    """Rebuilds that exited non-zero other than by the harness's kill."""
    rss_start_kib: int = 0
    rss_end_kib: int = 0
    oldest_rss_start_kib: int = 0
    oldest_rss_end_kib: int = 0
    oldest_uptime_s: float = 0.0
    elapsed_s: float = 0.0
    drain_s: float = 0.0
    drained: bool = False

    def violations(self) -> list[str]:
        out: list[str] = []
        if not self.drained:
            out.append(f"the replicas did not catch up within {self.config.drain_s}s")
        for name, items in (
            ("timers never fired", self.lost_timers),
            ("commits missing from the sink", self.lost_commits),
            ("documents in the sink more than once or not in the log", self.extra_documents),
            ("timers FAILED/PARKED", self.dead_timers),
            ("cancelled timers delivered", self.cancelled_delivered),
            ("duplicate deliveries beyond the in-flight allowance", self.duplicates_beyond),
            ("requests the command target refused", self.target_refused),
            ("cancelled timers still stored", self.cancelled_left),
            ("request ids delivered under two fences", self.duplicate_fences),
            ("(slot, fence) used by two owner keys", self.fence_owner_conflicts),
            ("checkpoints that went backwards", self.checkpoint_regressions),
            ("quarantine differs from the malformed input", self.quarantine_mismatch),
            ("paused holders that did not stop after their lease ran out", self.paused_holders_kept_acting),
            ("replicas that exited on their own", self.crashes),
            ("graceful stops that did not exit 0", self.unclean_exits),
            ("rebuilds that failed", self.rebuild_failures),
        ):
            if items:
                out.append(f"{name} ({len(items)}): {items[:5]}")
        return out

    @property
    def rebuilds_killed(self) -> int:
        return sum(1 for r in self.rebuilds if r.killed)

    @property
    def lost(self) -> int:
        return len(self.lost_timers) + len(self.lost_commits)

    def summary(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"seed {self.config.seed}, {self.config.replicas} replicas (limit {self.config.limit}, "
            f"ttl {self.config.ttl_s}s), {self.elapsed_s:.0f}s: faults survived {sum(self.faults.values())} "
            f"({faults}); commits fed {self.commits_fed}/{self.commits_expected}; timers fired "
            f"{self.timers_fired}/{self.timers_expected}; cancelled {self.cancelled} (before due "
            f"{self.cancelled_in_time}, delivered {len(self.cancelled_delivered)}; raced {self.cancelled_raced}); "
            f"deliveries {self.deliveries} (http {self.http_deliveries}, slow {self.slow_deliveries}); "
            f"duplicates {self.duplicates} (allowed {self.duplicates_allowed} of {self.unsettled_at_faults} "
            f"unsettled at kills/pauses/lapses, beyond {self.duplicates_beyond_n}); malformed injected "
            f"{self.malformed_injected}, quarantined {self.quarantined}; lost {self.lost}; duplicate "
            f"deliveries with distinct fences {len(self.duplicate_fences)}; checkpoint samples "
            f"{self.checkpoint_samples}, regressions {len(self.checkpoint_regressions)} (handover rewinds "
            f"{self.handover_rewinds}); paused holders {self.paused_holders}; lease lapses {self.lapses}; "
            f"rebuilds {len(self.rebuilds)} "
            f"(killed {self.rebuilds_killed}, failed {len(self.rebuild_failures)}); crashes {len(self.crashes)}; "
            f"RSS max start {self.rss_start_kib // 1024} MiB, end {self.rss_end_kib // 1024} MiB, "
            f"longest-lived replica ({self.oldest_uptime_s:.0f}s) {self.oldest_rss_start_kib // 1024} -> "
            f"{self.oldest_rss_end_kib // 1024} MiB; "
            f"drained in {self.drain_s:.1f}s"
        )


# --------------------------------------------------------------------------- replicas


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass(eq=False)
class Replica:
    name: str
    proc: Process
    log_path: Path
    port_file: Path
    out: IO[bytes]
    tag: str = ""
    """This process's tag in its gateway URL (one per start)."""
    gateway: str = "outbox"
    started_at: float = 0.0
    rss_first_kib: int = 0
    expected_exit: bool = False
    stopped: bool = False

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def replica_env(config: ChaosConfig, db: Path, *, mongo_uri: str = "", es_url: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WOWD_") and k != "NOTIFY_SOCKET"}
    if config.backend == "mongo-sim":
        env.update(
            {
                "WOWD_BACKEND": "mongo",
                "WOWD_MONGODB__URI": mongo_uri,
                "WOWD_MONGODB__DATABASE": MONGO_DATABASE,
                "WOWD_ELASTICSEARCH__URL": es_url,
            }
        )
    else:
        env.update({"WOWD_BACKEND": "embedded", "WOWD_EMBEDDED__PATH": str(db)})
    env.update(
        {
            "WOWD_CONTEXT": CONTEXT,
            "WOWD_PARTITIONS": str(config.partitions),
            "WOWD_HTTP__HOST": "127.0.0.1",
            "WOWD_HTTP__PORT": "0",
            "WOWD_LEASE__LIMIT": str(config.limit),
            "WOWD_LEASE__TTL_S": str(config.ttl_s),
            "WOWD_LEASE__TOLERANCE_S": str(config.tolerance_s),
            "WOWD_TIMERS__CLAIM_TTL_S": str(config.claim_ttl_s),
            "WOWD_TIMERS__BACKOFF_BASE_S": "0.2",
            "WOWD_TIMERS__BACKOFF_MAX_S": "2",
            "WOWD_TIMERS__MAX_BODY_BYTES": str(MAX_BODY_BYTES),
            "WOWD_GATEWAY__KIND": "outbox",
            "WOWD_SHUTDOWN__GRACE_S": str(config.grace_s),
            "WOWD_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@dataclass(frozen=True)
class FaultMark:
    """A kill, or a pause of a slot holder, with the timers the replica had claimed and not
    settled at that moment (read from the timer store while the process could not move)."""

    kind: str
    replica: str
    tag: str
    at: float
    """``time.monotonic()``, the target's clock."""
    unsettled: frozenset[str]
    """Request ids of the replica's FIRING claims."""


# --------------------------------------------------------------------------- the producer


@dataclass
class Expected:
    """What the producer wrote: what the stores must show at the end."""

    versions: dict[str, int] = field(default_factory=dict)
    timers: dict[str, str] = field(default_factory=dict)
    """request id -> "owner/key" of each timer scheduled to fire during the run."""
    racing: list[tuple[int, str, str, int, str]] = field(default_factory=list)
    """(cancel at ms, aggregate id, key, due ms, request id) of the cancels still to append."""
    cancel_in_time: dict[str, str] = field(default_factory=dict)
    """request id -> "owner/key" of the timers whose cancel was appended before their due time:
    never to be delivered."""
    cancel_raced: dict[str, str] = field(default_factory=dict)
    """The same for cancels appended around or after the due time: delivered or not."""
    later: dict[str, tuple[AggregateRef, str]] = field(default_factory=dict)
    """Aggregate id -> (owner, key) of a far-future timer its next commit cancels."""
    cancelled: list[tuple[AggregateRef, str]] = field(default_factory=list)
    malformed: dict[str, str] = field(default_factory=dict)
    """Aggregate id -> the field its quarantine reason must name."""

    def must_fire(self) -> set[str]:
        return set(self.timers) - set(self.cancel_in_time) - set(self.cancel_raced)


RAW_DEFECTS: list[tuple[str, dict[str, Any]]] = [
    ("request_id", {"request_id": None}),
    ("version", {"version": "seven"}),
    ("events", {"events": {"not": "a list"}}),
    ("create_time", {"create_time": 1.5}),
]
EVENT_DEFECTS: list[tuple[str, dict[str, Any]]] = [
    ("rule.type", {"rule": {"type": "fortnightly"}}),
    ("body.command", {"command": {"name": "c", "body": {"pad": "x" * (MAX_BODY_BYTES + 1)}}}),
    ("body.target", {"target": {"context": "Not.A.Name", "aggregate": AGGREGATE, "id": "x"}}),
    ("body.due_at", {"due_at": -1}),
]


def _ref(agg_id: str) -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate=AGGREGATE, id=agg_id)


def _scheduled(agg_id: str, key: str, due: int, **override: Any) -> DomainEvent:
    body: dict[str, Any] = {
        "key": key,
        "due_at": due,
        "rule": {"type": "once"},
        "target": {"context": CONTEXT, "aggregate": AGGREGATE, "id": agg_id},
        "command": {"name": "expire-order", "body": {"order_id": agg_id, "key": key}},
    }
    body.update(override)
    return DomainEvent(id=uuid.uuid4().hex, name="TimerScheduled", body=body)


class Producer:
    def __init__(self, config: ChaosConfig, log_store: Any, rng: random.Random) -> None:
        self._config = config
        self._log = log_store
        self._rng = rng
        self.expected = Expected()
        self._n = 0
        self._bad = 0

    def _commit(self, agg_id: str, events: list[DomainEvent], now: int) -> Commit:
        version = self.expected.versions.get(agg_id, 0) + 1
        self.expected.versions[agg_id] = version
        return Commit(
            ref=_ref(agg_id),
            version=version,
            command_id=uuid.uuid4().hex,
            request_id=uuid.uuid4().hex,
            create_time=now,
            events=(DomainEvent(id=uuid.uuid4().hex, name="ItemAdded", body={"n": version}), *events),
            access={"owner_id": "chaos", "space_id": "", "tags": []},
        )

    def _good(self, now: int) -> Commit:
        rng, exp = self._rng, self.expected
        agg_id = f"order-{rng.randrange(self._config.aggregates)}"
        version = exp.versions.get(agg_id, 0) + 1
        due = now + rng.randint(*self._config.due_in_ms)
        key = f"t{version}"
        events = [_scheduled(agg_id, key, due)]
        pending = exp.later.pop(agg_id, None)
        if pending is not None:
            events.append(DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": pending[1]}))
            exp.cancelled.append(pending)
        elif rng.random() < 0.15:
            later = f"later{version}"
            events.append(_scheduled(agg_id, later, now + 3_600_000))
            exp.later[agg_id] = (_ref(agg_id), later)
        commit = self._commit(agg_id, events, now)
        owner = commit.ref
        rid = request_id_for(deterministic_timer_id(owner, key, version), due)
        exp.timers[rid] = f"{agg_id}/{key}"
        if rng.random() < self._config.cancel_share:
            # cancelled by a later commit: in the same batch, before, around or after the due time
            at = now if rng.random() < 0.15 else now + rng.randint(0, due - now + 300)
            exp.racing.append((at, agg_id, key, due, rid))
        return commit

    def _cancels(self, now: int) -> list[tuple[Commit, int, str, str]]:
        """The cancel commits due by ``now``: (commit, timer due ms, request id, "owner/key")."""
        exp = self.expected
        out: list[tuple[Commit, int, str, str]] = []
        keep: list[tuple[int, str, str, int, str]] = []
        for item in exp.racing:
            at, agg_id, key, due, rid = item
            if at > now:
                keep.append(item)
                continue
            event = DomainEvent(id=uuid.uuid4().hex, name="TimerCancelled", body={"key": key})
            out.append((self._commit(agg_id, [event], now), due, rid, f"{agg_id}/{key}"))
            exp.cancelled.append((_ref(agg_id), key))
        exp.racing = keep
        return out

    async def _append(self, commits: list[Commit]) -> None:
        for attempt in range(50):
            try:
                outcomes = await self._log.append_many(commits)
                break
            except StorageUnavailable:
                await anyio.sleep(min(1.0, 0.05 * 2**attempt))
        else:
            raise RuntimeError("the producer could not append for 50 attempts")
        assert all(o in ("appended", "duplicate") for o in outcomes), outcomes

    async def _malformed(self, now: int) -> Commit | None:
        """One malformed input: a raw document that is no commit, or a commit (returned, to be
        appended) whose timer event is refused."""
        self._bad += 1
        n = self._bad
        if n % 2:
            fieldname, defect = RAW_DEFECTS[(n // 2) % len(RAW_DEFECTS)]
            agg_id = f"bad-{n}"
            doc = {
                "tenant_id": "(0)",
                "aggregate_id": agg_id,
                "version": 1,
                "command_id": "c",
                "request_id": uuid.uuid4().hex,
                "create_time": now,
                "events": [],
                **defect,
            }
            if self._config.backend == "mongo-sim":
                # on MongoDB the log writer writes the partition (docs/schema.md): a producer's
                # malformed document still has one, or no partition would ever read it
                doc["partition"] = partition(agg_id, self._config.partitions)
            for attempt in range(50):
                try:
                    await self._log.insert_raw(TYPE, doc)
                    break
                except StorageUnavailable:
                    await anyio.sleep(min(1.0, 0.05 * 2**attempt))
                except ConflictError:
                    if not attempt:
                        raise
                    break  # an earlier attempt landed (its reply was lost): the document is there
            self.expected.malformed[agg_id] = fieldname
            return None
        fieldname, override = EVENT_DEFECTS[(n // 2) % len(EVENT_DEFECTS)]
        agg_id = f"rej-{n}"
        self.expected.malformed[agg_id] = fieldname
        return self._commit(agg_id, [_scheduled(agg_id, "bad", now + 1000, **override)], now)

    async def run(self, until: float) -> None:
        # the pace is a schedule of ticks up to ``until``, not a sleep after each append: an append
        # slowed by a fault or a loaded host is caught up with, so a run writes what its rate and
        # duration say (a tick written late still counts)
        tick = 0.2
        per_tick = max(1, round(self._config.rate_per_s * tick))
        start = anyio.current_time()
        ticks = max(1, round((until - start) / tick))
        for i in range(ticks):
            await anyio.sleep_until(start + i * tick)  # the producer's pace (not a synchronisation)
            now = int(time.time() * 1000)
            batch: list[Commit] = []
            for _ in range(per_tick):
                self._n += 1
                if self._n % self._config.malformed_every == 0:
                    bad = await self._malformed(now)
                    if bad is not None:
                        batch.append(bad)
                else:
                    batch.append(self._good(now))
            cancels = self._cancels(now)
            batch += [c for c, _due, _rid, _name in cancels]
            await self._append(batch)
            appended = time.time() * 1000  # every cancel of the batch is in the log by now
            for _c, due, rid, name in cancels:
                if appended < due:
                    self.expected.cancel_in_time[rid] = name
                else:
                    self.expected.cancel_raced[rid] = name


# --------------------------------------------------------------------------- the harness


class Harness:
    def __init__(self, config: ChaosConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.db = workdir / "wowd.db"
        self.env = replica_env(config, self.db)
        self.rng = random.Random(config.seed)
        self.replicas: dict[str, Replica] = {}
        self.report = ChaosReport(config=config)
        self._joined = 0
        self._checkpoints: dict[int, tuple[tuple[int, ...], int]] = {}
        self._fences: dict[int, int] = {}
        self._claims: dict[str, frozenset[str]] = {}
        self._claims_before: dict[str, frozenset[str]] = {}
        self._claims_at = 0.0
        self._log_seen: dict[str, int] = {}
        self._starts = 0
        self.marks: list[FaultMark] = []
        self._es_model: Any = None
        """The Elasticsearch fake's model (``mongo-sim``): what its index refuses."""
        self._outage_rng = random.Random(config.seed + 3)
        self._rebuild_rng = random.Random(config.seed + 4)
        pick = random.Random(config.seed + 2)
        aggs = [f"order-{i}" for i in range(config.aggregates)]
        slow = {a for a in aggs if pick.random() < config.slow_share}
        if config.slow_share > 0 and not slow:
            slow = {pick.choice(aggs)}
        self.target = CommandTarget(slow=slow, slow_s=config.slow_latency_s)

    # ------------------------------------------------------------------ processes

    async def start(self, name: str) -> Replica:
        log_path = self.workdir / f"{name}.log"
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)  # written again once this process listens
        out = log_path.open("ab")
        self._starts += 1
        tag = f"{name}.{self._starts}"
        kind: str = self.config.gateway
        if kind == "mixed":
            kind = "http" if self._starts % 2 else "outbox"
        gateway = {"WOWD_GATEWAY__KIND": kind}
        if kind == "http":
            gateway["WOWD_GATEWAY__URL"] = self.target.url(tag)
        proc = await forkserver.open_process(
            [sys.executable, "-m", "wowd", "run", "--port-file", str(port_file)],
            stdin=None,
            stdout=out,
            stderr=out,
            cwd=self.workdir,
            env={**self.env, **gateway, "WOWD_LEASE__OWNER_KEY": name},
        )
        old = self.replicas.get(name)
        if old is not None:
            old.out.close()
        replica = Replica(
            name=name,
            proc=proc,
            log_path=log_path,
            port_file=port_file,
            out=out,
            tag=tag,
            gateway=kind,
            started_at=anyio.current_time(),
        )
        self.replicas[name] = replica
        log.info("started %s (pid %d, %s gateway, tag %s)", name, proc.pid, kind, tag)
        return replica

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.alive]

    def check_crashes(self) -> None:
        for r in self.replicas.values():
            if not r.alive and not r.expected_exit:
                r.expected_exit = True  # reported once
                self.report.crashes.append(f"{r.name} exited {r.proc.returncode}: {r.tail()}")

    async def kill(self, r: Replica) -> None:
        r.expected_exit = True
        if r.stopped:
            r.proc.send_signal(signal.SIGCONT)
            r.stopped = False
        r.proc.kill()
        await r.proc.wait()

    async def _claims_of(self, name: str) -> set[str]:
        """Request ids of the FIRING timers claimed under ``name`` (any of its slot keys)."""
        return set((await self._all_claims()).get(name, frozenset()))

    async def _all_claims(self) -> dict[str, frozenset[str]]:
        """Request ids of the FIRING timers by the replica that claimed them (one read)."""
        for attempt in range(50):
            try:
                firing = await self._timers.queries.scan(status=TimerStatus.FIRING, limit=1_000_000)
                break
            except StorageUnavailable:
                await anyio.sleep(min(1.0, 0.05 * 2**attempt))
        else:
            raise RuntimeError("the timer store did not answer for 50 attempts")
        claims: dict[str, set[str]] = {}
        for t in firing:
            if t.claim is not None:
                claims.setdefault(t.claim.owner_key.split("#")[0], set()).add(t.request_id)
        return {k: frozenset(v) for k, v in claims.items()}

    async def mark(self, kind: str, r: Replica) -> None:
        """Records a fault of ``r`` (dead or paused: its claims cannot move) with its claimed and
        unsettled timers, the deliveries the next holder may send again."""
        at = time.monotonic()
        unsettled = frozenset(await self._claims_of(r.name))
        self.marks.append(FaultMark(kind=kind, replica=r.name, tag=r.tag, at=at, unsettled=unsettled))
        self.report.unsettled_at_faults += len(unsettled)

    async def wait_started(self, r: Replica, within: float = 15.0) -> bool:
        """Polls until the replica listens (its port file is written: its signal handling is in
        place), inside ``move_on_after``; False when it exited or did not start in time."""
        with anyio.move_on_after(within):
            while r.alive:
                if r.port_file.exists() and r.port_file.read_text().strip():
                    return True
                await anyio.sleep(0.05)
        return False

    async def is_ready(self, r: Replica) -> bool:
        """``/readyz`` of this very process answers 200: it holds a valid lease now."""
        import httpx

        from tests.processes import local_client

        if not r.alive or r.stopped or not r.port_file.exists():
            return False
        try:
            port = int(r.port_file.read_text())
            async with local_client(1.0) as client:
                return (await client.get(f"http://127.0.0.1:{port}/readyz?holding=1")).status_code == 200
        except (httpx.HTTPError, ValueError, OSError):
            return False

    async def terminate(self, r: Replica, within: float = 15.0) -> None:
        """SIGTERM once the replica is up (a SIGTERM during its start-up imports would find
        Python's default action, not the daemon's graceful stop)."""
        if not await self.wait_started(r):
            self.report.unclean_exits.append(f"{r.name} did not start: {r.tail()}")
        r.expected_exit = True
        if r.stopped:
            r.proc.send_signal(signal.SIGCONT)
            r.stopped = False
        r.proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(within):
            await r.proc.wait()
        if r.alive:
            self.report.unclean_exits.append(f"{r.name} did not exit within {within}s of SIGTERM")
            await self.kill(r)
        elif r.proc.returncode != 0:
            self.report.unclean_exits.append(f"{r.name} exited {r.proc.returncode}: {r.tail()}")

    # ------------------------------------------------------------------ faults

    def _schedule(self) -> list[str]:
        first = list(FAULTS)
        self.rng.shuffle(first)
        return first

    async def fault(self, kind: str) -> None:
        live = [r for r in self.live() if not r.stopped]
        if kind == "join" and len(self.live()) >= self.config.max_replicas:
            kind = "restart"
        if not live and kind != "join":
            kind = "join"
        if kind == "kill":
            r = self.rng.choice(live)
            log.info("fault: SIGKILL %s", r.name)
            await self.kill(r)
            await self.mark("kill", r)
            await anyio.sleep(self.rng.uniform(0.2, 1.5))  # down for a while, then restarted
            await self.start(r.name)
        elif kind == "restart":
            r = self.rng.choice(live)
            log.info("fault: SIGTERM + restart %s", r.name)
            await self.terminate(r)
            self.report.claims_left_by_graceful_stops += len(await self._claims_of(r.name))
            await self.start(r.name)
        elif kind == "join":
            self._joined += 1
            log.info("fault: standby joins")
            await self.start(f"joined-{self._joined}")
        elif kind == "stop":
            await self._pause(live)
        self.report.faults[kind] += 1

    async def _pause(self, live: list[Replica]) -> None:
        held = [r for r in live if await self.is_ready(r)]
        r = self.rng.choice(held or live)
        was_holder = r in held
        mark = len(r.log_text())
        pause = self.config.ttl_s + self.config.tolerance_s + self.rng.uniform(0.5, 1.5)
        log.info("fault: SIGSTOP %s for %.1fs (holder: %s)", r.name, pause, was_holder)
        r.proc.send_signal(signal.SIGSTOP)
        r.stopped = True
        await self.mark("stop", r)
        await anyio.sleep(pause)  # the fault itself: paused longer than the ttl
        r.proc.send_signal(signal.SIGCONT)
        r.stopped = False
        if not was_holder:
            return
        self.report.paused_holders += 1
        try:
            with anyio.fail_after(10):
                while not any(m in r.log_text()[mark:] for m in ("lost slot", "released slot")):
                    if not r.alive:
                        return
                    await anyio.sleep(0.05)
        except TimeoutError:
            self.report.paused_holders_kept_acting.append(f"{r.name}: {r.tail(5)}")

    async def _sink_outages(self, until: float) -> None:
        """The event index down and up again while the other faults go on: a write block on the
        index (the fake answers 403 ``cluster_block_exception`` to every write) for 2 to 6 s, every
        8 to 15 s. The replicas' index views fall behind and catch up; their timers keep firing."""
        model, rng = self._es_model, self._outage_rng
        index = f"wow.{CONTEXT}.{TYPE.aggregate}.events"
        while anyio.current_time() < until:
            await anyio.sleep(rng.uniform(8.0, 15.0))
            if anyio.current_time() >= until or index not in model.indices:
                continue
            down = rng.uniform(2.0, 6.0)
            log.info("fault: the event index refuses writes for %.1fs", down)
            model.block_writes(index)
            self.report.faults["sink"] += 1
            try:
                await anyio.sleep(down)
            finally:
                model.block_writes(index, on=False)

    async def _rebuilds(self, until: float) -> None:
        """Rebuilds of the timer view while the producer writes (``rebuild_gap_s``), never two at
        once (with ``rebuild_kill_first``, past ``until`` until one ended by itself); after a
        MongoDB rebuild killed while it held the slots, the next one waits until that hold has
        lapsed (a hold of another rebuild refuses it)."""
        gap, rng = self.config.rebuild_gap_s, self._rebuild_rng
        if gap is None:
            return
        first = self.config.rebuild_kill_first
        ended = not first  # a rebuild that ended by itself is still to come
        while True:
            await anyio.sleep(rng.uniform(*gap))  # the schedule's pace
            if anyio.current_time() >= until and ended:
                return
            kill = first or rng.random() < self.config.rebuild_kill_share
            run = await self.rebuild(kill=kill, within=self.config.rebuild_within_s, at_start=first)
            ended = ended or not run.killed
            first = False
            self.report.faults["rebuild"] += 1
            if run.held and run.exit_code != 0:
                await self._hold_lapsed()

    async def rebuild(self, *, kill: bool, within: float, at_start: bool = False) -> RebuildRun:
        """One ``python -m wowd timers rebuild`` with the replicas' environment, its output in
        ``rebuild-N.log``, SIGKILLed and failed when it runs longer than ``within``; with
        ``kill``, SIGKILLed a moment after a line drawn among its progress lines (the first one;
        on MongoDB also the hold line), unless it printed its summary by then (then it ends as it
        would); with ``kill`` and ``at_start``, run by :mod:`tests.chaos.stopping_rebuild`, which
        stops itself once its replay is done, and SIGKILLed there (always partway). Recorded in the
        report; a non-zero exit other than by the kill is a failure."""
        rng = self._rebuild_rng
        n = len(self.report.rebuilds) + 1
        at = time.monotonic() - self._t0
        triggers = ["rebuild: "] + ([HOLD_LINE] if self.config.backend == "mongo-sim" else [])
        trigger = rng.choice(triggers)
        # the embedded rebuild of a short log swaps within tens of ms of its first progress line
        delay = rng.uniform(0.0, 0.5 if self.config.backend == "mongo-sim" else 0.05)
        command = [sys.executable, "-m", "wowd", "timers", "rebuild"]
        env = self.env
        if at_start and kill:
            # a rebuild that stops itself between its replay and its carry-over: the kill lands
            # there whatever the machine's load (a short log's rebuild outruns a reaction to a line)
            trigger, delay = STOPPED_LINE, 0.0
            command = [sys.executable, "-m", "tests.chaos.stopping_rebuild"]
            env = {**self.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH")]))}
        log_path = self.workdir / f"rebuild-{n}.log"
        errors_path = self.workdir / f"rebuild-{n}.err"
        log.info("fault: timer view rebuild %d%s", n, f" (killed after {trigger!r})" if kill else "")
        lines: list[str] = []
        seen = anyio.Event()
        killed = ""
        started = anyio.current_time()
        with log_path.open("ab") as out, errors_path.open("ab") as errors:
            proc = await forkserver.open_process(command, stdin=None, stderr=errors, cwd=self.workdir, env=env)

            async def read() -> None:
                assert proc.stdout is not None
                buffer = b""
                async for chunk in proc.stdout:
                    out.write(chunk)
                    buffer += chunk
                    *complete, buffer = buffer.split(b"\n")
                    for raw in complete:
                        line = raw.decode(errors="replace")
                        lines.append(line)
                        if line.startswith(trigger):
                            seen.set()
                seen.set()  # its output ended: it exited

            try:
                with anyio.move_on_after(within) as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(read)
                        if kill:
                            await seen.wait()
                            if trigger == STOPPED_LINE:
                                await stopped(proc.pid)
                            await anyio.sleep(delay)  # a point of the rebuild after the line
                            if proc.returncode is None and not any(x.startswith("summary: ") for x in lines):
                                killed = lines[-1] if lines else "(no output)"
                                proc.kill()
                        await proc.wait()
            finally:
                with anyio.CancelScope(shield=True):
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
                    await proc.aclose()
        code = proc.returncode
        timed_out = scope.cancelled_caught
        if timed_out or code != -signal.SIGKILL:
            killed = ""  # it ended before the kill, or ran too long (a failure, not an interruption)
        err_lines = errors_path.read_text(errors="replace").splitlines()
        summary = next((x for x in reversed(lines) if x.startswith("summary: ")), "")
        failed = code != 0 and not killed and not timed_out  # its error says why
        last = summary or (err_lines[-1] if failed and err_lines else (lines[-1] if lines else ""))
        run = RebuildRun(
            at=at,
            took_s=anyio.current_time() - started,
            exit_code=code,
            killed=killed,
            held=any(x.startswith(HOLD_LINE) for x in lines),
            last_line=f"still running after {within:g}s, killed: {last}" if timed_out else last,
        )
        self.report.rebuilds.append(run)
        log.info("rebuild %d: %s", n, run.text())
        if code != 0 and not killed:
            self.report.rebuild_failures.append(f"rebuild {n} {run.text()} ({log_path.name}, {errors_path.name})")
        return run

    async def _hold_lapsed(self, within: float = 45.0) -> None:
        """Polls the lease store until no slot of the replicas' namespace is held (a killed
        rebuild's hold lapses ``HOLD_TTL_S`` after its last renewal), inside ``move_on_after``;
        a hold still there after ``within`` is a failure."""
        with anyio.move_on_after(within):
            while True:
                try:
                    slots = await self._leases.slots(f"wowd.{CONTEXT}")
                except StorageUnavailable:
                    slots = None
                if slots is not None and not any(st.held for st in slots):
                    return
                await anyio.sleep(0.5)
        self.report.rebuild_failures.append(f"the hold of a killed rebuild did not lapse within {within}s")

    async def _faults(self, until: float) -> None:
        lo, hi = self.config.fault_gap_s
        queue = self._schedule()
        while True:
            await anyio.sleep(self.rng.uniform(lo, hi))  # the schedule's pace
            if anyio.current_time() >= until and not queue:  # every kind of fault at least once
                return
            self.check_crashes()
            kind = queue.pop(0) if queue else self.rng.choices(FAULTS, weights=(3, 3, 2, 1))[0]
            await self.fault(kind)

    # ------------------------------------------------------------------ sampling and checks

    async def _sample_checkpoints(self) -> None:
        parts = list(range(self.config.partitions))
        while True:
            try:
                cps = await self._checkpoint_store.read(CONSUMER, parts)
            except Exception as exc:  # a busy file: the next sample will do
                log.debug("checkpoint sample failed: %s", exc)
                cps = {}
            for p, cp in cps.items():
                seq, fence = progress(cp.position), cp.fence
                last = self._checkpoints.get(p)
                if last is not None:
                    last_seq, last_fence = last
                    if fence < last_fence:
                        self.report.checkpoint_regressions.append(f"partition {p}: fence {last_fence} -> {fence}")
                    elif fence == last_fence and seq < last_seq:
                        self.report.checkpoint_regressions.append(
                            f"partition {p}: seq {last_seq} -> {seq} under fence {fence}"
                        )
                    elif fence > last_fence and seq < last_seq:
                        self.report.handover_rewinds += 1
                self._checkpoints[p] = (seq, fence)
            try:
                slots = await self._leases.slots(f"wowd.{CONTEXT}")
            except Exception as exc:  # a busy file: the next sample will do
                log.debug("slot sample failed: %s", exc)
                slots = []
            for st in slots:
                last_fence = self._fences.get(st.slot, 0)
                if st.fence < last_fence:
                    self.report.checkpoint_regressions.append(f"slot {st.slot}: fence {last_fence} -> {st.fence}")
                self._fences[st.slot] = max(last_fence, st.fence)
            self.report.checkpoint_samples += 1
            await self._watch_lapses()
            now = anyio.current_time()
            for r in self.live():
                if not r.rss_first_kib and now - r.started_at >= 3.0:
                    r.rss_first_kib = _rss_kib(r.proc.pid)  # settled in: the replica's starting RSS
            await anyio.sleep(self.config.sample_every_s)

    async def _watch_lapses(self) -> None:
        """Marks a replica that lost its lease on its own (``lapse``; not within
        :data:`LAPSE_AFTER_PAUSE_S` of a pause or a kill by the soak, whose marks count already) with
        the claims it held at the sample before or now: wowd delivers at least once after a lost
        lease, and the next holder may send those again."""
        now = time.monotonic()
        if now - self._claims_at >= LAPSE_CLAIMS_EVERY_S:
            self._claims_at = now
            self._claims_before, self._claims = self._claims, await self._all_claims()
        for r in self.live():
            text = r.log_text()
            seen = self._log_seen.get(r.name, 0)
            self._log_seen[r.name] = len(text)
            if "lost slot" not in text[seen:] or r.stopped:
                continue
            if any(m.replica == r.name and now - m.at < LAPSE_AFTER_PAUSE_S for m in self.marks if m.kind != "lapse"):
                continue
            unsettled = self._claims_before.get(r.name, frozenset()) | self._claims.get(r.name, frozenset())
            unsettled |= frozenset(await self._claims_of(r.name))
            self.marks.append(FaultMark(kind="lapse", replica=r.name, tag=r.tag, at=now, unsettled=unsettled))
            self.report.lapses += 1
            self.report.unsettled_at_faults += len(unsettled)

    async def _outbox(self) -> list[Any]:
        entries: list[Any] = []
        while True:
            page = await self._outbox_store.entries(limit=5000, after=len(entries))
            entries += page
            if len(page) < 5000:
                return entries

    async def _sink_state(self, producer: Producer) -> tuple[list[str], list[str]]:
        sink = self._sink
        if self.config.backend == "mongo-sim":
            # a search sees what the last refresh made visible (the replicas write without one;
            # a server refreshes each second, the fake on request)
            await self._es.indices.refresh(index=sink.index)
        missing: list[str] = []
        extra: list[str] = []
        for agg_id, version in sorted(producer.expected.versions.items()):
            docs = await sink.documents(_ref(agg_id))
            got = [int(d["version"]) for d in docs]
            want = list(range(1, version + 1))
            if got != want:
                missing += [f"{agg_id} v{v}" for v in sorted(set(want) - set(got))]
                counts = Counter(got)
                extra += [f"{agg_id} v{v} x{n}" for v, n in counts.items() if n > 1 or v not in want]
        return missing, extra

    async def _caught_up(self, producer: Producer) -> bool:
        """Every timer that must fire did (the target saw it, or it waits in the outbox), every
        malformed commit is quarantined and the event index holds every version. A store that
        does not answer in time is not caught up yet: the replicas share the store with this poll,
        and a slow answer under load is not the soak's failure (what the replicas did is checked
        after the drain)."""
        must, delivered = producer.expected.must_fire(), set(self.target.by_request)
        try:
            if not must <= delivered:  # the outbox is read only while needed
                delivered |= {e.request_id for e in await self._outbox()}
                if not must <= delivered:
                    return False
            if len(await self._quarantine.items(limit=100_000)) < len(producer.expected.malformed):
                return False
        except StorageUnavailable as exc:
            log.info("drain: the store did not answer the poll (%s); polling again", exc)
            return False
        missing, _extra = await self._sink_state(producer)
        return not missing

    async def _final_checks(self, producer: Producer) -> None:
        rep, exp, cfg = self.report, producer.expected, self.config
        entries = await self._outbox()
        by_request: dict[str, set[int]] = {}
        owners: dict[tuple[int, int], set[str]] = {}
        for e in entries:
            by_request.setdefault(e.request_id, set()).add(e.fence)
            slot = partition(e.target.id, cfg.partitions) % cfg.limit
            owners.setdefault((slot, e.fence), set()).add(e.owner_key)
        rep.duplicate_fences = [f"{rid}: fences {sorted(f)}" for rid, f in by_request.items() if len(f) > 1]
        if len(entries) != len(by_request):
            rep.duplicate_fences.append(f"{len(entries) - len(by_request)} repeated request ids")
        rep.fence_owner_conflicts = [f"slot {s} fence {f}: {sorted(o)}" for (s, f), o in owners.items() if len(o) > 1]
        target = self.target
        delivered = set(by_request) | set(target.by_request)
        must = exp.must_fire()
        rep.timers_expected = len(must)
        rep.timers_fired = len(must & delivered)
        rep.lost_timers = [exp.timers[rid] for rid in sorted(must - delivered)]
        rep.cancelled_in_time = len(exp.cancel_in_time)
        rep.cancelled_raced = len(exp.cancel_raced)
        rep.cancelled_delivered = [
            f"{name} ({rid}): {self._deliveries_text(rid)}"
            for rid, name in sorted(exp.cancel_in_time.items())
            if rid in delivered
        ]
        rep.http_deliveries = len(target.deliveries)
        rep.deliveries = len(target.deliveries) + len(entries)
        rep.slow_targets = len(target.slow)
        rep.slow_deliveries = sum(1 for d in target.deliveries if d.target_id in target.slow)
        rep.target_refused = list(target.refused)
        self._duplicates({e.request_id for e in entries})

        stored: list[Timer] = await self._timers.queries.scan(limit=100_000)
        rep.dead_timers = [
            f"{t.owner.id}/{t.key} {t.status.value}: {t.last_error}"
            for t in stored
            if t.status in (TimerStatus.FAILED, TimerStatus.PARKED)
        ]
        rep.cancelled = len(exp.cancelled)
        gone = {(t.owner.id, t.key) for t in stored}
        rep.cancelled_left = [f"{o.id}/{k}" for o, k in exp.cancelled if (o.id, k) in gone]

        good = {a: v for a, v in exp.versions.items() if not a.startswith("bad-")}
        rep.commits_expected = sum(good.values())
        missing, extra = await self._sink_state(producer)
        rep.lost_commits, rep.extra_documents = missing, extra
        rep.commits_fed = rep.commits_expected - len(missing)

        quarantined = await self._quarantine.items(limit=100_000)
        rep.quarantined = len(quarantined)
        rep.malformed_injected = len(exp.malformed)
        seen: dict[str, str] = {}
        for q in quarantined:
            agg_id = str(q["raw"].get("aggregate_id"))
            if agg_id in seen:
                rep.quarantine_mismatch.append(f"{agg_id} quarantined twice")
            seen[agg_id] = str(q["reason"])
        for agg_id, fieldname in exp.malformed.items():
            reason = seen.get(agg_id)
            if reason is None:
                rep.quarantine_mismatch.append(f"{agg_id} ({fieldname}) not quarantined")
            elif f"{fieldname}: " not in reason:
                rep.quarantine_mismatch.append(f"{agg_id}: reason {reason!r} does not name {fieldname}")
        rep.quarantine_mismatch += [f"{a} quarantined, not injected" for a in seen if a not in exp.malformed]

    def _deliveries_text(self, rid: str) -> str:
        t0 = self._t0
        ds = self.target.by_request.get(rid, [])
        return ", ".join(f"{d.tag} at {d.at - t0:.3f}s" for d in ds) or "in the outbox"

    def _resent_by_one_process(self, rid: str) -> int:
        """The requests of ``rid`` a replica process sent again with no pause (or lease lost on its
        own) between the two that found the timer claimed by it and unsettled (a delivery in flight at a pause
        may come back failed, a timeout run out while the process stood still, and be retried
        by the same process once it holds the slot again: a MongoDB rebuild's hold leaves the
        slot to nobody meanwhile)."""
        sends: dict[str, list[float]] = {}
        for d in self.target.by_request.get(rid, []):
            sends.setdefault(d.tag, []).append(d.at)
        resent = 0
        for tag, times in sends.items():
            pauses = sorted(
                m.at for m in self.marks if m.kind in ("stop", "lapse") and m.tag == tag and rid in m.unsettled
            )
            for before, after in itertools.pairwise(sorted(times)):
                between = next((at for at in pauses if before <= at <= after), None)
                if between is None:
                    resent += 1
                else:
                    pauses.remove(between)  # one repeat per pause
        return resent

    def _duplicates(self, in_outbox: set[str]) -> None:
        """Counts the deliveries beyond the first of each request id (the target's requests and
        the outbox's entry), and which of them a fault allows: one per kill or pause of a replica
        that held the timer claimed and unsettled at that moment. Any other repeat (a replica
        sending a request id twice with no pause of its own in between, a re-fire of a settled
        timer) is beyond the allowance."""
        rep = self.report
        allowance: Counter[str] = Counter()
        for m in self.marks:
            allowance.update(m.unsettled)
        counts: Counter[str] = Counter({rid: len(ds) for rid, ds in self.target.by_request.items()})
        counts.update(in_outbox)
        for rid, n in sorted(counts.items()):
            extra = n - 1
            if extra <= 0:
                continue
            rep.duplicates += extra
            beyond = max(extra - allowance[rid], self._resent_by_one_process(rid))
            rep.duplicates_allowed += extra - beyond
            if beyond > 0:
                rep.duplicates_beyond_n += beyond
                faults = [f"{m.kind} {m.tag} at {m.at - self._t0:.3f}s" for m in self.marks if rid in m.unsettled]
                rep.duplicates_beyond.append(
                    f"{rid} x{n} ({self._deliveries_text(rid)}; outbox {rid in in_outbox}; "
                    f"faults with it unsettled: {faults or 'none'})"
                )

    # ------------------------------------------------------------------ run

    async def _open_stores(self, stack: AsyncExitStack) -> None:
        """The harness's own stores of the replicas' backend (the simulator and the
        Elasticsearch fake started first for ``mongo-sim``)."""
        cfg = self.config
        if cfg.backend == "mongo-sim":
            from elasticsearch import AsyncElasticsearch

            from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch
            from tests.timer_stores import mongo_timers
            from wowd.stores.elasticsearch.sink import ElasticsearchEventSink
            from wowd.stores.mongo.checkpoints import MongoCheckpoints
            from wowd.stores.mongo.leases import MongoSlotLeaseStore
            from wowd.stores.mongo.log import MongoLog
            from wowd.stores.mongo.outbox import MongoOutbox
            from wowd.stores.mongo.quarantine import MongoQuarantine

            uri = await self._start_simulator(stack)
            fake = FakeElasticsearch()
            fake.model = EsModel()
            fake.start()
            self._es_model = fake.model
            stack.callback(fake.stop)
            self.env = replica_env(cfg, self.db, mongo_uri=uri, es_url=fake.url)
            self._log = MongoLog(uri, MONGO_DATABASE, context=CONTEXT, partitions=cfg.partitions)
            self._checkpoint_store = MongoCheckpoints(uri, MONGO_DATABASE, context=CONTEXT)
            self._quarantine = MongoQuarantine(uri, MONGO_DATABASE, context=CONTEXT)
            self._leases = MongoSlotLeaseStore(uri, MONGO_DATABASE)
            self._timers = mongo_timers(uri, MONGO_DATABASE, context=CONTEXT, partitions=cfg.partitions)
            self._outbox_store = MongoOutbox(uri, MONGO_DATABASE, context=CONTEXT)
            self._es = AsyncElasticsearch(fake.url)
            self._sink = ElasticsearchEventSink(self._es, TYPE, refresh=True, owns_client=True)
        else:
            from tests.timer_stores import embedded_timers
            from wowd.stores.embedded.checkpoints import EmbeddedCheckpoints
            from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
            from wowd.stores.embedded.log import EmbeddedLog
            from wowd.stores.embedded.outbox import EmbeddedOutbox
            from wowd.stores.embedded.quarantine import EmbeddedQuarantine
            from wowd.stores.embedded.sink import EmbeddedEventSink

            self._log = EmbeddedLog(self.db, context=CONTEXT, partitions=cfg.partitions)
            self._checkpoint_store = EmbeddedCheckpoints(self.db, context=CONTEXT)
            self._quarantine = EmbeddedQuarantine(self.db, context=CONTEXT)
            self._leases = EmbeddedSlotLeaseStore(self.db)
            self._timers = embedded_timers(self.db, context=CONTEXT, partitions=cfg.partitions)
            self._outbox_store = EmbeddedOutbox(self.db)
            self._sink = EmbeddedEventSink(self.db, TYPE)
        stores = (self._log, self._checkpoint_store, self._quarantine, self._leases, self._timers, self._outbox_store)
        for store in (*stores, self._sink):
            stack.push_async_callback(store.close)
            await store.prepare()

    async def _start_simulator(self, stack: AsyncExitStack) -> str:
        """``python -m tests.mongosim`` on a free port (its own process, as a server is); its URI."""
        out = (self.workdir / "mongosim.log").open("ab")
        stack.callback(out.close)
        proc = await anyio.open_process(
            [sys.executable, "-m", "tests.mongosim", "--port", "0"],
            stdin=None,
            stderr=out,
            cwd=ROOT,
        )

        async def stop() -> None:
            with anyio.CancelScope(shield=True):
                proc.terminate()
                with anyio.move_on_after(10):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                await proc.aclose()

        stack.push_async_callback(stop)
        assert proc.stdout is not None
        line = b""
        with anyio.fail_after(30):
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive(1)
        text = line.decode().strip()
        if not text.startswith("mongosim listening: "):
            raise RuntimeError(f"the MongoDB simulator did not start: {text!r}")
        return text.split(": ", 1)[1]

    async def run(self) -> ChaosReport:
        async with AsyncExitStack() as stack:
            await self._open_stores(stack)
            return await self._run()

    async def _run(self) -> ChaosReport:
        cfg, rep = self.config, self.report
        started = anyio.current_time()
        self._t0 = time.monotonic()
        producer = Producer(cfg, self._log, random.Random(cfg.seed + 1))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.target.serve)
                for i in range(cfg.replicas):
                    await self.start(f"r{i}")
                tg.start_soon(self._sample_checkpoints)
                until = anyio.current_time() + cfg.duration_s
                async with anyio.create_task_group() as work:
                    work.start_soon(producer.run, until)
                    faults_until = until if cfg.faults_for_s is None else anyio.current_time() + cfg.faults_for_s
                    work.start_soon(self._faults, faults_until)
                    if cfg.backend == "mongo-sim" and cfg.sink_outages:
                        work.start_soon(self._sink_outages, until)
                    work.start_soon(self._rebuilds, until)
                    await anyio.sleep(min(5.0, cfg.duration_s / 2))  # replicas settled in
                    rep.rss_start_kib = max((_rss_kib(r.proc.pid) for r in self.live()), default=0)
                # drain: every replica running, then poll the stores until caught up
                self.check_crashes()
                if not any(r.alive for r in self.replicas.values()):
                    await self.start("drain")
                drain_started = anyio.current_time()
                with anyio.move_on_after(cfg.drain_s):
                    while True:
                        if await self._caught_up(producer):
                            rep.drained = True
                            break
                        self.check_crashes()
                        await anyio.sleep(0.25)
                rep.drain_s = anyio.current_time() - drain_started
                self.check_crashes()
                rep.rss_end_kib = max((_rss_kib(r.proc.pid) for r in self.live()), default=0)
                oldest = min(self.live(), key=lambda r: r.started_at, default=None)
                if oldest is not None:
                    rep.oldest_uptime_s = anyio.current_time() - oldest.started_at
                    rep.oldest_rss_start_kib = oldest.rss_first_kib
                    rep.oldest_rss_end_kib = _rss_kib(oldest.proc.pid)
                for r in self.live():
                    await self.terminate(r)  # the target answers until the replicas are gone
                tg.cancel_scope.cancel()
            await self._final_checks(producer)
        finally:
            with anyio.CancelScope(shield=True):
                for r in self.replicas.values():
                    if r.alive:
                        r.expected_exit = True
                        r.proc.send_signal(signal.SIGCONT)
                        r.proc.kill()
                        await r.proc.wait()
                    r.out.close()
                    await r.proc.aclose()
        rep.elapsed_s = anyio.current_time() - started
        return rep


async def run_chaos(config: ChaosConfig, workdir: Path) -> ChaosReport:
    """Runs one chaos schedule in ``workdir`` (the SQLite file and the replicas' logs)."""
    await anyio.Path(workdir).mkdir(parents=True, exist_ok=True)
    return await Harness(config, workdir).run()
