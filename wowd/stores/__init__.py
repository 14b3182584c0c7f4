"""Stores: the protocols in :mod:`wowd.stores.base`, one subpackage per backend.

Backends are imported only when used: a user of the embedded default never imports pymongo.
"""

from wowd.stores.backend import Backend, open_backend

__all__ = ["Backend", "open_backend"]
