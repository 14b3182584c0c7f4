"""What an operator meets first: wrong paths fail naming the setting, writes are deliberate."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import Run
from wowd.client import SyncWowdClient
from wowd.errors import ConfigError
from wowd.model import AggregateRef


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
