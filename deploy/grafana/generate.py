"""Writes deploy/grafana/wowd.json (run: python deploy/grafana/generate.py). Edit here, not the JSON."""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "prometheus"}

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Slots held per replica", "short", [("sum by (instance) (wowd_leases_held)", "{{instance}}")]),
    ("Unowned partitions", "short", [("max(wowd_partitions_unowned)", "unowned")]),
    (
        "Fire lag p50 / p99 per replica",
        "s",
        [
            ("histogram_quantile(0.5, sum by (instance, le) (rate(wowd_fire_lag_seconds_bucket[5m])))", "p50 {{instance}}"),
            ("histogram_quantile(0.99, sum by (instance, le) (rate(wowd_fire_lag_seconds_bucket[5m])))", "p99 {{instance}}"),
        ],
    ),
    (
        "Timers fired / retried / parked / failed per second",
        "ops",
        [
            ("sum(rate(wowd_timers_fired_total[1m]))", "fired"),
            ("sum(rate(wowd_timers_retried_total[1m]))", "retried"),
            ("sum(rate(wowd_timers_parked_total[1m]))", "parked"),
            ("sum(rate(wowd_timers_failed_total[1m]))", "failed"),
        ],
    ),
    ("Due backlog", "short", [("sum by (instance) (wowd_timers_due_backlog)", "{{instance}}")]),
    ("Feed lag per partition group", "s", [("max by (instance, slot) (wowd_feed_lag_seconds)", "{{instance}} slot {{slot}}")]),
    ("Feed commits per second", "ops", [("sum by (instance, aggregate) (rate(wowd_feed_commits_total[1m]))", "{{instance}} {{aggregate}}")]),
    (
        "Sink bulk latency p50 / p99",
        "s",
        [
            ("histogram_quantile(0.5, sum by (le) (rate(wowd_sink_bulk_seconds_bucket[5m])))", "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(wowd_sink_bulk_seconds_bucket[5m])))", "p99"),
        ],
    ),
    ("Sink items by status", "ops", [("sum by (status) (rate(wowd_sink_items_total[1m]))", "{{status}}")]),
    (
        "Store latency p99 by operation",
        "s",
        [("histogram_quantile(0.99, sum by (store, operation, le) (rate(wowd_store_call_seconds_bucket[5m])))", "{{store}} {{operation}}")],
    ),
    (
        "Lease renew latency p99 and failures",
        "s",
        [
            ("histogram_quantile(0.99, sum by (instance, le) (rate(wowd_lease_renew_seconds_bucket[5m])))", "p99 {{instance}}"),
            ("sum by (instance) (increase(wowd_lease_renew_failures_total[5m]))", "failures {{instance}}"),
        ],
    ),
    ("Slot fences", "short", [("max by (instance, slot) (wowd_lease_fence)", "{{instance}} slot {{slot}}")]),
    ("Quarantined commits per second", "ops", [("sum by (field) (rate(wowd_quarantined_total[5m]))", "{{field}}")]),
    ("Settle batch size p50", "short", [("histogram_quantile(0.5, sum by (le) (rate(wowd_settle_batch_size_bucket[5m])))", "p50")]),
]


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
                    {"refId": chr(ord("A") + j), "datasource": DS, "expr": expr, "legendFormat": legend}
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
        "templating": {"list": []},
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("wowd.json")
    out.write_text(json.dumps(build(), indent=2) + "\n")
