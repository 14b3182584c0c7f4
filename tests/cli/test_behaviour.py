"""The command line in a terminal and a pipe: exit codes, one-line errors, no stray files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from tests.cli.conftest import Run, fill_outbox, refused_check
from tests.factories import ref, timer
from wowd import __version__
from wowd.backends import opened_backend
from wowd.config import load_settings
from wowd.model import Owner
from wowd.stores.base import ReplicaInfo


def test_version(wowd: Run) -> None:
    assert wowd("--version")[:2] == (0, f"wowd {__version__}\n")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WOWD_REDUCERS": "order=x"}, "WOWD_REDUCERS: not JSON"),
        ({"WOWD_REDUCERS": '{"order": "x"}'}, "'x' is not an import path module:attribute"),
        ({"WOWD_GATEWAY__URL": "notaurl"}, "gateway.url (WOWD_GATEWAY__URL): must be an http:// or https:// URL"),
        (
            {"WOWD_GATEWAY__URL": "ftp://files.example/x"},
            "gateway.url (WOWD_GATEWAY__URL): must be an http:// or https://",
        ),
        ({"WOWD_LOG_LEVEL": "verbose"}, "'verbose' is not a log level"),
        # an environment passing WOWD_UI__TOKEN=${UI_TOKEN} with UI_TOKEN unset: actions open to anyone
        ({"WOWD_UI__TOKEN": ""}, "ui.token (WOWD_UI__TOKEN): is empty"),
        ({"WOWD_UI__TOKEN": "x"}, "ui.token (WOWD_UI__TOKEN): is 1 characters: a token of at least 16"),
        ({"WOWD_UI__TOKEN": "fifteen-chars-1"}, "ui.token (WOWD_UI__TOKEN): is 15 characters"),
        (
            {"WOWD_GATEWAY__URL": "https://svc:pw-in-url@orders.internal/api", "WOWD_GATEWAY__TOKEN": "t0k3n"},
            "gateway (WOWD_GATEWAY): url holds credentials (user:password@) and token is set",
        ),
        (
            {
                "WOWD_GATEWAY__ROUTES": json.dumps(
                    [{"match": "demo", "url": "https://u:pw-in-url@o.in", "token": "t0k3n"}]
                )
            },
            "gateway.routes.0 (WOWD_GATEWAY__ROUTES): url holds credentials (user:password@) and token is set",
        ),
        ({"WOWD_TIMERS__MIN_INTERVAL_MS": "0"}, "timers.min_interval_ms (WOWD_TIMERS__MIN_INTERVAL_MS)"),
        # values that crashed a command with a traceback further on
        ({"WOWD_LEASE__TTL_S": "1e300"}, "lease.ttl_s (WOWD_LEASE__TTL_S): Input should be less than or equal to"),
        ({"WOWD_LEASE__TTL_S": "inf"}, "lease.ttl_s (WOWD_LEASE__TTL_S): Input should be a finite number"),
        ({"WOWD_SHUTDOWN__GRACE_S": "nan"}, "shutdown.grace_s (WOWD_SHUTDOWN__GRACE_S): Input should be a finite"),
        (
            {"WOWD_BACKEND": "mongo", "WOWD_SINK": "none", "WOWD_MONGODB__URI": "mongodb://u:pw-in-url@h:99999/"},
            "mongodb.uri (WOWD_MONGODB__URI): host 'h:99999' of the URI: the port must be a number from 1 to 65535",
        ),
        (
            {"WOWD_BACKEND": "mongo", "WOWD_SINK": "none", "WOWD_MONGODB__URI": "mongodb://[::1/"},
            "mongodb.uri (WOWD_MONGODB__URI): host '[::1' of the URI: an IPv6 address is written [address]",
        ),
        ({"WOWD_HTTP__ALLOWED_HOSTS": '["https://wowd.internal:9180"]'}, "is not a host name, a .domain or *"),
    ],
)
def test_bad_settings_are_refused_at_start_with_one_clean_message(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], says: str
) -> None:
    err = refused_check(wowd, monkeypatch, env)
    assert says in err
    assert "t0k3n" not in err and "pw-in-url" not in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("timers", "list", "--limit", "9" * 30), "--limit: must be <= 2147483647"),
        (("outbox", "list", "--limit", "9" * 30), "--limit: must be <= 2147483647"),
        (("timers", "schedule", "order/o-1", "k", "--command", "x", "--in", "nan"), "--in: a number of seconds"),
        (("timers", "schedule", "order/o-1", "k", "--command", "x", "--in", "1e308"), "--in: a number of seconds"),
        (("timers", "list", "--after", "\u00b2:x"), "not a cursor of 'timers list'"),
        (("timers", "list", "--after", "9" * 30 + ":x"), "not a cursor of 'timers list'"),
        (("backup", "copy.db", "--step-pages", "9" * 30), "--step-pages: must be <= 2147483647"),
    ],
)
def test_values_out_of_range_are_refused_with_one_clean_message(
    wowd: Run, created: Path, args: tuple[str, ...], says: str
) -> None:
    code, _out, err = wowd(*args)
    assert code == 2 and says in err and "Traceback" not in err, err


def test_a_toml_file_that_is_not_toml_is_one_clean_message(wowd: Run, tmp_path: Path) -> None:
    bad = tmp_path / "wowd.toml"
    bad.write_text('context = "demo\n')
    code, _, err = wowd("status", "--config", str(bad))
    assert code == 2 and err.startswith(f"wowd: config file '{bad}': not TOML: ") and "Traceback" not in err


def test_a_text_log_line_stays_one_line_whatever_an_id_or_an_answer_holds() -> None:
    """An aggregate id or a target's answer with a line break and terminal escapes: the text
    line escapes them (no forged line, no cursor moved), its traceback keeps its lines, and a
    JSON line is JSON as before."""
    import logging

    from wowd.cli.logs import LogFormatter

    hostile = "o-1\n2026-01-01 00:00:00,000 INFO wowd: forged\x1b[2J\u2028"
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("wowd.x", logging.WARNING, __file__, 1, "retry of %s", (hostile,), sys.exc_info())
    record.target = "a\rb"
    text = LogFormatter(False, []).format(record)
    first, *trace = text.splitlines()
    assert first.endswith("retry of o-1\\n2026-01-01 00:00:00,000 INFO wowd: forged\\x1b[2J\\u2028"), first
    assert trace[0] == "Traceback (most recent call last):" and trace[-1] == "ValueError: boom [target=a\\rb]"
    assert "\x1b" not in text and "\r" not in text
    line = LogFormatter(True, []).format(record)
    assert "\n" not in line and json.loads(line)["msg"] == f"retry of {hostile}"


def test_wowd_run_raises_its_descriptor_limit_within_the_hard_limit() -> None:
    """Started with the 1,024 descriptors systemd and container runtimes give, a replica asks
    for what its hard limit allows (up to 65,536): 1,100 idle connections no longer reach it."""
    import resource

    from wowd.cli.run import NOFILE_WANTED, raise_descriptor_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard // 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        raise_descriptor_limit()
        wanted = NOFILE_WANTED if hard == resource.RLIM_INFINITY else min(NOFILE_WANTED, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_log_level_is_taken_in_any_case(wowd: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WOWD_LOG_LEVEL", "debug")
    assert load_settings().log_level == "DEBUG"


def test_check_creates_no_database_and_says_so(wowd: Run, db: Path) -> None:
    code, out, err = wowd("check")
    assert code == 0, err
    assert f"embedded: {db} does not exist yet (not created by check" in out
    assert not db.exists() and not list(db.parent.glob("wowd.db*"))


def test_check_fails_for_a_database_in_a_missing_directory(
    wowd: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WOWD_EMBEDDED__PATH", str(tmp_path / "nowhere" / "wowd.db"))
    code, _, err = wowd("check")
    assert code == 1 and "does not exist and its directory" in err and not (tmp_path / "nowhere").exists()


def test_check_probes_the_http_gateway(wowd: Run, monkeypatch: pytest.MonkeyPatch, http_endpoint: str) -> None:
    monkeypatch.setenv("WOWD_GATEWAY__KIND", "http")
    monkeypatch.setenv("WOWD_GATEWAY__URL", http_endpoint)
    code, out, err = wowd("check")
    assert code == 0, err
    assert f"ok   gateway {http_endpoint} (HEAD answered 501)" in out
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("WOWD_GATEWAY__URL", f"http://127.0.0.1:{closed}/")
    code, out, err = wowd("check")
    assert code == 1 and f"FAIL gateway: gateway http://127.0.0.1:{closed}/: transport error" in err
    # credentials in the URL are never printed, answered or not
    user_info = http_endpoint.replace("http://", "http://svc:pw-in-url@")
    monkeypatch.setenv("WOWD_GATEWAY__URL", user_info)
    code, out, err = wowd("check")
    assert code == 0 and f"ok   gateway {http_endpoint} (HEAD answered 501)" in out, out + err
    monkeypatch.setenv("WOWD_GATEWAY__URL", f"http://svc:pw-in-url@127.0.0.1:{closed}/")
    code, out, err = wowd("check")
    assert code == 1 and f"FAIL gateway: gateway http://127.0.0.1:{closed}/: transport error" in err
    assert "pw-in-url" not in out + err and "svc:" not in out + err


def test_status_lists_holders_and_standbys(wowd: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WOWD_LEASE__LIMIT", "2")

    async def hold() -> None:
        s = load_settings()
        async with opened_backend(s) as backend:
            got = await backend.leases.acquire(
                s.lease_namespace, Owner(key="replica-a"), 2, timedelta(seconds=60), timedelta(seconds=1)
            )
            assert got.acquired
            for key, slots in (("replica-a", (0,)), ("replica-c", ())):
                info = ReplicaInfo(instance=key, host="node-1", pid=41, version="9.9.9", slots=slots)
                await backend.leases.heartbeat(s.lease_namespace, key, info, timedelta(seconds=60))

    anyio.run(hold)
    code, out, _ = wowd("status")
    lines = out.splitlines()
    assert code == 0 and lines[1].split() == [
        "slot",
        "fence",
        "live",
        "expires",
        "(store",
        "time)",
        "partitions",
        "due",
        "now",
        "holder",
    ]
    assert "replicas holding a slot: 1 (replica-a)" in lines
    at = lines.index("replicas holding a slot: 1 (replica-a)")
    assert lines[at + 1].split() == ["replica", "state", "slots", "last", "seen", "up", "version", "host/pid"]
    a, c = (line.split() for line in lines[at + 2 : at + 4])
    assert a[:3] == ["replica-a", "holding", "0"] and a[-2:] == ["9.9.9", "node-1/41"]
    assert c[:3] == ["replica-c", "standby", "-"] and c[4:6] == ["s", "ago"]
    assert lines[at + 4] == "standbys: 1 (replica-c)"
    assert lines[-5:] == [
        "partitions without a live holder: 1,3..7 (4 partitions)",
        "view timers: current",  # nothing fed yet: nothing behind
        "view index: current",
        "quarantined commits: 0",
        "outbox: 0 entries",
    ]
    code, out, _ = wowd("status", "--json")
    doc = json.loads(out)
    assert [(v["view"], v["partitions_behind"]) for v in doc["views"]] == [("timers", []), ("index", [])]
    assert doc["holders"] == ["replica-a"] and doc["standbys"] == ["replica-c"]
    assert [(r["owner_key"], r["state"], r["slots"], r["host"], r["pid"]) for r in doc["replicas"]] == [
        ("replica-a", "holding", [0], "node-1", 41),
        ("replica-c", "standby", [], "node-1", 41),
    ]


def test_status_says_when_no_replica_is_recorded(wowd: Run, created: Path) -> None:
    code, out, _ = wowd("status")
    assert code == 0 and "replicas: no presence record (no replica is running)" in out.splitlines()
    assert "standbys: 0" in out.splitlines()


def test_status_counts_the_due_backlog_the_quarantine_and_the_outbox(wowd: Run) -> None:
    fill_outbox({"r1": 1_000, "r2": 2_000})

    async def fill() -> None:
        from wowd.model import AggregateType

        s = load_settings()
        async with opened_backend(s) as backend:
            assert await backend.timers.put(
                timer("o-1", 1_000, owner=ref("o-1", context=s.context), partitions=s.partitions)
            )
            order = AggregateType(context=s.context, aggregate="order")
            await backend.quarantine.put("wowd", 0, order, {"aggregate_id": "o-2"}, "version: is missing")

    anyio.run(fill)
    code, out, _ = wowd("status", "--json")
    doc = json.loads(out)
    assert code == 0 and [r["due_backlog"] for r in doc["slots"]] == [1]
    assert doc["quarantined"] == 1
    assert doc["outbox"]["depth"] == 2 and doc["outbox"]["oldest"]["request_id"] == "r1"
    assert doc["outbox"]["oldest"]["created_at"] == 1_000
    code, out, _ = wowd("status")
    lines = out.splitlines()
    assert lines[-2] == "quarantined commits: 1"
    assert lines[-1].startswith("outbox: 2 entries, oldest created 1970-01-01T00:00:01.000+00:00 (")


def test_outbox_list_looks_take_takes_ack_and_trim(wowd: Run) -> None:
    """``list`` takes nothing: two lists show the same entries and a consumer's take after them
    gets every one; ``take`` holds what it took from the next take; ``ack`` of an id the outbox
    does not hold says so and exits 1."""
    fill_outbox({"r1": 1_000, "r2": 2_000, "r3": 4_102_444_800_000})
    code, out, _ = wowd("outbox", "list", "--limit", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["request_id", "created", "target", "command"]
    assert [line.split()[0] for line in lines[1:3]] == ["r1", "r2"]
    assert lines[-1] == "2 of 3 entries shown (none taken); next: --offset 2"
    assert wowd("outbox", "list", "--limit", "2")[1] == out  # the same again: nothing was taken
    listed = json.loads(wowd("outbox", "list", "--offset", "2", "--json")[1])
    assert [e["request_id"] for e in listed["entries"]] == ["r3"] and listed["next"] is None and listed["depth"] == 3
    code, out, _ = wowd("outbox", "take", "--limit", "2")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:3]] == ["r1", "r2"]
    assert out.splitlines()[-1] == "2 of 3 entries taken for 60 s: acknowledge them within it (outbox ack)"
    code, out, _ = wowd("outbox", "take")  # r1 and r2 are held by the first take
    assert [line.split()[0] for line in out.splitlines()[1:-1]] == ["r3"]
    code, out, err = wowd("outbox", "ack", "r1", "r9")
    assert (code, out) == (1, "1 of 2 entries acknowledged (removed)\n")
    assert "wowd: 1 of the request ids named no entry of the outbox" in err
    assert wowd("outbox", "ack", "r2")[:2] == (0, "1 of 1 entries acknowledged (removed)\n")
    code, out, _ = wowd("outbox", "trim", "--older-than-s", "0", "--include-unacked")
    assert code == 0 and out.startswith("0 entries created before ")  # r3 is from the future
    code, _, err = wowd("outbox", "take", "--lease-s", "0")
    assert code == 1 and "lease" in err


# --------------------------------------------------------------------------- as processes


def _env(db: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("WOWD_")}
    env.update({"WOWD_EMBEDDED__PATH": str(db), "WOWD_PARTITIONS": "8", "WOWD_LOG_FORMAT": "json", **extra})
    return env


def test_a_closed_pipe_ends_the_listing_quietly(wowd: Run, db: Path) -> None:
    assert wowd("demo", "--commits", "100", "--timers", "2000", "--aggregates", "10")[0] == 0

    async def feed() -> None:
        from wowd.model import TimerScheduled, TimerWrite, timer_event_from, timer_from_event

        async with opened_backend(load_settings()) as backend:
            async for batch in backend.log.read(dict.fromkeys(range(8)), follow=False):
                puts = []
                for entry in batch.entries:
                    assert entry.commit is not None
                    for ev in entry.commit.events:
                        te = timer_event_from(ev)
                        if isinstance(te, TimerScheduled):
                            puts.append(TimerWrite.put(timer_from_event(entry.commit, te, 8)))
                assert all(await backend.timers.write(puts))  # a write per batch of the log

    anyio.run(feed)
    proc = subprocess.Popen(
        [sys.executable, "-m", "wowd", "timers", "list", "--limit", "2000"],
        env=_env(db),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"timer_id")  # what `head -1` reads
    proc.stdout.close()  # ... and then `head` exits
    code = proc.wait(60)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert (code, err) == (0, "")


def test_a_port_in_use_is_one_line_naming_the_setting(db: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "wowd", "run"],
            env=_env(db, WOWD_HTTP__HOST="127.0.0.1", WOWD_HTTP__PORT=str(port), WOWD_LOG_LEVEL="ERROR"),
            capture_output=True,
            timeout=60,
            check=False,
        )
    err = out.stderr.decode().strip()
    assert out.returncode == 2
    assert err == (
        f"wowd: HTTP port {port} on 127.0.0.1 is in use (choose another with WOWD_HTTP__PORT, 0 for any free port)"
    )
    assert not db.exists(), "nothing was started: no database file created"
