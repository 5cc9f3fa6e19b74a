"""History: the exactly-once move, partition upkeep under traffic, views across the move."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel.cli import main
from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, q, q1, run_worker_until, runtime, submit_many

PLACES = """
SELECT (SELECT count(*) FROM {s}.workflow_executions)
     + (SELECT count(*) FROM {s}.workflow_history),
       (SELECT count(*) FROM {s}.workflow_executions e
          JOIN {s}.workflow_history h USING (id)),
       (SELECT count(*) FROM {s}.workflow_steps)
     - (SELECT count(*) FROM {s}.operation_outputs),
       (SELECT count(*) FROM {s}.workflow_history)
"""


def test_each_execution_is_in_exactly_one_place_at_every_moment(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    n = 3000
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", n)
    samples: list[tuple[int, int, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
            stmt = pgsql.SQL(PLACES).format(s=pgsql.Identifier(schema))
            while not stop.is_set():
                # One statement, one snapshot: hot and history are seen at the same instant.
                samples.append(conn.execute(stmt).fetchone())  # type: ignore[arg-type]

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with runtime(pg_dsn, schema, procs=3, log=tmp_path / "rt.log"):
            deadline = time.monotonic() + 120
            while finished_count(pg_dsn, schema) < n and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        stop.set()
        sampler.join()
    assert finished_count(pg_dsn, schema) == n
    moving = [s for s in samples if 0 < s[3] < n]
    assert len(moving) >= 5, "the sampler must have seen the move in progress"
    for total, in_both, steps_in_both, _ in samples:
        assert (total, in_both, steps_in_both) == (n, 0, 0)
    # Everything ended up in history; each checkpoint was written once and never moved
    # (migration 0019), so every one shows as a finished execution's; the hot table is empty.
    assert q(pg_dsn, schema, "SELECT (SELECT count(*) FROM {s}.operation_outputs), "
             "(SELECT count(*) FROM {s}.step_history), "
             "(SELECT count(*) FROM {s}.workflow_executions)") == [(3 * n, 3 * n, 0)]


def test_views_return_the_same_rows_before_and_after_the_move(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.approval, 5)
    run_worker_until(pg_dsn, config(schema), lambda: client.get(h.id).status.value == "waiting")
    steps_sql = ("SELECT step_id, step_name, attempt, output, error, started_at, finished_at "
                 "FROM {s}.workflow_steps WHERE execution_id = %s ORDER BY step_id")
    exec_sql = ("SELECT id, workflow, queue, args, created_at, started_at "
                "FROM {s}.executions WHERE id = %s")
    live_steps = q(pg_dsn, schema, steps_sql, [h.id])
    live_exec = q(pg_dsn, schema, exec_sql, [h.id])
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs") == 1
    client.signal(h.id, "approve", "ok")
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    # The checkpoints stay where they were written (migration 0019).
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs") == 3
    done_steps = q(pg_dsn, schema, steps_sql, [h.id])
    assert done_steps[: len(live_steps)] == live_steps
    assert [r[1] for r in done_steps] == ["add", "kestrel.signal:approve", "add"]
    assert q(pg_dsn, schema, exec_sql, [h.id]) == live_exec
    assert q1(pg_dsn, schema, "SELECT status FROM {s}.executions WHERE id = %s",
              [h.id]) == "completed"
    # show/result still work from history.
    assert client.result(h.id, timeout=1)["payload"] == "ok"
    assert [s.name for s in client.steps(h.id)] == ["add", "kestrel.signal:approve", "add"]


def test_failed_workflows_by_step_is_one_select(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    for _ in range(3):
        client.submit(app.fails_in_step)
    client.submit(app.three_steps, 1)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 4)
    rows = q(pg_dsn, schema, """
        SELECT workflow, step_name, count(*)
          FROM {s}.workflow_steps
         WHERE execution_status = 'failed' AND error IS NOT NULL
           AND execution_finished_at > now() - interval '1 month'
         GROUP BY 1, 2""")
    assert rows == [("fails_in_step", "not_retried", 3)]


def _old_partition(pg_dsn: str, schema: str, days_ago: int) -> str:
    """Create the history partitions of a day *days_ago* days back, with a row in each."""
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = %s",
      [f"-{days_ago} days"])
    q(pg_dsn, schema, "SELECT {s}.kestrel_ensure_history_partitions_v1('day', 0, true)")
    q(pg_dsn, schema, "INSERT INTO {s}.workflow_history (id, workflow, queue, priority, "
      "status, args, lease_epoch, attempts, created_at, finished_at) VALUES "
      "(gen_random_uuid(), 'old', 'default', 0, 'completed', '[]', 1, 1, "
      "{s}.kestrel_now(), {s}.kestrel_now())")
    name = q1(pg_dsn, schema, "SELECT 'workflow_history_p' || "
              "to_char({s}.kestrel_now() AT TIME ZONE 'UTC', 'YYYYMMDD')")
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '0'")
    return str(name)


def test_dropping_an_old_partition_under_traffic_blocks_nothing(
    pg_dsn: str, schema: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _old_partition(pg_dsn, schema, 40)
    assert q1(pg_dsn, schema, "SELECT to_regclass(%s) IS NOT NULL", [f"{schema}.{old}"])
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    # The runtime keeps history for ever here, so only this test's upkeep drops anything.
    with runtime(pg_dsn, schema, procs=2, args=["--history-retention-days", "0"],
                 log=tmp_path / "rt.log"):
        submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 10_000)
        time.sleep(0.5)  # completions are flowing
        # A long reader holds the old partition: upkeep must give up fast, not queue the
        # hot path's inserts behind its lock request.
        # (Closed whatever happens: left open, it would hold the schema's teardown.)
        with psycopg.connect(pg_dsn) as reader:
            reader.execute(pgsql.SQL("SELECT count(*) FROM {}.{}").format(
                pgsql.Identifier(schema), pgsql.Identifier(old)))
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable), \
                    psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(pgsql.SQL("SELECT {}.kestrel_drop_history_partitions_v1("
                                       "interval '30 days')").format(pgsql.Identifier(schema)))
            assert time.monotonic() - started < 2.0
            before = finished_count(pg_dsn, schema)
            time.sleep(3.0)  # the reader holds on: DDL queued behind it would stall us this long
            assert finished_count(pg_dsn, schema) > before  # the hot path kept completing
        # Reader gone: the CLI's upkeep round drops it while workers keep running.
        code = main(["partitions", "--dsn", pg_dsn, "--schema", schema, "--json",
                     "--log-level", "error"])
        assert code == 0
        # workflow_history, signal_history, event_history, and operation_outputs' partition
        # of that day (no execution created then is live or in history)
        assert '"dropped": 4' in capsys.readouterr().out
        while finished_count(pg_dsn, schema) < 10_000:
            time.sleep(0.2)
    assert q1(pg_dsn, schema, "SELECT to_regclass(%s)", [f"{schema}.{old}"]) is None
    gaps = q1(pg_dsn, schema, "SELECT max(gap) FROM (SELECT finished_at - lag(finished_at) "
              "OVER (ORDER BY finished_at) AS gap FROM {s}.workflow_history "
              "WHERE workflow = 'three_steps') g")
    # Upkeep's DDL waits at most lock_timeout (200 ms) and holds its locks for milliseconds;
    # 2 s leaves room for a loaded CI machine while still catching a hot path stuck behind
    # DDL (which would stall until the reader's transaction ended).
    assert gaps.total_seconds() < 2.0, f"completions stalled for {gaps}"
    assert client.counts()["completed"] == 10_000


def test_the_partitions_command_waits_out_a_busy_partition_and_then_drops_it(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Upkeep's DDL gives up after lock_timeout so the hot path never queues behind it; the
    operator's command tries the round again instead of failing on the first busy moment (it
    failed under CI's traffic: test_dropping_an_old_partition_under_traffic_blocks_nothing)."""
    import threading

    old = _old_partition(pg_dsn, schema, 40)
    reader = psycopg.connect(pg_dsn)  # a long reader holds the old partition
    reader.execute(pgsql.SQL("SELECT count(*) FROM {}.{}").format(
        pgsql.Identifier(schema), pgsql.Identifier(old)))
    release = threading.Timer(1.0, reader.close)  # ... for a second
    release.start()
    try:
        code = main(["partitions", "--dsn", pg_dsn, "--schema", schema, "--json",
                     "--history-retention-days", "30", "--log-level", "error"])
    finally:
        release.join()
    assert code == 0, capsys.readouterr().err
    assert '"dropped": 4' in capsys.readouterr().out
    assert q1(pg_dsn, schema, "SELECT to_regclass(%s)", [f"{schema}.{old}"]) is None


def test_the_key_of_an_execution_retention_dropped_makes_a_new_one(
    pg_dsn: str, schema: str
) -> None:
    """FAULTS C6: after retention drops an execution, its idempotency key sent again makes a
    new execution, never the dead id (before, it returned an id every call answered with
    ExecutionNotFound). Keys of executions still live or still in history keep theirs."""
    from kestrel.errors import ExecutionNotFound

    client = SyncClient(pg_dsn, schema=schema, pool_size=0)

    def status(eid: object) -> str:
        return client.get(eid).status.value  # type: ignore[arg-type]

    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '-40 days'")
    q(pg_dsn, schema, "SELECT {s}.kestrel_ensure_history_partitions_v1('day', 0, true)")
    old = client.submit(app.three_steps, 1, idempotency_key="k-old")
    live = client.submit(app.approval, 2, idempotency_key="k-live")
    run_worker_until(pg_dsn, config(schema), lambda: status(old.id) == "completed"
                     and status(live.id) == "waiting")
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '0'")
    recent = client.submit(app.three_steps, 3, idempotency_key="k-recent")
    run_worker_until(pg_dsn, config(schema), lambda: status(recent.id) == "completed")
    assert client.submit(app.three_steps, 1, idempotency_key="k-old").id == old.id

    dropped = q1(pg_dsn, schema, "SELECT {s}.kestrel_drop_history_partitions_v1("
                 "interval '30 days')")
    assert dropped >= 3  # the day of `old` in workflow_, signal_ and event_history
    with pytest.raises(ExecutionNotFound):
        client.get(old.id)
    again = client.submit(app.three_steps, 1, idempotency_key="k-old")
    assert again.id != old.id
    assert client.submit(app.three_steps, 1, idempotency_key="k-old").id == again.id
    assert client.submit(app.approval, 2, idempotency_key="k-live").id == live.id
    assert client.submit(app.three_steps, 3, idempotency_key="k-recent").id == recent.id
    run_worker_until(pg_dsn, config(schema), lambda: status(again.id) == "completed")
    assert again.result(timeout=5) == app.model(1)
    assert sorted(r[0] for r in q(pg_dsn, schema, "SELECT idempotency_key FROM "
                                  "{s}.idempotency_keys")) == ["k-live", "k-old", "k-recent"]


def test_the_current_partition_is_created_under_traffic(pg_dsn: str, schema: str) -> None:
    """FAULTS C6: migrate creates the current period's partitions while the runtime writes
    history (a rolling deploy). Rows of that period wait in DEFAULT and move into the new
    partition; a row landing in DEFAULT between the move and the attach failed the attach
    with 23514, every time under a stream of inserts (and a lock on DEFAULT alone failed the
    inserts instead). Ten rounds under a stream of inserts: neither side fails, no row lost."""
    stop = threading.Event()
    errors: list[str] = []
    inserted = 0

    def traffic() -> None:
        nonlocal inserted
        # No prepared statements: a transaction-mode PgBouncer cannot route them.
        with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                try:
                    conn.execute(pgsql.SQL(
                        "INSERT INTO {}.workflow_history (id, workflow, queue, priority, "
                        "status, args, lease_epoch, attempts, created_at, finished_at) VALUES "
                        "(gen_random_uuid(), 'flow', 'default', 0, 'completed', '[]', 1, 1, "
                        "now(), now())").format(pgsql.Identifier(schema)))
                    inserted += 1
                except psycopg.Error as exc:
                    errors.append(f"insert: {exc!r}")

    today = q1(pg_dsn, schema, "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')")
    writer = threading.Thread(target=traffic)
    writer.start()
    try:
        with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
            for _ in range(10):
                time.sleep(0.05)  # rows of today land in DEFAULT meanwhile
                for table in ("workflow_history", "signal_history", "event_history"):
                    part = pgsql.Identifier(schema, f"{table}_p{today}")
                    if q1(pg_dsn, schema, "SELECT to_regclass(%s)",
                          [f"{schema}.{table}_p{today}"]) is None:
                        continue
                    # Back to DEFAULT with its rows, as before upkeep first ran.
                    conn.execute(pgsql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(
                        pgsql.Identifier(schema, table), part))
                    conn.execute(pgsql.SQL("INSERT INTO {} SELECT * FROM {}").format(
                        pgsql.Identifier(schema, table), part))
                    conn.execute(pgsql.SQL("DROP TABLE {}").format(part))
                # Upkeep gives up a lock it cannot have within 200 ms and tries again (a
                # commit's flush can hold an insert's lock that long on a slow disk); so
                # does this round. Any other error is what the test is for.
                for _ in range(50):
                    try:
                        conn.execute(pgsql.SQL(
                            "SELECT {}.kestrel_ensure_history_partitions_v1('day', 0, true)"
                        ).format(pgsql.Identifier(schema)))
                        break
                    except psycopg.errors.LockNotAvailable:
                        continue
                    except psycopg.Error as exc:
                        errors.append(f"ensure: {exc!r}")
                        break
                else:
                    errors.append("ensure: a lock not had in 50 tries")
    finally:
        stop.set()
        writer.join()
    assert errors == []
    assert inserted > 0
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history") == inserted
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history_default") == 0


def test_partitions_are_created_ahead_and_named_from_the_interval(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["partitions", "--dsn", pg_dsn, "--schema", schema, "--history-ahead", "5",
                 "--log-level", "error"])
    out = capsys.readouterr().out
    assert code == 0 and "created 8 partitions" in out  # 2 more days, 4 tables each
    names = [r[0] for r in q(pg_dsn, schema, "SELECT c.relname FROM pg_inherits i JOIN "
                             "pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass "
                             "ORDER BY 1", [f'"{schema}".workflow_history'])]
    assert len(names) == 7  # default + today + 5 ahead
    assert all(n == "workflow_history_default" or len(n) == len("workflow_history_p20261130")
               for n in names)
    code = main(["partitions", "--dsn", pg_dsn, "--schema", schema,
                 "--history-interval", "fortnight"])
    assert code == 2


def test_readme_observability_queries_run(pg_dsn: str, schema: str) -> None:
    """The manual's five queries (docs/howto/observability.md, the README's "History and SQL
    observability" before it) are valid against a real schema and return rows."""
    import re

    from tests.helpers import ROOT

    readme = (ROOT / "docs" / "howto" / "observability.md").read_text()
    block = readme.split("<!-- observability-queries:", 1)[1].split("```sql", 1)[1]
    block = block.split("```", 1)[0]
    queries = [s.strip() for s in block.split(";") if s.strip()]
    assert len(queries) == 5
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    client.submit(app.fails_in_step)
    client.submit(app.flaky_wf, "readme", 1)
    client.submit(app.three_steps, 1)
    waiting = client.submit(app.waiter)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 3
                     and client.get(waiting.id).status.value == "waiting")
    results = []
    for query in queries:
        text = re.sub(r"\bkestrel\.(?=workflow_steps|executions|workflow_executions|"
                      r"kestrel_now)", f'"{schema}".', query)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            results.append(conn.execute(text).fetchall())  # type: ignore[call-overload]
    assert all(results), [len(r) for r in results]
    assert results[0][0][:2] == ("fails_in_step", "not_retried")
    assert results[3][0][2] == "go"
    assert results[4][0][0] == "flaky"
