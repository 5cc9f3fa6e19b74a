-- name: reenqueue_expired
-- Recover executions whose lease expired (the worker died, froze or lost the database).
-- FOR UPDATE re-checks the predicate on the newest row version, so a row its owner just
-- heartbeated, completed or that another worker re-claimed is left alone (River #1302).
-- An execution claimed max_attempts times without finishing is quarantined: moved to history
-- with the reason, never claimed again. Bounded by %(limit)s; callers loop while full.
WITH expired AS (
    SELECT id, attempts,
           NULL::__schema__.workflow_executions AS text_results  -- docs/citus.md
      FROM __schema__.workflow_executions
     WHERE status = 'running'
       AND lease_expires_at < __schema__.kestrel_now()
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE __schema__.workflow_executions AS e
       SET status = 'queued',
           lease_owner = NULL,
           lease_expires_at = NULL,
           updated_at = __schema__.kestrel_now()
      FROM expired AS x
     WHERE e.id = x.id AND x.attempts < %(max_attempts)s
 RETURNING e.id
), poisoned AS (
    DELETE FROM __schema__.workflow_executions AS e
     USING expired AS x
     WHERE e.id = x.id AND x.attempts >= %(max_attempts)s
 RETURNING e.*
), quarantined AS (
    INSERT INTO __schema__.workflow_history
           (id, workflow, queue, priority, status, args, result, error, idempotency_key,
            lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
            app_version, concurrency_key, tags)
    SELECT id, workflow, queue, priority, 'quarantined', args, NULL,
           jsonb_build_object(
               'type', 'Quarantined',
               'message', format('claimed %%s times without finishing (max_attempts = %%s): '
                                 'the execution keeps losing its worker',
                                 attempts, %(max_attempts)s)),
           idempotency_key, lease_epoch, attempts, created_at, started_at,
           __schema__.kestrel_now(), parent_id, deadline, app_version,
           concurrency_key, tags
      FROM poisoned
    RETURNING id, parent_id, error, finished_at
), told AS (
    -- Not to a parent quarantined by this same statement (its row is deleted here).
    -- Counted: a void column cannot be a CTE's result on Citus (docs/citus.md).
    SELECT count(__schema__.child_finished(parent_id, id, 'quarantined', NULL, error)) AS n
      FROM quarantined
     WHERE parent_id IS NOT NULL
       AND parent_id NOT IN (SELECT id FROM poisoned)
), archived AS (
    SELECT __schema__.archive_finished(array_agg(id), min(finished_at)) AS n FROM quarantined
)
SELECT (SELECT count(*) FROM requeued) AS requeued,
       (SELECT count(*) FROM quarantined) AS quarantined,
       (SELECT count(*) FROM expired) AS examined,
       (SELECT n FROM told) AS told,
       (SELECT n FROM archived) AS archived;

-- name: reenqueue_expired_delegated
-- reenqueue_expired in its Citus form: a call of sweep_expired() (sql/functions), which
-- migrate delegates to the tenant's node in a distributed schema.
SELECT * FROM __schema__.sweep_expired(%(limit)s, %(max_attempts)s);

-- name: expire_deadlines
-- Fail queued and waiting executions whose workflow deadline passed (running ones are
-- stopped by their worker, which knows the deadline from the claim). Bounded. No worker sees
-- these finish: each leaves a row for the metrics collector (take_uncounted_finishes), which
-- counts it once as failed and as a deadline (migration 0016). A retry after a lost reply
-- finds the rows gone and moves nothing twice.
WITH late AS (
    SELECT id, NULL::__schema__.workflow_executions AS text_results  -- Citus: docs/citus.md
      FROM __schema__.workflow_executions
     WHERE deadline < __schema__.kestrel_now()
       AND status IN ('queued', 'waiting')
     ORDER BY deadline
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), removed AS (
    DELETE FROM __schema__.workflow_executions AS e
     USING late WHERE e.id = late.id
 RETURNING e.*
), moved AS (
    INSERT INTO __schema__.workflow_history
           (id, workflow, queue, priority, status, args, result, error, idempotency_key,
            lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
            app_version, concurrency_key, tags)
    SELECT id, workflow, queue, priority, 'failed', args, NULL,
           jsonb_build_object('type', 'kestrel.errors.DeadlineExceeded',
                              'message', format('workflow deadline %%s passed', deadline)),
           idempotency_key, lease_epoch, attempts, created_at, started_at,
           __schema__.kestrel_now(), parent_id, deadline, app_version,
           concurrency_key, tags
      FROM removed
    RETURNING id, parent_id, error, workflow, finished_at
), uncounted AS (
    INSERT INTO __schema__.uncounted_finishes (execution_id, workflow, status, deadline)
    SELECT id, workflow, 'failed', true FROM moved
), told AS (
    -- Not to a parent failed by this same statement (its row is deleted here).
    -- Counted: a void column cannot be a CTE's result on Citus (docs/citus.md).
    SELECT count(__schema__.child_finished(parent_id, id, 'failed', NULL, error)) AS n
      FROM moved
     WHERE parent_id IS NOT NULL
       AND parent_id NOT IN (SELECT id FROM removed)
), archived AS (
    SELECT __schema__.archive_finished(array_agg(id), min(finished_at)) AS n FROM moved
)
SELECT (SELECT count(*) FROM moved), (SELECT n FROM told), (SELECT n FROM archived);

-- name: expire_deadlines_delegated
-- expire_deadlines in its Citus form: a call of fail_late() (sql/functions), which migrate
-- delegates to the tenant's node in a distributed schema.
SELECT * FROM __schema__.fail_late(%(limit)s);

-- name: expire_worker_leases
-- A worker process its supervisor reaped (it died: SIGKILL, OOM, a crash) holds no lease
-- any more, whatever lease_expires_at says: end the leases of the rows it still owns now, so
-- the reenqueue_expired that follows in the same transaction re-queues them (or quarantines
-- those out of attempts: the claim counted the attempt, and a crash is one, FAULTS F9), and
-- they run again within a second instead of after the lease (FAULTS O8). Fenced: lease_owner
-- names one process incarnation (host:pid:nonce), so a row re-claimed since (another owner,
-- a newer epoch) is not touched. Rows someone holds locked are skipped; their leases expire
-- as before. Its caller wakes idle workers (wake_workers) in the same transaction when it
-- found any: in a statement of its own, so that on Citus the notification is raised on the
-- coordinator, where workers listen, not on the tenant's node (docs/citus.md).
WITH dead AS (
    SELECT id
      FROM __schema__.workflow_executions
     WHERE lease_owner = %(owner)s AND status = 'running'
     ORDER BY id
       FOR NO KEY UPDATE SKIP LOCKED
), expired AS (
    UPDATE __schema__.workflow_executions AS e
       SET lease_expires_at = '-infinity'
      FROM dead
     WHERE e.id = dead.id
 RETURNING e.id
)
SELECT count(*) FROM expired;
