"""Time one statement alone: the checkpoint batch (``save_new_steps_batch``), as this checkout
writes it, on one connection.

    python -m bench.checkpoint_batch                       # the bench's embedded PostgreSQL
    python -m bench.checkpoint_batch --citus postgresql://postgres@127.0.0.1:5440/postgres

A fresh schema (on Citus a tenant: a distributed schema) with ``--executions`` running
executions; ``--rounds`` rounds of ``--batches`` batches, each batch one checkpoint of every
execution (the next step), prepared. On plain PostgreSQL the tables are emptied before each
round, so rounds compare alike; on Citus they are not (the checkpoint table grows, as it
does while executions run). Prints microseconds per checkpoint for each round. Run two
checkouts one after the other to compare them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import psycopg
from psycopg import sql as pgsql
from psycopg.conninfo import make_conninfo

from bench.common import ROOT, database, fresh_schema
from kestrel.sql import queries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--citus", metavar="DSN", help="a Citus coordinator (default: embedded)")
    ap.add_argument("--executions", type=int, default=32, help="checkpoints per batch")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    schema = f"bench_batch_{uuid.uuid4().hex[:8]}"
    if args.citus:
        from kestrel.migrate import migrate

        dsn = args.citus
        migrate(make_conninfo(dsn, options="-c citus.enable_schema_based_sharding=on"), schema)
    else:
        dsn, _server = database(None, str(ROOT / ".kestrel" / "bench-pgdata"))
        fresh_schema(dsn, schema)
    query = queries(schema).save_new_steps_batch
    s = pgsql.Identifier(schema)
    per: list[float] = []
    step = 0
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ids = [uuid.uuid4() for _ in range(args.executions)]
            for n in range(args.rounds):
                if n == 0 or not args.citus:
                    if not args.citus:
                        conn.execute(pgsql.SQL("TRUNCATE {}.operation_outputs, "
                                               "{}.workflow_executions").format(s, s))
                    with conn.transaction():
                        for i in ids:
                            conn.execute(pgsql.SQL(
                                "INSERT INTO {}.workflow_executions (id, workflow, status, "
                                "args, lease_epoch) VALUES (%s, 'w', 'running', '[]', 1)"
                            ).format(s), [i])
                started = time.perf_counter()
                for _ in range(args.batches):
                    step += 1
                    rows = json.dumps([[str(i), 1, step, "s", [step], None, 1, 0.0, 0.0]
                                       for i in ids])
                    conn.execute(query, {"rows": rows}, prepare=True).fetchall()
                per.append((time.perf_counter() - started) / args.batches / args.executions
                           * 1e6)
                print(f"round {n + 1}: {per[-1]:.1f} µs per checkpoint", flush=True)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
    print(f"median {statistics.median(per):.1f} µs per checkpoint "
          f"({args.executions} per batch, {'Citus' if args.citus else 'PostgreSQL'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
