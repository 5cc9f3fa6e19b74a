"""Workflows, steps and the replay context.

A workflow is an ``async def`` taking a :class:`Context` and its JSON arguments. Each
``await ctx.step(fn, *args)`` is numbered in call order. When a step already has a checkpoint
the recorded output is returned (or its recorded error raised) without running the body; when
it has none the body runs, its output is encoded and checkpointed, and the workflow goes on
only after that checkpoint has committed. Whatever the live run got back is exactly what every
replay gets back, because both read the stored value.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, overload
from uuid import UUID

import orjson

from kestrel import codec, connections, metrics, tracing

# Re-exported (``X as X``): the declarations live in kestrel.definitions.
from kestrel.definitions import (
    P as P,
)
from kestrel.definitions import (
    RetryPolicy as RetryPolicy,
)
from kestrel.definitions import (
    StepInfo as StepInfo,
)
from kestrel.definitions import (
    StepSpec as StepSpec,
)
from kestrel.definitions import (
    T as T,
)
from kestrel.definitions import (
    W as W,
)
from kestrel.definitions import (
    WorkflowFn as WorkflowFn,
)
from kestrel.definitions import (
    _current_step as _current_step,
)
from kestrel.definitions import (
    _registry as _registry,
)
from kestrel.definitions import (
    _spec as _spec,
)
from kestrel.definitions import (
    current_step as current_step,
)
from kestrel.definitions import (
    describe_error as describe_error,
)
from kestrel.definitions import (
    registry as registry,
)
from kestrel.definitions import (
    step as step,
)
from kestrel.definitions import (
    workflow as workflow,
)
from kestrel.definitions import (
    workflow_name as workflow_name,
)
from kestrel.errors import (
    Cancelled,
    ChildFailed,
    CodeTooOld,
    KestrelError,
    LeaseLost,
    NonDeterminismError,
    SerializationError,
    StepFailed,
    WriteRejected,
)
from kestrel.failpoints import failpoint
from kestrel.types import Claimed, RecordedStep, SignalTaken, StepSaved, StepWrite

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from kestrel.lease import Lease

class Writer(Protocol):
    """What a Context needs from its worker: group commit and the database, each call made
    under the execution's :class:`~kestrel.lease.Lease` (its id *and* epoch)."""

    async def save_step(self, write: StepWrite) -> StepSaved:
        """Checkpoint *write* in the next group commit; return what is now recorded."""

    async def park(self, lease: Lease, *, step_id: int, waiting_for: str,
                   seconds: float | None, seen_seq: int | None) -> str:
        """Park the execution at a wait: parked, cancelled, signalled, recorded or lost
        (statements.executions.park)."""

    async def load_step(self, lease: Lease, *, step_id: int) -> RecordedStep | None:
        """Read the checkpoint recorded at *step_id* (a wait park refused as recorded)."""

    async def consume_signal(self, lease: Lease, *, step_id: int, name: str,
                             step_name: str) -> SignalTaken:
        """Consume a pending signal into the wait's checkpoint
        (statements.steps.consume_signal)."""

    async def set_event(self, lease: Lease, key: str, value: str) -> bool:
        """Upsert an event value, fenced by the epoch."""

    async def submit_child(self, lease: Lease, *, workflow: str, args: str, queue: str,
                           priority: int, key: str, timeout_s: float | None) -> UUID:
        """Submit a child execution under an idempotency key."""

    async def send_signal(self, lease: Lease, execution_id: UUID, name: str,
                          payload: str | None, key: str) -> bool:
        """Deliver a signal to another execution under an idempotency key."""


class Park(BaseException):
    """Unwinds a workflow that is now parked as a row (a sleep, a signal or child wait).

    A BaseException so that workflow code's ``except Exception`` cannot swallow it.
    """


class HistoryEnd(BaseException):
    """Unwinds a read-only replay (``Context.read_only``, ``kestrel-runtime replay``) at the
    first position its history does not hold, after the checks a claim makes there: from
    here a worker would run a step body or write, and a replay does neither.

    A BaseException, as :class:`Park` is, so that workflow code cannot swallow it.
    """

    def __init__(self, position: int, what: str) -> None:
        super().__init__(f"the history ends at step {position} ({what})")
        self.position = position
        self.what = what


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


@dataclass(frozen=True, slots=True)
class ChildHandle:
    """A child execution started by :meth:`Context.start_child`."""

    id: UUID
    workflow: str


_SLEEP = "kestrel.sleep"
_SIGNAL = "kestrel.signal:"
_PATCH = "kestrel.patch:"


@dataclass(eq=False)
class Context:
    """Handed to every workflow: run steps, wait durably, talk to other executions.

    Every method that returns something a replay must see again (step outputs, signals,
    ``now``/``random``/``uuid``, child ids) is checkpointed at the next step position.
    """

    claimed: Claimed
    workflow: str
    writer: Writer
    lease: Lease
    executor: Executor | None = None
    max_payload_bytes: int = codec.DEFAULT_MAX_PAYLOAD_BYTES
    # This process's monotonic clock when the claim statement (whose db_now it carries) was
    # sent: ctx.now() is db_now plus the monotonic time since.
    claimed_mono: float = field(default_factory=time.monotonic)
    # Patch ids the workflow declared retired (@workflow(retired_patches=…)): their markers
    # are this code's own, though it no longer asks about them.
    retired_patches: frozenset[str] = frozenset()
    # A replay before deploy (kestrel.replay): at the first position the history does not
    # hold, after the same checks a claim makes there, raise HistoryEnd instead of running a
    # body, parking or recording anything. A new patch marker still goes to the writer (a
    # read-only one keeps it in memory), so the replay sees the path the code takes.
    read_only: bool = False
    history_end: HistoryEnd | None = field(default=None, init=False)
    # This attempt's span (kestrel.tracing), or None: tracing is off.
    trace: tracing.Attempt | None = None
    _next_step: int = field(default=0, init=False)
    # What the runtime decided about this attempt (lease lost, cancelled, non-determinism, a
    # refused write). Sticky: every later ctx call raises it again, so workflow code that
    # catches Exception cannot run or record another step (FAULTS P6).
    decision: KestrelError | None = field(default=None, init=False)
    # Patches (Context.patched): what each id answered in this run, and the id of the next
    # marker. Markers are checkpoints at negative ids, outside the numbering of steps, so
    # adding or later removing a patch never moves a step to another position.
    _patches: dict[str, bool] = field(default_factory=dict, init=False)
    _next_marker: int = field(default=-1, init=False)
    _recorded_upto: int = field(default=-1, init=False)
    # The patch markers of the history: (patch id, the position it was recorded at).
    _markers: list[tuple[str, int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        steps = self.claimed.steps
        self._next_marker = min((k for k in steps if k < 0), default=0) - 1
        for k, rec in steps.items():
            if k < 0 and rec.name.startswith(_PATCH):
                at = rec.output.get("at", 0) if isinstance(rec.output, dict) else 0
                self._markers.append((rec.name[len(_PATCH):], at if isinstance(at, int) else 0))
        # How far this execution got before this claim: its last checkpoint, or the wait it
        # was parked at (a parked wait has passed its position though nothing is recorded).
        upto = max((k for k in steps if k >= 0), default=-1)
        if self.claimed.wait_step is not None:
            upto = max(upto, self.claimed.wait_step)
        self._recorded_upto = upto

    @property
    def execution_id(self) -> UUID:
        """The id of the execution this workflow runs as."""
        return self.claimed.id

    @property
    def next_position(self) -> int:
        """The step position the next step or wait of this run takes."""
        return self._next_step

    @property
    def attempt(self) -> int:
        """How many times this execution has been claimed since it last parked."""
        return self.claimed.attempt

    # -- steps --------------------------------------------------------------------------------

    @overload
    async def step(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T: ...
    @overload
    async def step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...
    async def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Return the recorded output of the next step, or run *fn* once and record it.

        Raises:
            StepFailed: the step failed (now, or in the run that recorded it).
            NonDeterminismError: a different step was recorded at this position.
            Cancelled: the execution was cancelled; it stops at this step boundary.
            LeaseLost: this worker no longer owns the execution.
        """
        return await self._step(_spec(fn), fn, args, kwargs)

    async def _step(self, spec: StepSpec, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        step_id = self._take_position()
        recorded = self.claimed.steps.get(step_id)
        if recorded is not None:
            if self.trace is not None:
                self.trace.replayed += 1  # no span: the body does not run (kestrel.tracing)
            return self._replay(step_id, spec.name, recorded)
        self._check_can_start()
        self._check_unrecorded(step_id, None, spec.name, spec.name)
        if self.trace is None:
            return await self._run_step(step_id, spec, fn, args, kwargs, None)
        with self.trace.step(spec.name, step_id) as span:
            return await self._run_step(step_id, spec, fn, args, kwargs, span)

    async def _run_step(self, step_id: int, spec: StepSpec, fn: Callable[..., Any],
                        args: tuple[Any, ...], kwargs: dict[str, Any],
                        span: tracing.StepSpan | None) -> Any:
        """Run the body of the unrecorded step at *step_id* (with its retries) and record
        what it returned or raised; return the recorded output."""
        clock = time.perf_counter()
        output: str | None = None
        error: str | None = None
        attempt = 1
        labels = (self.workflow, metrics.step_label(spec.name))
        while True:
            info = StepInfo(self.execution_id, step_id, spec.name, attempt, self.claimed.epoch)
            try:
                value = await self._run_body(info, fn, args, kwargs)
                output = codec.encode(
                    value,
                    what=f"output of step {spec.name!r} in workflow {self.workflow!r}",
                    max_bytes=self.max_payload_bytes,
                )
                break
            except SerializationError as exc:
                error = codec.encode(describe_error(exc), what="step error")
                break
            except (LeaseLost, Cancelled) as exc:
                # From a runtime call inside an internal step: the lease is gone, or a child
                # could not start because this execution is being cancelled (ParentCancelled).
                self._decide(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if attempt >= spec.retry.attempts or not isinstance(exc, spec.retry.retry_on):
                    error = codec.encode(describe_error(exc), what="step error")
                    break
                metrics.get().step_retries.labels(*labels).inc()
                if span is not None:
                    span.retried(attempt, exc)
                await asyncio.sleep(spec.retry.delay(attempt))
                if not self.lease.trusted():
                    self._decide(LeaseLost(f"lease of {self.execution_id} expired during a "
                                           "retry"))
                attempt += 1
        if span is not None:
            span.tried(attempt)
        m = metrics.get()
        ran = time.perf_counter() - clock
        m.child(m.step_seconds, *labels).observe(ran)
        m.child(m.step_runs, *labels, "error" if error else "ok").inc()
        return await self._record(step_id, spec.name, output, error, attempt, ran)

    async def _record(self, step_id: int, name: str, output: str | None, error: str | None,
                      attempt: int, ran_s: float) -> Any:
        write = StepWrite(self.execution_id, self.claimed.epoch, step_id, name, output, error,
                          attempt, ran_s)
        try:
            saved = await self.writer.save_step(write)
        except LeaseLost as exc:
            # Retried for contention until the lease was no longer trusted: not refused.
            self._decide(exc)
        except Exception as exc:
            # The database refused this checkpoint alone (the rest of its group commit went
            # through). A value it cannot store fails the execution; a refusal of the
            # database's own (a limit, its disk, a timeout) ends this attempt, which counts
            # toward max_attempts, so a repeat ends in quarantine, never in a loop.
            metrics.get().rejected_writes.labels("checkpoint").inc()
            if connections.is_data_error(exc):
                self._decide(WriteRejected(
                    f"the database refused the checkpoint of step {name!r}: "
                    f"{type(exc).__name__}: {exc}"))
            self._decide(LeaseLost(f"the database refused the checkpoint of step {name!r} "
                                   f"({type(exc).__name__}); dropping this attempt"))
        if saved.cancelled:
            self._cancel()
        if not saved.owned:
            self._decide(LeaseLost(f"execution {self.execution_id} was claimed by a newer "
                                   "epoch"))
        assert saved.recorded is not None
        return self._replay(step_id, name, saved.recorded)

    def _take_position(self) -> int:
        if self.decision is not None:
            raise self.decision
        step_id = self._next_step
        self._next_step += 1
        return step_id

    def _decide(self, decision: KestrelError) -> NoReturn:
        """Record the runtime's decision about this attempt (the first one stands) and
        raise it."""
        if self.decision is None:
            self.decision = decision
        raise self.decision

    def _check_can_start(self) -> None:
        if self.lease.cancel_requested:
            self._cancel()
        if not self.lease.trusted():
            self._decide(LeaseLost(f"lease of {self.execution_id} may have expired; not "
                                   "starting a step"))

    def _cancel(self) -> NoReturn:
        self._decide(Cancelled(f"execution {self.execution_id} was cancelled"))

    def _replay(self, step_id: int, name: str, recorded: RecordedStep) -> Any:
        if recorded.name != name:
            unknown = self._unknown_patches(step_id)
            if unknown:
                self._too_old(unknown, f"called step {name!r} at position {step_id} where "
                                       f"{recorded.name!r} is recorded")
            self._decide(NonDeterminismError(
                f"workflow {self.workflow!r} called step {name!r} at position {step_id}, "
                f"but the recorded history has {recorded.name!r} there; the workflow code "
                "changed under a running execution",
                position=step_id, recorded=recorded.name, called=name))
        if recorded.error is not None:
            raise StepFailed(name, recorded.error.get("type", "Error"),
                             recorded.error.get("message", ""))
        return recorded.output

    def _unknown_patches(self, position: int) -> list[str]:
        """Patch ids recorded at or before *position* that this run never asked about and
        the workflow has not declared retired: the history was written by code that knows
        a patch this code does not."""
        return sorted({patch for patch, at in self._markers
                       if at <= position and patch not in self._patches
                       and patch not in self.retired_patches})

    def _too_old(self, unknown: list[str], what: str) -> NoReturn:
        self._decide(CodeTooOld(
            f"workflow {self.workflow!r} {what}, but newer code recorded patch {unknown[0]!r} "
            "before it, which this code does not know; leaving the execution to a worker "
            "that runs the newer version"))

    def _check_unrecorded(self, step_id: int, wait: str | None, what: str,
                          called: str) -> None:
        """Before this run records or parks anything at *step_id*, a position its history
        has no checkpoint for (FAULTS O5): the code must know every patch recorded up to
        here (else the newer code that recorded it must go on: CodeTooOld), and at the
        position the execution was parked at, the call must be the wait it was parked for
        (*wait*: ``kestrel.sleep`` or a signal's name; None for a step). *called* is the
        call's step name (``kestrel.sleep``, ``kestrel.signal:<name>``).

        A read-only replay ends here (HistoryEnd), having made the same checks."""
        unknown = self._unknown_patches(step_id)
        if unknown:
            self._too_old(unknown, f"reached position {step_id} ({what})")
        c = self.claimed
        if c.wait_step == step_id and c.waiting_for is not None and wait != c.waiting_for:
            parked = c.waiting_for if c.waiting_for == _SLEEP else _SIGNAL + c.waiting_for
            self._decide(NonDeterminismError(
                f"workflow {self.workflow!r} called {what} at position {step_id}, but the "
                f"execution was parked there waiting for {c.waiting_for!r}; the workflow "
                "code changed under a running execution",
                position=step_id, recorded=parked, called=called))
        if self.read_only:
            if self.history_end is None:
                self.history_end = HistoryEnd(step_id, what)
            raise self.history_end

    def check_end(self) -> None:
        """Before the workflow's own end (its result, or the error it raised) is recorded:
        the end is an unrecorded position too, so every patch recorded must be known
        (CodeTooOld otherwise, which :meth:`_decide` records)."""
        if self.decision is None:
            unknown = self._unknown_patches(self._next_step)
            if unknown:
                self._too_old(unknown, f"ended after position {self._next_step - 1}")

    async def _run_body(
        self, info: StepInfo, fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        token = _current_step.set(info)
        try:
            failpoint("step_body", info)  # kestrel.testing's injected step failures
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            loop = asyncio.get_running_loop()
            call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
            return await loop.run_in_executor(self.executor, call)
        finally:
            _current_step.reset(token)

    async def _internal(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await self._step(StepSpec(name, RetryPolicy()), fn, args, {})

    # -- versioning ---------------------------------------------------------------------------

    async def patched(self, patch_id: str) -> bool:
        """Whether this execution takes the new code path of change *patch_id*.

        True for an execution that reaches this point under code that has the patch: a
        marker is checkpointed (before this returns), so every replay answers True again.
        False for an execution that passed this point before the change (its history goes
        beyond here with no marker): it replays the old path it recorded. The answer for one
        id is the same for the whole execution, however often it is asked. Markers take no
        step position, so the steps after a patch keep their numbers, and removing the patch
        later (once no execution needs the old path: ``kestrel-runtime patches``) is safe.

        Raises:
            SerializationError: *patch_id* is not 1-1024 characters of storable text (no
                NUL, no lone surrogate, at most 2048 bytes of UTF-8); nothing is written.
        """
        codec.check_text(patch_id, what="patch id")
        return await self._patch(patch_id)

    async def deprecate_patch(self, patch_id: str) -> None:
        """Mark where the old path of *patch_id* was removed (the code keeps only the new one).

        Records the marker like :meth:`patched` (so code that still asks ``patched`` — a
        rollback — takes the new path for executions started here) and checks that this
        execution did not need the old path.

        Raises:
            SerializationError: *patch_id* is not storable text (see :meth:`patched`).
            NonDeterminismError: this execution passed this point before the change: the old
                path was removed while it still needed it.
        """
        codec.check_text(patch_id, what="patch id")
        if not await self._patch(patch_id):
            self._decide(NonDeterminismError(
                f"execution {self.execution_id} of workflow {self.workflow!r} passed patch "
                f"{patch_id!r} before the change and needs the old code path, which this "
                f"code removed (deprecate_patch); restore `if ctx.patched({patch_id!r})` until "
                f"`kestrel-runtime list --without-patch {patch_id}` shows no live executions"))

    async def _patch(self, patch_id: str) -> bool:
        if self.decision is not None:
            raise self.decision
        known = self._patches.get(patch_id)
        if known is not None:
            return known
        name = _PATCH + patch_id
        if any(k < 0 and r.name == name for k, r in self.claimed.steps.items()):
            self._patches[patch_id] = True
            return True
        position = self._next_step
        if self._recorded_upto >= position:
            # Recorded before the change: the old path is what this history holds.
            self._patches[patch_id] = False
            return False
        self._check_can_start()
        # No new marker beside one this code does not know (also at this same position,
        # though this code might ask about it next): a marker written here would be one the
        # newer code does not know either, and neither version could go on.
        unknown = self._unknown_patches(position)
        if unknown:
            self._too_old(unknown, f"asked about patch {patch_id!r} at position {position}")
        marker = self._next_marker
        self._next_marker -= 1
        await self._record(marker, name, codec.encode({"at": position}, what="patch marker"),
                           None, 1, 0.0)
        self._patches[patch_id] = True
        return True

    # -- durable waits ------------------------------------------------------------------------

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

    def _db_now(self) -> datetime:
        base = self.claimed.db_now
        if base is None:
            return datetime.now(UTC)
        return base + timedelta(seconds=time.monotonic() - self.claimed_mono)

    async def _sleep(self, seconds: float) -> None:
        step_id = self._take_position()
        recorded = self.claimed.steps.get(step_id)
        if recorded is not None:
            self._replay(step_id, _SLEEP, recorded)
            return
        self._check_can_start()
        self._check_unrecorded(step_id, _SLEEP, "a durable sleep", _SLEEP)
        c = self.claimed
        if self._wait_is_over(step_id):
            await self._record(step_id, _SLEEP, codec.encode({"slept": True}, what="sleep"),
                               None, 1, 0.0)
            return
        recorded = await self._park(step_id, _SLEEP, seconds, None)
        if recorded is None:
            self._decide(LeaseLost(f"execution {c.id} could not be parked: no longer owned"))
        self._replay(step_id, _SLEEP, recorded)

    def _wait_is_over(self, step_id: int) -> bool:
        c = self.claimed
        return (c.wait_step == step_id and c.wait_deadline is not None
                and c.db_now is not None and c.db_now >= c.wait_deadline)

    async def _park(self, step_id: int, waiting_for: str, seconds: float | None,
                    seen_seq: int | None) -> RecordedStep | None:
        """Park at a wait and unwind (Park). Returns None when a signal arrived meanwhile
        (look again), or the checkpoint the wait's position already has: the database
        refuses to park there (FAULTS R2) and the caller replays it instead."""
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
        step_name = _SIGNAL + name
        step_id = self._take_position()
        recorded = self.claimed.steps.get(step_id)
        if recorded is None:
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

    async def signal(self, execution_id: UUID | str, name: str, payload: Any = None
                     ) -> None:
        """Send signal *name* to another execution, exactly once however often this replays."""
        codec.check_text(name, what="signal name")
        encoded = codec.encode(payload, what=f"payload of signal {name!r}",
                               max_bytes=self.max_payload_bytes)
        target = UUID(str(execution_id))

        async def send() -> bool:
            key = current_step().idempotency_key
            return await self.writer.send_signal(self.lease, target, name, encoded, key)

        await self._internal(f"kestrel.send_signal:{name}", send)

    # -- events -------------------------------------------------------------------------------

    async def set_event(self, key: str, value: Any) -> None:
        """Publish *value* under *key* for callers (``Client.get_event``).

        The step's checkpoint records ``{"value": value}``, so a fork rebuilds the events
        its copied history had published (``Client.fork``)."""
        codec.check_text(key, what="event key")
        encoded = codec.encode(value, what=f"event {key!r}", max_bytes=self.max_payload_bytes)

        async def put() -> dict[str, orjson.Fragment]:
            if not await self.writer.set_event(self.lease, key, encoded):
                raise LeaseLost(f"execution {self.execution_id} is no longer ours")
            return {"value": orjson.Fragment(encoded)}

        await self._internal(f"kestrel.set_event:{key}", put)

    # -- children -----------------------------------------------------------------------------

    async def start_child(self, wf: WorkflowFn | str, *args: Any, queue: str = "default",
                          priority: int = 0, timeout: float | None = None) -> ChildHandle:
        """Start a child execution, exactly once however often this workflow replays."""
        name = codec.check_text(workflow_name(wf), what="child workflow name")
        encoded = codec.encode(list(args), what=f"arguments of child workflow {name!r}",
                               max_bytes=self.max_payload_bytes)

        async def start() -> str:
            key = "kestrel.child:" + current_step().idempotency_key
            child = await self.writer.submit_child(
                self.lease, workflow=name, args=encoded, queue=queue, priority=priority,
                key=key, timeout_s=timeout)
            return str(child)

        child_id = await self._internal(f"kestrel.start_child:{name}", start)
        return ChildHandle(UUID(child_id), name)

    async def wait_child(self, child: ChildHandle) -> Any:
        """Wait durably for *child* to finish; return its result.

        Raises:
            ChildFailed: the child ended failed, cancelled or quarantined.
        """
        got = await self.wait_for_signal(f"kestrel.child:{child.id}")
        outcome = got.payload or {}
        if outcome.get("status") != "completed":
            raise ChildFailed(child.id, str(outcome.get("status")), outcome.get("error"))
        return outcome.get("result")

    async def child(self, wf: WorkflowFn | str, *args: Any, queue: str = "default",
                    priority: int = 0, timeout: float | None = None) -> Any:
        """Start a child execution and wait for its result (:meth:`start_child` +
        :meth:`wait_child`)."""
        handle = await self.start_child(wf, *args, queue=queue, priority=priority,
                                        timeout=timeout)
        return await self.wait_child(handle)

    # -- deterministic helpers ----------------------------------------------------------------

    async def now(self) -> datetime:
        """The current time by the database clock, recorded: a replay returns the same
        instant. It is the claim's database time plus the monotonic time since, so a
        worker's skewed or jumping wall clock does not leak in and it costs no round trip."""

        async def read() -> str:
            return self._db_now().isoformat()

        return datetime.fromisoformat(await self._internal("kestrel.now", read))

    async def random(self) -> float:
        """A random float in [0, 1), recorded: a replay returns the same number."""

        async def draw() -> float:
            return random.random()

        return float(await self._internal("kestrel.random", draw))

    async def uuid(self) -> UUID:
        """A random UUID, recorded: a replay returns the same one."""

        async def make() -> str:
            return str(uuid.uuid4())

        return UUID(await self._internal("kestrel.uuid", make))
