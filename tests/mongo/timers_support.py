"""Helpers of the MongoTimerStore black-pipe tests: timers, scripted answers, a call in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from bson import ObjectId

from tests.mongo.conftest import Wire
from wowd.model import AggregateRef, Timer, deterministic_timer_id, partition

CONTEXT = "ctx"
PARTITIONS = 8
REGISTRY = "wow_timer_aggregate"

T = TypeVar("T")


def ref(aggregate: str = "order", id: str = "order-1", tenant_id: str = "(0)") -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate=aggregate, id=id, tenant_id=tenant_id)


def make_timer(
    *,
    aggregate: str = "order",
    id: str = "order-1",
    key: str = "remind",
    version: int = 5,
    due_at: int = 1_000,
    revision: int = 0,
) -> Timer:
    owner = ref(aggregate, id)
    return Timer(
        timer_id=deterministic_timer_id(owner, key, version),
        partition=partition(id, PARTITIONS),
        owner=owner,
        key=key,
        version=version,
        due_at=due_at,
        scheduled_at=due_at,
        target=AggregateRef(context="billing", aggregate="invoice", id="inv-9"),
        body='{"body":{},"name":"Remind"}',
        revision=revision,
    )


@dataclass
class Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None


@asynccontextmanager
async def calling(fn: Callable[[], Awaitable[T]]) -> AsyncIterator[Outcome[T]]:
    """Runs ``fn()`` in a task while the body answers its commands; the outcome is set on exit."""
    outcome: Outcome[T] = Outcome()

    async def run() -> None:
        try:
            outcome.value = await fn()
        except Exception as exc:  # the test asserts on it
            outcome.error = exc

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            yield outcome


def cursor(ns: str, docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"cursor": {"id": 0, "ns": ns, "firstBatch": list(docs)}}


def registry_doc(aggregate: str, fmt: int = 5) -> dict[str, Any]:
    return {
        "_id": f"wow_timer__{CONTEXT}__{aggregate}",
        "context": CONTEXT,
        "aggregate": aggregate,
        "format": fmt,
        "created_at": 1,
    }


async def answer_first_use(wire: Wire, aggregate: str, *, fmt: int = 5) -> None:
    """Answers the registry upsert, ``create`` and ``createIndexes`` of a type's first put."""
    req = await wire.command("findAndModify")
    req.ok(value=registry_doc(aggregate, fmt), lastErrorObject={"n": 1, "updatedExisting": True})
    if fmt != 5:
        return
    (await wire.command("create")).ok()
    (await wire.command("createIndexes")).ok(numIndexesBefore=1, numIndexesAfter=4)


async def answer_update(wire: Wire, *, upserted: bool = True) -> dict[str, Any]:
    req = await wire.command("update")
    if upserted:
        req.ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ObjectId()}])
    else:
        req.ok(n=1, nModified=1)
    return dict(req.doc)


def matches(flt: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    """MongoDB's match of the equality / ``$lte`` / ``$in`` filters the store sends (dotted paths)."""
    for path, cond in flt.items():
        value: Any = doc
        for part in path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(cond, Mapping) and any(k.startswith("$") for k in cond):
            for op, arg in cond.items():
                if op == "$lte" and not (value is not None and value <= arg):
                    return False
                if op == "$in" and value not in arg:
                    return False
        elif value != cond:
            return False
    return True
