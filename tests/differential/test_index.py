"""The event index of a stream: the embedded index and Elasticsearch (the fake, behind the MongoDB
backend) hold the same documents, with the same access attributes once stamps have run, and set
aside the same commits. The index does not depend on how the MongoDB log is deployed: the
sharded simulator is left out here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given

from tests.differential import backends, compare
from tests.differential.conftest import SHRINKING, sized
from tests.differential.schema_draw import Stream, streams
from tests.differential.test_streams import report

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


@SHRINKING
@sized(10)
@given(stream=streams())
def test_the_event_index_holds_the_same_documents_everywhere(run: Callable[..., Any], stream: Stream) -> None:
    held = run(backends.run, stream, (backends.EMBEDDED, backends.MONGO), index=True)
    problems = compare.index(held) + compare.quarantine(stream, held)
    assert not problems, report(stream, problems)
