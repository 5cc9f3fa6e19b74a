"""How a periodic service reports a round the database refused (kestrel.loops.every)."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from kestrel.loops import every


def one_round(exc: Exception) -> None:
    calls = 0

    async def round_() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc
        raise asyncio.CancelledError  # the second round ends the loop

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await every(lambda: 0.0, round_, "sweep")

    asyncio.run(main())
    assert calls == 2  # the refused round did not end the loop


@pytest.mark.parametrize("exc", [psycopg.errors.LockNotAvailable("canceling statement due to "
                                                                 "lock timeout"),
                                 psycopg.errors.DeadlockDetected("deadlock detected"),
                                 psycopg.errors.QueryCanceled("statement timeout")])
def test_a_round_held_up_by_other_transactions_is_a_warning(
        exc: Exception, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kestrel.worker"):
        one_round(exc)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("sweep round waited too long on other transactions")
    assert type(exc).__name__ in record.getMessage()


def test_a_round_refused_for_what_it_says_is_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kestrel.worker"):
        one_round(psycopg.errors.UndefinedTable('relation "x" does not exist'))
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage().startswith("sweep round failed (UndefinedTable")
