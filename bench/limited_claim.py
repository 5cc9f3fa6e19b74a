"""A limited queue's claim on one schema and in a namespace of buckets (FAULTS C4), and a
keyed queue's (issue 42).

In a namespace every claim of a limited queue takes the queue's row in its home bucket and
counts the running rows of every bucket under it: one statement per bucket more than on one
schema. This times a claim of one row, statement by statement as the worker sends them, on
an ordinary schema and on a namespace of ``--buckets`` (the rows claimed stay running, so the
count grows as it would under load).

A keyed queue (``per_key``) is claimed the same way on one schema too, with the running
counted by key and the keys walked in turn: ``--keyed`` also times, on one schema, a claim
from one key of ``--rounds`` rows (``per_key`` never reached) and from ``--rounds`` keys of
one row each at ``per_key=1`` (every claimed key stays running, so the claim walks past
more and more of them).

    python -m bench.limited_claim --dsn postgresql://postgres@127.0.0.1:5432/postgres --keyed
"""

from __future__ import annotations

import argparse
import time
import uuid

import psycopg

from kestrel import buckets, db, statements
from kestrel.migrate import migrate, migrate_namespace
from kestrel.sql import queries


def measure(dsn: str, count: int, rounds: int, keys: int = 0) -> float:
    """Milliseconds per claim of one row of a limited queue in a namespace of *count*
    buckets (1: an ordinary schema), over *rounds* claims; with *keys*, of a keyed queue
    whose rows are spread over that many keys (per_key 1 when every row has its own key,
    else never reached)."""
    name = f"bench_{uuid.uuid4().hex[:10]}"
    if count == 1:
        migrate(dsn, name)
        names = [name]
    else:
        migrate_namespace(dsn, name, buckets=count)
        names = buckets.schemas(name, count)
    qs = [queries(s) for s in names]
    home = qs[buckets.home("lim", count)] if count > 1 else qs[0]
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for q in dict.fromkeys([home, qs[0]]):
                db.run_sync(conn, statements.queues.upsert_queue_limit(
                    q, queue="lim", concurrency=rounds + 1, rate=None, period_s=None,
                    per_key=(1 if keys == rounds else rounds + 1) if keys else None))
            key = f"'k' || (i % {keys})" if keys else "NULL"
            conn.execute(f"SELECT \"{names[0]}\".submit('w', jsonb_build_array(i), 'lim', "
                         f"p_concurrency_key => {key}) FROM generate_series(1, {rounds}) AS i")
            started = time.perf_counter()
            for _ in range(rounds):
                got = db.run_script_sync(conn, statements.queues.claim_limited(
                    qs[0], queue="lim", owner="bench", limit=1, lease_s=30,
                    namespace=qs if count > 1 else (), home=home, keyed=keys > 0))
                assert got is not None and len(got) == 1, got
            return (time.perf_counter() - started) / rounds * 1e3
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for schema in names:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--keyed", action="store_true",
                        help="Also time keyed claims on one schema (one key; a key a row).")
    args = parser.parse_args()
    for _ in range(2):
        for count in (1, args.buckets):
            ms = measure(args.dsn, count, args.rounds)
            print(f"buckets={count}: {ms:.3f} ms per limited claim of one row "
                  f"({args.rounds} claims)")
        if args.keyed:
            for keys in (1, args.rounds):
                ms = measure(args.dsn, 1, args.rounds, keys=keys)
                print(f"keys={keys}: {ms:.3f} ms per keyed claim of one row "
                      f"({args.rounds} claims)")


if __name__ == "__main__":
    main()
