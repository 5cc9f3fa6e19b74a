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
   AND parent.relname IN ('workflow_history', 'signal_history', 'event_history',
                          'operation_outputs')
 ORDER BY parent.relname, child.relname;

-- name: take_uncounted_finishes
-- Finishes no worker saw, of the workflows this process registers (%(workflows)s): what
-- cancel() finished while queued or waiting, and what the sweeper failed past its deadline
-- (expire_deadlines). A row per finish, counted once fleet-wide, in two rounds of one
-- collector (%(collector)s, one per process): a round takes rows nobody has taken (SKIP
-- LOCKED: a concurrent collector takes other rows) or that this collector took before
-- without acknowledging them, and deletes the rows it acknowledges (%(acked)s: the
-- finish_ids it counted since). A take whose reply was lost is so taken again by the same
-- collector, and counted then: a lost reply neither drops nor doubles a count (FAULTS R1).
-- At most 10,000 a round: (finish_id, workflow, status, deadline). Rows of names nobody
-- registers, and rows a collector took a day ago and never acknowledged (it died), go.
-- The clock inside the COALESCE is a column of `clk` (Citus refuses a function that is not
-- IMMUTABLE inside CASE or COALESCE in an UPDATE: the finishes of a distributed schema were
-- never counted, and its uncounted_finishes grew).
WITH gone AS (
    DELETE FROM __schema__.uncounted_finishes AS u
     WHERE (u.taken_by = %(collector)s AND u.finish_id = ANY (%(acked)s::bigint[]))
        OR u.taken_at < __schema__.kestrel_now() - interval '1 day'
        OR (u.finished_at < __schema__.kestrel_now() - interval '1 day'
            AND NOT u.workflow = ANY (%(workflows)s::text[]))
    RETURNING u.finish_id
), taken AS (
    SELECT finish_id FROM __schema__.uncounted_finishes
     WHERE workflow = ANY (%(workflows)s::text[])
       AND (taken_by IS NULL OR taken_by = %(collector)s)
       AND NOT finish_id = ANY (%(acked)s::bigint[])
     ORDER BY finish_id
     LIMIT 10000
       FOR UPDATE SKIP LOCKED
)
UPDATE __schema__.uncounted_finishes AS u
   SET taken_by = %(collector)s,
       taken_at = coalesce(u.taken_at, clk.now)
  FROM taken, (SELECT __schema__.kestrel_now() AS now) AS clk
 WHERE u.finish_id = taken.finish_id
   AND (SELECT count(*) FROM gone) >= 0
RETURNING u.finish_id, u.workflow, u.status, u.deadline;
