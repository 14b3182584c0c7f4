"""``wowd.retry.retrying`` and ``Pauses``, the retries every loop of the daemon goes through, timed
on trio's virtual clock (``trio.testing.MockClock``, jumping ahead whenever every task waits): what
is retried and what is raised at once, after which waits, what is logged and told, and a stop
that ends the wait at once. ``retrying_blocking``, a worker thread's, on the real clock."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from wowd.errors import ConflictError, StorageError, StorageUnavailable
from wowd.retry import Backoff, Pauses, RetryStopped, retrying, retrying_blocking

EXACT = 1e-6

anyio_mark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


class Flaky:
    """Raises the errors of ``script`` one per call (then answers ``"done"``), noting when each
    call came (virtual clock)."""

    def __init__(self, *script: BaseException) -> None:
        self.script = list(script)
        self.at: list[float] = []

    async def __call__(self) -> str:
        self.at.append(anyio.current_time())
        if self.script:
            raise self.script.pop(0)
        return "done"


async def run(flaky: Flaky, **kwargs: Any) -> str:
    kwargs.setdefault("backoff", Backoff(1.0, 4.0))
    async for attempt in retrying("the write", **kwargs):
        with attempt:
            result = await flaky()
    return result


@anyio_mark
async def test_an_unavailable_store_is_retried_after_the_backoff_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = [StorageUnavailable(f"not primary {i}") for i in range(4)]
    flaky = Flaky(*down)
    told: list[BaseException] = []
    start = anyio.current_time()
    with caplog.at_level(logging.WARNING, logger="wowd.retry"):
        assert await run(flaky, on_failure=told.append) == "done"
    waits = [b - a for a, b in zip([start, *flaky.at], flaky.at, strict=False)]
    assert [round(w, 6) for w in waits] == [0.0, 1.0, 2.0, 4.0, 4.0]  # doubled from the base, capped
    assert told == down
    assert [r.getMessage() for r in caplog.records] == [
        f"the write failed (will retry): not primary {i}" for i in range(4)
    ]


@anyio_mark
async def test_any_other_error_is_raised_at_once_untold(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky(StorageError("database disk image is malformed"), StorageUnavailable("never reached"))
    told: list[BaseException] = []
    with caplog.at_level(logging.WARNING, logger="wowd.retry"), pytest.raises(StorageError, match="malformed"):
        await run(flaky, on_failure=told.append)
    assert len(flaky.at) == 1 and told == [] and caplog.records == []


@anyio_mark
async def test_what_is_retried_is_the_callers_choice_and_its_log_too(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky(ConflictError("version taken"), StorageError("damaged"))
    told: list[BaseException] = []
    with caplog.at_level(logging.DEBUG):
        assert await run(flaky, retry_on=StorageError, logger=None, on_failure=told.append) == "done"
    assert len(flaky.at) == 3 and [str(e) for e in told] == ["version taken", "damaged"]
    assert not [r for r in caplog.records if r.name == "wowd.retry"]


@anyio_mark
async def test_a_stop_during_the_wait_ends_it_at_once() -> None:
    stop = anyio.Event()
    flaky = Flaky(*(StorageUnavailable("down") for _ in range(100)))
    async with anyio.create_task_group() as tg:

        async def stop_soon() -> None:
            await anyio.sleep(2.5)  # during the second wait (2 s, from 1 s on)
            stop.set()

        tg.start_soon(stop_soon)
        start = anyio.current_time()
        with pytest.raises(RetryStopped, match="the write"):
            await run(flaky, stop=stop)
        assert abs(anyio.current_time() - start - 2.5) < EXACT
    assert len(flaky.at) == 2


@anyio_mark
async def test_pauses_grow_with_the_failures_reset_on_progress_and_end_on_a_stop() -> None:
    stop = anyio.Event()
    pauses = Pauses(Backoff(0.5, 2.0), stop)
    waited: list[float] = []
    for _ in range(4):
        t = anyio.current_time()
        await pauses.pause()
        waited.append(anyio.current_time() - t)
    assert [round(w, 6) for w in waited] == [0.5, 1.0, 2.0, 2.0] and pauses.failures == 4
    pauses.reset()
    t = anyio.current_time()
    await pauses.pause()
    assert abs(anyio.current_time() - t - 0.5) < EXACT
    stop.set()
    t = anyio.current_time()
    await pauses.pause()  # the backoff is 1 s by now: a stop ends it at once
    assert anyio.current_time() == t


@anyio_mark
async def test_pauses_without_a_stop_wait_their_backoff() -> None:
    pauses = Pauses(Backoff(0.5, 2.0))
    t = anyio.current_time()
    await pauses.pause()
    await pauses.pause()
    assert abs(anyio.current_time() - t - 1.5) < EXACT


def test_a_blocking_call_is_retried_after_the_backoff_within_its_deadline_then_raises_the_last_error() -> None:
    calls: list[float] = []

    def busy() -> None:
        calls.append(time.monotonic())
        raise StorageUnavailable(f"database is locked ({len(calls)})")

    with pytest.raises(StorageUnavailable, match="locked"):
        for attempt in retrying_blocking(
            backoff=Backoff(0.02, 0.02), within_s=0.2, retry_if=lambda e: isinstance(e, StorageUnavailable)
        ):
            with attempt:
                busy()
    assert 3 <= len(calls) <= 11  # retried for the deadline's length, 20 ms apart
    assert all(b - a >= 0.02 for a, b in zip(calls, calls[1:], strict=False))

    calls.clear()
    with pytest.raises(StorageError, match="malformed"):
        for attempt in retrying_blocking(
            backoff=Backoff(0.001, 0.005), within_s=5, retry_if=lambda e: isinstance(e, StorageUnavailable)
        ):
            with attempt:
                calls.append(1)
                raise StorageError("database disk image is malformed")
    assert len(calls) == 1  # not retried
