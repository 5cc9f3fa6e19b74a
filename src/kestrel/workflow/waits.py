"""Durable waits: how a Context sleeps and waits for a signal, and how such a wait replays.

A wait takes a step position like a step. Recorded there, it replays its checkpoint
(``{"slept": true}``, or the signal's ``{"received", "payload"}``). Unrecorded, after the
checks of :mod:`kestrel.workflow.steps`, it ends at once when it is already over (a sleep or
a timeout whose deadline the database clock has passed: the checkpoint is recorded and the
workflow goes on), takes a pending signal into its checkpoint (``consume_signal``), or parks
the execution as a row (``_park``, which unwinds with :class:`Park`) and frees its slot; a
later claim replays the workflow to this position and finds the wait over or the signal
there. A park the database refuses because the position already has a checkpoint replays
that checkpoint instead (FAULTS R2).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kestrel import codec
from kestrel.errors import LeaseLost
from kestrel.types import RecordedStep
from kestrel.workflow.lanes import Unwind
from kestrel.workflow.steps import SIGNAL_STEP, SLEEP_STEP, StepContext


class Park(Unwind):
    """Unwinds a workflow that is now parked as a row (a sleep, a signal or child wait).

    A BaseException so that workflow code's ``except Exception`` cannot swallow it.
    """


@dataclass(frozen=True, slots=True)
class Signal:
    """What :meth:`Context.wait_for_signal` returns: the payload, or ``timed_out``."""

    name: str
    payload: Any
    timed_out: bool

    @property
    def received(self) -> bool:
        """Whether the signal arrived (the wait did not time out)."""
        return not self.timed_out


class Waits(StepContext):
    """A Context's durable waits: sleeps and waits for a signal, each parked as a row."""

    async def sleep(self, seconds: float) -> None:
        """Sleep durably: park the execution as a row until the database clock passes
        now + *seconds*. Costs no lease, slot or coroutine while it waits; survives restarts;
        never wakes early."""
        if seconds < 0:
            raise ValueError("sleep duration must not be negative")
        await self._sleep(float(seconds))

    async def sleep_until(self, when: datetime) -> None:
        """Sleep durably until *when* (timezone-aware), by the database clock."""
        if when.tzinfo is None:
            raise ValueError("sleep_until needs a timezone-aware datetime")
        # The database clock now: the claim's database time plus the monotonic time since
        # (not the claim's time alone, which would add the time since the claim to the
        # sleep). The target is then fixed in the row, so a replay never recomputes it.
        now = self._db_now()
        await self._sleep(max(0.0, (when - now).total_seconds()))

    async def _sleep(self, seconds: float) -> None:
        step_id = self._take_position()
        try:
            await self._sleep_at(step_id, seconds)
        finally:
            self._leave()

    async def _sleep_at(self, step_id: int, seconds: float) -> None:
        recorded = self.claimed.steps.get(step_id)
        if recorded is not None:
            self._replay(step_id, SLEEP_STEP, recorded)
            return
        await self._settle()
        self._check_can_start()
        self._check_unrecorded(step_id, SLEEP_STEP, "a durable sleep", SLEEP_STEP)
        c = self.claimed
        if self._wait_is_over(step_id):
            await self._record(step_id, SLEEP_STEP, codec.encode({"slept": True}, what="sleep"),
                               None, 1, 0.0)
            return
        recorded = await self._park(step_id, SLEEP_STEP, seconds, None)
        if recorded is None:
            self._decide(LeaseLost(f"execution {c.id} could not be parked: no longer owned"))
        self._replay(step_id, SLEEP_STEP, recorded)

    def _wait_is_over(self, step_id: int) -> bool:
        c = self.claimed
        return (c.wait_step == step_id and c.wait_deadline is not None
                and c.db_now is not None and c.db_now >= c.wait_deadline)

    async def _park(self, step_id: int, waiting_for: str, seconds: float | None,
                    seen_seq: int | None) -> RecordedStep | None:
        """Park at a wait and unwind (Park). Returns None when a signal arrived meanwhile
        (look again), or the checkpoint the wait's position already has: the database
        refuses to park there (FAULTS R2) and the caller replays it instead."""
        if self._lanes.in_flight > 1:
            await self._lanes.quiet_to_park(step_id)
            if self.decision is not None:
                raise self.decision
        outcome = await self.writer.park(self.lease, step_id=step_id, waiting_for=waiting_for,
                                         seconds=seconds, seen_seq=seen_seq)
        if outcome == "parked":
            raise Park(waiting_for)
        if outcome == "cancelled":
            self._cancel()  # finished as cancelled now, not left to the sweeper (FAULTS X2)
        if outcome == "recorded":
            recorded = await self.writer.load_step(self.lease, step_id=step_id)
            if recorded is not None:
                return recorded
        if outcome != "signalled" or seen_seq is None:
            self._decide(LeaseLost(f"execution {self.execution_id} could not be parked: "
                                   "no longer owned"))
        return None

    async def wait_for_signal(self, name: str, timeout: float | None = None) -> Signal:
        """Wait durably for the signal *name*; return it, or a result with ``timed_out``.

        A signal sent before the wait is kept and returned here; each signal is consumed by
        exactly one wait. *timeout* is in seconds (None: wait for ever).
        """
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must not be negative")
        codec.check_text(name, what="signal name")
        step_name = SIGNAL_STEP + name
        step_id = self._take_position()
        try:
            return await self._wait_for_signal_at(step_id, name, step_name, timeout)
        finally:
            self._leave()

    async def _wait_for_signal_at(self, step_id: int, name: str, step_name: str,
                                  timeout: float | None) -> Signal:
        recorded = self.claimed.steps.get(step_id)
        if recorded is None:
            await self._settle()
            self._check_can_start()
            self._check_unrecorded(step_id, name, f"a wait for signal {name!r}", step_name)
            while True:
                taken = await self.writer.consume_signal(self.lease, step_id=step_id,
                                                         name=name, step_name=step_name)
                if taken.cancelled:
                    self._cancel()
                if not taken.owned:
                    self._decide(LeaseLost(f"execution {self.execution_id} is no longer ours"))
                if taken.output is not None:
                    recorded = RecordedStep(step_name, taken.output, None)
                    break
                if self._wait_is_over(step_id):
                    output = codec.encode({"received": False, "payload": None}, what="signal")
                    await self._record(step_id, step_name, output, None, 1, 0.0)
                    return Signal(name, None, timed_out=True)
                # No signal yet: park. If one arrived since we looked, park refuses and we
                # look again; if the position is recorded, that checkpoint is the answer.
                recorded = await self._park(step_id, name, timeout, taken.signal_seq)
                if recorded is not None:
                    break
        out = self._replay(step_id, step_name, recorded)
        return Signal(name, out.get("payload"), timed_out=not out.get("received"))
