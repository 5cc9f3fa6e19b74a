"""The interleaving and poison machine (FAULTS.md, "Hypothesis stateful testing", 3).

Users call ``signal``, ``cancel``, ``submit`` and ``retry`` from their own transactions. This
machine holds such transactions open (real psycopg connections, autocommit off) and commits
or rolls them back at drawn moments between the statements of simulated workers, including
while a worker statement waits on a row lock the transaction holds: every statement runs as
an asyncio task on a connection of its own, and the machine *settles* after each rule (runs
the loop until every statement in flight has finished or waits on a lock in
``pg_stat_activity``). Ending a transaction then lets the blocked statement finish inside
the same rule, and its result is checked there.

Simulated workers drive the real ``kestrel.db`` statements: claim, checkpoint a step
through a real :class:`kestrel.writer.GroupCommit` (several executions share a batch), wait
for a signal (``consume_signal`` then ``park``) and complete (a second ``GroupCommit``).
Hostile values arrive next to good executions through every door: a checkpoint whose step
name holds a NUL or a lone surrogate in the same group commit as good ones (P1); arguments
``[1e400]`` and ``2**70`` through the SQL ``submit`` and the Python client (P2); a workflow
name no worker registers (P4); workflow, step and signal names with quotes, newlines and
``'); DROP TABLE x; --`` (I4); NUL and lone surrogates in names given to the Python client.

Every execution runs one workflow shape: step 0 outputs ``10 n``, step 1 waits for the
signal its workflow name selects, step 2 outputs ``10 n + 2``, and the result is
``20 n + 2 + payload``. Invariants after every rule: X1 (nothing waits for a signal that is
pending for it without a wake-up), X2 (cancelling a parked execution finishes it at once; a
cancelled execution never parks), I1 (one checkpoint per step, never changed), I5 (terminal
rows change only by a committed retry, epochs never go back), I6 (one execution per
idempotency key), every committed signal stored exactly once and consumed at most once, P4.
At the end: all client transactions end, everything is drained and every execution is
terminal with the model's result (or, P4, queued for a worker that does not exist).

Profiles: ``interleaving-ci`` (default, derandomized, about a minute and a half) and
``interleaving-soak`` (``KESTREL_HYPOTHESIS_PROFILE=soak``).

Showing that it finds the bugs it is for (done for the change that added it; repeat after
touching it). Revert one fix locally, never commit it, run
``.venv/bin/pytest -q tests/property/test_interleaving_machine.py``, expect a shrunk
falsifying example, then ``git checkout -- <file>``:

* X1 (worker parks with its signal pending): in ``sql/queries/steps.sql`` replace the body of
  ``consume_signal`` with the single-statement CTE of
  ``git show 861b348:sql/queries/steps.sql``. Expected: ``invariant_x1`` fails after a
  ``park`` that follows a ``consume_signal`` blocked on a transaction's ``signal()``.
* P1 (a poison item fails its whole batch): in ``src/kestrel/writer.py``, ``_send``, replace
  everything after the ``connections.is_transient`` branch of the ``except`` with
  ``for _, fut in live: fut.done() or fut.set_exception(exc)`` and ``return``. Expected:
  "P1: a good checkpoint ... failed" from ``advance_all``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from psycopg import sql as pgsql
from psycopg.pq import TransactionStatus

from kestrel import codec, connections, db, statements
from kestrel.client import Client
from kestrel.errors import (
    ExecutionNotFound,
    IdempotencyConflict,
    InvalidState,
    KestrelError,
    SerializationError,
    UndecodableInput,
    WriteRejected,
)
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite
from kestrel.workflow import describe_error
from kestrel.writer import GroupCommit

LEASE = 30.0
MAX_ATTEMPTS = 3
WAIT = 1  # the step position of the signal wait
MAX_LEASES = 6
BASELINE = 3  # good executions submitted before the first rule
SETTLED_BLOCKED_S = 0.1  # a statement waiting on a lock this long waits for a transaction

# Registered workflows and the signal name each one's wait takes (I4: hostile on purpose).
WORKFLOWS = {
    "sigfold": "go",
    "it's \"quoted\"": "it's \"go\"",
    "'); DROP TABLE x; --": "'); DROP TABLE signals; --",
    "two\nlines\r\n\t": "go\nnow",
    "ünï©ødé ✓": "ключ",
}
UNREGISTERED = "sigfold-typo"  # P4: no worker knows it
OTHER_SIGNAL = "not $$ waited; --"  # a name no wait takes: stays pending, harmlessly

# Bugs this machine found that are reported but not fixed yet. While a bug is listed here its
# symptom is tolerated (and warned about once per run); delete the entry with the fix and the
# machine enforces the behaviour FAULTS.md asks for.
KNOWN_BUGS: dict[str, str] = {}
# Found by this machine and fixed since: P2-bigint (an integer beyond 64 bits decoded as a
# float at claim), P-client-names (the client sent NUL / lone surrogates in names to
# psycopg), X-reinserted-row (signal() or cancel() that waited on the row of a transaction
# that cancelled and retried the execution read in the old snapshot and lost the cancel).
SEEN_KNOWN: set[str] = set()


def _call(conn: Any, query: str, params: dict[str, Any]) -> Awaitable[Any]:
    """One call of a kestrel SQL function on *conn*, its errors mapped to typed ones."""
    return db.run(conn, statements.value(query, params))


def known(bug: str, detail: str) -> None:
    """A symptom of a reported bug: an error, unless KNOWN_BUGS still lists it."""
    assert bug in KNOWN_BUGS, f"{bug}: {detail}"
    if bug not in SEEN_KNOWN:
        SEEN_KNOWN.add(bug)
        warnings.warn(f"known bug {bug} ({KNOWN_BUGS[bug]}): {detail}", stacklevel=2)


# Hostile values through every door: a poison step name (P1), arguments the runtime cannot
# decode (P2, through SQL), a workflow no worker knows (P4), and names and arguments the
# Python client must refuse before anything is written.
HOSTILE = ["nul", "surrogate", "1e400", "2**70", "unregistered", "nul name", "surrogate name",
           "nul signal", "surrogate signal", "inf arg", "huge arg"]

AUTO = 2  # the client slot that commits every call at once (the Python client's own connection)

settings.register_profile(
    "interleaving-ci", max_examples=40, stateful_step_count=50, deadline=None,
    derandomize=True, suppress_health_check=list(HealthCheck))
settings.register_profile(
    "interleaving-soak", max_examples=400, stateful_step_count=60, deadline=None,
    suppress_health_check=list(HealthCheck))


def step_output(n: int, k: int) -> int:
    return 10 * n + k


def model_result(n: int, payload: int) -> int:
    return step_output(n, 0) + payload + step_output(n, 2)


@dataclass(eq=False)
class Ex:
    """What the model knows of one submitted execution."""

    id: uuid.UUID
    workflow: str
    n: int
    kind: str  # good | nul | surrogate (poison step name) | undecodable | unregistered
    key: str | None = None
    parent: uuid.UUID | None = None
    poison_step: int = 0  # the step whose name is poison (nul, surrogate)

    @property
    def wait_name(self) -> str:
        return WORKFLOWS.get(self.workflow, "go")

    def step_name(self, k: int) -> str:
        name = f"{k}:{self.workflow}"
        if k == self.poison_step and self.kind == "nul":
            return name + "\x00"
        if k == self.poison_step and self.kind == "surrogate":
            return name + "\ud800"
        return name


@dataclass(eq=False)
class Conn:
    """A connection with at most one statement in flight, known to the settler by name."""

    name: str
    conn: psycopg.AsyncConnection[Any]
    inflight: int = 0

    async def run(self, fn: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]]) -> Any:
        self.inflight += 1
        try:
            return await fn(self.conn)
        finally:
            self.inflight -= 1


@dataclass(eq=False)
class Tx:
    """A client slot: a transaction held open across rules (0, 1) or autocommit (AUTO)."""

    slot: int
    conn: Conn
    task: asyncio.Task[None] | None = None
    effects: list[Callable[[], None]] = field(default_factory=list)
    keys: dict[str, tuple[uuid.UUID, tuple[str, int]]] = field(default_factory=dict)
    sig_keys: set[tuple[uuid.UUID, str]] = field(default_factory=set)
    aborted: bool = False
    used: bool = False

    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(eq=False)
class Lease:
    """A simulated worker's hold on one claimed execution."""

    ex: Ex
    epoch: int
    attempt: int
    recorded: dict[int, Any]
    pos: int
    owner: str = ""  # the simulated process's lease it runs under (migration 0026)
    cancel: bool = False
    broken: Exception | None = None
    seq: int | None = None  # at the wait: None = look for a signal, else park with it
    task: asyncio.Task[None] | None = None
    gone: bool = False
    expired: bool = False  # time passed its lease while held (it may be swept)

    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


class InterleavingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.conns: list[Conn] = []
        self.lapses = 0  # how many times every lease ran out (each process renamed since)
        self.tasks: list[asyncio.Task[Any]] = []
        self.services: list[asyncio.Task[Any]] = []

    # -- set-up and tear-down ---------------------------------------------------------------

    @initialize()
    def setup(self) -> None:
        self.dsn, self.schema = DB["dsn"], DB["schema"]
        self.tag = f"im-{self.schema[-8:]}"
        self.q = queries(self.schema)
        self.admin = self.run(self.connect("admin", autocommit=True, track=False))
        self.observer = self.run(self.connect("observer", autocommit=True, track=False))
        self.sql("TRUNCATE {s}.workflow_executions, {s}.workflow_history,"
                 " {s}.operation_outputs, {s}.idempotency_keys,"
                 " {s}.signals, {s}.events, {s}.signal_history, {s}.event_history")
        self.sql("UPDATE {s}.clock_offset SET offset_by = '0'")
        self.workers = [self.run(self.connect(f"w{i}")) for i in range(3)]
        self.sweeper = self.run(self.connect("sweeper"))
        self.ckpt_conn = self.run(self.connect("ckpt"))
        self.done_conn = self.run(self.connect("complete"))
        self.txs = [Tx(0, self.run(self.connect("tx0", autocommit=False))),
                    Tx(1, self.run(self.connect("tx1", autocommit=False))),
                    Tx(AUTO, self.run(self.connect("sql", autocommit=True)))]
        # The Python client's own connections carry a name of their own for the settler.
        self.pyclient = Client(
            psycopg.conninfo.make_conninfo(self.dsn, application_name=f"{self.tag}-client"),
            schema=self.schema, pool_size=0)
        self.client_calls = 0
        self.ckpt: GroupCommit[StepWrite, Any] = GroupCommit(
            "checkpoint", self.flush_checkpoints, retry_delay=0.001)
        self.completions: GroupCommit[Finish, bool] = GroupCommit(
            "completion", self.flush_completions, retry_delay=0.001)
        self.services = [self.loop.create_task(self.ckpt.run()),
                         self.loop.create_task(self.completions.run())]
        # The model.
        self.execs: dict[uuid.UUID, Ex] = {}
        self.order: list[uuid.UUID] = []  # committed executions, oldest first
        # Committed idempotency keys: the execution, and what it was submitted with.
        self.keys: dict[str, tuple[uuid.UUID, tuple[str, int]]] = {}
        self.inflight_keys: dict[str, list[tuple[str, int]]] = {}  # AUTO submits in flight
        self.signals: dict[uuid.UUID, dict[int, tuple[str, str | None]]] = {}
        self.sig_keys: set[tuple[uuid.UUID, str]] = set()
        self.maybe: dict[int, tuple[uuid.UUID, str]] = {}  # payloads committing right now
        self.payloads = 0
        self.cancels: set[uuid.UUID] = set()  # a cancel committed (ever, of it or a parent)
        self.cancelled_now: dict[uuid.UUID, int] = {}  # cancel() said 'cancelled' (retries)
        self.cancelling_now: dict[uuid.UUID, int] = {}  # cancel() said 'cancelling' (retries)
        self.retries: dict[uuid.UUID, int] = {}
        self.first: dict[tuple[uuid.UUID, int], Any] = {}
        self.max_epoch: dict[uuid.UUID, int] = {}
        self.terminal: dict[uuid.UUID, tuple[Any, ...]] = {}  # history rows seen, and retries
        self.ever_terminal: set[uuid.UUID] = set()
        self.leases: list[Lease] = []
        self.cancel_attempts: list[tuple[uuid.UUID, int]] = []  # X2: (id, attempts) to check
        self.ready = True
        # Good executions for the hostile ones to sit next to, from the start.
        for n in range(BASELINE):
            ex = Ex(uuid.UUID(int=0), "sigfold", 100 + n, "good")
            self.submit_ex(AUTO, ex, "python", orjson.dumps([ex.n]).decode())

    def teardown(self) -> None:
        try:
            # Teardown runs in a finally block: after a failed step, report that failure
            # alone (draining would add a second one and muddle the shrinking).
            if getattr(self, "ready", False) and sys.exc_info()[0] is None:
                self.drain_and_check()
        finally:
            for task in self.services + self.tasks:
                task.cancel()
            pending = [t for t in self.services + self.tasks if not t.done()]
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=5))
            for c in self.conns:
                self.loop.run_until_complete(c.conn.close())
            for c in (getattr(self, "admin", None), getattr(self, "observer", None)):
                if c is not None:
                    self.loop.run_until_complete(c.conn.close())
            self.loop.close()

    async def connect(self, name: str, *, autocommit: bool = True, track: bool = True) -> Conn:
        conn = await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=autocommit, prepare_threshold=None,
            application_name=f"{self.tag}-{name}")
        connections.configure_connection(conn)
        try:
            # Deadlocks between a user's transaction and a worker are legal; find them fast.
            await conn.execute("SET deadlock_timeout = '20ms'")
        except psycopg.Error:
            pass  # not a superuser: the default second
        if not autocommit:
            await conn.commit()
        c = Conn(name, conn)
        if track:
            self.conns.append(c)
        return c

    # -- helpers ----------------------------------------------------------------------------

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def sql(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        return self.run(self.asql(text, params))  # type: ignore[no-any-return]

    async def asql(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        stmt = pgsql.SQL(text).format(s=pgsql.Identifier(self.schema))  # type: ignore[arg-type]
        cur = await self.admin.conn.execute(stmt, params)
        return await cur.fetchall() if cur.description else []

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)  # type: ignore[arg-type]
        self.tasks.append(task)
        return task

    def reap(self) -> None:
        """Re-raise what a finished statement task raised (a failed check inside it)."""
        done = [t for t in self.tasks if t.done()]
        self.tasks = [t for t in self.tasks if not t.done()]
        for t in done:
            t.result()

    async def settle(self, limit: float = 30.0) -> None:
        """Run the loop until every statement in flight has finished, or has waited on a lock
        for longer than PostgreSQL takes to break a deadlock (deadlock_timeout is 20 ms on
        these connections): what is still blocked then stays blocked until a later rule ends
        the transaction it waits for. Returning sooner would let a deadlock's victim fail
        during a later rule, and the same example would not replay the same way."""
        deadline = time.monotonic() + limit
        blocked_since: float | None = None
        while True:
            await asyncio.sleep(0.002)
            self.reap()
            busy = {f"{self.tag}-{c.name}" for c in self.conns if c.inflight}
            if self.client_calls:
                busy.add(f"{self.tag}-client")
            if not busy and not self.tasks:
                return
            blocked = False
            if busy:
                cur = await self.observer.conn.execute(
                    "SELECT application_name, state, wait_event_type FROM pg_stat_activity "
                    "WHERE application_name = ANY(%s)", [list(busy)])
                rows = await cur.fetchall()
                blocked = (len(rows) == len(busy)
                           and all(r[1] == "active" and r[2] == "Lock" for r in rows))
            now = time.monotonic()
            if not blocked:
                blocked_since = None
            elif blocked_since is None:
                blocked_since = now
            elif now - blocked_since >= SETTLED_BLOCKED_S:
                return
            if now > deadline:
                raise AssertionError(f"statements made no progress for {limit}s: {busy}")

    def settled(self) -> None:
        self.run(self.settle())

    def pick(self, e: int) -> Ex | None:
        """A committed execution, recent ones first."""
        if not self.order:
            return None
        return self.execs[self.order[-1 - e % len(self.order)]]

    def live_leases(self) -> list[Lease]:
        self.leases = [L for L in self.leases if not L.gone]
        return self.leases

    def free_worker(self) -> Conn | None:
        return next((c for c in self.workers if not c.inflight), None)

    def possible(self, eid: uuid.UUID, name: str, payload: int) -> bool:
        got = self.signals.get(eid, {}).get(payload)
        return (got is not None and got[0] == name) or self.maybe.get(payload) == (eid, name)

    def ancestors_cancelled(self, ex: Ex) -> bool:
        seen: set[uuid.UUID] = set()
        cur: Ex | None = ex
        while cur is not None and cur.id not in seen:
            if cur.id in self.cancels:
                return True
            seen.add(cur.id)
            cur = self.execs.get(cur.parent) if cur.parent else None
        return False

    # -- group commit flushes (kestrel.worker's, minus metrics) -----------------------------

    async def flush_checkpoints(self, writes: list[StepWrite]) -> list[Any]:
        return await self.ckpt_conn.run(
            lambda c: db.run(c, statements.steps.save_steps(self.q, writes))
        )  # type: ignore[no-any-return]

    async def flush_completions(self, finishes: list[Finish]) -> list[bool]:
        done = await self.done_conn.run(
            lambda c: db.run(c, statements.executions.complete_batch(self.q, finishes))
        )
        return [f.execution_id in done for f in finishes]

    # -- the simulated worker ---------------------------------------------------------------

    async def claim(self, conn: Conn, owner: str, limit: int) -> None:
        got = await conn.run(lambda c: db.run(c, statements.executions.claim_batch(
            self.q, owner=owner, queues=["default"], limit=limit, lease_s=LEASE,
            workflows=list(WORKFLOWS))))
        for c in got:
            assert c.id in self.execs, f"claimed {c.id}, which was never submitted"
            ex = self.execs[c.id]
            assert ex.workflow in WORKFLOWS, f"P4: {ex.workflow!r} was claimed"
            assert c.epoch > self.max_epoch.get(c.id, 0), "I2: an epoch went back"
            self.max_epoch[c.id] = c.epoch
            recorded = {k: s.output for k, s in c.steps.items()}
            for k, out in recorded.items():
                if (c.id, k) in self.first:
                    assert out == self.first[(c.id, k)], "I1: a replay read another value"
            pos = next((k for k in range(3) if k not in recorded), 3)
            broken = c.broken
            if ex.kind == "undecodable" and broken is None:
                # P2: the arguments cannot be decoded unchanged; the claim must say so.
                known("P2-bigint", f"claimed with args {c.args}")
                broken = UndecodableInput("(known bug P2-bigint: failed by the test)")
            self.leases.append(Lease(ex, c.epoch, c.attempt, recorded, pos, owner=owner,
                                     cancel=c.cancel_requested, broken=broken))

    async def advance(self, L: Lease, conn: Conn | None) -> None:
        """The lease's next protocol action."""
        if L.broken is not None:
            assert L.ex.kind == "undecodable", f"claim of {L.ex.kind} broken: {L.broken}"
            assert isinstance(L.broken, UndecodableInput)
            await self.finish(L, Status.FAILED, error=L.broken)
        elif L.cancel:
            await self.finish(L, Status.CANCELLED)
        elif L.pos in (0, 2):
            await self.save(L)
        elif L.pos == WAIT:
            assert conn is not None
            await (self.look(L, conn) if L.seq is None else self.park(L, conn))
        else:
            await self.finish(L, Status.COMPLETED)

    async def save(self, L: Lease) -> None:
        k, ex = L.pos, L.ex
        write = StepWrite(ex.id, L.epoch, k, ex.step_name(k), str(step_output(ex.n, k)), None,
                          1, 0.0)
        try:
            saved = await self.ckpt.submit(write)
        except Exception as exc:
            if not connections.is_data_error(exc):
                L.gone = True  # refused for the database's own reasons: the attempt ends
                return
            # P1: the database refused a value; it must be this item's own.
            assert k == ex.poison_step and ex.kind in ("nul", "surrogate"), (
                f"P1: a good checkpoint ({ex.kind} execution, step {k}) failed in a group "
                f"commit: {type(exc).__name__}: {exc}")
            await self.finish(L, Status.FAILED, error=WriteRejected(
                f"the database refused the checkpoint of step {write.name!r}: "
                f"{type(exc).__name__}: {exc}"))
            return
        assert ex.kind not in ("nul", "surrogate") or k != ex.poison_step, "poison stored"
        if saved.cancelled:
            await self.finish(L, Status.CANCELLED)
            return
        if not saved.owned:
            L.gone = True
            return
        # Written by this try: it comes back without its value, which is what jsonb
        # stores of what was written; otherwise the row recorded first comes back.
        if saved.inserted:
            output = codec.stored(write.output or "null")
        else:
            assert saved.recorded is not None
            output = saved.recorded.output
        self.learn(ex.id, k, output)
        L.recorded[k] = output
        L.pos += 1

    def learn(self, eid: uuid.UUID, k: int, output: Any) -> None:
        if (eid, k) in self.first:
            assert output == self.first[(eid, k)], f"I1: checkpoint {k} of {eid} changed"
        else:
            self.first[(eid, k)] = output

    async def look(self, L: Lease, conn: Conn) -> None:
        name = L.ex.wait_name
        taken = await conn.run(lambda c: db.run(c, statements.steps.consume_signal(
            self.q, id=L.ex.id, epoch=L.epoch, step_id=WAIT, name=name,
            step_name="kestrel.signal:" + name)))
        if not taken.owned:
            L.gone = True
        elif taken.cancelled:
            await self.finish(L, Status.CANCELLED)
        elif taken.output is not None:
            payload = taken.output["payload"]
            assert taken.output["received"] is True
            assert self.possible(L.ex.id, name, payload), (
                f"consumed signal payload {payload} that was never committed")
            self.learn(L.ex.id, WAIT, taken.output)
            L.recorded[WAIT] = taken.output
            L.pos += 1
        else:
            L.seq = taken.signal_seq

    async def park(self, L: Lease, conn: Conn) -> None:
        outcome = await conn.run(lambda c: db.run(c, statements.executions.park(
            self.q, id=L.ex.id, epoch=L.epoch, step_id=WAIT, waiting_for=L.ex.wait_name,
            seconds=None, seen_seq=L.seq)))
        if outcome == "signalled":
            L.seq = None
        elif outcome == "cancelled":
            # X2: a cancel that raced the park finishes the execution now, as cancelled,
            # under this claim (never a lost lease, attempts unchanged).
            done = await self.finish(L, Status.CANCELLED)
            assert done or L.expired, "X2: a cancelled park could not finish the execution"
            if done:
                self.cancel_attempts.append((L.ex.id, L.attempt))
        else:
            assert outcome in ("parked", "lost"), outcome
            L.gone = True

    async def finish(self, L: Lease, status: Status, error: BaseException | None = None
                     ) -> bool:
        ex, result = L.ex, None
        if status is Status.COMPLETED:
            payload = L.recorded[WAIT]["payload"]
            result = L.recorded[0] + payload + L.recorded[2]
            assert result == model_result(ex.n, payload)
        encoded_error = None
        if error is not None:
            encoded_error = codec.encode(describe_error(error), what="error")
        elif status is Status.CANCELLED:
            encoded_error = codec.encode({"type": "Cancelled", "message": "cancelled by request"},
                                         what="error")
        L.gone = True
        try:
            done = await self.completions.submit(Finish(
                ex.id, L.epoch, status, None if result is None else str(result), encoded_error))
        except Exception as exc:
            assert not connections.is_data_error(exc), f"a completion was refused: {exc!r}"
            return False  # refused for the database's own reasons (a deadlock): retried later
        return bool(done)

    # -- rules: client transactions ---------------------------------------------------------

    def client_call(self, t: int, stmt: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]],
                    done: Callable[[Tx, Any], None],
                    failed: Callable[[Tx, BaseException], None] | None = None,
                    python: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Run one client call in slot *t* as a task: in the open transaction (0, 1), or
        committed at once (AUTO: through the Python client's own connection when *python*
        is given, else a SQL function on an autocommit connection). *done* sees the result
        when the call returns; in a transaction it adds effects that apply at commit."""
        tx = self.txs[t]
        if tx.busy() or tx.aborted:
            return
        tx.used = True

        async def go() -> None:
            try:
                if python is not None:
                    self.client_calls += 1
                    try:
                        value = await python()
                    finally:
                        self.client_calls -= 1
                else:
                    value = await tx.conn.run(stmt)
            except (psycopg.Error, KestrelError, UnicodeError) as exc:
                if t != AUTO and (tx.conn.conn.info.transaction_status
                                  == TransactionStatus.INERROR):
                    tx.aborted = True  # nothing it did will commit
                if failed is None:
                    raise
                failed(tx, exc)
                return
            done(tx, value)

        tx.task = self.spawn(go())
        self.settled()

    def effect(self, tx: Tx, fn: Callable[[], None]) -> None:
        if tx.slot == AUTO:
            fn()
        else:
            tx.effects.append(fn)

    def submitted(self, tx: Tx, ex: Ex, eid: uuid.UUID) -> None:
        """A submit returned *eid*: a new execution, or the one its key names (I6)."""
        key = ex.key
        if key is not None:
            prior = tx.keys.get(key) or self.keys.get(key)
            if prior is not None:
                assert (eid, (ex.workflow, ex.n)) == prior, (
                    f"I6: key {key!r} gave {eid}, not {prior}")
                return
            tx.keys[key] = (eid, (ex.workflow, ex.n))
            # An AUTO submit of this key may have committed and returned this id without
            # the model knowing yet (its reply is processed later): allowed once, below.
            racing = (ex.workflow, ex.n) in self.inflight_keys.get(key, [])
        else:
            racing = False
        assert racing or eid not in self.execs, f"submit returned the existing {eid}"
        ex.id = eid

        def commit() -> None:
            if eid in self.execs:  # the racing AUTO submit got there first
                assert racing and (self.execs[eid].workflow, self.execs[eid].n) == (
                    ex.workflow, ex.n)
            else:
                self.execs[eid] = ex
                self.order.append(eid)
            if key is not None:
                self.keys[key] = (eid, (ex.workflow, ex.n))

        self.effect(tx, commit)

    def conflict_ok(self, ex: Ex) -> Callable[[Tx, BaseException], None]:
        def failed(tx: Tx, exc: BaseException) -> None:
            if isinstance(exc, IdempotencyConflict):
                assert ex.key is not None
                prior = tx.keys.get(ex.key) or self.keys.get(ex.key)
                racing = self.inflight_keys.get(ex.key, [])
                assert (prior is not None and prior[1] != (ex.workflow, ex.n)) or any(
                    sig != (ex.workflow, ex.n) for sig in racing), f"I6: a false conflict: {exc}"
                return
            if isinstance(exc, psycopg.errors.DeadlockDetected):
                return  # this transaction was the deadlock's victim
            if ex.kind == "undecodable" and isinstance(exc, SerializationError):
                return  # P2: the SQL door refuses it; nothing is written
            if ex.parent is not None and isinstance(exc, InvalidState):
                # X7: a parent that finished, or is being cancelled (ParentCancelled), starts
                # no child; nothing is written.
                return
            raise exc
        return failed

    @rule(t=st.sampled_from([0, 1, AUTO]), n=st.integers(0, 9),
          key=st.sampled_from([None, None, "k0", "k1"]),
          workflow=st.sampled_from(["sigfold", "sigfold", *WORKFLOWS]),
          parent=st.none() | st.integers(0, 3), door=st.sampled_from(["python", "sql"]),
          what=st.sampled_from(["good"] * 20 + HOSTILE))
    def submit(self, t: int, n: int, key: str | None, workflow: str, parent: int | None,
               door: str, what: str) -> None:
        """A good execution (with an idempotency key, a parent, through either door), or
        one hostile value next to the good ones (*what*, see submit_hostile)."""
        if what != "good":
            self.submit_hostile(t, what, n, parent or 0)
            return
        p = self.pick(parent) if parent is not None else None
        ex = Ex(uuid.UUID(int=0), workflow, n, "good", key, p.id if p else None)
        self.submit_ex(t, ex, door, orjson.dumps([n]).decode())

    def submit_ex(self, t: int, ex: Ex, door: str, args: str) -> None:
        """Submit *ex* through the Python client (``conn=`` in a transaction, its own
        connection in AUTO) or the SQL function (which also takes a parent)."""
        python = None
        if door == "python" and ex.parent is None:
            async def stmt(c: psycopg.AsyncConnection[Any]) -> Any:
                return (await self.pyclient.submit(ex.workflow, *orjson.loads(args),
                                                 idempotency_key=ex.key, conn=c)).id

            if t == AUTO:
                async def python() -> Any:
                    return (await self.pyclient.submit(ex.workflow, *orjson.loads(args),
                                                     idempotency_key=ex.key)).id
        else:
            params = statements.client.submit_params(
                workflow=ex.workflow,
                args=args,
                queue="default",
                priority=0,
                idempotency_key=ex.key,
                parent=ex.parent,
            )

            async def stmt(c: psycopg.AsyncConnection[Any]) -> Any:
                return await db.run(c, statements.value(self.q.submit, params, key=ex.key))

        # Until its reply is processed, an AUTO submit may or may not have committed.
        sig, racing = (ex.workflow, ex.n), self.inflight_keys.setdefault(ex.key or "", [])
        if t == AUTO:
            racing.append(sig)

        def done(tx: Tx, eid: Any) -> None:
            if t == AUTO:
                racing.remove(sig)
            self.submitted(tx, ex, eid)

        def failed(tx: Tx, exc: BaseException) -> None:
            if t == AUTO:
                racing.remove(sig)
            self.conflict_ok(ex)(tx, exc)

        self.client_call(t, stmt, done, failed, python)

    def submit_hostile(self, t: int, what: str, n: int, e: int) -> None:
        """A hostile value next to the good ones, through the SQL functions or the client."""
        if what in ("nul", "surrogate", "unregistered"):
            # Stored; the poison ones fail at their first checkpoint (P1), the unregistered
            # one waits for a worker that knows it (P4).
            workflow = UNREGISTERED if what == "unregistered" else "sigfold"
            ex = Ex(uuid.UUID(int=0), workflow, n, what)
            self.submit_ex(t, ex, "sql" if t == AUTO else "python", orjson.dumps([n]).decode())
            return
        if what in ("1e400", "2**70"):  # P2 through SQL: stored, fails at its claim
            ex = Ex(uuid.UUID(int=0), "sigfold", n, "undecodable")
            self.submit_ex(t, ex, "sql", "[1e400]" if what == "1e400" else f"[{2**70}]")
            return
        # Refused before anything is written; in a transaction, the transaction lives on.
        bad = "\x00" if what.startswith("nul") else "\ud800"
        target = self.pick(e)
        arg: Any = {"inf arg": float("inf"), "huge arg": 2**70}.get(what, n)
        if what.endswith("signal"):
            if target is None:
                return
            name = "go" + bad

            async def stmt(c: psycopg.AsyncConnection[Any]) -> Any:
                return await _call(c, self.q.signal, {"id": target.id, "name": name,
                                                        "payload": "1",
                                                        "idempotency_key": None})

            async def python() -> Any:
                return await self.pyclient.signal(target.id, name, 1)
        else:
            name = "sig" + bad + "fold" if what.endswith("name") else "sigfold"

            async def stmt(c: psycopg.AsyncConnection[Any]) -> Any:
                return await self.pyclient.submit(name, arg, conn=c)

            async def python() -> Any:
                return await self.pyclient.submit(name, arg)

        def done(tx: Tx, value: Any) -> None:
            raise AssertionError(f"P: {what} was accepted: {value}")

        def failed(tx: Tx, exc: BaseException) -> None:
            assert not tx.aborted, f"{what} aborted the caller's transaction: {exc!r}"
            if isinstance(exc, SerializationError):
                return  # the client's typed refusal
            assert isinstance(exc, psycopg.DataError | UnicodeError), repr(exc)
            if what.endswith("signal") and t != AUTO:
                return  # the SQL function's door: psycopg refuses the value itself
            known("P-client-names", f"{what}: {type(exc).__name__}: {exc}")

        self.client_call(t, stmt, done, failed, python if t == AUTO else None)

    # No precondition: `order` grows when a transaction commits, which a race may do or not
    # depending on lock timing (see end_tx).
    @rule(t=st.sampled_from([0, 1, AUTO]),
          call=st.sampled_from(["signal", "signal", "cancel", "retry", "signal other"]),
          e=st.integers(0, 5), key=st.sampled_from([None, None, "s1"]))
    def client(self, t: int, call: str, e: int, key: str | None) -> None:
        """signal (the waited name, or one no wait takes), cancel or retry an execution,
        in an open transaction (0, 1) or through the Python client (AUTO)."""
        ex = self.pick(e)
        if ex is None:
            return
        if call == "cancel":
            self.send_cancel(t, ex)
        elif call == "retry":
            self.send_retry(t, ex)
        else:
            self.send_signal(t, ex, OTHER_SIGNAL if call == "signal other" else ex.wait_name,
                             key)

    def send_signal(self, t: int, ex: Ex, name: str, key: str | None) -> None:
        self.payloads += 1
        payload = self.payloads
        params = {"id": ex.id, "name": name, "payload": str(payload), "idempotency_key": key}
        if t == AUTO:
            self.maybe[payload] = (ex.id, name)

        def stored(tx: Tx) -> None:
            self.signals.setdefault(ex.id, {})[payload] = (name, key)
            if key is not None:
                self.sig_keys.add((ex.id, key))

        def done(tx: Tx, value: Any) -> None:
            self.maybe.pop(payload, None)
            dup = key is not None and ((ex.id, key) in self.sig_keys
                                       or (ex.id, key) in tx.sig_keys)
            assert bool(value) is not dup, f"signal key {key!r} on {ex.id}: {value}, dup={dup}"
            if value:
                if key is not None:
                    tx.sig_keys.add((ex.id, key))
                self.effect(tx, lambda: stored(tx))

        def failed(tx: Tx, exc: BaseException) -> None:
            self.maybe.pop(payload, None)
            if isinstance(exc, InvalidState | psycopg.errors.DeadlockDetected):
                return  # it had finished; or this transaction was a deadlock's victim
            if isinstance(exc, ExecutionNotFound):
                # It was committed before this call started, and nothing deletes for good.
                known("X-reinserted-row", f"signal({ex.id}): {exc}")
                return
            raise exc

        python = None
        if t == AUTO:
            async def python() -> Any:
                return await self.pyclient.signal(ex.id, name, payload, idempotency_key=key)

        self.client_call(t, lambda c: _call(c, self.q.signal, params), done, failed, python)

    def send_cancel(self, t: int, ex: Ex) -> None:
        def done(tx: Tx, value: Any) -> None:
            assert value in ("cancelled", "cancelling", "completed", "failed", "quarantined")
            retries = self.retries.get(ex.id, 0)  # what the answer is about

            def commit() -> None:
                if value in ("cancelled", "cancelling"):
                    self.cancels.add(ex.id)
                if value == "cancelled":
                    self.cancelled_now[ex.id] = retries
                if value == "cancelling":
                    self.cancelling_now[ex.id] = retries
            self.effect(tx, commit)

        def failed(tx: Tx, exc: BaseException) -> None:
            if not isinstance(exc, psycopg.errors.DeadlockDetected):
                raise exc

        python = None
        if t == AUTO:
            async def python() -> Any:
                return await self.pyclient.cancel(ex.id)

        self.client_call(t, lambda c: _call(c, self.q.cancel, {"id": ex.id}), done, failed,
                         python)

    def send_retry(self, t: int, ex: Ex) -> None:
        def done(tx: Tx, value: Any) -> None:
            def commit() -> None:
                self.retries[ex.id] = self.retries.get(ex.id, 0) + 1
                self.cancelled_now.pop(ex.id, None)
                self.cancelling_now.pop(ex.id, None)
            self.effect(tx, commit)

        def failed(tx: Tx, exc: BaseException) -> None:
            if not isinstance(exc, InvalidState | psycopg.errors.DeadlockDetected):
                raise exc  # InvalidState: it is live or completed

        python = None
        if t == AUTO:
            async def python() -> Any:
                return await self.pyclient.retry(ex.id)

        self.client_call(t, lambda c: _call(c, self.q.retry,
                                            {"id": ex.id, "idempotency_key": None}),
                         done, failed,
                         python)

    # No precondition on what the database's timing decides (a statement still blocked,
    # a claim still out): Hypothesis replays a prefix of rules and demands the same
    # rules be enabled again (FlakyStrategyDefinition otherwise). The body does nothing
    # when there is nothing to do.
    @rule(t=st.integers(0, 1), commit=st.booleans())
    def end_tx(self, t: int, commit: bool) -> None:
        tx = self.txs[t]
        if not tx.used or tx.busy():
            return
        self.run(self.end(tx, commit))
        self.settled()

    async def end(self, tx: Tx, commit: bool) -> None:
        if commit and not tx.aborted:
            # Applied before COMMIT is sent: a statement it unblocks may return first.
            for fn in tx.effects:
                fn()
            await tx.conn.conn.commit()
        else:
            await tx.conn.conn.rollback()
        tx.effects, tx.keys, tx.sig_keys = [], {}, set()
        tx.aborted = tx.used = False

    # -- rules: workers ---------------------------------------------------------------------

    @rule(limit=st.integers(1, 3))
    def claim_some(self, limit: int) -> None:
        conn = self.free_worker()
        if conn is None or len(self.live_leases()) >= MAX_LEASES:
            return
        # Each time the leases ran out, every simulated process goes on under a new name,
        # as kestrel.lease.Heartbeat does: a lease that ran out is never extended again.
        self.spawn(self.claim(conn, f"{conn.name}~{self.lapses}", limit))
        self.settled()

    def launch(self, L: Lease) -> bool:
        if L.busy() or L.gone:
            return False
        conn = None
        if L.pos == WAIT and L.broken is None and not L.cancel:
            conn = self.free_worker()
            if conn is None:
                return False
            conn.inflight += 1  # reserved until the task starts its statement
            reserved = conn

            async def act() -> None:
                reserved.inflight -= 1
                await self.advance(L, reserved)
            L.task = self.spawn(act())
            return True
        L.task = self.spawn(self.advance(L, conn))
        return True

    # No precondition on what the database's timing decides (a statement still blocked,
    # a claim still out): Hypothesis replays a prefix of rules and demands the same
    # rules be enabled again (FlakyStrategyDefinition otherwise). The body does nothing
    # when there is nothing to do.
    @rule(i=st.integers(0, MAX_LEASES - 1))
    def advance_one(self, i: int) -> None:
        idle = [L for L in self.live_leases() if not L.busy()]
        if idle:
            self.launch(idle[i % len(idle)])
            self.settled()

    @rule(poison=st.sampled_from([None, None, "nul", "surrogate"]))
    def advance_all(self, poison: str | None) -> None:
        """Every idle lease acts at once: their checkpoints share one group commit. A worker
        with little to do claims first. With *poison*, the first good execution about to
        checkpoint names its step with a NUL or a lone surrogate (a name made from user
        input): P1, only that execution fails, every other checkpoint in the batch is
        recorded."""
        if len(self.live_leases()) < 3:
            self.claim_some(2)
        idle = [L for L in self.live_leases() if not L.busy()]
        if poison is not None:
            target = next((L for L in idle if L.pos in (0, 2) and not L.expired
                           and not L.cancel and L.broken is None and L.ex.kind == "good"
                           and (L.ex.id, L.pos) not in self.first), None)
            if target is not None:
                target.ex.kind, target.ex.poison_step = poison, target.pos
        for L in idle:
            self.launch(L)
        self.settled()

    # No precondition on what the database's timing decides (a statement still blocked,
    # a claim still out): Hypothesis replays a prefix of rules and demands the same
    # rules be enabled again (FlakyStrategyDefinition otherwise). The body does nothing
    # when there is nothing to do.
    @rule(i=st.integers(0, MAX_LEASES - 1), t=st.integers(0, 1),
          call=st.sampled_from(["signal", "signal", "cancel"]), commit=st.booleans())
    def race(self, i: int, t: int, call: str, commit: bool) -> None:
        """A client transaction signals (or cancels) an execution, the worker's next
        statement on it waits for the row lock, then the transaction commits or rolls back
        and the worker's statement finishes. A lease still before its wait first takes its
        checkpoint, so the statement that waits is consume_signal (X1) or park (X2)."""
        # Executions at their wait first, about to look for a signal first.
        idle = sorted((L for L in self.live_leases() if not L.busy()),
                      key=lambda L: (L.pos != WAIT, L.seq is not None))
        tx = self.txs[t]
        if not idle or tx.busy() or tx.aborted:
            return
        L = idle[i % len(idle)]
        if L.pos < WAIT:
            self.launch(L)
            self.settled()
            if L.busy() or L.gone:
                return
        if call == "cancel":
            self.send_cancel(t, L.ex)
        else:
            self.send_signal(t, L.ex, L.ex.wait_name, None)
        self.launch(L)
        self.settled()
        if not tx.busy():
            self.run(self.end(tx, commit))
            self.settled()

    @rule(kind=st.sampled_from(["lease_expires", "heartbeat", "crash"]),
          i=st.integers(0, MAX_LEASES - 1))
    def fault(self, kind: str, i: int) -> None:
        """lease_expires: the database clock passes every lease and the sweeper runs (the
        holders become zombies, fenced from now on). heartbeat: extend every idle lease
        (and learn of cancels). crash: the worker holding lease *i* dies."""
        if kind == "lease_expires":
            self.sql("UPDATE {s}.clock_offset SET offset_by = offset_by"
                     " + make_interval(secs => %s)", [LEASE + 1])
            for L in self.live_leases():
                L.expired = True
            self.lapses += 1
            self.sweep()
            return
        idle = [L for L in self.live_leases() if not L.busy()]
        if not idle:
            return
        if kind == "crash":
            idle[i % len(idle)].gone = True
            return
        conn = self.free_worker()
        if conn is None:
            return

        async def beat() -> None:
            owned: dict[uuid.UUID, bool] = {}
            try:
                for owner in sorted({L.owner for L in idle}):
                    mine = [(L.ex.id, L.epoch) for L in idle if L.owner == owner]
                    beat = await conn.run(lambda c, o=owner, m=mine: db.run_script(
                        c, statements.executions.heartbeat(self.q, owner=o, held=m,
                                                           lease_s=LEASE)))
                    owned.update(beat.owned)
            except psycopg.errors.DeadlockDetected:
                return  # against a user's transaction: the next beat tries again
            for L in idle:
                if L.ex.id not in owned:
                    L.gone = True
                elif owned[L.ex.id]:
                    L.cancel = True  # stop at the next step boundary

        task = self.spawn(beat())
        for L in idle:
            L.task = task
        self.settled()

    def sweep(self) -> None:
        if self.sweeper.inflight:
            return
        self.spawn(self.sweeper.run(lambda c: db.run(c, statements.sweeper.reenqueue_expired(
            self.q, limit=100, max_attempts=MAX_ATTEMPTS))))
        self.settled()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def invariant_x1(self) -> None:
        """No execution waits for a signal that is pending for it without a wake-up: every
        signal sent is consumed exactly once or still pending with a wake-up scheduled."""
        if not getattr(self, "ready", False):
            return
        stuck = self.sql(
            "SELECT e.id, e.waiting_for, e.wake_at FROM {s}.workflow_executions AS e "
            "WHERE e.status = 'waiting' AND (e.wake_at IS NULL "
            "      OR e.wake_at > {s}.kestrel_now() + interval '1 hour')"
            "  AND EXISTS (SELECT 1 FROM {s}.signals AS s WHERE s.execution_id = e.id"
            "              AND s.name = e.waiting_for AND s.consumed_step IS NULL)")
        assert not stuck, f"X1: parked with its signal pending and no wake-up: {stuck}"
        for eid, waiting_for in self.sql(
                "SELECT id, waiting_for FROM {s}.workflow_executions WHERE status = 'waiting'"
                " AND waiting_for IS NOT NULL"):
            assert waiting_for == self.execs[eid].wait_name  # I4: stored verbatim

    @invariant()
    def invariant_x2(self) -> None:
        """A cancelled execution never parks; cancel() of a queued or parked one finished it
        at once; a cancel that raced a park finished it under the same claim."""
        if not getattr(self, "ready", False):
            return
        parked = self.sql("SELECT id FROM {s}.workflow_executions"
                          " WHERE cancel_requested AND status = 'waiting'")
        assert not parked, f"X2: cancelled but parked: {parked}"
        for eid, retries in self.cancelled_now.items():
            if retries != self.retries.get(eid, 0):
                continue
            row = self.sql("SELECT status FROM {s}.workflow_history WHERE id = %s", [eid])
            assert row == [("cancelled",)], f"X2: cancel() said cancelled, history has {row}"
        self.cancelled_now.clear()
        for eid, retries in self.cancelling_now.items():
            if retries != self.retries.get(eid, 0):
                continue
            hot = self.sql("SELECT status, cancel_requested FROM {s}.workflow_executions"
                           " WHERE id = %s", [eid])
            if hot and not hot[0][1]:
                known("X-reinserted-row", f"cancel({eid}) said cancelling; the row is {hot}")
        self.cancelling_now.clear()
        for eid, attempt in self.cancel_attempts:
            row = self.sql("SELECT status, attempts FROM {s}.workflow_history WHERE id = %s",
                           [eid])
            if row and self.retries.get(eid, 0) == 0:
                assert row[0] == ("cancelled", attempt), f"X2: {eid} ended {row}"
        self.cancel_attempts.clear()

    @invariant()
    def invariant_i1_checkpoints(self) -> None:
        """One checkpoint per (execution, step), equal to the first recorded, and to the
        model: steps from the arguments, the wait from a committed signal."""
        if not getattr(self, "ready", False):
            return
        rows = self.sql(
            "SELECT execution_id, step_id, step_name, output, count(*) OVER "
            "(PARTITION BY execution_id, step_id) FROM {s}.workflow_steps")
        for eid, k, name, out, count in rows:
            assert count == 1, f"I1: {count} checkpoints of step {k} of {eid}"
            ex = self.execs[eid]
            self.learn(eid, k, out)
            if k == WAIT:
                assert name == "kestrel.signal:" + ex.wait_name
                assert out["received"] and self.possible(eid, ex.wait_name, out["payload"])
            else:
                assert (name, out) == (ex.step_name(k), step_output(ex.n, k)), (name, out)

    @invariant()
    def invariant_i5_i6(self) -> None:
        """Terminal rows change only by a committed retry; epochs never go back; one
        execution per idempotency key; every row was submitted; P4 never claimed."""
        if not getattr(self, "ready", False):
            return
        hot = self.sql("SELECT id, status, lease_epoch, workflow, idempotency_key"
                       " FROM {s}.workflow_executions")
        hist = self.sql("SELECT id, status, result, error->>'type', lease_epoch, workflow,"
                        " idempotency_key FROM {s}.workflow_history")
        assert not {r[0] for r in hot} & {r[0] for r in hist}, "in two places at once"
        for eid, status, epoch, workflow, key in hot:
            ex = self.execs.get(eid)
            assert ex is not None, f"unexpected execution {eid}"
            assert (workflow, key) == (ex.workflow, ex.key)
            assert epoch >= self.max_epoch.get(eid, 0), "I5: an epoch went back"
            if ex.kind == "unregistered":
                assert (status, epoch) == ("queued", 0), "P4: an unregistered one was claimed"
        for eid, status, result, error, epoch, workflow, key in hist:
            ex = self.execs.get(eid)
            assert ex is not None, f"unexpected execution {eid}"
            assert (workflow, key) == (ex.workflow, ex.key)
            assert epoch >= self.max_epoch.get(eid, 0), "I5: an epoch went back"
            seen = (status, result, error, epoch, self.retries.get(eid, 0))
            before = self.terminal.get(eid)
            if before is not None and before[4] == seen[4]:
                assert before == seen, f"I5: a terminal row changed: {before} -> {seen}"
            self.terminal[eid] = seen
            self.ever_terminal.add(eid)
        for eid in list(self.terminal):
            if eid not in {r[0] for r in hist}:
                assert self.retries.get(eid, 0) > self.terminal[eid][4], (
                    f"I5: {eid} left history without a retry")
                del self.terminal[eid]
        keys: dict[str, list[uuid.UUID]] = {}
        for eid, *_rest, key in hot:
            if key is not None:
                keys.setdefault(key, []).append(eid)
        for eid, *_rest, key in hist:
            if key is not None:
                keys.setdefault(key, []).append(eid)
        for key, ids in keys.items():
            assert len(ids) == 1, f"I6: {len(ids)} executions for key {key!r}"
            assert self.keys[key][0] == ids[0]

    @invariant()
    def invariant_signals(self) -> None:
        """Every committed signal is stored once, verbatim; none stored that was not
        committed; each consumed at most once, by the wait; children tell live parents."""
        if not getattr(self, "ready", False):
            return
        stored: dict[int, tuple[uuid.UUID, str, str | None, int | None]] = {}
        told: set[tuple[uuid.UUID, str]] = set()
        for eid, name, payload, key, consumed in self.sql(
                "SELECT execution_id, name, payload, idempotency_key, consumed_step"
                " FROM {s}.signals UNION ALL SELECT execution_id, name, payload,"
                " idempotency_key, consumed_step FROM {s}.signal_history"):
            if name.startswith("kestrel.child:"):
                told.add((eid, name))
                continue
            assert payload not in stored, f"signal {payload} stored twice"
            stored[payload] = (eid, name, key, consumed)
        committed = {p: (eid, name, key) for eid, sigs in self.signals.items()
                     for p, (name, key) in sigs.items()}
        assert {p: v[:3] for p, v in stored.items()} == committed, "a signal lost or invented"
        consumed_by: dict[uuid.UUID, int] = {}
        for eid, name, _key, consumed in stored.values():
            if consumed is not None:
                assert (consumed, name) == (WAIT, self.execs[eid].wait_name)
                consumed_by[eid] = consumed_by.get(eid, 0) + 1
        assert all(n == 1 for n in consumed_by.values()), f"consumed twice: {consumed_by}"
        live = {r[0] for r in self.sql("SELECT id FROM {s}.workflow_executions")}
        for cid, parent in self.sql("SELECT id, parent_id FROM {s}.workflow_history"
                                    " WHERE parent_id IS NOT NULL"):
            if parent in live and parent not in self.ever_terminal and not self.retries.get(
                    parent):
                assert (parent, f"kestrel.child:{cid}") in told, (
                    f"child {cid} finished without telling its live parent {parent}")

    # -- the end: every transaction ends, everything drains ---------------------------------

    async def end_all(self) -> None:
        """Commit every open client transaction (a blocked statement first finishes)."""
        for _ in range(100):
            open_ = [tx for tx in self.txs[:AUTO] if tx.used]
            if not open_:
                break
            for tx in open_:
                if not tx.busy():
                    await self.end(tx, commit=True)
            await self.settle()
        await self.settle()

    def drain_and_check(self) -> None:
        self.run(self.end_all())
        stuck = [c.name for c in self.conns if c.inflight]
        if stuck or self.client_calls:
            raise AssertionError(
                f"statements stay blocked after every client transaction ended: {stuck}, "
                f"{self.client_calls} client calls; "
                + str([(tx.used, tx.busy(), tx.aborted, tx.task, tx.conn.inflight,
                        tx.conn.conn.info.transaction_status) for tx in self.txs])
                + str(self.sql(
                    "SELECT application_name, state, wait_event_type, wait_event, query"
                    " FROM pg_stat_activity WHERE application_name LIKE %s",
                    [self.tag + "%"])))
        assert not self.tasks
        for L in self.leases:
            L.gone = True
        self.leases = []
        self.sql("UPDATE {s}.clock_offset SET offset_by = offset_by + interval '1 day'")
        for _ in range(2):
            self.run(self.drain())
            self.invariant_x1()
            # Whatever waits for its signal now gets one.
            for (eid,) in self.sql("SELECT id FROM {s}.workflow_executions"
                                   " WHERE status = 'waiting'"):
                ex = self.execs[eid]
                self.payloads += 1
                payload = self.payloads
                assert self.run(self.pyclient.signal(eid, ex.wait_name, payload))
                self.signals.setdefault(eid, {})[payload] = (ex.wait_name, None)
        self.run(self.drain())
        self.invariant_x1()
        self.invariant_x2()
        self.invariant_i1_checkpoints()
        self.invariant_i5_i6()
        self.invariant_signals()
        for row in self.sql("SELECT id, workflow, status, attempts, wake_at, waiting_for,"
                            " cancel_requested FROM {s}.workflow_executions"):
            # Only P4's execution may wait on, for a worker that knows its workflow.
            assert row[1:3] == (UNREGISTERED, "queued"), f"left behind: {row}"
        consumed = dict(self.sql("SELECT execution_id, payload FROM {s}.signals"
                                 " WHERE consumed_step IS NOT NULL UNION ALL"
                                 " SELECT execution_id, payload FROM {s}.signal_history"
                                 " WHERE consumed_step IS NOT NULL"))
        for eid, status, result, error, attempts in self.sql(
                "SELECT id, status, result, error->>'type', attempts"
                " FROM {s}.workflow_history"):
            ex = self.execs[eid]
            if status == "quarantined":
                assert attempts >= MAX_ATTEMPTS
            elif status == "cancelled":
                assert self.ancestors_cancelled(ex), f"{eid} cancelled without a cancel"
            elif status == "completed":
                assert ex.kind == "good", f"a {ex.kind} execution completed"
                assert result == model_result(ex.n, consumed[eid]), (result, ex.n)
            else:
                assert status == "failed"
                want = {"undecodable": "kestrel.errors.UndecodableInput",
                        "nul": "kestrel.errors.WriteRejected",
                        "surrogate": "kestrel.errors.WriteRejected"}
                assert error == want.get(ex.kind), f"a {ex.kind} execution failed: {error}"

    async def drain(self) -> None:
        """Sweep, then one well-behaved worker runs everything claimable to its end."""
        for _ in range(1000):
            r = await self.sweeper.run(lambda c: db.run(c, statements.sweeper.reenqueue_expired(
                self.q, limit=100, max_attempts=MAX_ATTEMPTS)))
            if r.examined == 0:
                break
        closer = self.workers[0]
        for _ in range(1000):
            await self.claim(closer, "closer", 5)
            leases = self.live_leases()
            if not leases:
                return
            for L in leases:
                while not L.gone:
                    await self.advance(L, closer)
                    await self.settle()
        raise AssertionError("the closer never ran out of work")


DB: dict[str, str] = {}


@pytest.fixture
def interleaving_db(pg_dsn: str, schema: str) -> None:
    DB.update(dsn=pg_dsn, schema=schema)


@pytest.mark.usefixtures("interleaving_db")
class TestInterleavings(InterleavingMachine.TestCase):  # type: ignore[name-defined,misc]
    settings = settings.get_profile(
        "interleaving-soak" if os.environ.get("KESTREL_HYPOTHESIS_PROFILE") == "soak"
        else "interleaving-ci")
