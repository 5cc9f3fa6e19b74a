"""History indexes what is looked up, not every success (migration 0012, issue 16).

workflow_history_status_idx is partial (``WHERE status <> 'completed'``): a completed
execution, most of history, writes no entry into it (one index entry less of WAL per
workflow), while "which executions failed" is still answered through it. Asserted on index
sizes and plans, not on timings.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql as pgsql

from tests.helpers import q, q1

COMPLETED = 20_000
FAILED = 30


def _fill(dsn: str, schema: str) -> None:
    """COMPLETED completed and FAILED failed executions in history, finished today."""
    q(dsn, schema, """
        INSERT INTO {s}.workflow_history (id, workflow, queue, priority, status, args, result,
                                          error, lease_epoch, attempts, created_at, started_at,
                                          finished_at)
        SELECT gen_random_uuid(), 'wf', 'default', 0,
               CASE WHEN i <= %s THEN 'failed' ELSE 'completed' END, '[]', NULL, NULL, 1, 1,
               {s}.kestrel_now(), {s}.kestrel_now(), {s}.kestrel_now()
          FROM generate_series(1, %s) AS i""", [FAILED, FAILED + COMPLETED])
    q(dsn, schema, "ANALYZE {s}.workflow_history")


def _index_bytes(dsn: str, schema: str, index: str) -> int:
    """Bytes of a partitioned index over all its partitions."""
    return int(q1(dsn, schema, """
        SELECT coalesce(sum(pg_relation_size(i.inhrelid)), 0)
          FROM pg_inherits AS i
         WHERE i.inhparent = (quote_ident(%s) || '.' || quote_ident(%s))::regclass""",
                  [schema, index]))


def test_completed_executions_write_no_status_index_entry(pg_dsn: str, schema: str) -> None:
    _fill(pg_dsn, schema)
    status = _index_bytes(pg_dsn, schema, "workflow_history_status_idx")
    by_workflow = _index_bytes(pg_dsn, schema, "workflow_history_workflow_idx")
    partitions = int(q1(pg_dsn, schema, """
        SELECT count(*) FROM pg_inherits
         WHERE inhparent = (quote_ident(%s) || '.workflow_history')::regclass""", [schema]))
    # 20,000 entries take dozens of pages (the workflow index); the 30 failed ones fit in one
    # leaf page, next to each partition's metapage: completed executions are not in it.
    assert by_workflow > 20 * 8192
    assert status <= (partitions + 1) * 8192, (status, partitions)
    indexdef = q1(pg_dsn, schema, "SELECT indexdef FROM pg_indexes WHERE schemaname = %s "
                  "AND indexname = 'workflow_history_status_idx'", [schema])
    assert "WHERE (status <> 'completed'::text)" in indexdef


def test_failed_executions_are_still_found_through_the_status_index(
    pg_dsn: str, schema: str
) -> None:
    _fill(pg_dsn, schema)
    query = pgsql.SQL("SELECT id FROM {s}.workflow_history WHERE status = %s "
                      "AND finished_at > {s}.kestrel_now() - interval '1 month'"
                      ).format(s=pgsql.Identifier(schema))
    with psycopg.connect(pg_dsn, prepare_threshold=None) as conn:  # one transaction
        rows = conn.execute(query, ["failed"]).fetchall()
        plan = conn.execute(pgsql.SQL("EXPLAIN (FORMAT JSON) ") + query, ["failed"]).fetchone()
        conn.rollback()
    assert len(rows) == FAILED
    assert plan is not None
    used = {n.get("Index Name", "") for n in _nodes(plan[0][0]["Plan"])}
    assert any(name.endswith("status_finished_at_idx") or "status" in name for name in used), used
    # A status no execution has: nothing, and no error (the predicate is not a filter).
    assert q(pg_dsn, schema, "SELECT id FROM {s}.workflow_history WHERE status = %s",
             ["x'); DROP TABLE workflow_history; --\x01"]) == []


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += _nodes(child)
    return out
