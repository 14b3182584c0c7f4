"""A burst and a SIGKILL: ``python -m tests.chaos.burst [--runs 3]``.

Three replicas (``WOWD_LEASE__LIMIT=2``, 16 partitions, lease ttl 3 s, the default claim ttl
of 30 s) deliver over the ``http`` gateway to the harness's command target. Once both slots are
held, 20,000 timers of 5 aggregates are appended, all due at one instant; the replica that makes
the first delivery is SIGKILLed from the target's request handler. Then the harness waits
(bounded) until every timer was delivered and reports:

- lost (timers never delivered): must be 0;
- duplicates (deliveries beyond the first of a request id), the killed replica's claimed and
  unsettled timers at the kill (read from the timer store while its claims cannot move), and the
  duplicates beyond them (must be 0);
- when the dead replica's claims were delivered again, counted from the kill: the first of them
  must be within ``ttl + ttl/3 + one poll`` (the lease's failover plus the loop's idle period),
  not after the 30 s claim ttl; the last adds the time to deliver them.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from tests.chaos.harness import AGGREGATE, CONTEXT, ChaosConfig, Harness, Replica, _ref
from tests.chaos.target import Delivery
from wowd.daemon.timers import MAX_IDLE_S
from wowd.model import Commit, DomainEvent, deterministic_timer_id, request_id_for

log = logging.getLogger(__name__)

EVENTS_PER_COMMIT = 100


@dataclass
class BurstReport:
    timers: int
    ttl_s: float
    delivered: int = 0
    lost: int = 0
    deliveries: int = 0
    duplicates: int = 0
    killed: str = ""
    killed_delivered: int = 0
    """Deliveries the killed replica made (all before the kill)."""
    unsettled: int = 0
    """The killed replica's claimed and unsettled timers at the kill."""
    duplicates_beyond: int = 0
    refire_first_s: float | None = None
    refire_last_s: float | None = None
    """When the first and the last of the dead replica's claims were delivered again (from the kill):
    the first tells when the takeover made them due again, the last adds the delivery of the batch."""
    burst_s: float = 0.0
    """From the due time to the last delivery."""
    notes: list[str] = field(default_factory=list)

    @property
    def bound_s(self) -> float:
        return self.ttl_s + self.ttl_s / 3 + MAX_IDLE_S

    def violations(self) -> list[str]:
        out = list(self.notes)
        if self.lost:
            out.append(f"{self.lost} timers never delivered")
        if self.duplicates_beyond:
            out.append(f"{self.duplicates_beyond} duplicate deliveries beyond the killed replica's unsettled claims")
        if self.refire_first_s is None or self.refire_first_s > self.bound_s:
            out.append(f"the dead replica's claims were first re-fired {self.refire_first_s}s after the kill")
        return out

    def summary(self) -> str:
        first = "-" if self.refire_first_s is None else f"{self.refire_first_s:.2f}s"
        last = "-" if self.refire_last_s is None else f"{self.refire_last_s:.2f}s"
        return (
            f"{self.timers} timers: delivered {self.delivered}, lost {self.lost}; deliveries {self.deliveries}, "
            f"duplicates {self.duplicates} (beyond allowance {self.duplicates_beyond}); killed {self.killed} "
            f"after its first delivery: it delivered {self.killed_delivered}, left {self.unsettled} claimed and "
            f"unsettled; those re-fired from {first} to {last} after the kill (bound ttl + ttl/3 + poll = "
            f"{self.bound_s:.2f}s); burst delivered in {self.burst_s:.1f}s"
        )


def burst_commits(n_timers: int, aggregates: int, due: int, now: int) -> tuple[list[Commit], list[str]]:
    """Commits carrying ``n_timers`` TimerScheduled events spread over ``aggregates`` aggregates,
    all due at ``due``; answers the commits and the request ids."""
    commits: list[Commit] = []
    rids: list[str] = []
    versions: Counter[str] = Counter()
    made = 0
    while made < n_timers:
        agg_id = f"order-{len(commits) % aggregates}"
        versions[agg_id] += 1
        version = versions[agg_id]
        ref = _ref(agg_id)
        events = []
        for i in range(min(EVENTS_PER_COMMIT, n_timers - made)):
            key = f"b{version}-{i}"
            events.append(
                DomainEvent(
                    id=uuid.uuid4().hex,
                    name="TimerScheduled",
                    body={
                        "key": key,
                        "due_at": due,
                        "rule": {"type": "once"},
                        "target": {"context": CONTEXT, "aggregate": AGGREGATE, "id": agg_id},
                        "command": {"name": "expire-order", "body": {"order_id": agg_id, "key": key}},
                    },
                )
            )
            rids.append(request_id_for(deterministic_timer_id(ref, key, version), due))
        made += len(events)
        commits.append(
            Commit(
                ref=ref,
                version=version,
                command_id=uuid.uuid4().hex,
                request_id=uuid.uuid4().hex,
                create_time=now,
                events=tuple(events),
                access={"owner_id": "chaos", "space_id": "", "tags": []},
            )
        )
    return commits, rids


async def run_burst(workdir: Path, *, timers: int = 20_000, aggregates: int = 5, ttl_s: float = 3.0) -> BurstReport:
    from tests.timer_stores import embedded_timers
    from wowd.stores.embedded.log import EmbeddedLog

    config = ChaosConfig(replicas=3, limit=2, partitions=16, ttl_s=ttl_s, gateway="http", slow_share=0.0)
    h = Harness(config, workdir)
    h.env["WOWD_TIMERS__CLAIM_TTL_S"] = "30"  # the default: a re-fire within failover time is the takeover's
    rep = BurstReport(timers=timers, ttl_s=ttl_s)
    killed: list[tuple[Replica, float]] = []
    kill_done = anyio.Event()

    def first_delivery(d: Delivery) -> None:
        if killed:
            return
        r = next(r for r in h.replicas.values() if r.tag == d.tag)
        r.expected_exit = True
        r.proc.kill()  # right after its first delivery, from the target's handler
        killed.append((r, time.monotonic()))
        kill_done.set()

    h.target.on_delivery = first_delivery
    log_store = EmbeddedLog(h.db, context=CONTEXT, partitions=config.partitions)
    await log_store.prepare()
    h._timers = embedded_timers(h.db, context=CONTEXT, partitions=config.partitions)
    await h._timers.prepare()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(h.target.serve)
            for i in range(config.replicas):
                await h.start(f"r{i}")
            with anyio.fail_after(60):
                while True:  # both slots held: polled, each replica's /readyz
                    if sum([await h.is_ready(r) for r in h.live()]) >= config.limit:
                        break
                    await anyio.sleep(0.1)
            now = int(time.time() * 1000)
            commits, rids = burst_commits(timers, aggregates, now + 8_000, now)
            await log_store.append_many(commits)
            due_mono = time.monotonic() + (now + 8_000 - time.time() * 1000) / 1000
            with anyio.fail_after(180):
                await kill_done.wait()
                victim, kill_at = killed[0]
                await h.kill(victim)
                await h.mark("kill", victim)
                while not set(rids) <= set(h.target.by_request):
                    h.check_crashes()
                    await anyio.sleep(0.1)
            for r in h.live():
                await h.terminate(r)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for r in h.replicas.values():
                if r.alive:
                    r.proc.kill()
                    await r.proc.wait()
                r.out.close()
                await r.proc.aclose()
            await log_store.close()
            await h._timers.close()
    by = h.target.by_request
    unsettled = h.marks[0].unsettled
    r = victim  # the replica killed (not a loop variable above)
    rep.killed = r.tag
    rep.delivered = len(set(rids) & set(by))
    rep.lost = timers - rep.delivered
    rep.deliveries = len(h.target.deliveries)
    rep.duplicates = rep.deliveries - len(by)
    rep.killed_delivered = sum(1 for d in h.target.deliveries if d.tag == r.tag)
    rep.unsettled = len(unsettled)
    for rid, ds in by.items():
        per_tag = Counter(d.tag for d in ds)
        extra = len(ds) - 1
        rep.duplicates_beyond += max(extra - (rid in unsettled), sum(c - 1 for c in per_tag.values()))
    refires = [
        min(d.at for d in ds) - kill_at
        for ds in ([d for d in by.get(rid, []) if d.tag != r.tag] for rid in unsettled)
        if ds
    ]
    if refires:
        rep.refire_first_s, rep.refire_last_s = min(refires), max(refires)
    rep.burst_s = max(d.at for d in h.target.deliveries) - due_mono
    with (workdir / "deliveries.csv").open("w") as f:
        f.write("at_s,tag,target,request_id\n")
        f.writelines(f"{d.at - kill_at:.4f},{d.tag},{d.target_id},{d.request_id}\n" for d in h.target.deliveries)
    rep.notes += h.report.crashes + h.report.unclean_exits + h.target.refused
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.burst", description=__doc__)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timers", type=int, default=20_000)
    p.add_argument("--workdir", type=Path, help="where the SQLite files and logs go (default: a temp dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="wowd-burst-"))
    failed = False
    for n in range(args.runs):
        workdir = base / f"run{n + 1}"
        workdir.mkdir(parents=True, exist_ok=True)
        rep = anyio.run(functools.partial(run_burst, workdir, timers=args.timers))
        sys.stdout.write(f"run {n + 1}: {rep.summary()}\n")
        for v in rep.violations():
            failed = True
            sys.stdout.write(f"VIOLATION: {v}\n")
    sys.stdout.write(f"logs and databases in {base}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
