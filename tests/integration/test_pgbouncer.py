"""Behind a real PgBouncer in transaction mode: restarts, no session state, connection cap."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg

from tests.apps import ledger_app as app
from tests.helpers import audit, finished_count, q, q1, runtime, submit_many, wait_until
from tests.pgbouncer import PgBouncer


def test_pgbouncer_restart_mid_run_loses_and_duplicates_nothing(
    direct_dsn: str, schema: str, tmp_path: Path, ledger_path: Path
) -> None:
    bouncer = PgBouncer(direct_dsn, pool_size=4)
    try:
        submit_many(direct_dsn, schema, "three_steps", "jsonb_build_array(i)", 2000)
        args = ["--connection-mode", "pgbouncer", "--listen-dsn", direct_dsn,
                "--concurrency", "32"]
        with runtime(bouncer.dsn, schema, procs=2, args=args, log=tmp_path / "rt.log"):
            wait_until(lambda: finished_count(direct_dsn, schema) >= 300, timeout=60,
                       what="work under way")
            bouncer.restart()  # SIGKILL: every client and server connection drops
            wait_until(lambda: finished_count(direct_dsn, schema) == 2000, timeout=120,
                       interval=0.5, what="every workflow after the restart")
        log = (tmp_path / "rt.log").read_text()
        assert "prepared statement" not in log  # none were used, none went missing
    finally:
        bouncer.stop()
    per_step = q(direct_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps "
                 "GROUP BY execution_id, step_id")
    assert len(per_step) == 6000 and {r[0] for r in per_step} == {1}
    assert q1(direct_dsn, schema, "SELECT count(*) FROM {s}.workflow_history WHERE status <> "
              "'completed' OR result <> to_jsonb((args->>0)::int * 30 + 3)") == 0
    runs = len(app.read_ledger(ledger_path))
    assert 6000 <= runs <= 6000 + 2 * 64  # bodies re-run only for checkpoints in flight


def test_pgbouncer_pause_and_resume_mid_run(
    direct_dsn: str, schema: str, tmp_path: Path, ledger_path: Path
) -> None:
    """D7: PAUSE holds every server connection back for longer than the lease; the runtime
    waits (its leases run out, so it starts no new steps), then carries on after RESUME."""
    bouncer = PgBouncer(direct_dsn, pool_size=4)
    n = 1000
    log = tmp_path / "rt.log"
    try:
        submit_many(direct_dsn, schema, "three_steps", "jsonb_build_array(i)", n)
        args = ["--connection-mode", "pgbouncer", "--listen-dsn", direct_dsn,
                "--concurrency", "32"]
        with runtime(bouncer.dsn, schema, procs=2, args=args, log=log):
            wait_until(lambda: finished_count(direct_dsn, schema) >= 200, timeout=60,
                       what="work under way")
            bouncer.admin("PAUSE")
            held = finished_count(direct_dsn, schema)
            time.sleep(3)  # past the 2 s lease
            assert finished_count(direct_dsn, schema) == held  # really paused
            bouncer.admin("RESUME")
            wait_until(lambda: finished_count(direct_dsn, schema) == n, timeout=120,
                       interval=0.5, what="every workflow after RESUME")
    finally:
        bouncer.stop()
    text = log.read_text()
    assert "prepared statement" not in text and "worker crashed" not in text
    assert audit(direct_dsn, schema, n, ledger_path) <= 2 * 32


def test_no_session_state_is_left_on_pooled_connections(
    direct_dsn: str, schema: str, tmp_path: Path
) -> None:
    bouncer = PgBouncer(direct_dsn, pool_size=2)
    try:
        with psycopg.connect(bouncer.dsn, autocommit=True, prepare_threshold=None) as conn:
            defaults = conn.execute("SELECT current_setting('search_path'), "
                                    "current_setting('statement_timeout'), "
                                    "current_setting('lock_timeout')").fetchone()
        submit_many(direct_dsn, schema, "three_steps", "jsonb_build_array(i)", 300)
        args = ["--connection-mode", "pgbouncer", "--maintenance-interval", "0.5"]
        # No --listen-dsn (also not from the suite's environment): polling only.
        with runtime(bouncer.dsn, schema, procs=2, args=args, log=tmp_path / "rt.log",
                     env={"KESTREL_LISTEN_DSN": ""}):
            wait_until(lambda: finished_count(direct_dsn, schema) == 300, timeout=60,
                       what="the work")
            time.sleep(1.5)  # partition upkeep (function-level lock_timeout) has run too
            # Only two server connections, shared by every client: each must be clean.
            for _ in range(6):
                with psycopg.connect(bouncer.dsn, autocommit=True,
                                     prepare_threshold=None) as conn:
                    now = conn.execute("SELECT current_setting('search_path'), "
                                       "current_setting('statement_timeout'), "
                                       "current_setting('lock_timeout')").fetchone()
                    assert now == defaults
            advisory = q1(direct_dsn, schema, "SELECT count(*) FROM pg_locks "
                          "WHERE locktype = 'advisory'")
            assert advisory == 0
            listening = q1(direct_dsn, schema, "SELECT count(*) FROM pg_stat_activity "
                           "WHERE application_name = 'kestrel-listen'")
            assert listening == 0  # no --listen-dsn: polling only, never LISTEN via the pooler
        assert "polling only" in (tmp_path / "rt.log").read_text()
    finally:
        bouncer.stop()


def test_total_connections_stay_under_the_stated_cap(
    direct_dsn: str, schema: str, tmp_path: Path
) -> None:
    procs, pool = 3, 3
    cap = procs * (pool + 2)  # the pool, the heartbeat connection, LISTEN
    peak = 0
    submit_many(direct_dsn, schema, "three_steps", "jsonb_build_array(i)", 1500)
    log = tmp_path / "rt.log"
    # Only backends opened from now on: a pooler elsewhere in the suite may keep idle server
    # connections that still carry an earlier client's application_name.
    since = q1(direct_dsn, schema, "SELECT clock_timestamp()")
    args = ["--pool-size", str(pool), "--connection-mode", "direct"]
    with runtime(direct_dsn, schema, procs=procs, args=args, log=log,
                 env={"KESTREL_LISTEN_DSN": ""}):
        while finished_count(direct_dsn, schema) < 1500:
            n = q1(direct_dsn, schema, "SELECT count(*) FROM pg_stat_activity WHERE "
                   "application_name IN ('kestrel-worker', 'kestrel-listen', "
                   "'kestrel-heartbeat') AND backend_start >= %s", [since])
            peak = max(peak, n)
            time.sleep(0.05)
    assert 0 < peak <= cap
    assert f"at most {cap} connections" in log.read_text()
