"""The status page served by each replica's HTTP listener (``/ui``, ``/api/v1``): see
:mod:`wowd.ui.app`."""

from wowd.ui.app import StatusPage

__all__ = ["StatusPage"]
