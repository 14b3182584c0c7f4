"""``sd_notify`` without a dependency: datagrams to ``$NOTIFY_SOCKET`` (abstract namespace ``@``).

Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op. A send failure is logged at debug
level and never raised: the daemon works the same with or without a supervisor listening.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["SystemdNotifier"]

log = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET") or None
        if addr is not None and addr.startswith("@"):
            addr = "\0" + addr[1:]
        self._address = addr
        self._watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if usec and (not pid or pid == str(os.getpid())):
            try:
                value = int(usec)
            except ValueError:
                value = 0
            if value > 0:
                self._watchdog_s = value / 1_000_000

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Half of ``WATCHDOG_USEC`` in seconds (how often to send WATCHDOG=1), or None."""
        return None if self._watchdog_s is None else self._watchdog_s / 2

    def notify(self, *lines: str) -> bool:
        """Sends ``lines`` (e.g. ``"READY=1"``, ``"STATUS=..."``) as one datagram."""
        if self._address is None or not lines:
            return False
        payload = "\n".join(line.replace("\n", " ") for line in lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall(payload)
        except OSError as exc:
            log.debug("sd_notify failed: %s", exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")
