-- Partition upkeep, run by every runtime's maintenance loop and by `kestrel-runtime
-- partitions`. Only one caller at a time does the work: a transaction-level advisory lock,
-- released at COMMIT, so nothing is left on a pooled connection.

-- name: maintenance_lock
SELECT pg_try_advisory_xact_lock(hashtext('kestrel.maintenance.__schema_name__'));

-- name: ensure_partitions
SELECT __schema__.kestrel_ensure_history_partitions_v1(%(interval)s, %(ahead)s);

-- name: drop_partitions
SELECT __schema__.kestrel_drop_history_partitions_v1(
    %(retention_days)s * interval '1 day', %(detach)s);

-- name: list_partitions
-- History partitions with their bounds, estimated rows and size.
SELECT parent.relname, child.relname, pg_get_expr(child.relpartbound, child.oid),
       greatest(child.reltuples, 0)::bigint, pg_total_relation_size(child.oid)
  FROM pg_inherits AS i
  JOIN pg_class AS child ON child.oid = i.inhrelid
  JOIN pg_class AS parent ON parent.oid = i.inhparent
  JOIN pg_namespace AS n ON n.oid = parent.relnamespace
 WHERE n.nspname = '__schema_name__'
   AND parent.relname IN ('workflow_history', 'step_history')
 ORDER BY parent.relname, child.relname;

-- name: take_uncounted_finishes
-- Finishes no worker saw, of the workflows this process registers (%(workflows)s): what
-- cancel() finished while queued or waiting, and what the sweeper failed past its deadline
-- (expire_deadlines). Taken from uncounted_finishes, a row per finish, so each is counted
-- once fleet-wide (SKIP LOCKED: a concurrent collector takes other rows), at most 10,000 a
-- round: (workflow, status, deadline). Rows of names nobody registers go after a day.
WITH taken AS (
    SELECT finish_id FROM __schema__.uncounted_finishes
     WHERE workflow = ANY (%(workflows)s::text[])
        OR finished_at < __schema__.kestrel_now() - interval '1 day'
     LIMIT 10000
       FOR UPDATE SKIP LOCKED
)
DELETE FROM __schema__.uncounted_finishes AS u
 USING taken
 WHERE u.finish_id = taken.finish_id
RETURNING u.workflow, u.status, u.deadline;
