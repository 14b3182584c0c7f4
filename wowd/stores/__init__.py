"""Stores: the protocols and :class:`~wowd.stores.base.Backend` in :mod:`wowd.stores.base`, one
subpackage per backend (``embedded``, ``mongo``, ``elasticsearch``).

Nothing here imports a backend: the composition root (:mod:`wowd.backends`) opens one, so a
user of the embedded default never imports pymongo.
"""

from wowd.stores.base import Backend

__all__ = ["Backend"]
