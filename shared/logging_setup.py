"""One log format for every process of the stack: `configure_logging(level, log_format)`.

Each process (engine, control plane, `loraplane up`) calls it once at its edge, before anything logs; the
libraries' loggers (uvicorn, alembic, httpx, litestar) then propagate to the one root handler, so every line
of a process has the same fields: time, level, logger, message (and the exception, if any).

- text: `2025-01-01T12:00:00.123+00:00 INFO engine[local-1] loraplane.engine: message`, the traceback on
  the lines after;
- json: one object per line, `{"time", "level", "process", "logger", "message"[, "exception"]}`.

The process is named (`control`, `router`, `engine[NAME]`, `up`) because `loraplane up` runs them all on
one stream; an engine's own child processes inherit its name through LORAPLANE_LOG_PROCESS.

One line per call: where it is received (uvicorn's access line). What a process sends (httpx's request
line) is logged at DEBUG only, as the receiver logs it. Routine traffic that succeeded (heartbeats every
few seconds, /metrics scrapes, /health probes, a router's reads of its routing table, demand and tenancy
every second) is logged at DEBUG where it is received too, so an idle stack at INFO prints nothing.
uvicorn must be run with `log_config=None` (it then leaves the handlers alone) and Litestar with
`logging_config=None`.
"""

from __future__ import annotations

import json
import logging
import os
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
LOG_PROCESS_ENV = "LORAPLANE_LOG_PROCESS"  # the process name an engine hands its child processes

# probes, scrapes, and a router's revalidation of its routing table and its demand report (each every second)
ROUTINE_PATHS = frozenset({"/health", "/metrics", "/v1/routes", "/v1/routes/demand"})
ROUTINE_SUFFIXES = ("/heartbeat",)  # /v1/engines/{name}/heartbeat
# a router's reads of the adapter access table (every second) and of tenant keys' records (every key cache TTL)
ROUTINE_GET_PREFIXES = ("/v1/tenancy/",)


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
    # (method, url, http_version, status_code, reason_phrase): what a process asked, which the receiver logs
    "httpx": _RequestLog(method=0, path=1, status=3,
                         routine_methods=frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})),
}

# Libraries' start-up chatter, shown only at DEBUG: alembic names each plugin it sets up (7 lines a start).
_CHATTY_LOGGERS = ("alembic.runtime.plugins",)
# Loggers that libraries may have given handlers of their own (uvicorn's default dictConfig does, and
# turns propagation off): they are reset to propagate to the one root handler.
_LIBRARY_LOGGERS = ("uvicorn", "uvicorn.access", "uvicorn.error", "httpx", "alembic", "litestar")


def is_routine(path_or_url: str, method: str = "GET") -> bool:
    path = urlsplit(path_or_url).path
    return (path in ROUTINE_PATHS or path.endswith(ROUTINE_SUFFIXES)
            or (method == "GET" and path.startswith(ROUTINE_GET_PREFIXES)))


def _iso_time(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


class NameProcess(logging.Filter):
    """On the handler: every record carries the process's name (`loraplane_process`; empty: none)."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.loraplane_process = self.process
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(process_part)s%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        process = getattr(record, "loraplane_process", "")
        record.process_part = f"{process} " if process else ""
        return super().format(record)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return _iso_time(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback is one string field, so it stays on its line."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": _iso_time(record), "level": record.levelname}
        if process := getattr(record, "loraplane_process", ""):
            line["process"] = process
        line |= {"logger": record.name, "message": record.getMessage()}
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
                and (str(args[at.method]) in at.routine_methods
                     or is_routine(str(args[at.path]), str(args[at.method])))):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def level_number(level: str) -> int:
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LOG_LEVELS)}")
    return _TRACE if level.lower() == "trace" else logging.getLevelName(level.upper())


def configure_logging(level: str = "info", log_format: str = "text", stream: IO[str] | None = None,
                      process: str | None = None) -> None:
    """Route every logger of this process to one stderr handler in `log_format`, each line naming
    `process` (None: LORAPLANE_LOG_PROCESS's, if set); idempotent."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; expected text or json")
    number = level_number(level)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.setLevel(number)
    handler.addFilter(NameProcess(os.environ.get(LOG_PROCESS_ENV, "") if process is None else process))
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
