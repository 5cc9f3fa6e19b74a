-- name: submit
-- %(traceparent)s and %(tracestate)s: the submitter's W3C trace context, or NULL (migration
-- 0018; submit() keeps them only when well formed). The debounce parameters: 0024; the
-- concurrency key and tags: 0025.
SELECT __schema__.submit(%(workflow)s, %(args)s::jsonb, %(queue)s, %(priority)s,
                         %(idempotency_key)s, %(id)s, %(parent)s, %(timeout_s)s,
                         %(delay_s)s, %(dedup_key)s, %(on_duplicate)s, %(start_at)s,
                         %(traceparent)s, %(tracestate)s, %(debounce_key)s,
                         %(debounce_s)s, %(debounce_max_s)s, %(concurrency_key)s,
                         %(tags)s::jsonb);

-- name: signal
SELECT __schema__.signal(%(id)s, %(name)s, %(payload)s::jsonb, %(idempotency_key)s);

-- name: cancel
SELECT __schema__.cancel(%(id)s);

-- name: retry
SELECT __schema__.retry(%(id)s, %(idempotency_key)s);

-- name: fork
-- %(new_id)s is the fork's id, chosen by the caller: sent again after a lost reply, the same
-- call returns the fork it made instead of making another.
-- %(idempotency_key)s (migration 0015) does the same for a key the caller names.
SELECT __schema__.fork(%(id)s, %(from_step)s, %(new_id)s, %(idempotency_key)s);

-- name: get_event
-- A live execution's events are in events; a finished one's moved to event_history with it
-- (archive_finished). It is in exactly one of them in any snapshot.
SELECT value FROM __schema__.events WHERE execution_id = %(id)s AND key = %(key)s
UNION ALL
SELECT value FROM __schema__.event_history WHERE execution_id = %(id)s AND key = %(key)s;

-- name: listen_done
LISTEN "kestrel.__schema_name__.done";

-- name: listen_events
LISTEN "kestrel.__schema_name__.events";

-- name: get_execution
-- One execution wherever it lives: the hot queue while live, history once finished. A live
-- one also says what it waits for (waiting_for, wake_at, wait_deadline) and the limits of
-- its queue, if it has any (what a queued execution may wait for: a slot), and its
-- give-backs (migration 0014).
SELECT id, workflow, queue, priority, status, args, NULL::jsonb AS result, NULL::jsonb AS error,
       attempts, lease_epoch, created_at, started_at, NULL::timestamptz AS finished_at,
       deadline, waiting_for, wake_at, wait_deadline,
       (SELECT concat_ws(', ', 'concurrency ' || l.concurrency,
                         'rate ' || l.rate || ' per ' || l.period,
                         'per key ' || l.per_key)
          FROM __schema__.queue_limits l WHERE l.queue = e.queue) AS queue_limit,
       give_backs, given_back_by, given_back_at, tags, concurrency_key
  FROM __schema__.workflow_executions e WHERE id = %(id)s
UNION ALL
SELECT id, workflow, queue, priority, status, args, result, error,
       attempts, lease_epoch, created_at, started_at, finished_at,
       deadline, NULL, NULL, NULL, NULL, NULL, NULL, NULL, tags, concurrency_key
  FROM __schema__.workflow_history WHERE id = %(id)s;

-- name: list_steps
-- Checkpoints of one execution, live or finished: they never leave operation_outputs.
SELECT step_id, step_name, output, error, attempt, lease_epoch, started_at, finished_at,
       tries
  FROM __schema__.operation_outputs
 WHERE execution_id = %(id)s
 ORDER BY step_id;

-- name: count_by_status
SELECT status, count(*) FROM __schema__.workflow_executions GROUP BY status
UNION ALL
SELECT status, count(*) FROM __schema__.workflow_history GROUP BY status;

-- name: list_executions
-- Newest first, live and finished alike, with optional filters (NULL = any). With a patch:
-- the executions that recorded its marker (%(with_patch)s) or, of the workflows where that
-- patch was ever recorded, those that did not (they may still need the old code path).
-- With tags: those carrying every one of them (each table's tags GIN index answers).
SELECT id, workflow, queue, status, attempts, created_at, finished_at, app_version, tags
  FROM (SELECT id, workflow, queue, status, attempts, created_at,
               NULL::timestamptz AS finished_at, app_version, tags
          FROM __schema__.workflow_executions
        UNION ALL
        SELECT id, workflow, queue, status, attempts, created_at, finished_at, app_version,
               tags
          FROM __schema__.workflow_history) AS x
 WHERE (%(status)s::text IS NULL OR status = %(status)s::text)
   AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(app_version)s::text IS NULL OR app_version = %(app_version)s::text)
   AND (%(tags)s::jsonb IS NULL OR tags @> %(tags)s::jsonb)
   AND (%(patch)s::text IS NULL
        OR EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                    WHERE o.execution_id = x.id AND o.step_id < 0
                      AND o.step_name = 'kestrel.patch:' || %(patch)s::text)
           = %(with_patch)s
           AND x.workflow IN (SELECT p.workflow FROM __schema__.patch_markers AS p
                               WHERE p.patch = %(patch)s::text))
 ORDER BY created_at DESC
 LIMIT %(limit)s;

-- name: queue_stats
-- Live executions by queue and status, with the age of the oldest queued one.
SELECT queue, status, count(*),
       extract(epoch FROM __schema__.kestrel_now() - min(created_at))
  FROM __schema__.workflow_executions
 GROUP BY queue, status
 ORDER BY queue, status;

-- name: worker_stats
-- Running executions by the worker holding their lease.
SELECT lease_owner, count(*)
  FROM __schema__.workflow_executions
 WHERE status = 'running'
 GROUP BY lease_owner
 ORDER BY lease_owner;

-- name: fork_source
-- What the fork with this id copied (execution and step), if it exists: Client.forked_from,
-- and an HTTP fork sent again under the same Idempotency-Key (kestrel/http/api.py).
SELECT forked_from, from_step FROM __schema__.forks WHERE id = %(id)s;
