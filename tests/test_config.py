"""Bad configuration is refused naming the setting, and never echoes a secret: property-based
(hypothesis) over ``load_settings``: lease bounds, partitions and slots, misspelled keys in the
environment, in TOML and in nested parts."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from wowd.config import load_settings
from wowd.errors import ConfigError

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _no_wowd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read the environment: the tests start from none of it."""
    for key in list(os.environ):
        if key.startswith("WOWD_"):
            monkeypatch.delenv(key)


def config_error(**overrides: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    return info.value


@FAST
@given(ttl=st.floats(max_value=0, allow_nan=False, allow_infinity=False))
def test_a_ttl_that_is_not_positive_names_lease_ttl_s(ttl: float) -> None:
    assert "lease.ttl_s" in str(config_error(lease={"ttl_s": ttl}))


@FAST
@given(ttl=st.floats(min_value=0.01, max_value=40_000), extra=st.floats(min_value=0, max_value=40_000))
def test_tolerance_at_or_over_ttl_names_both(ttl: float, extra: float) -> None:
    msg = str(config_error(lease={"ttl_s": ttl, "tolerance_s": ttl + extra}))
    assert "lease" in msg and "tolerance_s" in msg and "ttl_s" in msg


@FAST
@given(limit=st.integers(max_value=0))
def test_a_limit_below_one_names_lease_limit(limit: int) -> None:
    assert "lease.limit" in str(config_error(lease={"limit": limit}))


@FAST
@given(limit=st.integers(min_value=2, max_value=4096), data=st.data())
def test_fewer_partitions_than_slots_is_refused(limit: int, data: st.DataObject) -> None:
    partitions = data.draw(st.integers(min_value=1, max_value=limit - 1))
    msg = str(config_error(partitions=partitions, lease={"limit": limit}))
    assert "partitions" in msg and "lease.limit" in msg
    ok = load_settings(partitions=limit, lease={"limit": limit})
    assert ok.partitions_of_slot(limit - 1) == [limit - 1]


NESTED_KEYS = {
    "lease": ["ttl_s", "tolerance_s", "limit", "slot_offset", "namespace"],
    "timers": ["batch", "max_body_bytes", "claim_ttl_s"],
    "gateway": ["kind", "timeout_s"],
    "http": ["port"],
}


def _misspell(draw: Callable[..., Any], key: str) -> str:
    how = draw(st.sampled_from(["drop", "double", "swap"]))
    i = draw(st.integers(min_value=0, max_value=len(key) - 2))
    if how == "drop":
        out = key[:i] + key[i + 1 :]
    elif how == "double":
        out = key[:i] + key[i] + key[i:]
    else:
        out = key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    return out


@FAST
@given(data=st.data())
def test_a_misspelled_nested_key_is_an_error_naming_it(data: st.DataObject) -> None:
    part = data.draw(st.sampled_from(sorted(NESTED_KEYS)))
    key = data.draw(st.sampled_from(NESTED_KEYS[part]))
    typo = _misspell(data.draw, key)
    assume(typo != key and typo not in NESTED_KEYS[part])
    msg = str(config_error(**{part: {typo: "1"}}))
    assert f"{part}.{typo}" in msg


def test_misspelled_keys_in_the_environment_and_in_toml_are_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WOWD_LEASE__TLL_S", "3")
    assert "WOWD_LEASE__TLL_S: not a wowd setting (did you mean WOWD_LEASE__TTL_S?)" in str(config_error())
    monkeypatch.delenv("WOWD_LEASE__TLL_S")
    toml = tmp_path / "wowd.toml"
    toml.write_text('context = "demo"\npartitons = 8\n[lease]\nlimit = 2\n')
    with pytest.raises(ConfigError, match="partitons"):
        load_settings(toml)


def test_a_misspelled_top_level_environment_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WOWD_PARTITONS", "8")
    assert "WOWD_PARTITONS" in str(config_error())


secrets_ = st.text(alphabet="abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ2345", min_size=10, max_size=24)


@FAST
@given(secret=secrets_, case=st.integers(min_value=0, max_value=4))
def test_a_config_error_never_echoes_a_secret(secret: str, case: int) -> None:
    planted = f"S3cr3t{secret}"
    overrides: list[dict[str, Any]] = [
        {"mongodb": {"uri": f"mongodb://u:{planted}@h/db", "timeout_ms": -1}},
        {"gateway": {"kind": "http", "token": planted}},  # url missing
        {"gateway": {"url": "http://h", "tokn": planted}},  # misspelled secret key
        {"elasticsearch": {"url": "http://h", "password": planted, "ddl": "sometimes"}},
        {"elasticsearch": {"api_key": {"nested": planted}}},  # a secret of the wrong type
    ]
    msg = str(config_error(**overrides[case]))
    assert planted not in msg and secret not in msg
