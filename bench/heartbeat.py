"""What one heartbeat costs a process holding N running executions: WAL bytes (from the
LSN) and milliseconds per beat, as the worker sends it.

Since migration 0026 a beat writes one narrow row (the process's lease) and reads the
executions; before, it locked and rewrote each execution's row (a non-HOT update: the lease
column is in the running rows' index). The script runs against whichever tree is on
``PYTHONPATH``, so the same command measures both:

    python -m bench.heartbeat [--dsn postgresql://postgres@127.0.0.1:5432/postgres]

Without ``--dsn`` it runs on the bench's embedded PostgreSQL (in ``--data-dir``).
"""

from __future__ import annotations

import argparse
import inspect
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from bench.common import ROOT, database
from kestrel import db, statements
from kestrel.migrate import migrate
from kestrel.sql import queries


def _beat(conn: psycopg.Connection[Any], schema: str, owner: str,
          held: list[tuple[uuid.UUID, int]]) -> Callable[[], int]:
    """A beat as this tree's worker sends it; returns how many executions it kept."""
    q = queries(schema)
    stmt = statements.executions.heartbeat
    if "owner" in inspect.signature(stmt).parameters:  # a process's lease (0026 on)
        return lambda: len(db.run_script_sync(conn, stmt(  # type: ignore[call-arg]
            q, owner=owner, held=held, lease_s=30)).owned)
    return lambda: len(db.run_sync(conn, stmt(q, held=held, lease_s=30)))  # type: ignore


def measure(dsn: str, held: int, beats: int) -> tuple[float, float]:
    """(WAL bytes, milliseconds) per beat of a process holding *held* executions."""
    schema = f"bench_hb_{uuid.uuid4().hex[:10]}"
    migrate(dsn, schema)
    q = queries(schema)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'SELECT "{schema}".submit(\'w\', jsonb_build_array(i)) '
                         f"FROM generate_series(1, {held}) AS i")
            beat0 = _beat(conn, schema, "bench", [])
            if hasattr(statements.executions, "held_by"):
                beat0()  # the lease the claims run under
            claimed = db.run_sync(conn, statements.executions.claim_batch(
                q, owner="bench", queues=["default"], limit=held, lease_s=30))
            assert len(claimed) == held, len(claimed)
            beat = _beat(conn, schema, "bench", [(c.id, c.epoch) for c in claimed])
            assert beat() == held
            conn.execute("CHECKPOINT")  # full-page images: every beat after the first page
            before = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
            started = time.perf_counter()
            for _ in range(beats):
                assert beat() == held
            elapsed = time.perf_counter() - started
            wal = conn.execute("SELECT pg_current_wal_insert_lsn() - %s::pg_lsn",
                               [before[0] if before else None]).fetchone()
            return float(wal[0] if wal else 0) / beats, elapsed / beats * 1e3
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="PostgreSQL to use (default: embedded, in --data-dir)")
    parser.add_argument("--data-dir", default=str(ROOT / ".kestrel" / "bench-pgdata"))
    parser.add_argument("--held", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--beats", type=int, default=50)
    args = parser.parse_args()
    dsn, _server = database(args.dsn, args.data_dir)
    for held in args.held:
        wal, ms = measure(dsn, held, args.beats)
        print(f"held={held}: {wal:,.0f} B of WAL and {ms:.2f} ms per beat "
              f"({args.beats} beats)")


if __name__ == "__main__":
    main()
