"""The command line and the one composition root (settings -> backend -> daemon).

One module per command group (``run``, ``check``, ``status``, ``timers``, ``outbox``, ``snapshots``,
``demo``); :mod:`wowd.backends` opens the configured stores; :mod:`wowd.cli.logs` formats the
log lines and masks secrets; :mod:`wowd.cli.output` prints lines and tables.
"""

from wowd.cli.main import main

__all__ = ["main"]
