"""Log lines of the process: text on a terminal, JSON lines otherwise, every secret masked."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from wowd.config import WowdSettings
from wowd.fmt import one_line
from wowd.redaction import redact, secret_values

__all__ = ["LogFormatter", "json_logs", "redact", "secret_values", "setup_logging"]

_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class LogFormatter(logging.Formatter):
    """Text or JSON lines; a record's extra fields are appended; every secret value is masked;
    a text line's control characters are escaped."""

    def __init__(self, json_lines: bool, secrets: list[str]) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._json = json_lines
        self._secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in vars(record).items() if k not in _STD_ATTRS and not k.startswith("_")}
        if self._json:
            doc: dict[str, Any] = {
                "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
            }
            doc.update({k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in extras.items()})
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            line = json.dumps(doc, ensure_ascii=False)
        else:
            line = super().format(record)
            if extras:
                line += " [" + " ".join(f"{k}={one_line(str(v))}" for k, v in extras.items()) + "]"
        return redact(line, self._secrets)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        """A text line's message on one line, its control characters escaped (an id, a key or a
        target's answer cannot forge a line or send a terminal escape); a traceback, added after
        it, keeps its lines. JSON lines escape them as JSON does."""
        return one_line(super().formatMessage(record))


def json_logs(settings: WowdSettings, stream: TextIO | None = None) -> bool:
    """Whether the log lines are JSON: ``log_format`` json, or auto and ``stream`` (standard
    error) not a terminal."""
    fmt = settings.log_format
    return fmt == "json" or (fmt == "auto" and not (stream or sys.stderr).isatty())


def setup_logging(settings: WowdSettings, stream: TextIO | None = None) -> None:
    """One handler on the root logger, at ``settings.log_level``; drivers' chatter at WARNING."""
    stream = stream or sys.stderr
    json_lines = json_logs(settings, stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogFormatter(json_lines, secret_values(settings)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    for noisy in ("aiohttp", "pymongo", "elastic_transport"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
