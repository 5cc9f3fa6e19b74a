-- name: save_steps_batch
-- A group commit of step checkpoints, ON CONFLICT DO NOTHING: the retry of a batch that met a
-- recorded step (save_steps() in sql/functions/functions.sql says what it does and why).
SELECT * FROM __schema__.save_steps(%(rows)s::jsonb, true);

-- name: save_new_steps_batch
-- A group commit of step checkpoints, a plain INSERT: what every group commit tries first
-- (save_steps() in sql/functions/functions.sql).
SELECT * FROM __schema__.save_steps(%(rows)s::jsonb, false);

-- name: load_step
-- Read one recorded checkpoint (used when a write lost the race but the winner's row was
-- committed after this statement's snapshot).
SELECT step_name, output, error
  FROM __schema__.operation_outputs
 WHERE execution_id = %(execution_id)s AND step_id = %(step_id)s;

-- name: consume_signal
-- Take a pending signal into the wait's checkpoint, or learn signal_seq for a following park
-- (see consume_signal in migration 0006: it locks, then looks, in two statements).
SELECT owned, cancelled, output, signal_seq
  FROM __schema__.consume_signal(%(id)s, %(epoch)s, %(step_id)s, %(name)s, %(step_name)s);

-- name: set_event
-- Publish an event value for callers following the execution (idempotent upsert; the step
-- that wraps it is checkpointed, so a replay does not publish an older value again).
WITH owned AS (
    SELECT e.id, NULL::__schema__.workflow_executions AS text_results  -- Citus: docs/citus.md
      FROM __schema__.workflow_executions AS e
     WHERE e.id = %(id)s AND e.lease_epoch = %(epoch)s AND e.status = 'running'
       FOR SHARE OF e
), put AS (
    INSERT INTO __schema__.events (execution_id, key, value)
    SELECT %(id)s, %(key)s, %(value)s::jsonb FROM owned
        ON CONFLICT (execution_id, key)
        -- The row offered carries the clock (its column default): Citus wants what DO
        -- UPDATE SET computes immutable (docs/citus.md).
        DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
    RETURNING 1
)
SELECT count(*) > 0, pg_notify('kestrel.__schema_name__.events', %(id)s::text) FROM put;
