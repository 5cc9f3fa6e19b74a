"""The test kit's environment: :class:`KestrelTestEnv` runs a user's workflows on a real
PostgreSQL with a real worker in the test's process, moves the database clock and arms
faults for one step; :class:`Run` and :class:`Waiting` are what it saw. The pytest plugin
that hands it to tests (fixtures, the database to test on, replay) is :mod:`kestrel.testing`,
which re-exports everything public here; read its docstring first.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

import psycopg

from kestrel import connections, db, failpoints, statements
from kestrel.client import Client, SyncClient
from kestrel.config import Config
from kestrel.definitions import StepInfo, _spec, registry
from kestrel.errors import ConfigError
from kestrel.sql import Queries, queries
from kestrel.types import Execution, Status, StepRow, StepWrite

if TYPE_CHECKING:
    from kestrel.workflow import WorkflowFn


class _HasId(Protocol):
    @property
    def id(self) -> uuid.UUID:
        """The execution's id."""


ExecutionRef: TypeAlias = "uuid.UUID | str | _HasId"
"""An execution as the kit's methods take it: a handle from ``submit`` (anything with its
``id``: a :class:`Run`, a :class:`Waiting`), a UUID, or an id as text."""

MAX_ADVANCE_S = 100 * 365.25 * 24 * 3600
"""The most :meth:`KestrelTestEnv.advance_clock` moves the clock at once (100 years)."""


INTERNAL_STEPS: Mapping[str, str] = {
    "kestrel.patch:ID": "ctx.patched(ID), ctx.deprecate_patch(ID): a marker, listed before "
                        "every step (it takes no step position)",
    "kestrel.sleep": "ctx.sleep(), ctx.sleep_until()",
    "kestrel.signal:NAME": "ctx.wait_for_signal(NAME), received or timed out",
    "kestrel.signal:kestrel.child:ID": "ctx.child(), ctx.wait_child(): the end of child ID",
    "kestrel.start_child:WORKFLOW": "ctx.start_child(), ctx.child(): the child's id",
    "kestrel.send_signal:NAME": "ctx.signal(other_id, NAME, payload)",
    "kestrel.set_event:KEY": "ctx.set_event(KEY, value)",
    "kestrel.set_tags": "ctx.set_tags(name=value, …)",
    "kestrel.now": "ctx.now()",
    "kestrel.random": "ctx.random()",
    "kestrel.uuid": "ctx.uuid()",
}
"""The steps a workflow's :class:`~kestrel.Context` records by itself, as the timeline names
them (upper-case parts stand for the actual name, key, id or workflow), and the call that
records each. Every other step is one of the workflow's own ``@kestrel.step`` functions:
:attr:`Run.user_timeline` keeps only those."""

_INTERNAL_EXACT = frozenset(k for k in INTERNAL_STEPS if ":" not in k)
_INTERNAL_PREFIXES = tuple(sorted({k.split(":", 1)[0] + ":" for k in INTERNAL_STEPS if ":" in k}))


def is_internal(name: str) -> bool:
    """Whether the step *name* is one the context records by itself (:data:`INTERNAL_STEPS`),
    not one of the workflow's own steps."""
    return name in _INTERNAL_EXACT or name.startswith(_INTERNAL_PREFIXES)


class TimelineEntry(NamedTuple):
    """One step of a run as a test asserts it: compares equal to ``(name, attempt, status)``.

    *status* is ``"ok"`` (an output was recorded) or ``"error"`` (the step failed after its
    retries); *attempt* is the attempt that recorded it (1 when it never retried).
    """

    name: str
    attempt: int
    status: str


@dataclass(frozen=True, slots=True)
class Run:
    """What :meth:`KestrelTestEnv.run_to_completion` saw: how the execution ended, and its
    steps in order (internal ones such as ``kestrel.sleep`` and ``kestrel.signal:approval``
    included: :data:`INTERNAL_STEPS`; :attr:`user_timeline` leaves them out)."""

    id: uuid.UUID
    workflow: str
    status: Status
    result: Any
    error: dict[str, Any] | None
    steps: list[StepRow]
    crashes: int = 0
    skipped_s: float = 0.0

    @property
    def timeline(self) -> list[TimelineEntry]:
        """Every step as ``(name, attempt, status)``, in order."""
        return [TimelineEntry(s.name, s.attempt, "error" if s.error else "ok")
                for s in self.steps]

    @property
    def step_names(self) -> list[str]:
        """The names of the steps, in order."""
        return [s.name for s in self.steps]

    @property
    def user_timeline(self) -> list[TimelineEntry]:
        """The workflow's own steps as ``(name, attempt, status)``, in order: the
        :attr:`timeline` without the context's internal records (:data:`INTERNAL_STEPS`:
        sleeps, signal waits, events, children, ``now()``, patch markers…)."""
        return [e for e in self.timeline if not is_internal(e.name)]

    @property
    def user_step_names(self) -> list[str]:
        """The names of the workflow's own steps, in order (see :attr:`user_timeline`)."""
        return [e.name for e in self.user_timeline]

    def step(self, name: str) -> StepRow:
        """The first recorded step called *name*.

        Raises:
            AssertionError: no step of that name was recorded.
        """
        __tracebackhide__ = True
        for s in self.steps:
            if s.name == name:
                return s
        raise AssertionError(f"no step {name!r} in the timeline {self.step_names}")

    def assert_timeline(self, expected: Sequence[tuple[str, int, str] | str], *,
                        user_only: bool = False) -> None:
        """Assert the steps, in order: each entry a name, or ``(name, attempt, status)``;
        with *user_only*, only the workflow's own steps (:attr:`user_timeline`).

        Raises:
            AssertionError: naming the first difference and showing both timelines.
        """
        __tracebackhide__ = True  # pytest shows the caller's line, not this one
        got = self.user_timeline if user_only else self.timeline
        want = [e if isinstance(e, tuple) else (e,) for e in expected]
        shown = [tuple(g[:len(w)]) for g, w in zip(got, want, strict=False)]
        if len(got) != len(want) or shown != [tuple(w) for w in want]:
            which = " (its own steps)" if user_only else ""
            raise AssertionError(
                f"execution {self.id} ({self.workflow}) recorded{which}\n  "
                + "\n  ".join(map(str, got)) + "\nexpected\n  "
                + "\n  ".join(map(str, want)))

    def assert_completed(self) -> Any:
        """Assert the execution completed; return its result.

        Raises:
            AssertionError: it ended otherwise (its error is in the message).
        """
        __tracebackhide__ = True
        if self.status is not Status.COMPLETED:
            raise AssertionError(f"execution {self.id} ({self.workflow}) ended "
                                 f"{self.status.value}: {self.error}")
        return self.result


@dataclass
class KestrelTestEnv:
    """A test's kestrel: a schema made for tests on a real PostgreSQL, a worker run on
    demand, the database clock and the runtime's failpoints. Use the ``kestrel_env`` fixture.

    Every method that writes refuses a schema not made for tests (``migrate(...,
    test_clock=True)``, as the fixture makes its own) with a ConfigError, before writing
    anything: :meth:`reset` empties every table, and a production schema's clock does not
    move."""

    dsn: str
    schema: str
    lease: float = 30.0
    concurrency: int = 16
    _checked: bool = field(default=False, init=False, repr=False)

    @property
    def client(self) -> SyncClient:
        """A blocking client on this schema (submit, signal, get, steps, …)."""
        return SyncClient(self.dsn, schema=self.schema, pool_size=0)

    def config(self, queues: Sequence[str] = ()) -> Config:
        """The settings of the worker :meth:`run_to_completion` runs: fast polls and
        sweeps, the connection mode the environment asks for (KESTREL_CONNECTION_MODE,
        KESTREL_LISTEN_DSN), polling only; it serves ``default``, every queue declared with
        ``kestrel.queue()`` (with its limits) and *queues*."""
        from kestrel.queues import declared

        served = tuple(dict.fromkeys(("default", *declared(), *queues)))
        return Config(schema=self.schema, lease=self.lease, heartbeat=self.lease / 3,
                      queues=served,
                      poll_interval=0.05, sweep_interval=0.1, concurrency=self.concurrency,
                      listen=False, pool_size=4, worker_id="kestrel-test-worker",
                      connection_mode=os.environ.get("KESTREL_CONNECTION_MODE", "direct"),
                      listen_dsn=os.environ.get("KESTREL_LISTEN_DSN", ""))

    def _sync(self) -> psycopg.Connection[Any]:
        conn = connections.connect(self.dsn, prepare_threshold=None)
        if not self._checked:
            try:
                self._own(db.run_sync(conn, statements.migrate.has_test_clock(
                    queries(self.schema))))
            except BaseException:
                conn.close()
                raise
        return conn

    def _own(self, ours: object) -> None:
        """Remember that the schema was made for tests, or refuse it.

        Raises:
            ConfigError: it was not made for tests.
        """
        if not ours:
            raise ConfigError(
                f"schema {self.schema!r} was not made for tests (kestrel.migrate.migrate(..., "
                "test_clock=True)), and kestrel.testing refuses it: reset() would empty its "
                "tables, and its clock cannot be moved. Use the kestrel_env fixture's own "
                "schema.")
        self._checked = True

    # -- a clean slate, the clock, faults -----------------------------------------------------

    def reset(self) -> None:
        """Empty the schema's tables, set its clock back to the real time, disarm faults."""
        failpoints.disarm()
        with self._sync() as conn:
            db.run_sync(conn, statements.testing.reset_for_test(queries(self.schema)))

    def advance_clock(self, seconds: float) -> datetime:
        """Move the database clock forward by *seconds*; return the new database time.

        Everything the runtime decides by time sees it: sleeps and signal timeouts end,
        deadlines pass, and leases expire (so do this while no worker runs, unless a lost
        lease is what the test is about).

        Raises:
            ValueError: *seconds* is negative, not a number, or over 100 years (time does not
                go back, and PostgreSQL's intervals end).
        """
        if not 0 <= seconds <= MAX_ADVANCE_S:
            raise ValueError(f"advance_clock: seconds must be between 0 and {MAX_ADVANCE_S:.0f}"
                             f" (100 years), got {seconds}")
        with self._sync() as conn:
            now: datetime = db.run_sync(conn, statements.testing.advance_clock(queries(self.schema),
                                                               seconds=float(seconds)))
        return now

    def now(self) -> datetime:
        """The database clock as the runtime reads it (``kestrel_now()``)."""
        with self._sync() as conn:
            now: datetime = db.run_sync(conn, statements.queues.db_now(queries(self.schema)))
        return now

    def fail_step(self, step: Callable[..., Any] | str,
                  error: BaseException | type[BaseException] | None = None, *, times: int = 1,
                  attempt: int | None = None) -> None:
        """Make the body of *step* (a step function or its name) raise *error* (an exception
        or its class; default a RuntimeError) instead of running, *times* times (only on its
        *attempt*-th attempt, if given).

        The error goes where a real one would: the step's retry policy, then ``StepFailed``
        in the workflow. Disarmed by :meth:`reset` (each test starts with none).

        Raises:
            ValueError: *times* is under 1.
            TypeError: *step* is not a step or a name, or *error* is not an exception.
        """
        name = _step_name(step)
        err = error if error is not None else RuntimeError(f"injected failure in {name!r}")

        def match(info: StepInfo) -> bool:
            return info.name == name and (attempt is None or info.attempt == attempt)

        failpoints.arm("step_body", "error", times=times, match=match, error=err)

    def crash_after_checkpoint(self, step: Callable[..., Any] | str, *, times: int = 1) -> None:
        """Kill the worker right after the checkpoint of *step* (a step function or its
        name) committed, before the worker hears of it (FAULTS F2), *times* times.

        :meth:`run_to_completion` then recovers as production does: the dead worker's lease
        expires (the clock moves past it), the sweeper re-queues the execution and a new
        worker replays it; the step's body does not run again, its checkpoint is read back.

        Raises:
            ValueError: *times* is under 1.
        """

        name = _step_name(step)

        def match(writes: list[StepWrite]) -> bool:
            return any(w.name == name for w in writes)

        failpoints.arm("after_checkpoint_commit_before_ack", "halt", times=times, match=match)

    # -- running workflows --------------------------------------------------------------------

    def run_to_completion(self, wf: WorkflowFn | str, *args: Any,
                          signals: Mapping[str, Any] | None = None, skip_sleeps: bool = True,
                          timeout: float = 60.0, **submit: Any) -> Run:
        """Submit *wf* with *args*, run a worker in this process until the execution ends,
        and return the :class:`Run`.

        *signals* are sent right after the submit (a signal sent early waits for its
        ``wait_for_signal``). With *skip_sleeps*, whenever nothing can run and something
        sleeps, the database clock moves to the sleep's end. *submit* takes the
        ``Client.submit`` options (``queue=``, ``idempotency_key=``, ``timeout=``, …).

        Raises:
            RuntimeError: called inside a running event loop (await :meth:`arun_to_completion`
                there instead).
            TimeoutError: the execution has not ended after *timeout* seconds; the message
                says what it waits for.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_to_completion(
                wf, *args, signals=signals, skip_sleeps=skip_sleeps, timeout=timeout,
                **submit))
        raise RuntimeError("run_to_completion() inside a running event loop: use "
                           "`await kestrel_env.arun_to_completion(...)` in an async test")

    def run_until_finished(self, execution: ExecutionRef, *, skip_sleeps: bool = True,
                           timeout: float = 60.0) -> Run:
        """Run a worker in this process until *execution* (a handle or an id, submitted
        before, perhaps by an earlier run that timed out) ends; return the :class:`Run`.

        Raises:
            RuntimeError: called inside a running event loop (await
                :meth:`arun_until_finished` there).
            TimeoutError: it has not ended after *timeout* seconds.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_until_finished(
                execution, skip_sleeps=skip_sleeps, timeout=timeout))
        raise RuntimeError("run_until_finished() inside a running event loop: use "
                           "`await kestrel_env.arun_until_finished(...)` in an async test")

    def run_until_waiting(self, execution: ExecutionRef, *, skip_sleeps: bool = True,
                          timeout: float = 60.0) -> Waiting:
        """Run a worker in this process until *execution* (a handle or an id) is parked
        waiting for a signal (with *skip_sleeps* off, also for the end of a sleep); return
        what it waits for, a :class:`Waiting`. Then send the signal, or move the clock past
        ``waiting.seconds_left`` for its timeout, and :meth:`run_until_finished`.

        Sleeps on the way are skipped as in :meth:`run_to_completion`. While it waits for
        a child, the child runs in the same worker, and the wait returned is the child's
        (``waiting.id`` says which execution waits).

        Raises:
            AssertionError: the execution ended without waiting (its status says how).
            RuntimeError: called inside a running event loop (await
                :meth:`arun_until_waiting` there).
            TimeoutError: it neither ended nor waited within *timeout* seconds.
        """
        __tracebackhide__ = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_until_waiting(
                execution, skip_sleeps=skip_sleeps, timeout=timeout))
        raise RuntimeError("run_until_waiting() inside a running event loop: use "
                           "`await kestrel_env.arun_until_waiting(...)` in an async test")

    async def arun_to_completion(self, wf: WorkflowFn | str, *args: Any,
                                 signals: Mapping[str, Any] | None = None,
                                 skip_sleeps: bool = True, timeout: float = 60.0,
                                 **submit: Any) -> Run:
        """:meth:`run_to_completion` in the caller's event loop (an async test)."""
        await self._check_async()
        client = Client(self.dsn, schema=self.schema, pool_size=0)
        handle = await client.submit(wf, *args, **submit)
        for name, payload in (signals or {}).items():
            await client.signal(handle.id, name, payload)
        return await self.arun_until_finished(handle.id, skip_sleeps=skip_sleeps,
                                              timeout=timeout)

    async def arun_until_finished(self, execution: ExecutionRef, *, skip_sleeps: bool = True,
                                  timeout: float = 60.0) -> Run:
        """Run workers in this event loop until *execution* (a handle or an id, already
        submitted) ends.

        A worker killed by :meth:`crash_after_checkpoint` is replaced by a new one after
        the clock moved past its lease, as a restarted process would find it.

        Raises:
            LookupError: there is no such execution.
            TimeoutError: it has not ended after *timeout* seconds.
        """
        run = await self._drive(_execution_id(execution), skip_sleeps, timeout,
                                stop_at_wait=False)
        assert isinstance(run, Run)
        return run

    async def arun_until_waiting(self, execution: ExecutionRef, *, skip_sleeps: bool = True,
                                 timeout: float = 60.0) -> Waiting:
        """:meth:`run_until_waiting` in the caller's event loop (an async test)."""
        __tracebackhide__ = True
        got = await self._drive(_execution_id(execution), skip_sleeps, timeout,
                                stop_at_wait=True)
        if isinstance(got, Run):
            raise AssertionError(f"execution {got.id} ({got.workflow}) ended {got.status.value}"
                                 " without waiting for a signal; its steps: "
                                 f"{got.step_names}")
        return got

    async def _drive(self, execution_id: uuid.UUID, skip_sleeps: bool, timeout: float, *,
                     stop_at_wait: bool) -> Run | Waiting:
        """Run workers until the execution ended (a :class:`Run`) or, with *stop_at_wait*,
        until it is parked on a wait the kit does not end by itself (a :class:`Waiting`)."""
        from kestrel.worker import Worker

        await self._check_async()
        q = queries(self.schema)
        deadline = time.monotonic() + timeout
        crashes, skipped = 0, 0.0
        # One connection watches (no prepared statements: it may go through PgBouncer).
        async with await connections.connect_async(self.dsn, prepare_threshold=None) as conn:
            submitted = await db.run(conn, statements.client.get_execution(q, id=execution_id))
            if submitted is None:
                raise LookupError(f"no execution {execution_id} in schema {self.schema}")
            while True:
                worker = Worker(self.config([submitted.queue]), registry(), dsn=self.dsn)
                task = asyncio.create_task(worker.run(), name="kestrel-test-worker")
                try:
                    seen, jumped = await self._watch(conn, q, execution_id, task, skip_sleeps,
                                                     deadline, stop_at_wait)
                    skipped += jumped
                finally:
                    if not task.done():
                        worker.stop(drain_timeout=5)
                        await asyncio.gather(task, return_exceptions=True)
                if seen is not None:
                    return seen
                if not _halted(task):
                    break
                # The worker died as a killed process does: its leases lapse, then another
                # worker recovers the execution (the sweeper, then a claim and a replay).
                crashes += 1
                await db.run(conn, statements.testing.advance_clock(q, seconds=self.lease + 1.0))
            ex = await db.run(conn, statements.client.get_execution(q, id=execution_id))
            steps = await db.run(conn, statements.client.list_steps(q, id=execution_id))
        assert ex is not None
        return Run(id=ex.id, workflow=ex.workflow, status=ex.status, result=ex.result,
                   error=ex.error, steps=steps, crashes=crashes, skipped_s=skipped)

    async def _check_async(self) -> None:
        """Refuse a schema not made for tests (see the class), before anything runs."""
        if self._checked:
            return
        conn = await connections.connect_async(self.dsn, prepare_threshold=None)
        try:
            self._own(await db.run(conn, statements.migrate.has_test_clock(
                queries(self.schema))))
        finally:
            await conn.close()

    async def _watch(self, conn: psycopg.AsyncConnection[Any], q: Queries,
                     execution_id: uuid.UUID, task: asyncio.Task[None], skip_sleeps: bool,
                     deadline: float, stop_at_wait: bool) -> tuple[Waiting | None, float]:
        """Poll until the execution ended or the worker *task* did, or (with
        *stop_at_wait*) until it is parked on a wait (the :class:`Waiting`); return that
        and the seconds of sleep skipped meanwhile."""
        skipped = 0.0
        while True:
            ex = await db.run(conn, statements.client.get_execution(q, id=execution_id))
            if ex is None:
                raise LookupError(f"no execution {execution_id} in schema {self.schema}")
            if ex.status.terminal:
                return None, skipped
            if stop_at_wait and ex.status is Status.WAITING:
                parked = await _parked(conn, q, ex, await db.run(conn, statements.queues.db_now(q)),
                                       skip_sleeps)
                if parked is not None:
                    return parked, skipped
            if task.done():
                if _halted(task):
                    return None, skipped
                task.result()  # a worker that ended otherwise: its error is the test's
                raise RuntimeError("the test worker stopped before the execution ended")
            if skip_sleeps:
                jumped = await db.run(conn, statements.testing.skip_to_next_sleep(q))
                skipped += jumped or 0.0
            if time.monotonic() > deadline:
                raise TimeoutError(_describe_wait(execution_id, await db.run(
                    conn, statements.testing.waiting_for(q, id=execution_id))))
            await asyncio.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Waiting:
    """Where :meth:`KestrelTestEnv.run_until_waiting` found an execution parked.

    *id* is the execution that waits: the one run, or a child it waits for (send the
    signal there). *kind* is ``"signal"`` (a ``wait_for_signal``: *signal* is its name) or
    ``"sleep"`` (only with ``skip_sleeps=False``; *signal* is None). *until* is when the wait
    ends by
    itself, by the database clock: the signal's timeout or the sleep's end (None: a signal
    waited for without a timeout); *seconds_left* is how far that was from the database
    clock when the wait was seen, what :meth:`KestrelTestEnv.advance_clock` must pass.
    """

    id: uuid.UUID
    kind: str
    signal: str | None
    until: datetime | None
    seconds_left: float | None


def _execution_id(execution: ExecutionRef) -> uuid.UUID:
    """The id of *execution*: a handle's ``id``, a UUID, or an id as text.

    Raises:
        ValueError: text that is not a UUID.
    """
    got: object = getattr(execution, "id", execution)
    return got if isinstance(got, uuid.UUID) else uuid.UUID(str(got))


async def _parked(conn: psycopg.AsyncConnection[Any], q: Queries, ex: Execution,
                  now: datetime, skip_sleeps: bool, depth: int = 0) -> Waiting | None:
    """The wait *ex* (status waiting) is parked on, if the kit does not end it by itself:
    a signal whose timeout has not passed, or (without *skip_sleeps*) a sleep not yet over.
    A wait for a child is the child's wait, if it is parked on one (the child runs in the
    same worker: until it parks, the parent's wait is none); a delayed start is none."""
    on = ex.waiting_for
    if on is None:
        return None
    if on.startswith("kestrel.child:"):
        child = await db.run(conn, statements.client.get_execution(
            q, id=uuid.UUID(on.removeprefix("kestrel.child:"))))
        if child is None or child.status is not Status.WAITING or depth >= 64:
            return None
        return await _parked(conn, q, child, now, skip_sleeps, depth + 1)
    if ex.wake_at is not None and ex.wake_at <= now:
        return None  # due: a worker claims it next
    until = ex.wait_deadline or ex.wake_at
    left = (until - now).total_seconds() if until is not None else None
    if on == "kestrel.sleep":
        return None if skip_sleeps else Waiting(ex.id, "sleep", None, until, left)
    return Waiting(ex.id, "signal", on, until, left)


def _describe_wait(execution_id: uuid.UUID, row: tuple[Any, ...] | None) -> str:
    if row is None:
        return f"execution {execution_id} did not end in time"
    status, waiting_for, wake_at = row
    if status == "waiting" and waiting_for and not waiting_for.startswith("kestrel."):
        until = f" (it times out at {wake_at})" if wake_at else ""
        return (f"execution {execution_id} is still waiting for signal {waiting_for!r}{until}:"
                " send it with signals={...} or kestrel_env.client.signal(...), or move the "
                "clock past the timeout with kestrel_env.advance_clock(...)")
    what = f" for {waiting_for}" if status == "waiting" and waiting_for else ""
    return f"execution {execution_id} did not end in time: it is {status}{what}"


def _step_name(step: Callable[..., Any] | str) -> str:
    """The name *step* is recorded under: the ``@kestrel.step(name=…)``, else its qualified
    name, as ``ctx.step`` records it.

    Raises:
        TypeError: *step* is neither a name nor a callable.
    """
    if isinstance(step, str):
        return step
    if not callable(step):
        raise TypeError(f"a step is a step function or its name, not {type(step).__name__}")
    return _spec(step).name


def _halted(task: asyncio.Task[None]) -> bool:
    """Whether the worker *task* ended because a failpoint halted it."""
    if task.cancelled():
        return False
    exc = task.exception()
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(failpoints.Halt) is not None
    return isinstance(exc, failpoints.Halt)
