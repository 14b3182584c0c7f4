"""wowd: a worker daemon for Wow-style event-sourced bounded contexts.

Public names only; the daemon is started by the ``wowd`` console script (``wowd.cli``).
"""

from importlib.metadata import PackageNotFoundError, version

from wowd.errors import ConfigError, StorageError, StorageUnavailable, WowdError
from wowd.model import AggregateRef, AggregateType, Commit, DomainEvent, Timer, partition

try:
    __version__ = version("wowd")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "AggregateRef",
    "AggregateType",
    "Commit",
    "ConfigError",
    "DomainEvent",
    "StorageError",
    "StorageUnavailable",
    "Timer",
    "WowdError",
    "__version__",
    "partition",
]
