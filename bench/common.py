"""What the benchmarks share: timer rows for the embedded store, statistics, process accounting,
the worker subprocess runner and Markdown tables."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wowd.model import partition
from wowd.stores.embedded.schema import timer_ddl, timer_register_sql, timer_table
from wowd.stores.embedded.sqlite import MODULE, sqlite3
from wowd.stores.embedded.timer_rows import COLUMNS
from wowd.stores.embedded.timer_view import put_sql

__all__ = [
    "BENCH_CONTEXT",
    "Lags",
    "WorkerError",
    "cpu_seconds",
    "fmt",
    "fmt_ms",
    "insert_timer_rows",
    "lag_stats",
    "machine",
    "median",
    "now_ms",
    "outbox_lags",
    "peak_rss_mb",
    "proc_stats",
    "run_worker",
    "table",
    "timer_rows",
]

BENCH_CONTEXT = "bench"
AGGREGATES = ("order", "cart", "invoice")
BODY = '{"body":{"n":1},"name":"remind"}'
RULE_ONCE = '{"type":"once"}'
REPO = Path(__file__).resolve().parent.parent


def now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- timer rows


def timer_rows(
    n: int, *, due_at: int | Callable[[int], int], partitions: int = 64, start: int = 0, prefix: str = "agg"
) -> Iterator[tuple[Any, ...]]:
    """``n`` PENDING one-shot timers as rows of the embedded timer table (``COLUMNS`` order),
    one per aggregate ``{prefix}-{i}``, over three aggregate types; ``due_at`` a constant or a
    function of ``i``."""
    due = due_at if callable(due_at) else (lambda _i, d=due_at: d)
    for i in range(start, start + n):
        agg_id = f"{prefix}-{i}"
        at = due(i)
        yield (
            hashlib.blake2b(agg_id.encode(), digest_size=16).hexdigest(),
            partition(agg_id, partitions),
            AGGREGATES[i % 3],
            "(0)",
            agg_id,
            "remind",
            1,
            "PENDING",
            at,
            at,
            "billing",
            "invoice",
            "(0)",
            f"inv-{i}",
            BODY,
            RULE_ONCE,
            0,
            0,
            None,
            None,
            None,
            None,
            0,
        )


def _connect(path: Path | str) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def create_timer_tables(path: Path | str, context: str = BENCH_CONTEXT) -> None:
    """The embedded timer store's tables and indexes (its own DDL statements) and the registry
    rows of the three aggregate types."""
    conn = _connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for stmt in timer_ddl(context):
            conn.execute(stmt)
        conn.execute(timer_register_sql(), (timer_table(context), context, None))
        for agg in AGGREGATES:
            conn.execute(timer_register_sql(), (f"wow_timer__{context}__{agg}", context, agg))
        conn.execute("COMMIT")
    finally:
        conn.close()


def insert_timer_rows(
    path: Path | str,
    rows: Iterator[tuple[Any, ...]] | Sequence[tuple[Any, ...]],
    context: str = BENCH_CONTEXT,
) -> int:
    """Inserts rows with the store's own ``put`` statement, in transactions of 50,000."""
    assert len(COLUMNS) == 23
    conn = _connect(path)
    sql = put_sql(context)
    total = 0
    try:
        it = iter(rows)
        while True:
            chunk = [r for _, r in zip(range(50_000), it, strict=False)]
            if not chunk:
                break
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql, chunk)
            conn.execute("COMMIT")
            total += len(chunk)
    finally:
        conn.close()
    return total


def outbox_lags(path: Path | str) -> list[int]:
    """``created_at - scheduled_at`` (ms) of every outbox row."""
    conn = _connect(path)
    try:
        return [int(r[0]) for r in conn.execute("SELECT created_at - scheduled_at FROM outbox")]
    finally:
        conn.close()


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True, slots=True, kw_only=True)
class Lags:
    p50: float
    p99: float
    max: float

    def as_dict(self) -> dict[str, float]:
        return {"p50_ms": self.p50, "p99_ms": self.p99, "max_ms": self.max}


def _pct(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[k])


def lag_stats(values: Sequence[float]) -> Lags:
    s = sorted(values)
    return Lags(p50=_pct(s, 0.5), p99=_pct(s, 0.99), max=float(s[-1]) if s else float("nan"))


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return float(statistics.median(vals)) if vals else float("nan")


def median_of(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per numeric key, the median over runs; other keys from the first run."""
    out: dict[str, Any] = dict(runs[0]) if runs else {}
    for key, value in out.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = median([float(r[key]) for r in runs if key in r])
    out["runs"] = len(runs)
    return out


# --------------------------------------------------------------------------- processes


def peak_rss_mb() -> float:
    """This process's peak resident set (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def proc_stats(pid: int) -> tuple[float, float]:
    """``(peak RSS MB, CPU seconds)`` of a live process, from ``/proc`` (Linux)."""
    rss = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) / 1024
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError, IndexError):
        return rss, float("nan")
    return rss, cpu


class WorkerError(RuntimeError):
    pass


POPEN: Callable[..., Any] = subprocess.Popen
"""Starts each process of the benchmarks (``wowd`` and the measurement workers), with
``subprocess.Popen``'s arguments. The benchmarks' smoke test (``tests/test_bench_smoke.py``)
forks them from its fork server instead: what it asserts does not depend on how a process
starts, which the numbers here include."""


def run_worker(
    name: str,
    params: Mapping[str, Any],
    *,
    python: str | None = None,
    script: Path | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Runs one measurement in a fresh process (``python -m bench.worker NAME PARAMS`` or a
    standalone ``script``) and answers the JSON object it prints last."""
    exe = python or sys.executable
    cmd = [exe, str(script), json.dumps(params)] if script else [exe, "-m", "bench.worker", name, json.dumps(params)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = POPEN(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = (b.decode(errors="replace") for b in proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise WorkerError(f"{name} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --------------------------------------------------------------------------- reporting


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "sqlite": f"{sqlite3.sqlite_version} ({MODULE})",
        "system": f"{platform.system()} {platform.release()}",
    }


def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def fmt_ms(value: Any) -> str:
    if isinstance(value, int | float) and value == value and abs(value) < 10:
        return fmt(float(value), 1)
    return fmt(float(value) if isinstance(value, int | float) else value, 0)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------- profiles


@contextmanager
def sqlite_inline(enabled: bool = True) -> Iterator[None]:
    """While it lasts (when ``enabled``), every embedded store's SQLite call runs inline on the
    calling (event loop's) thread, ``SqliteDatabase.run`` calling ``run_sync`` directly: cProfile
    follows one thread, so a profile then sees the calls' cost where it is spent."""
    from wowd.stores.embedded.db import SqliteDatabase

    if not enabled:
        yield
        return
    run_sync = SqliteDatabase.run_sync

    async def inline_run(self: SqliteDatabase, fn: Any) -> Any:
        return run_sync(self, fn)

    saved = SqliteDatabase.run
    SqliteDatabase.run = inline_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        SqliteDatabase.run = saved  # type: ignore[method-assign]


def profile_tables(
    profiler: Any, steps: Sequence[tuple[str, str, str]], n: int, unit: str, top: int, listed: int
) -> list[str]:
    """Markdown lines of a cProfile run over ``n`` units (``unit``: "command", "commit"): the
    cumulative time per unit of each step ``(label, file suffix, function)`` (a ``<lambda>``
    step counts its largest entry: lambdas of one file share the name), the ``top`` functions by
    own time, and the ``listed`` first lines of the cumulative listing."""
    import io
    import pstats

    stats = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    lines = ["", f"Steps (cumulative, per {unit}; the profiler's overhead included):", ""]
    lines += [f"| step | us per {unit} | calls |", "|---|---|---|"]
    for label, file, func in steps:
        hits = [(v[1], v[3]) for (f, _l, name), v in raw.items() if f.endswith(file) and name == func]
        if hits:
            calls = sum(c for c, _ in hits)
            cum = max(t for _, t in hits) if func == "<lambda>" else sum(t for _, t in hits)
            lines.append(f"| {label} | {cum / n * 1e6:,.1f} | {calls:,} |")
    total = sum(v[2] for v in raw.values())
    lines += ["", f"Top {top} functions by own time (of {total:.2f} s profiled):", ""]
    lines += [f"| function | own us per {unit} | share | calls per {unit} |", "|---|---|---|---|"]
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (f, line, name), v in ranked:
        where = f"{Path(f).parent.name}/{Path(f).name}:{line}" if line else f
        lines.append(f"| `{name}` ({where}) | {v[2] / n * 1e6:,.1f} | {v[2] / total:.0%} | {v[1] / n:,.2f} |")
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(listed)
    lines += ["", "```", buf.getvalue().strip(), "```"]
    return lines
