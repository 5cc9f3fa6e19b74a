-- name: save_steps_batch
-- Group commit of step checkpoints from every running execution of a process. A row is
-- written only while its execution is still running under the writer's epoch; FOR SHARE makes
-- a concurrent claim (which updates the row) wait or be waited for, and READ COMMITTED
-- re-checks the epoch on the newest row version, so a superseded epoch can never slip in.
-- ON CONFLICT DO NOTHING keeps the first committed output. Returns, per input row, whether
-- the writer still owns the execution, whether this statement wrote the row, and for a
-- position it did not write the output recorded first.
--
-- started_at and finished_at are the database clock less the seconds since the body started
-- and ended (the worker's monotonic clock): a worker whose wall clock is skewed or jumps
-- never writes its time into a row.
WITH input(execution_id, epoch, step_id, step_name, output, error, attempt, ran_s,
           waited_s, tries) AS (
    -- One JSON array of rows (statements/steps.py), not nine arrays: psycopg dumped those in
    -- Python at ~10 µs a checkpoint. Output and error come wrapped in a one-element array,
    -- so SQL NULL (none) and JSON null (a step that returned None) stay apart.
    -- (jsonb_typeof: `'null'::jsonb -> 0` is not SQL NULL, a scalar acts as an array.)
    SELECT (r->>0)::uuid, (r->>1)::integer, (r->>2)::integer, r->>3,
           CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
           CASE WHEN jsonb_typeof(r->5) = 'array' THEN r->5->0 END,
           (r->>6)::integer, (r->>7)::float8, (r->>8)::float8,
           -- The failed tries before this outcome (migration 0023), or none.
           CASE WHEN jsonb_typeof(r->9) = 'array' THEN r->9 END
      FROM jsonb_array_elements(%(rows)s::jsonb) AS r
), owned AS (
    -- One row per execution (a batch can hold several steps of one), and text_results
    -- (Citus: see docs/citus.md).
    -- By primary key; running under the batch's epoch is asked of the locked row, in the
    -- joins below (the rule for held rows: see heartbeat).
    SELECT e.id, e.lease_epoch, e.status, e.cancel_requested,
           NULL::__schema__.workflow_executions AS text_results
      FROM __schema__.workflow_executions AS e
     WHERE e.id = ANY (ARRAY(SELECT execution_id FROM input))
     ORDER BY e.id  -- lock order: see heartbeat
       FOR SHARE OF e
), inserted AS (
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
            finished_at, tries)
    SELECT i.execution_id, i.step_id, i.step_name, i.output, i.error, i.attempt, i.epoch,
           __schema__.kestrel_now() - make_interval(secs => i.ran_s),
           __schema__.kestrel_now() - make_interval(secs => i.waited_s), i.tries
      FROM input AS i
      JOIN owned AS o
        ON o.id = i.execution_id AND o.lease_epoch = i.epoch AND o.status = 'running'
     -- A cancelled execution records nothing more: it stops at this step boundary.
     WHERE NOT o.cancel_requested
        ON CONFLICT (execution_id, step_id) DO NOTHING
    RETURNING execution_id, step_id
)
-- A position this statement did not write comes back with the row recorded first (in its
-- snapshot: one committed after it comes back empty, and the worker reads it then); one it
-- wrote comes back without its value, which the worker knows (kestrel.codec.stored).
SELECT i.execution_id, i.step_id,
       (o.id IS NOT NULL) AS owned,
       (ins.step_id IS NOT NULL) AS inserted,
       CASE WHEN ins.step_id IS NULL THEN prior.step_name END,
       CASE WHEN ins.step_id IS NULL THEN prior.output END,
       CASE WHEN ins.step_id IS NULL THEN prior.error END,
       coalesce(o.cancel_requested, false) AS cancelled
  FROM input AS i
  LEFT JOIN owned AS o
         ON o.id = i.execution_id AND o.lease_epoch = i.epoch AND o.status = 'running'
  LEFT JOIN inserted AS ins ON ins.execution_id = i.execution_id AND ins.step_id = i.step_id
  LEFT JOIN __schema__.operation_outputs AS prior
         ON prior.execution_id = i.execution_id AND prior.step_id = i.step_id;

-- name: save_new_steps_batch
-- save_steps_batch without ON CONFLICT: the statement every group commit tries first.
-- INSERT … ON CONFLICT inserts speculatively and confirms each row with a second WAL record
-- (Heap/HEAP_CONFIRM, 48 bytes a checkpoint, 144 of the ~3,000 bytes of WAL a 3-step
-- workflow costs; BENCHMARKS.md). A conflict needs a row for the same (execution, step)
-- already there, and under the epoch-checked FOR SHARE lock only this process's own earlier
-- try of the same batch can have written one (a lost reply, FAULTS F3). Then this statement
-- fails as a whole with unique_violation, nothing of it is written, and db.run sends
-- save_steps_batch instead (Stmt.if_recorded), which keeps the first committed output and
-- returns it, as before.
WITH input(execution_id, epoch, step_id, step_name, output, error, attempt, ran_s,
           waited_s, tries) AS (
    -- One JSON array of rows (statements/steps.py), not nine arrays: psycopg dumped those in
    -- Python at ~10 µs a checkpoint. Output and error come wrapped in a one-element array,
    -- so SQL NULL (none) and JSON null (a step that returned None) stay apart.
    -- (jsonb_typeof: `'null'::jsonb -> 0` is not SQL NULL, a scalar acts as an array.)
    SELECT (r->>0)::uuid, (r->>1)::integer, (r->>2)::integer, r->>3,
           CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
           CASE WHEN jsonb_typeof(r->5) = 'array' THEN r->5->0 END,
           (r->>6)::integer, (r->>7)::float8, (r->>8)::float8,
           -- The failed tries before this outcome (migration 0023), or none.
           CASE WHEN jsonb_typeof(r->9) = 'array' THEN r->9 END
      FROM jsonb_array_elements(%(rows)s::jsonb) AS r
), owned AS (
    -- One row per execution (a batch can hold several steps of one), and text_results
    -- (Citus: see docs/citus.md).
    -- By primary key; running under the batch's epoch is asked of the locked row, in the
    -- joins below (the rule for held rows: see heartbeat).
    SELECT e.id, e.lease_epoch, e.status, e.cancel_requested,
           NULL::__schema__.workflow_executions AS text_results
      FROM __schema__.workflow_executions AS e
     WHERE e.id = ANY (ARRAY(SELECT execution_id FROM input))
     ORDER BY e.id  -- lock order: see heartbeat
       FOR SHARE OF e
), inserted AS (
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
            finished_at, tries)
    SELECT i.execution_id, i.step_id, i.step_name, i.output, i.error, i.attempt, i.epoch,
           __schema__.kestrel_now() - make_interval(secs => i.ran_s),
           __schema__.kestrel_now() - make_interval(secs => i.waited_s), i.tries
      FROM input AS i
      JOIN owned AS o
        ON o.id = i.execution_id AND o.lease_epoch = i.epoch AND o.status = 'running'
     -- A cancelled execution records nothing more: it stops at this step boundary.
     WHERE NOT o.cancel_requested
    RETURNING execution_id, step_id
)
-- Once this statement succeeds, every position of an execution owned and not cancelled was
-- written by it, so no row recorded first is looked for, and none comes back: the worker
-- knows what it wrote (kestrel.codec.stored gives what jsonb stores). Per checkpoint this
-- saves an index probe, the RETURNING of the jsonb and the reply's bytes (BENCHMARKS.md).
SELECT i.execution_id, i.step_id,
       (o.id IS NOT NULL) AS owned,
       (ins.step_id IS NOT NULL) AS inserted,
       NULL::text, NULL::jsonb, NULL::jsonb,
       coalesce(o.cancel_requested, false) AS cancelled
  FROM input AS i
  LEFT JOIN owned AS o
         ON o.id = i.execution_id AND o.lease_epoch = i.epoch AND o.status = 'running'
  LEFT JOIN inserted AS ins ON ins.execution_id = i.execution_id AND ins.step_id = i.step_id;

-- name: save_new_steps_delegated
-- save_new_steps_batch in its Citus form: the worker sends this one where its schema is a
-- Citus distributed schema, in which migrate delegates save_steps() to the tenant's node
-- (sql/functions/30_finishing.sql: what it does, and why two forms).
SELECT * FROM __schema__.save_steps(%(rows)s::jsonb, false);

-- name: save_steps_delegated
-- save_steps_batch in its Citus form (save_new_steps_delegated).
SELECT * FROM __schema__.save_steps(%(rows)s::jsonb, true);

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

-- name: set_tags
-- ctx.set_tags: merge %(tags)s (a JSON object; a null value removes its tag) into the
-- execution's tags (merge_tags: KS002 past 32 tags, nothing changed), fenced by the lease
-- epoch like every worker write. One row when it was still ours, none otherwise. The merge is
-- idempotent, so a retry after a lost reply, or the workflow re-run after a crash before the
-- step's checkpoint, sets the same tags again.
UPDATE __schema__.workflow_executions AS e
   SET tags = __schema__.merge_tags(e.tags, %(tags)s::jsonb)
 WHERE e.id = %(id)s AND e.lease_epoch = %(epoch)s AND e.status = 'running'
RETURNING e.id;
