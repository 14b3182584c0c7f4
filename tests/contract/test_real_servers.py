"""The contract suites against real servers: with ``WOWD_TEST_MONGODB_URI`` or
``WOWD_TEST_ELASTICSEARCH_URL`` set, the suites also run against that server (those runs marked
``mongo`` / ``elasticsearch``), and a server that does not answer fails them, never skips them.
Checked by a pytest of its own, the variables pointing at a port nothing listens on."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REAL_SERVER_RUNS = [
    "tests/contract/test_checkpoints.py::test_checkpoint_fence_guard[mongo]",
    "tests/contract/test_leases.py::test_acquire_stamps_the_lease_on_the_store_clock[mongo]",
    "tests/contract/test_sink.py::test_writing_the_same_records_twice_leaves_one_document_each[elasticsearch]",
]


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_suites_run_against_the_servers_named_and_fail_when_they_do_not_answer() -> None:
    port = closed_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WOWD_TEST_")}
    env["WOWD_TEST_MONGODB_URI"] = f"mongodb://127.0.0.1:{port}/?serverSelectionTimeoutMS=100"
    env["WOWD_TEST_ELASTICSEARCH_URL"] = f"http://127.0.0.1:{port}"
    # the runs exist (a test id that names no collected test is a usage error, exit code 4) and
    # carry their server's mark; each fails at its setup (an error, exit code 1), none skips. A
    # client closed while its server monitor is still connecting (PyMongo's) can leave a socket
    # to the garbage collector, at a moment of its choosing: that warning is not counted here.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-n", "0",
         "-W", "ignore::pytest.PytestUnraisableExceptionWarning",
         "-m", "mongo or elasticsearch", *REAL_SERVER_RUNS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    summary = ran.stdout.strip().splitlines()[-1]
    assert ran.returncode == 1 and re.search(rf"\b{len(REAL_SERVER_RUNS)} errors?\b", summary), ran.stdout
    assert not re.search(r"passed|skipped|deselected", summary), ran.stdout
