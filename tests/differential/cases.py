"""Streams the differential tests found, kept: each property test runs its own as ``@example``s
first, and a stream MongoDB still gets wrong has a test of its own marked ``xfail(strict=True)``
(the property tests do not draw that case; its test says so, and passes once MongoDB is right)."""

from __future__ import annotations

from typing import Any

from tests.differential.schema_draw import AT, Append, Stream


def scheduled(key: str, due_at: int, **rule: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "key": key, "due_at": due_at, "target": {"context": "ctx", "aggregate": "order", "id": ""},
        "command": {"name": "go"},
    }  # fmt: skip
    if rule:
        body["rule"] = rule
    return {"name": "TimerScheduled", "body": body}


def cancelled(key: str) -> dict[str, Any]:
    return {"name": "TimerCancelled", "body": {"key": key}}


def commit(n: int, *events: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Version ``n`` of order ``""`` (partition 0 of 2) with ``events``; ``fields`` change or
    (``None``) leave out its properties."""
    doc: dict[str, Any] = {
        "aggregate_id": "", "version": n, "request_id": f"r{n}", "tenant_id": "(0)", "partition": 0,
        "create_time": 0, "events": list(events),
    }  # fmt: skip
    doc.update(fields)
    return {k: v for k, v in doc.items() if v is not None}


TENANT_LEFT_OUT = Stream(appends=(Append("order", commit(1, tenant_id=None)),))
"""A commit without ``tenant_id`` (the schema's default, ``(0)``): the MongoDB log answered 0 as
the aggregate's last version (its read asked for ``tenant_id: "(0)"``)."""

TENANT_LEFT_OUT_AT_THE_GATE = Stream(
    appends=(
        Append("order", commit(1, scheduled("k", AT - 1), tenant_id=None)),
        Append("order", commit(2, cancelled("k"), tenant_id=None)),
    ),
    fed=1,
)
"""The timer ``k``, due, and a cancel not fed yet, both without ``tenant_id``: the MongoDB log's
check did not see the cancel, and the timer fired."""

PARTITION_LEFT_OUT = Stream(appends=(Append("order", commit(1, scheduled("k", 0), partition=None)),))
"""A commit without ``partition`` (written by the log writer, says the schema: not required): the
MongoDB log never read it, so its timer was never put and nothing was quarantined."""

PARTITION_LEFT_OUT_REFUSED = Stream(
    appends=(Append("order", commit(1, partition=None, version=0), refused="version"),),
)
"""A document the schema refuses, without ``partition``: never read, so never quarantined, by
the MongoDB log."""

VERSION_NO_INTEGER = Stream(
    appends=(
        Append("order", commit(1)),
        Append("order", commit(2, version="2"), refused="version"),
    ),
)
"""A document of the aggregate whose ``version`` is a string, which sorts above every number in
BSON order: the aggregate's last version is its highest integer one still (else a writer would
append at 1, a conflict, again and again)."""

PARTITION_WRITTEN_BY_SOME = Stream(
    appends=(
        Append("order", commit(1, partition=None)),
        Append("order", commit(2)),
        Append("order", commit(3, partition=None)),
    ),
)
"""One aggregate's commits, some with ``partition`` and some without, re-read from the log's
collections: the MongoDB log's index holds them in two ranges, read merged, so the aggregate's
versions come in order and its snapshot folds all three, as the embedded one does."""

OTHER_PARTITIONS = Stream(
    appends=(
        Append("order", commit(1, scheduled("k", 0), partition="0"), refused="partition"),
        Append("order", commit(2, partition=-1), refused="partition"),
        Append("order", commit(3, partition=1)),
        Append("order", commit(4, partition=99)),
    ),
)
"""``partition`` of other values: a string, a negative number, another partition's, one out of
range. The embedded log computes every commit's partition and reads these as the commits they
are; a MongoDB log quarantines each, naming ``partition``."""
