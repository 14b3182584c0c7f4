"""Writes deploy/grafana/wowd.json (run: python deploy/grafana/generate.py). Edit here, not the JSON.

Every query is narrowed by the dashboard's variables: job, instance and context (a label the
Prometheus scrape configuration gives each context's targets; see docs/operations.md).
"""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "prometheus"}

SELECTOR = '{job=~"$job", instance=~"$instance", context=~"$context"}'
"""Replaces ``{S}`` in every query below."""

VARIABLES: list[tuple[str, str]] = [
    ("job", "label_values(wowd_build_info, job)"),
    ("instance", 'label_values(wowd_build_info{job=~"$job"}, instance)'),
    ("context", 'label_values(wowd_build_info{job=~"$job"}, context)'),
]

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Ready (1) per replica", "short", [("min by (instance) (wowd_ready{S})", "{{instance}}")]),
    ("Slots held", "short", [("max by (instance, slot) (wowd_slot_held{S})", "{{instance}} slot {{slot}}")]),
    ("Unowned partitions", "short", [("max(wowd_partitions_unowned{S})", "unowned")]),
    (
        "Leases lost and renew failures",
        "short",
        [
            ("sum by (instance) (increase(wowd_lease_lost_total{S}[5m]))", "lost {{instance}}"),
            (
                "sum by (instance, reason) (increase(wowd_lease_renew_failures_total{S}[5m]))",
                "renew {{reason}} {{instance}}",
            ),
        ],
    ),
    (
        "Errors per second",
        "ops",
        [
            ("sum by (kind) (rate(wowd_feed_errors_total{S}[5m]))", "feed {{kind}}"),
            ("sum by (step, error) (rate(wowd_feed_poison_total{S}[5m]))", "poison {{step}} {{error}}"),
            ('sum by (status) (rate(wowd_sink_items_total{S, status!~"2..|409"}[5m]))', "sink item {{status}}"),
            ("sum(rate(wowd_settle_skipped_total{S}[5m]))", "settle skipped"),
        ],
    ),
    (
        "Store unavailable per second",
        "ops",
        [("sum by (store, operation) (rate(wowd_store_unavailable_total{S}[5m]))", "{{store}} {{operation}}")],
    ),
    (
        "Feed and timers stalled (1)",
        "short",
        [
            ("max by (instance, slot, view) (wowd_feed_stalled{S})", "{{view}} view {{instance}} slot {{slot}}"),
            ("max by (instance, slot) (wowd_timers_stalled{S})", "timers {{instance}} slot {{slot}}"),
        ],
    ),
    (
        "Feed lag and watermark lag",
        "s",
        [
            ("max by (instance, slot, view) (wowd_feed_lag_seconds{S})", "{{view}} view {{instance}} slot {{slot}}"),
            ("max by (instance, slot) (wowd_feed_watermark_lag_seconds{S})", "watermark {{instance}} slot {{slot}}"),
        ],
    ),
    (
        "Fire lag p50 / p99 per replica",
        "s",
        [
            (
                "histogram_quantile(0.5, sum by (instance, le) (rate(wowd_fire_lag_seconds_bucket{S}[5m])))",
                "p50 {{instance}}",
            ),
            (
                "histogram_quantile(0.99, sum by (instance, le) (rate(wowd_fire_lag_seconds_bucket{S}[5m])))",
                "p99 {{instance}}",
            ),
        ],
    ),
    (
        "Timers fired / retried / parked / failed per second",
        "ops",
        [
            ("sum(rate(wowd_timers_fired_total{S}[1m]))", "fired"),
            ("sum(rate(wowd_timers_retried_total{S}[1m]))", "retried"),
            ("sum(rate(wowd_timers_parked_total{S}[1m]))", "parked"),
            ("sum(rate(wowd_timers_failed_total{S}[1m]))", "failed"),
            ("sum(rate(wowd_timers_misfired_total{S}[1m]))", "skipped past their misfire grace"),
        ],
    ),
    (
        "HTTP requests per second by route and outcome",
        "ops",
        [
            ("sum by (route, outcome) (rate(wowd_gateway_requests_total{S}[1m]))", "{{route}} {{outcome}}"),
            ("sum by (target) (rate(wowd_gateway_unrouted_total{S}[5m]))", "unrouted {{target}}"),
        ],
    ),
    (
        "Circuit open per target",
        "short",
        [
            ("max by (target) (wowd_gateway_circuit_open{S})", "open {{target}}"),
            ("sum by (target) (rate(wowd_gateway_short_circuited_total{S}[5m]))", "short-circuited/s {{target}}"),
        ],
    ),
    (
        "Due backlog and outbox depth",
        "short",
        [
            ("sum by (instance) (wowd_timers_claimed_last_round{S})", "claimed {{instance}}"),
            ("sum by (reason) (wowd_timers_waiting{S})", "due, waiting: {{reason}}"),
            ("sum by (instance) (wowd_deliveries_queued{S})", "queued for a delivery slot {{instance}}"),
            ("max(wowd_outbox_depth{S})", "outbox"),
        ],
    ),
    (
        "Outbox: oldest entry and retention",
        "s",
        [
            ("max(wowd_outbox_oldest_age_seconds{S})", "oldest entry's age"),
            ("max(wowd_outbox_retention_seconds{S})", "retention (trimmed past it)"),
        ],
    ),
    (
        "Outbox entries trimmed unacknowledged (lost) and history records not written",
        "short",
        [
            ("sum(increase(wowd_outbox_trimmed_total{S}[1h]))", "trimmed in the last hour"),
            ("sum(increase(wowd_timer_history_unrecorded_total{S}[1h]))", "history records not written, last hour"),
        ],
    ),
    (
        "Quarantined per second (malformed by field, refused by step)",
        "ops",
        [
            ("sum by (field) (rate(wowd_quarantined_total{S}[5m]))", "field {{field}}"),
            ("sum by (step) (rate(wowd_feed_poison_total{S}[5m]))", "step {{step}}"),
        ],
    ),
    (
        "Feed commits per second",
        "ops",
        [("sum by (instance, aggregate) (rate(wowd_feed_commits_total{S}[1m]))", "{{instance}} {{aggregate}}")],
    ),
    (
        "Sink bulk latency p50 / p99",
        "s",
        [
            ("histogram_quantile(0.5, sum by (le) (rate(wowd_sink_bulk_seconds_bucket{S}[5m])))", "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(wowd_sink_bulk_seconds_bucket{S}[5m])))", "p99"),
        ],
    ),
    ("Sink items by status", "ops", [("sum by (status) (rate(wowd_sink_items_total{S}[1m]))", "{{status}}")]),
    (
        "Store latency p99 by operation",
        "s",
        [
            (
                "histogram_quantile(0.99, sum by (store, operation, le) (rate(wowd_store_call_seconds_bucket{S}[5m])))",
                "{{store}} {{operation}}",
            )
        ],
    ),
    (
        "Lease renew latency p99",
        "s",
        [
            (
                "histogram_quantile(0.99, sum by (instance, le) (rate(wowd_lease_renew_seconds_bucket{S}[5m])))",
                "p99 {{instance}}",
            )
        ],
    ),
    ("Slot fences", "short", [("max by (instance, slot) (wowd_lease_fence{S})", "{{instance}} slot {{slot}}")]),
    (
        "Settle batch size p50",
        "short",
        [("histogram_quantile(0.5, sum by (le) (rate(wowd_settle_batch_size_bucket{S}[5m])))", "p50")],
    ),
    ("Versions running", "short", [("count by (version) (wowd_build_info{S})", "{{version}}")]),
]


def query(expr: str) -> str:
    """``{S}`` becomes the variables' selector; ``{S, more}`` keeps the extra matchers."""
    return expr.replace("{S}", SELECTOR).replace("{S, ", SELECTOR[:-1] + ", ")


def variable(name: str, definition: str) -> dict[str, object]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DS,
        "definition": definition,
        "query": {"query": definition, "refId": name},
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def build() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": DS,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + j), "datasource": DS, "expr": query(expr), "legendFormat": legend}
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": "wowd",
        "title": "wowd",
        "tags": ["wowd"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "15s",
        "time": {"from": "now-1h", "to": "now"},
        "panels": panels,
        "templating": {"list": [variable(name, definition) for name, definition in VARIABLES]},
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("wowd.json")
    out.write_text(json.dumps(build(), indent=2) + "\n")
