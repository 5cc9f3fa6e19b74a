"""Logging set-up: one line per event, text or JSON."""

from __future__ import annotations

import logging
import sys

import orjson


class JsonFormatter(logging.Formatter):
    """One line of JSON per log record."""

    def format(self, record: logging.LogRecord) -> str:
        """Return *record* as one line of JSON.

        Keys: ``ts`` (local time), ``level``, ``logger``, ``pid``, ``msg``, and ``exc`` when it
        carries a traceback.
        """
        data = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(data).decode()


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger for the runtime (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)-7s %(name)s[%(process)d] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("psycopg.pool", "pgserver"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
