"""The worker's trust rules, each held by a test that fails within seconds when a code
mutation breaks it (FAULTS, section C; issue 38, item 7). The suite missed these mutations:

1. no step body starts once the lease is no longer trusted (its trust ran out, nothing
   extended it, nobody re-claimed it yet);
2. a process holds at most one suspect (an execution already claimed SUSPECT_AFTER times)
   at a time;
3. a claim skips a row a client's transaction holds, never waits for it;
4. the sweeper re-queues a lease only once it has run out, not a moment before.

(A heartbeat that skipped a busy row does not extend its trust: test_lock_timeout.py.)
No assertion reads elapsed time: a claim that waited is told by the LockNotAvailable its
lock_timeout raises, and the sweeper's edge is probed on the test clock, which stands still
inside one transaction.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

import kestrel
from kestrel import connections, db, statements
from kestrel.claimer import Claimer, Wakeups
from kestrel.lease import Leases, LeaseState
from kestrel.runner import Runner, WorkerStats
from kestrel.sql import queries
from kestrel.statements.executions import SUSPECT_AFTER
from kestrel.types import Claimed
from kestrel.worker import Worker
from kestrel.workflow import registry
from tests.apps import ledger_app as app
from tests.conftest import VIA_PGBOUNCER
from tests.helpers import config, q, q1, take_lease

# -- workflows only these tests run ----------------------------------------------------------

GATES: dict[str, asyncio.Event] = {}
"""By execution id: holds the first attempt of trust_gate's body until the test sets it."""


@kestrel.step(name="trust_gate", retries=1, base_delay=0.01, max_delay=0.01,
              retry_on=(ConnectionError,))
async def gate(fail_first: bool) -> int:
    """Records each attempt in the ledger; the first waits for its gate, then fails if told
    to (its retry is a second start of the body)."""
    app.ledger()
    info = kestrel.current_step()
    if info.attempt == 1:
        await GATES[str(info.execution_id)].wait()
        if fail_first:
            raise ConnectionError("the first attempt fails")
    return 1


@kestrel.workflow(name="trust_gated")
async def gated(ctx: kestrel.Context, n: int, fail_first: bool) -> int:
    a = await ctx.step(gate, fail_first)
    b = await ctx.step(app.add, n, 1)  # a body that records itself in the ledger too
    return a + b


@kestrel.workflow(name="trust_hold")
async def hold(ctx: kestrel.Context) -> None:
    """Holds its lease until the test cancels it."""
    await asyncio.Event().wait()


# -- helpers ---------------------------------------------------------------------------------


async def until(predicate: Callable[[], Any], what: str, *, timeout: float = 20.0,
                task: asyncio.Task[Any] | None = None) -> None:
    """Wait on the event loop until *predicate()*; a *task* that ended early raises."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if task is not None and task.done():
            task.result()
            raise AssertionError(f"the worker stopped before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def claim_conn(dsn: str) -> psycopg.Connection[Any]:
    """A claim's connection as a worker's carries it, with a lock_timeout of 2 s: a claim that
    waits on a held row fails with LockNotAvailable instead of returning."""
    return connections.connect(dsn, lock_timeout=2.0, session=not VIA_PGBOUNCER,
                               autocommit=True, prepare_threshold=None)


def submit(dsn: str, schema: str, n: int, *, queue: str = "default",
           workflow: str = "three_steps") -> list[uuid.UUID]:
    """Submit *n* executions of *workflow* in *queue*; their ids, in submission order."""
    rows = q(dsn, schema, "SELECT {s}.submit(%s, jsonb_build_array(i), %s) "
             "FROM generate_series(1, %s) AS i ORDER BY i", [workflow, queue, n])
    return [r[0] for r in rows]


# -- 1. no step body starts on an untrusted lease --------------------------------------------


@pytest.mark.parametrize("start", ["next_step", "retry"])
def test_no_step_body_starts_once_the_lease_is_untrusted(
    pg_dsn: str, schema: str, ledger_path: Path, start: str
) -> None:
    """A lease's trust ran out while a step body ran: the heartbeat stopped (nothing extends
    it, nothing cancels the run), the writer works and the row is still ours in the database
    (its lease pushed out: no sweep, no re-claim). Neither the next step's body nor a retry
    of this one may start. Catches the trust check removed from Context._check_can_start
    (next_step) or from the retry loop of Context._run_step (retry)."""
    fail_first = start == "retry"
    (eid,) = q(pg_dsn, schema, "SELECT {s}.submit('trust_gated', jsonb_build_array(7, %s))",
               [fail_first])[0]

    async def main() -> tuple[Worker, LeaseState]:
        gate = GATES[str(eid)] = asyncio.Event()
        worker = Worker(config(schema, lease=2.0, heartbeat=0.5, concurrency=4), registry(),
                        dsn=pg_dsn)
        task = asyncio.create_task(worker.run())
        try:
            await until(lambda: app.read_ledger(ledger_path, name="trust_gate"),
                        "the first step's body to start", task=task)
            (lease,) = list(worker.leases)
            await worker.heartbeat.stop()  # no beat extends the lease or cancels the run now
            await asyncio.to_thread(
                q, pg_dsn, schema, "UPDATE {s}.leases SET expires_at = "
                "{s}.kestrel_now() + interval '1 hour' WHERE owner = %s", [worker.id])
            await until(lambda: not lease.trusted(), "the lease's trust to run out", task=task)
            state = lease.state  # held, neither lost nor re-claimed: only its trust ran out
            gate.set()
            await until(lambda: lease.task is not None and lease.task.done(),
                        "the run to end", task=task)
        finally:
            gate.set()
            worker.stop(drain_timeout=1)
            await task
        return worker, state

    worker, state = asyncio.run(main())
    assert state is LeaseState.HELD
    bodies = [(e["name"], e["step_id"], e["attempt"]) for e in app.read_ledger(ledger_path)]
    assert bodies == [("trust_gate", 0, 1)], f"a body started on an untrusted lease: {bodies}"
    assert worker.stats.lost == 1  # the run was dropped as LeaseLost
    row = q(pg_dsn, schema, "SELECT status, lease_epoch, lease_owner, "
            "lease_expires_at = '-infinity' FROM {s}.workflow_executions WHERE id = %s", [eid])
    # Nobody took it over. Dropped here under a lease still alive, its own lease was ended
    # by its process as it stopped (the heartbeat, stopped above, would have at its next
    # beat), for the sweeper to re-queue.
    assert row == [("running", 1, worker.id, True)]


# -- 2. at most one suspect at a time --------------------------------------------------------


def test_a_process_holds_at_most_one_suspect_at_a_time(pg_dsn: str, schema: str) -> None:
    """Three suspects (claimed SUSPECT_AFTER times before) and two healthy executions queued;
    the claimer, with slots to spare, claims twice. The first round takes one suspect and the
    healthy ones; the second, holding that suspect, takes the healthy execution submitted
    meanwhile and no suspect. Deterministic: no worker loop, two claim rounds in a row.
    Catches take_suspect always true (Claimer._claim) or ignored (claim_batch's suspect CTE)."""
    suspects = submit(pg_dsn, schema, 3, workflow="trust_hold")
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET attempts = %s WHERE id = ANY(%s)",
      [SUSPECT_AFTER, suspects])
    submit(pg_dsn, schema, 2, workflow="trust_hold")
    cfg = config(schema, concurrency=8)
    owner = "trust-suspects"
    running_suspects = ("SELECT count(*) FROM {s}.workflow_executions WHERE status = 'running' "
                        "AND lease_owner = %s AND attempts > %s")

    async def main() -> list[int]:
        pool = connections.make_pool(pg_dsn, max_size=2, name="trust",
                                     prepared=cfg.prepared_statements,
                                     lock_timeout=cfg.statement_lock_timeout,
                                     session=cfg.connection_mode == "direct")
        await pool.open(wait=True)
        leases = Leases()
        stopping, freed = asyncio.Event(), asyncio.Event()
        executor = ThreadPoolExecutor(2)
        runner = Runner(cfg, {"trust_hold": hold}, pool=pool, q=queries(schema), leases=leases,
                        executor=executor, stats=WorkerStats(), worker_id=owner,
                        stopping=stopping, slot_freed=freed)
        claimer = Claimer(cfg, runner, pool=pool, workflows=["trust_hold"],
                          wakeups=Wakeups(stopping, asyncio.Event(), freed))
        try:
            first = (await claimer.run_once()).claimed
            submit(pg_dsn, schema, 1, workflow="trust_hold")
            second = (await claimer.run_once()).claimed
            held = sum(1 for h in leases if h.claimed.attempt > SUSPECT_AFTER)
            return [first, second, held]
        finally:
            stopping.set()
            tasks = [h.task for h in leases if h.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()
            executor.shutdown()

    first, second, held = asyncio.run(main())
    running = q1(pg_dsn, schema, running_suspects, [owner, SUSPECT_AFTER])
    assert (held, running) == (1, 1), f"{held} suspects held at once, {running} running"
    assert (first, second) == (3, 1)  # 1 suspect + 2 healthy, then the new healthy one only
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
              "WHERE status = 'queued' AND id = ANY(%s)", [suspects]) == 2


# -- 3. a claim skips what a client holds ----------------------------------------------------


def prepare(pg_dsn: str, schema: str, kind: str, queue: str) -> tuple[list[uuid.UUID],
                                                                      list[uuid.UUID]]:
    """Four claimable rows of *kind* (queued, suspect or woken) in *queue*: two that every
    claim reaches first (higher priority, earlier wake-up), to be held, and two free."""
    held, free = submit(pg_dsn, schema, 2, queue=queue), submit(pg_dsn, schema, 2, queue=queue)
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET priority = 5 WHERE id = ANY(%s)",
      [held])
    if kind == "suspect":
        q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET attempts = %s", [SUSPECT_AFTER])
    if kind == "woken":
        q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'waiting', "
          "waiting_for = 'kestrel.sleep', wake_at = {s}.kestrel_now() - "
          "CASE WHEN id = ANY(%s) THEN interval '1 minute' ELSE interval '1 second' END",
          [held])
    return held, free


def holding(direct_dsn: str, schema: str, held: list[uuid.UUID]) -> list[psycopg.Connection[Any]]:
    """Two client transactions left open: one holds *held[0]* FOR UPDATE, the other
    *held[1]* FOR NO KEY UPDATE (the lock a client's UPDATE of the row takes)."""
    clients = []
    for row, mode in zip(held, ("UPDATE", "NO KEY UPDATE"), strict=True):
        client = psycopg.connect(direct_dsn)
        client.execute(pgsql.SQL("SELECT 1 FROM {}.workflow_executions WHERE id = %s FOR "
                                 + mode).format(pgsql.Identifier(schema)), [row])
        clients.append(client)
    return clients


def check_skipped(pg_dsn: str, schema: str, claimed: list[Claimed] | None,
                  held: list[uuid.UUID], free: list[uuid.UUID], kind: str) -> None:
    assert claimed is not None
    got = {c.id for c in claimed}
    if kind == "suspect":
        assert len(got) == 1 and got <= set(free)  # one suspect a claim
    else:
        assert got == set(free)
    untouched = q(pg_dsn, schema, "SELECT status, lease_epoch FROM {s}.workflow_executions "
                  "WHERE id = ANY(%s)", [held])
    assert sorted(untouched) == [("waiting" if kind == "woken" else "queued", 0)] * 2


@pytest.mark.parametrize("kind", ["queued", "suspect", "woken"])
def test_a_claim_skips_rows_a_client_holds(pg_dsn: str, direct_dsn: str, schema: str,
                                           kind: str) -> None:
    """claim_batch, with two claimable rows held by open client transactions (FOR UPDATE and
    FOR NO KEY UPDATE) ahead of two free ones: it returns the free rows at once and raises
    nothing; waiting on a held row, it would fail with LockNotAvailable after its
    lock_timeout. Catches SKIP LOCKED dropped from claim_batch's healthy (queued), suspect
    or woken CTE."""
    held, free = prepare(pg_dsn, schema, kind, "default")
    clients = holding(direct_dsn, schema, held)
    try:
        with claim_conn(pg_dsn) as conn:
            claimed = db.run_sync(conn, statements.executions.claim_batch(
                queries(schema), owner="t", queues=["default"], limit=10, lease_s=30))
    finally:
        for client in clients:
            client.close()
    check_skipped(pg_dsn, schema, claimed, held, free, kind)


@pytest.mark.parametrize("kind", ["queued", "woken"])
def test_a_limited_claim_skips_rows_a_client_holds(pg_dsn: str, direct_dsn: str, schema: str,
                                                   kind: str) -> None:
    """The same for a limited queue's claim (queues.claim_limited, a Script in one
    transaction under the queue's row lock). Catches SKIP LOCKED dropped from
    limited_candidates' queued_first (queued) or woken_first (woken)."""
    qs = queries(schema)
    with claim_conn(pg_dsn) as conn:
        db.run_sync(conn, statements.queues.upsert_queue_limit(
            qs, queue="trust-limited", concurrency=10, rate=None, period_s=None))
    held, free = prepare(pg_dsn, schema, kind, "trust-limited")
    clients = holding(direct_dsn, schema, held)
    try:
        with claim_conn(pg_dsn) as conn:
            claimed = db.run_script_sync(conn, statements.queues.claim_limited(
                qs, queue="trust-limited", owner="t", limit=10, lease_s=30))
    finally:
        for client in clients:
            client.close()
    check_skipped(pg_dsn, schema, claimed, held, free, kind)


# -- 4. the sweeper waits for the lease to run out -------------------------------------------


@pytest.mark.parametrize("delegated", [False, True], ids=["statement", "sweep_expired"])
def test_the_sweeper_requeues_a_lease_only_once_it_ran_out(pg_dsn: str, schema: str,
                                                           delegated: bool) -> None:
    """A row claimed under a process's 30 s lease (migration 0026); the sweep runs with the
    database clock set, in the sweep's own transaction (where the clock stands still), to 1 s
    and to 1 ms before the lease runs out: nothing is re-queued and the row runs on under its
    epoch. 1 ms after, it is re-queued. Catches the sweep re-queueing early (`expires_at <
    kestrel_now() + interval '5 seconds'`, or by a millisecond), in the statement and in
    its Citus form (sweep_expired())."""
    qs = queries(schema)
    (eid,) = submit(pg_dsn, schema, 1)
    take_lease(pg_dsn, schema, "t", 30)
    with claim_conn(pg_dsn) as conn:
        (claimed,) = db.run_sync(conn, statements.executions.claim_batch(
            qs, owner="t", queues=["default"], limit=1, lease_s=30))
    runs_out = q1(pg_dsn, schema, "SELECT expires_at FROM {s}.leases WHERE owner = 't'")
    clock = pgsql.SQL("UPDATE {}.clock_offset SET offset_by = %s - now()").format(
        pgsql.Identifier(schema))

    def sweep_at(delta: timedelta) -> int:
        with (psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn,
              conn.transaction()):
            conn.execute(clock, [runs_out + delta])
            swept = db.run_sync(conn, statements.sweeper.reenqueue_expired(
                qs, limit=100, max_attempts=10, delegated=delegated))
        return swept.requeued

    row = "SELECT status, lease_epoch, lease_owner FROM {s}.workflow_executions WHERE id = %s"
    for before in (timedelta(seconds=-1), timedelta(milliseconds=-1)):
        early = -before.total_seconds()
        assert sweep_at(before) == 0, f"re-queued {early} s before its lease ran out"
        assert q(pg_dsn, schema, row, [eid]) == [("running", claimed.epoch, "t")]
    assert sweep_at(timedelta(milliseconds=1)) == 1
    assert q(pg_dsn, schema, row, [eid]) == [("queued", claimed.epoch, None)]
