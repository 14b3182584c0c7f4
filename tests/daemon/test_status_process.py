"""``wowd status`` lists every replica, standbys included, from their presence records: two
``wowd run`` processes on one SQLite file with one slot, then a graceful stop and a kill."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.inprocess import wowd_in_process
from tests.factories import CONTEXT, eventually
from tests.processes import Replica, base_env
from wowd.stores.base import Backend

pytestmark = [pytest.mark.anyio, pytest.mark.process]

NS = f"wowd.{CONTEXT}"


async def states(stores: Backend) -> dict[str, str]:
    """Owner key -> ``holding``, ``standby`` or ``gone``, as the presence records say."""
    return {r.owner_key: (r.state if r.live else "gone") for r in await stores.leases.replicas(NS)}


async def test_status_shows_the_standby_and_forgets_it_once_it_left(
    spawn: Callable[..., Replica], db: Path, tmp_path: Path, stores: Backend
) -> None:
    env = base_env(db, WOWD_LEASE__LIMIT="1", WOWD_LEASE__TTL_S="1", WOWD_LEASE__TOLERANCE_S="0.25")
    a = spawn("a", env)
    await a.wait_ready()
    b = spawn("b", env)
    await b.wait_port()

    async def both() -> bool:
        return await states(stores) == {"a": "holding", "b": "standby"}

    await eventually(both, 15, "a holding and b standing by in the presence records")

    rc, out, err = await wowd_in_process("status", env=env, cwd=tmp_path)
    assert rc == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("replica "))
    assert lines[header].split() == ["replica", "state", "slots", "last", "seen", "up", "version", "host/pid"]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 3]}
    assert rows["a"][1:3] == ["holding", "0"] and rows["b"][1:3] == ["standby", "-"]
    assert rows["b"][-1].endswith(f"/{b.proc.pid}") and rows["a"][-1].endswith(f"/{a.proc.pid}")
    assert "replicas holding a slot: 1 (a)" in lines and "standbys: 1 (b)" in lines

    rc, out, err = await wowd_in_process("status", "--json", env=env, cwd=tmp_path)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["holders"] == ["a"] and doc["standbys"] == ["b"]
    by_key = {r["owner_key"]: r for r in doc["replicas"]}
    assert (by_key["b"]["state"], by_key["b"]["slots"], by_key["b"]["pid"]) == ("standby", [], b.proc.pid)
    assert (by_key["a"]["state"], by_key["a"]["slots"]) == ("holding", [0])
    assert 0 <= by_key["b"]["seen_ms_ago"] < 1000  # heartbeats every ttl/3 (the ttl is 1 s)

    b.signal(signal.SIGTERM)
    assert await b.wait_exit(10) == 0
    assert await states(stores) == {"a": "holding"}  # left on its way out

    a.signal(signal.SIGKILL)
    await a.wait_exit(5)

    async def a_gone() -> bool:
        # its presence record and its lease expire about together (both renewed every ttl/3)
        leases_live = any(st.live for st in await stores.leases.slots(NS))
        return await states(stores) == {"a": "gone"} and not leases_live

    await eventually(a_gone, 10, "a's record and lease expired (killed: it could not leave)")
    rc, out, err = await wowd_in_process("status", "--json", env=env, cwd=tmp_path)
    assert rc == 0, err
    doc = json.loads(out)
    assert [(r["owner_key"], r["state"]) for r in doc["replicas"]] == [("a", "gone")]
    assert doc["holders"] == [] and doc["standbys"] == []
