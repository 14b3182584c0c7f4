"""What an operator meets first: wrong paths fail naming the setting, writes are deliberate."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from tests.cli.conftest import Run, fill_outbox, refused_check
from wowd.backends import opened_backend
from wowd.cli import output
from wowd.client import SyncWowdClient
from wowd.config import load_settings
from wowd.daemon.rebuild import Rebuilder
from wowd.errors import ConfigError
from wowd.model import AggregateRef, Owner
from wowd.reducers import load_reducer


@pytest.mark.parametrize("how", ["env", "flag"])
def test_a_missing_config_file_fails_naming_the_path(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    missing = tmp_path / "missing.toml"
    if how == "env":
        monkeypatch.setenv("WOWD_CONFIG", str(missing))
        code, out, err = wowd("check")
    else:
        code, out, err = wowd("--config", str(missing), "check")
    assert code == 2 and out == ""
    assert f"config file {str(missing)!r} does not exist" in err
    assert ("WOWD_CONFIG" in err) == (how == "env")


@pytest.mark.parametrize(
    "argv",
    [
        ("status",),
        ("timers", "list"),
        ("outbox", "list"),
        ("quarantine", "list"),
        ("outbox", "ack", "r-1"),
        ("timers", "cancel", "order/o-1", "expire"),
    ],
)
def test_commands_other_than_run_and_demo_create_no_database(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: tuple[str, ...]
) -> None:
    path = tmp_path / "nowhere" / "wowd.db"
    monkeypatch.setenv("WOWD_EMBEDDED__PATH", str(path))
    code, out, err = wowd(*argv)
    assert code == 2 and out == ""
    assert err.startswith(f"wowd: WOWD_EMBEDDED__PATH: the database file {str(path)!r} does not exist")
    assert "--create" in err and "Traceback" not in err
    assert not path.parent.exists()


def test_create_creates_the_database_on_request(wowd: Run, db: Path) -> None:
    code, out, err = wowd("timers", "list", "--create")
    assert code == 0, err
    assert out.splitlines()[-1] == "0 timer(s)" and db.exists()


def test_the_client_refuses_a_database_that_does_not_exist(db: Path) -> None:
    with (
        pytest.raises(ConfigError, match=rf"WOWD_EMBEDDED__PATH: the database file '{db}' does not exist"),
        SyncWowdClient.connect(),
    ):
        pass
    assert not db.exists()
    with SyncWowdClient.connect(create=True) as client:
        client.cancel(AggregateRef(context="demo", aggregate="order", id="o-1"), "k")
    assert db.exists()


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"WOWD_MONGODB__URI": "http://x"},
            "mongodb.uri (WOWD_MONGODB__URI): must be a mongodb:// or mongodb+srv:// URI with a host, got a http://",
        ),
        ({"WOWD_MONGODB__URI": "mongodb://"}, "mongodb.uri (WOWD_MONGODB__URI): must be a mongodb://"),
        ({"WOWD_ELASTICSEARCH__URL": "notaurl"}, "elasticsearch.url (WOWD_ELASTICSEARCH__URL): must be an http://"),
    ],
)
def test_a_bad_store_url_is_a_settings_error_naming_the_variable(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], says: str
) -> None:
    monkeypatch.setenv("WOWD_BACKEND", "mongo")
    monkeypatch.setenv("WOWD_MONGODB__URI", "mongodb://db/?replicaSet=rs0")
    monkeypatch.setenv("WOWD_ELASTICSEARCH__URL", "http://es:9200")
    assert says in refused_check(wowd, monkeypatch, env)


@pytest.mark.process
def test_check_names_each_unreachable_server_by_its_setting(db: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("WOWD_")}
        env.update(
            WOWD_BACKEND="mongo",
            WOWD_MONGODB__URI=f"mongodb://wowd:pw-secret@127.0.0.1:{port}/?replicaSet=rs0",
            WOWD_MONGODB__TIMEOUT_MS="200",
            WOWD_ELASTICSEARCH__URL=f"http://127.0.0.1:{port}",
        )
        done = subprocess.run(
            [sys.executable, "-m", "wowd", "check"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr
    assert lines[0].startswith(
        f"FAIL mongodb: StorageUnavailable: WOWD_MONGODB__URI: no MongoDB server answered at 127.0.0.1:{port}: "
    )
    assert lines[1].startswith(f"FAIL elasticsearch: WOWD_ELASTICSEARCH__URL: 127.0.0.1:{port}: ")
    assert lines[2:] == ["wowd check: 2 problem(s)"]
    assert "Topology" not in done.stderr and "pw-secret" not in done.stderr


def _fill_outbox(n: int) -> None:
    fill_outbox({f"r{i}": 1_000 + i for i in range(n)})


def test_trimming_unacknowledged_entries_is_deliberate(
    wowd: Run, created: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill_outbox(3)
    code, out, err = wowd("outbox", "trim", "--older-than-s", "0")
    assert code == 1 and out == ""
    assert "wowd: 3 unacknowledged entries were created before " in err and "--include-unacked" in err
    # at a terminal, the operator is asked; anything but yes keeps the entries
    monkeypatch.setattr(output, "interactive", lambda: True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("n\n"))
    code, out, err = wowd("outbox", "trim", "--older-than-s", "0", "--include-unacked")
    assert code == 1 and "remove 3 unacknowledged entries created before " in err and "[y/N]" in err
    assert wowd("outbox", "list")[1].splitlines()[-1].startswith("3 of 3 entries")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = wowd("outbox", "trim", "--older-than-s", "0", "--include-unacked")
    assert code == 0 and out.startswith("3 unacknowledged entries created before ")
    _fill_outbox(1)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # --yes asks nothing
    code, out, err = wowd("outbox", "trim", "--older-than-s", "0", "--include-unacked", "--yes")
    assert code == 0 and out.startswith("1 unacknowledged entries") and err == ""


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (
            "WOWD_GATEWAY__CONCURENCY",
            "WOWD_GATEWAY__CONCURENCY: not a wowd setting (did you mean WOWD_GATEWAY__CONCURRENCY?)",
        ),
        (  # a misspelling of a setting's earlier name: its name now
            "WOWD_TIMERS__CONCURENCY",
            "WOWD_TIMERS__CONCURENCY: not a wowd setting (did you mean WOWD_GATEWAY__CONCURRENCY?)",
        ),
        ("WOWD_TIMRS__BATCH", "WOWD_TIMRS__BATCH: not a wowd setting (did you mean WOWD_TIMERS__BATCH?)"),
        ("WOWD_CONTEXTT", "WOWD_CONTEXTT: not a wowd setting (did you mean WOWD_CONTEXT?)"),
        # one underscore where a nested setting has two
        ("WOWD_GATEWAY_KIND", "WOWD_GATEWAY_KIND: not a wowd setting (did you mean WOWD_GATEWAY__KIND?)"),
        ("WOWD_NOTHING_LIKE_IT", "WOWD_NOTHING_LIKE_IT: not a wowd setting (misspelled?)"),
    ],
)
def test_an_unknown_setting_names_the_variable_and_a_close_match(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, key: str, says: str
) -> None:
    monkeypatch.setenv(key, "3")
    code, out, err = wowd("check")
    assert code == 2 and out == "" and says in err


def test_a_setting_under_its_earlier_name_is_read_and_the_log_names_its_new_name(
    wowd: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WOWD_TIMERS__CONCURRENCY", "7")
    assert load_settings().gateway.concurrency == 7
    monkeypatch.setenv("WOWD_GATEWAY__CONCURRENCY", "9")  # the new name wins where both are given
    assert load_settings().gateway.concurrency == 9
    monkeypatch.setenv("WOWD_LOG_FORMAT", "text")
    _code, _out, err = wowd("check")
    warned = [line for line in err.splitlines() if "TIMERS__CONCURRENCY" in line]
    assert len(warned) == 1 and "WARNING" in warned[0]
    assert warned[0].endswith(
        "timers.concurrency (WOWD_TIMERS__CONCURRENCY) is now gateway.concurrency (WOWD_GATEWAY__CONCURRENCY): "
        "the old name is read for now, rename it"
    )


@pytest.mark.process
def test_the_demo_run_tells_a_newcomer_where_to_look_in_one_format(tmp_path: Path) -> None:
    """``make run`` in a pipe: stdout is JSON lines as the log is (no progress text among JSON),
    the first says the replica is up and where to look, and no line lists partitions one by one."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("WOWD_")}
    env.update(WOWD_HTTP__PORT="0", WOWD_LOG_FORMAT="json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "wowd", "run", "--demo"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first, second = json.loads(proc.stdout.readline()), json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    msg = first["msg"]
    assert msg.startswith("wowd ") and " is up on embedded file wowd.db" in msg
    # where fired commands go, and how to read them, as this shell runs wowd (not on its PATH)
    assert "Fired commands go to the outbox (the outbox table of the file)" in msg
    runs = f"{sys.executable} -m wowd"
    assert f"`{runs} outbox list` shows them, `{runs} outbox take` takes them" in msg
    assert f"`{runs} status`" in msg and "`wowd status`" not in msg
    assert f"http://localhost:{first['port']}/ui (the status page)" in msg
    assert f"http://localhost:{first['port']}/metrics" in msg
    assert "demo: appended" in second["msg"] and {"appended", "fed", "fired"} <= set(second)
    logged = [json.loads(line) for line in err.splitlines()]
    assert not [d for d in logged if "holds partitions" in d["msg"] or "snapshots" in d["msg"]], logged


def test_an_offline_snapshot_rebuild_takes_the_slots_leases_for_its_duration(
    wowd: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No replica runs, but one did (its slots have fences): the rebuild holds each slot's lease
    while it writes under its fence, and gives it back."""
    monkeypatch.setenv("WOWD_REDUCERS", json.dumps({"order": "wowd.demo:reducer"}))
    monkeypatch.setenv("WOWD_LEASE__LIMIT", "2")
    assert wowd("demo", "--commits", "40", "--timers", "0", "--aggregates", "8")[0] == 0

    async def a_replica_came_and_went() -> None:
        s = load_settings()
        async with opened_backend(s) as backend:
            rebuilder = Rebuilder(s, backend, {"order": load_reducer("wowd.demo:reducer")})
            for key in ("replica-a", "replica-b"):
                got = await backend.leases.acquire(
                    s.lease_namespace, Owner(key=key), 2, timedelta(seconds=60), timedelta(seconds=1)
                )
                assert got.lease is not None
                await rebuilder.rebuild(s.partitions_of_slot(got.lease.slot), fence=got.lease.fence)
                assert await backend.leases.release(got.lease, last_issued=got.lease.written_at)

    anyio.run(a_replica_came_and_went)
    code, out, err = wowd("snapshots", "rebuild", "--force", "--json")
    assert code == 0, err
    docs = json.loads(out)
    assert sorted(p for d in docs for p in d["partitions"]) == list(range(8))
    assert sum(d["rewritten"] + d["unchanged"] for d in docs) == 8 and any(d["backfilled"] for d in docs)
    assert all(d["outcome"] == "rebuilt" for d in docs), docs
    code, out, _ = wowd("status", "--json")
    assert json.loads(out)["holders"] == []  # the leases were given back
    code, out, _ = wowd("snapshots", "status", "--json")
    assert json.loads(out)[0]["table"]["backfilled"] is True
