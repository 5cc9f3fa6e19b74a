"""Interleavings with other transactions and with the worker's own writes (FAULTS X).

Each test here is the regression test of one fix: it fails on the code before the fix and
passes after it. Where a race decides the outcome, the test forces the interleaving itself
(a client transaction held open across a worker statement, a failpoint, a hanging flush)
instead of hoping to hit it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql as pgsql

import kestrel
from kestrel import connections, db, failpoints, statements
from kestrel.client import SyncClient
from kestrel.sql import queries
from kestrel.types import Claimed, Finish, SignalTaken, Status, StepWrite
from tests.apps.ledger_app import ledger, read_ledger
from tests.helpers import config, finished_count, q, q1, run_worker_until, wait_until

# -- helpers ----------------------------------------------------------------------------------


def _steps(dsn: str, schema: str, eid: object) -> list[tuple[Any, ...]]:
    """(step_id, step_name, lease_epoch) of every checkpoint of *eid*, live or finished."""
    return q(dsn, schema, "SELECT step_id, step_name, lease_epoch FROM {s}.operation_outputs "
             "WHERE execution_id = %s ORDER BY step_id", [eid])


def _metric(name: str, **labels: str) -> float:
    """An in-process metric's current value (0 when it has no sample yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _inject(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """Enable failpoints in this process, as KESTREL_FAILPOINTS=*spec* would at import."""
    monkeypatch.setattr(failpoints, "_FAILPOINTS", failpoints._parse_failpoints(spec))


async def _connect(dsn: str, *, autocommit: bool = True) -> psycopg.AsyncConnection[Any]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit,
                                                 prepare_threshold=None)
    connections.configure_connection(conn)
    return conn


async def _consume_waits_for_a_lock(watch: psycopg.AsyncConnection[Any], schema: str) -> None:
    """Return once a statement on *schema* (the consume: nothing else runs) waits for a lock
    (at most 10 s). Found by its text, not by backend pid: behind PgBouncer the pid a client
    sees is not the server's."""
    deadline = time.monotonic() + 10
    while True:
        cur = await watch.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s", [f"%{schema}%"])
        row = await cur.fetchone()
        if row is not None and row[0] > 0:
            return
        assert time.monotonic() < deadline, "the consume statement never waited for the lock"
        await asyncio.sleep(0.02)


# -- X1: a signal committed while the worker's consume waits for the row lock -------------------

Send = Callable[[psycopg.AsyncConnection[Any], dict[uuid.UUID, Claimed]], Awaitable[Any]]


def _consume_while_a_transaction_commits(
    dsn: str, schema: str, *, waiter: uuid.UUID, name: str, send: Send
) -> tuple[SignalTaken, Any]:
    """Claim what is queued; in a client transaction run *send* (it locks *waiter*'s row);
    run consume_signal of *name* for *waiter* while that transaction is open (it waits
    for the row lock); commit; then do what the worker does with the answer: park with its
    signal_seq when no signal was taken. Returns (consume's answer, park's answer or None)."""
    qs = queries(schema)

    async def main() -> tuple[SignalTaken, Any]:
        worker = await _connect(dsn)
        client = await _connect(dsn, autocommit=False)
        watch = await _connect(dsn)
        try:
            claimed = {c.id: c for c in await db.run(worker, statements.executions.claim_batch(
                qs, owner="w", queues=["default"], limit=10, lease_s=60))}
            c = claimed[waiter]
            await send(client, claimed)
            consume = asyncio.create_task(db.run(worker, statements.steps.consume_signal(
                qs, id=c.id, epoch=c.epoch, step_id=0, name=name,
                step_name="kestrel.signal:" + name)))
            await _consume_waits_for_a_lock(watch, schema)
            await client.commit()
            taken = await asyncio.wait_for(consume, 10)
            parked = None
            if taken.owned and taken.output is None:
                parked = await db.run(
                    worker,
                    statements.executions.park(
                        qs,
                        id=c.id,
                        epoch=c.epoch,
                        step_id=0,
                        waiting_for=name,
                        seconds=None,
                        seen_seq=taken.signal_seq,
                    ),
                )
            return taken, parked
        finally:
            for conn in (worker, client, watch):
                await conn.close()

    return asyncio.run(main())


def _assert_never_parked_with_its_signal_pending(
    dsn: str, schema: str, eid: uuid.UUID, name: str, taken: SignalTaken, parked: Any
) -> None:
    signals = q(dsn, schema, "SELECT consumed_step FROM {s}.signals WHERE execution_id = %s "
                "AND name = %s", [eid, name])
    status, wake_at = q(dsn, schema, "SELECT status, wake_at FROM {s}.workflow_executions "
                        "WHERE id = %s", [eid])[0]
    assert len(signals) == 1
    assert not (status == "waiting" and signals == [(None,)]), (
        f"parked (park answered {parked!r}, wake_at {wake_at}) with its signal pending; "
        f"consume answered {taken!r}")
    # The signal committed before the consume statement got the row lock, so consume took
    # it: consumed exactly once, into the wait's checkpoint.
    assert taken.output is not None and taken.output["received"] is True
    assert signals == [(0,)]
    assert [r[:2] for r in _steps(dsn, schema, eid)] == [(0, "kestrel.signal:" + name)]


def test_signal_committed_while_consume_waits_for_the_row_lock_is_consumed(
    pg_dsn: str, schema: str
) -> None:
    """X1: signal() in a client transaction that commits while the worker's consume waits
    on the execution's row lock. Before the fix, consume scanned the signals in its old
    snapshot, found none, returned the bumped signal_seq, and the park with it succeeded:
    parked for ever with the signal pending."""
    qs = queries(schema)
    eid = uuid.UUID(str(q1(pg_dsn, schema, "SELECT {s}.submit('rx_x1_waiter', '[]'::jsonb)")))

    async def signal(conn: psycopg.AsyncConnection[Any], _: dict[uuid.UUID, Claimed]) -> None:
        await conn.execute(qs.signal, {"id": eid, "name": "approval", "payload": "{}",
                                       "idempotency_key": None})

    taken, parked = _consume_while_a_transaction_commits(pg_dsn, schema, waiter=eid,
                                                         name="approval", send=signal)
    _assert_never_parked_with_its_signal_pending(pg_dsn, schema, eid, "approval", taken,
                                                 parked)


def test_child_completion_committed_while_parent_consume_waits_is_consumed(
    pg_dsn: str, schema: str
) -> None:
    """X1, the child's side: a child's completion tells its waiting parent (a signal and a
    bump of the parent's signal_seq) in a transaction that commits while the parent's
    consume waits on the parent row's lock."""
    qs = queries(schema)
    parent = uuid.uuid4()
    q(pg_dsn, schema, "SELECT {s}.submit('rx_x1_parent', '[]'::jsonb, 'default', 0, NULL, %s)",
      [parent])
    child = uuid.UUID(str(q1(pg_dsn, schema, "SELECT {s}.submit('rx_x1_child', '[]'::jsonb, "
                             "'default', 0, NULL, NULL, %s)", [parent])))

    async def complete(conn: psycopg.AsyncConnection[Any],
                       claimed: dict[uuid.UUID, Claimed]) -> None:
        done = await db.run(conn, statements.executions.complete_batch(qs, [
            Finish(child, claimed[child].epoch, Status.COMPLETED, "7", None)]))
        assert done == {child}

    name = f"kestrel.child:{child}"
    taken, parked = _consume_while_a_transaction_commits(pg_dsn, schema, waiter=parent,
                                                         name=name, send=complete)
    _assert_never_parked_with_its_signal_pending(pg_dsn, schema, parent, name, taken, parked)
    assert taken.output["payload"]["status"] == "completed"
    assert taken.output["payload"]["result"] == 7


# -- X2: cancel() racing a durable sleep ------------------------------------------------------


@kestrel.step(name="rx_x2_one")
async def _x2_one() -> int:
    return 1


@kestrel.workflow(name="rx_x2_cancel_then_sleep")
async def _x2_cancel_then_sleep(ctx: kestrel.Context, dsn: str, schema: str) -> int:
    await ctx.step(_x2_one)
    # patched() writes its marker at once, and the step's checkpoint, held back until the
    # next call (issue 23, item 3), before it: both are committed here, and nothing is
    # written between the cancel below and the park.
    await ctx.patched("rx_x2")
    # A client cancels after the last checkpoint and before the park: the park meets it.
    if ctx.attempt == 1:
        q(dsn, schema, "SELECT {s}.cancel(%s)", [ctx.execution_id])
    await ctx.sleep(60)
    return 2


def test_cancel_racing_a_durable_sleep_cancels_at_once(pg_dsn: str, schema: str) -> None:
    """X2: the park meets a cancel request. Before the fix the park simply failed, the
    worker took that for a lost lease and dropped the execution, which stayed running until
    its lease expired and the sweeper requeued it (one more attempt)."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_x2_cancel_then_sleep, pg_dsn, schema)
    # A long lease and rare heartbeats: neither the sweeper nor a heartbeat's cancel flag can
    # finish it within the test; only the park's own answer can.
    cfg = config(schema, lease=60, heartbeat=20)
    t0 = time.monotonic()
    worker = run_worker_until(
        pg_dsn, cfg, lambda: finished_count(pg_dsn, schema) == 1 or time.monotonic() > t0 + 8)
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.CANCELLED, (
        f"status {ex.status.value} (attempts {ex.attempts}); leases lost: {worker.stats.lost}")
    assert ex.attempts == 1
    assert worker.stats.lost == 0
    assert [r[:2] for r in _steps(pg_dsn, schema, h.id)] == [(-1, "kestrel.patch:rx_x2"),
                                                             (0, "rx_x2_one")]


# -- X3: no deadlocks between heartbeats, checkpoint batches and completions -----------------


def test_heartbeats_checkpoints_and_completions_never_deadlock(pg_dsn: str, schema: str) -> None:
    """X3: every multi-row statement locks execution rows in one global order. Heartbeats of
    shuffled (id, epoch) lists race checkpoint batches (shuffled) and completions of
    children and parents (a child's completion also locks its parent) over the same rows,
    in two threads for a few seconds: no DeadlockDetected. Before the fix each statement
    locked in its input's order and they deadlocked."""
    qs = queries(schema)
    held: dict[uuid.UUID, int] = {}
    lock = threading.Lock()
    stop = threading.Event()
    deadlocks: list[str] = []
    rounds = {"heartbeat": 0, "checkpoint": 0, "completion": 0}

    async def add_families(conn: psycopg.AsyncConnection[Any], n: int) -> None:
        """*n* parents with three children each, all claimed by this "process"."""
        parents = [uuid.uuid4() for _ in range(n)]
        await conn.execute(pgsql.SQL(
            "SELECT {s}.submit('rx_x3', '[]'::jsonb, 'default', 0, NULL, p) "
            "FROM unnest(%s::uuid[]) AS p").format(s=pgsql.Identifier(schema)), [parents])
        await conn.execute(pgsql.SQL(
            "SELECT {s}.submit('rx_x3', '[]'::jsonb, 'default', 0, NULL, NULL, p) "
            "FROM unnest(%s::uuid[]) AS p, generate_series(1, 3)").format(
                s=pgsql.Identifier(schema)), [parents])
        for c in await db.run(
            conn,
            statements.executions.claim_batch(
                qs, owner="x3", queues=["default"], limit=4 * n, lease_s=300
            ),
        ):
            with lock:
                held[c.id] = c.epoch

    def heartbeats() -> None:
        rng = random.Random(1)
        with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                with lock:
                    pairs = list(held.items())
                rng.shuffle(pairs)
                try:
                    db.run_script_sync(conn, statements.executions.heartbeat(
                        qs, owner="x3", held=pairs, lease_s=300))
                except psycopg.errors.DeadlockDetected as exc:
                    deadlocks.append(f"heartbeat: {exc}")
                rounds["heartbeat"] += 1

    async def writes() -> None:
        rng = random.Random(2)
        step = 0
        async with await _connect(pg_dsn) as conn:
            await add_families(conn, 20)
            while not stop.is_set():
                with lock:
                    pairs = list(held.items())
                rng.shuffle(pairs)
                step += 1
                try:
                    await db.run(conn, statements.steps.save_steps(qs, [
                        StepWrite(i, e, step, "rx_x3_step", "1", None, 1, 0.0)
                        for i, e in pairs[: len(pairs) * 2 // 3]]))
                    rounds["checkpoint"] += 1
                    if step % 4 == 0:
                        done = pairs[: rng.randint(4, 12)]
                        await db.run(conn, statements.executions.complete_batch(qs, [
                            Finish(i, e, Status.COMPLETED, "1", None) for i, e in done]))
                        rounds["completion"] += 1
                        with lock:
                            for i, _ in done:
                                held.pop(i, None)
                        await add_families(conn, 3)
                except psycopg.errors.DeadlockDetected as exc:
                    deadlocks.append(f"checkpoint/completion: {exc}")

    beat = threading.Thread(target=heartbeats)
    write = threading.Thread(target=lambda: asyncio.run(writes()))
    write.start()
    wait_until(lambda: held, timeout=10, what="the first claims")
    beat.start()
    time.sleep(6)
    stop.set()
    beat.join(30)
    write.join(30)
    assert rounds["heartbeat"] > 10 and rounds["checkpoint"] > 10 and rounds["completion"] > 2
    assert deadlocks == [], f"{len(deadlocks)} deadlocks in {rounds}: {deadlocks[:2]}"


# -- X4: a lost reply to park or completion -----------------------------------------------------


@kestrel.step(name="rx_x4_add")
async def _x4_add(n: int) -> int:
    return n + 1


@kestrel.workflow(name="rx_x4_sleeper")
async def _x4_sleeper(ctx: kestrel.Context, n: int) -> int:
    a = await ctx.step(_x4_add, n)
    await ctx.sleep(0.3)
    return int(await ctx.step(_x4_add, a))


@pytest.mark.parametrize("point", ["after_park_commit", "after_complete_commit"])
def test_a_lost_reply_to_park_or_completion_is_read_back(
    pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """X4: the park (or the completion) commits and its reply is lost (the failpoint raises
    what a dropped connection raises). The retry finds its own committed write: the runtime
    reports neither a lost lease nor a fenced write, and the execution completes normally.
    Before the fix the park retry found the row waiting and reported a lost lease; the
    completion retry found nothing to finish and reported a fenced write."""
    _inject(monkeypatch, point)
    lost, fenced = (_metric("kestrel_leases_lost_total"),
                    _metric("kestrel_fenced_writes_total", kind="completion"))
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_x4_sleeper, 5)
    worker = run_worker_until(pg_dsn, config(schema),
                              lambda: finished_count(pg_dsn, schema) == 1)
    assert h.result(timeout=1) == 7
    assert failpoints._FAILPOINTS[point][2] == 0, "the failpoint never fired"
    assert (worker.stats.lost, worker.stats.fenced) == (0, 0)
    assert (worker.stats.parked, worker.stats.completed) == (1, 1)
    assert _metric("kestrel_leases_lost_total") == lost
    assert _metric("kestrel_fenced_writes_total", kind="completion") == fenced
    assert client.get(h.id).status is kestrel.Status.COMPLETED


# -- X5: a re-claim of the same execution inside one process ---------------------------------


@kestrel.step(name="rx_x5_slow")
async def _x5_slow(dsn: str, schema: str) -> str:
    info = kestrel.current_step()
    ledger("start")
    if info.lease_epoch == 1:
        # As if this process stalled past its lease: the sweeper requeues the execution and
        # this same process claims it again (epoch 2) while this body still runs.
        q(dsn, schema, "UPDATE {s}.workflow_executions SET status = 'queued', "
          "lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", [info.execution_id])
        await asyncio.sleep(3)
    ledger()
    return f"slow@{info.lease_epoch}"


@kestrel.step(name="rx_x5_after")
async def _x5_after() -> str:
    ledger()
    return f"after@{kestrel.current_step().lease_epoch}"


@kestrel.workflow(name="rx_x5")
async def _x5(ctx: kestrel.Context, dsn: str, schema: str) -> list[str]:
    return [await ctx.step(_x5_slow, dsn, schema), await ctx.step(_x5_after)]


def test_a_reclaim_by_the_same_process_cancels_the_stale_coroutine(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    """X5: inside a process an execution is (id, epoch). When this process claims an
    execution again under a newer epoch while the old coroutine still runs, the old one
    loses its lease at once: its body is cancelled and it never runs another step. Before
    the fix the held map was keyed by id: the new claim replaced the old entry, the stale
    coroutine kept asking "is (id) trusted?" of the new claim and ran on beside it."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_x5, pg_dsn, schema)
    # Rare heartbeats: the re-claim itself, not a heartbeat, must retire the old coroutine.
    cfg = config(schema, lease=30, heartbeat=10)
    t0 = time.monotonic()
    # Past the stale body's 3 s sleep, so a stale coroutine that was not cancelled shows.
    worker = run_worker_until(pg_dsn, cfg, lambda: finished_count(pg_dsn, schema) == 1
                              and time.monotonic() > t0 + 5)
    assert h.result(timeout=1) == ["slow@2", "after@2"]
    entries = [(e["name"], e["kind"], e["epoch"]) for e in read_ledger(ledger_path)]
    assert ("rx_x5_slow", "start", 1) in entries  # the stale body did start
    stale = [e for e in entries if e[2] == 1 and e[1] == "body"]
    assert stale == [], f"the stale coroutine ran on after the re-claim: {entries}"
    assert sorted(entries) == sorted([("rx_x5_slow", "start", 1), ("rx_x5_slow", "start", 2),
                                      ("rx_x5_slow", "body", 2), ("rx_x5_after", "body", 2)])
    assert [r[2] for r in _steps(pg_dsn, schema, h.id)] == [2, 2]
    assert worker.stats.claimed == 2 and worker.stats.completed == 1


# -- X6: a deadline firing while the completion is queued ----------------------------------


@kestrel.step(name="rx_x6_work")
async def _x6_work(until: str) -> str:
    await asyncio.sleep(max(0.0, (datetime.fromisoformat(until) - datetime.now(UTC))
                            .total_seconds()))
    return "done"


@kestrel.workflow(name="rx_x6")
async def _x6(ctx: kestrel.Context, until: str) -> str:
    return str(await ctx.step(_x6_work, until))


def test_a_deadline_firing_while_the_completion_is_queued_does_not_undo_it(
    pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X6: the completed result wins. A first completion hangs in its flush (failpoint
    before_complete=hang(4)); a second execution finishes its work, queues its completion
    behind it, and its deadline passes while it waits. Before the fix the deadline cancelled
    the queued completion and the execution ended DeadlineExceeded (once its lease ran out)
    although its work had completed."""
    _inject(monkeypatch, "before_complete=hang(4)")
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    # On the database clock (the test's clock too: one host, no offset), with t0 = now:
    # first completes at t0+3.5 and its flush hangs until t0+7.5; late completes at t0+4.5,
    # queued behind it; late's deadline is t0+6 (and a little).
    t0 = q1(pg_dsn, schema, "SELECT {s}.kestrel_now()")
    first = client.submit(_x6, (t0 + timedelta(seconds=3.5)).isoformat())
    late = client.submit(_x6, (t0 + timedelta(seconds=4.5)).isoformat(), timeout=6.0)
    deadline = q1(pg_dsn, schema, "SELECT deadline FROM {s}.workflow_executions WHERE id = %s",
                  [late.id])
    # A long lease: the lease watchdog must not give up on the hanging writer meanwhile.
    worker = run_worker_until(pg_dsn, config(schema, lease=20, heartbeat=1),
                              lambda: finished_count(pg_dsn, schema) == 2, timeout=40)
    assert first.result(timeout=1) == "done"
    # The interleaving happened: the work was recorded before the deadline, the completion
    # after it.
    step_done = q1(pg_dsn, schema, "SELECT finished_at FROM {s}.step_history "
                   "WHERE execution_id = %s", [late.id])
    finished = q1(pg_dsn, schema, "SELECT finished_at FROM {s}.workflow_history WHERE id = %s",
                  [late.id])
    assert step_done < deadline < finished, "the deadline did not fall while it was queued"
    ex = client.get(late.id)
    assert ex.status is kestrel.Status.COMPLETED, f"{ex.status.value}: {ex.error}"
    assert late.result(timeout=1) == "done"
    assert worker.stats.completed == 2 and worker.stats.lost == 0


# -- bug 12: sleep_until measured from the claim ---------------------------------------------


@kestrel.step(name="rx_sleep_until_work")
async def _work_a_while(seconds: float) -> None:
    await asyncio.sleep(seconds)


@kestrel.workflow(name="rx_sleep_until")
async def _sleep_until(ctx: kestrel.Context, when: str) -> str:
    await ctx.step(_work_a_while, 1.5)
    await ctx.sleep_until(datetime.fromisoformat(when))
    return "woke"


def test_sleep_until_after_work_wakes_at_the_given_instant(pg_dsn: str, schema: str) -> None:
    """Bug 12: sleep_until(t) after 1.5 s of work since the claim. Before the fix the
    remaining time was measured from the claim's database time, so the row woke 1.5 s
    after t."""
    now = q1(pg_dsn, schema, "SELECT {s}.kestrel_now()")
    when = now + timedelta(seconds=20)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_sleep_until, when.isoformat())
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(h.id).status is kestrel.Status.WAITING)
    wake_at = q1(pg_dsn, schema, "SELECT wake_at FROM {s}.workflow_executions WHERE id = %s",
                 [h.id])
    off = (wake_at - when).total_seconds()
    assert abs(off) < 0.5, f"wake_at is {off:+.3f}s from the instant asked for"
