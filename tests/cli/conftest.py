"""The command line in-process (``main(argv)`` with captured output) on a fresh SQLite file."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from wowd.cli import main
from wowd.backends import opened_backend
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
