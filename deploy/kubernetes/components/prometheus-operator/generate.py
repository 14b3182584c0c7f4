"""Writes prometheusrule.yaml (run: python deploy/kubernetes/components/prometheus-operator/generate.py).

The PrometheusRule carries the rule groups of deploy/prometheus/alerts.yaml as they are: edit
the alerts there (with their unit tests in alerts.test.yaml), then run this script.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ALERTS = Path(__file__).resolve().parents[3] / "prometheus" / "alerts.yaml"
OUT = Path(__file__).with_name("prometheusrule.yaml")

HEADER = """\
# The alert rules of deploy/prometheus/alerts.yaml for the Prometheus operator. Written by
# generate.py beside this file: edit alerts.yaml, then run
#   python deploy/kubernetes/components/prometheus-operator/generate.py
# Your Prometheus picks up the rules its ruleSelector matches: add the labels it selects
# (kube-prometheus-stack: release: <its release name>) in your overlay.
"""


def build() -> dict[str, object]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "wowd", "labels": {"app.kubernetes.io/name": "wowd"}},
        "spec": {"groups": groups},
    }


def render() -> str:
    return HEADER + yaml.safe_dump(build(), sort_keys=False, width=1_000, allow_unicode=True)


if __name__ == "__main__":
    OUT.write_text(render())
