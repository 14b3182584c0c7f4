"""The long-running replica: leases, feed, timer loop, gateway, HTTP health/metrics, systemd."""

from wowd.daemon.supervisor import Supervisor

__all__ = ["Supervisor"]
