-- name: reenqueue_expired
-- Recover executions whose lease expired (the worker died, froze or lost the database).
-- A lease is its process's row in `leases` (migration 0026): the executions running under an
-- owner whose row has run out (or that has none) are recovered, each found among the
-- running rows (the work in flight, never the backlog), and only in a round that has such
-- an owner. A row that still
-- carries a lease of its own (lease_expires_at: claimed by code from before that migration,
-- or ended at once by expire_worker_leases) is recovered once that has passed.
-- FOR UPDATE re-checks the predicate on the newest row version, so a row that was
-- completed, released or re-claimed since (another owner, or a lease of its own) is left
-- alone (River #1302); a lease that ran out is never extended again, so its owner's rows
-- cannot come back to life under it.
-- An execution claimed max_attempts times without finishing is quarantined: moved to history
-- with the reason, never claimed again. Bounded by %(limit)s; callers loop while full.
-- A process's row is dropped a day after it ran out, once nothing runs under it.
WITH dead AS (
    -- Owners whose lease ran out, and owners of running rows that never took one (a claim
    -- sent by hand: the runtime takes its lease before it claims).
    SELECT coalesce(array_agg(owner), '{}') AS owners
      FROM (SELECT owner FROM __schema__.leases
             WHERE expires_at < __schema__.kestrel_now()
            UNION
            SELECT DISTINCT e.lease_owner FROM __schema__.workflow_executions AS e
             WHERE e.status = 'running' AND e.lease_expires_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM __schema__.leases AS l
                                WHERE l.owner = e.lease_owner)) AS d
), lapsed AS (
    SELECT id, attempts, NULL::__schema__.workflow_executions AS text_results  -- docs/citus.md
      FROM __schema__.workflow_executions
     WHERE status = 'running'
       AND lease_expires_at < __schema__.kestrel_now()
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), orphaned AS (
    SELECT id, attempts, NULL::__schema__.workflow_executions AS text_results
      FROM __schema__.workflow_executions
     WHERE status = 'running'
       AND lease_expires_at IS NULL
       AND lease_owner = ANY ((SELECT owners FROM dead)::text[])
       AND cardinality((SELECT owners FROM dead)) > 0  -- read nothing in a round with none
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT * FROM lapsed UNION ALL SELECT * FROM orphaned
), forgotten AS (
    DELETE FROM __schema__.leases AS l
     WHERE l.expires_at < __schema__.kestrel_now() - interval '1 day'
       AND NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                        WHERE e.status = 'running' AND e.lease_owner = l.owner)
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
-- any more, whatever its row in `leases` says: end that lease now (and those it took under
-- later names, owner~1, owner~2, …), so the reenqueue_expired that follows in the same
-- transaction re-queues the executions it held (or quarantines those out of attempts: the
-- claim counted the attempt, and a crash is one, FAULTS F9), and they run again within a
-- second instead of after the lease (FAULTS O8). The owner names one process incarnation
-- (host:pid:nonce), so nothing claimed since by another process is touched. Returns how
-- many executions ran under it. Its caller wakes idle workers (wake_workers) in the same
-- transaction when it found any: in a statement of its own, so that on Citus the
-- notification is raised on the coordinator, where workers listen, not on the tenant's
-- node (docs/citus.md).
WITH ended AS (
    UPDATE __schema__.leases
       SET expires_at = '-infinity'
     WHERE owner = %(owner)s OR left(owner, length(%(owner)s) + 1) = %(owner)s || '~'
    RETURNING owner
)
SELECT count(*)
  FROM __schema__.workflow_executions
 WHERE status = 'running' AND lease_owner = ANY (ARRAY(SELECT owner FROM ended));
