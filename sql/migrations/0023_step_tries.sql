-- 0023: every failed try of a step, kept with the checkpoint it led to (issue 42, item 5).
--
-- A step with retries ran its failing tries inside one claim and recorded only the outcome:
-- `show` printed `charge … try 3` and nothing about the two failures before it. The tries
-- travel with the checkpoint, in the same row and the same statement (no write more on the
-- happy path, NULL when the first try succeeded), and so live and leave with it: retention,
-- Citus placement and forks need nothing new. Each try is {attempt, type, message,
-- after_s}: when it failed is started_at + after_s, the database's clock as for the rest of
-- the row, never a worker's.
ALTER TABLE __schema__.operation_outputs ADD COLUMN tries jsonb;

-- The SQL view of every checkpoint shows them too, in a column added at its end (a view's
-- existing columns keep their places, so patch_markers and queries by position stand).
CREATE OR REPLACE VIEW __schema__.workflow_steps AS
SELECT o.execution_id, e.workflow, e.queue, e.status AS execution_status, o.step_id,
       o.step_name, o.attempt, o.output, o.error, o.started_at, o.finished_at,
       o.finished_at - o.started_at AS duration, NULL::timestamptz AS execution_finished_at,
       o.tries
  FROM __schema__.operation_outputs AS o
  JOIN __schema__.workflow_executions AS e ON e.id = o.execution_id
UNION ALL
SELECT o.execution_id, h.workflow, h.queue, h.status, o.step_id,
       o.step_name, o.attempt, o.output, o.error, o.started_at, o.finished_at,
       o.finished_at - o.started_at, h.finished_at, o.tries
  FROM __schema__.operation_outputs AS o
  JOIN __schema__.workflow_history AS h ON h.id = o.execution_id;
