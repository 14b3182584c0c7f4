"""The modules of ``wowd`` import one another without a circle.

Every ``import``/``from ... import`` of a ``wowd`` module counts, at module level or inside a
function (a deferred import is still a dependency), except under ``if TYPE_CHECKING:``.
``from pkg import name`` depends on ``pkg.name`` when that is a module, else on ``pkg``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from wowd.stores import base

ROOT = Path(__file__).resolve().parents[1] / "wowd"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The syntax tree of a module, parsed once for every test here."""
    return ast.parse(path.read_text(), str(path))


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(_tree(path))
    return {m for m in found if m in MODULES and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    """What each wowd module imports (of wowd), parsed once, when a test first asks."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph()[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := dfs(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph()):
        if start not in state and (found := dfs(start)) is not None:
            return found
    return None


def test_the_walk_sees_the_package() -> None:
    assert "wowd.cli.main" in graph() and "wowd.stores.base" in graph()
    assert "wowd.stores.base" in graph()["wowd.stores.embedded.operations"]  # an import the walk must see
    assert "wowd.stores.embedded" in graph()["wowd.backends"]  # a deferred one too


def test_no_module_of_wowd_imports_itself_back() -> None:
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("wowd.model", ("wowd.stores", "wowd.daemon", "wowd.delivery", "wowd.cli", "wowd.client", "wowd.backends")),
    ("wowd.stores", ("wowd.daemon", "wowd.delivery", "wowd.cli", "wowd.client", "wowd.backends")),
    ("wowd.delivery", ("wowd.daemon", "wowd.cli", "wowd.client", "wowd.backends")),
    ("wowd.daemon", ("wowd.cli", "wowd.client")),
    ("wowd.backends", ("wowd.daemon", "wowd.delivery", "wowd.cli", "wowd.client")),
    ("wowd.client", ("wowd.daemon", "wowd.delivery", "wowd.cli")),
]
"""Which way imports go: each layer and the layers above it that it never imports (the model
below the stores, the stores below delivery, delivery below the daemon; the command line on top;
the stores' assembly and the application client beside the daemon, never reaching into it or the
CLI; the replica's composition root opens its backend through the stores' assembly)."""


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


@pytest.mark.parametrize(("layer", "above"), LAYERS, ids=[layer for layer, _ in LAYERS])
def test_imports_go_one_way(layer: str, above: tuple[str, ...]) -> None:
    offenders = sorted(
        f"{name} -> {dep}"
        for name, deps in graph().items()
        if _in(name, layer)
        for dep in deps
        if any(_in(dep, a) for a in above)
    )
    assert not offenders


def test_only_the_composition_root_of_the_daemon_opens_a_backend() -> None:
    opening = {n for n, deps in graph().items() if n.startswith("wowd.daemon") and "wowd.backends" in deps}
    assert opening == {"wowd.daemon.replica"}


BACKEND_PACKAGES = tuple(
    f"wowd.stores.{p.name}" for p in sorted((ROOT / "stores").iterdir()) if (p / "__init__.py").exists()
)
"""The packages of the backends (and of the Elasticsearch sink): ``wowd.stores.embedded``, ..."""


def test_the_protocol_layer_names_no_backend() -> None:
    assert "wowd.stores.embedded" in BACKEND_PACKAGES and "wowd.stores.mongo" in BACKEND_PACKAGES
    for name, deps in graph().items():
        if name in ("wowd.stores", "wowd.stores.base"):
            assert not {d for d in deps if _in(d, "wowd.cli") or _in(d, "wowd.daemon")}, name
            assert not {d for d in deps if any(_in(d, b) for b in BACKEND_PACKAGES)}, name


def _all_imports(path: Path) -> set[str]:
    """Every module a file names in an import, those only a type checker reads included."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update({node.module, *(f"{node.module}.{a.name}" for a in node.names)})
    return found


def _backend_branches(path: Path) -> list[str]:
    """The comparisons of a ``backend`` setting (``settings.backend == "mongo"``) and of a
    backend's name (``... == "embedded"``) in a file, by line."""
    names = {"embedded", "mongo"}
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Compare, ast.Match)):
            sides = [node.subject] if isinstance(node, ast.Match) else [node.left, *node.comparators]
            if any(isinstance(x, ast.Attribute) and x.attr == "backend" for x in sides) or any(
                isinstance(x, ast.Constant) and x.value in names for x in sides
            ):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return found


OUTSIDE_THE_STORES = {
    name: path
    for name, path in MODULES.items()
    if not _in(name, "wowd.stores") and name not in ("wowd.backends", "wowd.config")
}
"""The modules of wowd that know no backend: all but the stores, their assembly and the settings
(which say which settings each backend needs)."""


def test_no_module_outside_the_stores_and_their_assembly_imports_a_backend() -> None:
    # a command or the daemon asks the backend for a capability (wowd.stores.base), never
    # imports or isinstance-checks a concrete store: no backend is named outside wowd/stores
    importing = {
        name: sorted(m for m in _all_imports(path) if any(_in(m, b) for b in BACKEND_PACKAGES))
        for name, path in OUTSIDE_THE_STORES.items()
    }
    assert {name: found for name, found in importing.items() if found} == {}


def test_no_module_outside_the_stores_and_their_assembly_branches_on_the_backend() -> None:
    branches = [b for path in OUTSIDE_THE_STORES.values() for b in _backend_branches(path)]
    assert branches == []


@pytest.mark.parametrize("layer", ["wowd.stores", "wowd.daemon"])
def test_stores_and_daemon_never_import_the_cli(layer: str) -> None:
    offenders = {
        n for n, deps in graph().items() if n.startswith(layer) and any(d.startswith("wowd.cli") for d in deps)
    }
    assert not offenders


DAEMON_WORK = {
    "wowd.daemon.replica": {"open_replica"},
    "wowd.daemon.supervisor": {"Supervisor"},
    "wowd.daemon.rebuild": {"Rebuilder", "RebuildReport", "RebuildStatus"},
    "wowd.daemon.timer_rebuild": {"TimerRebuilder"},
    "wowd.daemon.timer_rebuild_mongo": {"MongoTimerRebuilder"},
}
"""What the CLI may take from the daemon: the daemon and the rebuild (daemon work it runs); a
helper it needs beside them lives outside ``wowd.daemon`` (the gateways in ``wowd.delivery``)."""


def _names_from_daemon(path: Path) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update((a.name, "*") for a in node.names if a.name.startswith("wowd.daemon"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wowd.daemon"):
            found.update((node.module or "", a.name) for a in node.names)
    return found


def test_only_the_cli_imports_the_daemon() -> None:
    offenders = {
        n
        for n, deps in graph().items()
        if not n.startswith(("wowd.daemon", "wowd.cli")) and any(d.startswith("wowd.daemon") for d in deps)
    }
    assert not offenders


def test_the_cli_takes_only_daemon_work_from_the_daemon() -> None:
    taken = {(n, m, name) for n, p in MODULES.items() if n.startswith("wowd.cli") for m, name in _names_from_daemon(p)}
    assert taken, "the walk must see the CLI start the daemon"
    assert {(n, m, name) for n, m, name in taken if name not in DAEMON_WORK.get(m, set())} == set()


LOADED_BY_NAME = {"uvloop"}
"""Declared, never imported by name: anyio loads it (``use_uvloop``)."""


def _distribution(requirement: str) -> str:
    return re.split(r"[\[<>=;! ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_dependencies_declared_are_the_ones_imported() -> None:
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    declared = {_distribution(r) for r in project["dependencies"]}
    top_level: set[str] = set()
    for path in MODULES.values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                top_level.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                top_level.add(node.module.partition(".")[0])
    third_party = {m for m in top_level if m != "wowd" and m not in sys.stdlib_module_names}
    providers = packages_distributions()
    imported = {_distribution(d) for m in third_party for d in providers.get(m, [m])}
    assert imported | LOADED_BY_NAME == declared


def test_every_runtime_dependency_has_its_line_in_the_docs() -> None:
    # docs/architecture.md, "Dependencies": one table row per declared dependency, saying why
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    declared = {_distribution(r) for r in project["dependencies"]}
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = doc.split("## Dependencies", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {_distribution(n) for row in rows for n in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert declared <= named, f"without a line in docs/architecture.md: {sorted(declared - named)}"


def test_the_cli_starts_without_the_http_client() -> None:
    # aiohttp takes about a third of a second to import (it loads the system's CA bundle): only
    # a replica with an http gateway pays it, not every `wowd` command nor an outbox replica
    code = "import sys, wowd.cli, wowd.cli.run; print(sorted(m for m in ('aiohttp', 'yarl') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


STORE_PROTOCOLS = (
    base.Log, base.Checkpoints, base.Quarantine, base.SlotLeaseStore, base.TimerView, base.TimerFiring,
    base.TimerQueries, base.SnapshotStore, base.SnapshotRebuildStore, base.EventSink, base.Outbox, base.TimerHistory,
)  # fmt: skip
"""The protocols every backend implements (its capabilities aside)."""


def _members(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_no_store_protocol_has_more_than_twelve_methods() -> None:
    wide = {p.__name__: len(_members(p)) for p in STORE_PROTOCOLS if len(_members(p)) > 12}
    assert wide == {}


def test_each_module_of_a_backend_implements_one_store_protocol_at_most() -> None:
    """A module is one concern: a backend module implements one protocol of the stores (what it
    needs of another is a store of its own, or a function of the backend's schema module)."""
    several = {}
    for name in MODULES:
        if not any(_in(name, b) and name != b for b in BACKEND_PACKAGES):
            continue
        module = importlib.import_module(name)
        classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == name]
        implemented = {p.__name__ for p in STORE_PROTOCOLS for c in classes if _members(p) <= {n for n in dir(c)}}
        if len(implemented) > 1:
            several[name] = sorted(implemented)
    assert several == {}


def test_the_timer_loops_run_is_short_and_knows_no_backend() -> None:
    """``TimerLoop.run`` reads as the loop it is: what differs per backend is the round strategy
    chosen where the backend is assembled, not a branch in the loop."""
    tree = _tree(MODULES["wowd.daemon.timers"])
    loop = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TimerLoop")
    run = next(n for n in loop.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "run")
    assert run.end_lineno is not None and run.end_lineno - run.lineno + 1 < 60
    names = {n.id for n in ast.walk(run) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(run) if isinstance(n, ast.Attribute)
    }
    assert not names & {"embedded", "mongo", "FusedFirst", "ClaimDeliverSettle", "FusedFiring"}


def test_the_commands_but_run_start_without_the_replica() -> None:
    # the replica (supervisor, loops, gateways, HTTP server) is a third of a command's start:
    # `wowd run` loads it, the other commands do not; a replica loads the status page's
    # template engine at the first page
    code = (
        "import sys, wowd.cli, wowd.daemon.rebuild, wowd.ui.app; "
        "print(sorted(m for m in ('wowd.daemon.supervisor', 'wowd.delivery', 'jinja2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
