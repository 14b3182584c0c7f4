"""Helpers of the lease black-pipe tests: run a store call beside the wire, read and answer it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup
from bson.datetime_ms import DatetimeMS
from mockupdb import Request

T = TypeVar("T")

DB = "wowd"
NS = "wowd.demo"
T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
"""The store clock of the scripted answers (nothing on the client reads a clock)."""

DRIVER_KEYS = frozenset({"$db", "lsid", "$clusterTime", "$readPreference"})


def ms(at: datetime) -> int:
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


def at(seconds: float) -> datetime:
    """The store clock ``seconds`` after :data:`T0`."""
    return T0 + timedelta(seconds=seconds)


class Call(Generic[T]):
    """A store call running in a task group while the test plays the server."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    @classmethod
    def start(cls, tg: TaskGroup, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> Call[T]:
        call: Call[T] = cls()
        tg.start_soon(call._run, fn, args, kwargs)
        return call

    async def _run(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._value = await fn(*args, **kwargs)
        except Exception as exc:  # handed to the test by result()
            self._error = exc
        finally:
            self._done.set()

    async def result(self, within_s: float = 10) -> T:
        with anyio.fail_after(within_s):
            await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def error(self, within_s: float = 10) -> BaseException:
        with anyio.fail_after(within_s):
            await self._done.wait()
        assert self._error is not None, f"expected an error, got {self._value!r}"
        return self._error


def plain(value: Any) -> Any:
    """OrderedDicts (as MockupDB decodes) to dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def body(req: Request) -> dict[str, Any]:
    """The command document without what the driver adds on its own (session, $db, ...)."""
    return {k: plain(v) for k, v in req.doc.items() if k not in DRIVER_KEYS}


def reply_cursor(req: Request, collection: str, docs: list[dict[str, Any]]) -> None:
    req.ok(cursor={"id": 0, "ns": f"{DB}.{collection}", "firstBatch": docs})


def reply_value(req: Request, value: dict[str, Any] | None) -> None:
    """A findAndModify answer: the document after the write, or none matched."""
    req.ok(value=value, lastErrorObject={"n": 0 if value is None else 1, "updatedExisting": value is not None})


def client_times(value: Any, path: str = "") -> list[str]:
    """Paths of every date value in a command document: a client clock on the wire."""
    if isinstance(value, datetime | DatetimeMS):
        return [path]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in client_times(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in client_times(v, f"{path}[{i}]")]
    return []


def equality_mismatches(query: Mapping[str, Any], doc: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The plain equality conditions of ``query`` that ``doc`` fails (field: (wanted, stored))."""
    return {
        k: (v, doc.get(k))
        for k, v in query.items()
        if not k.startswith("$") and not isinstance(v, Mapping) and doc.get(k) != v
    }


def slot_doc(
    slot: int,
    *,
    owner: str | None,
    last_owner: str | None = None,
    incarnation: int = 1,
    fence: int = 1,
    written: datetime = T0,
    ttl_s: float = 10,
    floor: datetime | None = None,
    ns: str = NS,
) -> dict[str, Any]:
    """A slot document as the store keeps it (dates of the store clock)."""
    expires = written + timedelta(seconds=ttl_s)
    return {
        "ns": ns,
        "slot": slot,
        "ownerKey": owner,
        "incarnation": incarnation,
        "lastOwnerKey": owner if last_owner is None else last_owner,
        "fence": fence,
        "expiresAt": expires,
        "floor": floor or written,
        "ceiling": expires,
        "nextFloor": expires,
        "writtenAt": written,
    }


def projected(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What the store's projection returns of a slot document."""
    keys = ("ns", "slot", "ownerKey", "incarnation", "fence", "expiresAt", "floor", "ceiling", "writtenAt")
    return {k: doc[k] for k in keys}
