"""A timer view rebuild's progress lines: how far the replay is, against the log's size when it
began, and what it says once commits appended since then are read too."""

from __future__ import annotations

from typing import Any, cast

import pytest

from wowd.config import WowdSettings
from wowd.daemon.timer_rebuild import SO_FAR, TimerRebuilder, TimerRebuildReport
from wowd.stores.base import Backend, TimerViewRebuild

pytestmark = pytest.mark.anyio


class Counted:
    """A rebuild that counts 7 live timers in its new view."""

    async def live_count(self) -> int:
        return 7


async def lines_of(*reports: TimerRebuildReport) -> list[str]:
    lines: list[str] = []
    rebuilder = TimerRebuilder(WowdSettings(), cast(Backend, None), progress=lines.append)
    for report in reports:
        await rebuilder._line(cast(TimerViewRebuild, cast(Any, Counted())), report, last=True)
    return lines


async def test_a_progress_line_says_how_far_the_replay_is_against_the_log_when_it_began() -> None:
    assert await lines_of(
        TimerRebuildReport(context="c", aggregate=None, commits=1_000, total=4_000),
        TimerRebuildReport(context="c", aggregate=None, commits=4_000, total=4_000),
        TimerRebuildReport(context="c", aggregate=None, commits=10),
    ) == [
        f"rebuild: 1000 of 4000 commits read (25%), 7 {SO_FAR}",
        f"rebuild: 4000 of 4000 commits read (100%), 7 {SO_FAR}",
        f"rebuild: 10 commits read, 7 {SO_FAR}",
    ]


async def test_commits_appended_since_the_replay_began_are_counted_without_a_share_past_the_whole() -> None:
    [line] = await lines_of(TimerRebuildReport(context="c", aggregate=None, commits=4_554, total=4_547))
    assert line == f"rebuild: 4554 commits read (the log held 4547 when the replay began), 7 {SO_FAR}"
