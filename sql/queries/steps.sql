-- name: save_steps_batch
-- Group commit of step checkpoints from every running execution of a process. A row is
-- written only while its execution is still running under the writer's epoch; FOR SHARE makes
-- a concurrent claim (which updates the row) wait or be waited for, and READ COMMITTED
-- re-checks the epoch on the newest row version, so a superseded epoch can never slip in.
-- ON CONFLICT DO NOTHING keeps the first committed output. Returns, per input row, whether
-- the writer still owns the execution and the output that is now recorded.
WITH input(execution_id, epoch, step_id, step_name, output, error, attempt, started_at) AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(epochs)s::integer[], %(step_ids)s::integer[],
                         %(names)s::text[], %(outputs)s::jsonb[], %(errors)s::jsonb[],
                         %(attempts)s::integer[], %(started)s::timestamptz[])
), owned AS (
    SELECT e.id, e.lease_epoch
      FROM __schema__.workflow_executions AS e
      JOIN input AS i ON i.execution_id = e.id AND i.epoch = e.lease_epoch
     WHERE e.status = 'running'
       FOR SHARE OF e
), inserted AS (
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at)
    SELECT i.execution_id, i.step_id, i.step_name, i.output, i.error, i.attempt, i.epoch,
           i.started_at
      FROM input AS i
      JOIN owned AS o ON o.id = i.execution_id AND o.lease_epoch = i.epoch
        ON CONFLICT (execution_id, step_id) DO NOTHING
    RETURNING execution_id, step_id, step_name, output, error
)
-- The stored value comes back either way: our row as jsonb normalized it (so the live run
-- returns exactly what a replay will), or the row that was recorded first.
SELECT i.execution_id, i.step_id,
       (o.id IS NOT NULL) AS owned,
       (ins.step_id IS NOT NULL) AS inserted,
       coalesce(ins.step_name, prior.step_name),
       CASE WHEN ins.step_id IS NOT NULL THEN ins.output ELSE prior.output END,
       CASE WHEN ins.step_id IS NOT NULL THEN ins.error ELSE prior.error END
  FROM input AS i
  LEFT JOIN owned AS o ON o.id = i.execution_id AND o.lease_epoch = i.epoch
  LEFT JOIN inserted AS ins ON ins.execution_id = i.execution_id AND ins.step_id = i.step_id
  LEFT JOIN __schema__.operation_outputs AS prior
         ON prior.execution_id = i.execution_id AND prior.step_id = i.step_id;

-- name: load_step
-- Read one recorded checkpoint (used when a write lost the race but the winner's row was
-- committed after this statement's snapshot).
SELECT step_name, output, error
  FROM __schema__.operation_outputs
 WHERE execution_id = %(execution_id)s AND step_id = %(step_id)s;
