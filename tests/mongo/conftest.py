"""Black-pipe fixtures: the real PyMongo async driver over a socket to a MockupDB server.

MockupDB serves from its own thread; its blocking ``receives()`` runs through
``anyio.to_thread.run_sync`` (``Wire.receives``). A test starts the store call in a task group,
then receives each command, asserts its document, and scripts the answer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import anyio
import bson
import pytest
from mockupdb import MockupDB, Request
from pymongo import AsyncMongoClient

CODE_NAMES = {
    9: "FailedToParse",
    13: "Unauthorized",
    14: "TypeMismatch",
    26: "NamespaceNotFound",
    43: "CursorNotFound",
    48: "NamespaceExists",
    50: "MaxTimeMSExpired",
    64: "WriteConcernFailed",
    133: "FailedToSatisfyReadPreference",
    134: "ReadConcernMajorityNotAvailableYet",
    136: "CappedPositionLost",
    175: "QueryPlanKilled",
    280: "ChangeStreamFatalError",
    251: "NoSuchTransaction",
    286: "ChangeStreamHistoryLost",
    10107: "NotWritablePrimary",
    10334: "BSONObjectTooLarge",
    11000: "DuplicateKey",
    11601: "Interrupted",
    112: "WriteConflict",
    13388: "StaleConfig",
    11602: "InterruptedDueToReplStateChange",
    40573: "Location40573",
    7749501: "Location7749501",
}
"""The ``codeName`` a 7.0 server sends with each code the tests script (src/mongo/base/error_codes.yml;
a ``uassert`` code without a name there is ``Location<code>``; 64 is ``WriteConcernTimeout`` from 8.1)."""


def server_error(request: Request, code: int, errmsg: str, *, labels: tuple[str, ...] = ()) -> None:
    """Answers ``request`` with a command error shaped as a 7.0+ server sends it: ``ok: 0``, the
    code, its ``codeName``, the message and, when the server attaches them, ``errorLabels``."""
    reply: dict[str, Any] = {"ok": 0, "errmsg": errmsg, "code": code, "codeName": CODE_NAMES[code]}
    if labels:
        reply["errorLabels"] = list(labels)
    request.replies(reply)


def write_concern_timeout(w: str = "majority", wtimeout: int = 5000) -> dict[str, Any]:
    """A ``writeConcernError`` as 7.0 sends it when replication did not reach ``w`` in time."""
    return {
        "code": 64,
        "codeName": "WriteConcernFailed",
        "errmsg": "waiting for replication timed out",
        "errInfo": {"wtimeout": True, "writeConcern": {"w": w, "wtimeout": wtimeout, "provenance": "clientSupplied"}},
    }


class Wire:
    def __init__(self, server: MockupDB) -> None:
        self.server = server

    async def receives(self, *args: Any, timeout: float = 10, **kwargs: Any) -> Request:  # noqa: ASYNC109
        """The next request the driver sent (heartbeats are answered by MockupDB itself). A request
        whose connection the driver closed before it was matched is passed over, as a server
        drops it: nothing can answer it, and MockupDB's matcher, which reads the peer's address,
        raises ``OSError`` on it."""
        deadline = anyio.current_time() + timeout
        while True:
            left = max(deadline - anyio.current_time(), 0.001)
            try:
                return await anyio.to_thread.run_sync(partial(self.server.receives, *args, timeout=left, **kwargs))
            except OSError:
                continue

    async def command(self, name: str, timeout: float = 10) -> Request:  # noqa: ASYNC109
        """The next request, asserted to be the command ``name``."""
        req = await self.receives(timeout=timeout)
        assert req.command_name == name, f"expected {name}, got {req.command_name}: {req.doc}"
        return req


REPR_LIMIT = 64 * 1024
"""Requests of more BSON bytes are named, not spelled out, by their ``repr`` (:func:`bounded_reprs`)."""


@pytest.fixture(autouse=True, scope="session")
def bounded_reprs() -> Iterator[None]:
    """MockupDB formats every request it receives for its log, verbose or not (``%r``, through
    ``json_util.dumps``): an aggregation of thousands of stages (megabytes) takes a good part of
    a second each. A request over :data:`REPR_LIMIT` is named by its command and size instead;
    the smaller ones read as MockupDB spells them."""
    spelled = Request.__repr__

    def bounded(self: Request) -> str:
        size = sum(len(bson.encode(d)) for d in self.docs)
        if size <= REPR_LIMIT:
            return spelled(self)
        return f"{type(self).__name__}({getattr(self, 'command_name', None)!r}: {size} bytes of BSON)"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Request, "__repr__", bounded)
        yield


def unanswered(server: MockupDB) -> list[Request]:
    """The requests ``server`` received that nobody took, taken now (``receives(timeout=0)``
    would first wait out its queue's 50 ms poll, after every test that drains so)."""
    taken: list[Request] = []
    while True:
        try:
            taken.append(server._request_q.get(block=False))
        except queue.Empty:
            return taken


_STOPPING: list[threading.Thread] = []


@contextmanager
def serving(server: MockupDB) -> Iterator[MockupDB]:
    """Runs ``server``; on exit stops it on a thread of its own: ``MockupDB.stop()`` waits out its
    accept loop's one-second poll, which the next test need not wait for (the session joins it)."""
    server.run()
    try:
        yield server
    finally:
        stop = threading.Thread(target=server.stop, name="mockupdb-stop", daemon=True)
        stop.start()
        _STOPPING.append(stop)


def pytest_sessionfinish() -> None:
    for stop in _STOPPING:
        stop.join(15)


@contextmanager
def primary(replica_set: str | None = None) -> Iterator[MockupDB]:
    """A MockupDB answering ``hello``/``isMaster`` as a MongoDB 7.0 primary (wire version 21):
    standalone, or the primary of ``replica_set`` (the one member of its host list)."""
    if replica_set is None:
        with serving(MockupDB(auto_ismaster={"maxWireVersion": 21}, verbose=False)) as server:
            yield server
        return
    with serving(MockupDB(verbose=False)) as server:
        addr = f"localhost:{server.port}"
        server.autoresponds(
            "ismaster",
            {
                "ismaster": True,
                "isWritablePrimary": True,
                "setName": replica_set,
                "hosts": [addr],
                "primary": addr,
                "me": addr,
                "minWireVersion": 0,
                "maxWireVersion": 21,
                "logicalSessionTimeoutMinutes": 30,
            },
        )
        yield server


@pytest.fixture
def mock_server() -> Iterator[MockupDB]:
    with primary() as server:
        yield server


@pytest.fixture
def wire(mock_server: MockupDB) -> Wire:
    return Wire(mock_server)


@pytest.fixture
async def mongo_client(mock_server: MockupDB) -> AsyncIterator[AsyncMongoClient[Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        mock_server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False
    )
    try:
        yield client
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await client.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
