"""How many executions one worker process runs at once: a fixed count, or a limit that
finds the knee of the process's own throughput curve.

Every execution in flight is one more row in the next group commit, so more of them means
larger batches and fewer commits per workflow, and less CPU per workflow on both sides;
the fixed part of a commit (a round trip, a flush of the WAL) is what the batch amortizes,
so the slower the flush, the more executions it takes to hide it (BENCHMARKS.md, issue 23).
Past the knee more slots only make each execution wait longer in the process.

With ``--concurrency 0`` (the default) the limit starts at :data:`START` and moves by
doubling and halving, never below :data:`FLOOR` nor above :data:`CEILING`. It measures only
while the process is saturated: every slot taken and the last claim full, so there was more
to claim. A measurement is the rate of work done (checkpoints and completions committed per
second) over a window of at least :data:`WINDOW_S` and at least one item per slot. A probe
compares one window at the limit with the next window at the probed limit, once the process
has filled (or drained) to it:

* up (twice the limit) is kept when it did at least :data:`GAIN` times the work;
* down (half) is kept when it did at least :data:`KEEP_DOWN` of it: the extra slots bought
  (next to) nothing.

A probe that is kept goes on the same way (from the start, the limit doubles until a
doubling stops paying), one that is not is undone; then the limit holds, and every
:data:`HOLD_S` it probes again, in the other direction each time, so it follows a disk or a
workload that changes. A window the process spends less than saturated (a claim came back
short, the queue drained) is thrown away: with no backlog the limit is never reached, so it costs
nothing, and nothing is learned from it.

``--concurrency N`` fixes the limit at N: what a step calls (an API with a rate limit, a
licence count) may need an exact bound; queue limits are the fleet-wide one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum

log = logging.getLogger("kestrel.worker")

START = 256
"""Where an adaptive limit starts: the best of 64, 128 and 256 on the 2-core VM at both
flush delays (BENCHMARKS.md, issue 23, item 1); from there one or two doublings reach the
knee measured later (512 to 1,024 there, item 4)."""

FLOOR = 32
"""The least an adaptive limit goes down to."""
CEILING = 1024
"""The most an adaptive limit goes up to (and the step threads' pool size)."""
WINDOW_S = 0.5
"""The shortest window a rate is measured over."""
GAIN = 1.05
"""A doubling is kept when it did at least this many times the work."""
KEEP_DOWN = 0.98
"""A halving is kept when it did at least this share of the work: fewer slots are worth a
little (each execution waits less in the process, a crash strands fewer), not much."""
HOLD_S = 10.0
"""How long the limit holds after a probe ends before the next one."""


class _Phase(Enum):
    BASE = "base"  # measuring the rate at the limit
    PROBE = "probe"  # measuring the rate at the probed limit
    HOLD = "hold"  # settled until the next probe


class Slots:
    """The limit on executions in flight: ``fixed`` when given, else adaptive.

    The claimer calls :meth:`observe` on every round with the executions running, and
    :meth:`short` when a claim came back with less than it asked for; *work* counts the
    items the process's writers have committed (a monotonic counter); *clock* is
    ``time.monotonic``.
    """

    def __init__(self, fixed: int | None, *, work: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, start: int = START,
                 floor: int = FLOOR, ceiling: int = CEILING) -> None:
        self.adaptive = fixed is None
        self.limit = fixed if fixed is not None else min(max(start, floor), ceiling)
        self._floor, self._ceiling = floor, ceiling
        self._work, self._clock = work, clock
        self._phase = _Phase.BASE
        self._up_next = True  # the direction of the next probe: up first, from the start
        self._base_limit = self.limit
        self._base_rate = 0.0
        self._since: float | None = None  # the window's start (None: not saturated yet)
        self._at = 0
        self._hold_until = 0.0
        self.changes = 0

    def observe(self, running: int) -> None:
        """One claimer round with *running* executions in flight."""
        if not self.adaptive:
            return
        now = self._clock()
        if self._phase is _Phase.HOLD:
            if now < self._hold_until:
                return
            self._phase, self._since = _Phase.BASE, None
        if self._since is None:
            # A window starts once the process has filled to the limit (after a rise, or a
            # claim short of the backlog) or drained to it (after a fall); then it runs,
            # whatever the claimer's dips between a batch of completions and its claims,
            # until it is long enough or a short claim voids it.
            if self.limit - max(1, self.limit // 8) <= running <= self.limit:
                self._since, self._at = now, self._work()
            return
        elapsed, done = now - self._since, self._work() - self._at
        if elapsed < WINDOW_S or done < self.limit:
            return
        self._decide(done / elapsed, now)

    def short(self) -> None:
        """A claim came back short: the process is not saturated, the window is void."""
        self._since = None

    def _decide(self, rate: float, now: float) -> None:
        if self._phase is _Phase.BASE:
            self._base_limit, self._base_rate = self.limit, rate
            target = (min(self.limit * 2, self._ceiling) if self._up_next
                      else max(self.limit // 2, self._floor))
            if target == self.limit:
                self._up_next = not self._up_next
                self._hold(now)
                return
            self._set(target, _Phase.PROBE)
            return
        went_up = self.limit > self._base_limit
        kept = (rate >= self._base_rate * GAIN if went_up
                else rate >= self._base_rate * KEEP_DOWN)
        log.debug("concurrency probe %d -> %d: %.0f -> %.0f items/s, %s", self._base_limit,
                  self.limit, self._base_rate, rate, "kept" if kept else "undone")
        if kept:
            # Go on the same way while it pays; this window is the next probe's base.
            target = (min(self.limit * 2, self._ceiling) if went_up
                      else max(self.limit // 2, self._floor))
            if target != self.limit:
                self._base_limit, self._base_rate = self.limit, rate
                self._set(target, _Phase.PROBE)
                return
        else:
            self._set(self._base_limit, _Phase.HOLD)
        self._up_next = not went_up
        self._hold(now)

    def _set(self, limit: int, phase: _Phase) -> None:
        if limit != self.limit:
            self.changes += 1
        self.limit, self._phase, self._since = limit, phase, None

    def _hold(self, now: float) -> None:
        self._phase, self._since, self._hold_until = _Phase.HOLD, None, now + HOLD_S
