"""The floors: a durable k-step workflow loop as a good engineer writes it without a framework,
in two flavours that differ only in what one transaction holds.

The rows are inserted up front. Each loop, on its own connection, claims a batch of rows
with one ``SKIP LOCKED`` statement (``CLAIM_BATCH`` = 8 per claim), then runs the batch's
workflows side by side: for each step, the checkpoints of every workflow in the batch are
sent in one psycopg pipeline (one round trip), then the completions, pipelined likewise.

- **group** (``mode="group"``): a group-commit loop. A psycopg pipeline sends one Sync, at
  its end, and PostgreSQL runs everything between two Syncs as one implicit transaction: the
  batch's checkpoints of a step commit together (a failure in the 5th INSERT rolls back the
  first 4), and so do its completions. About 1/8 + k/8 + 1/8 commits per workflow.
- **per-step** (``mode="step"``): each checkpoint and each completion is its own
  transaction, durable before its workflow's next step: the pipeline carries
  ``BEGIN; INSERT; COMMIT`` per row, still one round trip per step of the batch (a Sync per
  statement would cost a round trip each). About 1/8 + k + 1 commits per workflow.

Both run with ``synchronous_commit`` as the server has it (on by default). The best
concurrency differs from kestrel's (each loop holds a connection), so :func:`run_best`
sweeps the loops per process and keeps the fastest. They do less than kestrel (no leases,
no heartbeats, no history move, no fencing): a framework must beat them with batching, not
by skipping work.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

SETUP = """
CREATE TABLE {s}.floor_job (
    id bigserial PRIMARY KEY, args jsonb NOT NULL, status text NOT NULL DEFAULT 'queued',
    result jsonb, created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at timestamptz, finished_at timestamptz);
CREATE INDEX ON {s}.floor_job (id) WHERE status = 'queued';
CREATE TABLE {s}.floor_step (
    job_id bigint NOT NULL, step_id int NOT NULL, output jsonb NOT NULL,
    PRIMARY KEY (job_id, step_id));
"""
CLAIM_BATCH = 8
CLAIM = """
WITH picked AS (
    SELECT id FROM {s}.floor_job WHERE status = 'queued' ORDER BY id LIMIT %s
       FOR UPDATE SKIP LOCKED)
UPDATE {s}.floor_job AS j SET status = 'running', started_at = clock_timestamp()
  FROM picked WHERE j.id = picked.id
RETURNING j.id, j.args
"""
CONCURRENCIES = (2, 4, 8, 16, 32, 64)
"""Loops per process that run_best tries."""
MODES = ("group", "step")
APP_NAME = "kestrel-bench-floor"
CHECKPOINT = ("INSERT INTO {s}.floor_step (job_id, step_id, output) VALUES (%s, %s, %s) "
              "ON CONFLICT DO NOTHING")
COMPLETE = ("UPDATE {s}.floor_job SET status = 'done', result = %s, "
            "finished_at = clock_timestamp() WHERE id = %s")


def _q(text: str, schema: str) -> pgsql.Composed:
    return pgsql.SQL(text).format(s=pgsql.Identifier(schema))  # type: ignore[arg-type]


def prepare(dsn: str, schema: str, n: int, steps: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_q("DROP SCHEMA IF EXISTS {s} CASCADE", schema))
        conn.execute(_q("CREATE SCHEMA {s}", schema))
        conn.execute(_q(SETUP, schema))
        conn.execute(_q("INSERT INTO {s}.floor_job (args) "
                        "SELECT jsonb_build_array(%s) FROM generate_series(1, %s)", schema),
                     [steps, n])


async def send_group(conn: psycopg.AsyncConnection[Any], stmt: pgsql.Composed,
                     rows: list[list[Any]]) -> None:
    """Run *stmt* once per row of parameters in one pipeline: one round trip, one Sync,
    so one transaction (all or nothing)."""
    async with conn.pipeline():
        for params in rows:
            await conn.execute(stmt, params)


async def send_per_step(conn: psycopg.AsyncConnection[Any], stmt: pgsql.Composed,
                        rows: list[list[Any]]) -> None:
    """Run *stmt* once per row of parameters in one pipeline (one round trip), each in its
    own transaction: a failure rolls back its own row only (the rows after it in the
    pipeline are skipped, as in any pipeline)."""
    try:
        async with conn.pipeline():
            for params in rows:
                await conn.execute("BEGIN")
                await conn.execute(stmt, params)
                await conn.execute("COMMIT")
    except psycopg.Error:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            await conn.execute("ROLLBACK")
        raise


async def _loop(dsn: str, schema: str, mode: str) -> int:
    claim, checkpoint, complete = (_q(CLAIM, schema), _q(CHECKPOINT, schema),
                                   _q(COMPLETE, schema))
    send = send_group if mode == "group" else send_per_step
    done = 0
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True,
                                                     application_name=APP_NAME) as conn:
        while True:
            rows = await (await conn.execute(claim, [CLAIM_BATCH])).fetchall()
            if not rows:
                return done
            for k in range(max(args[0] for _, args in rows)):
                await send(conn, checkpoint,
                           [[job_id, k, str(k)] for job_id, args in rows if k < args[0]])
            await send(conn, complete, [[str(args[0]), job_id] for job_id, args in rows])
            done += len(rows)


def _proc(dsn: str, schema: str, concurrency: int, mode: str) -> None:
    async def main() -> None:
        await asyncio.gather(*(_loop(dsn, schema, mode) for _ in range(concurrency)))

    asyncio.run(main())


def run(dsn: str, schema: str, *, n: int, steps: int, procs: int, concurrency: int,
        mode: str = "group", profile: bool = False,
        py_spy: Path | None = None) -> dict[str, Any]:
    """Run one floor; return workflows/s measured on the database clock, commits, WAL bytes
    and CPU seconds (the loops' processes and the server's) per workflow, and with
    *profile* its statements (bench/statements.py), with *py_spy* (a folder) its loop
    processes sampled (bench/profiles.py)."""
    from bench import profiles, statements
    from bench.common import DbCounters

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    prepare(dsn, schema, n, steps)
    with psycopg.connect(dsn, autocommit=True) as mon:
        before = DbCounters.read(mon)
        if profile:
            statements.reset(mon)
        children = _children_cpu()
        # The bench's own main thread only waits in join(): py-spy samples no idle thread.
        spy = (profiles.Recorder(os.getpid(), py_spy / f"{mode}-{concurrency}.raw")
               if py_spy else None)
        ctx = multiprocessing.get_context("fork")
        started = time.monotonic()
        workers = [ctx.Process(target=_proc, args=(dsn, schema, concurrency, mode))
                   for _ in range(procs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.monotonic() - started
        raw = spy.stop() if spy else None
        client_cpu = _children_cpu() - children  # the joined loop processes
        # A backend publishes its counters when it exits: wait for the loops' backends.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (mon.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                [APP_NAME]).fetchone() or [0])[0]:
            time.sleep(0.05)
        after = DbCounters.read(mon)
        stmts = statements.read(mon, n) if profile else []
        row = mon.execute(_q(
            "SELECT count(*) FILTER (WHERE status = 'done'), "
            "extract(epoch FROM max(finished_at) - min(started_at)) FROM {s}.floor_job",
            schema)).fetchone()
        # The monitor's own transactions between the two reads (3 in DbCounters.read, one
        # per activity poll at most) are a handful against thousands: left in.
        mon.execute(_q("DROP SCHEMA {s} CASCADE", schema))
    assert row is not None
    finished, span = int(row[0]), float(row[1] or wall)
    if finished != n:
        raise RuntimeError(f"floor finished {finished} of {n} workflows")
    return {"mode": mode, "workflows": n, "seconds": span, "workflows_per_s": n / span,
            "procs": procs, "concurrency": concurrency,
            "commits_per_workflow": (after.commits - before.commits) / n,
            "wal_bytes_per_workflow": (after.wal_bytes - before.wal_bytes) / n,
            "worker_cpu_s_per_workflow": client_cpu / n,
            "postgres_cpu_s_per_workflow": (after.pg_cpu_s - before.pg_cpu_s) / n,
            **({"statements": stmts} if stmts else {}),
            **({"py_spy": str(raw)} if raw else {})}


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def run_best(dsn: str, schema: str, *, n: int, steps: int, procs: int, mode: str = "group",
             concurrencies: tuple[int, ...] = CONCURRENCIES,
             profile: bool = False, py_spy: Path | None = None) -> dict[str, Any]:
    """Run a floor at each number of loops per process; return the fastest run (with its
    statements, under *profile*), with every run under ``tried``."""
    tried = [run(dsn, schema, n=n, steps=steps, procs=procs, concurrency=c, mode=mode,
                 profile=profile, py_spy=py_spy)
             for c in concurrencies]
    best = max(tried, key=lambda r: r["workflows_per_s"])
    return {**best, "tried": [{"concurrency": r["concurrency"],
                               "workflows_per_s": round(r["workflows_per_s"]),
                               "commits_per_workflow": round(r["commits_per_workflow"], 2),
                               "wal_bytes_per_workflow": round(r["wal_bytes_per_workflow"])}
                              for r in tried]}
