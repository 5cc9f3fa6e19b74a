-- The web UI (kestrel/http/ui.py): its own reads. Every change it makes goes through the
-- SQL functions the other doors call (signal, cancel, retry).

-- name: ui_counts
-- Live executions by status (the hot table is small), and those that finished in the last
-- %(finished_window)s by status (the history's (status, finished_at) index; old partitions
-- are pruned), so the live counts cost the same with a million finished rows.
SELECT status, count(*), true AS live
  FROM __schema__.workflow_executions
 GROUP BY status
UNION ALL
SELECT status, count(*), false
  FROM __schema__.workflow_history
 WHERE finished_at >= __schema__.kestrel_now() - %(finished_window)s::interval
 GROUP BY status;

-- name: search_history
-- Finished executions in [since, until) whose workflow, error, arguments or idempotency key
-- contain %(pattern)s (an ILIKE pattern the caller escaped), newest first. The finish-time
-- range prunes history partitions, and LIMIT bounds the rows read back.
SELECT id, workflow, queue, status, attempts, created_at, finished_at, parent_id,
       error ->> 'type', error ->> 'message'
  FROM __schema__.workflow_history
 WHERE finished_at >= %(since)s::timestamptz
   AND finished_at < %(until)s::timestamptz
   AND (%(status)s::text IS NULL OR status = %(status)s::text)
   AND (workflow ILIKE %(pattern)s ESCAPE '\'
        OR coalesce(error ->> 'message', '') ILIKE %(pattern)s ESCAPE '\'
        OR coalesce(error ->> 'type', '') ILIKE %(pattern)s ESCAPE '\'
        OR coalesce(idempotency_key, '') ILIKE %(pattern)s ESCAPE '\'
        OR args::text ILIKE %(pattern)s ESCAPE '\')
 ORDER BY finished_at DESC, id DESC
 LIMIT %(limit)s;
