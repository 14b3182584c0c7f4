"""The command line in-process (``main(argv)`` with captured output) on a fresh SQLite file."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from tests.factories import outbox_entry
from wowd.backends import opened_backend
from wowd.cli import main
from wowd.config import load_settings

CONTEXT = "demo"
PARTITIONS = 8


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A clean ``WOWD_*`` environment naming a database in ``tmp_path``."""
    for key in list(os.environ):
        if key.upper().startswith("WOWD_"):
            monkeypatch.delenv(key)
    path = tmp_path / "wowd.db"
    monkeypatch.setenv("WOWD_EMBEDDED__PATH", str(path))
    monkeypatch.setenv("WOWD_CONTEXT", CONTEXT)
    monkeypatch.setenv("WOWD_PARTITIONS", str(PARTITIONS))
    monkeypatch.setenv("WOWD_LOG_FORMAT", "text")
    yield path


@pytest.fixture
def created(db: Path) -> Path:
    """The database of ``db``, created as ``wowd run`` creates it (the other commands and the
    client open an existing file only)."""

    async def create() -> None:
        async with opened_backend(load_settings()):
            pass

    anyio.run(create)
    return db


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def wowd(capsys: pytest.CaptureFixture[str], db: Path) -> Run:
    """``wowd ARGS`` in-process: (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals and --version
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture
def http_endpoint() -> Iterator[str]:
    """A local HTTP server (it answers HEAD with 501: an answer all the same)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # shut down within 50 ms
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/commands"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def fill_outbox(created_at: dict[str, int]) -> None:
    """Puts an outbox entry per request id, created at the time given (of ``demo.order`` o-1)."""

    async def fill() -> None:
        async with opened_backend(load_settings()) as backend:
            for request_id, created in created_at.items():
                assert await backend.outbox.put(outbox_entry(request_id, created))

    anyio.run(fill)


def refused_check(wowd: Run, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    """``wowd check`` with ``env`` set, refused at start (exit 2, nothing on stdout, no
    traceback); answers what it said on stderr."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = wowd("check")
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    return err
