"""A checkpoint is written once, into storage it never leaves (issue 23, item 2; migration
0019): operation_outputs is range-partitioned by execution id, execution ids are UUIDv7 of
the database clock (or kestrel.ids in Python), and retention drops a period's partition
only once none of its executions is live or in history."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from kestrel import ids
from kestrel.client import SyncClient
from kestrel.migrate import migrate
from kestrel.sql import migrations
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, q, q1, run_worker_until


def partition_of(dsn: str, schema: str, eid: object) -> list[str]:
    """The partitions holding *eid*'s checkpoints."""
    return [r[0] for r in q(dsn, schema, "SELECT DISTINCT tableoid::regclass::text "
                            "FROM {s}.operation_outputs WHERE execution_id = %s", [eid])]


def test_python_and_sql_ids_are_uuidv7_of_the_clock(pg_dsn: str, schema: str) -> None:
    made = [ids.new_id() for _ in range(1000)]
    assert {u.version for u in made} == {7} and {u.variant for u in made} == {uuid.RFC_4122}
    assert len(set(made)) == 1000
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    assert all(abs(ids.created_ms(u) - now_ms) < 5_000 for u in made)  # type: ignore[operator]
    assert ids.created_ms(uuid.uuid4()) is None
    assert ids.created_ms(ids.new_id(0x123456789ABC)) == 0x123456789ABC
    # Ids of later milliseconds sort after earlier ones: a period's ids are one range.
    assert ids.new_id(1000) < ids.new_id(1001) < ids.new_id(2**48 - 1)
    rows = q(pg_dsn, schema, "SELECT {s}.new_execution_id(), {s}.kestrel_now() "
             "FROM generate_series(1, 200)")
    sql_ids = [r[0] for r in rows]
    assert {u.version for u in sql_ids} == {7} and len(set(sql_ids)) == 200
    assert {u.variant for u in sql_ids} == {uuid.RFC_4122}
    assert {ids.created_ms(u) for u in sql_ids} == {int(rows[0][1].timestamp() * 1000)}
    # The partition bound of an instant is the smallest id of its millisecond.
    at = datetime(2026, 12, 2, tzinfo=UTC)
    bound = q1(pg_dsn, schema, "SELECT {s}.execution_id_at(%s)", [at])
    assert bound == uuid.UUID(int=int(at.timestamp() * 1000) << 80)


def test_checkpoints_are_written_once_in_their_period_and_never_move(
        pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    handles = [client.submit(app.approval, i) for i in range(20)]
    today = "operation_outputs_p" + q1(pg_dsn, schema, "SELECT to_char({s}.kestrel_now() "
                                       "AT TIME ZONE 'UTC', 'YYYYMMDD')")
    run_worker_until(pg_dsn, config(schema), lambda: q1(
        pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
        "WHERE status = 'waiting'") == 20)
    # Where each checkpoint lies, and the transaction that wrote it.
    where = ("SELECT execution_id, step_id, tableoid::regclass::text, ctid::text, xmin::text "
             "FROM {s}.operation_outputs WHERE step_id = 0 ORDER BY 1")
    before = q(pg_dsn, schema, where)
    assert len(before) == 20
    for h in handles:
        assert h.id.version == 7
        assert partition_of(pg_dsn, schema, h.id) == [f"{schema}.{today}"]
        client.signal(h.id, "approve", "ok")
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 20)
    # Finished: the same row versions, where they were written (nothing copied, nothing
    # deleted, nothing rewritten), and history sees them.
    assert q(pg_dsn, schema, where) == before
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.step_history") == 60
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs") == 60
    assert [s.name for s in client.steps(handles[0].id)] == [
        "add", "kestrel.signal:approve", "add"]


def _id_in_days(pg_dsn: str, schema: str, days: int) -> uuid.UUID:
    at = q1(pg_dsn, schema, "SELECT {s}.kestrel_now()") + timedelta(days=days)
    return ids.new_id(int(at.timestamp() * 1000))


def test_retention_keeps_a_period_while_one_of_its_executions_lives(
        pg_dsn: str, schema: str) -> None:
    """A two-week wait outlives its period's retention: the partition holding its
    checkpoints stays until it has finished and its history is gone; the DEFAULT
    partition loses only the checkpoints of executions that are gone."""
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '-40 days'")
    q(pg_dsn, schema, "SELECT {s}.kestrel_ensure_history_partitions_v1('day', 0, true)")
    old_day = "operation_outputs_p" + q1(pg_dsn, schema, "SELECT to_char({s}.kestrel_now() "
                                         "AT TIME ZONE 'UTC', 'YYYYMMDD')")
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    waiting = client.submit(app.approval, 5)  # created 40 days ago, waits on
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(waiting.id).status.value == "waiting")
    assert partition_of(pg_dsn, schema, waiting.id) == [f"{schema}.{old_day}"]
    # Checkpoints under ids of no covered period: a live one's and a gone one's.
    live_v4, gone_v4 = uuid.uuid4(), uuid.uuid4()
    q(pg_dsn, schema, "SELECT {s}.submit('nobody_runs_this', '[1]', p_id => %s)", [live_v4])
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES (%s, 0, 'add', '1', 1, 1, now()), "
      "(%s, 0, 'add', '1', 1, 1, now())", [live_v4, gone_v4])
    assert partition_of(pg_dsn, schema, gone_v4) == [f"{schema}.operation_outputs_default"]
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '0'")

    def drop() -> int:
        return int(q1(pg_dsn, schema,
                      "SELECT {s}.kestrel_drop_history_partitions_v1(interval '30 days')"))

    # The old day's history partitions (empty) go; its checkpoint partition holds a live
    # execution and stays.
    assert drop() == 3
    assert q1(pg_dsn, schema, "SELECT to_regclass(%s) IS NOT NULL", [f"{schema}.{old_day}"])
    assert partition_of(pg_dsn, schema, waiting.id) == [f"{schema}.{old_day}"]
    assert partition_of(pg_dsn, schema, live_v4) == [f"{schema}.operation_outputs_default"]
    assert partition_of(pg_dsn, schema, gone_v4) == []  # trimmed from DEFAULT
    # It finishes today: in history, so its checkpoints stay (its history is not old).
    client.signal(waiting.id, "approve", "ok")
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(waiting.id).status.value == "completed")
    # An orphan in DEFAULT stays through a round that drops no history (the look reads
    # all of DEFAULT: only rounds that make orphans pay for it).
    orphan = uuid.uuid4()
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES (%s, 0, 'add', '1', 1, 1, now())",
      [orphan])
    assert drop() == 0
    assert partition_of(pg_dsn, schema, orphan) == [f"{schema}.operation_outputs_default"]
    assert [s.name for s in client.steps(waiting.id)] == ["add", "kestrel.signal:approve",
                                                          "add"]
    # Forty days on, its history is past retention: history and checkpoints go together.
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '40 days'")
    q(pg_dsn, schema, "SELECT {s}.kestrel_ensure_history_partitions_v1('day', 0, true)")
    assert drop() >= 2  # today's workflow_history partition, then the old checkpoints'
    assert q1(pg_dsn, schema, "SELECT to_regclass(%s)", [f"{schema}.{old_day}"]) is None
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.executions WHERE id = %s",
              [waiting.id]) == 0
    # The live v4 execution is untouched; the orphan went with that round.
    assert partition_of(pg_dsn, schema, live_v4) == [f"{schema}.operation_outputs_default"]
    assert partition_of(pg_dsn, schema, orphan) == []


def test_a_period_partition_holding_an_id_a_caller_chose_is_kept(
        pg_dsn: str, schema: str) -> None:
    """An id a caller chose can fall in any period: the partition is not dropped while
    its execution is live, whatever the period's age."""
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '-40 days'")
    q(pg_dsn, schema, "SELECT {s}.kestrel_ensure_history_partitions_v1('day', 0, true)")
    chosen = _id_in_days(pg_dsn, schema, 0)
    q(pg_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '0'")
    q(pg_dsn, schema, "SELECT {s}.submit('three_steps', '[1]', p_id => %s)", [chosen])
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES (%s, 0, 'add', '1', 1, 1, now())",
      [chosen])
    (where,) = partition_of(pg_dsn, schema, chosen)
    assert where != f"{schema}.operation_outputs_default"
    # The period's (empty) history partitions go; its checkpoints' partition stays.
    assert q1(pg_dsn, schema,
              "SELECT {s}.kestrel_drop_history_partitions_v1(interval '30 days')") == 3
    assert partition_of(pg_dsn, schema, chosen) == [where]


def test_migration_0019_keeps_every_checkpoint_once(pg_dsn: str) -> None:
    """A schema at migration 0018 with a live execution's checkpoints in operation_outputs
    and a finished one's in step_history: after 0019 each is in operation_outputs once, the
    views show them as before, and the live one runs on from its checkpoints."""
    schema = f"m19_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        with conn.transaction():
            conn.execute("SELECT set_config('kestrel.test_clock', 'on', true)")
            for m in migrations(schema):
                if m.version > 18:
                    break
                for statement in m.statements:
                    conn.execute(statement)
                conn.execute(f'INSERT INTO "{schema}".schema_migrations (version, name) '
                             "VALUES (%s, %s)", [m.version, m.name])
    try:
        live, done = uuid.uuid4(), uuid.uuid4()
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        q(pg_dsn, schema, "CREATE TABLE {s}.workflow_history_p20990101 PARTITION OF "
          f"{{s}}.workflow_history FOR VALUES FROM ('{today.isoformat()}') "
          f"TO ('{(today + timedelta(days=1)).isoformat()}')")
        q(pg_dsn, schema, "INSERT INTO {s}.workflow_executions (id, workflow, args) "
          "VALUES (%s, 'three_steps', '[2]')", [live])
        q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, "
          "step_name, output, attempt, lease_epoch, started_at) VALUES "
          "(%s, 0, 'add', '120', 1, 1, now()), (%s, 1, 'add', '121', 1, 1, now())",
          [live, live])
        q(pg_dsn, schema, "INSERT INTO {s}.workflow_history (id, workflow, queue, priority, "
          "status, args, result, lease_epoch, attempts, created_at, finished_at) VALUES "
          "(%s, 'three_steps', 'default', 0, 'completed', '[1]', '13', 1, 1, now(), now())",
          [done])
        q(pg_dsn, schema, "INSERT INTO {s}.step_history (execution_id, step_id, step_name, "
          "output, attempt, lease_epoch, started_at, finished_at, execution_finished_at) "
          "SELECT %s, s, 'add', to_jsonb(10 + s), 1, 1, now(), now(), now() "
          "FROM generate_series(0, 2) AS s", [done])
        assert migrate(pg_dsn, schema, test_clock=True)[:1] == [19]  # and any later
        assert q(pg_dsn, schema, "SELECT execution_id, step_id, output FROM "
                 "{s}.operation_outputs ORDER BY execution_id = %s, step_id", [live]) == [
            (done, 0, 10), (done, 1, 11), (done, 2, 12), (live, 0, 120), (live, 1, 121)]
        assert q1(pg_dsn, schema, "SELECT relkind FROM pg_class WHERE oid = "
                  "%s::regclass", [f'"{schema}".step_history']) == "v"
        assert q(pg_dsn, schema, "SELECT step_id, execution_finished_at = (SELECT finished_at "
                 "FROM {s}.workflow_history) FROM {s}.step_history ORDER BY 1") == [
            (0, True), (1, True), (2, True)]
        assert q1(pg_dsn, schema, "SELECT to_regclass(%s) IS NOT NULL",
                  [f'"{schema}".operation_outputs_p20990101']) is True
        # The live one replays its two checkpoints (not what its steps would return now)
        # and runs its last step only.
        client = SyncClient(pg_dsn, schema=schema, pool_size=0)
        run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
        assert client.get(live).result == 120 + 121 + 22
        assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs "
                  "WHERE execution_id = %s", [live]) == 3
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize("hostile", ["x'); DROP TABLE operation_outputs; --", "\x00",
                                     "\ud800", "9" * 100])
def test_execution_id_at_refuses_what_is_no_instant(pg_dsn: str, schema: str,
                                                     hostile: str) -> None:
    with pytest.raises((psycopg.errors.DataError, UnicodeEncodeError, psycopg.DataError)):
        q(pg_dsn, schema, "SELECT {s}.execution_id_at(%s)", [hostile])
