"""kestrel.schedule: standard cron semantics, checked at declaration (FAULTS P5).

Dates are hand-computed from a calendar (1 January 2026 is a Thursday) or checked against
``datetime``'s own calendar, never against the library under test. Work is measured by
counting function calls, never by the clock.
"""

from __future__ import annotations

import calendar
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from types import FrameType

import pytest

from kestrel.errors import ConfigError
from kestrel.schedule import MAX_CATCH_UP, Cron, due_ticks, scheduled


def at(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[arg-type, misc]


def forward(expr: str, start: datetime, n: int) -> list[datetime]:
    """The first *n* ticks after *start*, by next_after."""
    cron, ticks, t = Cron.parse(expr), [], start
    for _ in range(n):
        t = cron.next_after(t)
        ticks.append(t)
    return ticks


def midnights(year: int, keep: Callable[[date], bool]) -> list[datetime]:
    """Midnight of every day of *year* for which keep(date) is true (the oracle)."""
    days = (date(year, 1, 1) + timedelta(days=i) for i in range(366))
    return [at(d.year, d.month, d.day) for d in days if d.year == year and keep(d)]


class WorkBudgetExceeded(AssertionError):
    pass


@contextmanager
def work_budget(calls: int) -> Iterator[None]:
    """Fail once the code inside makes more than *calls* function calls (Python or C).

    A deterministic measure of work: the same code makes the same calls on any machine.
    """
    made = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal made
        if event in ("call", "c_call"):
            made += 1
            if made > calls:
                sys.setprofile(None)
                raise WorkBudgetExceeded(f"more than {calls} calls")

    sys.setprofile(count)
    try:
        yield
    finally:
        sys.setprofile(None)


# -- rejected at declaration ----------------------------------------------------------------


@pytest.mark.parametrize("expr", [
    "0 0 30 2 *",          # 30 February
    "0 0 31 2 *",
    "0 0 31 4,6,9,11 *",   # the 30-day months
    "0 0 30,31 2 *",
    "15 0 0 30 2 *",       # with seconds
    "0 0 */10 2 1#5",      # days 1, 11, 21, 31 and (AND: '*' first) the fifth Monday of Feb
    "0 0 LW * */6",        # last weekday of the month that is a Saturday or Sunday
])
def test_dates_that_never_occur_are_rejected_at_declaration(expr: str) -> None:
    with pytest.raises(ConfigError, match=r"cron '.*'") as caught:
        scheduled(expr)
    assert expr[:20] in str(caught.value)
    with pytest.raises(ConfigError):
        Cron.parse(expr)


def test_the_reason_is_named() -> None:
    with pytest.raises(ConfigError, match=r"cron '0 0 30 2 \*' never fires"):
        Cron.parse("0 0 30 2 *")
    with pytest.raises(ConfigError, match=r"cron '0 0 \*/10 2 1#5' never fires"):
        Cron.parse("0 0 */10 2 1#5")
    with pytest.raises(ConfigError, match=r"cron '61 \* \* \* \*': bad minute field '61'"):
        Cron.parse("61 * * * *")


@pytest.mark.parametrize(("expr", "start", "first"), [
    ("0 0 29 2 *", at(2026, 1, 1), at(2028, 2, 29)),
    ("0 0 30 2 MON", at(2026, 1, 1), at(2026, 2, 2)),   # both restricted: OR, Feb Mondays
    ("0 0 * 2 MON#5", at(2072, 3, 1), at(2112, 2, 29)),  # 2100 is no leap year
    ("0 0 29 2 */7", at(2088, 3, 1), at(2128, 2, 29)),   # Sunday 29 Feb: the longest gap
])
def test_rare_dates_are_accepted_and_found(expr: str, start: datetime, first: datetime) -> None:
    assert Cron.parse(expr).next_after(start) == first


# -- day-of-month and day-of-week: AND when either starts with '*', else OR ------------------


def test_star_step_day_of_month_ands_with_monday() -> None:
    # Odd days that are Mondays. Mondays of 2026: Jan 5 12 19 26, Feb 2 9 16 23,
    # Mar 2 9 16 23 30.
    assert forward("0 0 */2 * 1", at(2026, 1, 1), 6) == [
        at(2026, 1, 5), at(2026, 1, 19), at(2026, 2, 9), at(2026, 2, 23), at(2026, 3, 9),
        at(2026, 3, 23)]


def test_star_step_day_of_week_ands_with_day_of_month() -> None:
    # The 15th when it is a Sunday, Tuesday, Thursday or Saturday.
    assert forward("0 12 15 * */2", at(2026, 1, 1), 4) == [
        at(2026, 1, 15, 12), at(2026, 2, 15, 12), at(2026, 3, 15, 12), at(2026, 8, 15, 12)]


def test_both_day_fields_restricted_or() -> None:
    # Friday or the 13th.
    assert forward("0 0 13 * 5", at(2026, 1, 1), 4) == [
        at(2026, 1, 2), at(2026, 1, 9), at(2026, 1, 13), at(2026, 1, 16)]


@pytest.mark.parametrize(("expr", "keep"), [
    ("0 0 */2 * 1", lambda d: d.day % 2 == 1 and d.weekday() == 0),
    ("0 0 1-7 * */7", lambda d: d.day <= 7 and d.weekday() == 6),   # first Sunday
    ("0 0 * * 1-5", lambda d: d.weekday() < 5),
    ("0 0 1,15 * FRI", lambda d: d.day in (1, 15) or d.weekday() == 4),
    ("0 0 */10 * sun", lambda d: d.day in (1, 11, 21, 31) and d.weekday() == 6),
])
def test_a_whole_year_against_the_calendar(expr: str, keep: Callable[[date], bool]) -> None:
    year = midnights(2026, keep)
    got = due_ticks(Cron.parse(expr), at(2025, 12, 31, 23), at(2026, 12, 31, 23), True)
    assert got == year


# -- names, macros, L, LW, #, L in day-of-week ----------------------------------------------


@pytest.mark.parametrize(("expr", "start", "ticks"), [
    ("0 9 * JAN MON", at(2026, 1, 20), [at(2026, 1, 26, 9), at(2027, 1, 4, 9)]),
    ("0 9 * * mon-fri", at(2026, 1, 2, 10), [at(2026, 1, 5, 9), at(2026, 1, 6, 9)]),
    ("0 0 1 jan,Jul *", at(2026, 1, 1), [at(2026, 7, 1), at(2027, 1, 1)]),
    ("0 0 * * SUN,7", at(2026, 1, 1), [at(2026, 1, 4), at(2026, 1, 11)]),
    ("@yearly", at(2026, 3, 1), [at(2027, 1, 1), at(2028, 1, 1)]),
    ("@annually", at(2026, 3, 1), [at(2027, 1, 1), at(2028, 1, 1)]),
    ("@monthly", at(2026, 3, 1), [at(2026, 4, 1), at(2026, 5, 1)]),
    ("@weekly", at(2026, 1, 1), [at(2026, 1, 4), at(2026, 1, 11)]),
    ("@daily", at(2026, 1, 1, 0, 0, 1), [at(2026, 1, 2), at(2026, 1, 3)]),
    ("@midnight", at(2026, 1, 1, 0, 0, 1), [at(2026, 1, 2), at(2026, 1, 3)]),
    ("@hourly", at(2026, 1, 1, 0, 30), [at(2026, 1, 1, 1), at(2026, 1, 1, 2)]),
    ("0 0 L * *", at(2026, 1, 31), [at(2026, 2, 28), at(2026, 3, 31)]),
    ("0 0 L 2 *", at(2027, 3, 1), [at(2028, 2, 29), at(2029, 2, 28)]),
    ("0 0 LW * *", at(2026, 1, 1), [at(2026, 1, 30), at(2026, 2, 27)]),  # Jan 31: Saturday
    ("0 0 LW 5 *", at(2026, 1, 1), [at(2026, 5, 29), at(2027, 5, 31)]),  # May 31: Sunday
    ("0 0 * * 5#2", at(2026, 1, 1), [at(2026, 1, 9), at(2026, 2, 13)]),
    ("0 0 * * FRI#2", at(2026, 1, 1), [at(2026, 1, 9), at(2026, 2, 13)]),
    ("0 0 * * 5L", at(2026, 1, 1), [at(2026, 1, 30), at(2026, 2, 27)]),
    ("0 0 * * 1#1,5L", at(2026, 1, 1), [at(2026, 1, 5), at(2026, 1, 30)]),
])
def test_names_macros_last_and_nth(expr: str, start: datetime, ticks: list[datetime]) -> None:
    assert forward(expr, start, len(ticks)) == ticks


@pytest.mark.parametrize("expr", ["@reboot", "@DAILY", "@fortnightly", "@daily *", "@"])
def test_unknown_macros_rejected(expr: str) -> None:
    with pytest.raises(ConfigError, match="cron '@"):
        Cron.parse(expr)


# -- seconds first ---------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "start", "ticks"), [
    ("*/10 * * * * *", at(2026, 1, 1, 10, 0, 5),
     [at(2026, 1, 1, 10, 0, 10), at(2026, 1, 1, 10, 0, 20)]),
    ("*/10 * * * * *", at(2026, 1, 1, 10, 0, 50, 500_000),
     [at(2026, 1, 1, 10, 1), at(2026, 1, 1, 10, 1, 10)]),
    ("30 0 9 * * *", at(2026, 1, 1), [at(2026, 1, 1, 9, 0, 30), at(2026, 1, 2, 9, 0, 30)]),
    ("0,45 */30 * * * *", at(2026, 1, 1, 10, 0, 0),
     [at(2026, 1, 1, 10, 0, 45), at(2026, 1, 1, 10, 30), at(2026, 1, 1, 10, 30, 45)]),
    ("5-6 0 0 * * 5#2", at(2026, 1, 1), [at(2026, 1, 9, 0, 0, 5), at(2026, 1, 9, 0, 0, 6),
                                         at(2026, 2, 13, 0, 0, 5)]),
    ("59 59 23 L 12 *", at(2026, 1, 1), [at(2026, 12, 31, 23, 59, 59)]),
])
def test_seconds_first(expr: str, start: datetime, ticks: list[datetime]) -> None:
    assert forward(expr, start, len(ticks)) == ticks


@pytest.mark.parametrize("field", [
    "60", "-1", "*/0", "1-60", "5-1", "a", "L", "LW", "1#2", "5L", "MON", "JAN", "1,", ",1",
    "*/", "1-", "1/2/3",
])
def test_bad_seconds_fields_rejected(field: str) -> None:
    with pytest.raises(ConfigError, match="second"):
        Cron.parse(f"{field} * * * * *")


# -- missed ticks ----------------------------------------------------------------------------


def test_due_ticks_latest_or_the_last_max_catch_up_in_order() -> None:
    cron = Cron.parse("*/5 * * * *")
    last, now = at(2026, 1, 1, 10), at(2026, 1, 1, 10, 17, 30)
    assert due_ticks(cron, last, now, False) == [at(2026, 1, 1, 10, 15)]
    assert due_ticks(cron, last, now, True) == [
        at(2026, 1, 1, 10, 5), at(2026, 1, 1, 10, 10), at(2026, 1, 1, 10, 15)]
    assert due_ticks(cron, last, at(2026, 1, 1, 10, 15), True)[-1] == at(2026, 1, 1, 10, 15)
    assert due_ticks(cron, last, at(2026, 1, 1, 10, 4, 59), True) == []
    assert due_ticks(cron, now, last, True) == []  # last tick ahead of now: nothing due


def test_a_year_of_missed_minutes_is_not_walked() -> None:
    cron = Cron.parse("* * * * *")
    last, now = at(2025, 1, 1), at(2026, 1, 1, 0, 0, 30)
    # The old walk made tens of calls per missed tick: ~525,600 ticks, millions of calls.
    with work_budget(5_000):
        assert due_ticks(cron, last, now, False) == [at(2026, 1, 1)]
    with work_budget(100 * MAX_CATCH_UP):
        ticks = due_ticks(cron, last, now, True)
    assert ticks == [at(2026, 1, 1) - timedelta(minutes=MAX_CATCH_UP - 1 - i)
                     for i in range(MAX_CATCH_UP)]


def test_a_day_of_missed_seconds_catches_up_the_last_ones() -> None:
    cron = Cron.parse("* * * * * *")
    last, now = at(2025, 12, 31), at(2026, 1, 1, 0, 0, 0, 999_999)
    with work_budget(100 * MAX_CATCH_UP):
        ticks = due_ticks(cron, last, now, True)
    assert ticks == [at(2026, 1, 1) - timedelta(seconds=MAX_CATCH_UP - 1 - i)
                     for i in range(MAX_CATCH_UP)]


@pytest.mark.parametrize("expr", [
    "*/7 * * * *", "0 */5 * * * *", "*/20 * * * * *", "0 0 */2 * 1", "0 0 L * *", "@weekly",
    "0 0 * * 5#2", "30 9 * * mon-fri", "0 0 LW * *", "0 0 13 * 5",
])
def test_walking_back_agrees_with_walking_forward(expr: str) -> None:
    start = at(2026, 1, 1, 0, 0, 1)
    ahead = forward(expr, start, 60)
    assert due_ticks(Cron.parse(expr), start, ahead[-1], True) == ahead


# -- hostile input ---------------------------------------------------------------------------


@pytest.mark.parametrize("expr", [
    "", "   ", "\x00", "* * * * *\x00", "\x00* * * * *", "\ud800 * * * *", "* * * * \udfff",
    "*" * 100_000, "* " * 10_000, "'); DROP TABLE x; --", "0 0 * * 1; DROP TABLE x",
    "\u0661 * * * *",       # an Arabic-Indic one: int() reads it, cron does not
    "* * * * *\u2003*",     # an em space: str.split() splits on it, cron does not
    "* * * * \u017fun",     # long s: upper() makes it SUN
    "* * * * * * *", "* * * *", "1 2 3 4 5 6 7 8",
    None, 5, b"* * * * *", ["*"] * 5,
])
def test_hostile_input_is_a_config_error(expr: object) -> None:
    with pytest.raises(ConfigError, match="cron"):
        Cron.parse(expr)  # type: ignore[arg-type]


def test_next_after_never_raises_for_a_parsed_expression() -> None:
    exprs = ["* * * * *", "0 0 29 2 */7", "0 0 * 2 MON#5", "59 59 23 31 12 *", "0 0 L 2 *",
             "0 0 LW 2 *", "0 0 * * 0L", "0 0 30 2 MON", "@yearly"]
    starts = [at(1970, 1, 1), at(2026, 6, 15, 12, 30, 30, 1), at(2099, 12, 31, 23, 59, 59),
              at(2400, 2, 29)]
    for expr in exprs:
        cron = Cron.parse(expr)
        for start in starts:
            tick = cron.next_after(start)
            assert start < tick < start + timedelta(days=366 * 41)
            assert due_ticks(cron, start, tick, False) == [tick]


def test_leap_years_by_the_calendar() -> None:
    got = due_ticks(Cron.parse("0 0 29 2 *"), at(1999, 1, 1), at(2401, 1, 1), True)
    assert [t.year for t in got] == [y for y in range(1999, 2401) if calendar.isleap(y)]
