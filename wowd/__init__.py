"""wowd: a worker daemon for Wow-style event-sourced bounded contexts.

Public names only; the daemon is started by the ``wowd`` console script (``wowd.cli``).
"""

__version__ = "0.1.0"

from wowd.errors import ConfigError, StorageError, StorageUnavailable, WowdError
from wowd.model import AggregateRef, AggregateType, Commit, DomainEvent, Timer, partition

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
