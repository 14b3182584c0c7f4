"""A MongoDB simulator for tests: a replica-set primary speaking the wire protocol to the real
PyMongo driver, with query semantics from mongomock (docs/mongosim.md).

``serving()`` starts one in this process (the tests' fixture); ``python -m tests.mongosim --port
N`` runs one as a process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.mongosim.engine import Engine, Settings
from tests.mongosim.wire import WireServer

__all__ = ["Engine", "Settings", "WireServer", "serving"]


@contextmanager
def serving(settings: Settings | None = None, *, port: int = 0) -> Iterator[WireServer]:
    """A started simulator on ``127.0.0.1`` (``port`` 0: a free one); stopped on exit."""
    server = WireServer(Engine(settings), port=port)
    server.start()
    try:
        yield server
    finally:
        server.stop()
