"""Logging set-up: one line per event, text or JSON, stamped in UTC.

Timestamps are RFC 3339 in UTC with milliseconds (``2026-11-30T14:03:07.123Z``) in both
formats, so lines from several hosts and processes sort and join without a time zone guess.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime

import orjson


def rfc3339(created: float) -> str:
    """Return the epoch time *created* as RFC 3339 UTC with milliseconds and a ``Z``."""
    when = datetime.fromtimestamp(created, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>[<pid>] <message>``, the time as :func:`rfc3339`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s[%(process)d] %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """Return the record's time as :func:`rfc3339` (logging's name for the hook)."""
        return rfc3339(record.created)


class JsonFormatter(logging.Formatter):
    """One line of JSON per log record."""

    def format(self, record: logging.LogRecord) -> str:
        """Return *record* as one line of JSON.

        Keys: ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``pid``, ``msg``,
        and ``exc`` when it carries a traceback.
        """
        data = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(data).decode()


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger for the runtime (idempotent).

    psycopg_pool logs each failed connection attempt as a warning, twice per attempt, and
    kestrel's own outage log (:mod:`kestrel.outage`) already says when the database is
    unreachable and when it is back: the pool speaks only at ``error`` unless the level is
    ``debug``.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    pool = logging.DEBUG if root.level <= logging.DEBUG else logging.ERROR
    logging.getLogger("psycopg.pool").setLevel(max(pool, root.level))
    logging.getLogger("pgserver").setLevel(max(logging.WARNING, root.level))
