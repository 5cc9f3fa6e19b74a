"""Per-statement server profiles of one side of a bench run (``bench.run --statements``).

Each side (kestrel, and every run of each floor) starts from ``pg_stat_statements_reset()``
and reads the view when its workflows have finished, so one invocation profiles both sides
on the same server: calls, server execution time, rows and WAL bytes per statement, per
workflow. It needs a server that preloads the extension (``shared_preload_libraries =
'pg_stat_statements'``, then ``CREATE EXTENSION pg_stat_statements``), given by ``--dsn``:
the embedded server is built without it. The bench's own monitoring reads are left out.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

MONITOR = ("pg_stat_statements", "pg_stat_database", "pg_stat_activity",
           "pg_stat_clear_snapshot", "pg_backend_pid", "pg_current_wal_lsn",
           "workflow_history WHERE queue", "pg_stat_user_tables")
"""Text that marks the bench's own reads (counters, progress polls), not a side's work."""


class NotAvailable(RuntimeError):
    """The server cannot profile statements: the extension is missing or not preloaded."""


def check(conn: psycopg.Connection[Any]) -> None:
    """Raise :class:`NotAvailable`, saying how to fix it, unless *conn*'s server can
    profile statements."""
    try:
        conn.execute("SELECT 1 FROM pg_stat_statements LIMIT 1")
    except psycopg.Error as exc:
        raise NotAvailable(
            "--statements needs pg_stat_statements on the server given by --dsn: "
            "shared_preload_libraries = 'pg_stat_statements' in its postgresql.conf (a "
            "restart), then CREATE EXTENSION pg_stat_statements in its database "
            f"({type(exc).__name__}: {str(exc).strip()[:160]})") from None


def reset(conn: psycopg.Connection[Any]) -> None:
    """Start a side's profile from zero."""
    conn.execute("SELECT pg_stat_statements_reset()")


def read(conn: psycopg.Connection[Any], workflows: int) -> list[dict[str, Any]]:
    """The statements run since :func:`reset` in this database, per workflow, the costliest
    first (server execution time); the bench's own reads left out. ``nested`` marks a
    statement run inside a function (counted in its caller's time too)."""
    rows = conn.execute(
        "SELECT query, NOT toplevel, calls, total_exec_time, rows, wal_bytes::bigint, "
        "       wal_fpi "
        "  FROM pg_stat_statements "
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        " ORDER BY total_exec_time DESC").fetchall()
    out = []
    for query, nested, calls, ms, nrows, wal, fpi in rows:
        text = re.sub(r"\s+", " ", str(query)).strip()
        if any(m in text for m in MONITOR):
            continue
        out.append({"statement": text[:160], "nested": bool(nested),
                    "calls_per_workflow": calls / workflows,
                    "server_us_per_workflow": ms * 1000 / workflows,
                    "us_per_call": ms * 1000 / calls if calls else 0.0,
                    "rows_per_call": nrows / calls if calls else 0.0,
                    "wal_bytes_per_workflow": int(wal) / workflows,
                    "fpi_per_workflow": int(fpi) / workflows})
    return out


def table(name: str, stmts: list[dict[str, Any]], limit: int = 14) -> str:
    """*stmts* as a text table under *name*, with the top-level statements' totals."""
    top = [s for s in stmts if not s["nested"]]
    head = (f"{name}: statements per workflow (pg_stat_statements; top level: "
            f"{sum(s['calls_per_workflow'] for s in top):.2f} calls, "
            f"{sum(s['server_us_per_workflow'] for s in top):.0f} µs of execution, "
            f"{sum(s['wal_bytes_per_workflow'] for s in top):.0f} B of WAL)")
    lines = [head, f"  {'calls/wf':>8} {'µs/wf':>7} {'µs/call':>8} {'rows/call':>9} "
                   f"{'WAL B/wf':>8}  statement"]
    for s in stmts[:limit]:
        mark = "  (nested) " if s["nested"] else "  "
        lines.append(f"  {s['calls_per_workflow']:8.3f} {s['server_us_per_workflow']:7.1f} "
                     f"{s['us_per_call']:8.1f} {s['rows_per_call']:9.1f} "
                     f"{s['wal_bytes_per_workflow']:8.0f}{mark}{s['statement'][:90]}")
    return "\n".join(lines)
