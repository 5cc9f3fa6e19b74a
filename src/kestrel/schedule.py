"""Cron schedules: ``@kestrel.scheduled("*/5 * * * *")`` starts the workflow once per tick.

Each tick starts exactly one execution across every process and host: the process that
advances the schedule's ``last_tick`` row (compare-and-set) submits the tick, in the same
transaction, under the idempotency key ``kestrel.cron:<name>:<tick>``. Ticks are computed on
the database clock, in UTC. Ticks missed while nothing ran are skipped (only the latest due
tick starts) unless the schedule says ``catch_up=True``, which starts each of them (at most
``MAX_CATCH_UP``).

The cron format is the usual five fields (minute hour day-of-month month day-of-week) with
``*``, lists, ranges and ``/step``; an optional sixth leading field gives seconds. As in
cron, when both day fields are restricted a day matching either runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from kestrel.errors import ConfigError
from kestrel.workflow import WorkflowFn, workflow_name

MAX_CATCH_UP = 1000
W = TypeVar("W", bound=WorkflowFn)

_FIELDS = (("second", 0, 59), ("minute", 0, 59), ("hour", 0, 23), ("day", 1, 31),
           ("month", 1, 12), ("weekday", 0, 6))


def _parse_field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    top = 7 if name == "weekday" else high  # day of week 7 is Sunday, like 0
    values: set[int] = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if body == "*":
                start, end = low, high
            elif "-" in body:
                a, b = body.split("-", 1)
                start, end = int(a), int(b)
            else:
                start = int(body)
                end = top if step_text else start
        except ValueError:
            raise ConfigError(f"cron {name} field {text!r} is not a number, range or *") from None
        if step < 1 or not low <= start <= end <= top:
            raise ConfigError(f"cron {name} field {text!r} is outside {low}-{top}")
        values.update(range(start, end + 1, step))
    if 7 in values and name == "weekday":
        values.discard(7)
        values.add(0)
    return frozenset(values)


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed cron expression."""

    text: str
    second: frozenset[int]
    minute: frozenset[int]
    hour: frozenset[int]
    day: frozenset[int]
    month: frozenset[int]
    weekday: frozenset[int]
    day_any: bool
    weekday_any: bool
    seconds: bool

    @staticmethod
    def parse(text: str) -> Cron:
        parts = text.split()
        if len(parts) == 5:
            parts = ["0", *parts]
            seconds = False
        elif len(parts) == 6:
            seconds = True
        else:
            raise ConfigError(f"cron {text!r}: expected 5 fields (or 6 with seconds first)")
        s, mi, h, d, mo, w = (_parse_field(p, *f) for p, f in zip(parts, _FIELDS, strict=True))
        return Cron(text, s, mi, h, d, mo, w, day_any=parts[3] == "*",
                    weekday_any=parts[5] == "*", seconds=seconds)

    def _day_ok(self, t: datetime) -> bool:
        dom = t.day in self.day
        dow = (t.isoweekday() % 7) in self.weekday
        if self.day_any or self.weekday_any:
            return dom and dow
        return dom or dow

    def next_after(self, t: datetime) -> datetime:
        """The first tick strictly after *t* (UTC)."""
        t = t.astimezone(UTC).replace(microsecond=0) + timedelta(seconds=1)
        if not self.seconds:
            t = t.replace(second=0) + (timedelta(minutes=1) if t.second else timedelta())
        for _ in range(200_000):
            if t.month not in self.month:
                t = (t.replace(day=1, hour=0, minute=0, second=0) + timedelta(days=32)
                     ).replace(day=1)
            elif not self._day_ok(t):
                t = t.replace(hour=0, minute=0, second=0) + timedelta(days=1)
            elif t.hour not in self.hour:
                t = t.replace(minute=0, second=0) + timedelta(hours=1)
            elif t.minute not in self.minute:
                t = t.replace(second=0) + timedelta(minutes=1)
            elif t.second not in self.second:
                t += timedelta(seconds=1)
            else:
                return t
        raise ConfigError(f"cron {self.text!r} never fires")


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    cron: Cron
    workflow: str
    catch_up: bool
    queue: str


_schedules: dict[str, Schedule] = {}


def scheduled(cron: str, *, name: str | None = None, catch_up: bool = False,
              queue: str = "default") -> Callable[[W], W]:
    """Start the decorated ``@kestrel.workflow`` on every tick of *cron*; it receives the
    tick time (ISO 8601, UTC) as its one argument. Put it above ``@kestrel.workflow``."""
    parsed = Cron.parse(cron)

    def register(fn: W) -> W:
        wf = workflow_name(fn)
        sched_name = name or wf
        _schedules[sched_name] = Schedule(sched_name, parsed, wf, catch_up, queue)
        return fn

    return register


def schedules() -> dict[str, Schedule]:
    return dict(_schedules)


def due_ticks(cron: Cron, last_tick: datetime, now: datetime, catch_up: bool) -> list[datetime]:
    """Ticks after *last_tick* up to *now*: all of them (bounded) or only the latest."""
    ticks: list[datetime] = []
    t = cron.next_after(last_tick)
    while t <= now:
        ticks.append(t)
        if len(ticks) > MAX_CATCH_UP:
            ticks.pop(0)
        t = cron.next_after(t)
    return ticks if catch_up else ticks[-1:]
