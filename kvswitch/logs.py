"""Log lines for the command line: one line per record, as key=value pairs or as JSON.

Fields, in order: ``ts`` (UTC), ``level``, the process's own fields (a worker's ``worker_id``,
so that the lines of several workers on one terminal tell apart), ``logger``, ``msg``, then
whatever the call passed in
``extra`` (``logger.info("...", extra={"request_id": request_id})`` gives a ``request_id``
field, so one request can be followed through the router and its workers), then ``exc`` with
the traceback, if any::

    ts=2025-01-31T12:00:00.123Z level=INFO logger=worker.server msg="stop after 8 ..." request_id=r1
    {"ts": "2025-01-31T12:00:00.123Z", "level": "INFO", ..., "request_id": "r1"}

The commands read the format and level from the environment: ``KVSWITCH_LOG_FORMAT=json``
(default text), ``KVSWITCH_LOG_LEVEL=DEBUG`` (default INFO).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

LOG_FORMAT_ENV = "KVSWITCH_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
LOG_LEVEL_ENV = "KVSWITCH_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# What every LogRecord carries; any other attribute of a record came in through ``extra``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


@dataclass(frozen=True)
class LogSettings:
    """How a process logs; an engine core process takes its serving process's."""

    level: int | str = "INFO"
    json: bool = False
    process_fields: tuple[tuple[str, str], ...] = ()  # on every line, after the level


class _Formatter(logging.Formatter):
    def __init__(self, process_fields: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__()
        self.process_fields = process_fields


def _fields(record: logging.LogRecord, formatter: _Formatter) -> dict[str, Any]:
    timestamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    fields: dict[str, Any] = {
        "ts": f"{timestamp}.{int(record.msecs):03d}Z",
        "level": record.levelname,
        **dict(formatter.process_fields),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES)
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    if record.stack_info:
        fields["stack"] = formatter.formatStack(record.stack_info)
    return fields


class KeyValueFormatter(_Formatter):
    """``key=value`` pairs; a value with a space, quote, ``=`` or newline is quoted and escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_quote(v)}" for k, v in _fields(record, self).items())


class JsonFormatter(_Formatter):
    """One JSON object per line; values JSON cannot hold are written as their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), default=str, ensure_ascii=False)


def _quote(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\\\n\r\t'):
        return text
    return json.dumps(text, ensure_ascii=False)


def configure_logging(
    level: int | str = "INFO",
    json: bool = False,
    process_fields: Mapping[str, str] | tuple[tuple[str, str], ...] = (),
) -> None:
    """Send every log record at ``level`` and above to stderr, as key=value pairs or JSON lines,
    each with ``process_fields``. Replaces whatever handlers the root logger had."""
    fields = tuple(dict(process_fields).items())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(fields) if json else KeyValueFormatter(fields))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def log_settings() -> LogSettings:
    """How this process logs now (for a process it starts to log alike)."""
    root = logging.getLogger()
    formatter = next(
        (h.formatter for h in root.handlers if isinstance(h.formatter, _Formatter)), None
    )
    return LogSettings(
        root.getEffectiveLevel(),
        isinstance(formatter, JsonFormatter),
        formatter.process_fields if formatter is not None else (),
    )


def log_format_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``KVSWITCH_LOG_FORMAT``: "text" (the default, also when empty) or "json"; ValueError
    otherwise."""
    log_format = environ.get(LOG_FORMAT_ENV) or "text"
    if log_format not in LOG_FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV} must be text or json, got {log_format!r}")
    return log_format


def log_level_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``KVSWITCH_LOG_LEVEL``: DEBUG, INFO (the default, also when empty), WARNING or ERROR;
    ValueError otherwise."""
    level = (environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV} must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return level


class Throttled:
    """A warning that recurs (once per request while the index is down, say), logged at most
    once per ``interval_s``; the next line that gets through says how many were held back.

    The count of every occurrence belongs in a metric; this only keeps the log readable.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._next_s = -math.inf
        self._num_held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now < self._next_s:
            self._num_held += 1
            return
        if self._num_held:
            msg += " (and %d more like it in the last %g s)"
            args = (*args, self._num_held, self._interval_s)
        self._logger.warning(msg, *args)
        self._next_s = now + self._interval_s
        self._num_held = 0
