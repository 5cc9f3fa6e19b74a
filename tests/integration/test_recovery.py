"""Real kestrel-runtime processes: scale, SIGKILL mid-step, zombies, poison executions."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import psycopg

import kestrel
from kestrel import connections, db, statements
from kestrel.client import SyncClient
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite
from tests.apps import ledger_app as app
from tests.helpers import (
    alive,
    finished_count,
    kill,
    q,
    q1,
    runtime,
    submit_many,
    wait_until,
    worker_pids,
)


def test_1000_workflows_3_steps_exactly_one_checkpoint_each(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 1000)
    with runtime(pg_dsn, schema, procs=2, args=["--concurrency", "64"],
                 log=tmp_path / "runtime.log"):
        wait_until(lambda: finished_count(pg_dsn, schema) == 1000, timeout=120,
                   what="1000 executions to finish")
    per_step = q(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps "
                 "GROUP BY execution_id, step_id")
    assert len(per_step) == 3000 and all(r[0] == 1 for r in per_step)
    wrong = q(pg_dsn, schema, "SELECT id, args, result FROM {s}.workflow_history "
              "WHERE status <> 'completed' OR result <> to_jsonb((args->>0)::int * 30 + 3)")
    assert wrong == []
    assert len(app.read_ledger(ledger_path)) == 3000
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0


def test_sigkill_mid_step_resumes_elsewhere_without_rerunning_finished_steps(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.slow_middle, 4, 1.5)
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "runtime.log"):
        started = wait_until(
            lambda: [e for e in app.read_ledger(ledger_path) if e["kind"] == "start"],
            timeout=20, what="the slow step body to start")
        victim = started[0]["pid"]
        epoch_before = started[0]["epoch"]
        kill(victim, signal.SIGKILL)  # the body is inside its sleep: mid-step
        assert h.result(timeout=30) == app.model(4)
    entries = app.read_ledger(ledger_path)
    by_step: dict[int, list[dict[str, object]]] = {}
    for e in entries:
        if e["kind"] == "body":
            by_step.setdefault(int(e["step_id"]), []).append(e)
    assert len(by_step[0]) == 1  # recorded before the kill: never rerun
    assert len(by_step[1]) == 1  # the killed run never finished its body; the rerun did
    assert by_step[1][0]["pid"] != victim
    starts = [e for e in entries if e["kind"] == "start"]
    assert len(starts) == 2  # B(s) <= 1 + k with k = 1
    assert len(by_step[2]) == 1
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps "
              "WHERE execution_id = %s AND step_id = 1", [h.id]) == 1
    ex = client.get(h.id)
    assert ex.lease_epoch == epoch_before + 1 and ex.attempts == 2


def test_killed_worker_is_restarted_by_the_supervisor(pg_dsn: str, schema: str) -> None:
    with runtime(pg_dsn, schema, procs=2) as proc:
        first = wait_until(lambda: len(worker_pids(proc.pid)) == 2 and worker_pids(proc.pid),
                           timeout=20, what="two workers")
        kill(first[0], signal.SIGKILL)
        after = wait_until(
            lambda: (p := worker_pids(proc.pid)) and len(p) == 2 and first[0] not in p and p,
            timeout=20, what="a replacement worker")
        assert first[1] in after
        submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 50)
        wait_until(lambda: finished_count(pg_dsn, schema) == 50, timeout=30,
                   what="work after the restart")


def test_poison_execution_is_quarantined_after_max_attempts(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.poison)
    healthy = [client.submit(app.three_steps, n) for n in range(10)]
    with runtime(pg_dsn, schema, procs=2, args=["--max-attempts", "3"],
                 log=tmp_path / "runtime.log"):
        for n, other in enumerate(healthy):
            assert other.result(timeout=60) == app.model(n)
        wait_until(lambda: client.get(h.id).status is kestrel.Status.QUARANTINED,
                   timeout=60, what="quarantine")
    ex = client.get(h.id)
    assert ex.attempts == 3
    assert ex.error is not None and "max_attempts = 3" in ex.error["message"]
    assert len([e for e in app.read_ledger(ledger_path) if e["name"] == "die"]) == 3


def test_zombie_writes_with_a_stale_epoch_change_nothing(pg_dsn: str, schema: str) -> None:
    """A worker that lost its lease (frozen, partitioned) and wakes up is fenced everywhere."""
    qs = queries(schema)
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit(app.three_steps, 1)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            connections.configure_connection(conn)
            (zombie,) = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="zombie", queues=["default"], limit=10, lease_s=1
                ),
            )
            # The zombie freezes; the database clock passes its lease; the sweeper requeues;
            # a healthy worker claims under the next epoch.
            await conn.execute(f'UPDATE "{schema}".clock_offset SET offset_by = \'1 minute\'')
            swept = await db.run(
                conn, statements.sweeper.reenqueue_expired(qs, limit=10, max_attempts=5)
            )
            assert swept.requeued == 1
            (fresh,) = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="healthy", queues=["default"], limit=10, lease_s=30
                ),
            )
            assert fresh.epoch == zombie.epoch + 1
            write = StepWrite(h.id, zombie.epoch, 0, "add", "999", None, 1, 0.0)
            (saved,) = await db.run(conn, statements.steps.save_steps(qs, [write]))
            assert not saved.owned and not saved.inserted
            assert (
                await db.run_script(
                    conn,
                    statements.executions.heartbeat(qs, owner="zombie",
                                                    held=[(h.id, zombie.epoch)], lease_s=30),
                )
            ).owned == {}
            done = await db.run(
                conn,
                statements.executions.complete_batch(
                    qs, [Finish(h.id, zombie.epoch, Status.COMPLETED, "1", None)]
                ),
            )
            assert done == set()
            assert (
                await db.run(
                    conn, statements.executions.release_batch(qs, held=[(h.id, zombie.epoch)])
                )
                == set()
            )
            # The owner of the current epoch is unaffected.
            assert (await db.run_script(
                conn, statements.executions.heartbeat(qs, owner="healthy",
                                                      held=[(h.id, fresh.epoch)], lease_s=30)
            )).owned == {h.id: False}

    asyncio.run(main())
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps") == 0
    assert q(pg_dsn, schema, "SELECT status, lease_owner FROM {s}.workflow_executions") == [
        ("running", "healthy")]


def test_first_committed_checkpoint_wins_and_is_returned(pg_dsn: str, schema: str) -> None:
    """A retried write of a recorded step (lost ack) returns the stored output unchanged."""
    qs = queries(schema)
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit(app.three_steps, 1)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            connections.configure_connection(conn)
            (c,) = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=1, lease_s=30
                ),
            )
            (first,) = await db.run(
                conn,
                statements.steps.save_steps(
                    qs, [StepWrite(h.id, c.epoch, 0, "add", "10", None, 1, 0.0)]
                ),
            )
            assert first.owned and first.inserted and first.recorded is None
            (again,) = await db.run(
                conn,
                statements.steps.save_steps(
                    qs, [StepWrite(h.id, c.epoch, 0, "add", "77", None, 1, 0.0)]
                ),
            )
            assert again.owned and not again.inserted and again.recorded.output == 10

    asyncio.run(main())
    assert q1(pg_dsn, schema, "SELECT output FROM {s}.workflow_steps") == 10


def test_sigterm_drains_and_releases_unfinished_work_at_once(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.slow_middle, 2, 30.0)  # cannot finish within the drain timeout
    with runtime(pg_dsn, schema, procs=1, args=["--drain-timeout", "1", "--lease", "60",
                                                "--heartbeat", "5"],
                 log=tmp_path / "runtime.log") as proc:
        wait_until(lambda: any(e["kind"] == "start" for e in app.read_ledger(ledger_path)),
                   timeout=20, what="the slow step to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    # Released, not left to a 60 s lease: queued again right away, claim not counted.
    got = q(pg_dsn, schema, "SELECT status, lease_owner, attempts FROM {s}.workflow_executions")
    assert got == [("queued", None, 0)]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps WHERE "
              "execution_id = %s", [h.id]) == 1  # step 0 stays recorded
    # Another runtime finishes it at once, far sooner than the 60 s lease would have allowed.
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET args = '[2, 0.1]'")
    started = time.monotonic()
    with runtime(pg_dsn, schema, procs=1, args=["--lease", "60", "--heartbeat", "5"],
                 log=tmp_path / "runtime2.log"):
        assert client.result(h.id, timeout=30) == app.model(2)
    assert time.monotonic() - started < 20
    steps = [e["step_id"] for e in app.read_ledger(ledger_path) if e["kind"] == "body"]
    assert steps.count(0) == 1  # the recorded step was replayed, not rerun


def test_sigkill_of_the_supervisor_stops_its_children_and_work_resumes(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.slow_middle, 9, 3.0)
    with runtime(pg_dsn, schema, procs=3, log=tmp_path / "rt.log") as proc:
        children = wait_until(lambda: len(worker_pids(proc.pid)) == 3 and worker_pids(proc.pid),
                              timeout=20, what="three workers")
        wait_until(lambda: any(e["kind"] == "start" for e in app.read_ledger(ledger_path)),
                   timeout=20, what="the slow step")
        kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_until(lambda: not any(alive(p) for p in children), timeout=5,
                   what="orphaned workers to exit")
    assert q1(pg_dsn, schema, "SELECT status FROM {s}.workflow_executions") in ("queued",
                                                                              "running")
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "rt2.log"):
        assert h.result(timeout=30) == app.model(9)


def test_more_procs_than_cores_completes_5000_workflows(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    assert (os.cpu_count() or 1) < 8
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 5000)
    with runtime(pg_dsn, schema, procs=8, args=["--concurrency", "32"],
                 log=tmp_path / "rt.log") as proc:
        wait_until(lambda: len(worker_pids(proc.pid)) == 8, timeout=30, what="eight workers")
        wait_until(lambda: finished_count(pg_dsn, schema) == 5000, timeout=300, interval=0.5,
                   what="5000 executions")
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history WHERE status <> "
              "'completed' OR result <> to_jsonb((args->>0)::int * 30 + 3)") == 0
