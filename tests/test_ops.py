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
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
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


def test_exposition_has_build_info_and_no_created_series() -> None:
    text = generate_latest().decode()
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["wowd_build_info"].samples
    assert sample.value == 1 and sample.labels["version"]
    # counters with known label values start at 0, so increase() sees their first event
    kinds = {s.labels["kind"] for s in families["wowd_feed_errors"].samples if s.name.endswith("_total")}
    assert {"transient", "fatal"} <= kinds


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/wowd.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_dashboard_filters_by_job_instance_context_and_shows_the_operator_signals() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/wowd.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"job", "instance", "context"} <= variables
    exprs = _dashboard_exprs()
    for expr in exprs:
        for name in referenced_names(expr):
            # every metric selector of every query is narrowed by the three variables
            for m in re.finditer(rf"\b{name}\{{([^}}]*)\}}", expr):
                assert all(f'{v}=~"${v}"' in m.group(1) for v in ("job", "instance", "context")), expr
            assert re.search(rf"\b{name}\{{", expr), f"{name} without the variables' selector: {expr}"
    used = set().union(*(referenced_names(e) for e in exprs))
    assert {
        "wowd_ready",
        "wowd_lease_lost_total",
        "wowd_feed_errors_total",
        "wowd_store_unavailable_total",
        "wowd_feed_stalled",
        "wowd_feed_watermark_lag_seconds",
        "wowd_gateway_circuit_open",
        "wowd_slot_held",
        "wowd_quarantined_total",
        "wowd_feed_poison_total",
    } <= used
    assert any("sum by (step)" in e and "wowd_feed_poison_total" in e for e in exprs)


def test_dashboard_is_generated_from_its_source() -> None:
    sys.path.insert(0, str(ROOT / "deploy/grafana"))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
        sys.modules.pop("generate", None)  # the Kubernetes component's generate.py has the same name
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


def _alert_rules() -> dict[str, dict[str, object]]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"]}


def test_alert_rules_cover_the_operators_cases() -> None:
    by_name = _alert_rules()
    assert by_name["WowdUnownedPartitions"]["for"] == "2m"
    assert "> 30" in str(by_name["WowdFireLagHigh"]["expr"])
    assert "> 60" in str(by_name["WowdFeedLagHigh"]["expr"])
    assert {"WowdQuarantine", "WowdLeaseRenewFailures", "WowdReplicaDown"} <= set(by_name)
    stalled = by_name["WowdFeedStalled"]
    assert "wowd_feed_stalled" in str(stalled["expr"]) and "== 1" in str(stalled["expr"])
    assert stalled["for"] == "1m" and stalled["labels"] == {"severity": "page"}
    timers = by_name["WowdTimersStalled"]
    assert "wowd_timers_stalled" in str(timers["expr"]) and "== 1" in str(timers["expr"])
    assert timers["for"] == "1m" and timers["labels"] == {"severity": "page"}
    assert 'kind="fatal"' in str(by_name["WowdFeedFatalErrors"]["expr"])
    assert "wowd_timers_failed_total" in str(by_name["WowdTimersFailed"]["expr"])
    assert "wowd_timers_parked_total" in str(by_name["WowdTimersParked"]["expr"])
    not_ready = by_name["WowdReplicaNotReady"]
    assert "wowd_ready" in str(not_ready["expr"]) and "== 0" in str(not_ready["expr"]) and not_ready["for"] == "2m"
    circuit = by_name["WowdGatewayCircuitOpen"]
    assert "wowd_gateway_circuit_open" in str(circuit["expr"]) and circuit["for"] == "5m"
    assert "wowd_feed_watermark_lag_seconds" in str(by_name["WowdWatermarkLagHigh"]["expr"])
    for name, rule in by_name.items():
        assert rule["labels"] in ({"severity": "page"}, {"severity": "ticket"}), name


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tests = yaml.safe_load((ROOT / "deploy/prometheus/alerts.test.yaml").read_text())
    assert tests["rule_files"] == ["alerts.yaml"]
    fired = {
        case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", []) if case.get("exp_alerts")
    }
    silent = {
        case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", []) if not case.get("exp_alerts")
    }
    assert set(_alert_rules()) == fired == silent


@pytest.mark.parametrize(
    ("command", "file"),
    [("test", "alerts.test.yaml"), ("check", "alerts.yaml")],
    ids=["runs the alert unit tests", "checks the alert rules"],
)
def test_promtool(command: str, file: str) -> None:
    promtool = _tool("promtool")
    out = subprocess.run(
        [promtool, command, "rules", str(ROOT / "deploy/prometheus" / file)],
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
    # descriptors for the listener's connections and the stores' (systemd's default soft limit: 1,024)
    assert int(re.search(r"^LimitNOFILE=(\d+)$", unit, re.M).group(1)) >= 65536  # type: ignore[union-attr]
    assert re.search(r"^TasksMax=\d+$", unit, re.M) and re.search(r"^MemoryMax=\d+[KMG]$", unit, re.M)
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
    # `docker run IMAGE` runs a replica, `docker run IMAGE status` runs that command
    assert re.search(r'^ENTRYPOINT \["wowd"\]$', text, re.M)
    assert re.search(r'^CMD \["run"\]$', text, re.M)
    assert re.search(r'org\.opencontainers\.image\.source="\$\{SOURCE\}"', text)
    assert "github.com/wowd/wowd" not in text
    assert "STOPSIGNAL SIGTERM" in text


def test_compose_stack_has_replicas_standby_and_monitoring() -> None:
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    services = compose["services"]
    assert services["mongo"]["image"].startswith("mongo:7")
    assert "--replSet" in services["mongo"]["command"]
    assert services["elasticsearch"]["image"].rsplit(":", 1)[1].startswith("9.")
    assert {"wowd-1", "wowd-2", "wowd-3", "wowd-standby", "prometheus", "grafana"} <= set(services)
    assert compose["x-wowd"]["environment"]["WOWD_LEASE__LIMIT"] == "3"


def test_compose_limits_the_replicas_and_lets_prometheus_scrape_them_by_name() -> None:
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    wowd = compose["x-wowd"]
    assert wowd["ulimits"]["nofile"] == {"soft": 65536, "hard": 65536}
    assert wowd["mem_limit"] and wowd["pids_limit"] > 0
    allowed = json.loads(wowd["environment"]["WOWD_HTTP__ALLOWED_HOSTS"])
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]
    targets = {t.rpartition(":")[0] for job in scrape for c in job["static_configs"] for t in c["targets"]}
    assert targets and targets <= set(allowed)  # a scrape by a name not allowed is answered 400


def test_compose_mongo_healthcheck_exits_non_zero_without_a_primary() -> None:
    services = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())["services"]
    test = services["mongo"]["healthcheck"]["test"]
    script = test[test.index("--eval") + 1]
    # mongosh exits 0 whatever --eval prints: the exit code must come from quit(...)
    assert re.search(r"quit\(db\.hello\(\)\.isWritablePrimary \? 0 : 1\)\s*$", script), script


def test_compose_publishes_ports_on_loopback_only() -> None:
    services = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())["services"]
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports", [])]
    assert published
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), (name, port)


def test_compose_takes_the_grafana_password_from_the_environment() -> None:
    services = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())["services"]
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), password


def test_compose_builds_the_wowd_image_once_and_checks_readiness() -> None:
    services = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())["services"]
    wowd = {name: svc for name, svc in services.items() if svc.get("image") == "wowd:local"}
    assert {"wowd-1", "wowd-2", "wowd-3", "wowd-standby", "demo-producer"} <= set(wowd)
    assert [name for name, svc in wowd.items() if "build" in svc] == ["wowd-1"]
    assert all(svc["pull_policy"] == "never" for svc in wowd.values())
    for name in ("wowd-1", "wowd-2", "wowd-3", "wowd-standby"):
        assert "/readyz" in " ".join(wowd[name]["healthcheck"]["test"]), name
    # the image's entrypoint is `wowd`: a one-off service gives the subcommand only
    assert wowd["demo-producer"]["command"][0] == "demo" and "entrypoint" not in wowd["demo-producer"]


def test_a_batch_of_observations_counts_as_each_observed() -> None:
    """``BatchHistogram.observe_many`` (the fire lag of a round) gives the exposition ``observe``
    of each value gives: bucket boundaries included, sum, count, and nothing for an empty batch."""
    from prometheus_client import CollectorRegistry, generate_latest

    from wowd.metrics import BatchHistogram

    values = [0.0, 0.001, 0.0011, 0.005, 0.25, 1.0, 59.9, 60.0, 3600.0, 0.0005]
    one, many = CollectorRegistry(), CollectorRegistry()
    each = BatchHistogram("lag_seconds", "h", buckets=(0.001, 0.005, 0.25, 1.0, 60.0), registry=one)
    batch = BatchHistogram("lag_seconds", "h", buckets=(0.001, 0.005, 0.25, 1.0, 60.0), registry=many)
    for v in values:
        each.observe(v)
    batch.observe_many(values[:4])
    batch.observe_many([])
    batch.observe_many(values[4:])
    assert generate_latest(many) == generate_latest(one)
    assert b'lag_seconds_bucket{le="0.001"} 3.0' in generate_latest(many)
