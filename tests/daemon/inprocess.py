"""``wowd ARGS`` run in the test's own process: for the process tests' commands that read the file
replicas write, or refuse, where the replicas are the processes under test and a new interpreter's
start (about a second) would add nothing."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from pathlib import Path

import anyio

from wowd.cli import main

__all__ = ["wowd_in_process"]

_ONE_AT_A_TIME = threading.Lock()
"""The environment, the working directory and the standard streams are the process's own."""


async def wowd_in_process(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    """``wowd ARGS`` as :func:`~tests.processes.run_wowd` runs it, in a worker thread of
    this process: ``main(ARGS)`` with ``env`` as the environment and ``cwd`` as the working
    directory; answers (exit code, stdout, stderr). The environment, the working directory and
    the logging set up by the command are restored afterwards."""
    with anyio.fail_after(60):
        return await anyio.to_thread.run_sync(_run, list(args), env, cwd)


def _run(args: list[str], env: dict[str, str], cwd: Path | None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in ("aiohttp", "pymongo", "elastic_transport"))]
    with _ONE_AT_A_TIME:
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        saved_handlers = logging.getLogger().handlers[:]
        saved_levels = [lg.level for lg in loggers]
        os.environ.clear()
        os.environ.update(env)
        try:
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(args)
                except SystemExit as exc:  # argparse's refusals
                    code = int(exc.code or 0)
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            logging.getLogger().handlers[:] = saved_handlers
            for lg, level in zip(loggers, saved_levels, strict=True):
                lg.setLevel(level)
    return code, out.getvalue(), err.getvalue()
