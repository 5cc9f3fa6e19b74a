"""The core of a workflow's :class:`~kestrel.workflow.Context`: its state, the step path, and
the checks every position gets.

How a step replays or runs: ``step`` takes the next position; a recorded checkpoint there is
returned (or its error raised) without running the body (``_replay``, which also tells a
changed workflow, :class:`~kestrel.errors.NonDeterminismError`, from a history written by
newer code, :class:`~kestrel.errors.CodeTooOld`). An unrecorded position is checked first
(``_check_unrecorded``: every patch marker up to here known, a parked wait called as that
wait; a read-only replay ends there with :class:`HistoryEnd`); then the body runs with its
retries and its output is checkpointed through the :class:`Writer` (``_record``): held back
as the tail while the workflow's own code goes on with the value as it will be stored, and
sent before the next call takes a position or reaches the database (``_settle``), or by the
completion with the workflow's end. The runtime's decisions about an attempt (lease lost,
cancelled, a refused write) are sticky (``_decide``).

The other parts of a Context build on this one: durable waits in
:mod:`kestrel.workflow.waits`, patch markers in :mod:`kestrel.workflow.patches`, what is
recorded through internal steps (``_internal``: signals sent, events, children, ``now``) in
:mod:`kestrel.workflow.calls`; :mod:`kestrel.workflow` puts them together.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, overload
from uuid import UUID

from kestrel import codec, connections, metrics, tracing
from kestrel.definitions import (
    RetryPolicy,
    StepInfo,
    StepSpec,
    T,
    _current_step,
    _spec,
    describe_error,
    note_failed_try,
)
from kestrel.errors import (
    Cancelled,
    CodeTooOld,
    ConcurrentCallError,
    KestrelError,
    LeaseLost,
    NonDeterminismError,
    SerializationError,
    StepFailed,
    WriteRejected,
)
from kestrel.failpoints import failpoint
from kestrel.types import Claimed, RecordedStep, SignalTaken, StepSaved, StepWrite
from kestrel.workflow.lanes import Lanes, Unwind

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
        """Consume a pending signal into the wait's checkpoint (see
        statements.steps.consume_signal)."""

    async def set_event(self, lease: Lease, key: str, value: str) -> bool:
        """Upsert an event value, fenced by the epoch."""

    async def set_tags(self, lease: Lease, tags: str) -> bool:
        """Merge tag changes (a JSON object as text) into the execution's tags, fenced by
        the epoch."""

    async def submit_child(self, lease: Lease, *, workflow: str, args: str, queue: str,
                           priority: int, key: str, timeout_s: float | None) -> UUID:
        """Submit a child execution under an idempotency key."""

    async def send_signal(self, lease: Lease, execution_id: UUID, name: str,
                          payload: str | None, key: str) -> bool:
        """Deliver a signal to another execution under an idempotency key."""


class HistoryEnd(Unwind):
    """Unwinds a read-only replay (``Context.read_only``, ``kestrel-runtime replay``) at the
    first position its history does not hold, after the checks a claim makes there: from
    here a worker would run a step body or write, and a replay does neither.

    A BaseException, as :class:`~kestrel.workflow.waits.Park` is, so that workflow code
    cannot swallow it.
    """

    def __init__(self, position: int, what: str) -> None:
        super().__init__(f"the history ends at step {position} ({what})")
        self.position = position
        self.what = what


# The step names of the runtime's own checkpoints: a durable sleep, a signal wait (and the
# signal's name), a patch marker (and the patch id).
SLEEP_STEP = "kestrel.sleep"
SIGNAL_STEP = "kestrel.signal:"
PATCH_STEP = "kestrel.patch:"


@dataclass(eq=False)
class StepContext:
    """The state of a :class:`~kestrel.workflow.Context` and its step path: replay or run
    steps, record checkpoints, decide about the attempt, check each unrecorded position.
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
    # The checkpoint of the last step run, not yet sent (the tail), and the value the
    # workflow was handed for it: sent before the next call touches the database or takes
    # a position (``_settle``), or by the completion, in its statement (``take_tail``).
    _tail: tuple[StepWrite, RecordedStep] | None = field(default=None, init=False)
    # A tail on its way: every call that starts meanwhile waits for it (``_settle``).
    _sending: asyncio.Future[None] | None = field(default=None, init=False)
    # Parallel calls: lanes, calls in flight, branches, parallel waits (kestrel.workflow.lanes).
    _lanes: Lanes = field(default_factory=Lanes, init=False)

    def __post_init__(self) -> None:
        steps = self.claimed.steps
        self._next_marker = min((k for k in steps if k < 0), default=0) - 1
        for k, rec in steps.items():
            if k < 0 and rec.name.startswith(PATCH_STEP):
                at = rec.output.get("at", 0) if isinstance(rec.output, dict) else 0
                self._markers.append((rec.name[len(PATCH_STEP):], at if isinstance(at, int) else 0))
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

    def _db_now(self) -> datetime:
        """The database clock now: the claim's database time plus the monotonic time
        since (never this worker's wall clock)."""
        base = self.claimed.db_now
        if base is None:
            return datetime.now(UTC)
        return base + timedelta(seconds=time.monotonic() - self.claimed_mono)

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
        try:
            recorded = self.claimed.steps.get(step_id)
            if recorded is not None:
                if self.trace is not None:
                    self.trace.replayed += 1  # no span: the body does not run (tracing)
                return self._replay(step_id, spec.name, recorded)
            await self._settle()
            self._check_can_start()
            self._check_unrecorded(step_id, None, spec.name, spec.name)
            if self.trace is None:
                return await self._run_step(step_id, spec, fn, args, kwargs, None)
            with self.trace.step(spec.name, step_id) as span:
                return await self._run_step(step_id, spec, fn, args, kwargs, span)
        finally:
            self._leave()

    async def _run_step(self, step_id: int, spec: StepSpec, fn: Callable[..., Any],
                        args: tuple[Any, ...], kwargs: dict[str, Any],
                        span: tracing.StepSpan | None) -> Any:
        """Run the body of the unrecorded step at *step_id* (with its retries) and record
        what it returned or raised; return the recorded output."""
        clock = time.perf_counter()
        output: str | None = None
        error: str | None = None
        attempt = 1
        tries: list[dict[str, Any]] | None = None  # the failed ones before the outcome
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
                tries = note_failed_try(tries, attempt, exc, time.perf_counter() - clock)
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
        return await self._record(step_id, spec.name, output, error, attempt, ran,
                                  defer=not self.read_only,
                                  tries=None if tries is None else codec.encode(
                                      tries, what="failed tries", max_bytes=1 << 20))

    async def _record(self, step_id: int, name: str, output: str | None, error: str | None,
                      attempt: int, ran_s: float, *, defer: bool = False,
                      tries: str | None = None) -> Any:
        """Checkpoint what the step at *step_id* returned or raised and return (or raise)
        what is recorded. *defer*: a step body's checkpoint is not sent now but held as the
        tail, and the workflow goes on with the value the write will store
        (:func:`kestrel.codec.stored`, what a replay reads): the next call sends it first
        and waits for it, or the completion carries it in its own statement, so a
        workflow's last checkpoint and its end are one write (issue 23, item 3). Until the
        next call only the workflow's own code runs, which touches nothing outside."""
        await self._settle()
        write = StepWrite(self.execution_id, self.claimed.epoch, step_id, name, output, error,
                          attempt, ran_s, tries=tries)
        handed = RecordedStep(name, None if output is None else codec.stored(output),
                              None if error is None else codec.stored(error))
        if defer and self._lanes.in_flight == 1:
            # Only while no other call is in flight: a parallel one may be a body running
            # now, which must not outlive a checkpoint it could have seen not yet durable.
            self._tail = (write, handed)
            return self._replay(step_id, name, handed)
        saved = await self._save(write)
        if saved.inserted:
            return self._replay(step_id, name, handed)  # the write comes back without it
        assert saved.recorded is not None
        return self._replay(step_id, name, saved.recorded)

    async def _settle(self) -> None:
        """Send the tail, if one waits, and wait for it: before anything else of this run
        reaches the database, takes a position or records. The tail leaves first, so one
        cancelled while on its way (a deadline) is never also sent by the completion. What
        is recorded is what the workflow was handed, unless an older claim's write of the
        same position committed after this claim read the history: the workflow went on
        with a value that is not the recorded one, so this attempt is dropped (nothing more
        is written; the next claim replays the recorded value)."""
        if self._tail is not None:
            write, handed = self._tail
            self._tail = None
            # Published before the first await: a parallel call that starts while the tail
            # is on its way waits for it too (below), never runs its body before it.
            self._sending = sending = asyncio.get_running_loop().create_future()
            try:
                saved = await self._save(write)
                if not saved.inserted and saved.recorded != handed:
                    self._decide(LeaseLost(
                        f"the checkpoint of step {write.name!r} at position {write.step_id} "
                        f"was recorded by an older claim of {self.execution_id}; dropping "
                        "this attempt"))
            finally:
                self._sending = None
                sending.set_result(None)  # a failure is the decision, raised to each waiter
            return
        if self._sending is not None:
            await asyncio.shield(self._sending)
            if self.decision is not None:
                raise self.decision

    async def send_tail(self) -> None:
        """Send the tail now, if one waits (an end that the completion does not write)."""
        await self._settle()

    def take_tail(self) -> StepWrite | None:
        """The tail's checkpoint, for the completion to write in its statement; none is
        left to send after this."""
        tail, self._tail = self._tail, None
        return None if tail is None else tail[0]

    async def _save(self, write: StepWrite) -> StepSaved:
        """Send *write* through the group commit; every refusal becomes this attempt's
        decision (raised)."""
        name = write.name
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
        return saved

    # -- positions and parallel calls -----------------------------------------------------

    async def run_workflow(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run the workflow function *fn* in this task, its root lane
        (:meth:`kestrel.workflow.lanes.Lanes.run`)."""
        return await self._lanes.run(self, fn, *args)

    def _take_position(self) -> int:
        """Take the next step position, at once: positions follow the order in which the
        workflow's code makes its calls, never when a write or a body finished (README,
        "Parallel steps"). Refuses, before anything is taken, a call whose order would
        depend on timing (:class:`ConcurrentCallError`); every call that took a position
        ends with :meth:`_leave`."""
        if self.decision is not None:
            raise self.decision
        refused = self._lanes.enter(self)
        if refused is not None:
            self._decide(ConcurrentCallError(
                f"workflow {self.workflow!r}: {refused} (position {self._next_step}). Run a "
                "sequence of calls in the workflow's own task or as a child workflow, and "
                "start parallel calls together (asyncio.gather, TaskGroup), one call each"))
        step_id = self._next_step
        self._next_step += 1
        return step_id

    def _leave(self) -> None:
        self._lanes.leave(self)

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
            parked = c.waiting_for if c.waiting_for == SLEEP_STEP else SIGNAL_STEP + c.waiting_for
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
