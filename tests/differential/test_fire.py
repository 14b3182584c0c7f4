"""The fire decision at a due time, with the end of the stream appended but not fed yet: each
backend's gate holds back, fires or skips (past its misfire grace) each due timer alike, within
the latitude the log check has (tests/differential/compare.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given

from tests.differential import backends, cases, compare
from tests.differential.conftest import SHRINKING, sized
from tests.differential.schema_draw import Stream, streams
from tests.differential.test_streams import report

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


@SHRINKING
@sized(10)
@given(stream=streams(fire=True))
@example(stream=cases.TENANT_LEFT_OUT_AT_THE_GATE)
def test_each_backend_decides_alike_which_due_timers_fire(run: Callable[..., Any], stream: Stream) -> None:
    held = run(backends.run, stream, decide=True)
    problems = compare.decisions(stream, held) + compare.timers(held) + compare.last_versions(stream, held)
    assert not problems, report(stream, problems)
