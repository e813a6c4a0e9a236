"""One log format for every process of the stack: `configure_logging(level, log_format)`.

Each process (engine, control plane, `loraplane up`) calls it once at its edge, before anything logs; the
libraries' loggers (uvicorn, alembic, httpx, litestar) then propagate to the one root handler, so every line
of a process has the same fields: time, level, logger, message (and the exception, if any).

- text: `2025-01-01T12:00:00.123+00:00 INFO loraplane.engine: message`, the traceback on the lines after;
- json: one object per line, `{"time", "level", "logger", "message"[, "exception"]}`.

Routine traffic (heartbeats every few seconds, /metrics scrapes, /health probes) that succeeded is logged at
DEBUG, both where it is received (uvicorn's access line) and where it is sent (httpx's request line), as are
the GETs a process sends (the control plane's polls of its engines), so an idle stack at INFO prints nothing. uvicorn must be run with `log_config=None` (it then leaves the handlers
alone) and Litestar with `logging_config=None`.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Literal
from urllib.parse import urlsplit

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_TRACE = 5  # uvicorn's TRACE level, below DEBUG
LOG_FORMAT_ENV = "LORAPLANE_LOG_FORMAT"

# probes, scrapes, and a router's revalidation of its routing table and its demand report (each every second)
ROUTINE_PATHS = frozenset({"/health", "/metrics", "/v1/routes", "/v1/routes/demand"})
ROUTINE_SUFFIXES = ("/heartbeat",)  # /v1/engines/{name}/heartbeat


@dataclass(frozen=True)
class _RequestLog:
    """Where a request logger's record args hold the method, the path (or URL) and the status code, and
    which methods are routine on it whatever the path."""

    method: int
    path: int
    status: int
    routine_methods: frozenset[str] = frozenset()


_REQUEST_LOGGERS = {
    # (client_addr, method, full_path, http_version, status_code): what a process was asked
    "uvicorn.access": _RequestLog(method=1, path=2, status=4),
    # (method, url, http_version, status_code, reason_phrase): what a process asked; its GETs are polls
    # (the reconciler's and the stats' reads of every engine), its POSTs are changes and stay at INFO
    "httpx": _RequestLog(method=0, path=1, status=3, routine_methods=frozenset({"GET"})),
}

# Libraries' start-up chatter, shown only at DEBUG: alembic names each plugin it sets up (7 lines a start).
_CHATTY_LOGGERS = ("alembic.runtime.plugins",)
# Loggers that libraries may have given handlers of their own (uvicorn's default dictConfig does, and
# turns propagation off): they are reset to propagate to the one root handler.
_LIBRARY_LOGGERS = ("uvicorn", "uvicorn.access", "uvicorn.error", "httpx", "alembic", "litestar")


def is_routine(path_or_url: str) -> bool:
    path = urlsplit(path_or_url).path
    return path in ROUTINE_PATHS or path.endswith(ROUTINE_SUFFIXES)


def _iso_time(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return _iso_time(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback is one string field, so it stays on its line."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": _iso_time(record), "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class DemoteRoutineRequests(logging.Filter):
    """On a request logger: a successful routine request becomes a DEBUG record. It sits on the logger,
    not the handler, because a handler's level is checked before that handler's filters run."""

    def __init__(self, layout: _RequestLog) -> None:
        super().__init__()
        self.layout = layout

    def filter(self, record: logging.LogRecord) -> bool:
        args, at = record.args, self.layout
        if (record.levelno == logging.INFO and isinstance(args, tuple) and len(args) > max(at.path, at.status)
                and isinstance(status := args[at.status], int) and status < 400
                and (str(args[at.method]) in at.routine_methods or is_routine(str(args[at.path])))):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def level_number(level: str) -> int:
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LOG_LEVELS)}")
    return _TRACE if level.lower() == "trace" else logging.getLevelName(level.upper())


def configure_logging(level: str = "info", log_format: str = "text", stream: IO[str] | None = None) -> None:
    """Route every logger of this process to one stderr handler in `log_format`; idempotent."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; expected text or json")
    number = level_number(level)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.setLevel(number)
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate, library.disabled = True, False
        library.setLevel(logging.NOTSET)
    for name, layout in _REQUEST_LOGGERS.items():
        logger = logging.getLogger(name)
        for old_filter in [f for f in logger.filters if isinstance(f, DemoteRoutineRequests)]:
            logger.removeFilter(old_filter)
        logger.addFilter(DemoteRoutineRequests(layout))
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(number, logging.WARNING) if number > logging.DEBUG else logging.NOTSET)
    # Python's warnings (a library's DeprecationWarning, our FutureWarnings) go through the same handler.
    logging.captureWarnings(True)
