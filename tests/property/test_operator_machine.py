"""The operator machine (FAULTS.md, section O): operator actions and mixed versions.

What it models. Three simulated worker processes run the real :class:`kestrel.runner.Runner`
(the real replay :class:`~kestrel.workflow.Context`, group commits, give-backs) in this
process, on one connection each, against a real PostgreSQL. Every statement a worker sends
waits at a *gate* until a rule lets it through, so Hypothesis decides the interleaving one
statement at a time, and may drop the reply of a statement that committed (the runtime then
sees the error a lost connection gives and retries). Between worker statements an operator
acts: ``submit``, ``signal`` (through the client, or from a client transaction held open
across worker statements and committed or rolled back at a drawn moment), ``cancel`` (of
parents, children, waiting and running executions), ``retry``, ``fork`` from a drawn step, a
deploy of version v2 next to v1 workers and a rollback, a worker killed between two
statements, and time passing (sleeps end).

The workflow (``opm.flow``): a step; a step the machine can make fail, caught, with a
fallback step on another branch; a wait for the signal ``go``; in v2 only, behind
``ctx.patched("opm.audit")``, a durable sleep and an audit step; a child (``opm.leaf``: a
durable sleep, then a step) whose failure (a cancel) is caught; a final step the machine can
make fail, uncaught. The result names every choice the run made, and a pure
Python model (:meth:`OperatorMachine.expected_flow`) recomputes it from the arguments and the
facts that may legitimately vary: which committed signal a wait took, which branch, whether
the patch marker is there (only ever written by v2), how its own child ended.

Invariants after every rule: every execution ends or waits for something that can still
arrive (a wait for a child waits for a live child of its own; a pending signal has a wake-up;
a sleep has a wake-up; no execution parks at a position that already has a checkpoint); no
signal is lost (a consumed signal is in a checkpoint of its execution, or pending again);
nothing ends twice (finishes per execution <= 1 + committed retries; a worker counts only the
finish it wrote); every finish matches the model (completed: the model's result; failed: only
the final step the machine failed; cancelled: only under a committed cancel). At the end the
client transaction commits, every worker rolls forward to v2, time passes, every wait for
``go`` gets a signal, and everything must end.

Profiles: ``operator-ci`` (default, derandomized, about two minutes) and ``operator-soak``
(``KESTREL_HYPOTHESIS_PROFILE=soak``, run by ``make soak``).

Showing that it finds what it is for. On the code before issue 22's fixes (b36b934) it
finds rows 1-4 of that issue, each shrunk to a handful of rules (the commit that added it
lists them). To see it again, restore the pre-fix code locally (never commit it), run
``.venv/bin/pytest -q -p no:cacheprovider tests/property/test_operator_machine.py`` and
expect a falsifying example, then ``git checkout`` the file:

* rows 1-3 (lost reply to consume_signal, retry after a consumed wait, cancel of a parent
  then retry, fork after start_child or past a caught failure):
  ``git rm -q sql/functions/[0-9]*.sql && git show b36b934:sql/functions/functions.sql >
  sql/functions/functions.sql`` (every migrate re-applies it; ``git checkout HEAD --
  sql/functions`` and removing the old file bring today's back). Expected, e.g.:
  ``setup(fails=['none', 'risky'])``, ``fleet()``, ``fork(e=0, k=3)``, ``fleet()``: the
  fork fails with NonDeterminismError.
* row 4 (an old worker runs its old path over a new marker): the Context as at b36b934
  (then all in ``src/kestrel/workflow.py``; since issue 25 its checks of a position are in
  ``workflow/steps.py`` and its markers in ``workflow/patches.py``). Expected:
  ``setup(versions=['v2', 'v1', 'v1'])``, a ``go`` signal, ``fleet(first=0, fault='crash',
  at=4)`` (v2 dies after the marker, before its sleep), ``fleet(first=1)``: v1 runs its
  old path: "no child started at 5" (the model's path has the audit there).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from psycopg import sql as pgsql
from psycopg.pq import TransactionStatus

import kestrel
from kestrel import connections, db, statements
from kestrel.client import Client
from kestrel.commits import Completions
from kestrel.config import Config
from kestrel.errors import ChildFailed, InvalidState, KestrelError, StepFailed
from kestrel.lease import Lease, Leases
from kestrel.runner import FLUSHES_IN_FLIGHT, Runner, WorkerStats
from kestrel.sql import queries
from kestrel.types import Finish
from kestrel.workflow import Context, current_step

# No explain phase: it re-runs a failing example once per step, minutes here.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
settings.register_profile(
    "operator-ci", max_examples=120, stateful_step_count=40, deadline=None,
    derandomize=True, suppress_health_check=list(HealthCheck), phases=PHASES)
settings.register_profile(
    "operator-soak", max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=list(HealthCheck), phases=PHASES)

LEASE = 86_400.0  # leases end only when the machine says so (a crash), never by accident
SLEEP_S = 60
MAX_ATTEMPTS = 50  # the sweeper's; crashes never quarantine in this model
WORKERS = 3
FLOW, LEAF = "opm.flow", "opm.leaf"
PATCH = "opm.audit"
MARKER = "kestrel.patch:" + PATCH
FAILS = ["none", "none", "risky", "final", "both"]  # what the machine makes fail in a flow

# Executions whose risky / final step fails (the machine decides at submit; a retry clears it,
# as an operator fixes the cause before retrying). Keyed by execution id, read by the bodies.
FAIL_RISKY: set[uuid.UUID] = set()
FAIL_FINAL: set[uuid.UUID] = set()


# -- the application, in two versions -------------------------------------------------------

@kestrel.step(name="opm.a")
async def s_a(n: int) -> int:
    return 10 * n


@kestrel.step(name="opm.risky")
async def s_risky(n: int) -> int:
    if current_step().execution_id in FAIL_RISKY:
        raise RuntimeError("opm.risky failed (the machine)")
    return n + 1


@kestrel.step(name="opm.fallback")
async def s_fallback(n: int) -> int:
    return -(n + 2)


@kestrel.step(name="opm.audit")
async def s_audit(n: int) -> int:
    return 7 * n


@kestrel.step(name="opm.final")
async def s_final(n: int) -> int:
    if current_step().execution_id in FAIL_FINAL:
        raise RuntimeError("opm.final failed (the machine)")
    return 3 * n


@kestrel.step(name="opm.leaf")
async def s_leaf(n: int) -> int:
    return 100 * n


async def _head(ctx: Context, n: int) -> tuple[int, int, Any]:
    a = await ctx.step(s_a, n)
    try:
        r = await ctx.step(s_risky, n)
    except StepFailed:
        r = await ctx.step(s_fallback, n)
    go = await ctx.wait_for_signal("go")
    return a, r, go.payload


async def _tail(ctx: Context, n: int, a: int, r: int, go: Any, audit: int | None
                ) -> dict[str, Any]:
    child = await ctx.start_child(LEAF, n)
    try:
        c = await ctx.wait_child(child)
    except ChildFailed as exc:
        c = exc.status
    f = await ctx.step(s_final, n)
    return {"a": a, "r": r, "go": go, "audit": audit, "child": [str(child.id), c], "f": f}


async def flow_v1(ctx: Context, n: int) -> dict[str, Any]:
    a, r, go = await _head(ctx, n)
    return await _tail(ctx, n, a, r, go, None)


async def flow_v2(ctx: Context, n: int) -> dict[str, Any]:
    a, r, go = await _head(ctx, n)
    audit = None
    if await ctx.patched(PATCH):
        await ctx.sleep(SLEEP_S)
        audit = await ctx.step(s_audit, n)
    return await _tail(ctx, n, a, r, go, audit)


async def leaf(ctx: Context, n: int) -> int:
    await ctx.sleep(SLEEP_S)
    return await ctx.step(s_leaf, n)


APPS: dict[str, dict[str, Any]] = {"v1": {FLOW: flow_v1, LEAF: leaf},
                                   "v2": {FLOW: flow_v2, LEAF: leaf}}


# -- simulated workers: the real runner, one statement per permit ---------------------------

class GatePool:
    """The runner's pool: one connection, lent one statement (or group-commit flush) per
    permit. A permit may drop the reply: the statement commits, the caller gets the
    OperationalError a lost connection gives."""

    def __init__(self) -> None:
        self.sim: Sim

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float | None = None) -> AsyncIterator[Any]:
        sim = self.sim
        gate: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        sim.gates.append(gate)
        sim.moved.set()
        try:
            lose = await gate
        finally:
            if gate in sim.gates:
                sim.gates.remove(gate)
        sim.inflight += 1
        try:
            yield sim.conn
        finally:
            sim.inflight -= 1
        if lose:
            raise psycopg.OperationalError("the machine dropped the reply after the commit")


class SimCompletions(Completions):
    """The real completions; they also tell the machine which finishes the runner counted
    as its own."""

    runner: SimRunner

    async def run_once(self, finishes: list[Finish]) -> list[bool]:
        done = await super().run_once(finishes)
        for f, ok in zip(finishes, done, strict=True):
            if ok:
                self.runner.sim.reports.append((f.execution_id, f.epoch, f.status.value))
        return done


class SimRunner(Runner):
    """The real runner; it also tells the machine which finishes it counted as its own."""

    sim: Sim

    def __init__(self, cfg: Config, workflows: Any, **kwargs: Any) -> None:
        super().__init__(cfg, workflows, **kwargs)
        self.completions = SimCompletions(kwargs["pool"], kwargs["q"], self.leases,
                                          in_flight=FLUSHES_IN_FLIGHT)
        self.completions.runner = self


@dataclass(eq=False)
class Sim:
    """One simulated worker process of one app version."""

    slot: int
    version: str
    app: str
    conn: psycopg.AsyncConnection[Any]
    runner: SimRunner
    executor: ThreadPoolExecutor
    services: list[asyncio.Task[Any]] = field(default_factory=list)
    gates: list[asyncio.Future[bool]] = field(default_factory=list)
    inflight: int = 0
    lease: Lease | None = None
    owner: str = ""  # the name of its process's lease (migration 0026): app, then app~, …
    reports: list[tuple[uuid.UUID, int, str]] = field(default_factory=list)
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # the machine's (settle)

    def live(self) -> bool:
        return self.lease is not None and self.lease.task is not None and \
            not self.lease.task.done()

    def at_rest(self) -> bool:
        """Nothing on the wire, and its execution (if any) waits at the gate."""
        return self.inflight == 0 and (not self.live() or any(not g.done() for g in self.gates))

    def permit(self, lose: bool) -> bool:
        for gate in self.gates:
            if not gate.done():
                gate.set_result(lose)
                return True
        return False


@dataclass(eq=False)
class Chan:
    """A connection of the machine's own (the client, its transaction, the sweeper), with at
    most one call in flight."""

    name: str
    app: str
    conn: psycopg.AsyncConnection[Any]
    task: asyncio.Task[None] | None = None
    effects: list[Callable[[], None]] = field(default_factory=list)
    aborted: bool = False
    used: bool = False

    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(eq=False)
class Ex:
    """What the model knows of one execution."""

    id: uuid.UUID
    workflow: str
    n: int
    parent: uuid.UUID | None = None  # started by this execution (start_child)
    origin: uuid.UUID | None = None  # forked from this execution
    retries: int = 0
    cancelled: bool = False  # a cancel() of it committed (it may have been retried since)
    versions: set[str] = field(default_factory=set)  # of the workers that claimed it
    epoch: int = 0
    finished: tuple[Any, ...] | None = None  # the history row last seen
    finishes: int = 0
    outcomes: list[tuple[str, Any]] = field(default_factory=list)  # (status, result) seen


def canon(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


class OperatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.chans: list[Chan] = []
        self.sims: list[Sim] = []
        self.ready = False

    # -- set-up and tear-down ---------------------------------------------------------------

    @initialize(versions=st.lists(st.sampled_from(["v1", "v1", "v2"]), min_size=WORKERS,
                                  max_size=WORKERS),
                fails=st.lists(st.sampled_from(FAILS), min_size=2, max_size=3))
    def setup(self, versions: list[str], fails: list[str]) -> None:
        """Workers of the drawn versions, and a few flows submitted to start with."""
        self.dsn, self.schema = DB["dsn"], DB["schema"]
        self.tag = f"opm-{self.schema[-8:]}"
        self.q = queries(self.schema)
        FAIL_RISKY.clear()
        FAIL_FINAL.clear()
        self.admin = self.run(self.connect("admin"))
        self.sql("TRUNCATE {s}.workflow_executions, {s}.workflow_history,"
                 " {s}.operation_outputs, {s}.idempotency_keys,"
                 " {s}.signals, {s}.events")
        self.client = Client(self.dsn, schema=self.schema, pool_size=0)
        self.auto = self.run(self.chan("auto", autocommit=True))
        self.tx = self.run(self.chan("tx", autocommit=False))
        self.sweeper = self.run(self.chan("sweeper", autocommit=True))
        self.generation = 0
        self.moved = asyncio.Event()  # a worker reached its gate, a call or execution ended
        self.sims = [self.run(self.start_sim(i, v)) for i, v in enumerate(versions)]
        # The model.
        self.execs: dict[uuid.UUID, Ex] = {}
        self.order: list[uuid.UUID] = []
        self.sent: dict[int, tuple[uuid.UUID, str]] = {}  # committed "go" payloads
        self.payloads = 0
        self.first: dict[tuple[uuid.UUID, int], tuple[int, Any]] = {}
        self.reported: set[tuple[uuid.UUID, int]] = set()
        self.ready = True
        for n, fail in enumerate(fails):
            self.submit(n, fail)

    def teardown(self) -> None:
        try:
            # After a failed rule, report that failure alone (draining would add another).
            if self.ready and sys.exc_info()[0] is None:
                self.drain_and_check()
        finally:
            for sim in self.sims:
                self.run(self.kill(sim))
            tasks = [c.task for c in self.chans if c.task is not None and not c.task.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.wait(tasks, timeout=5))
            for c in self.chans:
                self.run(c.conn.close())
            FAIL_RISKY.clear()
            FAIL_FINAL.clear()
            self.loop.close()

    async def connect(self, name: str, *, autocommit: bool = True, fast_deadlock: bool = True
                      ) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=autocommit, prepare_threshold=None,
            application_name=f"{self.tag}-{name}")
        connections.configure_connection(conn)
        if fast_deadlock:
            # A deadlock between the machine's own statements and a worker's makes the
            # machine's statement the victim (workers keep the 1 s default): found at once.
            try:
                await conn.execute("SET deadlock_timeout = '20ms'")
            except psycopg.Error:
                pass  # not a superuser: the default second
            if not autocommit:
                await conn.commit()
        return conn

    async def chan(self, name: str, *, autocommit: bool) -> Chan:
        c = Chan(name, f"{self.tag}-{name}", await self.connect(name, autocommit=autocommit))
        self.chans.append(c)
        return c

    async def start_sim(self, slot: int, version: str) -> Sim:
        self.generation += 1
        name = f"w{slot}g{self.generation}{version}"
        conn = await self.connect(name, fast_deadlock=False)
        pool = GatePool()
        cfg = Config(schema=self.schema, lease=LEASE, heartbeat=LEASE / 3, app_version=version,
                     worker_id=name)
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"opm-{name}")
        runner = SimRunner(cfg, APPS[version], pool=pool, q=self.q,  # type: ignore[arg-type]
                           leases=Leases(), executor=executor, stats=WorkerStats(),
                           worker_id=name, stopping=asyncio.Event(), slot_freed=asyncio.Event())
        sim = Sim(slot, version, f"{self.tag}-{name}", conn, runner, executor,
                  moved=self.moved)
        pool.sim = sim
        runner.sim = sim
        sim.services = [asyncio.create_task(runner.checkpoints.run()),
                        asyncio.create_task(runner.completions.run())]
        return sim

    async def kill(self, sim: Sim) -> None:
        """The process dies between two statements: nothing more is sent, nothing released."""
        tasks = list(sim.services)
        if sim.lease is not None and sim.lease.task is not None:
            tasks.append(sim.lease.task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sim.services = []
        sim.lease = None
        sim.executor.shutdown(wait=False)
        if not sim.conn.closed:
            await sim.conn.close()

    # -- helpers ----------------------------------------------------------------------------

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def sql(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        return self.run(self.asql(text, params))  # type: ignore[no-any-return]

    async def asql(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        stmt = pgsql.SQL(text).format(s=pgsql.Identifier(self.schema))  # type: ignore[arg-type]
        cur = await self.admin.execute(stmt, params)
        return await cur.fetchall() if cur.description else []

    def pick(self, e: int, workflow: str | None = None) -> Ex | None:
        """An execution the model knows (of *workflow*), recent ones first: by index, for
        ids are random."""
        order = [i for i in self.order if workflow in (None, self.execs[i].workflow)]
        if not order:
            return None
        return self.execs[order[-1 - e % len(order)]]

    def add(self, eid: uuid.UUID, workflow: str, n: int, *, parent: uuid.UUID | None = None,
            origin: uuid.UUID | None = None) -> Ex:
        assert eid not in self.execs, f"{eid} was returned twice as a new execution"
        ex = Ex(eid, workflow, n, parent=parent, origin=origin)
        self.execs[eid] = ex
        self.order.append(eid)
        return ex

    def lineage(self, ex: Ex) -> list[Ex]:
        """The execution and those it was forked from (a fork copies their checkpoints)."""
        chain = [ex]
        while chain[-1].origin is not None:
            chain.append(self.execs[chain[-1].origin])
        return chain

    async def settle(self, limit: float = 30.0) -> None:
        """Run the loop until every worker waits at its gate (or has nothing to do) and every
        call of the machine has returned, except statements that wait, directly or through
        others, for a lock the open client transaction holds: those wait until it ends."""
        deadline = time.monotonic() + limit
        while True:
            # Woken as soon as a worker reaches its gate or a call or an execution ends;
            # the timeout covers what sends no word (a backoff, a lock wait).
            try:
                await asyncio.wait_for(self.moved.wait(), 0.005)
            except TimeoutError:
                pass
            self.moved.clear()
            await asyncio.sleep(0)  # let whatever was woken with it run first
            self.reap()
            sims = [s for s in self.sims if not s.at_rest()]
            chans = [c for c in self.chans if c.busy()]
            if not sims and not chans:
                return
            # A worker that is not at rest with nothing on the wire is running or backing off.
            if all(s.inflight for s in sims) and await self.stuck(
                    [s.app for s in sims] + [c.app for c in chans]):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"statements made no progress for {limit}s: "
                    f"{[s.app for s in sims]} {[c.app for c in chans]} " + str(self.sql(
                        "SELECT application_name, state, wait_event_type, query"
                        " FROM pg_stat_activity WHERE application_name LIKE %s",
                        [self.tag + "%"])))

    async def stuck(self, apps: list[str]) -> bool:
        """Whether every one of *apps* runs a statement that waits for the open client
        transaction, directly or through statements that do."""
        cur = await self.admin.execute(
            "SELECT pid, application_name, state, wait_event_type, pg_blocking_pids(pid)"
            " FROM pg_stat_activity WHERE application_name LIKE %s", [self.tag + "-%"])
        rows = await cur.fetchall()
        holders = {r[0] for r in rows if r[1] == self.tx.app
                   and (r[2] or "").startswith("idle in transaction")}
        waiting = {r[0]: set(r[4] or ()) for r in rows
                   if r[2] == "active" and r[3] == "Lock" and r[4]}
        stuck: set[int] = set()
        grew = True
        while grew:
            grew = False
            for pid, blockers in waiting.items():
                if pid not in stuck and blockers <= holders | stuck:
                    stuck.add(pid)
                    grew = True
        by_app = {r[1]: r[0] for r in rows}
        return all(by_app.get(app) in stuck for app in apps)

    def settled(self) -> None:
        self.run(self.settle())

    def reap(self) -> None:
        """Re-raise what a machine call's own checks raised; a worker service that died."""
        for c in self.chans:
            if c.task is not None and c.task.done():
                task, c.task = c.task, None
                task.result()
        for s in self.sims:
            for t in s.services:
                if t.done():
                    t.result()
                    raise AssertionError(f"a writer of {s.app} ended")

    def call(self, c: Chan, stmt: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]],
             done: Callable[[Any], None],
             failed: Callable[[BaseException], None] | None = None) -> None:
        """One client call on *c* as a task (it may wait for the transaction's locks)."""
        if c.busy() or c.aborted:
            return
        c.used = True

        async def go() -> None:
            try:
                value = await stmt(c.conn)
            except (psycopg.Error, KestrelError) as exc:
                if c is self.tx and (c.conn.info.transaction_status
                                     == TransactionStatus.INERROR):
                    c.aborted = True  # nothing it did will commit
                if failed is None:
                    raise
                failed(exc)
                return
            done(value)

        c.task = self.loop.create_task(go())
        c.task.add_done_callback(lambda _: self.moved.set())
        self.settled()

    def effect(self, c: Chan, fn: Callable[[], None]) -> None:
        if c is self.tx:
            c.effects.append(fn)
        else:
            fn()

    async def end_tx(self, commit: bool) -> None:
        tx = self.tx
        if commit and not tx.aborted:
            for fn in tx.effects:  # before COMMIT: a statement it unblocks may return first
                fn()
            await tx.conn.commit()
        else:
            await tx.conn.rollback()
        tx.effects, tx.aborted, tx.used = [], False, False

    # -- workers ----------------------------------------------------------------------------

    async def claim(self, sim: Sim) -> bool:
        sim.inflight += 1
        try:
            # Its process's lease, as its heartbeat keeps it (claims renew nothing): a lease
            # that ran out (the clock moved past it) is taken again under a new name.
            sim.owner = sim.owner or sim.app
            beat = statements.executions.heartbeat
            if not (await db.run_script(sim.conn, beat(
                    self.q, owner=sim.owner, held=[], lease_s=LEASE))).renewed:
                sim.owner += "~"
                await db.run_script(sim.conn, beat(self.q, owner=sim.owner, held=[],
                                                   lease_s=LEASE))
            got = await db.run(sim.conn, statements.executions.claim_batch(
                self.q, owner=sim.owner, queues=["default"], limit=1, lease_s=LEASE,
                workflows=sorted(APPS[sim.version]), app_version=sim.version))
        finally:
            sim.inflight -= 1
        if not got:
            return False
        c = got[0]
        await self.aobserve_new()
        ex = self.execs.get(c.id)
        assert ex is not None, f"claimed {c.id}, which the model never saw submitted"
        assert c.epoch > ex.epoch, "an epoch went back"
        ex.epoch = c.epoch
        ex.versions.add(sim.version)
        now = time.monotonic()
        sim.lease = Lease(c, trusted_until=now + 1e9, claimed_at=now,
                          cancel_requested=c.cancel_requested)
        sim.runner.start(sim.lease)
        assert sim.lease.task is not None
        sim.lease.task.add_done_callback(lambda _: self.moved.set())
        return True

    def advance_sim(self, sim: Sim, lose: bool) -> bool:
        """Claim if idle, else let the next statement through; False when nothing to do."""
        if sim.inflight:
            return False
        if not sim.live():
            if not self.run(self.claim(sim)):
                return False
        elif not sim.permit(lose):
            return False
        self.settled()
        return True

    def run_out(self, sim: Sim, limit: int = 100) -> None:
        """Let the worker's execution run until it parks, ends, or waits for a lock."""
        for _ in range(limit):
            if not sim.live() or not sim.permit(False):
                return
            self.settled()
        raise AssertionError(f"{sim.app} still runs its execution after {limit} statements")

    def replace(self, w: int, version: str, *, crash: bool) -> None:
        """Worker *w* stops (killed, or after its attempt) and a *version* one starts."""
        sim = self.sims[w]
        held = sim.lease.claimed if crash and sim.live() and sim.lease else None
        self.run(self.kill(sim))
        self.sims[w] = self.run(self.start_sim(w, version))
        if held is not None:
            # The dead worker's lease runs out (only its row: others' leases are fine) and the
            # sweeper puts it back in the queue; run as a call, the row may be the
            # transaction's.
            async def expire(c: psycopg.AsyncConnection[Any]) -> None:
                stmt = pgsql.SQL(
                    "UPDATE {s}.workflow_executions SET lease_expires_at ="
                    " {s}.kestrel_now() - interval '1 second'"
                    " WHERE id = %s AND lease_epoch = %s AND status = 'running'").format(
                        s=pgsql.Identifier(self.schema))
                await c.execute(stmt, [held.id, held.epoch])
                await db.run(
                    c,
                    statements.sweeper.reenqueue_expired(
                        self.q, limit=100, max_attempts=MAX_ATTEMPTS
                    ),
                )

            self.call(self.sweeper, expire, lambda _: None)

    # -- rules: workers ---------------------------------------------------------------------

    @rule(w=st.integers(0, WORKERS - 1), lose=st.sampled_from([False, False, False, True]))
    def worker_step(self, w: int, lose: bool) -> None:
        """Worker *w* claims (when idle) or sends its next statement, whose reply may be
        lost after the commit."""
        self.advance_sim(self.sims[w], lose)

    @rule(first=st.integers(0, WORKERS - 1),
          fault=st.sampled_from(["none", "none", "lose", "crash"]), at=st.integers(0, 9))
    def fleet(self, first: int, fault: str, at: int) -> None:
        """Every worker in turn, from *first* on, claims and runs until its execution parks
        or ends, until nothing is claimable. The reply of the *at*-th statement of this rule
        may be lost after its commit, or its worker killed just before sending it."""
        sent = 0
        for _ in range(30):
            progressed = False
            for i in range(WORKERS):
                w = (first + i) % WORKERS
                sim = self.sims[w]
                if sim.inflight or (not sim.live() and not self.run(self.claim(sim))):
                    continue
                self.settled()
                progressed = True
                for _ in range(100):
                    if not sim.live() or sim.inflight:
                        break
                    if fault == "crash" and sent == at:
                        fault = "none"
                        self.replace(w, sim.version, crash=True)
                        break
                    if not sim.permit(fault == "lose" and sent == at):
                        break
                    sent += 1
                    self.settled()
            if not progressed:
                return

    @rule(w=st.integers(0, WORKERS - 1))
    def crash(self, w: int) -> None:
        """Worker *w* is killed between two statements (with nothing on the wire); its lease
        runs out and the sweeper re-queues what it held."""
        if not self.sims[w].inflight:
            self.replace(w, self.sims[w].version, crash=True)

    @rule(w=st.integers(0, WORKERS - 1), version=st.sampled_from(["v1", "v2"]))
    def deploy(self, w: int, version: str) -> None:
        """Worker *w* is replaced by one of *version*: v2 next to v1 (a rolling deploy), or
        v1 again (a rollback). It stops as SIGTERM does: it finishes its attempt first."""
        sim = self.sims[w]
        if sim.version == version:
            return
        self.run_out(sim)
        if not sim.inflight and not sim.live():
            self.replace(w, version, crash=False)

    @rule(seconds=st.sampled_from([1, SLEEP_S + 1]))
    def advance_clock(self, seconds: int) -> None:
        """Time passes (by the database clock): sleeps end."""
        self.run(
            db.run(self.admin, statements.testing.advance_clock(self.q, seconds=float(seconds)))
        )

    # -- rules: the operator ----------------------------------------------------------------

    @rule(n=st.integers(0, 9), fail=st.sampled_from(FAILS))
    def submit(self, n: int, fail: str) -> None:
        """Submit a flow; the machine may make its risky step (caught) or its final step
        (uncaught) fail."""
        async def stmt(c: psycopg.AsyncConnection[Any]) -> Any:
            return (await self.client.submit(FLOW, n, conn=c)).id

        def done(eid: Any) -> None:
            self.add(eid, FLOW, n)
            if fail in ("risky", "both"):
                FAIL_RISKY.add(eid)
            if fail in ("final", "both"):
                FAIL_FINAL.add(eid)

        self.call(self.auto, stmt, done)

    @rule(e=st.integers(0, 7), via=st.sampled_from(["auto", "tx", "tx"]))
    def signal(self, e: int, via: str) -> None:
        """Signal ``go`` to an execution through the client, or from the open transaction
        (committed or rolled back later, while workers go on)."""
        ex = self.pick(e, FLOW)
        if ex is None:
            return
        self.payloads += 1
        payload = self.payloads
        c = self.tx if via == "tx" else self.auto

        async def stmt(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await self.client.signal(ex.id, "go", payload, conn=conn)

        def done(value: Any) -> None:
            assert value is True

            def commit() -> None:
                self.sent[payload] = (ex.id, "go")
            self.effect(c, commit)

        def failed(exc: BaseException) -> None:
            if not isinstance(exc, InvalidState | psycopg.errors.DeadlockDetected):
                raise exc  # InvalidState: it had finished; a deadlock's victim: nothing done

        self.call(c, stmt, done, failed)

    @rule(commit=st.booleans())
    def end_transaction(self, commit: bool) -> None:
        """The client transaction commits or rolls back; what waited for it goes on."""
        if self.tx.used and not self.tx.busy():
            self.run(self.end_tx(commit))
            self.settled()

    @rule(e=st.integers(0, 7), action=st.sampled_from(["cancel", "cancel", "retry"]))
    def operate(self, e: int, action: str) -> None:
        """cancel() (a parent with its children, a child, waiting or running) or retry()."""
        ex = self.pick(e)
        if ex is None:
            return
        if action == "cancel":
            def cancelled(value: Any) -> None:
                assert value in ("cancelled", "cancelling", "completed", "failed",
                                 "quarantined"), value
                if value in ("cancelled", "cancelling"):
                    ex.cancelled = True

            def refused(exc: BaseException) -> None:
                if not isinstance(exc, psycopg.errors.DeadlockDetected):
                    raise exc

            self.call(self.auto, lambda c: self.client.cancel(ex.id, conn=c), cancelled,
                      refused)
            return

        def retried(_: Any) -> None:
            ex.retries += 1
            FAIL_RISKY.discard(ex.id)  # the operator fixed the cause before retrying
            FAIL_FINAL.discard(ex.id)

        def not_retried(exc: BaseException) -> None:
            if not isinstance(exc, InvalidState):
                raise exc  # live or completed (KS005), or its parent was cancelled (KS009)

        self.call(self.auto, lambda c: self.client.retry(ex.id, conn=c), retried, not_retried)

    @rule(e=st.integers(0, 7), k=st.integers(0, 9))
    def fork(self, e: int, k: int) -> None:
        """fork() an execution from step *k*: a new one that reuses the first k checkpoints."""
        ex = self.pick(e)
        if ex is None:
            return

        # The fork's id is chosen by the caller, as the client does, and derived from what
        # was drawn: a resend after a lost reply returns the same fork.
        new_id = uuid.uuid5(ex.id, f"fork:{k}:{len(self.order)}")

        async def stmt(c: psycopg.AsyncConnection[Any]) -> Any:
            return await db.run(c, statements.value(self.q.fork, {
                "id": ex.id, "from_step": k, "new_id": new_id, "idempotency_key": None}))

        def forked(new: Any) -> None:
            self.add(new, ex.workflow, ex.n, origin=ex.id)

        def refused(exc: BaseException) -> None:
            if not isinstance(exc, KestrelError):
                raise exc  # a fork the runtime refuses, with a typed error, is allowed

        self.call(self.auto, stmt, forked, refused)

    # -- invariants -------------------------------------------------------------------------

    async def aobserve_new(self) -> None:
        """Children the workers started join the model (in the order they were created)."""
        hot, hist, _, _ = await self.snapshot(steps=False)
        self.observe_new(hot, hist)

    async def snapshot(self, *, steps: bool = True) -> tuple[Any, Any, Any, Any]:
        """Live and finished executions, checkpoints and signals, in one round trip."""
        text = (
            "SELECT id, status, waiting_for, wait_step, wake_at, cancel_requested, parent_id,"
            " workflow, args, created_at FROM {s}.workflow_executions;"
            " SELECT id, status, lease_epoch, finished_at, result, error->>'type',"
            " error->>'message', parent_id, workflow, args, created_at"
            " FROM {s}.workflow_history")
        if steps:
            text += ("; SELECT execution_id, step_id, step_name, output, error"
                     " FROM {s}.workflow_steps;"
                     " SELECT execution_id, name, payload, consumed_step FROM {s}.signals")
        cur = self.admin.cursor()
        await cur.execute(pgsql.SQL(text).format(s=pgsql.Identifier(self.schema)))
        sets = [await cur.fetchall()]
        while cur.nextset():
            sets.append(await cur.fetchall())
        hot = {r[0]: r[1:] for r in sets[0]}
        hist = {r[0]: r[1:] for r in sets[1]}
        return hot, hist, sets[2] if steps else [], sets[3] if steps else []

    def observe_new(self, hot: dict[uuid.UUID, tuple[Any, ...]],
                    hist: dict[uuid.UUID, tuple[Any, ...]]) -> None:
        rows = sorted((r[-1], str(eid), eid, r[-4], r[-3], r[-2])
                      for eid, r in [*hot.items(), *hist.items()] if eid not in self.execs)
        for *_, eid, parent, workflow, args in rows:
            assert parent in self.execs and workflow == LEAF, (
                f"an execution nobody submitted: {eid} {workflow} parent {parent}")
            assert args == [self.execs[parent].n], args
            self.add(eid, LEAF, args[0], parent=parent)

    @invariant()
    def check(self) -> None:
        if self.ready:
            self.run(self.acheck())

    async def acheck(self) -> None:
        hot, hist, step_rows, signals = await self.snapshot()
        self.observe_new(hot, hist)
        assert not set(hot) & set(hist), "an execution is live and finished at once"
        steps: dict[uuid.UUID, dict[int, tuple[str, Any, Any]]] = {}
        for eid, k, name, out, err in step_rows:
            assert k not in steps.setdefault(eid, {}), f"two checkpoints at {k} of {eid}"
            steps[eid][k] = (name, out, err)
            # A checkpoint never changes, unless a retry since dropped it.
            seen = self.first.get((eid, k))
            ex = self.execs[eid]
            if seen is None or seen[0] != ex.retries:
                self.first[(eid, k)] = (ex.retries, (name, out, err))
            else:
                assert seen[1] == (name, out, err), f"checkpoint {k} of {eid} changed"
        # Finishes: each one seen once, counted once, and the model's.
        new = []
        for eid, row in hist.items():
            ex = self.execs[eid]
            if ex.finished != row:
                ex.finished = row
                ex.finishes += 1
                assert ex.finishes <= 1 + ex.retries, (
                    f"{eid} ended {ex.finishes} times with {ex.retries} retries")
                ex.outcomes.append((row[0], row[3]))
                new.append(ex)
        for sim in self.sims:
            for eid, epoch, status in sim.reports:
                assert (eid, epoch) not in self.reported, f"finish of {eid} counted twice"
                self.reported.add((eid, epoch))
                assert eid in hist and (hist[eid][0], hist[eid][1]) == (status, epoch), (
                    f"a worker counted a finish ({status}, epoch {epoch}) of {eid} that is "
                    f"not the one recorded: {hist.get(eid)}")
            sim.reports.clear()
        for ex in new:
            if not steps.get(ex.id):  # none through the view: say what the tables hold
                cur = await self.admin.execute(pgsql.SQL(
                    "SELECT step_id, step_name, execution_finished_at FROM {s}.step_history"
                    " WHERE execution_id = %s UNION ALL SELECT step_id, step_name, NULL"
                    " FROM {s}.operation_outputs WHERE execution_id = %s").format(
                        s=pgsql.Identifier(self.schema)), (ex.id, ex.id))
                raw = await cur.fetchall()
                assert not raw, (f"{ex.id} finished at {hist[ex.id][2]}; its checkpoints "
                                 f"are not in workflow_steps, the tables hold {raw}")
            self.check_finish(ex, hist[ex.id], steps.get(ex.id, {}))
        self.check_signals(signals, steps)
        self.check_waits(hot, hist, signals, steps)

    def check_finish(self, ex: Ex, row: tuple[Any, ...], steps: dict[int, tuple[str, Any, Any]]
                     ) -> None:
        status, _epoch, _at, result, etype, message = row[:6]
        if status == "completed":
            want = (self.expected_leaf(ex, steps) if ex.workflow == LEAF
                    else self.expected_flow(ex, steps))
            assert result == want, (
                f"the result of {ex.workflow} {ex.id} is not the model's:\n  got  {result}\n"
                f"  want {want}\n  steps {sorted(steps.items())}")
        elif status == "cancelled":
            cur: Ex | None = ex
            while cur is not None and not cur.cancelled:
                cur = self.execs[cur.parent] if cur.parent else None
            assert cur is not None, f"{ex.id} was cancelled, but no cancel() of it committed"
        elif status == "failed":
            assert ex.workflow == FLOW and etype == "kestrel.errors.StepFailed" and \
                "'opm.final'" in (message or ""), (
                    f"{ex.workflow} {ex.id} failed with {etype}: {message}; only the final "
                    f"step the machine fails may fail it\n  steps {sorted(steps.items())}")
        else:
            raise AssertionError(f"{ex.id} ended {status}: {etype}: {message}")

    def payload_of(self, ex: Ex, steps: dict[int, tuple[str, Any, Any]], k: int) -> Any:
        """The payload of the ``go`` wait at *k*: a signal committed for this execution or
        one it was forked from."""
        got = steps.get(k)
        assert got is not None and got[0] == "kestrel.signal:go" and got[2] is None, (
            f"no wait for go at {k} of {ex.id}: {sorted(steps.items())}")
        assert got[1]["received"] is True, got
        payload = got[1]["payload"]
        assert self.sent.get(payload, (None,))[0] in {x.id for x in self.lineage(ex)}, (
            f"{ex.id} took payload {payload}, never committed for it: "
            f"{self.sent.get(payload)}")
        return payload

    def expected_leaf(self, ex: Ex, steps: dict[int, tuple[str, Any, Any]]) -> Any:
        got = [s[0] for k, s in sorted(steps.items())]
        assert got == ["kestrel.sleep", "opm.leaf"], f"{ex.id} took no path of the model: {got}"
        return 100 * ex.n

    def expected_flow(self, ex: Ex, steps: dict[int, tuple[str, Any, Any]]) -> Any:
        """The model: what flow *ex* returns, given the branch its risky step took, the
        signal its wait took, whether v2 marked it, and how its child ended."""
        n = ex.n
        risky = steps.get(1)
        failed = risky is not None and risky[2] is not None
        go = 3 if failed else 2
        patched = any(k < 0 and s[0] == MARKER for k, s in steps.items())
        if patched:
            assert any("v2" in x.versions for x in self.lineage(ex)), (
                f"{ex.id} has the marker of {PATCH!r}, which only v2 writes")
        start = go + (3 if patched else 1)
        child = steps.get(start)
        assert child is not None and child[0] == "kestrel.start_child:" + LEAF, (
            f"no child started at {start} of {ex.id}: {sorted(steps.items())}")
        cid = child[1]
        names = (["opm.a", "opm.risky"] + (["opm.fallback"] if failed else [])
                 + ["kestrel.signal:go"] + (["kestrel.sleep", "opm.audit"] if patched else [])
                 + ["kestrel.start_child:" + LEAF, f"kestrel.signal:kestrel.child:{cid}",
                    "opm.final"])
        got = [s[0] for k, s in sorted(steps.items()) if k >= 0]
        assert got == names, f"{ex.id} took no path of the model: {got}, want {names}"
        assert all(s[2] is None for k, s in steps.items() if k != 1), sorted(steps.items())
        kid = self.execs.get(uuid.UUID(cid))
        assert kid is not None and kid.parent in {x.id for x in self.lineage(ex)}, (
            f"{ex.id} waited for {cid}, which is not its child")
        told = steps[start + 1][1]
        assert told["received"] is True, told
        outcome = told["payload"]
        assert (outcome["status"], outcome["result"]) in kid.outcomes, (
            f"{ex.id} was told its child {cid} ended {outcome}; it ended {kid.outcomes}")
        c = outcome["result"] if outcome["status"] == "completed" else outcome["status"]
        return {"a": 10 * n, "r": -(n + 2) if failed else n + 1,
                "go": self.payload_of(ex, steps, go), "audit": 7 * n if patched else None,
                "child": [cid, c], "f": 3 * n}

    def check_signals(self, signals: list[tuple[Any, ...]],
                      steps: dict[uuid.UUID, dict[int, tuple[str, Any, Any]]]) -> None:
        """Every committed go is stored once (or left with its finished execution) and none
        other; no signal is lost: a consumed one is in a checkpoint of its execution, or
        pending again (a copy)."""
        stored: dict[int, set[uuid.UUID]] = {}
        for eid, name, payload, _consumed in signals:
            if name == "go":
                # A fork gets a copy of its source's signals not consumed below its
                # position (fork() copies them as pending): one per execution of a lineage.
                assert eid not in stored.get(payload, set()), (
                    f"signal {payload} stored twice in {eid}")
                sent = self.sent.get(payload)
                lineage = {x.id for x in self.lineage(self.execs[eid])} if (
                    eid in self.execs) else {eid}
                assert sent is not None and sent[1] == "go" and sent[0] in lineage, (
                    f"signal {payload} of {eid} was never committed to it or to what it was "
                    f"forked from: {sent}")
                stored.setdefault(payload, set()).add(eid)
        for payload, (eid, _) in self.sent.items():
            assert payload in stored or self.execs[eid].finishes, (
                f"committed signal {payload} of live {eid} is not stored")
        pending = {(eid, name, canon(p)) for eid, name, p, consumed in signals
                   if consumed is None}
        for eid, name, payload, consumed in signals:
            if consumed is None:
                continue
            held = [k for k, s in steps.get(eid, {}).items()
                    if s[0] == "kestrel.signal:" + name and s[1].get("received")
                    and canon(s[1].get("payload")) == canon(payload)]
            assert len(held) <= 1, f"signal {name} {payload} of {eid} taken at {held}"
            assert held or (eid, name, canon(payload)) in pending, (
                f"a consumed signal is in no checkpoint: {name} {payload} of {eid} (consumed "
                f"at {consumed}), checkpoints {sorted(steps.get(eid, {}).items())}")

    def check_waits(self, hot: dict[uuid.UUID, tuple[Any, ...]],
                    hist: dict[uuid.UUID, tuple[Any, ...]], signals: list[tuple[Any, ...]],
                    steps: dict[uuid.UUID, dict[int, tuple[str, Any, Any]]]) -> None:
        """Everything live ends, or waits for something that can still arrive."""
        pending = {(eid, name) for eid, name, _p, consumed in signals if consumed is None}
        for eid, (status, waiting_for, wait_step, wake_at, cancelling, *_) in hot.items():
            if status != "waiting":
                continue
            assert not cancelling, f"{eid} parked with its cancel requested"
            assert wait_step is None or wait_step not in steps.get(eid, {}), (
                f"{eid} parked at {wait_step}, which already has a checkpoint: "
                f"{steps[eid][wait_step]}")
            if waiting_for == "kestrel.sleep" or (eid, waiting_for) in pending:
                assert wake_at is not None, f"{eid} waits for {waiting_for} with no wake-up"
                continue
            if waiting_for is not None and waiting_for.startswith("kestrel.child:"):
                cid = uuid.UUID(waiting_for.removeprefix("kestrel.child:"))
                kid = hot.get(cid)
                assert kid is not None and kid[5] == eid, (
                    f"{eid} waits for child {cid}, which can no longer tell it: "
                    f"{'its own child' if kid is None or kid[5] == eid else 'not its child'}"
                    f", {hist.get(cid, ('live',))[0]}, parent "
                    f"{self.execs[cid].parent if cid in self.execs else '?'}")

    # -- the end: the transaction ends, v2 everywhere, everything drains --------------------

    def drain_and_check(self) -> None:
        if self.tx.used:
            for _ in range(100):
                if not self.tx.busy():
                    break
                self.settled()
            self.run(self.end_tx(True))
        self.settled()
        self.check()
        for w, sim in enumerate(self.sims):  # roll forward: every worker runs v2
            self.run_out(sim)
            self.settled()
            assert not sim.live(), f"{sim.app} never finished its attempt"
            self.replace(w, "v2", crash=False)
        worker = self.sims[0]
        for _ in range(100):
            progress = False
            self.run(
                db.run(self.admin, statements.testing.advance_clock(self.q, seconds=2 * LEASE))
            )
            while self.run(
                db.run(
                    self.admin,
                    statements.sweeper.reenqueue_expired(
                        self.q, limit=100, max_attempts=MAX_ATTEMPTS
                    ),
                )
            ).examined:
                pass
            for _ in range(1000):
                if not self.run(self.claim(worker)):
                    break
                progress = True
                self.settled()
                self.run_out(worker)
            # Whatever waits for go gets one.
            for (eid,) in self.sql(
                    "SELECT id FROM {s}.workflow_executions AS e WHERE status = 'waiting'"
                    " AND waiting_for = 'go' AND NOT EXISTS (SELECT 1 FROM {s}.signals AS s"
                    " WHERE s.execution_id = e.id AND s.name = 'go'"
                    " AND s.consumed_step IS NULL)"):
                self.signal_now(eid)
                progress = True
            self.check()
            if not progress:
                break
        left = self.sql("SELECT id, workflow, status, waiting_for, wait_step, wake_at"
                        " FROM {s}.workflow_executions")
        assert not left, f"left behind for ever: {left}"

    def signal_now(self, eid: uuid.UUID) -> None:
        self.payloads += 1
        payload = self.payloads
        assert self.run(self.client.signal(eid, "go", payload, conn=self.auto.conn))
        self.sent[payload] = (eid, "go")


DB: dict[str, str] = {}


@pytest.fixture
def operator_db(pg_dsn: str, schema: str) -> None:
    DB.update(dsn=pg_dsn, schema=schema)


@pytest.mark.usefixtures("operator_db")
class TestOperators(OperatorMachine.TestCase):  # type: ignore[name-defined,misc]
    settings = settings.get_profile(
        "operator-soak" if os.environ.get("KESTREL_HYPOTHESIS_PROFILE") == "soak"
        else "operator-ci")
