"""Structured, quiet-by-default logging: one line per event, `key=value` pairs after the message."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

from common.settings_registry import LOG_LEVEL

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
            for k, v in vars(record).items()
            if k not in _RESERVED
        )
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname.lower()} {record.name}: {record.getMessage()}"
        if extras:
            line += " " + extras
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str | None = None) -> None:
    level = (level or LOG_LEVEL.read()).upper()
    # NIXL logs every agent start at INFO on stdout; child processes inherit this before importing it.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN" if level != "DEBUG" else "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger("kvferry")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # Third-party chatter stays at warnings unless asked for.
    for name in ("uvicorn.access", "httpx", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)


class TracebackLimiter(logging.Filter):
    """At most one full traceback a minute per (logger, exception type, raising line); the others keep one line
    with the count (a failure every request hits would write whole tracebacks per request)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str], tuple[float, int]] = {}  # key -> (last traceback, repeats since)

    def filter(self, record: logging.LogRecord) -> bool:
        exc_info = record.exc_info
        if not exc_info or exc_info[1] is None:
            return True
        exc = exc_info[1]
        frames = traceback.extract_tb(exc_info[2]) if exc_info[2] is not None else []
        site = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        key = (record.name, type(exc).__qualname__, site)
        now = time.monotonic()
        with self._lock:
            last, repeats = self._last.get(key, (-self.interval_s, 0))
            if now - last >= self.interval_s:
                self._last[key] = (now, 0)
                if repeats:
                    record.repeats_before = repeats  # shown by KeyValueFormatter
                return True
            self._last[key] = (last, repeats + 1)
        detail = f"{type(exc).__name__}: {str(exc)[:200]} (traceback logged at most once a minute; {repeats + 1} since)"
        record.msg = f"{str(record.msg).rstrip()} [{detail.replace('%', '%%') if record.args else detail}]"
        record.exc_info = None
        record.exc_text = None
        return True


class RepeatLimiter(logging.Filter):
    """At most one record a minute per message (the rest counted in the next kept): for uvicorn's per-connection
    warnings, which garbage from a client would repeat per connection."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, message) -> (last kept, dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.levelno >= logging.ERROR:
            return True  # errors are each kept (their tracebacks limited by TracebackLimiter)
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last, dropped = self._last.get(key, (-self.interval_s, 0))
            if now - last < self.interval_s:
                self._last[key] = (last, dropped + 1)
                return False
            self._last[key] = (now, 0)
        if dropped:
            record.msg = f"{str(record.msg).rstrip()} ({dropped} more in the last minute, not logged)"
        return True


_LIMITER = TracebackLimiter()
_REPEATS = RepeatLimiter()
# The loggers that log a 500's traceback (the router's handler, and uvicorn's for an exception leaving an app).
_SERVING_LOGGERS = ("kvferry.router", "kvferry.control", "uvicorn.error")


def limit_tracebacks() -> None:
    """Installs the traceback limiter on the serving loggers, and the repeat limiter on uvicorn's (idempotent)."""
    for name in _SERVING_LOGGERS:
        logger = logging.getLogger(name)
        if _LIMITER not in logger.filters:
            logger.addFilter(_LIMITER)
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _REPEATS not in uvicorn_log.filters:
        uvicorn_log.addFilter(_REPEATS)
