"""The three timer stores of one table (embedded) or one registry of collections (MongoDB), made
together as a backend makes them: the view the feed writes, firing, and the operators' reads.
For the tests of one backend's timer stores; the contract suites have their own factories."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from wowd.stores.embedded.db import SqliteDatabase
    from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring
    from wowd.stores.embedded.timer_queries import EmbeddedTimerQueries
    from wowd.stores.embedded.timer_view import EmbeddedTimerView
    from wowd.stores.mongo.timer_firing import MongoTimerFiring
    from wowd.stores.mongo.timer_queries import MongoTimerQueries
    from wowd.stores.mongo.timer_view import MongoTimerView


class EmbeddedTimers(NamedTuple):
    """The embedded timer stores on one connection (``db``: closed by :meth:`close` when the
    stores opened it)."""

    view: EmbeddedTimerView
    firing: EmbeddedTimerFiring
    queries: EmbeddedTimerQueries
    db: SqliteDatabase | None = None

    async def prepare(self) -> None:
        await self.view.prepare()

    async def close(self) -> None:
        for store in (self.view, self.firing, self.queries):
            await store.close()
        if self.db is not None:
            self.db.close()


def embedded_timers(
    db_or_path: SqliteDatabase | str | Path,
    *,
    context: str,
    partitions: int,
    firing: type[EmbeddedTimerFiring] | None = None,
    **firing_options: Any,
) -> EmbeddedTimers:
    """The three embedded timer stores of ``context`` on one connection of the file (or on the
    connection ``db_or_path``, which the caller closes); ``firing``: a subclass of the firing
    store (one that counts its calls), made with ``firing_options`` too."""
    from wowd.stores.embedded.db import SqliteDatabase
    from wowd.stores.embedded.timer_firing import EmbeddedTimerFiring
    from wowd.stores.embedded.timer_queries import EmbeddedTimerQueries
    from wowd.stores.embedded.timer_view import EmbeddedTimerView

    owned = None if isinstance(db_or_path, SqliteDatabase) else SqliteDatabase(db_or_path)
    db = db_or_path if owned is None else owned
    assert isinstance(db, SqliteDatabase)
    kw: dict[str, Any] = {"context": context, "partitions": partitions}
    fire = (firing or EmbeddedTimerFiring)(db, **kw, **firing_options)
    return EmbeddedTimers(EmbeddedTimerView(db, **kw), fire, EmbeddedTimerQueries(db, **kw), owned)


class MongoTimers(NamedTuple):
    """The MongoDB timer stores on one registry of collections and one client."""

    view: MongoTimerView
    firing: MongoTimerFiring
    queries: MongoTimerQueries

    async def prepare(self) -> None:
        await self.view.prepare()

    async def close(self) -> None:
        await self.view.close()


def mongo_timers(client: Any, database: str, **options: Any) -> MongoTimers:
    """The three MongoDB timer stores of ``database`` (``options``: the view's, for all three)."""
    from wowd.stores.mongo.timer_firing import MongoTimerFiring
    from wowd.stores.mongo.timer_queries import MongoTimerQueries
    from wowd.stores.mongo.timer_view import MongoTimerView

    view = MongoTimerView(client, database, **options)
    return MongoTimers(view, view.sibling(MongoTimerFiring), view.sibling(MongoTimerQueries))
