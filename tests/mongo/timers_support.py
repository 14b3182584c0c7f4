"""Helpers of the MongoDB timer stores' black-pipe tests: timers, scripted answers, a call in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from bson import ObjectId
from mockupdb import Request

from tests.mongo.conftest import Wire
from wowd.model import AggregateRef, Timer, deterministic_timer_id, partition

CONTEXT = "ctx"
PARTITIONS = 8
REGISTRY = "wow_timer_aggregate"
DB = "wowd"

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


def registry_doc(aggregate: str, fmt: int = 6) -> dict[str, Any]:
    return {
        "_id": f"wow_timer__{CONTEXT}__{aggregate}",
        "context": CONTEXT,
        "aggregate": aggregate,
        "format": fmt,
        "created_at": 1,
    }


async def answer_first_use(wire: Wire, aggregate: str, *, fmt: int = 6) -> None:
    """Answers the registry upsert, ``create`` and ``createIndexes`` of a type's first put."""
    req = await wire.command("findAndModify")
    req.ok(value=registry_doc(aggregate, fmt), lastErrorObject={"n": 1, "updatedExisting": True})
    if fmt != 6:
        return
    (await wire.command("create")).ok()
    (await wire.command("createIndexes")).ok(numIndexesBefore=1, numIndexesAfter=5)


async def answer_update(wire: Wire, *, upserted: bool = True) -> dict[str, Any]:
    req = await wire.command("update")
    if upserted:
        req.ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ObjectId()}])
    else:
        req.ok(n=1, nModified=1)
    return dict(req.doc)


def matches(flt: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    """MongoDB's match of the filters the store sends (dotted paths; equality, ``$lt``, ``$lte``,
    ``$in``, ``$nin``, ``$eq``, top-level ``$or``). A missing field is null: ``$nin`` matches it."""
    for path, cond in flt.items():
        if path == "$or":
            if not any(matches(clause, doc) for clause in cond):
                return False
            continue
        value: Any = doc
        for part in path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(cond, Mapping) and any(k.startswith("$") for k in cond):
            for op, arg in cond.items():
                if op == "$lte" and not (value is not None and value <= arg):
                    return False
                if op == "$lt" and not (value is not None and value < arg):
                    return False
                if op == "$in" and value not in arg:
                    return False
                if op == "$nin" and value in arg:
                    return False
                if op == "$eq" and value != arg:
                    return False
        elif value != cond:
            return False
    return True


def dup_key_error(index: int, doc: Mapping[str, Any], ns: str = "wowd.wow_timer__ctx__order") -> dict[str, Any]:
    """The write error MongoDB 7.0 answers for an insert (an upsert's) that met the unique index
    ``partition_owner_key``: code 11000, the server's errmsg, ``keyPattern`` and ``keyValue``."""
    owner = doc["owner"]
    return {
        "index": index,
        "code": 11000,
        "errmsg": (
            f"E11000 duplicate key error collection: {ns} index: partition_owner_key dup key: "
            f'{{ partition: {doc["partition"]}, owner.tenant_id: "{owner["tenant_id"]}", '
            f'owner.id: "{owner["id"]}", key: "{doc["key"]}" }}'
        ),
        "keyPattern": {"partition": 1, "owner.tenant_id": 1, "owner.id": 1, "key": 1},
        "keyValue": {
            "partition": doc["partition"],
            "owner.tenant_id": owner["tenant_id"],
            "owner.id": owner["id"],
            "key": doc["key"],
        },
    }


def key_doc(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A stored document as the read of an E11000's keys answers it (its projection)."""
    return {k: doc[k] for k in ("partition", "owner", "key", "version", "status")}


def tombstone(timer_doc: Mapping[str, Any], status: str, version: int | None = None) -> dict[str, Any]:
    """A stored timer made a tombstone (as the store's pipeline leaves it)."""
    import datetime

    doc = dict(timer_doc)
    doc.pop("claim", None)
    doc["status"] = status
    if version is not None:
        doc["version"] = version
    doc["expires_at"] = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    return doc


async def registry_reloaded(wire: Wire) -> Request:
    """Answers the registry's reload (another replica registered ``cart`` beside ``order``) and
    answers the ``aggregate`` asked again, which reads both collections in name order."""
    reload = await wire.command("find")
    assert reload.doc["find"] == REGISTRY and reload.doc["filter"] == {"context": CONTEXT}
    reload.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order"), registry_doc("cart")]))
    again = await wire.command("aggregate")
    assert [s["$unionWith"]["coll"] for s in again.doc["pipeline"] if "$unionWith" in s] == [
        f"wow_timer__{CONTEXT}__cart",
        f"wow_timer__{CONTEXT}__order",
    ]
    return again
