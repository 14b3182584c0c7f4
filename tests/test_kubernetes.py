"""The Kubernetes manifests (deploy/kubernetes): every kustomization renders with ``kubectl
kustomize``; its core objects validate strictly against the schemas of Kubernetes
:data:`KUBERNETES_VERSION` (kubernetes-validate) and the Prometheus operator's objects against the
fields of its CRDs; every workload holds what a wowd replica needs (probes, owner key, a grace
period covering the drain, non-root on a read-only root file system with its writable paths
mounted, requests and limits, a disruption budget and a spread only with several replicas); the
PrometheusRule carries every alert of deploy/prometheus/alerts.yaml; a replica runs on the embedded
overlay's file system with nothing writable but what it mounts.

kubectl is looked up on PATH: without it these tests skip, and fail instead with
``WOWD_TEST_REQUIRE_KUBECTL=1`` (``.ci/run`` sets it where kubectl is installed). Each
kustomization is rendered once per session (:func:`rendered`).
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel, SecretStr

from wowd.backends import CLOSE_TIMEOUT_S
from wowd.config import WowdSettings, load_settings, unknown_environment_keys, variable
from wowd.daemon.firing import SETTLE_TIMEOUT_S
from wowd.daemon.leases import RELEASE_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
REQUIRE = os.environ.get("WOWD_TEST_REQUIRE_KUBECTL") == "1"
REQUIRE_MOUNT = os.environ.get("WOWD_TEST_REQUIRE_TMPFS") == "1"

KUBERNETES_VERSION = "1.32"
"""The schemas the core objects are validated against: the oldest Kubernetes the manifests are
for (every field they use is in it), and the kubectl (kustomize 5.5) of the CI image."""

OVERLAYS = ("overlays/embedded", "overlays/mongo")
"""The kustomizations an operator applies (the base is not applied alone)."""
COMPONENT = "components/prometheus-operator"
OPERATOR_GROUP = "monitoring.coreos.com"
WORKLOAD_KINDS = set("Deployment StatefulSet DaemonSet ReplicaSet ReplicationController Pod Job CronJob".split())
SECRET_EXAMPLE = K8S / "overlays" / "mongo" / "secret.env.example"
POD_NAME = "wowd-0"

Obj = dict[str, Any]


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        if REQUIRE:
            pytest.fail("kubectl is required (WOWD_TEST_REQUIRE_KUBECTL=1) but not installed")
        pytest.skip("kubectl not installed")
    return path


def kustomizations() -> tuple[list[str], list[str]]:
    """The directories under deploy/kubernetes with a kustomization: (kustomizations, components)."""
    plain, components = [], []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        name = path.parent.relative_to(K8S).as_posix()
        kind = yaml.safe_load(path.read_text()).get("kind", "Kustomization")
        (components if kind == "Component" else plain).append(name)
    return plain, components


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every kustomization rendered by ``kubectl kustomize``, once: each plain one, and each
    overlay with each component (through a kustomization of the test's own that names both)."""
    kubectl = _kubectl()
    plain, components = kustomizations()
    targets = {name: K8S / name for name in plain}
    scratch = tmp_path_factory.mktemp("kustomize")
    for overlay in OVERLAYS:
        for component in components:
            name = f"{overlay}+{component}"
            d = scratch / name.replace("/", "_").replace("+", "__")
            d.mkdir()
            (d / "kustomization.yaml").write_text(
                yaml.safe_dump(
                    {
                        "resources": [os.path.relpath(K8S / overlay, d)],
                        "components": [os.path.relpath(K8S / component, d)],
                    }
                )
            )
            targets[name] = d
    procs = {
        name: subprocess.Popen(
            [kubectl, "kustomize", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, d in targets.items()
    }
    out: dict[str, list[Obj]] = {}
    failed = []
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        if proc.returncode != 0:
            failed.append(f"{name}: {stderr.strip()}")
        else:
            out[name] = [o for o in yaml.safe_load_all(stdout) if o]
    if failed:
        pytest.fail("kubectl kustomize failed:\n" + "\n".join(failed))
    return out


def only(objects: list[Obj], kind: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Whether a label selector (``matchLabels`` only: the manifests use nothing else) matches."""
    assert set(selector) <= {"matchLabels"}, selector
    return bool(selector.get("matchLabels")) and selector["matchLabels"].items() <= labels.items()


# ---------------------------------------------------------------------------------------- the image


def image_env() -> dict[str, str]:
    """The ``ENV`` of the Dockerfile's final stage (``PATH`` left out: it names the build's)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = text.splitlines()
    final = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    env: dict[str, str] = {}
    for line in lines[final:]:
        if line.startswith("ENV "):
            for pair in shlex.split(line[len("ENV ") :]):
                key, _, value = pair.partition("=")
                env[key] = value
    env.pop("PATH", None)
    return env


def test_the_image_writes_no_bytecode_and_ships_it_compiled() -> None:
    """A read-only root file system: the image's Python neither tries to write ``__pycache__``
    nor has to compile every module at each start (it would, in memory, without bytecode)."""
    text = (ROOT / "Dockerfile").read_text()
    assert image_env().get("PYTHONDONTWRITEBYTECODE") == "1"
    assert "compileall" in text and "--invalidation-mode checked-hash /opt/wowd/lib" in text
    assert "__pycache__" not in text, "the build removes the bytecode it compiled"
    assert "--no-compile" in text  # pip's own (timestamp) bytecode replaced by compileall's
    assert re.search(r"compileall .*sysconfig.*get_path\(\"stdlib\"\)", text)  # the standard library's


# ----------------------------------------------------------------------------------- the rendering


def test_every_kustomization_renders(rendered: dict[str, list[Obj]]) -> None:
    plain, components = kustomizations()
    assert {"base", *OVERLAYS} <= set(plain)
    assert components == [COMPONENT]
    for name in [*plain, *(f"{o}+{c}" for o in OVERLAYS for c in components)]:
        assert rendered[name], f"{name} rendered nothing"


def test_core_objects_validate_strictly(rendered: dict[str, list[Obj]]) -> None:
    """Every object but the operator's against the strict schemas (an unknown field fails)."""
    errors = []
    checked = 0
    for name, objects in rendered.items():
        for obj in objects:
            if obj["apiVersion"].startswith(OPERATOR_GROUP + "/"):
                continue
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
                checked += 1
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                errors.append(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(f"{name}: {exc.message}")
    assert not errors, "\n".join(errors)
    assert checked >= 10


DURATION = {"type": "string", "pattern": "^(0|" + "".join(f"(([0-9]+){u})?" for u in "ywdhms") + "(([0-9]+)ms)?)$"}
"""A Prometheus duration, with the CRDs' pattern."""
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
STRING_LIST = {"type": "array", "items": {"type": "string"}}
ANY: dict[str, Any] = {}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


METADATA = _object(
    {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRINGS, "annotations": STRINGS}, ("name",)
)
"""What the manifests set of an object's metadata."""

# The fields of prometheus-operator 0.93.0's CRDs (monitoring.coreos.com/v1; in its repository,
# example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml and
# ..._prometheusrules.yaml): every property of each object at the levels the manifests use, so
# that a misspelled or unknown field fails, and the types and patterns of those they set.
SERVICE_MONITOR_OTHER = """attachMetadata bodySizeLimit convertClassicHistogramsToNHCB fallbackScrapeProtocol
    keepDroppedTargets labelLimit labelNameLengthLimit labelValueLengthLimit namespaceSelector
    nativeHistogramBucketLimit nativeHistogramMinBucketFactor sampleLimit scrapeClass scrapeClassicHistograms
    scrapeNativeHistograms scrapeProtocols selectorMechanism targetLimit""".split()
ENDPOINT_OTHER = """authorization basicAuth bearerTokenFile bearerTokenSecret enableHttp2 filterRunning
    followRedirects honorTimestamps metricRelabelings noProxy oauth2 params proxyConnectHeader
    proxyFromEnvironment proxyUrl targetPort tlsConfig trackTimestampsStaleness""".split()
RELABEL = _object(
    {
        "action": {"type": "string"},
        "modulus": {"type": "integer"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": STRING_LIST,
        "targetLabel": {"type": "string"},
    }
)
ENDPOINT = _object(
    {
        **dict.fromkeys(ENDPOINT_OTHER, ANY),
        "port": {"type": "string"},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL},
    }
)
SERVICE_MONITOR_SPEC = _object(
    {
        **dict.fromkeys(SERVICE_MONITOR_OTHER, ANY),
        "serviceDiscoveryRole": {"enum": ["Endpoints", "EndpointSlice"]},
        "jobLabel": {"type": "string"},
        "targetLabels": STRING_LIST,
        "podTargetLabels": STRING_LIST,
        "selector": _object({"matchLabels": STRINGS, "matchExpressions": {"type": "array"}}),
        "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
    },
    ("endpoints", "selector"),
)
RULE = _object(
    {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRINGS,
        "annotations": STRINGS,
    },
    ("expr",),
)
RULE_GROUP = _object(
    {
        "name": {"type": "string", "minLength": 1},
        "interval": DURATION,
        "labels": STRINGS,
        "limit": {"type": "integer"},
        "partial_response_strategy": {"type": "string"},
        "query_offset": DURATION,
        "rules": {"type": "array", "items": RULE},
    },
    ("name",),
)


def _crd_object(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {
            "apiVersion": {"const": f"{OPERATOR_GROUP}/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


OPERATOR_SCHEMAS = {
    "ServiceMonitor": _crd_object("ServiceMonitor", SERVICE_MONITOR_SPEC),
    "PrometheusRule": _crd_object("PrometheusRule", _object({"groups": {"type": "array", "items": RULE_GROUP}})),
}


def test_operator_objects_have_the_fields_of_its_crds(rendered: dict[str, list[Obj]]) -> None:
    seen = set()
    for name, objects in rendered.items():
        for obj in objects:
            if not obj["apiVersion"].startswith(OPERATOR_GROUP + "/"):
                continue
            assert obj["kind"] in OPERATOR_SCHEMAS, f"{name}: no schema of {obj['kind']}"
            errors = list(jsonschema.Draft202012Validator(OPERATOR_SCHEMAS[obj["kind"]]).iter_errors(obj))
            assert not errors, f"{name}: {obj['kind']}: " + "; ".join(
                f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
            )
            seen.add(obj["kind"])
            names = [g["name"] for g in obj["spec"].get("groups", [])]
            assert len(names) == len(set(names)), "group names are the list's keys"
    assert seen == {"ServiceMonitor", "PrometheusRule"}
    # the overlays alone need no operator: a cluster without its CRDs applies them
    for overlay in OVERLAYS:
        assert not [o for o in rendered[overlay] if o["apiVersion"].startswith(OPERATOR_GROUP)], overlay


# ------------------------------------------------------------------------------------ the workloads


@dataclass
class Workload:
    """The StatefulSet of one overlay, its wowd container, and the settings wowd reads in its pod
    (the image's environment, the container's, its Secret and its config file)."""

    name: str
    objects: list[Obj]
    sts: Obj
    pod: Obj
    container: Obj
    env: dict[str, str]
    settings: WowdSettings

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.sts["spec"]["template"]["metadata"]["labels"])

    @property
    def replicas(self) -> int:
        return int(self.sts["spec"].get("replicas", 1))


def secret_example(*, commented: bool) -> dict[str, str]:
    """The keys of the example Secret; ``commented``: also those commented out (``# WOWD_...=``)."""
    pattern = r"^(?:# )?(WOWD_\w+)=(.*)$" if commented else r"^(WOWD_\w+)=(.*)$"
    return dict(re.findall(pattern, SECRET_EXAMPLE.read_text(), re.M))


def pod_env(objects: list[Obj], container: Obj) -> dict[str, str]:
    """The container's environment in pod :data:`POD_NAME`: the image's, then ``envFrom`` (the
    Secret as the example fills it, every line of it), then ``env``."""
    env = image_env()
    for source in container.get("envFrom", []):
        assert set(source) == {"secretRef"}, source
        assert source["secretRef"]["name"] == "wowd" and not source["secretRef"].get("optional")
        env.update(secret_example(commented=True))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = POD_NAME
    return env


def config_file(objects: list[Obj], pod: Obj, container: Obj, path: str) -> str:
    """The text of the file ``path`` in the container, from the ConfigMap volume mounted there."""
    mount = next(m for m in container["volumeMounts"] if Path(path).parent == Path(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"])
    return str(cm["data"][Path(path).name])


def settings_in_pod(objects: list[Obj], pod: Obj, container: Obj, env: dict[str, str], scratch: Path) -> WowdSettings:
    env = dict(env)
    if "WOWD_CONFIG" in env:
        local = scratch / "wowd.toml"
        local.write_text(config_file(objects, pod, container, env["WOWD_CONFIG"]))
        env["WOWD_CONFIG"] = str(local)
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.upper().startswith("WOWD_")]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        return load_settings()


@pytest.fixture(scope="session")
def workloads(rendered: dict[str, list[Obj]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    found = {}
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        sts = only(objects, "StatefulSet")
        pod = sts["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "wowd"]
        env = pod_env(objects, container)
        settings = settings_in_pod(objects, pod, container, env, tmp_path_factory.mktemp("pod"))
        found[overlay] = Workload(overlay, objects, sts, pod, container, env, settings)
    return found


@pytest.fixture(params=OVERLAYS)
def workload(request: pytest.FixtureRequest, workloads: dict[str, Workload]) -> Workload:
    return workloads[request.param]


def test_every_workload_is_a_statefulset(rendered: dict[str, list[Obj]]) -> None:
    for name, objects in rendered.items():
        kinds = [o["kind"] for o in objects if o["kind"] in WORKLOAD_KINDS]
        assert kinds == ["StatefulSet"], (name, kinds)


def test_each_overlay_gives_wowd_valid_settings(workloads: dict[str, Workload]) -> None:
    """The pod's environment and config file are settings wowd starts with (every key known, every
    value valid), on the backend the overlay is named after."""
    assert workloads["overlays/embedded"].settings.backend == "embedded"
    mongo = workloads["overlays/mongo"].settings
    assert mongo.backend == "mongo" and mongo.config is not None
    assert mongo.mongodb.uri is not None and mongo.elasticsearch.url


def test_probes_are_on_the_listener(workload: Workload) -> None:
    c = workload.container
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        assert port.get(get["port"], get["port"]) == workload.settings.http.port, probe
    assert workload.settings.http.host == "0.0.0.0"


def test_the_owner_key_is_the_pod_name(workload: Workload) -> None:
    (var,) = [v for v in workload.container["env"] if v["name"] == "WOWD_LEASE__OWNER_KEY"]
    assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert workload.settings.owner_key == POD_NAME


def test_the_grace_period_covers_the_drain(workload: Workload) -> None:
    """SIGTERM: deliveries in flight get the grace, then (each bounded, one after the other) the
    last settle, the slots' release, the presence record's deletion and the stores' close."""
    drain = workload.settings.shutdown.grace_s + SETTLE_TIMEOUT_S + 2 * RELEASE_TIMEOUT_S + CLOSE_TIMEOUT_S
    assert workload.pod["terminationGracePeriodSeconds"] >= drain
    # the grace is set beside the period, where both are read together
    assert "WOWD_SHUTDOWN__GRACE_S" in {v["name"] for v in workload.container["env"]}


def test_non_root_on_a_read_only_root_file_system(workload: Workload) -> None:
    """The restricted Pod Security Standard, and the image's own user."""
    pod, c = workload.pod["securityContext"], workload.container["securityContext"]
    assert pod["runAsNonRoot"] is True
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert user is not None and (pod["runAsUser"], pod["runAsGroup"]) == (int(user[1]), int(user[2]))
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["readOnlyRootFilesystem"] is True
    assert c["allowPrivilegeEscalation"] is False
    assert c["capabilities"] == {"drop": ["ALL"]}
    assert "runAsUser" not in c or c["runAsUser"] != 0
    assert workload.pod["automountServiceAccountToken"] is False


def writable_paths(w: Workload) -> set[Path]:
    """Where a replica writes: its embedded file's directory (the file, -wal, -shm) and the
    temporary directory (SQLite's temporary files, Python's tempfile)."""
    paths = {Path(w.env.get("TMPDIR", "/tmp"))}
    if w.settings.backend == "embedded":
        paths.add(Path(w.settings.embedded.path).parent)
    return paths


def test_every_writable_path_is_a_mounted_volume(workload: Workload) -> None:
    claims = {t["metadata"]["name"] for t in workload.sts["spec"].get("volumeClaimTemplates", [])}
    writable_volumes = claims | {v["name"] for v in workload.pod.get("volumes", []) if "emptyDir" in v}
    mounts = [m for m in workload.container["volumeMounts"] if m["name"] in writable_volumes and not m.get("readOnly")]
    for path in writable_paths(workload):
        assert any(path.is_relative_to(m["mountPath"]) for m in mounts), f"{path} is on the read-only root"
    assert Path(workload.settings.embedded.path).is_absolute()


def test_the_writable_paths_follow_the_backend(workloads: dict[str, Workload]) -> None:
    assert writable_paths(workloads["overlays/embedded"]) == {Path("/tmp"), Path("/var/lib/wowd")}
    assert writable_paths(workloads["overlays/mongo"]) == {Path("/tmp")}


QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|)$")
UNITS = {"m": 1e-3, "": 1.0, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30}


def quantity(text: str | int) -> float:
    match = QUANTITY.match(str(text))
    assert match is not None, text
    return float(match[1]) * UNITS[match[2]]


def test_requests_and_limits(workload: Workload) -> None:
    for c in workload.pod["containers"]:
        res = c["resources"]
        for resource in ("cpu", "memory"):
            assert quantity(res["requests"][resource]) <= quantity(res["limits"][resource]), (c["name"], resource)
    memory = quantity(workload.container["resources"]["limits"]["memory"])
    assert memory >= 512 * 2**20  # a burst of 100,000 timers peaks at about 360 MiB (bench/RESULTS.md)


def budgets(w: Workload) -> list[Obj]:
    return [o for o in w.objects if o["kind"] == "PodDisruptionBudget" and selects(o["spec"]["selector"], w.labels)]


def test_a_disruption_budget_only_with_several_replicas(workloads: dict[str, Workload]) -> None:
    """With one replica, a budget that protects it blocks every node drain: none. With several,
    one at a time, and the slots keep a holder meanwhile."""
    embedded = workloads["overlays/embedded"]
    assert embedded.replicas == 1 and budgets(embedded) == []
    mongo = workloads["overlays/mongo"]
    assert mongo.replicas > 1
    (pdb,) = budgets(mongo)
    spec = pdb["spec"]
    down = spec["maxUnavailable"] if "maxUnavailable" in spec else mongo.replicas - spec["minAvailable"]
    assert down >= 1, "a budget that allows no disruption blocks every drain"
    lease = mongo.settings.lease
    assert (mongo.replicas - down) * lease.slots_per_process >= lease.limit, "a drain leaves a slot without holder"
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_several_replicas_spread_across_nodes(workload: Workload) -> None:
    lease = workload.settings.lease
    if workload.replicas == 1:
        assert workload.settings.backend == "embedded"
        return
    assert workload.replicas * lease.slots_per_process > lease.limit, "no standby"
    spread = [
        t
        for t in workload.pod.get("topologySpreadConstraints", [])
        if t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"], workload.labels)
    ]
    assert spread and spread[0]["maxSkew"] == 1 and spread[0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread[0]["nodeTaintsPolicy"] == "Honor"  # a cordoned node does not keep evicted pods Pending


def test_the_embedded_overlay_is_one_replica_on_a_read_write_once_volume(workloads: dict[str, Workload]) -> None:
    w = workloads["overlays/embedded"]
    assert w.replicas == 1
    (claim,) = w.sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    (mount,) = [m for m in w.container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert Path(w.settings.embedded.path).parent == Path(mount["mountPath"])
    assert w.sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}


def test_the_service_and_the_network_policy_reach_the_listener(workload: Workload) -> None:
    service = only(workload.objects, "Service")
    assert workload.sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= workload.labels.items()
    named = {p["name"]: p["containerPort"] for p in workload.container["ports"]}
    (port,) = service["spec"]["ports"]
    assert named[port["targetPort"]] == workload.settings.http.port
    assert service["metadata"]["labels"]["context"] == workload.settings.context
    policy = only(workload.objects, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"], workload.labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress is the operator's
    for rule in policy["spec"]["ingress"]:
        assert [named.get(p["port"], p["port"]) for p in rule["ports"]] == [workload.settings.http.port]


def test_no_service_links(workload: Workload) -> None:
    """Kubernetes would set ``<SERVICE>_SERVICE_HOST`` and the like for each Service of the
    namespace: for a Service named wowd-ui, variables wowd refuses to start with."""
    assert workload.pod["enableServiceLinks"] is False
    links = {"WOWD_UI_SERVICE_HOST": "10.0.0.1", "WOWD_UI_PORT": "tcp://10.0.0.1:80"}
    assert unknown_environment_keys(links) == sorted(links)


def test_the_image_is_this_version(rendered: dict[str, list[Obj]]) -> None:
    from wowd import __version__

    for overlay in OVERLAYS:
        (image,) = {
            c["image"] for c in only(rendered[overlay], "StatefulSet")["spec"]["template"]["spec"]["containers"]
        }
        assert image == f"wowd:{__version__}"


# --------------------------------------------------------------------------------------- the secrets


def _types(annotation: Any) -> list[Any]:
    """The annotation, its origin (``list``) and its arguments, all the way down."""
    found = [annotation, typing.get_origin(annotation)]
    for arg in typing.get_args(annotation):
        found += _types(arg)
    return found


def secret_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The settings that are credentials (``SecretStr``) as paths of keys; a list setting whose
    items hold one (the routes) is one setting, one variable, and a credential as a whole."""
    found = set()
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        types = _types(field.annotation)
        if SecretStr in types:
            found.add(path)
        for part in types:
            if isinstance(part, type) and issubclass(part, BaseModel) and (inner := secret_paths(part, path)):
                found |= {path} if list in types else inner
    return found


SECRETS = secret_paths(WowdSettings)


def test_the_credentials_come_from_the_secret_only(workloads: dict[str, Workload]) -> None:
    assert {("mongodb", "uri"), ("elasticsearch", "api_key"), ("ui", "token"), ("gateway", "routes")} <= SECRETS
    secret_variables = {variable(p) for p in SECRETS}
    for w in workloads.values():
        literal = {v["name"] for v in w.container.get("env", []) if "value" in v}
        assert not literal & secret_variables, w.name
        if "WOWD_CONFIG" in w.env:
            toml = tomllib.loads(config_file(w.objects, w.pod, w.container, w.env["WOWD_CONFIG"]))
            for path in SECRETS:
                node: Any = toml
                for key in path:
                    node = node.get(key, {}) if isinstance(node, dict) else {}
                assert node == {}, f"{'.'.join(path)} in the ConfigMap"
    # the example Secret holds credentials only, and the status page's token is long
    assert set(secret_example(commented=True)) <= secret_variables
    assert len(secret_example(commented=True)["WOWD_UI__TOKEN"]) >= 16
    assert "WOWD_UI__TOKEN" not in secret_example(commented=False), "a token of the repository enables the actions"


def test_the_documented_command_creates_the_secret(tmp_path: Path) -> None:
    """``kubectl create secret generic wowd --from-env-file=...`` of the example (each line
    uncommented) makes a valid Secret with every value as written."""
    kubectl = _kubectl()
    example = secret_example(commented=True)
    env_file = tmp_path / "secret.env"
    env_file.write_text(SECRET_EXAMPLE.read_text().replace("\n# WOWD_", "\nWOWD_"))
    out = subprocess.run(
        [
            kubectl,
            "create",
            "secret",
            "generic",
            "wowd",
            f"--from-env-file={env_file}",
            "--dry-run=client",
            "-o",
            "yaml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    secret = yaml.safe_load(out.stdout)
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == example


# ------------------------------------------------------------------------------------ the monitoring


def test_the_prometheus_rule_is_generated_from_the_alerts() -> None:
    component = K8S / COMPONENT
    sys.path.insert(0, str(component))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
        sys.modules.pop("generate", None)
    assert (component / "prometheusrule.yaml").read_text() == generate.render(), (
        "prometheusrule.yaml is not what generate.py writes from alerts.yaml: run it"
    )


def test_the_prometheus_rule_carries_every_alert(rendered: dict[str, list[Obj]]) -> None:
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())["groups"]
    names = {r["alert"] for g in alerts for r in g["rules"]}
    assert len(names) >= 15
    for overlay in OVERLAYS:
        rule = only(rendered[f"{overlay}+{COMPONENT}"], "PrometheusRule")
        assert rule["spec"]["groups"] == alerts


def test_the_service_monitor_scrapes_the_replicas_as_the_alerts_expect(rendered: dict[str, list[Obj]]) -> None:
    alerts = (ROOT / "deploy/prometheus/alerts.yaml").read_text()
    jobs = set(re.findall(r'\bjob="([^"]+)"', alerts))
    assert jobs == {"wowd"}
    for overlay in OVERLAYS:
        objects = rendered[f"{overlay}+{COMPONENT}"]
        monitor, service = only(objects, "ServiceMonitor"), only(objects, "Service")
        labels = service["metadata"]["labels"]
        assert selects(monitor["spec"]["selector"], labels)
        assert "namespaceSelector" not in monitor["spec"]  # its own namespace, the Service's
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
        assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}
        assert labels[monitor["spec"]["jobLabel"]] in jobs
        assert set(monitor["spec"]["targetLabels"]) == {"context"} and "context" in labels


# ------------------------------------------------------------------------ a replica, read-only root


MOUNT_SCRIPT = r"""
set -eu
root=$1; shift
# the new root: a tmpfs, read-only at the end
mount -t tmpfs -o mode=0755,size=4m wowd-root "$root"
# writable volumes first (their mount points are made in the new root's own tmpfs)
while [ "$1" != -- ]; do
  mkdir -p "$root$1"; mount -t tmpfs -o "$2" wowd-volume "$root$1"; shift 2
done
shift
# what the interpreter and the code need, each read-only at its own path
while [ "$1" != -- ]; do
  if [ -L "$1" ]; then
    mkdir -p "$root$(dirname "$1")"; ln -s "$(readlink "$1")" "$root$1"
  else
    mkdir -p "$root$1"; mount --bind "$1" "$root$1"; mount -o remount,bind,ro "$root$1"
  fi
  shift
done
shift
mkdir "$root/dev" "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /proc "$root/proc"
mount -o remount,ro "$root"
exec chroot "$root" "$@"
"""
"""``unshare --mount`` runs it: ``ROOT VOLUME OPTIONS ... -- PATH ... -- COMMAND ...``."""


def _host_paths() -> list[str]:
    """What a replica needs from this machine, each bound read-only: the system's libraries and
    settings, the interpreter, the virtual environment and this checkout (installed editable)."""
    wanted = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", sys.base_prefix, sys.prefix, str(ROOT)]
    paths: list[str] = []
    for p in sorted(set(wanted)):
        if os.path.lexists(p) and not any(Path(p).is_relative_to(q) for q in paths):
            paths.append(p)
    return paths


@pytest.fixture
def read_only_replica(workloads: dict[str, Workload], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``wowd run`` (with its in-process demo producer) in a root of its own where nothing is
    writable but the embedded overlay's writable volumes, as the pod's user, with the pod's
    environment; answers the process and its log."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        why = "a mount namespace (root, unshare, setpriv) is needed"
        if REQUIRE_MOUNT:
            pytest.fail(f"{why} (WOWD_TEST_REQUIRE_TMPFS=1)")
        pytest.skip(why)
    w = workloads["overlays/embedded"]
    claims = {t["metadata"]["name"] for t in w.sts["spec"]["volumeClaimTemplates"]}
    empty = {v["name"] for v in w.pod["volumes"] if "emptyDir" in v}
    volumes: list[str] = []
    for m in w.container["volumeMounts"]:
        # an emptyDir is open to all; a claim belongs to the pod's fsGroup
        group = w.pod["securityContext"]["fsGroup"]
        options = "mode=1777,size=64m" if m["name"] in empty else f"mode=2770,gid={group},size=64m"
        assert m["name"] in empty | claims, m
        volumes += [m["mountPath"], options]
    env = {**w.env, "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/var/lib/wowd"}
    env |= {"WOWD_HTTP__HOST": "127.0.0.1", "WOWD_HTTP__PORT": "0", "WOWD_DEMO": "true"}
    sc = w.pod["securityContext"]
    command = [
        "setpriv", f"--reuid={sc['runAsUser']}", f"--regid={sc['runAsGroup']}", "--clear-groups", "--",
        "/bin/sh", "-c", 'cd "$0" && exec "$@"', "/var/lib/wowd",
        sys.executable, "-m", "wowd", "run", "--port-file", "/tmp/wowd.port",
    ]  # fmt: skip
    root = tmp_path / "root"
    root.mkdir()
    log = tmp_path / "wowd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT_SCRIPT, "sh", str(root)]
            + [*volumes, "--", *_host_paths(), "--", *command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def what_it_wrote(pid: int) -> tuple[int, dict[str, int]]:
    """The process's user, and each file in its writable volumes with its owner."""
    status = Path(f"/proc/{pid}/status").read_text()
    uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
    assert uid is not None
    inside = Path(f"/proc/{pid}/root")
    host = [Path(h) for h in _host_paths()]  # bound read-only, in a volume where the checkout is (/tmp/...)

    def bound(path: Path) -> bool:
        return any(path.is_relative_to(h) or h.is_relative_to(path) for h in host)

    files: dict[str, int] = {}
    for d in ("var/lib/wowd", "tmp"):
        for top, dirs, names in os.walk(inside / d):
            here = Path("/") / Path(top).relative_to(inside)
            dirs[:] = [x for x in dirs if not bound(here / x)]  # not into what is bound from the host
            for name in [*dirs, *names]:
                if not bound(here / name):
                    files[str(here / name)] = (Path(top) / name).stat().st_uid
    return int(uid[1]), files


@pytest.mark.process
@pytest.mark.anyio
async def test_a_replica_runs_with_only_its_volumes_writable(
    read_only_replica: tuple[subprocess.Popen[bytes], Path], workloads: dict[str, Workload]
) -> None:
    """The embedded overlay's replica on a read-only root: it starts, holds its slot, feeds the
    demo's commits into its file, writes nowhere else, and drains on SIGTERM within the period."""
    import anyio

    proc, log = read_only_replica
    inside = Path(f"/proc/{proc.pid}/root")
    port_file = inside / "tmp/wowd.port"

    def exited() -> str:
        return f"wowd exited ({proc.returncode}): {log.read_text(errors='replace')[-3000:]}"

    async def fed(client: httpx.AsyncClient, port: int) -> bool:
        ready = await client.get(f"http://127.0.0.1:{port}/readyz?holding=1")
        metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        return ready.status_code == 200 and bool(re.search(r"^wowd_feed_commits_total\{[^}]*\} [1-9]", metrics, re.M))

    with anyio.fail_after(30):
        while not (proc.poll() is None and port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, exited()
            await anyio.sleep(0.05)
        port = int(port_file.read_text())
        async with httpx.AsyncClient(timeout=5) as client:
            while not await fed(client, port):
                assert proc.poll() is None, exited()
                await anyio.sleep(0.1)
    user = workloads["overlays/embedded"].pod["securityContext"]["runAsUser"]
    uid, written = what_it_wrote(proc.pid)
    assert uid == user
    assert written == {
        "/var/lib/wowd/wowd.db": user,
        "/var/lib/wowd/wowd.db-shm": user,
        "/var/lib/wowd/wowd.db-wal": user,
        "/tmp/wowd.port": user,
    }
    proc.send_signal(signal.SIGTERM)
    period = workloads["overlays/embedded"].pod["terminationGracePeriodSeconds"]
    await anyio.to_thread.run_sync(lambda: proc.wait(timeout=period))
    assert proc.returncode == 0, exited()
    text = log.read_text(errors="replace")
    assert "replica stopped" in text and "Read-only file system" not in text
