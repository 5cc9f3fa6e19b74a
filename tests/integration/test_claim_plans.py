"""A claim's cost does not depend on the backlog: its plans read indexes in order and stop
early; no claim reads the queue sequentially. Nor does a completion: it finds the rows it
finishes and the parents it tells by primary key. Asserted on the plans, not on timings."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel import statements
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite
from tests.helpers import plan_of, q, q1, wait_until

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
        plan = plan_of(conn, query, params, generic=generic)
        conn.rollback()
    return plan_nodes(plan)


def on_hot_table(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Relation Name") == "workflow_executions"]


def hot_indexes(nodes: list[dict[str, Any]]) -> set[str]:
    """The hot table's indexes a plan reads (a bitmap's index scan names no relation)."""
    return {n["Index Name"] for n in nodes
            if n.get("Index Name", "").startswith("workflow_executions_")}


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


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_claim_keyed_walks_keys_by_index_never_a_keys_rows(
    pg_dsn: str, schema: str, generic: bool
) -> None:
    """A keyed queue of BACKLOG rows, almost all of one key, 50 other keys and a few rows
    without one: the claim reads the keys through their index and each key's best rows,
    and no more of the queue than the bound of rows without a key."""
    q(pg_dsn, schema, """
        INSERT INTO {s}.workflow_executions (id, workflow, queue, args, status,
                                             concurrency_key)
        SELECT gen_random_uuid(), 'wf', 'keyed', '[]',
               CASE WHEN i %% 100 = 0 THEN 'running' ELSE 'queued' END,
               CASE WHEN i %% 400 = 3 THEN NULL WHEN i %% 200 = 1 THEN 'k' || (i %% 50)
                    ELSE 'big' END
          FROM generate_series(1, %s) AS i""", [BACKLOG])
    q(pg_dsn, schema, "INSERT INTO {s}.queue_limits (queue, per_key, key_turn) "
                      "VALUES ('keyed', 2, 'k20')")
    q(pg_dsn, schema, "ANALYZE {s}.workflow_executions")
    params = {"queue": "keyed", "owner": "w", "limit": 32, "lease_s": 30.0, "budget": 32,
              "per_key": 2, "run_keys": ["big"], "run_counts": [1], "max_keys": 100,
              "want_keys": 40,
              "workflows": ["wf"], "any_workflow": False, "max_history_bytes": 1 << 27,
              "app_version": "v1"}
    nodes = explain(pg_dsn, queries(schema).claim_keyed, params, generic=generic)
    hot = on_hot_table(nodes)
    assert [n for n in hot if "Seq" in n["Node Type"]] == []
    assert "workflow_executions_key_claim_idx" in hot_indexes(nodes)
    # Every read of the queue stops early: each scan of the hot table is under a Limit (the
    # probes, a key's best rows, the rows without a key, the woken), or finds rows by id.
    with psycopg.connect(pg_dsn, prepare_threshold=None) as conn:
        plan = plan_of(conn, queries(schema).claim_keyed, params, generic=generic)
        conn.rollback()
    by_id = {"workflow_executions_pkey"}
    unbounded = [n.get("Index Name", n["Node Type"]) for n in hot_reads_not_under_a_limit(
        plan) if n["Node Type"] != "ModifyTable"  # the claim's own rows
        and {c.get("Index Name") for c in plan_nodes(n) if "Index Name" in c} != by_id]
    assert unbounded == []


def hot_reads_not_under_a_limit(plan: dict[str, Any],
                                limited: bool = False) -> list[dict[str, Any]]:
    limited = limited or plan["Node Type"] == "Limit"
    found = [plan] if plan.get("Relation Name") == "workflow_executions" and not limited else []
    for child in plan.get("Plans", []):
        found += hot_reads_not_under_a_limit(child, limited)
    return found


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


@pytest.fixture
def in_flight(backlog: str, pg_dsn: str) -> str:
    """The backlog with 500 of its rows running, among the others in the list's order (one
    created_at, ids spread), leases due at spread times, some expired."""
    q(pg_dsn, backlog, """
        UPDATE {s}.workflow_executions
           SET status = 'running', lease_epoch = 1, lease_owner = 'w',
               lease_expires_at = now() + ((i.n % 40) - 5) * interval '1 second'
          FROM (SELECT id, row_number() OVER (ORDER BY id DESC) AS n
                  FROM {s}.workflow_executions WHERE status = 'queued') AS i
         WHERE workflow_executions.id = i.id AND i.n % 30 = 0 AND i.n <= 15000""")
    q(pg_dsn, backlog, "ANALYZE {s}.workflow_executions")
    return backlog


PAGE = {"status": None, "workflow": None, "queue": None, "since": None, "until": None,
        "app_version": None, "patch": None, "with_patch": True, "tags": None,
        "after_at": None, "after_id": None, "limit": 50}


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_a_page_of_executions_reads_indexes_in_order_running_rows_included(
    pg_dsn: str, in_flight: str, generic: bool
) -> None:
    """Running rows have no entry in the list's index (migration 0020: a claim would write
    one): the page merges that index, read in order, with the running rows, read from their
    own index; never the whole queue. And the page is the right one: newest first, running
    rows in their place, page after page."""
    nodes = explain(pg_dsn, queries(in_flight).page_executions, PAGE, generic=generic)
    hot = on_hot_table(nodes)
    assert [n for n in hot if "Seq" in n["Node Type"]] == []
    # (The generic plan also holds the patch filter's subplans, which find a marker's
    # execution by id; they run only when a patch is asked for.)
    assert hot_indexes(nodes) - {"workflow_executions_pkey"} == {
        "workflow_executions_created_idx", "workflow_executions_running_queue_idx"}
    # What is sorted of the hot table is its running rows only.
    for sort in (n for n in nodes if n["Node Type"] == "Sort"):
        assert hot_indexes(plan_nodes(sort)) <= {"workflow_executions_running_queue_idx",
                                                 "workflow_executions_pkey"}, sort

    every = [(r[0], r[1]) for r in q(pg_dsn, in_flight, """
        SELECT created_at, id FROM {s}.workflow_executions
         ORDER BY created_at DESC, id DESC""")]
    running = {r[0] for r in q(pg_dsn, in_flight, """
        SELECT id FROM {s}.workflow_executions WHERE status = 'running'""")}
    paged: list[tuple[Any, Any]] = []
    params = dict(PAGE, limit=700)
    with psycopg.connect(pg_dsn, prepare_threshold=None) as conn:
        while len(paged) < 3_500:
            rows = conn.execute(pgsql.SQL(queries(in_flight).page_executions),  # type: ignore[arg-type]
                                params).fetchall()
            paged += [(r[5], r[0]) for r in rows]
            params = dict(params, after_at=rows[-1][5], after_id=rows[-1][0])
    assert paged == every[:3_500]
    assert 50 < len(running & {i for _, i in paged}) < 500


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_sweeper_reads_running_rows_only(pg_dsn: str, in_flight: str,
                                             generic: bool) -> None:
    """lease_idx is gone (migration 0020): the sweeper finds expired leases among the running
    rows' entries of running_queue_idx, never among the queue."""
    stmt = statements.sweeper.reenqueue_expired(queries(in_flight), limit=100, max_attempts=5)
    hot = on_hot_table(explain(pg_dsn, stmt.query, dict(stmt.params or {}), generic=generic))
    assert [n for n in hot if "Seq" in n["Node Type"]] == []
    assert "workflow_executions_running_queue_idx" in hot_indexes(hot)


RUNNING = 4_000  # what --procs 16 at 256 a process holds running


@pytest.fixture
def running_unseen(direct_dsn: str, schema: str) -> tuple[str, list[uuid.UUID]]:
    """RUNNING executions running, most of them children, where the statistics last saw
    a few running and no child: what the planner knows mid-run, when autovacuum analyzed
    the table between bursts. The 64 ids of a batch, none of them a child.

    Made on one direct connection whose server process has exited, its counts flushed,
    before the test starts: the test counts the index entries read after it, and a fixture's
    process flushing its own later (5,563 of running_queue_idx, once in CI under load) would
    be taken for the statements under test's."""
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        pid = conn.info.backend_pid

        def run(sql: str, *params: Any) -> list[Any]:
            cur = conn.execute(pgsql.SQL(sql).format(s=pgsql.Identifier(schema)), params)
            return cur.fetchall() if cur.description else []

        run("""
            INSERT INTO {s}.workflow_executions (id, workflow, queue, args, status,
                                                 lease_epoch, lease_owner)
            SELECT gen_random_uuid(), 'wf', 'default', '[]',
                   CASE WHEN i <= 20 THEN 'running' ELSE 'queued' END, 1,
                   CASE WHEN i <= 20 THEN 't' END
              FROM generate_series(1, %s) AS i""", RUNNING * 2)
        run("ANALYZE {s}.workflow_executions")
        run("""
            UPDATE {s}.workflow_executions SET status = 'running', lease_owner = 't'
             WHERE id IN (SELECT id FROM {s}.workflow_executions WHERE status = 'queued'
                           LIMIT %s)""", RUNNING - 20)
        ids = [r[0] for r in run("SELECT id FROM {s}.workflow_executions "
                                 "WHERE status = 'running' LIMIT 64")]
        # and the other running executions are children of one queued, also unseen
        run("""
            UPDATE {s}.workflow_executions
               SET parent_id = (SELECT id FROM {s}.workflow_executions WHERE status = 'queued'
                                 LIMIT 1)
             WHERE status = 'running' AND NOT id = ANY (%s)""", ids)
    wait_until(lambda: q1(direct_dsn, schema, "SELECT count(*) FROM pg_stat_activity "
                          "WHERE pid = %s", [pid]) == 0, timeout=30,
               what="the fixture's server process to exit (flushing its counts)")
    return schema, ids


def not_by_primary_key(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hot table's scans that are not by its primary key alone (a bitmap scan reads
    the indexes of the nodes under it)."""
    def indexes(n: dict[str, Any]) -> set[Any]:
        if n["Node Type"] == "Bitmap Heap Scan":
            return {c.get("Index Name") for c in plan_nodes(n)[1:]
                    if c["Node Type"] == "Bitmap Index Scan"}
        return {n.get("Index Name")}
    return [n for n in on_hot_table(nodes)
            if n["Node Type"] != "ModifyTable" and indexes(n) != {"workflow_executions_pkey"}]


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_checkpoint_batch_finds_its_owners_by_primary_key_whatever_the_statistics(
    pg_dsn: str, running_unseen: tuple[str, list[uuid.UUID]], generic: bool
) -> None:
    """A checkpoint batch locks the executions it writes for, by primary key. Written as
    `(id, epoch) IN (…)` of the batch, PostgreSQL planned it as a scan of the running index
    (all running executions) when the statistics counted few running: a cost per batch that
    grows with everything running (auto_explain: 416 rows read where 27 were estimated)."""
    schema, ids = running_unseen
    stmt = statements.steps.save_steps(queries(schema), [
        StepWrite(i, 1, 1, "s", "1", None, 1, 0.0) for i in ids])
    assert stmt.params is not None
    nodes = explain(pg_dsn, stmt.query, dict(stmt.params), generic=generic)
    assert on_hot_table(nodes) and not_by_primary_key(nodes) == []


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_completion_deletes_by_primary_key_whatever_the_statistics(
    pg_dsn: str, running_unseen: tuple[str, list[uuid.UUID]], generic: bool
) -> None:
    """The completion's DELETE, too: never the running index's every entry."""
    schema, ids = running_unseen
    stmt = statements.executions.complete_batch(queries(schema), [
        Finish(i, 1, Status.COMPLETED, "1", None, None) for i in ids])
    assert stmt.params is not None
    nodes = explain(pg_dsn, stmt.query, dict(stmt.params), generic=generic)
    assert on_hot_table(nodes) and not_by_primary_key(nodes) == []


def index_reads(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """Index entries read so far, by index of the hot table (what ran, not what was planned)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return dict(conn.execute(
        "SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes"
        " WHERE schemaname = %s AND relname = 'workflow_executions'", [schema]).fetchall())


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("delegated", [False, True], ids=["statement", "function"])
def test_batches_read_the_primary_key_only_whatever_the_statistics(
    direct_dsn: str, running_unseen: tuple[str, list[uuid.UUID]], delegated: bool,
    generic: bool
) -> None:
    """Run, not explained: a heartbeat, a checkpoint batch and a completion batch, the
    latter two as statements and in their Citus form (save_steps() and finish_batch(),
    PL/pgSQL, whose plans EXPLAIN cannot show), read no index of the hot table but its
    primary key: not every running execution's entry, not every child's. Direct, in the
    PgBouncer pass too: a session's counts are flushed by the server process that ran it."""
    schema, ids = running_unseen
    q_ = queries(schema)
    batches = [
        statements.executions.held_by(q_, owner="t", held=[(i, 1) for i in ids]),
        statements.steps.save_steps(q_, [StepWrite(i, 1, 1, "s", "1", None, 1, 0.0)
                                         for i in ids], delegated=delegated),
        statements.executions.complete_batch(
            q_, [Finish(i, 1, Status.COMPLETED, "1", None, None) for i in ids],
            delegated=delegated),
    ]
    with psycopg.connect(direct_dsn, autocommit=True, prepare_threshold=None) as watcher, \
            psycopg.connect(direct_dsn, autocommit=True, prepare_threshold=None) as conn:
        before = index_reads(watcher, schema)
        if generic:
            conn.execute("SET plan_cache_mode = force_generic_plan")
        finished = []
        for stmt in batches:
            assert stmt.params is not None
            finished.append(conn.execute(stmt.query, dict(stmt.params)).fetchall())
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")  # the flush happens when this session goes idle after it
        extended, saved, done = finished  # each did its work
        assert len(extended) == len(ids)  # every one still ours
        assert [r[3] for r in saved] == [True] * len(ids)  # inserted
        assert len(done) == len(ids)
        for _ in range(200):  # the server flushes a session's counts within a second
            read = {k: v - before.get(k, 0) for k, v in index_reads(watcher, schema).items()}
            if read.get("workflow_executions_pkey", 0) >= len(ids):
                break
            time.sleep(0.05)
    assert read["workflow_executions_pkey"] >= len(ids)
    assert {k: v for k, v in read.items() if v and k != "workflow_executions_pkey"} == {}
