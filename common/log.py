"""Structured, quiet-by-default logging: one line per event, `key=value` pairs after the message."""

from __future__ import annotations

import logging
import os
import sys

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
    level = (level or os.environ.get("KVFERRY_LOG_LEVEL") or "WARNING").upper()
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
