"""Command delivery: where a fired timer's command goes. A gateway only sends; when, how many at
once and to whom is the delivery stream's (:mod:`wowd.daemon.stream`).

- :mod:`~wowd.delivery.outcomes`: what a delivery answers (:class:`Delivered`, :class:`Retry`,
  :class:`Park`, :class:`Fail`) and the gateway protocols (:class:`CommandGateway`,
  :class:`BatchGateway`);
- :mod:`~wowd.delivery.outbox`: the ``outbox`` gateway (:class:`OutboxGateway`);
- :mod:`~wowd.delivery.http`: the ``http`` gateway (:class:`HttpGateway`), over
  :mod:`~wowd.delivery.routes` (where each target's commands go), :mod:`~wowd.delivery.commands`
  (a command's URL and body), :mod:`~wowd.delivery.breaker` (a circuit per target) and
  :mod:`~wowd.delivery.log` (the rate-limited outcome log);
- :mod:`~wowd.delivery.signing`: Standard Webhooks signatures, and :func:`verify` for a target
  written in Python.
"""

from wowd.delivery.breaker import CircuitBreaker
from wowd.delivery.commands import command_url, request_parts
from wowd.delivery.http import HttpGateway
from wowd.delivery.log import DeliveryLog, delivery_log
from wowd.delivery.outbox import OutboxGateway
from wowd.delivery.outcomes import (
    BatchGateway,
    CommandGateway,
    Delivered,
    Fail,
    Outcome,
    Park,
    Retry,
    outcome_for_status,
    target_of,
)
from wowd.signing import InvalidSignature, verify

__all__ = [
    "BatchGateway",
    "CircuitBreaker",
    "CommandGateway",
    "Delivered",
    "DeliveryLog",
    "Fail",
    "HttpGateway",
    "InvalidSignature",
    "OutboxGateway",
    "Outcome",
    "Park",
    "Retry",
    "command_url",
    "delivery_log",
    "outcome_for_status",
    "request_parts",
    "target_of",
    "verify",
]
