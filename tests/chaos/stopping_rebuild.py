"""``wowd timers rebuild`` that stops itself (SIGSTOP) when its replay is done and before it
carries the old view over, on either backend: the chaos harness SIGKILLs it there, at a known
point partway (the lock taken, the shadow written, the live view untouched), however fast the
rebuild of a short log would otherwise swap in.

Run as ``python -m tests.chaos.stopping_rebuild [wowd timers rebuild arguments]``; :func:`stopped`
tells when it has stopped."""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from wowd.cli import main
from wowd.stores.embedded.timer_rebuild import EmbeddedTimerRebuild
from wowd.stores.mongo.timer_rebuild import MongoTimerRebuild

STOPPED_LINE = "stopping before the carry-over"


def _stopping(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def stop_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        print(STOPPED_LINE, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return await method(self, *args, **kwargs)

    return stop_first


async def stopped(pid: int) -> None:
    """Returns once process ``pid`` is stopped (``T`` in ``/proc/PID/stat``) or gone."""
    stat = anyio.Path(f"/proc/{pid}/stat")
    while True:
        try:
            state = (await stat.read_text()).rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        await anyio.sleep(0.01)


def run(argv: list[str]) -> int:
    """The rebuild with its stop (the patch is made here, never on import: the harness imports
    :data:`STOPPED_LINE`)."""
    EmbeddedTimerRebuild.carry_over = _stopping(EmbeddedTimerRebuild.carry_over)  # type: ignore[method-assign]
    MongoTimerRebuild.carry = _stopping(MongoTimerRebuild.carry)  # type: ignore[method-assign]
    return main(["timers", "rebuild", *argv])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
