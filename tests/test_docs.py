"""The user docs say what the product does: every link resolves, every setting and metric is
documented as it is, the example configuration loads, and the published JSON Schema accepts the
commits wowd writes and refuses what wowd refuses."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel

import wowd.metrics
from wowd.config import WowdSettings, load_settings
from wowd.demo import demo_commits
from wowd.errors import InvalidInput
from wowd.model import AggregateType, commit_from_doc, commit_to_doc, timer_event_from

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
USER_DOCS = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SCHEMA = json.loads((DOCS / "schema/commit.schema.json").read_text())

# ------------------------------------------------------------------------------------------ README and links


def test_readme_is_short_and_gives_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    assert "make run" in text and "make test" in text
    assert "wowd.client" in text


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", [*USER_DOCS, ROOT / "CHANGELOG.md"], ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    for link in _links(doc):
        if re.match(r"^[a-z]+:", link):
            continue  # http(s), mailto: not checked here
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: {link} does not exist"
        assert ROOT in path.parents or path == ROOT, f"{doc.name}: {link} leaves the repository"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.name}: {link}: no heading with that anchor"


@pytest.mark.parametrize("doc", [*USER_DOCS, ROOT / "Makefile"], ids=lambda p: p.name)
def test_every_test_module_named_exists(doc: Path) -> None:
    """A page that points a maintainer at ``tests/...py`` points at a module that is there."""
    named = set(re.findall(r"\btests/[\w/]+\.py\b", doc.read_text()))
    assert not {n for n in named if not (ROOT / n).exists()}, f"{doc.name} names test modules that are not there"


def test_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#title) [c](https://example.com)\n```\n[d](x.md)\n```\n")
    assert _links(page) == ["missing.md", "#title", "https://example.com"]
    assert _anchors(page) == {"title"}


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_speak_of_the_product_only(doc: Path) -> None:
    text = doc.read_text()
    for pattern in (r"\bseeds?[ /]?0\d\d\b", r"\bissues? #?\d+", r"\bwas \d"):
        assert not re.search(pattern, text, re.I), f"{doc.name}: {re.search(pattern, text, re.I)}"


# ------------------------------------------------------------------------------------------ configuration


def _settings(model: type[BaseModel], prefix: str = "WOWD_") -> list[tuple[str, Any]]:
    """``(environment variable, default)`` of every setting, nested parts flattened."""
    out: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += _settings(annotation, f"{prefix}{name.upper()}__")
        else:
            out.append((f"{prefix}{name.upper()}", field.get_default(call_default_factory=True)))
    return out


def _documented_defaults() -> dict[str, str]:
    text = (DOCS / "configuration.md").read_text()
    rows = re.findall(r"^\| `(WOWD_[A-Z0-9_]+)` \| ([^|]*) \|", text, re.M)
    return {key: cell.strip().strip("`") for key, cell in rows}


def _same(cell: str, default: Any) -> bool:
    if default is None:
        return cell.startswith("(")  # "(none)" or "(derived value)"
    if isinstance(default, bool):
        return cell == str(default).lower()
    if isinstance(default, int | float):
        return float(cell) == float(default)
    if isinstance(default, Path):
        return Path(cell) == default
    if isinstance(default, dict):
        return bool(json.loads(cell) == default)
    return bool(cell == str(default))


def test_every_setting_is_documented_with_its_default() -> None:
    documented = _documented_defaults()
    settings = _settings(WowdSettings)
    assert len(settings) > 30
    missing = [key for key, _ in settings if key not in documented]
    assert not missing, f"settings not in docs/configuration.md: {missing}"
    wrong = [(key, documented[key], default) for key, default in settings if not _same(documented[key], default)]
    assert not wrong, f"documented default differs: {wrong}"


def test_the_example_toml_loads_with_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("WOWD_"):
            monkeypatch.delenv(key)
    loaded = load_settings(DOCS / "wowd.example.toml")
    assert loaded.model_dump(exclude={"config"}) == WowdSettings().model_dump(exclude={"config"})


# ------------------------------------------------------------------------------------------ metrics


def _exported_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for obj in vars(wowd.metrics).values():
        if isinstance(obj, Counter):
            out[obj._name + "_total"] = ("counter", tuple(obj._labelnames))
        elif isinstance(obj, Gauge):
            out[obj._name] = ("gauge", tuple(obj._labelnames))
        elif isinstance(obj, Histogram):
            out[obj._name] = ("histogram", tuple(obj._labelnames))
    return out


def test_the_metrics_reference_is_what_wowd_exports() -> None:
    text = (DOCS / "operations.md").read_text()
    rows = re.findall(r"^\| `(wowd_[a-z0-9_]+)(?:\{([a-z_, ]*)\})?` \| (counter|gauge|histogram) \|", text, re.M)
    documented = {
        name: (kind, tuple(s.strip() for s in labels.split(",")) if labels else ()) for name, labels, kind in rows
    }
    exported = _exported_metrics()
    assert len(exported) > 25
    assert documented == exported


# ------------------------------------------------------------------------------------------ schema


def _validator() -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


def _demo_docs() -> list[dict[str, Any]]:
    commits, stats = demo_commits(
        "demo", commits=40, timers=60, due_in_ms=1500, aggregates=10, now_ms=1_767_225_600_000
    )
    assert stats.timers == 60 and stats.cancelled > 0
    # as stored: the log keeps the document as JSON (embedded) or BSON (MongoDB)
    return [json.loads(json.dumps(commit_to_doc(c, 64))) for c in commits]


def test_the_demo_commits_match_the_published_schema() -> None:
    validator = _validator()
    docs = _demo_docs()
    names = {e["name"] for d in docs for e in d["events"]}
    assert {"TimerScheduled", "TimerCancelled", "OrderCreated"} <= names
    for doc in docs:
        errors = [e.message for e in validator.iter_errors(doc)]
        assert not errors, errors


def _scheduled(doc: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in doc["events"] if e["name"] == "TimerScheduled")


def _with(change: str) -> dict[str, Any]:
    doc = _demo_docs()[0]
    body = _scheduled(doc)["body"]
    if change == "unknown rule type":
        body["rule"] = {"type": "sometimes"}
    elif change == "interval without every_ms":
        body["rule"] = {"type": "interval"}
    elif change == "due_at as text":
        body["due_at"] = "tomorrow"
    elif change == "due_at after year 9999":
        body["due_at"] = 253402300800000
    elif change == "target aggregate not a name":
        body["target"]["aggregate"] = "Order Lines"
    elif change == "command without name":
        del body["command"]["name"]
    elif change == "empty key":
        body["key"] = ""
    elif change == "no request id":
        del doc["request_id"]
    elif change == "version 0":
        doc["version"] = 0
    elif change == "control character in the key":
        body["key"] = "remind\x1fv2"  # joined by \x1f into the timer's id: two timers would be one
    elif change == "control character in the aggregate id":
        doc["aggregate_id"] = "order-1\n2026-01-01 INFO forged line"
    elif change == "control character in the tenant":
        doc["tenant_id"] = "acme\x1b[2J"
    elif change == "control character in the target id":
        body["target"]["id"] = "o-\x9b1"
    return doc


@pytest.mark.parametrize(
    "change",
    [
        "unknown rule type",
        "interval without every_ms",
        "due_at as text",
        "due_at after year 9999",
        "target aggregate not a name",
        "command without name",
        "empty key",
        "no request id",
        "version 0",
        "control character in the key",
        "control character in the aggregate id",
        "control character in the tenant",
        "control character in the target id",
    ],
)
def test_the_schema_refuses_what_wowd_refuses(change: str) -> None:
    doc = _with(change)
    assert not _validator().is_valid(doc)
    with pytest.raises(InvalidInput):
        commit = commit_from_doc(AggregateType(context="demo", aggregate="order"), doc)
        for event in commit.events:
            timer_event_from(event)


def test_the_version_in_examples_is_the_packages() -> None:
    """The version a replica shows in ``wowd status`` and ``wowd --version`` is this package's in
    every example."""
    from wowd import __version__

    status = (DOCS / "operations.md").read_text().split("### `wowd status`", 1)[1].split("```", 2)[1]
    rows = [line.split() for line in status.splitlines() if re.search(r"\b(holding|standby|gone)\b  ", line)]
    assert rows and {row[-2] for row in rows} == {__version__}, rows
    for doc in USER_DOCS:
        for found in re.findall(r"\bwowd (\d+\.\d+\.\d+)\b", doc.read_text()):
            assert found == __version__, doc.name


def test_the_upgrade_notes_name_the_store_formats_of_this_version() -> None:
    """docs/operations.md says which upgrades are rolling and names the formats the code has."""
    from wowd.stores.embedded import schema as embedded
    from wowd.stores.mongo import schema as mongo

    text = " ".join((DOCS / "operations.md").read_text().split())
    assert (
        f"embedded log tables {embedded.LOG_FORMAT} (upgraded in place from {embedded.LOG_UPGRADES_FROM}), "
        f"snapshot tables {embedded.SNAPSHOT_FORMAT}, timer tables {embedded.TIMER_FORMAT}" in text
    )
    assert f"MongoDB collections {mongo.FORMAT}, timer collections {mongo.TIMER_FORMAT}" in text
    assert "Such an upgrade is not rolling" in text
