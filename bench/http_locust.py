"""Locust load test of the HTTP door: users submit workflows with POST /api/v1/.../submit
while the runtime runs them.

    locust -f bench/http_locust.py --headless -u 100 -r 50 -t 30s
    (KESTREL_DSN=postgresql://… to use a server of yours; default: the embedded one in
    .kestrel/bench-pgdata, as bench/locustfile.py)

On test start it migrates a fresh schema, creates a ``submit`` token and starts
``kestrel-runtime --procs $KESTREL_BENCH_PROCS`` (default 2) with ``--http-port`` (the HTTP
server is the supervisor's child process, next to the workers); on test stop it drains it.
Each user submits one 3-step workflow per second, so the offered rate is the user count per
second, exactly as ``bench/locustfile.py`` does through the Python client. Reported:

* ``POST /api/v1/workflows/bench/submit``: the HTTP round trip (token checked, row
  committed), measured by locust;
* ``end_to_end``: submit → finished, from the execution's own timestamps in history
  (database clock), read by one watcher greenlet.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import gevent
import psycopg
from locust import FastHttpUser, constant_throughput, events, task
from psycopg import sql as pgsql

from bench.common import ROOT, database, fresh_schema

SCHEMA = "bench_http"
STATE: dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = int(os.environ.get("KESTREL_BENCH_HTTP_PORT") or _free_port())


@events.test_start.add_listener
def start_runtime(environment: Any, **_: Any) -> None:
    dsn, server = database(os.environ.get("KESTREL_DSN"), str(ROOT / ".kestrel" / "bench-pgdata"))
    fresh_schema(dsn, SCHEMA)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    made = subprocess.run(
        [sys.executable, "-m", "kestrel", "token", "create", "--name", "bench", "--scopes",
         "submit", "--dsn", dsn, "--schema", SCHEMA, "--json"],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True)
    procs = os.environ.get("KESTREL_BENCH_PROCS", "2")
    runtime = subprocess.Popen(
        [sys.executable, "-m", "kestrel", "--app", "bench.workloads", "--dsn", dsn,
         "--schema", SCHEMA, "--procs", procs, "--log-level", "warning",
         "--http-port", str(PORT)], env=env, cwd=ROOT)
    STATE.update(dsn=dsn, server=server, runtime=runtime, pending={}, stop=False,
                 token=json.loads(made.stdout)["token"])
    deadline = time.monotonic() + 60
    while True:  # the HTTP child is up once it answers
        try:
            with socket.create_connection(("127.0.0.1", PORT), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
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
        "SELECT id::text, extract(epoch FROM finished_at - created_at) * 1000, status "
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


class HttpSubmitter(FastHttpUser):
    """One workflow a second through the HTTP API."""

    wait_time = constant_throughput(1)
    host = f"http://127.0.0.1:{PORT}"

    @task
    def submit(self) -> None:
        with self.client.post("/api/v1/workflows/bench/submit",
                              json={"args": [3, "noop", 0.0]},
                              headers={"Authorization": f"Bearer {STATE['token']}"},
                              catch_response=True) as reply:
            if reply.status_code == 200:
                STATE["pending"][reply.json()["id"]] = time.perf_counter()
                reply.success()
            else:
                reply.failure(f"HTTP {reply.status_code}")
