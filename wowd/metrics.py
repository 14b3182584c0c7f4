"""Every Prometheus metric wowd exports, in one place (names follow Prometheus conventions:
``wowd_`` prefix, base units in the name, ``_total`` for counters).

Stores and the daemon import the objects from here; the dashboard and the alert rules use only
these names (``tests/test_ops.py`` checks that against a live ``/metrics``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from wowd import __version__

__all__ = [
    "BUILD_INFO",
    "EMBEDDED_SQLITE_INFO",
    "BatchHistogram",
    "FEED_COMMITS",
    "FEED_ERRORS",
    "FEED_LAG",
    "FEED_POISON",
    "FEED_STALLED",
    "FEED_WATERMARK_LAG",
    "FIRE_LAG",
    "GATEWAY_CIRCUIT_OPEN",
    "GATEWAY_REQUESTS",
    "GATEWAY_SHORT_CIRCUITED",
    "GATEWAY_UNROUTED",
    "LEASES_HELD",
    "LEASE_FENCE",
    "LEASE_HEARTBEAT_FAILURES",
    "LEASE_LOST",
    "LEASE_RENEW_FAILURES",
    "LEASE_RENEW_SECONDS",
    "OUTBOX_DEPTH",
    "OUTBOX_DEPTH_AGE",
    "PARTITIONS_OWNED",
    "PARTITIONS_UNOWNED",
    "QUARANTINED",
    "READY",
    "REGISTRY",
    "DELIVERIES_QUEUED",
    "SETTLE_BATCH",
    "SETTLE_SKIPPED",
    "SINK_BULK_SECONDS",
    "SINK_ITEMS",
    "SLOT_HELD",
    "SNAPSHOT_REBUILD_FAILED",
    "STORE_CALL_SECONDS",
    "STORE_UNAVAILABLE",
    "TIMERS_CLAIMED_LAST_ROUND",
    "TIMERS_FAILED",
    "TIMERS_FIRED",
    "TIMERS_MISFIRED",
    "TIMERS_PARKED",
    "TIMERS_RETRIED",
    "TIMERS_STALLED",
    "TIMERS_WAITING",
    "TIMER_EVENTS_REJECTED",
    "CollectorRegistry",
    "count_fired",
]


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# leases
LEASES_HELD = Gauge("wowd_leases_held", "Slot leases this replica holds now")
LEASE_FENCE = Gauge("wowd_lease_fence", "Fence of each slot this replica holds", ["slot"])
LEASE_RENEW_SECONDS = Histogram("wowd_lease_renew_seconds", "Latency of lease renewals", buckets=_LATENCY_BUCKETS)
LEASE_RENEW_FAILURES = Counter(
    "wowd_lease_renew_failures_total", "Lease renewals that failed (error or lease lost)", ["reason"]
)
LEASE_HEARTBEAT_FAILURES = Counter(
    "wowd_lease_heartbeat_failures_total",
    "Presence heartbeats that failed (the replica's record for wowd status; leases unaffected)",
    ["reason"],
)
LEASE_LOST = Counter("wowd_lease_lost_total", "Leases lost while held (expired on the holder's clock or refused)")
PARTITIONS_OWNED = Gauge("wowd_partitions_owned", "Log partitions this replica works on now")
PARTITIONS_UNOWNED = Gauge(
    "wowd_partitions_unowned", "Partitions of the context whose slot has no live holder (store view)"
)
READY = Gauge(
    "wowd_ready", "1 when the replica is functioning (holder or standby: its stores answer, no held slot stalled)"
)

# timers
TIMERS_FIRED = Counter("wowd_timers_fired_total", "Timer occurrences delivered, by target", ["target"])
TIMERS_RETRIED = Counter("wowd_timers_retried_total", "Deliveries to retry later, by target", ["target"])
TIMERS_PARKED = Counter(
    "wowd_timers_parked_total", "Timers parked (their target could not take the command), by target", ["target"]
)
TIMERS_FAILED = Counter(
    "wowd_timers_failed_total", "Timers failed after the retry budget or refused, by target", ["target"]
)
TIMERS_MISFIRED = Counter(
    "wowd_timers_misfired_total",
    "Occurrences skipped, not delivered: they would have fired later than their rule's misfire_grace_ms, by target",
    ["target"],
)


class BatchHistogram(Histogram):
    """A histogram that also takes a batch of observations at once (:meth:`observe_many`): the
    timer loop observes the fire lag of up to a thousand timers per round, and ``observe`` scans
    the buckets and takes two locks per value."""

    def observe_many(self, amounts: Iterable[float]) -> None:
        """What ``observe`` of each amount gives: each bucket and the sum added to once."""
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        bounds = self._upper_bounds
        counts = [0] * len(bounds)
        total = 0.0
        for amount in amounts:
            total += amount
            counts[bisect_left(bounds, amount)] += 1  # the first bound >= amount (the last is +Inf)
        if not any(counts):
            return
        self._sum.inc(total)
        for i, n in enumerate(counts):
            if n:
                self._buckets[i].inc(n)


FIRE_LAG = BatchHistogram(
    "wowd_fire_lag_seconds", "Delivery time minus scheduled time of fired timers", buckets=_LAG_BUCKETS
)
TIMERS_CLAIMED_LAST_ROUND = Gauge(
    "wowd_timers_claimed_last_round",
    "Timers claimed by the timer loop's last round: at most timers.batch, equal to it while more are due",
)
DELIVERIES_QUEUED = Gauge(
    "wowd_deliveries_queued",
    "Claimed timers waiting for a delivery slot of their target (a queue per target)",
)
SETTLE_BATCH = Histogram(
    "wowd_settle_batch_size", "Changes per settle call", buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000)
)
SETTLE_SKIPPED = Counter("wowd_settle_skipped_total", "Settle changes skipped: the timer moved on meanwhile")
HISTORY_UNRECORDED = Counter(
    "wowd_timer_history_unrecorded_total",
    "Records of the timer history not written (the history store refused them): the timers were fired all the same",
)
TIMER_EVENTS_REJECTED = Counter(
    "wowd_timer_events_rejected_total", "Timer events refused as malformed, by field", ["field"]
)

OUTBOX_DEPTH = Gauge(
    "wowd_outbox_depth", "Outbox entries not acknowledged (nor trimmed) yet, counted when /metrics is scraped"
)
OUTBOX_DEPTH_AGE = Gauge(
    "wowd_outbox_depth_age_seconds",
    "Seconds since wowd_outbox_depth was counted: about 0, growing while the outbox store does not answer",
)
OUTBOX_OLDEST_AGE = Gauge(
    "wowd_outbox_oldest_age_seconds",
    "Age of the oldest outbox entry not acknowledged yet (0 when the outbox is empty), read when /metrics is scraped",
)
OUTBOX_RETENTION = Gauge(
    "wowd_outbox_retention_seconds",
    "WOWD_OUTBOX__RETENTION_S: the replicas trim entries older than this, acknowledged or not (0: never)",
)
OUTBOX_TRIMMED = Counter(
    "wowd_outbox_trimmed_total",
    "Outbox entries the replicas trimmed past the retention, unacknowledged: commands no consumer took, lost",
)

# http gateway
GATEWAY_CIRCUIT_OPEN = Gauge(
    "wowd_gateway_circuit_open", "1 while a delivery target's circuit is open (sends answer Retry unsent)", ["target"]
)
GATEWAY_SHORT_CIRCUITED = Counter(
    "wowd_gateway_short_circuited_total",
    "Sends answered Retry without a request: the target's circuit is open",
    ["target"],
)
GATEWAY_REQUESTS = Counter(
    "wowd_gateway_requests_total",
    "Requests sent by the http gateway, by route (its match, * for gateway.url) and outcome",
    ["route", "outcome"],
)
GATEWAY_UNROUTED = Counter(
    "wowd_gateway_unrouted_total",
    "Timers failed without a request: no route matches their target and gateway.url is unset",
    ["target"],
)

# feed
FEED_COMMITS = Counter("wowd_feed_commits_total", "Commits fed to the sink and views", ["aggregate"])
FEED_LAG = Gauge(
    "wowd_feed_lag_seconds", "Now minus create time of the last commit the view applied; 0 caught up", ["slot", "view"]
)
FEED_ERRORS = Counter("wowd_feed_errors_total", "Feed batches that failed, by kind (transient, fatal)", ["kind"])
QUARANTINED = Counter("wowd_quarantined_total", "Malformed commits quarantined, by field", ["field"])

# sink
SINK_BULK_SECONDS = Histogram("wowd_sink_bulk_seconds", "Latency of one sink bulk write", buckets=_LATENCY_BUCKETS)
SINK_ITEMS = Counter("wowd_sink_items_total", "Sink bulk items by HTTP status (201, 409, 429, ...)", ["status"])

# stores
STORE_CALL_SECONDS = Histogram(
    "wowd_store_call_seconds", "Latency of store calls", ["store", "operation"], buckets=_LATENCY_BUCKETS
)
STORE_UNAVAILABLE = Counter(
    "wowd_store_unavailable_total", "Transient store failures met (retried with backoff)", ["store", "operation"]
)

# ------------------------------------------------------------------ operator signals
# Feed and timer-loop stalls, the watermark, slot holding, delivery circuits, poison commits, outbox
# depth and the build. Counters whose label values are known start at 0, so ``increase()`` sees their first event.

# No ``*_created`` series: nothing reads them, and they double the series of every counter.
disable_created_metrics()  # type: ignore[no-untyped-call]

FEED_STALLED = Gauge(
    "wowd_feed_stalled",
    "1 while the view of the slot cannot progress (its store refuses or is unavailable, a reducer raises)",
    ["slot", "view"],
)
SNAPSHOT_REBUILD_FAILED = Gauge(
    "wowd_snapshot_rebuild_failed",
    "1 while the held slot's snapshot rebuild of the aggregate type failed: its reducer raised",
    ["slot", "aggregate"],
)
TIMERS_STALLED = Gauge(
    "wowd_timers_stalled",
    "1 while the slot's timer loop cannot progress (the store refuses its reads or writes: a full disk)",
    ["slot"],
)
TIMERS_WAITING = Gauge(
    "wowd_timers_waiting",
    "Due timers held back now, by why: feed_behind (the feed has not read the log past their due time),"
    " log_check (the log asked at their due time, or a commit of their aggregate it found not read yet),"
    " target_limit (queued for a delivery slot of their target), circuit_open (their target's circuit is open)",
    ["slot", "reason"],
)
FEED_WATERMARK_LAG = Gauge(
    "wowd_feed_watermark_lag_seconds",
    "Now minus the slot's oldest partition watermark (every commit appended before it is in the timer view)",
    ["slot"],
)
FEED_POISON = Counter(
    "wowd_feed_poison_total",
    "Commits quarantined because a feed step refused them, by step and error class",
    ["step", "error"],
)
SLOT_HELD = Gauge("wowd_slot_held", "1 for each slot this replica holds now", ["slot"])

# the HTTP listener
HTTP_CONNECTIONS = Gauge("wowd_http_connections", "Connections the HTTP listener serves now")
HTTP_REFUSED = Counter(
    "wowd_http_refused_total",
    "Clients the HTTP listener refused or dropped: an accept without resources (accept), an idle connection "
    "closed at the connection cap (cap), a Host not allowed (host), a request not sent in time (request "
    "timeout), an answer not read in time (slow reader)",
    ["reason"],
)

# status page
UI_REFUSED = Counter(
    "wowd_ui_refused_total",
    "Status page requests refused: bad input, or an action read-only, cross-site, without the token or the form key",
    ["reason"],
)


def count_fired(fired: Iterable[tuple[str, int, int]]) -> None:
    """``wowd_timers_fired_total`` and the fire lag of timers delivered: ``(target, scheduled
    time, fire time)`` each (the target as ``context.aggregate``)."""
    per_target: dict[str, int] = {}
    lags: list[float] = []
    for target, scheduled_at, at in fired:
        per_target[target] = per_target.get(target, 0) + 1
        lags.append(max(0.0, (at - scheduled_at) / 1000))
    FIRE_LAG.observe_many(lags)
    for target, n in per_target.items():
        TIMERS_FIRED.labels(target=target).inc(n)


BUILD_INFO = Gauge("wowd_build_info", "Always 1; the version of wowd in the label", ["version"])
BUILD_INFO.labels(version=__version__).set(1)
EMBEDDED_SQLITE_INFO = Gauge(
    "wowd_embedded_sqlite_info",
    "Always 1 once the embedded backend is open; its SQLite library in the labels",
    ["version", "module", "wal_reset_bug"],
)

for _reason in ("accept", "cap", "host", "request timeout", "slow reader"):
    HTTP_REFUSED.labels(reason=_reason)
for _kind in ("transient", "fatal"):
    FEED_ERRORS.labels(kind=_kind)
for _reason in ("unavailable", "error", "lost"):
    LEASE_RENEW_FAILURES.labels(reason=_reason)
for _reason in ("unavailable", "error"):
    LEASE_HEARTBEAT_FAILURES.labels(reason=_reason)
