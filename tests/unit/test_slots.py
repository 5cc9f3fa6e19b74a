"""The adaptive concurrency limit (kestrel.slots) against model processes: a process whose
work per second follows a curve of its limit, driven by a fake clock, as the claimer drives
it (one observe per round)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kestrel import slots
from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.slots import Slots


def amortized(k: float) -> Callable[[int], float]:
    """Work per second of a process whose commits cost a fixed part worth *k* items and a
    part per item: ``n / (n + k)`` of its best (a slow flush is a large k)."""
    return lambda n: 10_000 * n / (n + k)


class Model:
    """A saturated process at *curve*'s rate; every round observes it with *running*
    executions (by default, full at the limit)."""

    def __init__(self, curve: Callable[[int], float], *, fixed: int | None = None) -> None:
        self.curve = curve
        self.now = 0.0
        self.work = 0.0
        self.slots = Slots(fixed, work=lambda: int(self.work), clock=lambda: self.now)
        self.limits = [self.slots.limit]

    def run(self, seconds: float, *, running: Callable[[int], int] = lambda limit: limit,
            short: bool = False) -> int:
        end = self.now + seconds
        while self.now < end:
            self.now += 0.01
            self.work += self.curve(self.slots.limit) * 0.01
            if short:
                self.slots.short()
            self.slots.observe(running(self.slots.limit))
            if self.slots.limit != self.limits[-1]:
                self.limits.append(self.slots.limit)
        return self.slots.limit


@pytest.mark.parametrize(("k", "knee"), [(32, 512), (200, 1024)])
def test_the_limit_climbs_from_the_start_while_a_doubling_pays(k: float, knee: int) -> None:
    # k = 32: 256 -> 512 is +5.9% (kept), 512 -> 1024 +3.1% (undone): the knee is 512.
    # k = 200 (a slow flush): every doubling pays up to the ceiling.
    model = Model(amortized(k))
    assert model.run(3) == knee
    assert model.limits[:3] == [256, 512, 1024]
    assert model.run(slots.HOLD_S - 4) == knee  # holds until the next probe


def test_a_limit_past_the_knee_comes_down_where_halving_costs_nothing() -> None:
    # Work done falls with more in flight past 128 (the process thrashes): the climb's first
    # doubling is undone, and the down probes after each hold keep halving while it pays.
    model = Model(lambda n: 10_000 - abs(n - 128) * 5)
    model.run(3)
    assert model.slots.limit == 256
    model.run(4 * slots.HOLD_S)
    assert model.slots.limit == 128


def test_it_follows_a_disk_that_gets_slower() -> None:
    model = Model(amortized(32))
    assert model.run(3) == 512
    model.curve = amortized(400)  # the flush now costs what 400 items do
    assert model.run(3 * slots.HOLD_S) == 1024


def test_nothing_is_learned_without_a_backlog() -> None:
    model = Model(amortized(200))
    assert model.run(30, short=True) == slots.START
    assert model.slots.changes == 0


def test_no_window_runs_while_the_process_is_not_full() -> None:
    # 100 in flight against a limit of 256: the process cannot fill (a claim short of the
    # limit every round would void it too); the limit stays.
    model = Model(amortized(200))
    assert model.run(30, running=lambda _: 100) == slots.START


def test_a_fixed_limit_never_moves() -> None:
    model = Model(amortized(200), fixed=40)
    assert model.run(60) == 40
    assert model.slots.changes == 0


def test_the_limit_stays_within_floor_and_ceiling() -> None:
    up = Model(lambda n: float(n))  # every slot pays: the ceiling, never past it
    assert up.run(60) == slots.CEILING
    down = Model(lambda n: 10_000 - n)  # every slot costs: the floor, never past it
    down.run(12 * slots.HOLD_S)
    assert down.slots.limit == slots.FLOOR
    assert min(down.limits) == slots.FLOOR


@pytest.mark.parametrize("value", [-1, -64])
def test_a_negative_concurrency_is_refused(value: int) -> None:
    with pytest.raises(ConfigError, match="concurrency"):
        Config(concurrency=value)


def test_the_default_is_adaptive_and_sizes_the_step_threads_to_its_ceiling() -> None:
    assert Config().concurrency == 0
    assert Config().max_concurrency == slots.CEILING
    assert Config(concurrency=7).max_concurrency == 7
