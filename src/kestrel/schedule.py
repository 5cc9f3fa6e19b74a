"""Cron schedules: ``@kestrel.scheduled("*/5 * * * *")`` starts the workflow once per tick.

Each tick starts exactly one execution across every process and host: the process that
advances the schedule's ``last_tick`` row (compare-and-set) submits the tick, in the same
transaction, under the idempotency key ``kestrel.cron:<name>:<tick>``. Ticks are computed on
the database clock, in UTC. Ticks missed while nothing ran are skipped (only the latest due
tick starts) unless the schedule says ``catch_up=True``, which starts the most recent
``MAX_CATCH_UP`` of them, oldest first. Either way the missed ticks are found by walking
back from now, so a long outage costs no more than a short one.

The format is standard (Vixie/Debian) cron, evaluated by ``cronsim``: five fields (minute
hour day-of-month month day-of-week) with ``*``, lists, ranges, ``/step``, the names
``JAN``-``DEC`` and ``SUN``-``SAT`` (any case), ``L`` (last day of the month), ``LW`` (last
weekday of the month), ``5L`` (last Friday) and ``5#2`` (second Friday); or one of
``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily`` (``@midnight``) and
``@hourly``. When either day field starts with ``*`` a day must match both day fields;
otherwise a day matching either runs. kestrel adds an optional sixth field, placed *first*,
giving the seconds with the minute field's syntax (``*/10 * * * * *`` is every 10 s).

Every expression is checked when it is declared: one that is malformed, or whose dates
never occur (``0 0 30 2 *``), raises :class:`~kestrel.errors.ConfigError` at import time,
so a worker never starts with a schedule it cannot compute.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from cronsim import CronSim, CronSimError

from kestrel.definitions import WorkflowFn, workflow_name
from kestrel.errors import ConfigError

MAX_CATCH_UP = 1000
MAX_CRON_CHARS = 200
W = TypeVar("W", bound=WorkflowFn)

_MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# Everything cron syntax uses. Checked before the library sees the text: str.split() and
# str.upper() are Unicode-aware: an em space would split a field, and "\u017fun" (long s)
# would become SUN.
_CRON_CHARS = re.compile(r"[0-9A-Za-z*/,#@ \t-]*")
_FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")
_MINUTE = timedelta(minutes=1)
# cronsim gives up after 50 years without a match. Every kind of date cron can tell apart
# (month, day, weekday, leap year or not) recurs within 40 years (checked over the 400-year
# Gregorian cycle; 29 February on a Sunday is the worst), so no match in the 50 years after
# this probe means no match ever, and a match is never more than 40 years away.
_PROBE = datetime(2000, 1, 1, tzinfo=UTC)


def _show(text: str) -> str:
    """Return *text* quoted for an error message, cut short if it is long."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + "…"


def _library_error(text: str, five: str, exc: CronSimError) -> ConfigError:
    """Turn cronsim's terse "Bad <field>" into a message naming the field's text."""
    fields = five.split()
    reason = str(exc)
    name = reason.removeprefix("Bad ")
    if name not in _FIELD_NAMES:
        return ConfigError(f"cron {_show(text)}: {reason}")
    value = fields[_FIELD_NAMES.index(name)]
    if name == "day-of-month":
        try:  # the day is valid on its own: no chosen month has it (Feb 30)
            CronSim(f"0 0 {value} * *", _PROBE)
        except CronSimError:
            pass
        else:
            return ConfigError(f"cron {_show(text)} never fires: no month in {fields[3]!r} "
                               f"has day {value!r}")
    return ConfigError(f"cron {_show(text)}: bad {name} field {value!r}")


def _seconds(text: str, field: str) -> tuple[int, ...]:
    """Return the seconds a seconds field names, in order.

    The seconds field has the minute field's syntax and range, so the library parses it in
    the minute position and lists the minutes of one hour: one grammar for both fields.
    """
    try:
        minutes = CronSim(f"{field} 0 * * *", _PROBE - _MINUTE)
    except CronSimError:
        raise ConfigError(f"cron {_show(text)}: bad second field {field!r}") from None
    found: list[int] = []
    for tick in minutes:
        if tick >= _PROBE + timedelta(hours=1):
            break
        found.append(tick.minute)
    return tuple(found)


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed cron expression: five standard fields (minute granularity, evaluated by
    cronsim) and the seconds of each matching minute that are ticks."""

    text: str
    minutes: str
    seconds: tuple[int, ...]

    @staticmethod
    def parse(text: str) -> Cron:
        """Parse and check *text*; the result's ticks can always be computed.

        Raises:
            ConfigError: not a string, too long, characters cron does not use, the wrong
                number of fields, a bad field, or dates that never occur. The message
                names the expression.
        """
        if not isinstance(text, str):
            raise ConfigError(f"cron expression must be a string, got {type(text).__name__}")
        if len(text) > MAX_CRON_CHARS:
            raise ConfigError(f"cron {_show(text)} is {len(text)} characters, over the "
                              f"limit of {MAX_CRON_CHARS}")
        if not _CRON_CHARS.fullmatch(text):
            bad = next(c for c in text if not _CRON_CHARS.fullmatch(c))
            raise ConfigError(f"cron {_show(text)}: character {bad!r} is not cron syntax")
        parts = text.split()
        if len(parts) == 1 and parts[0].startswith("@"):
            if parts[0] == "@reboot":
                raise ConfigError(f"cron {_show(text)}: a fleet has no one boot to run at; "
                                  "start the workflow from your own start-up code")
            if parts[0] not in _MACROS:
                raise ConfigError(f"cron {_show(text)}: unknown macro; use one of "
                                  f"{', '.join(_MACROS)}")
            parts = _MACROS[parts[0]].split()
        if len(parts) == 5:
            seconds: tuple[int, ...] = (0,)
        elif len(parts) == 6:
            seconds = _seconds(text, parts[0])
            parts = parts[1:]
        else:
            raise ConfigError(f"cron {_show(text)}: expected 5 fields (minute hour "
                              "day-of-month month day-of-week), 6 with seconds first, or "
                              "an @macro")
        five = " ".join(parts)
        try:
            probe = CronSim(five, _PROBE)
        except CronSimError as exc:
            raise _library_error(text, five, exc) from None
        if next(probe, None) is None:
            raise ConfigError(f"cron {_show(text)} never fires: no date matches its "
                              "day-of-month, month and day-of-week fields together")
        return Cron(text, five, seconds)

    def next_after(self, t: datetime) -> datetime:
        """Return the first tick strictly after *t*, in UTC."""
        t = t.astimezone(UTC)
        minute = t.replace(second=0, microsecond=0)
        # The library starts strictly after its start time, at minute granularity: start a
        # minute early so that t's own minute counts, then take the first tick after t.
        for tick_minute in CronSim(self.minutes, minute - _MINUTE):
            for s in self.seconds:
                tick = tick_minute + timedelta(seconds=s)
                if tick > t:
                    return tick
        raise AssertionError(f"cron {self.text!r} passed parse() but has no next tick")

    def ticks_back(self, t: datetime) -> Iterator[datetime]:
        """Yield the ticks at or before *t*, newest first, in UTC."""
        t = t.astimezone(UTC)
        minute = t.replace(second=0, microsecond=0)
        # Reverse iteration starts strictly before its start time: a minute after t's
        # minute, so that t's own minute counts.
        for tick_minute in CronSim(self.minutes, minute + _MINUTE, reverse=True):
            for s in reversed(self.seconds):
                tick = tick_minute + timedelta(seconds=s)
                if tick <= t:
                    yield tick


@dataclass(frozen=True, slots=True)
class Schedule:
    """A registered cron schedule and the workflow each of its ticks starts.

    Ticks run on *queue*; with *catch_up* missed ticks are started, not skipped (see
    :func:`due_ticks`).
    """

    name: str
    cron: Cron
    workflow: str
    catch_up: bool
    queue: str


_schedules: dict[str, Schedule] = {}


def scheduled(cron: str, *, name: str | None = None, catch_up: bool = False,
              queue: str = "default") -> Callable[[W], W]:
    """Start the decorated ``@kestrel.workflow`` on every tick of *cron*; it receives the
    tick time (ISO 8601, UTC) as its one argument. Put it above ``@kestrel.workflow``.

    Raises:
        ConfigError: *cron* is not a valid expression or never fires.
    """
    parsed = Cron.parse(cron)

    def register(fn: W) -> W:
        wf = workflow_name(fn)
        sched_name = name or wf
        _schedules[sched_name] = Schedule(sched_name, parsed, wf, catch_up, queue)
        return fn

    return register


def schedules() -> dict[str, Schedule]:
    """Return the schedules registered with :func:`scheduled`, by name (a copy)."""
    return dict(_schedules)


def due_ticks(cron: Cron, last_tick: datetime, now: datetime, catch_up: bool) -> list[datetime]:
    """Return the ticks after *last_tick* up to *now*, oldest first: the latest only, or
    with *catch_up* the latest ``MAX_CATCH_UP``.

    Walks back from *now* and stops at *last_tick* or the limit, so the work is bounded by
    the ticks returned, not by the length of the gap (a year of per-minute ticks is one
    step, not half a million).
    """
    limit = MAX_CATCH_UP if catch_up else 1
    ticks: list[datetime] = []
    for tick in cron.ticks_back(now):
        if tick <= last_tick or len(ticks) == limit:
            break
        ticks.append(tick)
    ticks.reverse()
    return ticks
