"""Decimals through BSON as the MongoDB snapshot store writes and reads them (no server needed).

A ``Decimal`` is stored as ``Decimal128`` and read back unchanged: its digits, its scale (trailing
zeros), its sign; a float is never involved. A state BSON cannot hold is a ``failed`` outcome of
``save_all`` (nothing is sent), not a crash.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import bson
import pytest
from bson.codec_options import DEFAULT_CODEC_OPTIONS
from bson.decimal128 import Decimal128
from hypothesis import given
from hypothesis import strategies as st
from pymongo import AsyncMongoClient

from wowd.errors import InvalidInput
from wowd.model import AggregateRef, AggregateType, SnapshotRecord
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import MongoSharding
from wowd.stores.mongo.snapshots import CODEC_OPTIONS, MongoSnapshotStore, record_from_doc, snapshot_pipeline

TYPE = AggregateType(context="ctx", aggregate="order")
EXACT = [
    "1.00",  # scale kept: not 1, not 1.0
    "0.10",
    "-12.3400",
    "-0",
    "-0.000",
    "1234567890123456789012345678901234",  # 34 digits: Decimal128's precision
    "-9.999999999999999999999999999999999E+6144",  # the largest magnitude, negative
    "1E-6176",  # the smallest exponent
    "0E+10",
    "123456789012345678.9012345678901234",
]


def round_trip(value: Any) -> Any:
    return bson.decode(bson.encode({"v": value}, codec_options=CODEC_OPTIONS), codec_options=CODEC_OPTIONS)["v"]


@pytest.mark.parametrize("text", EXACT)
def test_a_decimal_round_trips_unchanged(text: str) -> None:
    value = Decimal(text)
    back = round_trip(value)
    assert type(back) is Decimal
    assert back.as_tuple() == value.as_tuple()  # digits, exponent (scale) and sign
    assert str(back) == str(value)


def test_a_decimal_is_stored_as_decimal128_never_a_float() -> None:
    raw = bson.decode(
        bson.encode({"state": {"price": Decimal("19.90"), "lines": [Decimal("-0.5")]}}, codec_options=CODEC_OPTIONS),
        codec_options=DEFAULT_CODEC_OPTIONS,
    )
    assert raw["state"]["price"] == Decimal128("19.90")
    assert raw["state"]["lines"] == [Decimal128("-0.5")]


def test_nested_decimals_come_back_in_place() -> None:
    state = {"a": {"b": [Decimal("1.10"), {"c": Decimal("-2.000")}]}, "n": 3, "f": 0.5}
    assert round_trip(state) == state
    assert str(round_trip(state)["a"]["b"][1]["c"]) == "-2.000"


@given(
    st.decimals(allow_nan=False, allow_infinity=False, places=None).filter(
        lambda d: len(d.as_tuple().digits) <= 34 and -6176 <= int(d.as_tuple().exponent) <= 6111
    )
)
def test_any_decimal_of_34_digits_round_trips(value: Decimal) -> None:
    assert round_trip(value).as_tuple() == value.as_tuple()


def test_a_snapshot_document_reads_back_with_exact_decimals() -> None:
    record = SnapshotRecord(
        ref=AggregateRef(context="ctx", aggregate="order", id="o-1"),
        version=2,
        state_revision=1,
        state={"total": Decimal("100.00"), "tax": Decimal("-0.015")},
    )
    # what the pipeline stores, as the server would store it, read back through the codec
    stored = {k: v["$literal"] for k, v in snapshot_pipeline(record)[0]["$replaceWith"].items() if "$literal" in v}
    decoded = bson.decode(bson.encode(stored, codec_options=CODEC_OPTIONS), codec_options=CODEC_OPTIONS)
    assert record_from_doc(TYPE, decoded) == record


@pytest.mark.parametrize(
    "value",
    [
        Decimal("1" * 35),  # 35 significant digits: would need rounding
        Decimal("1E+6145"),  # exponent beyond Decimal128 without clamping digits
        Decimal("1E-6177"),  # below the smallest exponent
    ],
)
def test_a_decimal_decimal128_cannot_hold_exactly_is_refused_not_rounded(value: Decimal) -> None:
    with pytest.raises(ArithmeticError):
        bson.encode({"v": value}, codec_options=CODEC_OPTIONS)


@pytest.mark.parametrize(
    "value",
    [
        Decimal("12345678901234567890123456789012340"),  # 35 digits, the last a zero: same value
        Decimal("1.0000000000000000000000000000000000"),  # 35 digits of scale: would read as 34
        Decimal("1E+6144"),  # clamp=1 pads it to 1.000...000E+6144 (34 digits)
        Decimal("0E-6200"),  # a zero's exponent below Decimal128's: clamped to 0E-6176
        Decimal("0E+7000"),  # above: clamped to 0E+6111
    ],
)
def test_a_decimal_whose_digits_or_scale_would_change_is_refused(value: Decimal) -> None:
    """Decimal128(value) is exact in value for these, but reads back with other digits or another
    exponent (scale): refused as well, so what is stored always reads back unchanged."""
    back = bson.decode(bson.encode({"v": Decimal128(value)}), codec_options=DEFAULT_CODEC_OPTIONS)["v"].to_decimal()
    assert back == value and back.as_tuple() != value.as_tuple()  # what plain Decimal128 does
    with pytest.raises(ArithmeticError, match="same digits and exponent"):
        bson.encode({"v": value}, codec_options=CODEC_OPTIONS)


@pytest.mark.parametrize("text", ["NaN", "-NaN", "sNaN", "Infinity", "-Infinity"])
def test_special_decimals_round_trip(text: str) -> None:
    value = Decimal(text)
    assert str(round_trip(value)) == str(value)


@pytest.fixture
async def offline_store() -> AsyncIterator[MongoSnapshotStore]:
    """A store whose client never connects: a call that sends nothing must not need a server."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        "mongodb://127.0.0.1:1", connect=False, serverSelectionTimeoutMS=200
    )
    try:
        yield MongoSnapshotStore(client, "wowd", context="ctx", ddl=Ddl.NONE, sharding=MongoSharding.OFF)
    finally:
        await client.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "state",
    [
        {"d": Decimal("1" * 35)},
        {"big": 2**64},  # beyond BSON's 64-bit integers
        {"obj": object()},
        {1: "non-string key"},
        {"nested": {"deep": [Decimal("NaN"), Decimal("1E-7000")]}},
        {"scale": [Decimal("1"), Decimal("1.0000000000000000000000000000000000")]},
    ],
    ids=["35-digits", "int-overflow", "object", "int-key", "nested-tiny", "scale-35"],
)
async def test_a_state_bson_cannot_hold_is_failed_not_a_crash(
    offline_store: MongoSnapshotStore, state: dict[Any, Any]
) -> None:
    snapshot = SnapshotRecord(
        ref=AggregateRef(context="ctx", aggregate="order", id="o-1"), version=1, state_revision=1, state=state
    )
    [outcome] = await offline_store.save_all([snapshot])
    assert outcome.status == "failed"
    assert outcome.ref == snapshot.ref and outcome.version == 1
    assert outcome.reason is not None and "not BSON" in outcome.reason
    with pytest.raises(InvalidInput):
        await offline_store.save(snapshot)
