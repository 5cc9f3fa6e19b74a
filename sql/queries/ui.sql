-- The web UI (kestrel/http/ui/): its own reads. Every change it makes goes through the
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
       error ->> 'type', error ->> 'message', lease_epoch
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

-- name: ui_waits
-- Of the live executions %(ids)s (one page of the executions list, or one execution), the
-- waiting ones: what each waits for, since when, and whether what it waits for has arrived
-- (a signal of the name it waits for, not consumed yet: it resumes at its next claim), with
-- the database's clock for "since 12 min". A waiting row's updated_at is when it was parked
-- (park_execution) or given back (give_back), or created (a delayed start): nothing else
-- writes a waiting row's updated_at, and its next claim makes it running.
SELECT e.id, e.waiting_for, e.wait_deadline, e.wake_at, e.updated_at, e.given_back_at,
       e.given_back_by, e.give_backs,
       EXISTS (SELECT 1 FROM __schema__.signals AS s
                WHERE s.execution_id = e.id AND s.name = e.waiting_for
                  AND s.consumed_step IS NULL) AS arrived,
       __schema__.kestrel_now()
  FROM __schema__.workflow_executions AS e
 WHERE e.id = ANY (%(ids)s::uuid[]) AND e.status = 'waiting';

-- name: ui_sent_signal
-- The signal a form of the execution page sent, by its idempotency key (live or finished
-- execution): its name, payload and time, for the notice the page shows after the form's
-- redirect (POST/redirect/GET). NULL payloads read back as JSON null.
SELECT name, payload, created_at
  FROM (SELECT name, payload, created_at FROM __schema__.signals
         WHERE execution_id = %(id)s AND idempotency_key = %(key)s
        UNION ALL
        SELECT name, payload, created_at FROM __schema__.signal_history
         WHERE execution_id = %(id)s AND idempotency_key = %(key)s) AS s
 LIMIT 1;

-- name: ui_retried
-- Whether a form of the execution page retried it under this idempotency key: the retry
-- recorded the key with the execution (sql/functions: retry), which the notice after the
-- form's redirect reads back rather than trusting the link.
SELECT EXISTS (SELECT 1 FROM __schema__.idempotency_keys
                WHERE idempotency_key = %(key)s AND execution_id = %(id)s);
