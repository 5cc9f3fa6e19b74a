"""The floor: the least SQL a durable 3-step workflow needs, hand-written, no framework.

Per workflow: the row is inserted up front; a loop claims one row with SKIP LOCKED (one
commit), writes each step's checkpoint in its own committed INSERT (three commits) and marks
the row done (one commit): five commits per workflow after the insert, with
``synchronous_commit`` as the server has it (on by default). ``procs`` processes each run
``concurrency`` such loops, each on its own connection, the same concurrency kestrel gets.
It does less than kestrel (no leases, no heartbeats, no history move, no fencing): any
framework must beat this with batching, not by skipping work.
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
CLAIM = """
UPDATE {s}.floor_job SET status = 'running', started_at = clock_timestamp()
 WHERE id = (SELECT id FROM {s}.floor_job WHERE status = 'queued' ORDER BY id LIMIT 1
             FOR UPDATE SKIP LOCKED)
RETURNING id, args
"""
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
            row = await (await conn.execute(claim)).fetchone()
            if row is None:
                return done
            job_id, args = row
            for k in range(args[0]):
                await conn.execute(checkpoint, [job_id, k, str(k)])
            await conn.execute(complete, [str(args[0]), job_id])
            done += 1


def _proc(dsn: str, schema: str, concurrency: int) -> None:
    async def main() -> None:
        await asyncio.gather(*(_loop(dsn, schema) for _ in range(concurrency)))

    asyncio.run(main())


def run(dsn: str, schema: str, *, n: int, steps: int, procs: int, concurrency: int
        ) -> dict[str, Any]:
    """Run the floor; return workflows/s measured on the database clock."""
    prepare(dsn, schema, n, steps)
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
        conn.execute(_q("DROP SCHEMA {s} CASCADE", schema))
    assert row is not None
    finished, span = int(row[0]), float(row[1] or wall)
    if finished != n:
        raise RuntimeError(f"floor finished {finished} of {n} workflows")
    return {"workflows": n, "seconds": span, "workflows_per_s": n / span}
