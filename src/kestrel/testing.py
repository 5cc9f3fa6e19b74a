"""Test your own workflows against a real PostgreSQL: the ``kestrel.testing`` pytest plugin.

Installed with kestrel (entry point ``pytest11``), so a user's test needs no import to get
the fixtures:

* ``kestrel_dsn`` (session): the PostgreSQL to test against: ``--kestrel-dsn``, else
  ``KESTREL_TEST_DSN``, else an embedded server in a temporary folder when
  ``kestrel-runtime[embedded]`` is installed, else a one-line error saying how to give one.
* ``kestrel_env`` (each test): a :class:`KestrelTestEnv` on a schema migrated once per test
  session (``kestrel_test_<random>``) and emptied before each test, with its clock back at
  the real time and no fault armed.

:meth:`KestrelTestEnv.run_to_completion` submits a workflow, runs a real worker (claims,
group commits, leases, the sweeper) in the test's process until the execution ends, and
returns a :class:`Run`: the result and the step timeline. Faults are the runtime's own
failpoints (:mod:`kestrel.failpoints`) armed for one step: :meth:`KestrelTestEnv.fail_step`
makes a step body raise, so its retry policy and the workflow's error handling run;
:meth:`KestrelTestEnv.crash_after_checkpoint` kills the worker right after that step's
checkpoint committed (the writer halts before it hears the commit), and the run goes on the
way a real crash is recovered: the lease expires, the sweeper re-queues the execution, a new
worker replays it from its checkpoints.

Time is the database's (``kestrel_now()``: ``now()`` plus the offset of a schema made for
tests, ``migrate(..., test_clock=True)``; a production schema's is ``now()`` and cannot move),
so the kit moves that clock, never a mock: when nothing can run and the execution sleeps
(``ctx.sleep``), :meth:`run_to_completion` moves the clock to the sleep's end; and
:meth:`KestrelTestEnv.advance_clock` moves it by hand (past a signal's timeout, say). Moving
the clock is what the runtime sees when that much time passes: a sleep ends, a deadline
passes, a lease expires. The kit works only on a schema made for tests: it refuses any other
(a production schema), since :meth:`KestrelTestEnv.reset` empties every table.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
import pytest

from kestrel import db, failpoints
from kestrel.client import Client, SyncClient
from kestrel.config import Config
from kestrel.definitions import StepInfo, _spec, registry
from kestrel.errors import ConfigError
from kestrel.sql import Queries, queries
from kestrel.types import Status, StepRow, StepWrite

if TYPE_CHECKING:
    from kestrel.replay import ReplayResult
    from kestrel.workflow import WorkflowFn

__all__ = ["KestrelTestEnv", "Run", "TimelineEntry", "areplay", "dsn_for_tests", "replay"]

MAX_ADVANCE_S = 100 * 365.25 * 24 * 3600
"""The most :meth:`KestrelTestEnv.advance_clock` moves the clock at once (100 years)."""

_DSN_HELP = ("give the tests a PostgreSQL with --kestrel-dsn=postgresql://… or "
             "KESTREL_TEST_DSN, or pip install 'kestrel-runtime[embedded]' for a private one")


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
    included)."""

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

    def assert_timeline(self, expected: Sequence[tuple[str, int, str] | str]) -> None:
        """Assert the steps, in order: each entry a name, or ``(name, attempt, status)``.

        Raises:
            AssertionError: naming the first difference and showing both timelines.
        """
        __tracebackhide__ = True  # pytest shows the caller's line, not this one
        got = self.timeline
        want = [e if isinstance(e, tuple) else (e,) for e in expected]
        shown = [tuple(g[:len(w)]) for g, w in zip(got, want, strict=False)]
        if len(got) != len(want) or shown != [tuple(w) for w in want]:
            raise AssertionError(
                f"execution {self.id} ({self.workflow}) recorded\n  "
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
        conn = psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None)
        if not self._checked:
            try:
                self._own(db.run_sync(conn, db.value(queries(self.schema).has_test_clock, {})))
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
            db.run_sync(conn, db.reset_for_test(queries(self.schema)))

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
            now: datetime = db.run_sync(conn, db.advance_clock(queries(self.schema),
                                                               seconds=float(seconds)))
        return now

    def now(self) -> datetime:
        """The database clock as the runtime reads it (``kestrel_now()``)."""
        with self._sync() as conn:
            now: datetime = db.run_sync(conn, db.db_now(queries(self.schema)))
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

    def run_until_finished(self, execution_id: uuid.UUID | str, *, skip_sleeps: bool = True,
                           timeout: float = 60.0) -> Run:
        """Run a worker in this process until *execution_id* (submitted before, perhaps by
        an earlier run that timed out) ends; return the :class:`Run`.

        Raises:
            RuntimeError: called inside a running event loop (await
                :meth:`arun_until_finished` there).
            TimeoutError: it has not ended after *timeout* seconds.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_until_finished(
                uuid.UUID(str(execution_id)), skip_sleeps=skip_sleeps, timeout=timeout))
        raise RuntimeError("run_until_finished() inside a running event loop: use "
                           "`await kestrel_env.arun_until_finished(...)` in an async test")

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

    async def arun_until_finished(self, execution_id: uuid.UUID, *, skip_sleeps: bool = True,
                                  timeout: float = 60.0) -> Run:
        """Run workers in this event loop until *execution_id* (already submitted) ends.

        A worker killed by :meth:`crash_after_checkpoint` is replaced by a new one after
        the clock moved past its lease, as a restarted process would find it.

        Raises:
            LookupError: there is no such execution.
            TimeoutError: it has not ended after *timeout* seconds.
        """
        from kestrel.worker import Worker

        await self._check_async()
        q = queries(self.schema)
        deadline = time.monotonic() + timeout
        crashes, skipped = 0, 0.0
        # One connection watches (no prepared statements: it may go through PgBouncer).
        async with await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, prepare_threshold=None) as conn:
            submitted = await db.run(conn, db.get_execution(q, id=execution_id))
            if submitted is None:
                raise LookupError(f"no execution {execution_id} in schema {self.schema}")
            while True:
                worker = Worker(self.config([submitted.queue]), registry(), dsn=self.dsn)
                task = asyncio.create_task(worker.run(), name="kestrel-test-worker")
                try:
                    skipped += await self._watch(conn, q, execution_id, task, skip_sleeps,
                                                 deadline)
                finally:
                    if not task.done():
                        worker.stop(drain_timeout=5)
                        await asyncio.gather(task, return_exceptions=True)
                if not _halted(task):
                    break
                # The worker died as a killed process does: its leases lapse, then another
                # worker recovers the execution (the sweeper, then a claim and a replay).
                crashes += 1
                await db.run(conn, db.advance_clock(q, seconds=self.lease + 1.0))
            ex = await db.run(conn, db.get_execution(q, id=execution_id))
            steps = await db.run(conn, db.list_steps(q, id=execution_id))
        assert ex is not None
        return Run(id=ex.id, workflow=ex.workflow, status=ex.status, result=ex.result,
                   error=ex.error, steps=steps, crashes=crashes, skipped_s=skipped)

    async def _check_async(self) -> None:
        """Refuse a schema not made for tests (see the class), before anything runs."""
        if self._checked:
            return
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True,
                                                     prepare_threshold=None)
        try:
            self._own(await db.run(conn, db.value(queries(self.schema).has_test_clock, {})))
        finally:
            await conn.close()

    async def _watch(self, conn: psycopg.AsyncConnection[Any], q: Queries,
                     execution_id: uuid.UUID, task: asyncio.Task[None], skip_sleeps: bool,
                     deadline: float) -> float:
        """Poll until the execution ended or the worker *task* did; return the seconds of
        sleep skipped meanwhile."""
        skipped = 0.0
        while True:
            ex = await db.run(conn, db.get_execution(q, id=execution_id))
            if ex is None:
                raise LookupError(f"no execution {execution_id} in schema {self.schema}")
            if ex.status.terminal:
                return skipped
            if task.done():
                if _halted(task):
                    return skipped
                task.result()  # a worker that ended otherwise: its error is the test's
                raise RuntimeError("the test worker stopped before the execution ended")
            if skip_sleeps:
                jumped = await db.run(conn, db.skip_to_next_sleep(q))
                skipped += jumped or 0.0
            if time.monotonic() > deadline:
                raise TimeoutError(_describe_wait(execution_id, await db.run(
                    conn, db.waiting_for(q, id=execution_id))))
            await asyncio.sleep(0.05)


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


# -- replay before deploy ---------------------------------------------------------------------


def replay(histories: str | os.PathLike[str] | None = None,
           workflows: Mapping[str, WorkflowFn] | Iterable[WorkflowFn] | None = None, *,
           dsn: str | None = None, schema: str = "kestrel",
           ids: Sequence[uuid.UUID | str] = (), workflow: str | None = None,
           status: str | None = None, limit: int | None = None, check: bool = True,
           timeout: float = 30.0, max_history_bytes: int | None = None,
           ) -> list[ReplayResult]:
    """Replay recorded histories through *workflows* (the new code) and return one
    :class:`~kestrel.replay.ReplayResult` per execution; with *check*, raise
    :class:`~kestrel.replay.ReplayFailed` (an AssertionError, one line per execution the new
    code would break) if any would break.

    The histories come from a file ``kestrel-runtime export-histories`` wrote (*histories*)
    or from a database (*dsn*, *schema*: read in one read-only snapshot), not both; *ids*,
    *workflow*, *status* and *limit* select among them (from a database, the newest 100 by
    default). *workflows* is a mapping of recorded workflow name to the function that now
    runs it, or registered workflow functions, or None for every registered workflow. It is
    the same replay as ``kestrel-runtime replay`` (see :mod:`kestrel.replay`): nothing is
    written, no step body runs.

    Raises:
        ReplayFailed: *check* and some execution diverges, needs newer code, raises where it
            did not fail, or is live under a workflow *workflows* lacks.
        HistoryFileError: a line of the file is not a history.
        ExecutionNotFound: an id names no execution.
        RuntimeError: called inside a running event loop (``await areplay(...)`` there).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(areplay(histories, workflows, dsn=dsn, schema=schema, ids=ids,
                                   workflow=workflow, status=status, limit=limit,
                                   check=check, timeout=timeout,
                                   max_history_bytes=max_history_bytes))
    raise RuntimeError("kestrel.testing.replay() inside a running event loop: use "
                       "`await kestrel.testing.areplay(...)` in an async test")


async def areplay(histories: str | os.PathLike[str] | None = None,
                  workflows: Mapping[str, WorkflowFn] | Iterable[WorkflowFn] | None = None, *,
                  dsn: str | None = None, schema: str = "kestrel",
                  ids: Sequence[uuid.UUID | str] = (), workflow: str | None = None,
                  status: str | None = None, limit: int | None = None, check: bool = True,
                  timeout: float = 30.0, max_history_bytes: int | None = None,
                  ) -> list[ReplayResult]:
    """:func:`replay` in the caller's event loop (an async test)."""
    from kestrel import replay as rp

    if (histories is None) == (dsn is None):
        raise TypeError("kestrel.testing.replay: give a histories file or a dsn (one of them)")
    sel = rp.Selection(ids=tuple(dict.fromkeys(uuid.UUID(str(i)) for i in ids)),
                       workflow=workflow,
                       status=status, limit=limit)
    rp.check_selection(sel)
    fns = rp.resolve_workflows(workflows)
    found = await asyncio.to_thread(_load_histories, histories, dsn, schema, sel,
                                    max_history_bytes)
    results = await rp.replay_all(found, fns, timeout=timeout)
    if check and any(r.failed for r in results):
        raise rp.ReplayFailed(rp.failure_message(results), results)
    return results


def _load_histories(histories: str | os.PathLike[str] | None, dsn: str | None, schema: str,
                    sel: Any, max_history_bytes: int | None) -> list[Any]:
    """The selected histories from the file, else from the database (blocking)."""
    from kestrel import codec
    from kestrel import replay as rp
    from kestrel.errors import ExecutionNotFound

    max_history = max_history_bytes or codec.MAX_HISTORY_BYTES
    if histories is None:
        assert dsn is not None
        return list(rp.histories_from_db(dsn, schema, sel, max_history_bytes=max_history))
    path = os.fspath(histories)
    limit = rp.line_limit(max_history, codec.DEFAULT_MAX_PAYLOAD_BYTES)
    with open(path, "rb") as f:
        found = [h for h in rp.read_histories(f, name=path, max_line_bytes=limit)
                 if sel.matches(h)]
    found = found[:sel.limit] if sel.limit else found
    missing = set(sel.ids) - {h.id for h in found}
    if missing:
        raise ExecutionNotFound(f"no execution {min(missing)} in {path}")
    return found


# -- the pytest plugin ------------------------------------------------------------------------


def dsn_for_tests(option: str | None, data_dir: Any) -> tuple[str, Any]:
    """The PostgreSQL a test session uses, and the embedded server's handle (or None).

    *option* is ``--kestrel-dsn``; then ``KESTREL_TEST_DSN``; then an embedded server in
    *data_dir* when the ``embedded`` extra is installed.

    Raises:
        ConfigError: none of them is available (the message says how to give one).
    """
    dsn = option or os.environ.get("KESTREL_TEST_DSN")
    if dsn:
        return dsn, None
    from kestrel import embedded

    if not embedded.available():
        raise ConfigError(f"kestrel.testing needs a PostgreSQL: {_DSN_HELP}")
    return embedded.start(data_dir)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--kestrel-dsn``: the PostgreSQL the ``kestrel_env`` fixture tests against."""
    parser.addoption("--kestrel-dsn", default=None, metavar="DSN",
                     help="PostgreSQL for kestrel.testing's fixtures (default: "
                          "KESTREL_TEST_DSN, else an embedded server if installed).")


@pytest.fixture(scope="session")
def kestrel_dsn(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The PostgreSQL of this test session (see :func:`dsn_for_tests`)."""
    try:
        dsn, server = dsn_for_tests(request.config.getoption("--kestrel-dsn"),
                                    tmp_path_factory.mktemp("kestrel-pg") / "data")
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    yield dsn
    if server is not None:
        server.cleanup()


@pytest.fixture(scope="session")
def kestrel_schema(kestrel_dsn: str) -> Iterator[str]:
    """A schema made for tests (its clock moves), migrated once for the test session and
    dropped at its end."""
    from kestrel.migrate import migrate

    name = f"kestrel_test_{uuid.uuid4().hex[:12]}"
    migrate(kestrel_dsn, name, test_clock=True)
    yield name
    try:
        conn = psycopg.connect(kestrel_dsn, autocommit=True)
    except psycopg.OperationalError:
        return  # the server went first (its fixture ended before this one): nothing to drop
    with conn:
        db.run_sync(conn, db.command(queries(name).drop_schema))


@pytest.fixture
def kestrel_env(kestrel_dsn: str, kestrel_schema: str) -> Iterator[KestrelTestEnv]:
    """A :class:`KestrelTestEnv`: the session's schema, emptied, the clock at the real time,
    no fault armed."""
    env = KestrelTestEnv(kestrel_dsn, kestrel_schema)
    env.reset()
    yield env
    failpoints.disarm()

