"""Bad input is refused or quarantined with a message naming the field, and nothing else breaks.

Property-based (hypothesis) over the readers of outside data: commit documents
(``commit_from_doc``), timer events (``timer_event_from``), the configuration (``load_settings``);
example-based over the HTTP gateway's answers from a real local socket server; and one run of the
daemon's feed over a log holding malformed documents (quarantined, counted, the partition goes on).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import SocketStream
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from wowd import metrics
from wowd.config import GatewaySettings, load_settings
from wowd.errors import ConfigError, InvalidInput
from wowd.model import (
    MAX_BODY_BYTES,
    AggregateRef,
    AggregateType,
    Claim,
    Command,
    Commit,
    CronRule,
    DomainEvent,
    SlotLease,
    Timer,
    TimerCancelled,
    TimerScheduled,
    TimerStatus,
    commit_from_doc,
    commit_to_doc,
    timer_event_from,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPE = AggregateType(context="chaos", aggregate="order")
MAX_MS = 253402300799999
NAME = re.compile(r"^[a-z0-9_-]{1,64}$")


@pytest.fixture(autouse=True)
def _no_wowd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read the environment: the tests start from none of it."""
    for key in list(os.environ):
        if key.startswith("WOWD_"):
            monkeypatch.delenv(key)


# --------------------------------------------------------------------------- strategies

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
bson_only = st.one_of(
    st.datetimes(timezones=st.just(dt.UTC)), st.binary(max_size=8), st.uuids(), st.decimals(allow_nan=False)
)
"""Values a MongoDB log document may hold that JSON has not."""
any_value = st.one_of(json_like, bson_only)

COMMIT_KEYS = (
    "tenant_id", "aggregate_id", "version", "command_id", "request_id", "create_time", "header",
    "events", "access", "access_version", "deleted",
)  # fmt: skip


def valid_doc(agg_id: str = "order-1", version: int = 3) -> dict[str, Any]:
    commit = Commit(
        ref=AggregateRef(context=TYPE.context, aggregate=TYPE.aggregate, id=agg_id),
        version=version,
        command_id="cmd",
        request_id=f"req-{agg_id}-{version}",
        create_time=1_700_000_000_000,
        events=(DomainEvent(id="e1", name="OrderCreated", body={"n": 1}),),
        access={"owner_id": "u1", "space_id": "s1", "tags": ["a"]},
        access_version=2,
    )
    return commit_to_doc(commit, 8)


def _field_is_under(field: str | None, key: str) -> bool:
    return field is not None and (field == key or field.startswith((f"{key}[", f"{key}.")))


# --------------------------------------------------------------------------- commit documents


@FAST
@given(doc=st.dictionaries(st.sampled_from(COMMIT_KEYS) | st.text(max_size=6), any_value, max_size=12))
def test_any_document_is_a_commit_or_names_a_field(doc: dict[str, Any]) -> None:
    """The feed relies on this: a log document reads as a Commit or raises InvalidInput with a
    field (the quarantine reason and the metric label); never another exception."""
    try:
        commit = commit_from_doc(TYPE, doc)
    except InvalidInput as exc:
        assert exc.field, exc
        assert str(exc).startswith(f"{exc.field}: ")
        return
    assert commit.version >= 1 and commit.request_id
    assert commit.ref.type == TYPE


@FAST
@given(data=st.data(), key=st.sampled_from(COMMIT_KEYS), value=any_value)
def test_one_bad_field_of_a_valid_commit_is_the_field_named(data: st.DataObject, key: str, value: Any) -> None:
    doc = valid_doc()
    if data.draw(st.booleans(), label="delete instead"):
        del doc[key]
    else:
        doc[key] = value
    try:
        commit_from_doc(TYPE, doc)
    except InvalidInput as exc:
        assert _field_is_under(exc.field, key), (key, exc.field, str(exc))


@FAST
@given(events=st.lists(any_value | st.dictionaries(st.sampled_from(["id", "name", "body"]), any_value)))
def test_bad_events_name_the_event(events: list[Any]) -> None:
    doc = valid_doc()
    doc["events"] = events
    try:
        commit = commit_from_doc(TYPE, doc)
    except InvalidInput as exc:
        assert exc.field is not None and re.fullmatch(r"events\[\d+\](\.(name|body|id))?", exc.field), exc
        return
    assert len(commit.events) == len(events)


# --------------------------------------------------------------------------- timer events


def scheduled(**body: Any) -> DomainEvent:
    base: dict[str, Any] = {
        "key": "expire",
        "due_at": 1_700_000_000_000,
        "rule": {"type": "once"},
        "target": {"context": "chaos", "aggregate": "order", "id": "order-1"},
        "command": {"name": "expire-order", "body": {"n": 1}},
    }
    base.update(body)
    return DomainEvent(id="e", name="TimerScheduled", body=base)


def read_timer_event(event: DomainEvent, **kw: Any) -> TimerScheduled | TimerCancelled | None:
    """``timer_event_from`` under the feed's own expectation: a result or InvalidInput naming a field."""
    try:
        return timer_event_from(event, **kw)
    except InvalidInput as exc:
        assert exc.field and exc.field.startswith(("body.", "rule")), exc
        raise


@FAST
@given(body=st.dictionaries(st.sampled_from(["key", "due_at", "rule", "target", "command"]), json_like))
def test_any_timer_event_body_is_read_or_names_a_field(body: dict[str, Any]) -> None:
    for name in ("TimerScheduled", "TimerCancelled"):
        try:
            read_timer_event(DomainEvent(id="e", name=name, body=body))
        except InvalidInput:
            pass


def test_an_interval_under_the_settings_floor_is_rejected_by_the_feed() -> None:
    """``every_ms = 1`` would have one timer ask for a delivery every few milliseconds: under
    ``timers.min_interval_ms`` (1 s by default) the feed rejects the event (bad input, set aside
    with its reason); a floor lowered in the settings lets it through."""
    from wowd.config import TimerSettings
    from wowd.daemon.feed_batch import prepare_batch
    from wowd.model import LogEntry

    event = scheduled(rule={"type": "interval", "every_ms": 1})
    with pytest.raises(InvalidInput) as info:
        read_timer_event(event)
    assert info.value.field == "rule.every_ms" and "below the shortest interval, 1000 ms" in info.value.reason
    assert isinstance(read_timer_event(scheduled(rule={"type": "interval", "every_ms": 1000})), TimerScheduled)
    commit = commit_from_doc(TYPE, {**valid_doc(), "events": [{"id": "e", "name": event.name, "body": event.body}]})
    entry = LogEntry(position={"seq": 1}, partition=0, aggregate=TYPE, commit=commit, raw={})
    default = prepare_batch([entry], TimerSettings(), 8)
    assert default.timer_writes == [] and [(c, exc.field) for c, _, exc in default.rejected] == [
        (commit, "rule.every_ms")
    ]
    lowered = prepare_batch([entry], TimerSettings(min_interval_ms=1), 8)
    assert lowered.rejected == [] and len(lowered.timer_writes) == 1


@FAST
@given(kind=(st.text(max_size=10) | json_like).filter(lambda k: k not in ("once", "interval", "cron")))
def test_unknown_rule_types_are_refused_naming_rule_type(kind: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        read_timer_event(scheduled(rule={"type": kind, "every_ms": 10}))
    assert info.value.field == "rule.type"


@FAST
@given(
    expression=st.sampled_from(["0 0 30 2 *", "0 0 31 2 *", "0 0 31 4 *", "0 0 31 11 *", "15 3 30 2 *"]),
    zone=st.sampled_from(["UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata"]),
    after=st.integers(min_value=0, max_value=MAX_MS - 2 * 86_400_000),
)
def test_a_cron_that_never_fires_has_no_next_occurrence(expression: str, zone: str, after: int) -> None:
    """Read without error (the first occurrence is the event's ``due_at``), then no next one:
    the timer loop deletes the timer after its first fire instead of looping or raising."""
    ev = read_timer_event(scheduled(rule={"type": "cron", "expression": expression, "zone": zone}))
    assert isinstance(ev, TimerScheduled) and isinstance(ev.rule, CronRule)
    assert ev.rule.next_after(after) is None


@FAST
@given(after=st.integers(min_value=MAX_MS - 2 * 86_400_000, max_value=MAX_MS))
@example(after=MAX_MS - 3_000_000)
def test_a_cron_at_the_end_of_time_has_no_next_occurrence(after: int) -> None:
    """A due_at accepted near 9999-12-31 in a zone east of UTC (year 10000 locally) is no crash:
    the next occurrence is None or a time after it within the range of ``due_at``."""
    assert CronRule(expression="0 0 30 2 *", zone="Europe/Paris").next_after(after) is None
    for zone in ("Europe/Paris", "Asia/Tokyo", "UTC", "America/Los_Angeles"):
        nxt = CronRule(expression="* * * * *", zone=zone).next_after(after)
        assert nxt is None or after < nxt <= MAX_MS


@FAST
@given(
    due_at=st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MAX_MS + 1),
        st.booleans(),
        st.floats(),
        st.text(max_size=8),
        st.none(),
    )
)
@example(due_at=float("nan"))
@example(due_at=1.7e12)
def test_due_at_out_of_range_names_body_due_at(due_at: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        read_timer_event(scheduled(due_at=due_at))
    assert info.value.field == "body.due_at"


@FAST
@given(due_at=st.integers(min_value=0, max_value=MAX_MS))
def test_due_at_in_range_is_kept(due_at: int) -> None:
    ev = read_timer_event(scheduled(due_at=due_at))
    assert isinstance(ev, TimerScheduled) and ev.due_at == due_at


@FAST
@given(size=st.integers(min_value=0, max_value=3000), limit=st.integers(min_value=64, max_value=2500))
def test_command_body_over_the_limit_names_body_command(size: int, limit: int) -> None:
    """The limit applies to the command's JSON text exactly (what the timer store keeps)."""
    command = {"name": "expire-order", "body": {"pad": "x" * size}}
    text_size = len(Command(name="expire-order", body={"pad": "x" * size}).to_json().encode())
    if text_size > limit:
        with pytest.raises(InvalidInput) as info:
            read_timer_event(scheduled(command=command), max_body_bytes=limit)
        assert info.value.field == "body.command"
        assert f"over the limit of {limit}" in str(info.value)
    else:
        ev = read_timer_event(scheduled(command=command), max_body_bytes=limit)
        assert isinstance(ev, TimerScheduled) and ev.command.body == {"pad": "x" * size}


def test_the_default_body_limit_is_64_kib() -> None:
    with pytest.raises(InvalidInput, match="over the limit of 65536"):
        read_timer_event(scheduled(command={"name": "c", "body": {"pad": "x" * MAX_BODY_BYTES}}))


@FAST
@given(
    part=st.sampled_from(["context", "aggregate"]),
    name=(st.text(max_size=70) | json_like).filter(lambda n: not (isinstance(n, str) and NAME.match(n))),
)
@example(part="context", name="Orders")
@example(part="aggregate", name="order.items")
@example(part="aggregate", name="a$b")
@example(part="context", name="a" * 65)
@example(part="aggregate", name="")
def test_target_names_a_collection_or_index_cannot_hold_name_body_target(part: str, name: Any) -> None:
    target = {"context": "chaos", "aggregate": "order", "id": "order-1", part: name}
    with pytest.raises(InvalidInput) as info:
        read_timer_event(scheduled(target=target))
    assert info.value.field == "body.target"
    assert part in str(info.value)


@FAST
@given(value=bson_only)
def test_a_command_body_json_cannot_hold_names_the_field(value: Any) -> None:
    """A MongoDB log document may carry BSON values (dates, binaries, decimals) in a command body:
    refused naming the field, not a TypeError that would stop the feed."""
    with pytest.raises(InvalidInput) as info:
        timer_event_from(scheduled(command={"name": "c", "body": {"v": value}}))
    assert info.value.field == "body.command.body"


# --------------------------------------------------------------------------- configuration


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


# --------------------------------------------------------------------------- HTTP gateway answers


async def _drain_request(stream: SocketStream) -> None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += await stream.receive(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        rest += await stream.receive(65536)


def answer(status: int, body: bytes, *, ctype: bytes = b"application/json", trickle: float = 0.0) -> Any:
    async def behave(stream: SocketStream) -> None:
        await _drain_request(stream)
        head = b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, ctype, len(body))
        await stream.send(head)
        if trickle:
            for i in range(len(body)):
                await stream.send(body[i : i + 1])
                await anyio.sleep(trickle)  # a target that answers too slowly (not a synchronisation)
        else:
            await stream.send(body)

    return behave


async def never_answers(stream: SocketStream) -> None:
    await _drain_request(stream)
    await anyio.sleep_forever()


async def garbage(stream: SocketStream) -> None:
    await _drain_request(stream)
    await stream.send(b"\x00\xffTHIS IS NOT HTTP\r\n\r\n")


async def hangs_up(stream: SocketStream) -> None:
    await _drain_request(stream)
    await stream.aclose()


async def chunked_forever(stream: SocketStream) -> None:
    await _drain_request(stream)
    await stream.send(b"HTTP/1.1 503 X\r\ntransfer-encoding: chunked\r\n\r\n")
    while True:
        await stream.send(b"400\r\n" + b"y" * 1024 + b"\r\n")


@pytest.fixture
async def target() -> AsyncIterator[Callable[[Any], Awaitable[int]]]:
    """Starts scripted targets in the test's task group; answers their ports."""
    async with anyio.create_task_group() as tg:

        async def start(behave: Any) -> int:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

            async def handle(stream: SocketStream) -> None:
                async with stream:
                    try:
                        await behave(stream)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass

            async def serve() -> None:
                async with listener:
                    await listener.serve(handle)

            tg.start_soon(serve)
            return int(listener.extra(anyio.abc.SocketAttribute.local_port))

        yield start
        tg.cancel_scope.cancel()


def _timer() -> Timer:
    owner = AggregateRef(context="chaos", aggregate="order", id="order-1")
    return Timer(
        timer_id="t1",
        partition=0,
        owner=owner,
        key="k",
        version=1,
        due_at=1,
        scheduled_at=1,
        target=owner,
        body=Command(name="expire-order", body={"n": 1}).to_json(),
        status=TimerStatus.FIRING,
        claim=Claim(owner_key="me", fence=1, until=1),
    )


HUGE = b"<html>" + b"z" * 8_000_000 + b"</html>"

GATEWAY_CASES: list[tuple[str, Any, str]] = [
    ("non-JSON 500", answer(500, b"<html>Internal Error</html>", ctype=b"text/html"), "Retry"),
    ("non-JSON 200", answer(200, b"OK!!", ctype=b"text/plain"), "Delivered"),
    ("truncated JSON 404", answer(404, b'{"errorMsg": "no such ord'), "Park"),
    ("JSON list 400", answer(400, b"[1, 2, 3]"), "Fail"),
    ("huge 503", answer(503, HUGE, ctype=b"text/html"), "Retry"),
    ("huge 422", answer(422, HUGE, ctype=b"text/html"), "Fail"),
    ("huge 200", answer(200, HUGE), "Delivered"),
    ("slow: no answer", never_answers, "Retry"),
    ("slow: trickled 500 body", answer(500, b"x" * 10_000, trickle=0.01), "Retry"),
    ("endless chunked 503", chunked_forever, "Retry"),
    ("not HTTP", garbage, "Retry"),
    ("hang-up", hangs_up, "Retry"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("case", "behave", "expected"), GATEWAY_CASES, ids=[c[0] for c in GATEWAY_CASES])
async def test_gateway_answers_become_an_outcome_never_a_crash(
    target: Callable[[Any], Awaitable[int]], case: str, behave: Any, expected: str
) -> None:
    from wowd.delivery import HttpGateway

    port = await target(behave)
    timeout_s = 0.2 if case.startswith("slow") else 0.5  # the slow ones end at the timeout
    gw = HttpGateway(GatewaySettings(kind="http", url=f"http://127.0.0.1:{port}/api", timeout_s=timeout_s), pool_size=4)
    try:
        with anyio.fail_after(5):  # bounded by the gateway's own timeout, whatever the target does
            outcome = await gw.send(_timer())
    finally:
        await gw.aclose()
    assert type(outcome).__name__ == expected, (case, outcome)
    reason = getattr(outcome, "reason", "")
    assert len(reason) < 300, "the reason (kept as the timer's last_error) stays small"


@pytest.mark.anyio
async def test_a_refused_connection_is_a_retry() -> None:
    from wowd.delivery import HttpGateway, Retry

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
    await listener.aclose()  # nobody listens there now
    gw = HttpGateway(GatewaySettings(kind="http", url=f"http://127.0.0.1:{port}", timeout_s=0.5), pool_size=4)
    try:
        with anyio.fail_after(5):
            assert isinstance(await gw.send(_timer()), Retry)
    finally:
        await gw.aclose()


# --------------------------------------------------------------------------- the feed over malformed input


def good(agg_id: str, version: int, *events: DomainEvent) -> Commit:
    return Commit(
        ref=AggregateRef(context=TYPE.context, aggregate=TYPE.aggregate, id=agg_id),
        version=version,
        command_id=uuid.uuid4().hex,
        request_id=uuid.uuid4().hex,
        create_time=1_700_000_000_000,
        events=(DomainEvent(id=uuid.uuid4().hex, name="ItemAdded", body={"n": version}), *events),
    )


def timer_event(key: str, **body: Any) -> DomainEvent:
    ev = scheduled(**{"key": key, "due_at": 4_000_000_000_000, **body})
    return DomainEvent(id=uuid.uuid4().hex, name=ev.name, body=ev.body)


MALFORMED: list[tuple[str, dict[str, Any]]] = [
    ("request_id", {**valid_doc("bad-1", 1), "request_id": 17}),
    ("version", {**valid_doc("bad-2", 1), "version": "three"}),
    ("events", {**valid_doc("bad-3", 1), "events": {"not": "a list"}}),
    ("events[0].name", {**valid_doc("bad-4", 1), "events": [{"id": "x", "body": {}}]}),
    ("tenant_id", {**valid_doc("bad-5", 1), "tenant_id": ""}),
    ("create_time", {**valid_doc("bad-6", 1), "create_time": 1.5}),
]
"""(field named, raw document) written with ``insert_raw``."""

REJECTED_EVENTS: list[tuple[str, DomainEvent]] = [
    ("rule.type", timer_event("r1", rule={"type": "fortnightly"})),
    ("body.command", timer_event("r2", command={"name": "c", "body": {"pad": "x" * 600}})),
    ("body.target", timer_event("r3", target={"context": "Bad.Ctx", "aggregate": "order", "id": "x"})),
    ("body.due_at", timer_event("r4", due_at=-5)),
]
"""(field named, timer event): each in an otherwise valid commit, which is fed and quarantined."""


def _count(counter: Any, field: str) -> float:
    value = counter.labels(field=field)._value.get()
    assert isinstance(value, float)
    return value


@pytest.fixture
def feed_settings(tmp_path: Path) -> Iterator[Any]:
    yield load_settings(
        context=TYPE.context,
        partitions=4,
        embedded={"path": tmp_path / "wowd.db"},
        timers={"max_body_bytes": 512},
    )


@pytest.mark.anyio
async def test_the_feed_quarantines_bad_input_counts_it_and_goes_on(feed_settings: Any) -> None:
    """Malformed documents and rejected timer events are quarantined with the field named in the
    reason and counted by field; the good commits around them (same partitions) are fed to the sink
    and the timer store, and every partition's checkpoint passes them all."""
    from wowd.daemon.feed import CONSUMER, Feeder
    from wowd.daemon.leases import HeldSlot
    from wowd.daemon.waker import Waker
    from wowd.stores.embedded import open_embedded

    backend = await open_embedded(feed_settings)
    try:
        log = backend.log
        before_q = {f: _count(metrics.QUARANTINED, f) for f, _ in MALFORMED + REJECTED_EVENTS}
        before_r = {f: _count(metrics.TIMER_EVENTS_REJECTED, f) for f, _ in REJECTED_EVENTS}
        goods = [good(f"good-{i}", 1, timer_event(f"ok-{i}")) for i in range(8)]
        await log.append_many(goods[:4])
        for _field, raw in MALFORMED:
            await log.insert_raw(TYPE, raw)
        rejected = [good(f"rej-{i}", 1, ev) for i, (_f, ev) in enumerate(REJECTED_EVENTS)]
        zone = {"type": "cron", "expression": "* * * * *", "zone": "Mars/Olympus"}
        two = good("rej-two", 1, timer_event("", due_at=5), timer_event("z", rule=zone))
        await log.append_many([*rejected, two])
        await log.append_many(goods[4:])

        lease = SlotLease(
            namespace="t", slot=0, owner_key="me", incarnation=1, fence=1, expires_at=0, floor=0, ceiling=0,
            written_at=0,
        )  # fmt: skip
        held = HeldSlot(
            lease=lease, partitions=frozenset(range(4)), valid_until=anyio.current_time() + 60, owner_key="me"
        )
        feeder = Feeder(feed_settings, backend)
        last_seq = len(goods) + len(MALFORMED) + len(REJECTED_EVENTS) + 1
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(feeder.run, held, Waker())
                while True:
                    cps = await log.checkpoints(CONSUMER, range(4))
                    if cps and max(cp.position["seq"] for cp in cps.values()) >= last_seq:
                        break
                    await anyio.sleep(0.02)
                held.request_stop()
        assert feeder.stalled is None

        quarantined = await log.quarantined()
        reasons = {q["raw"]["aggregate_id"]: q["reason"] for q in quarantined}
        for field, raw in MALFORMED:
            reason = reasons[raw["aggregate_id"]]
            assert reason.startswith(f"{field}: "), (field, reason)
            assert _count(metrics.QUARANTINED, field) == before_q[field] + 1, field
        for i, (field, _ev) in enumerate(REJECTED_EVENTS):
            assert f"{field}: " in reasons[f"rej-{i}"], (field, reasons[f"rej-{i}"])
            assert _count(metrics.TIMER_EVENTS_REJECTED, field) == before_r[field] + 1, field
        # a commit with two rejected timer events is set aside once, naming the first bad field
        assert reasons["rej-two"].startswith("rejected timer event: body.key: "), reasons["rej-two"]
        assert len(quarantined) == len(MALFORMED) + len(REJECTED_EVENTS) + 1

        sink = backend.sink(TYPE)
        for c in [*goods, *rejected, two]:
            docs = await sink.documents(c.ref)
            assert [d["version"] for d in docs] == [1], c.ref
        for i, c in enumerate(goods):
            assert await backend.timers.find(c.ref, f"ok-{i}") is not None
        owners = {t.owner for t in await backend.timers.scan(limit=100)}
        assert owners == {c.ref for c in goods}, "a rejected timer event puts no timer"
    finally:
        await backend.close()
