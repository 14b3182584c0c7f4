"""Operations artefacts: the systemd unit, the image, the alert rules and the dashboard.

Tools that may be absent on a developer machine (systemd-analyze, promtool) are looked up on
PATH and in ``.ci/tools`` (where ``.ci/run`` puts them); with ``WOWD_TEST_REQUIRE_OPS_TOOLS=1`` (set by
``.ci/run``) a missing tool fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import wowd.metrics  # noqa: F401  (registers every metric)

ROOT = Path(__file__).resolve().parent.parent
REQUIRE = os.environ.get("WOWD_TEST_REQUIRE_OPS_TOOLS") == "1"


def _tool(name: str) -> str:
    search = os.pathsep.join([str(Path(sys.executable).parent), str(ROOT / ".ci" / "tools")])
    path = shutil.which(name) or shutil.which(name, path=search)
    if path is None:
        if REQUIRE:
            pytest.fail(f"{name} is required (WOWD_TEST_REQUIRE_OPS_TOOLS=1) but not installed")
        pytest.skip(f"{name} not installed")
    return path


def exported_names(exposition: str) -> set[str]:
    """Every sample name a scrape of ``exposition`` can carry (``_total``, ``_bucket`` ...)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(exposition):
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(fam.name)
        names |= {s.name for s in fam.samples}
    return names


def referenced_names(text: str) -> set[str]:
    return set(re.findall(r"\bwowd_[a-z0-9_]+\b", text))


def test_dashboard_and_alerts_use_only_exported_metric_names() -> None:
    exported = exported_names(generate_latest().decode())
    dashboard = json.loads((ROOT / "deploy/grafana/wowd.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = set().union(*(referenced_names(e) for e in exprs))
    assert used, "no wowd metric referenced"
    assert used <= exported, f"names not exported by wowd: {sorted(used - exported)}"
    # the metrics the checks and dashboards rely on by name
    assert {"wowd_timers_fired_total", "wowd_feed_commits_total", "wowd_fire_lag_seconds_bucket"} <= exported


def test_dashboard_is_generated_from_its_source() -> None:
    sys.path.insert(0, str(ROOT / "deploy/grafana"))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    assert json.loads((ROOT / "deploy/grafana/wowd.json").read_text()) == generate.build()


def test_fire_lag_buckets_span_1ms_to_60s() -> None:
    text = generate_latest().decode()
    les = {
        float(s.labels["le"])
        for f in text_string_to_metric_families(text)
        if f.name == "wowd_fire_lag_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    }
    assert min(les) == 0.001 and max(x for x in les if x != float("inf")) == 60.0


def test_alert_rules_cover_the_operators_cases() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert by_name["WowdUnownedPartitions"]["for"] == "2m"
    assert "> 30" in by_name["WowdFireLagHigh"]["expr"]
    assert "> 60" in by_name["WowdFeedLagHigh"]["expr"]
    assert {"WowdQuarantine", "WowdLeaseRenewFailures", "WowdReplicaDown"} <= set(by_name)


def test_promtool_checks_the_alert_rules() -> None:
    promtool = _tool("promtool")
    out = subprocess.run(
        [promtool, "check", "rules", str(ROOT / "deploy/prometheus/alerts.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    unit = (ROOT / "systemd/wowd.service").read_text()
    # verify needs ExecStart to exist: point it at this interpreter for the check.
    (tmp_path / "wowd.service").write_text(unit.replace("/opt/wowd/.venv/bin/wowd", sys.executable))
    out = subprocess.run(
        [analyze, "verify", str(tmp_path / "wowd.service")], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_systemd_unit_has_the_operational_settings() -> None:
    unit = (ROOT / "systemd/wowd.service").read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "EnvironmentFile=/etc/wowd/wowd.env",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "StateDirectory=wowd",
        "CapabilityBoundingSet=",
        "SystemCallFilter=@system-service",
    ):
        assert re.search(rf"^{re.escape(line)}", unit, re.M), line
    assert re.search(r"^RestrictAddressFamilies=", unit, re.M)
    assert re.search(r"^(DynamicUser=yes|User=wowd)", unit, re.M)
    assert re.search(r"^WatchdogSec=\d+", unit, re.M)
    # the stop timeout must exceed the default drain grace (20 s)
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M).group(1))  # type: ignore[union-attr]
    assert stop > 20


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = _tool("hadolint")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_runs_unprivileged_with_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") >= 2
    assert re.search(r"^USER (?!root|0)", text, re.M)
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert re.search(r'^ENTRYPOINT \["wowd", "run"\]', text, re.M)
    assert "STOPSIGNAL SIGTERM" in text


def test_compose_stack_has_replicas_standby_and_monitoring() -> None:
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    services = compose["services"]
    assert services["mongo"]["image"].startswith("mongo:7")
    assert "--replSet" in services["mongo"]["command"]
    assert services["elasticsearch"]["image"].rsplit(":", 1)[1].startswith("9.")
    assert {"wowd-1", "wowd-2", "wowd-3", "wowd-standby", "prometheus", "grafana"} <= set(services)
    assert compose["x-wowd"]["environment"]["WOWD_LEASE__LIMIT"] == "3"
