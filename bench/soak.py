"""Soak: push many workflows through kestrel-runtime and watch the hot tables stay flat.

    python -m bench.soak --workflows 1000000 --every 100000

The submitter keeps at most --backlog executions queued (a steady arrival stream, as in
production, rather than a million-row queue up front). Every --every finished workflows it
prints throughput for that block, the hot table's size and dead tuples, the checkpoints'
(written once into partitions they never leave: no dead tuples) and history's size.
The run fails if any workflow is lost or ends other than completed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from bench.common import ROOT, database, fresh_schema, git_rev, machine

SCHEMA = "bench_soak"


def _s(text: str) -> pgsql.Composed:
    return pgsql.SQL(text).format(s=pgsql.Identifier(SCHEMA))  # type: ignore[arg-type]


FINISHED = """
SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables
 WHERE schemaname = %s AND relname LIKE 'workflow\\_history%%'
"""


def finished(conn: psycopg.Connection[Any]) -> int:
    """Rows ever inserted into history: cumulative statistics, so the harness's own load
    stays constant as history grows (a count(*) over millions of rows would not)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return int((conn.execute(FINISHED, [SCHEMA]).fetchone() or [0])[0])


def _submitter(dsn: str, total: int, backlog: int, chunk: int, stop: threading.Event) -> None:
    submit = _s("SELECT {s}.submit('bench', '[3, \"noop\", 0]'::jsonb) "
                "FROM generate_series(1, %s)")
    sent = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while sent < total and not stop.is_set():
            depth = sent - finished(conn)
            if depth < backlog:
                n = min(chunk, total - sent)
                conn.execute(submit, [n])
                sent += n
            else:
                time.sleep(0.05)


def snapshot(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute(
        "SELECT relname, pg_total_relation_size(relid), n_live_tup, n_dead_tup "
        "FROM pg_stat_user_tables WHERE schemaname = %s", [SCHEMA]).fetchall()
    tables = {r[0]: {"bytes": r[1], "live": r[2], "dead": r[3]} for r in rows}
    hot = {"workflow_executions": tables.get("workflow_executions",
                                             {"bytes": 0, "live": 0, "dead": 0})}
    # Checkpoints are written once into partitions they never leave (migration 0019): all of
    # operation_outputs' partitions together, whose dead tuples stay at 0.
    parts = [v for k, v in tables.items() if k.startswith("operation_outputs")]
    hot["operation_outputs"] = {key: sum(v[key] for v in parts)
                                for key in ("bytes", "live", "dead")}
    history_bytes = sum(v["bytes"] for k, v in tables.items()
                        if k.startswith("workflow_history"))
    return {"hot": hot, "history_bytes": history_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn")
    ap.add_argument("--data-dir", default=str(ROOT / ".kestrel" / "bench-pgdata"))
    ap.add_argument("--workflows", type=int, default=1_000_000)
    ap.add_argument("--every", type=int, default=100_000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--backlog", type=int, default=20_000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ns = ap.parse_args(argv)

    dsn, server = database(ns.dsn, ns.data_dir)
    fresh_schema(dsn, SCHEMA)
    print(f"kestrel soak on {machine()}, commit {git_rev()}: {ns.workflows:,} workflows × 3 "
          f"no-op steps, --procs {ns.procs} --concurrency {ns.concurrency}")
    stop = threading.Event()
    submitter = threading.Thread(target=_submitter,
                                 args=(dsn, ns.workflows, ns.backlog, 10_000, stop))
    runtime = subprocess.Popen(
        [sys.executable, "-m", "kestrel", "--app", "bench.workloads", "--dsn", dsn,
         "--schema", SCHEMA, "--procs", str(ns.procs), "--concurrency", str(ns.concurrency),
         "--log-level", "warning"], env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    submitter.start()
    rows: list[dict[str, Any]] = []
    head = (f"{'finished':>10} {'wf/s':>7} {'hot exec kB':>11} {'dead':>6} "
            f"{'steps kB':>12} {'dead':>6} {'history MB':>10}")
    print(head + "\n" + "-" * len(head))
    try:
        with psycopg.connect(dsn, autocommit=True) as mon:
            mark, mark_t, next_report = 0, time.monotonic(), ns.every
            while mark < ns.workflows:
                time.sleep(0.5)
                done = finished(mon)
                if runtime.poll() is not None:
                    raise RuntimeError(f"kestrel-runtime exited with {runtime.returncode}")
                if done >= next_report or done >= ns.workflows:
                    now = time.monotonic()
                    snap = snapshot(mon)
                    row = {"finished": done, "workflows_per_s": (done - mark) / (now - mark_t),
                           **snap}
                    rows.append(row)
                    h = snap["hot"]
                    print(f"{done:>10,} {row['workflows_per_s']:7.0f} "
                          f"{h['workflow_executions']['bytes'] / 1024:11.0f} "
                          f"{h['workflow_executions']['dead']:>6} "
                          f"{h['operation_outputs']['bytes'] / 1024:12.0f} "
                          f"{h['operation_outputs']['dead']:>6} "
                          f"{snap['history_bytes'] / 2**20:10.0f}", flush=True)
                    mark, mark_t = done, now
                    next_report = (done // ns.every + 1) * ns.every
            bad = mon.execute(_s("SELECT count(*) FROM {s}.workflow_history "
                                 "WHERE status <> 'completed'")).fetchone()
            live = mon.execute(_s("SELECT count(*) FROM {s}.workflow_executions")).fetchone()
    finally:
        stop.set()
        submitter.join()
        runtime.send_signal(signal.SIGTERM)
        runtime.wait(timeout=60)
    first, last = rows[0]["workflows_per_s"], rows[-1]["workflows_per_s"]
    print(f"\nnot completed: {bad[0] if bad else '?'}, still live: {live[0] if live else '?'}; "
          f"last tenth / first tenth throughput: {last / first:.2f}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps({"machine": machine(), "commit": git_rev(),
                                "args": vars(ns), "rows": rows}, indent=2))
    print(f"wrote {path}")
    del server
    return 0 if (bad and bad[0] == 0 and live and live[0] == 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
