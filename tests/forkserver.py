"""``python -m wowd ...`` processes for the tests, forked from a server that imported wowd once.

A process test starts dozens of ``wowd`` processes, and each would spend about half a second
importing (pydantic settings, the stores, the daemon) before it does what the test is about. Like
``multiprocessing``'s forkserver, one server per test process imports those modules once; each
start is then a fork of it that runs the module as ``python -m`` does
(:func:`runpy.run_module` with ``alter_sys``), with the test's arguments, environment, working
directory and standard streams, and exits as the interpreter would: ``SystemExit``'s code, 1 and
a traceback for an uncaught exception, non-daemon threads joined, then the ``atexit`` handlers
(logging's flush among them).

The forked process is the test's child, as a ``subprocess`` one is: the server forks twice and the
test process is a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux), so the kernel hands the
process to it; it waits for it, signals it and reads its ``/proc/PID/stat`` like any child.

What differs from an interpreter started afresh: the modules are imported before the environment
is set (wowd reads its settings and ``os.environ`` at run time, never at import), variables the
interpreter reads at its own start (``PYTHONPATH``, ``PYTHONHASHSEED``, ``-X`` options) are the
server's, and ``PYTHONUNBUFFERED`` is applied to the new standard streams. Where that matters, or
on a platform without a subreaper, ``WOWD_TEST_FORKSERVER=0`` runs every such process afresh
(:data:`ENABLED`), as the tests that assert a process's start itself always do.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import io
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO, Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = (
    "wowd.cli",
    "wowd.daemon.supervisor",
    "wowd.daemon.timer_rebuild",
    "wowd.stores.embedded",
    "wowd.stores.mongo",
    "wowd.stores.elasticsearch",
)
"""What the server imports once: everything ``wowd run``, ``wowd timers rebuild`` and the
stopping rebuild import on their way."""
PR_SET_CHILD_SUBREAPER = 36
"""``prctl`` option (linux/prctl.h)."""

ENABLED = os.environ.get("WOWD_TEST_FORKSERVER", "1") != "0" and sys.platform == "linux"


# --------------------------------------------------------------------------- the server


_SERVER_SOCKET: socket.socket | None = None


def _serve(fd: int) -> None:
    global _SERVER_SOCKET
    sock = _SERVER_SOCKET = socket.socket(fileno=fd)
    for name in PRELOAD:
        importlib.import_module(name)
    sock.send(b"ready")
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
        except OSError:
            return
        if not msg:
            return  # the test process is gone
        request = json.loads(msg)
        try:
            pid = _fork_twice(request, fds)
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(str(pid).encode())


def _fork_twice(request: dict[str, Any], fds: list[int]) -> int:
    """Forks a child that forks the process and exits at once; answers the process's pid (by
    then the test process's child)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _run(request, fds)  # never returns
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    with os.fdopen(r, "rb") as answer:
        return int(answer.read())


def _run(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked process: the test's streams, directory and environment, then the module as
    ``python -m`` runs it; exits as the interpreter would."""
    code: int = 1
    try:
        if _SERVER_SOCKET is not None:
            _SERVER_SOCKET.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered, line_buffering=unbuffered
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own end: non-daemon threads joined
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001  # a closed pipe: nothing more to write
                pass
    except BaseException:  # the process could not be set up (a directory gone, a stream closed)
        traceback.print_exc()
    finally:
        os._exit(code & 0xFF)


# --------------------------------------------------------------------------- the test's side


class _Server:
    def __init__(self) -> None:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, tests.forkserver as f; f._serve(int(sys.argv[1]))",
                str(theirs.fileno()),
            ],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self._ready = False

    def fork(self, module: str, args: Sequence[str], env: dict[str, str], cwd: Path, fds: Sequence[int]) -> int:
        request = json.dumps({"module": module, "args": list(args), "env": env, "cwd": str(cwd)}).encode()
        with self.lock:
            if not self._ready:  # its imports done
                if self.sock.recv(16) != b"ready":
                    raise RuntimeError("the fork server did not start")
                self._ready = True
            socket.send_fds(self.sock, [request], list(fds))
            return int(self.sock.recv(32))


_server: _Server | None = None
_server_lock = threading.Lock()


def start() -> None:
    """Starts the server now, its imports running while the caller goes on (the first fork waits
    for them)."""
    _get_server()


def _get_server() -> _Server | None:
    global _server, ENABLED
    if not ENABLED:
        return None
    with _server_lock:
        if _server is None:
            try:
                _server = _Server()
            except OSError:
                ENABLED = False
                return None
    return _server


def _module_of(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """``python -m MODULE ARGS`` as (module, args); None for any other command."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2], list(command[3:])
    return None


def _fd(stream: int | IO[Any] | None, default: int) -> tuple[int, bool]:
    """The descriptor to hand over for ``stream`` (``subprocess``'s conventions), and whether it
    is ours to close."""
    if stream is None:
        return os.dup(default), True
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(stream, int):
        return stream, False
    return stream.fileno(), False


class Forked:
    """A forked process as ``subprocess.Popen`` shows one: ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill`` (and ``stdout``/``stderr`` when piped)."""

    def __init__(self, pid: int, stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        """Readable once the process has exited (Linux 5.3)."""
        # ChildProcessError if the kernel did not hand it to this process (nothing reaped here)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                os.close(self.pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            readable, _, _ = select.select([self.pidfd], [], [], timeout)
            if not readable:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return self.poll()  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """What the piped ``stdout`` and ``stderr`` carried until they closed, once the process
        has exited (``subprocess.Popen.communicate`` with no input; ``b""`` for a stream not
        piped)."""
        pipes = [p for p in (self.stdout, self.stderr) if p is not None]
        chunks: dict[int, list[bytes]] = {p.fileno(): [] for p in pipes}
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                ready = selector.select(timeout)
                if not ready:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
                for key, _events in ready:
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        out, err = (b"".join(chunks[p.fileno()]) if p is not None else b"" for p in (self.stdout, self.stderr))
        for p in pipes:
            p.close()
        self.wait(timeout)
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(
    command: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path | str | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
) -> Forked | subprocess.Popen[bytes]:
    """``subprocess.Popen(command, ...)``; forked from the server when ``command`` is
    ``[sys.executable, "-m", MODULE, ...]`` and the server runs."""
    target = _module_of(command)
    server = _get_server() if target else None
    if server is None or target is None:
        return subprocess.Popen(list(command), env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
    if stdin == subprocess.PIPE:
        raise ValueError("a forked process's stdin is a file or DEVNULL, not a pipe")
    pipes: dict[int, IO[bytes]] = {}
    """The read ends of the piped output streams, by their descriptor in the process (1, 2)."""
    mine: list[int] = []
    fds: list[int] = []
    for stream, default in ((stdin, 0), (stdout, 1), (stderr, 2)):
        if stream == subprocess.PIPE:
            r, w = os.pipe()
            pipes[default] = os.fdopen(r, "rb")
            fds.append(w)
            mine.append(w)
        elif stream == subprocess.STDOUT:
            fds.append(fds[1])
        else:
            fd, close = _fd(stream, default)
            fds.append(fd)
            if close:
                mine.append(fd)
    try:
        pid = server.fork(target[0], target[1], env, Path(cwd or os.getcwd()).resolve(), fds)
    finally:
        for fd in mine:
            os.close(fd)
    return Forked(pid, stdout=pipes.get(1), stderr=pipes.get(2))


class _PipeStream:
    """The read end of a pipe as an anyio byte stream (``receive``, ``async for``)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        os.set_blocking(file.fileno(), False)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            try:
                data = os.read(self._file.fileno(), max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._file.fileno())
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            try:
                yield await self.receive()
            except anyio.EndOfStream:
                return

    async def aclose(self) -> None:
        self._file.close()


class AsyncForked:
    """A forked process as ``anyio.abc.Process`` shows one."""

    def __init__(self, forked: Forked) -> None:
        self._forked = forked
        self.pid = forked.pid
        self.stdout = _PipeStream(forked.stdout) if forked.stdout is not None else None
        self.stderr = _PipeStream(forked.stderr) if forked.stderr is not None else None

    @property
    def returncode(self) -> int | None:
        return self._forked.poll()

    async def wait(self) -> int:
        if self._forked.poll() is None:
            await anyio.wait_readable(self._forked.pidfd)
        return self._forked.wait()

    def send_signal(self, sig: int) -> None:
        self._forked.send_signal(sig)

    def terminate(self) -> None:
        self._forked.terminate()

    def kill(self) -> None:
        self._forked.kill()

    async def aclose(self) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                await stream.aclose()
        if self._forked.poll() is None:
            with anyio.CancelScope(shield=True):
                await self.wait()


async def open_process(
    command: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path | str | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    stdout: int | IO[Any] | None = subprocess.PIPE,
    stderr: int | IO[Any] | None = subprocess.PIPE,
) -> Any:
    """``anyio.open_process(command, ...)``; forked from the server as :func:`popen` is."""
    target = _module_of(command)
    if target is None or _get_server() is None:
        return await anyio.open_process(list(command), env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
    return AsyncForked(popen(command, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr))  # type: ignore[arg-type]


async def run_process(
    command: Sequence[str], *, env: dict[str, str], cwd: Path | str | None = None
) -> tuple[int, bytes, bytes]:
    """``anyio.run_process(command, check=False)``: (exit code, stdout, stderr)."""
    proc = await open_process(command, env=env, cwd=cwd)
    out: list[bytes] = []
    err: list[bytes] = []

    async def drain(stream: Any, into: list[bytes]) -> None:
        async for chunk in stream:
            into.append(chunk)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, proc.stdout, out)
            tg.start_soon(drain, proc.stderr, err)
        code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()
    return code, b"".join(out), b"".join(err)
