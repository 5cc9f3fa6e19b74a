"""FAULTS C2 and C3: the heartbeat against locks on the rows a worker holds, with nothing
crashing. Real runtimes, a real PostgreSQL, the ledger as the witness of every step body.

C2: the worker's own checkpoint batches hold its rows ``FOR SHARE`` for a moment, many times
a second; the heartbeat must never lose to them. C3: a client transaction holds a running
execution's row for longer than the lease. The lease is the process's own row (migration
0026), which neither touches.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.helpers import finished_count, q, runtime, submit_many, wait_until

# The default lease and heartbeat (30 s, 10 s), scaled down tenfold: the same three beats
# to a lease, so a row skipped at three beats in a row is lost, as at the defaults.
DEFAULT_RATIO = ["--lease", "3", "--heartbeat", "1"]
EXECUTIONS, STEPS = 10, 1000  # ~10 ms a step: each execution runs for three leases or more


def _lines(log: Path, text: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if text in line]


@pytest.fixture
def slow_flush_dsn(direct_dsn: str) -> Iterator[str]:
    """A role of its own whose every commit waits 5 ms before its WAL flush (commit_delay):
    the checkpoint batches hold their row locks that much longer, as on a slow disk."""
    role = f"kestrel_slow_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(pgsql.Identifier(role)))
        for name, value in (("commit_delay", "5000"), ("commit_siblings", "0")):
            conn.execute(pgsql.SQL("ALTER ROLE {} SET {} = {}").format(
                pgsql.Identifier(role), pgsql.Identifier(name), pgsql.Literal(value)))
    try:
        yield psycopg.conninfo.make_conninfo(direct_dsn, user=role)
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE usename = %s", [role])
            conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))


@pytest.mark.parametrize("flush", ["fast", "slow"])
def test_c2_the_heartbeat_never_loses_to_the_workers_own_checkpoint_batches(
    flush: str, pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """FAULTS C2 (issue 38, row 3): ten executions of 1,000 short sequential steps (0-19 ms)
    in one process, at the default lease-to-heartbeat ratio, for more than three leases.
    Every lease is extended at every beat (no "not extended" line, no lease lost), no
    attempt is charged and every step body ran once. Before the fix the heartbeat skipped
    (``SKIP LOCKED``) each row a checkpoint batch held at that moment and counted it busy:
    dozens of rows a run went unextended, and leases were lost once one was skipped at
    three beats in a row."""
    dsn = request.getfixturevalue("slow_flush_dsn") if flush == "slow" else pg_dsn
    if flush == "slow":
        delay = q(dsn, schema, "SELECT current_setting('commit_delay')")[0][0]
        assert delay == "5000", delay  # microseconds
    submit_many(pg_dsn, schema, "short_steps", f"jsonb_build_array(i, {STEPS})", EXECUTIONS)
    log = tmp_path / "rt.log"
    with runtime(dsn, schema, procs=1, log=log, args=DEFAULT_RATIO):
        wait_until(lambda: finished_count(pg_dsn, schema) == EXECUTIONS, timeout=240,
                   what="every execution")
    assert _lines(log, "not extended") == []
    assert _lines(log, "was lost") == []
    assert q(pg_dsn, schema, "SELECT status, attempts, count(*) FROM {s}.workflow_history "
             "GROUP BY 1, 2") == [("completed", 1, EXECUTIONS)]
    bodies = app.read_ledger(ledger_path)
    ran = Counter((e["execution_id"], e["step_id"]) for e in bodies)
    assert len(ran) == EXECUTIONS * STEPS
    assert [k for k, n in ran.items() if n > 1] == []  # no body ran twice
    t = [e["t"] for e in bodies]
    assert max(t) - min(t) >= 3 * 3.0  # the run lasted three leases: the scenario happened


def test_c3_a_row_held_past_the_lease_costs_no_attempt_and_runs_once(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """FAULTS C3 (issue 38, row 6): a client's ``signal()`` in its own transaction keeps a
    running execution's row for two and a half leases while its ``async`` step takes three.
    The lease is the process's own row (migration 0026): the heartbeat extends it without
    touching the execution's, so the lease never lapses, nothing is swept or re-claimed,
    and the held step runs once, to its end; its checkpoint waits for the client and
    commits after it. No attempt is charged. Before, the heartbeat could not extend a held
    row's lease: the worker stopped the run one beat before it ran out, the sweeper
    re-queued it and a second run started (attempt 2); earlier still, the two runs
    overlapped by about a second."""
    lease = 2.0  # tests.helpers.FAST
    submit_many(pg_dsn, schema, "long_async_wf", f"jsonb_build_array(i, {3 * lease})", 3)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log = tmp_path / "rt.log"
    # The first runtime runs all three and has no room for more; the second, idle, would be
    # the one to take the held execution if it were ever re-queued: another process, as in
    # a fleet, where a run here cannot be cancelled by a re-claim here.
    full = ["--concurrency", "3"]
    with runtime(pg_dsn, schema, procs=1, log=log, args=full):
        wait_until(lambda: len(app.read_ledger(ledger_path, kind="start")) == 3, timeout=60,
                   what="every execution in its step")
        with runtime(pg_dsn, schema, procs=1, log=tmp_path / "other.log"):
            held = str(q(pg_dsn, schema,
                         "SELECT id FROM {s}.workflow_executions ORDER BY id")[0][0])
            with psycopg.connect(pg_dsn, prepare_threshold=None) as txn:
                assert client.signal(held, "poke", conn=txn)
                time.sleep(2.5 * lease)
                txn.rollback()
            wait_until(lambda: finished_count(pg_dsn, schema) == 3, timeout=90,
                       what="every execution")
    for eid in [str(r[0]) for r in q(pg_dsn, schema, "SELECT id FROM {s}.workflow_history")]:
        assert [e["kind"] for e in app.read_ledger(ledger_path, execution_id=eid)] == [
            "start", "body"], eid  # one run each, to its end
    assert q(pg_dsn, schema, "SELECT status, attempts, count(*) FROM {s}.workflow_history "
             "GROUP BY 1, 2") == [("completed", 1, 3)]  # no attempt charged
    assert _lines(log, "was lost") == []
    assert _lines(log, "runs out before") == []
