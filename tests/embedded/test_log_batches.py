"""The embedded log bounds a batch by its documents' bytes as well as by its number of commits."""

from __future__ import annotations

from pathlib import Path

import pytest

from wowd.model import AggregateRef, Commit, DomainEvent
from wowd.stores.embedded import log as embedded_log
from wowd.stores.embedded.log import EmbeddedLog

pytestmark = pytest.mark.anyio


def commit(i: int, pad: int) -> Commit:
    ref = AggregateRef(context="ctx", aggregate="order", id=f"o-{i}")
    ev = DomainEvent(id=str(i), name="ItemAdded", body={"pad": "x" * pad})
    return Commit(ref=ref, version=1, command_id=str(i), request_id=str(i), create_time=1, events=(ev,))


async def test_a_batch_ends_after_the_commit_that_passes_the_byte_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded_log, "BATCH_BYTES", 10_000)
    log = EmbeddedLog(tmp_path / "wowd.db", context="ctx", partitions=4)
    try:
        await log.append_many([commit(i, 3_000) for i in range(10)])
        batches = [b async for b in log.read({p: None for p in range(4)}, batch_size=500, follow=False)]
    finally:
        await log.close()
    sizes = [len(b.entries) for b in batches if b.entries]
    # about 3 KB each: a batch stops at the fourth document (12 KB >= 10 KB), every commit read once
    assert sizes == [4, 4, 2]
    assert [b.watermark is not None for b in batches if b.entries] == [False, False, True]
    read = sorted(e.commit.ref.id for b in batches for e in b.entries if e.commit)
    assert read == sorted(f"o-{i}" for i in range(10))
