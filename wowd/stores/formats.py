"""Store formats: what a store records, what this version writes, what it would do to it.

Every store records the layout version ("format") of its tables or collections. At start a
replica creates what is missing, upgrades in place a format it knows how to upgrade, and refuses
any other: a format newer than it knows (a newer wowd upgraded the store) is refused with
:class:`~wowd.errors.FormatTooNew`, naming both formats, like a configuration error (exit 2).
``wowd check`` reads the formats without changing anything and reports each verdict
(:class:`StoreFormat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from wowd import __version__
from wowd.errors import FormatError, FormatTooNew

__all__ = ["Action", "StoreFormat", "other_format", "too_new"]

Action = Literal["create", "nothing", "upgrade", "refuse"]
"""What a replica of this version does to a store at start: creates it (nothing recorded yet),
nothing (the format it writes), upgrades it in place, or refuses to start."""


@dataclass(frozen=True, slots=True)
class StoreFormat:
    """One store's recorded format and this version's."""

    store: str
    """The store and its table or collection (``embedded log``, ``timers wow_timer__demo``)."""
    found: int | None
    """The format recorded (``None``: nothing recorded yet)."""
    current: int
    """The format this version writes."""
    upgrades_from: int | None = None
    """The older format this version upgrades in place, if any."""

    @property
    def action(self) -> Action:
        if self.found is None:
            return "create"
        if self.found == self.current:
            return "nothing"
        if self.upgrades_from is not None and self.found == self.upgrades_from:
            return "upgrade"
        return "refuse"

    @property
    def newer(self) -> bool:
        """Recorded by a newer version than this one."""
        return self.found is not None and self.found > self.current

    def describe(self) -> str:
        """One line: the formats and what this version would do."""
        action = self.action
        if action == "create":
            return f"{self.store}: nothing recorded yet (format {self.current} is created at the first start)"
        if action == "nothing":
            return f"{self.store}: format {self.found}, this wowd's: nothing to do"
        if action == "upgrade":
            return (
                f"{self.store}: format {self.found}, upgraded in place to {self.current} at the next start of "
                "wowd run (DDL auto)"
            )
        return str(other_format(self.store, self.found, self.current))


def too_new(store: str, found: int, current: int) -> FormatTooNew:
    """The refusal of a store recorded in a format newer than this version's ``current``."""
    return FormatTooNew(
        f"{store} is recorded in format {found}, newer than this wowd {__version__} knows (format {current}): "
        "a newer wowd upgraded it; run that version (or restore a backup taken before the upgrade)"
    )


def other_format(store: str, found: int | None, current: int) -> FormatError:
    """The refusal of a store recorded in a format this version neither writes nor upgrades:
    :func:`too_new` for a newer one, else a :class:`FormatError`."""
    if isinstance(found, int) and found > current:
        return too_new(store, found, current)
    return FormatError(f"{store} is recorded in format {found!r}, this wowd {__version__} writes format {current}")
