"""Fault scenarios from FAULTS.md with real processes and a real PostgreSQL we may kill.

F3 (lost commit reply, by failpoint), D1/D2 (PostgreSQL fast and immediate restarts, the
latter with crash recovery), D3 (backends terminated, the LISTEN one included), D11 (no
kestrel backend ever idle in a transaction). F1, F2, F4, F6, F9 and I1-I6 live in
tests/integration and tests/property.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kestrel import embedded
from kestrel.client import SyncClient
from kestrel.migrate import migrate
from tests.apps import ledger_app as app
from tests.helpers import (
    audit,
    config,
    finished_count,
    metric,
    q,
    run_worker_until,
    runtime,
    submit_many,
    take_lease,
    wait_until,
    worker_pids,
)

KESTREL_BACKENDS = ("SELECT pid, application_name FROM pg_stat_activity "
                    "WHERE application_name LIKE 'kestrel-%%'")


def test_f3_lost_commit_reply_returns_the_stored_output(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 30)
    log = tmp_path / "rt.log"
    with runtime(pg_dsn, schema, procs=1, log=log,
                 env={"KESTREL_FAILPOINTS": "after_checkpoint_commit_before_ack:3"}):
        wait_until(lambda: finished_count(pg_dsn, schema) == 30, timeout=60, what="30")
    assert log.read_text().count("failpoint after_checkpoint_commit_before_ack fired") == 3
    assert audit(pg_dsn, schema, 30, ledger_path) == 0  # B(s) = 1: no body ran again


def test_d3_terminated_backends_listen_included(
    pg_dsn: str, direct_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    n = 3000
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", n)
    stop = threading.Event()
    killed: list[str] = []

    def terminator() -> None:
        rng = random.Random(3)
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            while not stop.is_set():
                rows = conn.execute(KESTREL_BACKENDS).fetchall()
                if rows:
                    pid, name = rng.choice(rows)
                    conn.execute("SELECT pg_terminate_backend(%s)", [pid])
                    killed.append(name)
                time.sleep(0.1)

    # 64 in flight per process: the bound on bodies run again below.
    args = ["--poll-interval", "3", "--concurrency", "64"]
    with runtime(pg_dsn, schema, procs=2, args=args, log=tmp_path / "rt.log"):
        t = threading.Thread(target=terminator)
        t.start()
        try:
            wait_until(lambda: finished_count(pg_dsn, schema) == n, timeout=180,
                       interval=0.5, what="every workflow while backends die")
        finally:
            stop.set()
            t.join()
        # Kill the LISTEN connections once more, then submit: the worker reconnects its
        # LISTEN (or polls), and the new execution starts within poll interval + slack.
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE application_name = 'kestrel-listen'")
        time.sleep(1.0)
        client = SyncClient(pg_dsn, schema=schema, pool_size=0)
        h = client.submit(app.three_steps, n + 1)
        client.result(h.id, timeout=10)
        ex = client.get(h.id)
        assert ex.started_at is not None
        assert (ex.started_at - ex.created_at).total_seconds() < 3 + 1.0
    assert len(killed) >= 5
    extra = audit(pg_dsn, schema, n + 1, ledger_path)
    assert extra <= 64 * len(killed)


def test_d11_no_kestrel_backend_idles_inside_a_transaction(
    pg_dsn: str, direct_dsn: str, schema: str, tmp_path: Path
) -> None:
    q(pg_dsn, schema, "SELECT {s}.submit('slow_middle', jsonb_build_array(i, 1.5)) "
      "FROM generate_series(1, 40) AS i")
    worst = 0.0
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "rt.log"), \
            psycopg.connect(direct_dsn, autocommit=True) as conn:
        while finished_count(pg_dsn, schema) < 40:
            row = conn.execute(
                "SELECT coalesce(max(extract(epoch FROM now() - state_change)), 0) "
                "FROM pg_stat_activity WHERE state LIKE 'idle in transaction%%' AND "
                "application_name LIKE 'kestrel-%%'").fetchone()
            worst = max(worst, float(row[0]))  # type: ignore[index]
            time.sleep(0.05)
    # FAULTS D11: never idle in a transaction longer than 1 s (the few multi-statement
    # transactions - limited claims, upkeep, cron ticks - never wait on user code).
    assert worst < 1.0, f"a kestrel backend sat {worst:.2f}s idle in a transaction"


@pytest.fixture
def private_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A PostgreSQL of this test's own, which it may restart or crash."""
    import shutil
    import subprocess
    import tempfile

    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    data = Path(tempfile.mkdtemp(prefix="kestrel-chaos-")) / "data"
    dsn, server = embedded.start(data)
    yield dsn, data
    server.cleanup()
    # After pg_ctl restarts pgserver no longer knows the postmaster: stop it here.
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=data, user="pgserver", timeout=60)
    except subprocess.CalledProcessError:
        pass  # already stopped
    shutil.rmtree(data.parent, ignore_errors=True)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_d1_d2_postgres_restarts_mid_run(
    private_server: tuple[str, Path], mode: str, ledger_path: Path, tmp_path: Path
) -> None:
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    dsn, data = private_server
    schema = "chaos"
    migrate(dsn, schema)
    n = 1500
    submit_many(dsn, schema, "three_steps", "jsonb_build_array(i)", n)
    log = tmp_path / "rt.log"
    restarts = 0
    # 64 in flight per process: the bound on bodies run again below.
    with runtime(dsn, schema, procs=2, log=log, args=["--concurrency", "64"]):
        wait_until(lambda: finished_count(dsn, schema) >= 100, timeout=60, what="progress")
        for _ in range(3):
            # -m immediate is a crash: the restart replays WAL (crash recovery).
            pg_ctl(["-w", "-m", mode, "restart"], pgdata=data, user="pgserver", timeout=60)
            restarts += 1
            time.sleep(1.5)

        def done() -> bool:
            try:
                return finished_count(dsn, schema) == n
            except psycopg.OperationalError:
                return False

        wait_until(done, timeout=180, interval=0.5, what="every workflow after the restarts")
    text = log.read_text()
    assert "restarting in" not in text  # workers rode it out: no crash, no restart
    extra = audit(dsn, schema, n, ledger_path)
    assert extra <= 2 * 64 * restarts


@pytest.mark.parametrize(("setting", "error"), [("lock_timeout", "LockNotAvailable"),
                                                ("statement_timeout", "QueryCanceled")])
def test_d10_lock_and_statement_timeouts_are_retried_and_nothing_crashes(
    pg_dsn: str, direct_dsn: str, schema: str, ledger_path: Path, tmp_path: Path,
    setting: str, error: str
) -> None:
    """An outside session holds ACCESS EXCLUSIVE on the hot table for 3 s while the runtime
    runs with lock_timeout (or statement_timeout) = 200 ms: its statements fail with 55P03
    (57014), are retried, and every workflow completes once the lock is gone; no worker
    dies."""
    n = 300
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", n)
    sep = "&" if "?" in direct_dsn else "?"
    dsn = f"{direct_dsn}{sep}options=-c%20{setting}%3D200"
    log = tmp_path / "rt.log"
    # 64 in flight per process: the bound on bodies run again below.
    with runtime(dsn, schema, procs=2, log=log, args=["--concurrency", "64"]):
        wait_until(lambda: finished_count(pg_dsn, schema) >= 20, timeout=30, what="progress")
        with psycopg.connect(direct_dsn) as blocker:
            blocker.execute(f'LOCK TABLE "{schema}".workflow_executions IN ACCESS EXCLUSIVE MODE')
            time.sleep(3)
            blocker.rollback()
        wait_until(lambda: finished_count(pg_dsn, schema) == n, timeout=60,
                   what="every workflow after the lock")
    text = log.read_text()
    assert error in text  # the timeout was hit and retried
    assert "restarting in" not in text and "worker crashed" not in text
    assert audit(pg_dsn, schema, n, ledger_path) <= 2 * 64


@pytest.mark.parametrize("table", ["queue_limits", "workers"])
def test_d10_a_worker_whose_start_meets_a_held_lock_waits_it_out_instead_of_dying(
    direct_dsn: str, schema: str, table: str
) -> None:
    """The worker's start (its queue limits, then its registration) meets a lock held past
    its lock_timeout: it sends the statement again until the lock is gone, then claims.
    Before, the start failed (LockNotAvailable; in CI under load, QueryCanceled from the
    registration's gauges under a 200 ms statement_timeout) and the supervisor restarted the
    worker, again and again while the lock lasted."""
    sep = "&" if "?" in direct_dsn else "?"
    dsn = f"{direct_dsn}{sep}options=-c%20lock_timeout%3D200"
    client = SyncClient(direct_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 3, queue="ai-model")
    with psycopg.connect(direct_dsn) as blocker:
        blocker.execute(f'LOCK TABLE "{schema}".{table} IN ACCESS EXCLUSIVE MODE')
        released = threading.Timer(1.5, blocker.rollback)
        released.start()
        try:
            run_worker_until(dsn, config(schema, queues=("ai-model",)),
                             lambda: finished_count(direct_dsn, schema) == 1, timeout=30)
        finally:
            released.join()
    assert client.result(h.id, timeout=5) == app.model(3)


def test_f5_sweeper_never_moves_back_what_its_owner_just_changed(
    pg_dsn: str, direct_dsn: str, schema: str
) -> None:
    """River #1302: a sweeper acting on a stale read. Ours is one statement whose FOR UPDATE
    SKIP LOCKED re-checks the newest row version, so a row the owner is completing, parking
    or that another worker re-claimed is left alone. (The lease itself is the process's row,
    migration 0026, and one that ran out is never extended: no beat can race the sweep.)"""
    import asyncio

    from kestrel import connections, db, statements
    from kestrel.sql import queries

    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ids = [client.submit(app.three_steps, n).id for n in range(3)]

    async def main() -> None:
        take_lease(direct_dsn, schema, "w", 1)
        take_lease(direct_dsn, schema, "w2", 60)
        async with await psycopg.AsyncConnection.connect(direct_dsn, autocommit=True) as c:
            connections.configure_connection(c)
            claimed = await db.run(
                c,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=3, lease_s=1
                ),
            )
            assert {x.id for x in claimed} == set(ids)
            await c.execute(f'UPDATE "{schema}".clock_offset SET offset_by = \'5 seconds\'')
            owner = await psycopg.AsyncConnection.connect(direct_dsn)
            # The owner is mid-transaction on two rows: completing one, parking one.
            done, parked, free = claimed
            await owner.execute(f'DELETE FROM "{schema}".workflow_executions WHERE id = %s',
                                [done.id])
            await owner.execute(f'UPDATE "{schema}".workflow_executions SET status = '
                                f"'waiting', lease_owner = NULL, wake_at = "
                                f'"{schema}".kestrel_now() + interval \'1 hour\' '
                                "WHERE id = %s", [parked.id])
            swept = await db.run(
                c, statements.sweeper.reenqueue_expired(qs, limit=10, max_attempts=5)
            )
            assert swept.requeued == 1  # only the row nobody is touching
            await owner.commit()
            await owner.close()
            again = await db.run(
                c, statements.sweeper.reenqueue_expired(qs, limit=10, max_attempts=5)
            )
            assert again.requeued == 0  # deleted stays gone; the parked one waits
            (reclaimed,) = await db.run(
                c,
                statements.executions.claim_batch(
                    qs, owner="w2", queues=["default"], limit=3, lease_s=60
                ),
            )
            assert reclaimed.id == free.id and reclaimed.epoch == free.epoch + 1
            assert (
                await db.run(c, statements.sweeper.reenqueue_expired(qs, limit=10, max_attempts=5))
            ).requeued == 0

    asyncio.run(main())
    rows = q(pg_dsn, schema, "SELECT status FROM {s}.workflow_executions")
    assert sorted(r[0] for r in rows) == ["running", "waiting"]  # the completed one is gone


def test_f8_a_step_blocking_the_event_loop_keeps_its_lease(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """The step blocks its worker's event loop for 1.5 s, three heartbeat periods (FAULTS
    F8). Heartbeats come from their own thread, so the lease holds: nobody re-claims it and
    the body never runs twice at once. (A stall of a whole lease or more is L2's case: the
    heartbeat then stops certifying the stuck work; see chaos/test_liveness.py.)"""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    # One execution: two in one process would block its loop twice as long (L2's case).
    handles = [client.submit(app.hog, 1.5)]
    with runtime(pg_dsn, schema, procs=2, log=tmp_path / "rt.log"):
        for h in handles:
            assert client.result(h.id, timeout=30) == 1
    entries = app.read_ledger(ledger_path)
    for h in handles:
        mine = [e for e in entries if e["execution_id"] == str(h.id)]
        assert [e["kind"] for e in mine] == ["start", "body"]  # B(s) = 1, no overlap
        assert client.get(h.id).attempts == 1  # never requeued


def test_d4_polling_alone_starts_every_execution_within_the_poll_interval(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """No LISTEN at all (--listen no): each execution still starts within poll_interval
    (jittered by up to 20 %) plus scheduling slack."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    args = ["--listen", "no", "--poll-interval", "1.0"]
    with runtime(pg_dsn, schema, procs=1, args=args, log=tmp_path / "rt.log"):
        handles = []
        for n in range(8):
            handles.append(client.submit(app.quick, n))
            time.sleep(0.37)  # arrivals at every phase of the poll cycle
        for n, h in enumerate(handles):
            assert h.result(timeout=10) == app.model_step(n, 0)
    assert "LISTEN" not in (tmp_path / "rt.log").read_text().split("started:")[-1]
    for h in handles:
        ex = client.get(h.id)
        assert ex.started_at is not None
        assert (ex.started_at - ex.created_at).total_seconds() < 1.2 + 0.5


def test_d5_a_worker_partitioned_past_its_lease_gives_its_runs_up_and_recovers_at_once(
    direct_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """Runtime A reaches the database through a PgBouncer of its own; runtime B directly.
    Killing A's PgBouncer for 4 s (twice the lease) cuts A off alone: A cancels its runs
    one beat before their leases can run out, B's sweeper requeues A's executions and B
    runs them. After the heal A is working again within seconds
    (not after a pool timeout), nothing is recorded twice and every result is the model's.
    """
    from tests.pgbouncer import PgBouncer, free_port

    n = 3000  # enough that B alone cannot finish it all before A is back
    submit_many(direct_dsn, schema, "slow_middle", "jsonb_build_array(i, 0.3)", n)
    bouncer = PgBouncer(direct_dsn, pool_size=8)
    port = free_port()
    # A runs 64 at once: the bound on bodies B runs again below.
    a_args = ["--connection-mode", "pgbouncer", "--listen", "no", "--metrics-port", str(port),
              "--concurrency", "64"]
    try:
        with runtime(bouncer.dsn, schema, procs=1, args=a_args, log=tmp_path / "a.log") as a:
            a_pids = set(wait_until(lambda: worker_pids(a.pid), timeout=20, what="A's worker"))
            wait_until(lambda: any(e["pid"] in a_pids for e in app.read_ledger(ledger_path)),
                       timeout=30, what="A at work")
            # B at 64 as well: alone, it cannot finish the load before A is back.
            with runtime(direct_dsn, schema, procs=1, log=tmp_path / "b.log",
                         args=["--concurrency", "64"]):
                bouncer.kill()
                time.sleep(4.0)
                bouncer.start()
                healed = time.time()
                wait_until(lambda: any(e["pid"] in a_pids and e["t"] > healed + 0.5
                                       for e in app.read_ledger(ledger_path)),
                           timeout=8, what="A to run steps again after the heal")
                wait_until(lambda: finished_count(direct_dsn, schema) == n, timeout=120,
                           interval=0.5, what="every workflow")
            lost = metric(port, "kestrel_leases_lost_total")
    finally:
        bouncer.stop()
    text = (tmp_path / "a.log").read_text()
    # A gave its runs up before their leases could run out (FAULTS C3), so B's runs of them
    # never overlapped A's; whatever A still sent for them was fenced.
    assert "runs out before the next heartbeat could extend it" in text
    assert lost >= 1  # and counted them
    assert "worker crashed" not in text and "restarting in" not in text
    assert audit(direct_dsn, schema, n, ledger_path) <= 64


def test_database_unreachable_past_the_lease_then_back_resumes_within_seconds(
    direct_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """Every kestrel backend terminated and no new connection allowed for 4 s (all of the
    runtime cut off at once). Every caller is then waiting for a pool connection whose
    reconnection attempt already failed; they must not wait out a pool timeout (30 s by
    psycopg_pool's default) once the database is back."""
    from urllib.parse import urlsplit, urlunsplit

    n = 3000
    submit_many(direct_dsn, schema, "slow_middle", "jsonb_build_array(i, 0.3)", n)
    parts = urlsplit(direct_dsn)
    db = parts.path.lstrip("/") or "postgres"
    admin = urlunsplit(parts._replace(path="/template1"))
    # 64 in flight per process: the bound on bodies run again below.
    with runtime(direct_dsn, schema, procs=2, log=tmp_path / "rt.log",
                 args=["--concurrency", "64"]):
        wait_until(lambda: finished_count(direct_dsn, schema) >= 60, timeout=60,
                   what="work under way")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
            try:
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                             "application_name LIKE 'kestrel-%%'")
                time.sleep(4.0)
            finally:
                conn.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
        healed = time.time()
        # Both processes at work again within a few seconds of the heal.
        wait_until(lambda: len({e["pid"] for e in app.read_ledger(ledger_path)
                                if e["t"] > healed + 0.5}) == 2,
                   timeout=8, what="both workers to run steps again")
        wait_until(lambda: finished_count(direct_dsn, schema) == n, timeout=180,
                   interval=0.5, what="every workflow")
    text = (tmp_path / "rt.log").read_text()
    assert "worker crashed" not in text and "restarting in" not in text
    assert audit(direct_dsn, schema, n, ledger_path) <= 2 * 64


# -- issue 22: locks are not poison, clients cannot stall workers ---------------------------

LEASE = 2.0  # tests.helpers.FAST


def _lost_leases(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "was lost" in line]


def test_o4_a_client_transaction_holding_one_running_row_costs_no_other_lease(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """FAULTS O4 (issue 22, row 5): a client's ``signal()`` inside its own transaction,
    left open for three leases, holds the row of one running execution while six run a
    ``def`` step two leases long. The heartbeat skips that row instead of waiting on it,
    so no other execution loses its lease or runs its step twice; no execution ever runs
    its step twice at the same time (ledger intervals never overlap). Before the fix the
    heartbeat waited on the row with every lease of the process behind it: the others lapsed
    and were re-claimed while their bodies still ran."""
    n, seconds = 6, 2 * LEASE
    submit_many(pg_dsn, schema, "long_def", f"jsonb_build_array(i, {seconds})", n)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log = tmp_path / "rt.log"
    with runtime(pg_dsn, schema, procs=1, log=log):
        wait_until(lambda: len(app.read_ledger(ledger_path, kind="start")) == n, timeout=60,
                   what="every execution in its long step")
        # The lowest id: the old heartbeat locked in id order, every other row behind it.
        held = q(pg_dsn, schema, "SELECT id FROM {s}.workflow_executions ORDER BY id")[0][0]
        with psycopg.connect(pg_dsn, prepare_threshold=None) as txn:
            assert client.signal(held, "poke", conn=txn)
            time.sleep(3 * LEASE)  # the transaction stays open past the others' steps
            txn.rollback()
        wait_until(lambda: finished_count(pg_dsn, schema) == n, timeout=90,
                   what="every execution after the client's transaction")
    others = {str(r[0]) for r in q(pg_dsn, schema, "SELECT id FROM {s}.workflow_history "
                                   "WHERE id <> %s", [held])}
    assert len(others) == n - 1
    assert [line for line in _lost_leases(log) if str(held) not in line] == []
    for eid in others:
        runs = app.read_ledger(ledger_path, execution_id=eid)
        assert [e["kind"] for e in runs] == ["start", "body"], (eid, runs)  # B(s) = 1
    for eid in others | {str(held)}:
        runs = app.read_ledger(ledger_path, execution_id=eid)
        starts = sorted(e["t"] for e in runs if e["kind"] == "start")
        ends = sorted(e["t"] for e in runs if e["kind"] == "body")
        # Never two runs of the step at once: each run ends before the next one starts.
        assert all(end <= nxt for end, nxt in zip(ends, starts[1:], strict=False)), (eid, runs)
    assert q(pg_dsn, schema, "SELECT DISTINCT status FROM {s}.workflow_history") == [
        ("completed",)]


def test_o6_an_operator_lock_on_the_checkpoint_table_charges_nothing_and_reruns_nothing(
    pg_dsn: str, direct_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """FAULTS O6 (issue 22, row 7): an operator holds ``LOCK operation_outputs IN SHARE
    MODE`` (what a non-concurrent CREATE INDEX takes) for 5 s, two and a half leases, twice,
    while workflows checkpoint. Checkpoints and completions time out (lock_timeout,
    55P03) and are retried whole with backoff; the heartbeat (another table) keeps the leases,
    so no attempt is charged, nothing is quarantined, no body runs again, and every workflow
    completes once the lock is gone. Before the fix a statement waited on the lock (past the
    lease: the watchdog gave the leases up) or, with a lock_timeout, was isolated as poison
    and failed after two tries."""
    n = 40
    log = tmp_path / "rt.log"
    with runtime(pg_dsn, schema, procs=2, log=log):
        with psycopg.connect(direct_dsn) as operator:
            for round_ in range(2):
                operator.execute(f'LOCK TABLE "{schema}".operation_outputs IN SHARE MODE')
                if round_ == 0:  # submitted under the lock: their first checkpoint meets it
                    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 1.0)", n)
                time.sleep(2.5 * LEASE)
                operator.rollback()
                time.sleep(0.3)
        wait_until(lambda: finished_count(pg_dsn, schema) == n, timeout=90,
                   what="every workflow after the locks")
    assert _lost_leases(log) == []
    assert q(pg_dsn, schema, "SELECT status, attempts, count(*) FROM {s}.workflow_history "
             "GROUP BY 1, 2") == [("completed", 1, n)]
    assert audit(pg_dsn, schema, n, ledger_path) == 0  # no body ran twice
    assert "55P03" in log.read_text()  # the lock timeout was met, and retried
