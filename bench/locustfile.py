"""Locust load test: users submit workflows through the client while the runtime runs.

    KESTREL_DSN=postgresql://… locust -f bench/locustfile.py --headless -u 50 -r 50 -t 60s
    (without KESTREL_DSN an embedded PostgreSQL in .kestrel/bench-pgdata is used)

On test start it migrates a fresh schema and starts ``kestrel-runtime --procs
$KESTREL_BENCH_PROCS`` (default 2) with the bench workload; on test stop it drains it. Each
user submits one 3-step workflow per second (``constant_throughput(1)``), so the offered rate
is the user count per second. Two request types are reported:

* ``submit``: time for ``SyncClient.submit`` to return (the row is committed);
* ``end_to_end``: submit → finished, read from the execution's own timestamps in history
  (database clock), collected by one watcher greenlet so users never block on results.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import gevent
import psycopg
from locust import User, constant_throughput, events, task
from psycopg import sql as pgsql

from bench.common import ROOT, database, fresh_schema
from kestrel.client import SyncClient

SCHEMA = "bench_locust"
STATE: dict[str, Any] = {}


@events.test_start.add_listener
def start_runtime(environment: Any, **_: Any) -> None:
    dsn, server = database(os.environ.get("KESTREL_DSN"), str(ROOT / ".kestrel" / "bench-pgdata"))
    fresh_schema(dsn, SCHEMA)
    procs = os.environ.get("KESTREL_BENCH_PROCS", "2")
    runtime = subprocess.Popen(
        [sys.executable, "-m", "kestrel", "--app", "bench.workloads", "--dsn", dsn,
         "--schema", SCHEMA, "--procs", procs, "--log-level", "warning"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    STATE.update(dsn=dsn, server=server, runtime=runtime, pending={}, stop=False)
    STATE["watcher"] = gevent.spawn(_watch, environment)


@events.test_stop.add_listener
def stop_runtime(**_: Any) -> None:
    STATE["stop"] = True
    STATE["watcher"].join(timeout=5)
    runtime = STATE["runtime"]
    runtime.send_signal(signal.SIGTERM)
    runtime.wait(timeout=60)


def _watch(environment: Any) -> None:
    """Report end-to-end latency of finished executions, from the database's timestamps."""
    query = pgsql.SQL(
        "SELECT id, extract(epoch FROM finished_at - created_at) * 1000, status "
        "FROM {}.workflow_history WHERE finished_at > %s ORDER BY finished_at"
    ).format(pgsql.Identifier(SCHEMA))
    with psycopg.connect(STATE["dsn"], autocommit=True) as conn:
        seen_until = "-infinity"
        while not STATE["stop"]:
            for eid, ms, status in conn.execute(query, [seen_until]).fetchall():
                if STATE["pending"].pop(eid, None) is not None:
                    environment.events.request.fire(
                        request_type="kestrel", name="end_to_end", response_time=float(ms),
                        response_length=0, context={},
                        exception=None if status == "completed" else RuntimeError(status))
            row = conn.execute(pgsql.SQL("SELECT max(finished_at) FROM {}.workflow_history")
                               .format(pgsql.Identifier(SCHEMA))).fetchone()
            if row and row[0]:
                seen_until = row[0].isoformat()
            gevent.sleep(0.2)


class WorkflowSubmitter(User):
    wait_time = constant_throughput(1)

    def on_start(self) -> None:
        self.client = SyncClient(STATE["dsn"], schema=SCHEMA)

    @task
    def submit(self) -> None:
        started = time.perf_counter()
        exc: Exception | None = None
        try:
            handle = self.client.submit("bench", 3, "noop", 0.0)
            STATE["pending"][handle.id] = started
        except Exception as e:  # report, don't kill the user
            exc = e
        self.environment.events.request.fire(
            request_type="kestrel", name="submit",
            response_time=(time.perf_counter() - started) * 1000, response_length=0,
            context={}, exception=exc)
