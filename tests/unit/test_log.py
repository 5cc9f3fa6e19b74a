"""kestrel.log: RFC 3339 UTC timestamps with milliseconds, one JSON object per line."""

from __future__ import annotations

import json
import logging
import re

import pytest

from kestrel import log as kestrel_log

STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _record(created: float, msg: str = "hello %s", args: tuple[object, ...] = ("x",)
            ) -> logging.LogRecord:
    record = logging.LogRecord("kestrel.test", logging.WARNING, __file__, 1, msg, args, None)
    record.created = created
    return record


def test_rfc3339_is_utc_with_milliseconds_whatever_the_local_zone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setenv("TZ", "America/St_Johns")  # UTC-3:30: a local time would show it
    time.tzset()
    try:
        # 2026-11-30 14:03:07.1239 UTC: milliseconds are truncated, never rounded up.
        assert kestrel_log.rfc3339(1796047387.1239) == "2026-11-30T14:03:07.123Z"
        assert kestrel_log.rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_json_lines_carry_rfc3339_utc_timestamps() -> None:
    record = _record(1796047387.5, 'quote " and\nnewline', ())
    line = kestrel_log.JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["ts"] == "2026-11-30T14:03:07.500Z"
    assert STAMP.fullmatch(data["ts"])
    assert (data["level"], data["logger"], data["msg"]) == (
        "warning", "kestrel.test", 'quote " and\nnewline')


def test_text_lines_start_with_the_same_timestamp() -> None:
    line = kestrel_log.TextFormatter().format(_record(1796047387.25))
    assert line.startswith("2026-11-30T14:03:07.250Z WARNING kestrel.test[")
    assert line.endswith("] hello x")


def test_setup_quiets_the_pools_duplicate_warnings_unless_debug() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        kestrel_log.setup("info", "json")
        assert logging.getLogger("psycopg.pool").getEffectiveLevel() == logging.ERROR
        kestrel_log.setup("debug", "text")
        assert logging.getLogger("psycopg.pool").getEffectiveLevel() == logging.DEBUG
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("psycopg.pool").setLevel(logging.NOTSET)
