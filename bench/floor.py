"""The floor: a durable k-step workflow loop as a good engineer writes it without a framework.

The rows are inserted up front. Each loop, on its own connection, claims a batch of rows
with one ``SKIP LOCKED`` statement (``CLAIM_BATCH`` = 8 per claim), then runs the batch's
workflows side by side: for each step, the checkpoints of every workflow in the batch are
sent pipelined (psycopg pipeline mode: one round trip, each INSERT still its own committed
transaction, so each checkpoint is durable before its workflow's next step), then the
completions, pipelined likewise. That is 1/8 + k + 1 commits per workflow with
``synchronous_commit`` as the server has it (on by default), and far fewer round trips than
one statement at a time.

The best concurrency differs from kestrel's (each loop holds a connection), so
:func:`run_best` sweeps the loops per process and keeps the fastest: every ratio in
BENCHMARKS.md is against that best configuration, measured in the same invocation. It does
less than kestrel (no leases, no heartbeats, no history move, no fencing): a framework must
beat it with batching, not by skipping work.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
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
CONCURRENCIES = (2, 4, 8, 16, 32)
"""Loops per process that run_best tries."""
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


async def _loop(dsn: str, schema: str) -> int:
    claim, checkpoint, complete = (_q(CLAIM, schema), _q(CHECKPOINT, schema),
                                   _q(COMPLETE, schema))
    done = 0
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            rows = await (await conn.execute(claim, [CLAIM_BATCH])).fetchall()
            if not rows:
                return done
            for k in range(max(args[0] for _, args in rows)):
                async with conn.pipeline():
                    for job_id, args in rows:
                        if k < args[0]:
                            await conn.execute(checkpoint, [job_id, k, str(k)])
            async with conn.pipeline():
                for job_id, args in rows:
                    await conn.execute(complete, [str(args[0]), job_id])
            done += len(rows)


def _proc(dsn: str, schema: str, concurrency: int) -> None:
    async def main() -> None:
        await asyncio.gather(*(_loop(dsn, schema) for _ in range(concurrency)))

    asyncio.run(main())


def run(dsn: str, schema: str, *, n: int, steps: int, procs: int, concurrency: int
        ) -> dict[str, Any]:
    """Run the floor; return workflows/s measured on the database clock."""
    prepare(dsn, schema, n, steps)
    with psycopg.connect(dsn, autocommit=True) as conn:
        wal_before = _wal_bytes(conn)
    ctx = multiprocessing.get_context("fork")
    started = time.monotonic()
    workers = [ctx.Process(target=_proc, args=(dsn, schema, concurrency)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.monotonic() - started
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(_q(
            "SELECT count(*) FILTER (WHERE status = 'done'), "
            "extract(epoch FROM max(finished_at) - min(started_at)) FROM {s}.floor_job",
            schema)).fetchone()
        wal = _wal_bytes(conn) - wal_before
        conn.execute(_q("DROP SCHEMA {s} CASCADE", schema))
    assert row is not None
    finished, span = int(row[0]), float(row[1] or wall)
    if finished != n:
        raise RuntimeError(f"floor finished {finished} of {n} workflows")
    return {"workflows": n, "seconds": span, "workflows_per_s": n / span,
            "procs": procs, "concurrency": concurrency, "wal_bytes_per_workflow": wal / n}


def _wal_bytes(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
    assert row is not None
    return int(row[0])


def run_best(dsn: str, schema: str, *, n: int, steps: int, procs: int,
             concurrencies: tuple[int, ...] = CONCURRENCIES) -> dict[str, Any]:
    """Run the floor at each number of loops per process; return the fastest run, with
    every run under ``tried``."""
    tried = [run(dsn, schema, n=n, steps=steps, procs=procs, concurrency=c)
             for c in concurrencies]
    best = max(tried, key=lambda r: r["workflows_per_s"])
    return {**best, "tried": [{"concurrency": r["concurrency"],
                               "workflows_per_s": round(r["workflows_per_s"]),
                               "wal_bytes_per_workflow": round(r["wal_bytes_per_workflow"])}
                              for r in tried]}
