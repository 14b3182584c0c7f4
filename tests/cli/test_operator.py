"""What an operator meets first: wrong paths fail naming the setting, writes are deliberate."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import Run


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
