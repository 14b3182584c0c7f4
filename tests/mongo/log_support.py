"""Helpers of the log's black-pipe tests: a MockupDB that looks like a replica-set primary
(change streams need one), change events, resume tokens and a way to run a store call while
the test scripts the server's answers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import pytest
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.timestamp import Timestamp
from mockupdb import MockupDB
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, primary
from wowd.model import AggregateRef, Commit, DomainEvent, commit_to_doc

T = TypeVar("T")

CONTEXT = "ctx"
PARTITIONS = 8
DB = "wowd"
ORDERS = "wow_log__ctx__order"
ID_P3 = "order-2"
"""An aggregate id of partition 3 (of 8)."""
ID_P5 = "order-4"
"""An aggregate id of partition 5 (of 8)."""


def housekeeping(request: Any) -> bool | None:
    """Answers the driver's cursor and session clean-up (whatever its arguments)."""
    if request.command_name in ("killCursors", "endSessions"):
        return bool(request.ok())
    return None


@pytest.fixture
def rs_server() -> Iterator[MockupDB]:
    """A MockupDB answering ``hello``/``isMaster`` as the primary of replica set ``rs0``."""
    with primary("rs0") as server:
        server.autoresponds(housekeeping)
        yield server


@pytest.fixture
def rs_wire(rs_server: MockupDB) -> Wire:
    return Wire(rs_server)


@pytest.fixture
async def rs_client(rs_server: MockupDB) -> AsyncIterator[AsyncMongoClient[Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        rs_server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False
    )
    try:
        yield client
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await client.close()


async def majority_point(wire: Wire, ct: tuple[int, int]) -> None:
    """Answers the read that takes the cluster time before a scan: a ``find`` that matches
    nothing, with ``majority`` read concern, whose ``operationTime`` is the majority commit point
    (no write still in flight below it, unlike a ``ping``'s last applied time)."""
    req = await wire.command("find")
    assert req["find"] == f"wow_checkpoint__{CONTEXT}"
    assert req["filter"] == {"_id": None}
    assert (req["limit"], req["singleBatch"]) == (1, True)
    assert req["readConcern"] == {"level": "majority"}
    req.ok(
        cursor={"id": 0, "ns": f"{DB}.wow_checkpoint__{CONTEXT}", "firstBatch": []},
        operationTime=Timestamp(*ct),
    )


SCAN_SORT = {"partition": 1, "aggregate_id": 1, "version": 1, "_id": 1}
"""The order of a partition's re-read: the ``partition_order`` index's."""


def scan_bounds(p: int, partitions: int = PARTITIONS) -> list[tuple[list[Any], list[Any]]]:
    """The index ranges a re-read of partition ``p`` reads in each collection, in order: no
    ``partition`` stored and ``p``'s own (read together, merged), then below null, the negative
    numbers, between ``p`` and ``p + 1``, and above the partitions (out of range, not a number)."""
    low, high = [MinKey()] * 3, [MaxKey()] * 3
    return [
        ([None, *low], [None, *high]),
        ([p, *low], [p, *high]),
        ([MinKey(), *low], [None, *low]),
        ([None, *high], [0, *low]),
        ([p, *high], [p + 1, *low]),
        ([partitions, *low], [MaxKey(), *high]),
    ]


async def scan_collection(
    wire: Wire,
    coll: str,
    p: int,
    docs: list[dict[str, Any]],
    *,
    missing: list[dict[str, Any]] | None = None,
    cut: tuple[int, int] | None = None,
) -> None:
    """Answers the six ``find`` commands of partition ``p``'s re-read of ``coll``, from their
    start: each bounded on ``partition_order`` (``hint``, ``min``, ``max``) in its order,
    ``missing`` (commits stored without ``partition``) and ``docs`` in ``p``'s own range, nothing
    in the others; with ``cut``, each reads majority-committed data at or after that cluster time
    (causally consistent: on every shard it sees each commit at or before the cut)."""
    answers = [missing or [], docs, [], [], [], []]
    for (lower, upper), answer in zip(scan_bounds(p), answers, strict=True):
        find = await wire.command("find")
        assert (find["find"], find["filter"], find["hint"]) == (coll, {}, "partition_order")
        assert find["sort"] == SCAN_SORT
        assert list(find["min"].values()) == lower and list(find["max"].values()) == upper
        if cut is not None:
            assert find["readConcern"] == {"level": "majority", "afterClusterTime": Timestamp(*cut)}
        find.ok(cursor={"id": 0, "ns": f"{DB}.{coll}", "firstBatch": answer})


def token(ct: tuple[int, int], n: int = 0) -> dict[str, str]:
    """A resume token shaped like the server's: KeyString hex starting with the cluster time."""
    return {"_data": f"82{ct[0]:08X}{ct[1]:08X}2B02{n:04X}04"}


def commit(agg_id: str, version: int = 1, request_id: str | None = None) -> Commit:
    return Commit(
        ref=AggregateRef(context=CONTEXT, aggregate="order", id=agg_id),
        version=version,
        command_id=f"cmd-{agg_id}-{version}",
        request_id=request_id or f"req-{agg_id}-{version}",
        create_time=1_700_000_000_000 + version,
        events=(DomainEvent(id=f"e-{agg_id}-{version}", name="OrderPlaced", body={"n": version}),),
    )


def log_doc(agg_id: str, version: int = 1) -> dict[str, Any]:
    return commit_to_doc(commit(agg_id, version), PARTITIONS)


def change(doc: dict[str, Any], ct: tuple[int, int], n: int = 0, coll: str = ORDERS) -> dict[str, Any]:
    """An insert change event of ``doc`` at cluster time ``ct``."""
    return {
        "_id": token(ct, n),
        "operationType": "insert",
        "clusterTime": Timestamp(*ct),
        "ns": {"db": DB, "coll": coll},
        "documentKey": {"_id": doc["_id"]},
        "fullDocument": doc,
    }


def cursor(batch: list[dict[str, Any]], *, first: bool, cursor_id: int = 42, pbrt: Any = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": cursor_id, "ns": f"{DB}.$cmd.aggregate", "firstBatch" if first else "nextBatch": batch}
    if pbrt is not None:
        c["postBatchResumeToken"] = pbrt
    return {"cursor": c}


@dataclass
class Call(Generic[T]):
    """The outcome of a store call run in the background."""

    done: anyio.Event = field(default_factory=anyio.Event)
    value: T | None = None
    error: BaseException | None = None

    def result(self) -> T:
        assert self.done.is_set(), "the call has not finished"
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def start(tg: anyio.abc.TaskGroup, fn: Callable[[], Awaitable[T]]) -> Call[T]:
    call: Call[T] = Call()

    async def run() -> None:
        try:
            call.value = await fn()
        except Exception as exc:  # handed to the test through result()
            call.error = exc
        finally:
            call.done.set()

    tg.start_soon(run)
    return call


async def collect(it: AsyncIterator[T]) -> list[T]:
    return [x async for x in it]
