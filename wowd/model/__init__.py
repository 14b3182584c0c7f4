"""The value types every layer shares: identities, commits, timers, snapshots, leases.

All models are frozen dataclasses; validation happens in ``__post_init__`` (or in the
``*_from_doc`` readers for data coming from a store) and raises :class:`InvalidInput` /
:class:`ConfigError` naming the field.
"""

from wowd.model.commits import (
    Checkpoint,
    Commit,
    DomainEvent,
    LogBatch,
    LogEntry,
    Position,
    commit_fields,
    commit_from_doc,
    commit_to_doc,
    unchecked,
)
from wowd.model.ids import (
    DEFAULT_TENANT,
    MAX_BODY_BYTES,
    MAX_STREAM_KEY_BYTES,
    AggregateRef,
    AggregateType,
    java_string_hash,
    partition,
    stream_id,
    validate_name,
)
from wowd.model.leases import (
    AcquireResult,
    Owner,
    SlotLease,
    SlotState,
)
from wowd.model.outbox import (
    AccessStamp,
    OutboxBatch,
    OutboxEntry,
)
from wowd.model.rules import (
    CronRule,
    IntervalRule,
    OnceRule,
    Rule,
    misfired,
    parse_rule,
)
from wowd.model.snapshots import (
    SnapshotRecord,
    SnapshotSaveOutcome,
    SnapshotTable,
)
from wowd.model.timers import (
    Claim,
    Command,
    Timer,
    TimerCancelled,
    TimerChange,
    TimerScheduled,
    TimerStatus,
    TimerWrite,
    deterministic_timer_id,
    net_writes,
    request_id_for,
    sorted_json,
    timer_event_from,
    timer_from_event,
)

__all__ = [
    "DEFAULT_TENANT",
    "MAX_BODY_BYTES",
    "MAX_STREAM_KEY_BYTES",
    "AccessStamp",
    "AcquireResult",
    "AggregateRef",
    "AggregateType",
    "Checkpoint",
    "Claim",
    "Command",
    "Commit",
    "CronRule",
    "DomainEvent",
    "IntervalRule",
    "LogBatch",
    "LogEntry",
    "OnceRule",
    "OutboxBatch",
    "OutboxEntry",
    "Owner",
    "Position",
    "Rule",
    "SlotLease",
    "SlotState",
    "SnapshotRecord",
    "SnapshotSaveOutcome",
    "SnapshotTable",
    "Timer",
    "TimerCancelled",
    "TimerChange",
    "TimerWrite",
    "TimerScheduled",
    "TimerStatus",
    "commit_fields",
    "commit_from_doc",
    "commit_to_doc",
    "deterministic_timer_id",
    "java_string_hash",
    "misfired",
    "net_writes",
    "parse_rule",
    "partition",
    "request_id_for",
    "sorted_json",
    "stream_id",
    "timer_event_from",
    "timer_from_event",
    "unchecked",
    "validate_name",
]
