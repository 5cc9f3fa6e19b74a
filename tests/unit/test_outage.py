"""kestrel.outage: one line when an outage begins, a rate-limited reminder, one at its end."""

from __future__ import annotations

import logging

import psycopg
import pytest

from kestrel.outage import OutageLog, reason


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def outage(caplog: pytest.LogCaptureFixture) -> tuple[OutageLog, Clock]:
    caplog.set_level(logging.DEBUG, logger="kestrel.test-outage")
    clock = Clock()
    return OutageLog(clock=clock, logger=logging.getLogger("kestrel.test-outage")), clock


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


REFUSED = psycopg.OperationalError('connection failed: connection to server at "127.0.0.1", '
                                   "port 5432 failed: Connection refused\n\tIs the server "
                                   "running on that host?")


def test_one_line_at_the_start_a_reminder_every_30_s_one_line_at_the_end(
        outage: tuple[OutageLog, Clock], caplog: pytest.LogCaptureFixture) -> None:
    log, clock = outage
    log.succeeded()  # nothing to say while reachable
    for _ in range(95):  # 95 s of every service failing once a second
        log.failed(REFUSED, "claim")
        log.failed(REFUSED, "heartbeat")
        clock.now += 1
    lines = _lines(caplog)
    assert len(lines) == 1 + 3  # the start, then reminders at 30, 60 and 90 s
    assert lines[0].startswith("database unreachable (OperationalError: connection failed: "
                               'connection to server at "127.0.0.1", port 5432 failed: '
                               "Connection refused, in claim)")
    assert "Is the server" not in lines[0]  # one line: the reason's first line only
    assert lines[1].startswith("database still unreachable after 30.0 s (61 failed attempts")
    log.succeeded()
    log.succeeded()
    assert _lines(caplog)[-1] == "database reconnected after 95.0 s"
    assert len(_lines(caplog)) == 5 and not log.down


def test_a_stale_connection_right_after_a_reconnect_is_not_a_new_outage(
        outage: tuple[OutageLog, Clock], caplog: pytest.LogCaptureFixture) -> None:
    log, clock = outage
    log.failed(REFUSED, "claim")
    clock.now += 12.3
    log.succeeded()
    clock.now += 3  # the heartbeat's connection from before the restart fails once
    log.failed(psycopg.OperationalError("server closed the connection unexpectedly"),
               "heartbeat")
    clock.now += 0.2
    log.succeeded()
    assert _lines(caplog) == [_lines(caplog)[0], "database reconnected after 12.3 s"]
    # ...but failures that go on past escalate_s are an outage again, even in the grace.
    clock.now += 1
    log.failed(REFUSED, "claim")
    clock.now += 2.5
    log.failed(REFUSED, "claim")
    assert _lines(caplog)[-1].startswith("database unreachable (")
    clock.now += 1
    log.succeeded()
    assert _lines(caplog)[-1] == "database reconnected after 3.5 s"


def test_reason_is_one_bounded_line() -> None:
    assert reason(psycopg.OperationalError("")) == "OperationalError"
    long = reason(OSError("x" * 1000 + "\nsecond line"))
    assert len(long) == 200 and "\n" not in long and long.startswith("OSError: xxx")
