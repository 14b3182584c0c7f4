"""A ``wowd run`` process against what anyone on the network, or a commit, can do to it: a flood of
connections under a low descriptor limit, many aggregate types, anonymous reads of command
bodies and requests naming another host; and settings that would open it to anyone. One replica
serves the module (each test leaves it serving)."""

from __future__ import annotations

import os
import resource
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from tests.factories import CONTEXT, PARTITIONS, commit, eventually, ref, scheduled
from tests.processes import Replica, base_env, run_wowd
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.model import Commit
from wowd.stores.embedded import open_embedded

pytestmark = [pytest.mark.anyio, pytest.mark.process]

TOKEN = "ui-token-of-the-hostile-tests"
CARD = "4111 1111 1111 1111"
TIMER = "/api/v1/timer?owner=order/o-1&key=pay"


async def _append(db: Path, commits: list[Commit]) -> None:
    settings = WowdSettings(
        context=CONTEXT, partitions=PARTITIONS, embedded=EmbeddedSettings(path=db), lease=LeaseSettings(limit=1)
    )
    backend = await open_embedded(settings)
    try:
        for c in commits:
            await backend.log.append(c)
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Path]]:
    """A replica (the status page's token set) on a file holding a timer whose command carries a
    card number, due in a day."""
    tmp = tmp_path_factory.mktemp("hostile")
    db = tmp / "wowd.db"
    pay = scheduled("pay", int(time.time() * 1000) + 86_400_000, body={"card": CARD})
    anyio.run(_append, db, [commit("o-1", 1, pay)])
    r = Replica(tmp, "a", base_env(db, WOWD_UI__TOKEN=TOKEN, WOWD_LEASE__LIMIT="1"))
    try:
        anyio.run(r.wait_ready)
        yield r, db
    finally:
        r.close()


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def test_an_anonymous_reader_gets_no_command_body_and_another_host_nothing(
    replica: tuple[Replica, Path],
) -> None:
    r, _db = replica

    async def fed() -> bool:
        return (await r.get(TIMER)).status_code == 200

    await eventually(fed, 15, "the timer in the view")
    anonymous = await r.get(TIMER)
    assert CARD not in anonymous.text and anonymous.json()["command"]["body_hidden"] is True
    page = await r.get("/ui/timer?owner=order/o-1&key=pay")
    assert page.status_code == 200 and CARD not in page.text
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{r.port}", timeout=5) as client:
        signed_in = await client.get(TIMER, headers={"authorization": f"Bearer {TOKEN}"})
        assert signed_in.status_code == 200 and signed_in.json()["command"]["body"]["card"] == CARD
        # a page of another site whose name was made to point here (DNS rebinding)
        for path in (TIMER, "/ui/timer?owner=order/o-1&key=pay", "/metrics"):
            rebound = await client.get(path, headers={"host": f"rebind.attacker.example:{r.port}"})
            assert rebound.status_code == 400 and CARD not in rebound.text
        assert (await client.get("/metrics", headers={"host": f"127.0.0.1:{r.port}"})).status_code == 200
        assert (await client.get("/healthz", headers={"host": f"localhost:{r.port}"})).status_code == 200


async def test_a_connection_flood_under_a_low_descriptor_limit_leaves_the_replica_serving(
    replica: tuple[Replica, Path],
) -> None:
    """Idle connections beyond what the descriptor limit leaves (the shipped unit had 1,024):
    ``accept`` fails with EMFILE, which ended the process; now it is logged, the oldest idle
    connection closed, and the replica keeps serving and holding its slot."""
    r, _db = replica
    pid = r.proc.pid
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    limit = _descriptors(pid) + 24
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
    flood: list[socket.socket] = []
    try:
        for _ in range(200):
            flood.append(socket.create_connection(("127.0.0.1", r.port or 0), timeout=5))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{r.port}", timeout=5) as client:

            async def answered() -> bool:
                try:
                    return (await client.get("/readyz?holding=1")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(answered, 15, "a probe answered during the flood")
        assert r.proc.poll() is None
        assert "http: accept failed (Too many open files)" in r.log()
    finally:
        for s in flood:
            s.close()
        try:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, before)
        except (PermissionError, ValueError):  # raising a hard limit back needs the privilege
            pass
    assert (await r.get("/healthz")).status_code == 200 and r.proc.poll() is None


async def test_many_aggregate_types_cost_no_descriptor_and_no_thread_each(replica: tuple[Replica, Path]) -> None:
    """Commits of 150 aggregate types fed into the event index: the replica holds no more
    descriptors or threads than before (each type kept a connection, a thread and two
    descriptors; 600 types under 1,024 descriptors stalled the feed, then crashed the replica)."""
    r, db = replica
    pid = r.proc.pid
    assert (await r.get("/healthz")).status_code == 200
    descriptors, threads = _descriptors(pid), _threads(pid)
    await _append(db, [commit(owner=ref(f"a-{i}", aggregate=f"type-{i}")) for i in range(150)])

    async def indexed() -> bool:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            (n,) = conn.execute("SELECT count(*) FROM events WHERE aggregate LIKE 'type-%'").fetchone()
        return int(n) == 150

    await eventually(indexed, 30, "the 150 commits in the event index")
    assert _threads(pid) <= threads and _descriptors(pid) <= descriptors + 2  # a probe's connection
    assert r.proc.poll() is None


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        # WOWD_UI__TOKEN=${UI_TOKEN} with UI_TOKEN unset opened every action to anyone (and the
        # page said "actions enabled")
        ({"WOWD_UI__TOKEN": ""}, "ui.token (WOWD_UI__TOKEN): is empty"),
        ({"WOWD_UI__TOKEN": "short"}, "ui.token (WOWD_UI__TOKEN): is 5 characters"),
        # these crashed with a traceback
        ({"WOWD_HTTP__HOST": "no-such-host.invalid"}, "WOWD_HTTP__HOST: cannot listen on 'no-such-host.invalid'"),
        ({"WOWD_EMBEDDED__PATH": "/proc/no-such-pid/wowd.db"}, "(WOWD_EMBEDDED__PATH)"),
    ],
    ids=["empty token", "short token", "unknown host", "uncreatable directory"],
)
async def test_settings_that_would_open_or_crash_the_replica_stop_it_at_start(
    tmp_path: Path, setting: dict[str, str], says: str
) -> None:
    db = tmp_path / "wowd.db"
    code, _out, err = await run_wowd("run", env={**base_env(db), **setting})
    assert code == 2 and says in err and "Traceback" not in err, err
    if "WOWD_UI__TOKEN" in setting:
        assert not db.exists()  # refused before anything is opened
