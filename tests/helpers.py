"""Helpers for tests that drive real runtimes against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from kestrel.config import Config
from kestrel.worker import Worker

ROOT = Path(__file__).resolve().parents[1]
APP = "tests.apps.ledger_app"

# Short leases so recovery happens within seconds in tests.
FAST = ["--lease", "2", "--heartbeat", "0.5", "--sweep-interval", "0.5",
        "--poll-interval", "0.2"]


def wait_until(predicate: Callable[[], Any], *, timeout: float, interval: float = 0.05,
               what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def q(dsn: str, schema: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run *text* with ``{s}`` standing for the schema; return all rows."""
    # No prepared statements: this may run through PgBouncer in transaction mode.
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        stmt = pgsql.SQL(text).format(s=pgsql.Identifier(schema))  # type: ignore[arg-type]
        cur = conn.execute(stmt, params)
        return cur.fetchall() if cur.description else []


def q1(dsn: str, schema: str, text: str, params: Any = None) -> Any:
    rows = q(dsn, schema, text, params)
    return rows[0][0] if rows else None


def take_lease(dsn: str, schema: str, owner: str, lease_s: float = 30.0) -> None:
    """Take *owner*'s lease (migration 0026) as a worker's first heartbeat does, before a
    test claims by hand under that owner: rows claimed under an owner with no lease are the
    sweeper's at its next round."""
    from kestrel import db, statements
    from kestrel.sql import queries

    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        beat = db.run_script_sync(conn, statements.executions.heartbeat(
            queries(schema), owner=owner, held=[], lease_s=lease_s))
    assert beat.renewed, f"{owner}'s lease ran out: it is never taken again"


def finished_count(dsn: str, schema: str) -> int:
    return int(q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_history"))


def submit_many(dsn: str, schema: str, workflow: str, args_sql: str, n: int) -> None:
    """Submit *n* executions in one statement through the SQL function (``i`` = 1..n)."""
    q(dsn, schema,
      "SELECT {s}.submit(%s, " + args_sql + ") FROM generate_series(1, %s) AS i",
      [workflow, n])


def start_runtime(dsn: str, schema: str, *, procs: int = 2, args: list[str] | None = None,
                  env: dict[str, str] | None = None, out: Any = subprocess.DEVNULL,
                  app: str = APP) -> subprocess.Popen[bytes]:
    """Start ``kestrel-runtime`` (the real supervisor and workers) in a session of its own;
    its output goes to *out* (a file opened for writing, or DEVNULL)."""
    cmd = [sys.executable, "-m", "kestrel", "--app", app, "--dsn", dsn, "--schema", schema,
           "--procs", str(procs), *FAST, *(args or [])]
    # This checkout's sources first: an installed kestrel (another checkout's, editable) must
    # not be what the runtime under test runs.
    full_env = {**os.environ,
                "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT))), **(env or {})}
    return subprocess.Popen(cmd, env=full_env, cwd=ROOT, stdout=out, stderr=out,
                            start_new_session=True)


def stop_runtime(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM (drain) and wait; SIGKILL the whole session if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def runtime(dsn: str, schema: str, *, procs: int = 2, args: list[str] | None = None,
            env: dict[str, str] | None = None, log: Path | None = None, app: str = APP,
            ) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``kestrel-runtime`` for the block's duration."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = start_runtime(dsn, schema, procs=procs, args=args, env=env, out=out, app=app)
    try:
        yield proc
    finally:
        stop_runtime(proc)
        if log:
            out.close()  # type: ignore[union-attr]


def worker_pids(supervisor_pid: int) -> list[int]:
    """Children of the supervisor, from /proc."""
    out = subprocess.run(["pgrep", "-P", str(supervisor_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def config(schema: str, **overrides: Any) -> Config:
    base: dict[str, Any] = dict(schema=schema, lease=2.0, heartbeat=0.5, sweep_interval=0.5,
                                poll_interval=0.1, concurrency=16,
                                connection_mode=os.environ.get("KESTREL_CONNECTION_MODE",
                                                               "direct"),
                                listen_dsn=os.environ.get("KESTREL_LISTEN_DSN", ""))
    base.update(overrides)
    return Config(**base)


def run_worker_until(dsn: str, cfg: Config, done: Callable[[], bool], *,
                     timeout: float = 30.0) -> Worker:
    """Run one in-process worker until *done()* (checked from a thread) is true."""
    from kestrel.workflow import registry

    async def main() -> Worker:
        worker = Worker(cfg, registry(), dsn=dsn)
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + timeout
        try:
            while not await asyncio.to_thread(done):
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker did not finish the work in {timeout}s")
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
        finally:
            worker.stop(drain_timeout=5)
            await task
        return worker

    return asyncio.run(main())


def alive(pid: int) -> bool:
    """A live process, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def metric(port: int, name: str) -> float:
    """The sum of every sample of *name* on a runtime's /metrics endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def audit(dsn: str, schema: str, n: int, ledger: Path) -> int:
    """The post-run audit: nothing lost, nothing recorded twice, nothing divergent.
    Returns the extra body runs (ledger rows beyond checkpoints)."""
    lost = q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_executions")
    assert lost == 0, f"{lost} executions never finished"
    assert finished_count(dsn, schema) == n
    dup = q1(dsn, schema, "SELECT count(*) FROM (SELECT 1 FROM {s}.workflow_steps "
             "GROUP BY execution_id, step_id HAVING count(*) > 1) d")
    assert dup == 0
    divergent = q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_history WHERE status <> "
                   "'completed' OR result <> to_jsonb((args->>0)::int * 30 + 3)")
    assert divergent == 0
    recorded = q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_steps")
    assert recorded == 3 * n
    from tests.apps import ledger_app as app

    runs = len([e for e in app.read_ledger(ledger) if e["kind"] == "body"])
    assert runs >= recorded
    return int(runs - recorded)


def drop_schemas(dsn: str, names: list[str]) -> None:
    """Drop the schemas *names* (a namespace's buckets, say) and what they hold."""
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        for name in names:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                pgsql.Identifier(name)))


def plan_of(conn: psycopg.Connection[Any], text: str, params: dict[str, Any], *,
          generic: bool) -> dict[str, Any]:
    """The plan of *text* with *params*; with *generic*, the plan a prepared statement
    settles on after five runs, made for any value (PREPARE, then EXPLAIN EXECUTE under
    force_generic_plan: a statement sent with its values is planned for them)."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
    if not generic:
        row = conn.execute(pgsql.SQL("EXPLAIN (FORMAT JSON) ") + pgsql.SQL(text),  # type: ignore[arg-type]
                           params).fetchone()
    else:
        body = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", text)
        conn.execute(pgsql.SQL("PREPARE listed AS ") + pgsql.SQL(body.replace("%%", "%")))  # type: ignore[arg-type]
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cur = psycopg.ClientCursor(conn)  # EXECUTE takes its arguments as literals
        row = cur.execute("EXPLAIN (FORMAT JSON) EXECUTE listed ("
                          + ", ".join(["%s"] * len(names)) + ")",
                          [params[n] for n in names]).fetchone()
        conn.execute("DEALLOCATE listed")
    assert row is not None
    plan: dict[str, Any] = row[0][0]["Plan"]
    return plan
