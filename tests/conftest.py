from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests, then the ones starting processes, first: run on several workers
    (``-n``), the longest start early instead of ending the run alone."""

    def rank(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("process") else 2

    items.sort(key=rank)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
