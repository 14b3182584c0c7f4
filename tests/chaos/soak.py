"""The soak mode of the chaos harness: ``python -m tests.chaos.soak --minutes 30`` (``make soak``).

Runs one long chaos schedule (faults every few seconds, the producer writing all along), prints the
summary and writes it into ``bench/RESULTS.md`` in place of the previous soak's section: faults
survived, timers fired, commits fed, lost (must be 0), cancelled timers delivered (must be 0),
duplicate deliveries beyond the ones in flight at a kill or a pause (must be 0), duplicate
deliveries with distinct fences (must be 0), RSS at start and end, and the rebuilds of the timer
view run meanwhile (``--rebuilds``, on by default: one every 30 to 60 s, a third of them killed
partway), each with its exit code and summary line.
Exits 1 when a promise was broken (the violations are printed and recorded too).
"""

from __future__ import annotations

import argparse
import logging
import platform
import re
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import anyio

from tests import forkserver
from tests.chaos.harness import ChaosConfig, ChaosReport, run_chaos
from wowd.stores.embedded.sqlite import LIBRARY

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md"


def markdown(report: ChaosReport, minutes: float, label: str) -> str:
    c = report.config
    faults = ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items())) or "none"
    violations = report.violations()
    faults_line = (
        f"{sum(report.faults.values())} ({faults}); paused slot holders {report.paused_holders}; "
        f"leases lost on their own (a slow store) {report.lapses}"
    )
    setup = (
        f"{c.replicas} replicas (max {c.max_replicas}), {c.limit} slots, {c.partitions} partitions, "
        f"ttl {c.ttl_s}s, tolerance {c.tolerance_s}s, claim ttl {c.claim_ttl_s}s, {c.rate_per_s:g} commits/s, "
        + (
            f"embedded {LIBRARY}"
            if c.backend == "embedded"
            else "MongoDB simulator (tests/mongosim), sink on the Elasticsearch fake"
        )
        + f"; gateway {c.gateway}"
        + (" (each start in turn: HTTP target, outbox)" if c.gateway == "mixed" else "")
    )
    rss = (
        f"largest replica: start {report.rss_start_kib / 1024:.0f} MiB, "
        f"end {report.rss_end_kib / 1024:.0f} MiB; "
        f"longest-lived replica ({report.oldest_uptime_s / 60:.1f} min up): "
        f"{report.oldest_rss_start_kib / 1024:.0f} -> {report.oldest_rss_end_kib / 1024:.0f} MiB"
    )
    rows = [
        ("run", f"{label}: {minutes:g} min schedule, seed {c.seed}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"),
        ("setup", setup),
        ("host", f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"),
        ("faults survived", faults_line),
        ("timers fired", f"{report.timers_fired} of {report.timers_expected} (cancelled {report.cancelled})"),
        (
            "commits fed",
            f"{report.commits_fed} of {report.commits_expected} in the event index, "
            f"{len(report.extra_documents)} documents there more than once",
        ),
        ("malformed", f"{report.malformed_injected} injected, {report.quarantined} quarantined"),
        ("lost", str(report.lost)),
        (
            "cancelled delivered",
            f"{len(report.cancelled_delivered)} of {report.cancelled_in_time} timers cancelled before their due "
            f"time ({report.cancelled_raced} more cancels appended around or after it)",
        ),
        (
            "duplicates beyond allowance",
            f"{report.duplicates_beyond_n} (duplicates {report.duplicates}, of which allowed "
            f"{report.duplicates_allowed}: sent again after a kill, a pause or a lost lease of the replica "
            f"that had them claimed and unsettled, {report.unsettled_at_faults} such claims at the faults)",
        ),
        (
            "deliveries",
            f"{report.deliveries} ({report.http_deliveries} to the HTTP target, {report.slow_deliveries} of them "
            f"to {report.slow_targets} slow targets answering after {c.slow_latency_s:g}s)",
        ),
        ("duplicate deliveries with distinct fences", str(len(report.duplicate_fences))),
        (
            "checkpoints",
            f"{report.checkpoint_samples} samples, {len(report.checkpoint_regressions)} went backwards, "
            f"{report.handover_rewinds} rewinds at a handover",
        ),
        (
            "timer view rebuilds",
            f"{len(report.rebuilds)} ({sum(1 for r in report.rebuilds if r.exit_code == 0)} swapped in, "
            f"{report.rebuilds_killed} SIGKILLed partway, {len(report.rebuild_failures)} failed)"
            + "".join(f"<br>{i}. " + r.text().replace("|", r"\|") for i, r in enumerate(report.rebuilds, 1)),
        ),
        ("crashes", str(len(report.crashes))),
        ("RSS", rss),
        ("drain", f"caught up {report.drain_s:.1f}s after the producer stopped"),
        ("verdict", "PASS" if not violations else "FAIL: " + "; ".join(violations)),
    ]
    lines = [f"{heading(c)} ({label}, {minutes:g} min)", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n\n"


def heading(config: ChaosConfig) -> str:
    """The soak section's heading (without its run): one section per backend."""
    return "## Chaos soak" if config.backend == "embedded" else "## Chaos soak on the MongoDB simulator"


def replace_soak_section(path: Path, text: str) -> None:
    """Write the soak's section ``text`` into the Markdown file ``path`` in place of the soak
    sections of its backend there (at the first one's place; after the last soak section, or at
    the end, when there is none), keeping the rest."""
    old = path.read_text() if path.exists() else ""
    head, *sections = re.split(r"(?m)^(?=## )", old)
    title = text.split(" (", 1)[0]
    soaks = [i for i, s in enumerate(sections) if s.split(" (", 1)[0] == title]
    if not soaks:
        others = [i for i, s in enumerate(sections) if s.startswith("## Chaos soak")]
        soaks_at = others[-1] + 1 if others else len(sections)
        sections.insert(soaks_at, "")
        soaks = [soaks_at]
    at = soaks[0] if soaks else len(sections)
    kept = [s for i, s in enumerate(sections) if i not in soaks]
    kept.insert(at, text)
    parts = [head.rstrip("\n")] if head.strip() else []
    parts += [s.strip("\n") for s in kept]
    path.write_text("\n\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=int(datetime.now(UTC).timestamp()))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="commits per second (default 20; 15 on mongo-sim, whose one-lock simulator, beside five "
        "replicas on two cores, answers lease renewals late and leases lapse over and over at 20)",
    )
    p.add_argument(
        "--results", type=Path, default=RESULTS, help="markdown file whose soak section the summary replaces"
    )
    p.add_argument("--label", default="make soak")
    p.add_argument(
        "--malformed-every", type=int, default=30, help="one malformed input per this many commits (0: none)"
    )
    p.add_argument(
        "--backend",
        choices=["embedded", "mongo-sim"],
        default="embedded",
        help="the replicas' stores: the embedded file, or MongoDB on the simulator (tests/mongosim)",
    )
    p.add_argument(
        "--rebuilds",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run `wowd timers rebuild` every 30 to 60 s meanwhile, a third of them killed partway",
    )
    p.add_argument(
        "--rebuild-within-s",
        type=float,
        default=60.0,
        help="a rebuild still running after this long is killed and fails the run",
    )
    p.add_argument("--workdir", type=Path, help="where the SQLite file and logs go (default: a temp dir)")
    args = p.parse_args(argv)
    forkserver.ENABLED = False  # every replica and rebuild started afresh, as systemd starts one
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the harness's readiness probes
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wowd-soak-"))
    config = ChaosConfig(
        seed=args.seed,
        replicas=args.replicas,
        duration_s=args.minutes * 60,
        rate_per_s=args.rate if args.rate is not None else (15.0 if args.backend == "mongo-sim" else 20.0),
        fault_gap_s=(2.0, 6.0),
        drain_s=120.0,
        backend=args.backend,
        malformed_every=args.malformed_every or 10**9,
        rebuild_gap_s=(30.0, 60.0) if args.rebuilds else None,
        rebuild_within_s=args.rebuild_within_s,
    )
    report = anyio.run(run_chaos, config, workdir)
    text = markdown(report, args.minutes, args.label)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    replace_soak_section(args.results, text)
    sys.stdout.write(report.summary() + "\n")
    sys.stdout.write(f"written to {args.results}; logs and database in {workdir}\n")
    for v in report.violations():
        sys.stdout.write(f"VIOLATION: {v}\n")
    return 1 if report.violations() else 0


if __name__ == "__main__":
    sys.exit(main())
