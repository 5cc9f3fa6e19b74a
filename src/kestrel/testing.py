"""Test your own workflows against a real PostgreSQL: the ``kestrel.testing`` pytest plugin.

Installed with kestrel (entry point ``pytest11``), so a user's test needs no import to get
the fixtures:

* ``kestrel_dsn`` (session): the PostgreSQL to test against: ``--kestrel-dsn``, else
  ``KESTREL_TEST_DSN``, else an embedded server in a temporary folder when
  ``kestrel-runtime[embedded]`` is installed, else a one-line error saying how to give one
  (also for a DSN that does not answer: each test using it fails at setup with that line).
* ``kestrel_env`` (each test): a :class:`KestrelTestEnv` on a schema migrated once per test
  session (``kestrel_test_<random>``) and emptied before each test, with its clock back at
  the real time and no fault armed.

:meth:`KestrelTestEnv.run_to_completion` submits a workflow, runs a real worker (claims,
group commits, leases, the sweeper) in the test's process until the execution ends, and
returns a :class:`Run`: the result and the step timeline (:attr:`Run.user_timeline`: the
workflow's own steps, without the ones the context records itself, :data:`INTERNAL_STEPS`).
:meth:`KestrelTestEnv.run_until_waiting` runs one until it is parked on a signal and says
what it waits for and until when, so a test can move the clock past its timeout. Faults
are the runtime's own failpoints (:mod:`kestrel.failpoints`) armed for one step:
:meth:`KestrelTestEnv.fail_step` makes a step body raise, so its retry policy and the
workflow's error handling run;
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
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from kestrel import connections, db, failpoints, statements
from kestrel.config import mask_dsn
from kestrel.errors import ConfigError
from kestrel.sql import queries
from kestrel.testenv import (
    INTERNAL_STEPS,
    MAX_ADVANCE_S,
    ExecutionRef,
    KestrelTestEnv,
    Run,
    TimelineEntry,
    Waiting,
    is_internal,
)

if TYPE_CHECKING:
    from kestrel.replay import ReplayResult
    from kestrel.workflow import WorkflowFn

_DSN_HELP = ("give the tests a PostgreSQL with --kestrel-dsn=postgresql://… or "
             "KESTREL_TEST_DSN, or pip install 'kestrel-runtime[embedded]' for a private one")

__all__ = ["INTERNAL_STEPS", "MAX_ADVANCE_S", "ExecutionRef", "KestrelTestEnv", "Run",
           "TimelineEntry", "Waiting", "areplay", "dsn_for_tests", "is_internal", "replay"]


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


def _reachable(dsn: str, source: str) -> None:
    """Fail the test with one line unless *dsn* (given by *source*) accepts a connection."""
    __tracebackhide__ = True
    try:
        connections.connect(dsn, autocommit=False, connect_timeout=10).close()
        return
    except psycopg.Error as exc:
        # psycopg's first line says what failed ("connection refused", "password
        # authentication failed"); the hint lines after it are libpq's, for psql users.
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    # Outside the except: pytest would show the psycopg error as well, "during handling".
    pytest.fail(f"kestrel.testing cannot connect to the PostgreSQL that {source} names, "
                f"{mask_dsn(dsn)} ({why}): start it, or {_DSN_HELP}", pytrace=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--kestrel-dsn``: the PostgreSQL the ``kestrel_env`` fixture tests against."""
    parser.addoption("--kestrel-dsn", default=None, metavar="DSN",
                     help="PostgreSQL for kestrel.testing's fixtures (default: "
                          "KESTREL_TEST_DSN, else an embedded server if installed).")


@pytest.fixture(scope="session")
def kestrel_dsn(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The PostgreSQL of this test session (see :func:`dsn_for_tests`).

    Without one, or with one that does not answer, each test that needs it fails with one
    line saying which DSN was tried and how to give another, not a traceback."""
    option = request.config.getoption("--kestrel-dsn")
    given = option or os.environ.get("KESTREL_TEST_DSN")
    data = None if given else tmp_path_factory.mktemp("kestrel-pg") / "data"
    try:
        dsn, server = dsn_for_tests(option, data)
    except ConfigError as exc:
        refused = str(exc)
    else:
        refused = ""
    if refused:  # outside the except, so that pytest shows this one line and no chain
        pytest.fail(refused, pytrace=False)
    if server is None:
        _reachable(dsn, "--kestrel-dsn" if option else "KESTREL_TEST_DSN")
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
        conn = connections.connect(kestrel_dsn)
    except psycopg.OperationalError:
        return  # the server went first (its fixture ended before this one): nothing to drop
    with conn:
        db.run_sync(conn, statements.testing.drop_schema(queries(name)))


@pytest.fixture
def kestrel_env(kestrel_dsn: str, kestrel_schema: str) -> Iterator[KestrelTestEnv]:
    """A :class:`KestrelTestEnv`: the session's schema, emptied, the clock at the real time,
    no fault armed."""
    env = KestrelTestEnv(kestrel_dsn, kestrel_schema)
    env.reset()
    yield env
    failpoints.disarm()

