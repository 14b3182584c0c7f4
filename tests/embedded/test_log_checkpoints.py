"""The embedded checkpoints' writes in the caller's transaction (a feed batch's): a write naming
no consumer writes nothing and is not taken for a refusal by a higher fence."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import CONTEXT
from wowd.stores.embedded.checkpoints import EmbeddedCheckpoints

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_checkpoint_write_naming_no_consumer_writes_nothing_and_is_not_refused(db_path: Path) -> None:
    checkpoints = EmbeddedCheckpoints(db_path, context=CONTEXT)
    try:
        assert await checkpoints.save_all([], {0: {"seq": 3}, 1: {"seq": 4}}, 2) is True
        assert await checkpoints.read("feed", [0, 1]) == {}
    finally:
        await checkpoints.close()
