"""The long-running replica: leases, feed, timer loop, gateway, HTTP health/metrics, systemd.

``Supervisor`` is imported on first use: the commands that use one module of the package (a
rebuild, the HTTP server's parts) do not load the whole replica."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wowd.daemon.supervisor import Supervisor

__all__ = ["Supervisor"]


def __getattr__(name: str) -> Any:
    if name == "Supervisor":
        from wowd.daemon.supervisor import Supervisor

        return Supervisor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
