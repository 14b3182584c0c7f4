"""``make mutate``: mutation testing (mutmut) of the modules where a silent change loses or repeats
a timer, each group of modules paired with the fast tests that cover it.

``python -m tests.mutate [GROUP ...]`` runs the groups named (default: every group, in the order
of :data:`GROUPS`: the stores first, the daemon's firing last), each in a directory of its own,
``.mutate/GROUP`` (a copy of ``wowd/``, ``tests/`` and ``pyproject.toml`` with the group's
``[tool.mutmut]``), one mutant at a time (``--max-children 1``: run it under ``nice``). mutmut
runs each mutant against the group's tests that cover the function it changed (its own
per-function map, made by one run of the group's tests first), never the whole suite. Each group's
survivors (and timeouts) are written to ``.mutate/GROUP/survivors.txt`` with the commit and the
date; ``cd .mutate/GROUP && mutmut show NAME`` shows one. docs/testing.md lists the last run's
survivors, each killed by a test since or explained.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".mutate"


@dataclass(frozen=True)
class Group:
    modules: tuple[str, ...]
    tests: tuple[str, ...]


GROUPS: dict[str, Group] = {
    # fences and checkpoints, the log's reads
    "log": Group(
        ("wowd/stores/embedded/log.py", "wowd/stores/embedded/checkpoints.py"),
        (
            "tests/contract/test_log.py",
            "tests/contract/test_checkpoints.py",
            "tests/embedded/test_log_batches.py",
            "tests/embedded/test_log_union_read.py",
            "tests/embedded/test_batched_reads.py",
            "tests/embedded/test_leases_log.py",
            "tests/embedded/test_log_reader.py",
            "tests/embedded/test_log_writes.py",
        ),
    ),  # fmt: skip
    # leases: acquire, renew, release, fences
    "leases": Group(
        ("wowd/stores/embedded/leases.py",),
        (
            "tests/contract/test_leases.py",
            "tests/contract/test_presence.py",
            "tests/embedded/test_leases_log.py",
            "tests/embedded/test_presence.py",
        ),
    ),  # fmt: skip
    # the view's puts and cancels, its rows, the operators' reads
    "timers": Group(
        (
            "wowd/stores/embedded/timer_view.py",
            "wowd/stores/embedded/timer_rows.py",
            "wowd/stores/embedded/timer_queries.py",
        ),
        (
            "tests/contract/test_timer_view.py",
            "tests/contract/test_timer_queries.py",
            "tests/embedded/test_timers.py",
            "tests/embedded/test_firing_path.py",
            "tests/embedded/test_timer_rebuild.py",
        ),
    ),  # fmt: skip
    # the outbox: puts, acks, the fast path's writes
    "outbox": Group(
        ("wowd/stores/embedded/outbox.py",),
        ("tests/contract/test_outbox.py", "tests/embedded/test_fast_path.py", "tests/embedded/test_firing_path.py"),
    ),
    # retries and their backoff
    "retry": Group(("wowd/retry.py",), ("tests/test_retrying.py", "tests/test_retry.py")),
    # firing: the embedded store's claims, settles, the outbox shortcut's round and the tombstone
    # sweep; the fire rule and its rounds, the timer loop's plan and the log's watermark; then the
    # slot keeper's timing
    "firing-store": Group(
        ("wowd/stores/embedded/timer_firing.py",),
        (
            "tests/contract/test_timer_firing.py",
            "tests/embedded/test_timers_next_due.py",
            "tests/embedded/test_tombstone_sweep.py",
            "tests/embedded/test_firing_path.py",
            "tests/embedded/test_fast_path.py",
            "tests/firing/test_outbox_shortcut.py",
            "tests/firing/test_history.py",
            "tests/firing/test_log_check.py",
        ),
    ),  # fmt: skip
    "fire-gate": Group(
        (
            "wowd/daemon/firing.py",
            "wowd/daemon/waker.py",
            "wowd/daemon/timer_plan.py",
            "wowd/daemon/timers.py",
        ),
        (
            "tests/firing/test_fire_rule.py",
            "tests/firing/test_outbox_shortcut.py",
            "tests/firing/test_history.py",
            "tests/firing/test_wakeup.py",
            "tests/firing/test_round_planning.py",
            "tests/firing/test_rounds.py",
            "tests/firing/test_cancel_after_claim.py",
            "tests/firing/test_log_gate.py",
            "tests/daemon/test_tombstone_retention.py",
            "tests/daemon/test_timer_stall.py",
        ),
    ),  # fmt: skip
    "lease-keeper": Group(
        ("wowd/daemon/leases.py",),
        (
            "tests/daemon/test_leases.py",
            "tests/daemon/test_lease_timing.py",
            "tests/daemon/test_lease_overlap.py",
            "tests/daemon/test_presence.py",
            "tests/embedded/test_leases_log.py",
        ),
    ),  # fmt: skip
}
"""Each group's modules, mutated, and the fast tests that cover them (one place for the list)."""

PYTEST_ARGS = ["-p", "no:randomly", "-n", "0", "-q", "-x"]


def toml_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def prepare(name: str, group: Group) -> Path:
    """``.mutate/NAME``: the sources and tests as they are now, and the group's mutmut settings
    (mutmut's cache in ``mutants/`` is kept between runs of an unchanged group)."""
    where = WORK / name
    where.mkdir(parents=True, exist_ok=True)
    for tree in ("wowd", "tests"):
        shutil.rmtree(where / tree, ignore_errors=True)
        shutil.copytree(REPO / tree, where / tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    settings = "\n".join(
        [
            "",
            "[tool.mutmut]",
            'source_paths = ["wowd"]',
            f"only_mutate = {toml_list(group.modules)}",
            f"pytest_add_cli_args = {toml_list(PYTEST_ARGS)}",
            f"pytest_add_cli_args_test_selection = {toml_list(group.tests)}",
            "",
        ]
    )
    (where / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text() + settings)
    return where


def run(name: str) -> list[str]:
    """Runs group ``name``; answers its survivors and timeouts (``mutmut results``)."""
    where = prepare(name, GROUPS[name])
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    # no fork server for the tests' processes: it makes the test process a child subreaper, and
    # mutmut's runner, handed the orphans of its workers (a process pool's), fails on their pids
    env = {**os.environ, "WOWD_TEST_FORKSERVER": "0"}
    subprocess.run([mutmut, "run", "--max-children", "1"], cwd=where, env=env, check=False)
    results = subprocess.run([mutmut, "results"], cwd=where, capture_output=True, text=True, check=True).stdout
    left = [line.strip() for line in results.splitlines() if line.strip()]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = f"# {name}: {', '.join(GROUPS[name].modules)} at {commit}, {stamp}: {len(left)} left\n"
    (where / "survivors.txt").write_text(header + "".join(f"{line}\n" for line in left))
    return left


def main(argv: list[str]) -> int:
    names = argv or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        print(f"unknown group(s) {unknown}; the groups: {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    for name in names:
        left = run(name)
        print(f"{name}: {len(left)} survived or timed out (.mutate/{name}/survivors.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
