"""Black-pipe tests of MongoOutbox's depth: the real async PyMongo driver against MockupDB, each
command asserted and answered as a 7.0 server answers it."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, server_error
from tests.mongo.leases_support import Call, body
from wowd.errors import StorageError
from wowd.stores.base import Ddl
from wowd.stores.mongo.outbox import MongoOutbox

pytestmark = pytest.mark.anyio

OUTBOX = "wow_outbox__ctx"


async def test_the_depth_is_one_count_of_the_collection_without_a_query(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    """The collection's count from its metadata (constant time): no filter, no aggregate that
    would read every entry."""
    box = MongoOutbox(mongo_client, "wowd", context="ctx", ddl=Ddl.NONE, operation_timeout=None)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, box.count)
        req = await wire.command("count")
        assert body(req) == {"count": OUTBOX}
        req.ok(n=200)
        assert await call.result() == 200
        call = Call.start(tg, box.count)
        req = await wire.command("count")
        server_error(req, 13, 'not authorized on wowd to execute command { count: "wow_outbox__ctx", $db: "wowd" }')
        with pytest.raises(StorageError):
            await call.result()


async def test_validate_checks_each_index_of_the_outbox(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    """``ddl=validate`` reads the indexes once and names one missing (both of them: the unique
    request id and ``created_at``, which the retention's trim reads)."""
    from tests.mongo.leases_support import reply_cursor
    from wowd.errors import FormatError

    box = MongoOutbox(mongo_client, "wowd", context="ctx", ddl=Ddl.VALIDATE, operation_timeout=None)
    both = [
        {"v": 2, "key": {"_id": 1}, "name": "_id_"},
        {"v": 2, "key": {"request_id": 1}, "name": "request_id", "unique": True},
        {"v": 2, "key": {"created_at": 1}, "name": "created_at"},
    ]
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, box.prepare)
        req = await wire.command("listIndexes")
        assert body(req)["listIndexes"] == OUTBOX
        reply_cursor(req, OUTBOX, both)
        await call.result()
        call = Call.start(tg, box.prepare)
        reply_cursor(await wire.command("listIndexes"), OUTBOX, both[:2])
        error = await call.error()
        assert isinstance(error, FormatError) and "created_at" in str(error)
