"""A claim's cost does not depend on the backlog: its plans read indexes in order and stop
early; no claim reads the queue sequentially. Nor does a completion: it finds the rows it
finishes and the parents it tells by primary key. Asserted on the plans, not on timings."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel import statements
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite
from tests.helpers import q

BACKLOG = 20_000


@pytest.fixture
def backlog(pg_dsn: str, schema: str) -> str:
    """A queue of BACKLOG executions, a second queue, suspects, due and future wake-ups."""
    q(pg_dsn, schema, """
        INSERT INTO {s}.workflow_executions (id, workflow, queue, priority, args, attempts,
                                             status, wake_at)
        SELECT gen_random_uuid(), 'wf', CASE WHEN i %% 50 = 0 THEN 'other' ELSE 'default' END,
               i %% 3, '[]', CASE WHEN i %% 1000 = 0 THEN 3 ELSE 0 END,
               CASE WHEN i %% 100 = 1 THEN 'waiting' ELSE 'queued' END,
               CASE WHEN i %% 100 = 1 THEN now() + (i %% 7 - 3) * interval '1 hour' END
          FROM generate_series(1, %s) AS i""", [BACKLOG])
    q(pg_dsn, schema, "INSERT INTO {s}.queue_limits (queue, concurrency) VALUES ('other', 5)")
    q(pg_dsn, schema, "ANALYZE {s}.workflow_executions")
    return schema


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += plan_nodes(child)
    return nodes


def explain(dsn: str, query: str, params: dict[str, Any], *, generic: bool) -> list[Any]:
    with psycopg.connect(dsn, prepare_threshold=None) as conn:  # one transaction, rolled back
        if generic:  # the plan a prepared statement settles on after five runs
            conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        row = conn.execute(pgsql.SQL("EXPLAIN (FORMAT JSON) ") + pgsql.SQL(query),  # type: ignore[arg-type]
                           params).fetchone()
        conn.rollback()  # SET LOCAL ends with it
    assert row is not None
    return plan_nodes(row[0][0]["Plan"])


def on_hot_table(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Relation Name") == "workflow_executions"]


CLAIM = {"owner": "w", "queues": ["default", "other"], "limit": 32, "lease_s": 30.0,
         "take_suspect": True, "workflows": ["wf"], "any_workflow": False,
         "max_history_bytes": 1 << 27, "app_version": "v1"}


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_claim_batch_reads_indexes_in_order_and_never_the_whole_queue(
    pg_dsn: str, backlog: str, generic: bool
) -> None:
    nodes = explain(pg_dsn, queries(backlog).claim_batch, CLAIM, generic=generic)
    hot = on_hot_table(nodes)
    assert [n for n in hot if "Seq" in n["Node Type"]] == []
    used = {n.get("Index Name") for n in hot}
    assert {"workflow_executions_claim_idx", "workflow_executions_suspect_idx",
            "workflow_executions_wake_idx"} <= used
    # No sort of the queue: whatever is sorted of it is a bounded set of index-ordered rows.
    # (A claimed execution's own checkpoints, ordered by step for its history, are no part
    # of the queue.)
    sorts = [n for n in nodes if n["Node Type"] == "Sort" and on_hot_table(plan_nodes(n))]
    assert all(any(c.get("Node Type") in ("Nested Loop", "Limit", "Append", "Subquery Scan")
                   for c in s.get("Plans", [])) for s in sorts), sorts


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_claim_limited_reads_indexes_in_order_and_never_the_whole_queue(
    pg_dsn: str, backlog: str, generic: bool
) -> None:
    nodes = explain(pg_dsn, queries(backlog).claim_limited,
                    {"queue": "other", "owner": "w", "limit": 32, "lease_s": 30.0,
                     "workflows": ["wf"], "any_workflow": False,
                     "max_history_bytes": 1 << 27, "app_version": "v1"},
                    generic=generic)
    hot = on_hot_table(nodes)
    assert [n for n in hot if "Seq" in n["Node Type"]] == []
    used = {n.get("Index Name") for n in hot}
    assert {"workflow_executions_claim_idx", "workflow_executions_wake_idx",
            "workflow_executions_running_queue_idx"} <= used


@pytest.mark.parametrize("rows", [6000, BACKLOG])
@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_complete_batch_finds_its_rows_by_primary_key_never_by_reading_the_queue(
    pg_dsn: str, schema: str, generic: bool, rows: int
) -> None:
    """A batch of 64 completions, tails and all, against a queue of *rows*: the lock of the
    finishing rows and the parents they tell was once an `IN (…)` that PostgreSQL planned as
    a hash join over two sequential scans of the hot table (6.4 ms of an 11 ms statement in
    the bench, BENCHMARKS.md), on a queue of a few thousand."""
    q(pg_dsn, schema, """
        INSERT INTO {s}.workflow_executions (id, workflow, queue, args, status)
        SELECT gen_random_uuid(), 'wf', 'default', '[]',
               CASE WHEN i %% 10 = 0 THEN 'running' ELSE 'queued' END
          FROM generate_series(1, %s) AS i""", [rows])
    q(pg_dsn, schema, "ANALYZE {s}.workflow_executions")
    ids = [uuid.uuid4() for _ in range(64)]
    stmt = statements.executions.complete_batch(queries(schema), [
        Finish(i, 1, Status.COMPLETED, "1", None, StepWrite(i, 1, 2, "s", "2", None, 1, 0.0))
        for i in ids])
    assert stmt.params is not None
    hot = on_hot_table(explain(pg_dsn, stmt.query, dict(stmt.params), generic=generic))
    assert hot and [n for n in hot if "Seq" in n["Node Type"]] == []
