"""Durable waits, signals, events, cancellation, retry, fork and child workflows."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import psycopg
import pytest

import kestrel
from kestrel.client import Client, SyncClient
from kestrel.testing import KestrelTestEnv
from tests.apps import ledger_app as app
from tests.helpers import (
    config,
    finished_count,
    q,
    q1,
    run_worker_until,
    runtime,
    submit_many,
    wait_until,
)


def status_of(client: SyncClient, eid: object) -> str:
    return client.get(str(eid)).status.value


def test_wait_for_signal_parks_as_a_row_and_wakes_on_signal(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.approval, 3)
    with runtime(pg_dsn, schema, procs=1, log=tmp_path / "rt.log"):
        wait_until(lambda: status_of(client, h.id) == "waiting", timeout=20, what="the park")
        row = q(pg_dsn, schema, "SELECT lease_owner, lease_expires_at, waiting_for "
                "FROM {s}.workflow_executions")
        assert row == [(None, None, "approve")]
        assert client.signal(h.id, "approve", {"by": "alice"}) is True
        assert h.result(timeout=20) == {"pre": 30, "payload": {"by": "alice"}, "post": 32}
    # The step before the wait ran once: the wake-up replayed it from its checkpoint.
    assert [e["step_id"] for e in app.read_ledger(ledger_path)] == [0, 2]


def test_signal_sent_before_the_wait_is_not_lost(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.approval, 1)
    assert client.signal(h.id, "approve", "early") is True  # before any worker runs
    worker = run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema))
    assert h.result(timeout=1)["payload"] == "early"
    assert worker.stats.parked == 0


def test_each_signal_is_consumed_once_and_keys_count_once(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    first, second = client.submit(app.waiter), client.submit(app.waiter)
    assert client.signal(first.id, "go", 1, idempotency_key="k") is True
    assert client.signal(first.id, "go", 2, idempotency_key="k") is False  # counted once
    assert client.signal(first.id, "go", 3) is True  # a second distinct signal stays pending
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) >= 1)
    assert first.result(timeout=1) == 1
    # They left the hot table with the finished execution (migration 0013).
    assert q(pg_dsn, schema, "SELECT count(*) FROM {s}.signals") == [(0,)]
    assert q(pg_dsn, schema, "SELECT payload, consumed_step FROM {s}.signal_history "
             "ORDER BY id") == [(1, 0), (3, None)]
    assert status_of(client, second.id) == "waiting"


def test_signal_errors_are_typed(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with pytest.raises(kestrel.ExecutionNotFound):
        client.signal("00000000-0000-0000-0000-000000000000", "go")
    h = client.submit(app.quick, 1)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    with pytest.raises(kestrel.InvalidState):
        client.signal(h.id, "go")


def test_wait_timeout_returns_a_result_not_an_exception(kestrel_env: KestrelTestEnv) -> None:
    # An hour's timeout, passed by moving the database clock (kestrel.testing): run until
    # it waits, move the clock past the timeout the wait reports, run to the end.
    handle = kestrel_env.client.submit(app.wait_with_timeout, 3600)
    waiting = kestrel_env.run_until_waiting(handle)
    assert waiting.signal == "never" and waiting.seconds_left is not None
    assert 3500 < waiting.seconds_left <= 3600
    kestrel_env.advance_clock(waiting.seconds_left + 1)
    run = kestrel_env.run_until_finished(handle)
    assert run.assert_completed() == {"timed_out": True, "payload": None}
    assert run.timeline == [("kestrel.signal:never", 1, "ok")]


def test_sleep_never_wakes_early_by_the_database_clock(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.sleeper, 2, 3600)  # an hour
    run_worker_until(pg_dsn, config(schema),
                     lambda: status_of(client, h.id) == "waiting")
    wake_at = q1(pg_dsn, schema, "SELECT wake_at FROM {s}.workflow_executions")
    # 59 minutes later by the database clock: still asleep, nobody may claim it.
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '59 minutes'")
    worker = run_worker_until(pg_dsn, config(schema), lambda: True, timeout=5)
    assert worker.stats.claimed == 0 and status_of(client, h.id) == "waiting"
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '61 minutes'")
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    assert h.result(timeout=1) == app.model_step(2, 0) + app.model_step(2, 1)
    resumed = q1(pg_dsn, schema, "SELECT started_at + (SELECT offset_by FROM {s}.clock_offset)"
                 " FROM {s}.workflow_steps WHERE step_id = 2")
    assert resumed >= wake_at


def test_sleep_survives_a_kill_of_every_process(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.sleeper, 5, 3)
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "rt.log") as proc:
        wait_until(lambda: status_of(client, h.id) == "waiting", timeout=20, what="the sleep")
        os.killpg(proc.pid, signal.SIGKILL)  # supervisor and workers, no drain
        proc.wait()
    assert status_of(client, h.id) == "waiting"
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "rt2.log"):
        assert h.result(timeout=30) == app.model_step(5, 0) + app.model_step(5, 1)
    slept = q1(pg_dsn, schema, "SELECT extract(epoch FROM b.started_at - a.finished_at) FROM "
               "{s}.workflow_steps a, {s}.workflow_steps b WHERE a.step_id = 0 AND "
               "b.step_id = 2")
    assert slept >= 3
    assert len(app.read_ledger(ledger_path)) == 2  # step 0 never re-ran after the kill


def test_10000_executions_wait_on_signals_without_leases(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    submit_many(pg_dsn, schema, "waiter", "'[]'::jsonb", 10_000)
    with runtime(pg_dsn, schema, procs=1, args=["--concurrency", "8", "--batch-size", "8"],
                 log=tmp_path / "rt.log"):
        wait_until(lambda: q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
                              "WHERE status = 'waiting'") == 10_000,
                   timeout=240, interval=0.5, what="10,000 parked executions")
        held = q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
                  "WHERE lease_owner IS NOT NULL OR lease_expires_at IS NOT NULL")
        assert held == 0
        q(pg_dsn, schema, "SELECT {s}.signal(id, 'go', to_jsonb(id::text)) "
          "FROM {s}.workflow_executions")
        wait_until(lambda: finished_count(pg_dsn, schema) == 10_000, timeout=300,
                   interval=0.5, what="10,000 signalled executions to finish")
    wrong = q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history "
               "WHERE status <> 'completed' OR result <> to_jsonb(id::text)")
    assert wrong == 0


def test_events_are_readable_while_running(pg_dsn: str, schema: str, tmp_path: Path) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.progress)
    with runtime(pg_dsn, schema, procs=1, log=tmp_path / "rt.log"):
        assert client.get_event(h.id, "stage", timeout=20) == "analyzing"
        with pytest.raises(TimeoutError):
            client.get_event(h.id, "missing", timeout=0.3)
        client.signal(h.id, "go")
        assert h.result(timeout=20) == "done"
    aclient = Client(pg_dsn, schema=schema, pool_size=0)
    assert asyncio.run(aclient.get_event(h.id, "stage", 1)) == "fixing"


def test_cancel_queued_waiting_and_running(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    queued = client.submit(app.quick, 1, queue="nobody-claims-this")
    assert client.cancel(queued.id) == "cancelled"
    waiting = client.submit(app.waiter)
    running = client.submit(app.slow_middle, 1, 2.0)
    with runtime(pg_dsn, schema, procs=1, args=["--heartbeat", "0.2"],
                 log=tmp_path / "rt.log"):
        wait_until(lambda: status_of(client, waiting.id) == "waiting", timeout=20,
                   what="the wait")
        assert client.cancel(waiting.id) == "cancelled"
        wait_until(lambda: any(e["kind"] == "start" for e in app.read_ledger(ledger_path)),
                   timeout=20, what="the slow step")
        assert client.cancel(running.id) == "cancelling"
        wait_until(lambda: status_of(client, running.id) == "cancelled", timeout=20,
                   what="the running execution to stop")
    # It stopped at the step boundary: the slow step's checkpoint was refused, step 2 never ran.
    assert q1(pg_dsn, schema, "SELECT max(step_id) FROM {s}.workflow_steps "
              "WHERE execution_id = %s", [running.id]) == 0
    assert client.cancel(running.id) == "cancelled"  # idempotent
    with pytest.raises(kestrel.WorkflowFailed):
        waiting.result(timeout=1)


def test_cancel_racing_completion_has_exactly_one_terminal_state(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    rng = random.Random(7)
    outcomes = []
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "rt.log"):
        for n in range(150):
            h = client.submit(app.quick, n)
            import time

            time.sleep(rng.choice([0, 0, 0.001, 0.005, 0.02]))
            outcomes.append((h, n, client.cancel(h.id)))
        wait_until(lambda: finished_count(pg_dsn, schema) == 150, timeout=60,
                   what="every execution to end")
    rows = {r[0]: r[1:] for r in q(pg_dsn, schema,
                                   "SELECT id, status, result FROM {s}.workflow_history")}
    assert len(rows) == 150
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0
    said = {"cancelled": 0, "cancelling": 0, "completed": 0}
    for h, n, answer in outcomes:
        status, result = rows[h.id]
        said[answer] += 1
        if answer in ("cancelled", "completed"):
            assert status == answer
        assert status in ("cancelled", "completed")
        assert (result == app.model_step(n, 0)) if status == "completed" else result is None
    assert said["cancelled"] > 0 and said["completed"] + said["cancelling"] > 0


def test_cancelling_a_parent_cancels_its_children(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.parent_of_waiter)
    run_worker_until(pg_dsn, config(schema), lambda: q1(
        pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
        "WHERE status = 'waiting'") == 2)
    assert client.cancel(h.id) == "cancelled"
    assert q(pg_dsn, schema, "SELECT status, count(*) FROM {s}.workflow_history "
             "GROUP BY 1") == [("cancelled", 2)]


def test_retry_resumes_a_failed_execution_from_its_last_checkpoint(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.flaky_wf, "retry-me", 10)  # fails: 4 attempts < 10 failures
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    assert status_of(client, h.id) == "failed"
    with pytest.raises(kestrel.InvalidState):
        client.retry(client.submit(app.quick, 1).id)  # live executions can't be retried
    app._failures["retry-me"] = 100  # the downstream dependency recovered
    client.retry(h.id)
    run_worker_until(pg_dsn, config(schema), lambda: status_of(client, h.id) == "completed")
    assert h.result(timeout=1) == "ok after 101"
    with pytest.raises(kestrel.ExecutionNotFound):
        client.retry("00000000-0000-0000-0000-000000000000")


def test_fork_reuses_the_first_k_checkpoints(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 4)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    forked = client.fork(h.id, 2)
    assert forked.id != h.id
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
    assert forked.result(timeout=1) == app.model(4)
    runs = [e for e in app.read_ledger(ledger_path) if e["execution_id"] == str(forked.id)]
    assert [e["step_id"] for e in runs] == [2]


def test_child_workflow_result_and_exactly_once_start_across_replays(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    simple = client.submit(app.parent, 6)
    replaying = client.submit(app.replaying_parent, 8)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 4)
    assert simple.result(timeout=1) == app.model(6)
    assert replaying.result(timeout=1) == app.model(8)
    children = q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history "
                  "WHERE parent_id = %s", [replaying.id])
    assert children == 1
    # Three parks and wake-ups: the parent was claimed four times, replaying start_child.
    assert q1(pg_dsn, schema, "SELECT lease_epoch FROM {s}.workflow_history WHERE id = %s",
              [replaying.id]) >= 4


def test_now_random_uuid_replay_identically(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.deterministic)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    runs = app.seen_values[str(h.id)]
    assert len(runs) == 2 and runs[0] == runs[1]
    assert h.result(timeout=1) == runs[0]


def test_deadline_fails_running_and_waiting_executions(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    running = client.submit(app.slow_middle, 1, 30.0, timeout=1.5)
    waiting = client.submit(app.waiter, timeout=1.5)
    with pytest.raises(kestrel.ConfigError):
        client.submit(app.waiter, timeout=0)
    with runtime(pg_dsn, schema, procs=1, log=tmp_path / "rt.log"):
        wait_until(lambda: finished_count(pg_dsn, schema) == 2, timeout=20,
                   what="both deadlines")
    for h in (running, waiting):
        ex = client.get(h.id)
        assert ex.status is kestrel.Status.FAILED and ex.error is not None
        assert ex.error["type"].endswith("DeadlineExceeded")


def test_parent_and_child_finishing_in_one_statement(pg_dsn: str, schema: str) -> None:
    """A parent and its child completed (or quarantined) by the same statement: the child's
    word to its parent must not touch the parent row the statement is deleting."""
    import uuid as _uuid

    from kestrel import connections, db, statements
    from kestrel.sql import queries
    from kestrel.types import Finish, Status

    qs = queries(schema)
    parent = _uuid.uuid4()
    q(pg_dsn, schema, "SELECT {s}.submit('quick', '[1]', 'default', 0, NULL, %s)", [parent])
    q(pg_dsn, schema, "SELECT {s}.submit('quick', '[2]', 'default', 0, NULL, NULL, %s)",
      [parent])
    q(pg_dsn, schema, "SELECT {s}.submit('quick', '[3]', 'default', 0, NULL, NULL, %s)",
      [parent])

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as c:
            connections.configure_connection(c)
            claimed = await db.run(
                c,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=10, lease_s=1
                ),
            )
            assert len(claimed) == 3
            first_two = [x for x in claimed if x.id == parent][:1] + [
                x for x in claimed if x.id != parent][:1]
            done = await db.run(c, statements.executions.complete_batch(qs, [
                Finish(x.id, x.epoch, Status.COMPLETED, "1", None) for x in first_two]))
            assert len(done) == 2
            # The third (a child of a finished parent) is quarantined by a sweep.
            await c.execute(f'UPDATE "{schema}".clock_offset SET offset_by = \'1 minute\'')
            swept = await db.run(
                c, statements.sweeper.reenqueue_expired(qs, limit=10, max_attempts=1)
            )
            assert swept.quarantined == 1

    asyncio.run(main())
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history") == 3
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0
