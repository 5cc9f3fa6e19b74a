-- Limited queues and schedules. None of this runs for queues without limits.

-- name: upsert_queue_limit
-- Declare (or change) a queue's limits; the recent starts are kept across restarts.
INSERT INTO __schema__.queue_limits (queue, concurrency, rate, period)
VALUES (%(queue)s, %(concurrency)s, %(rate)s, make_interval(secs => %(period_s)s))
    ON CONFLICT (queue) DO UPDATE
   SET concurrency = excluded.concurrency, rate = excluded.rate, period = excluded.period,
       updated_at = excluded.updated_at;  -- the clock of the row offered (docs/citus.md)

-- name: limited_queues
-- The queues with limits (a namespace's client pins each to one bucket, kestrel.buckets).
SELECT queue FROM __schema__.queue_limits;

-- name: lock_queue_limit
-- First statement of a limited claim's transaction: take the queue's row, or skip the queue
-- for now if another process is claiming from it at this moment.
SELECT queue FROM __schema__.queue_limits WHERE queue = %(queue)s FOR UPDATE SKIP LOCKED;

-- name: claim_limited
-- Second statement, under the queue's row lock and with a fresh snapshot: claim at most
-- what the concurrency limit (running now) and the rate limit (starts in the last period)
-- leave, and record the starts. Same row changes and version filter as claim_batch.
WITH lim AS (
    SELECT concurrency, rate, period, recent_starts
      FROM __schema__.queue_limits WHERE queue = %(queue)s
), budget AS (
    SELECT least(
               %(limit)s,
               coalesce(lim.concurrency - (SELECT count(*) FROM __schema__.workflow_executions
                                            WHERE queue = %(queue)s AND status = 'running'),
                        %(limit)s),
               coalesce(lim.rate - (SELECT count(*) FROM unnest(lim.recent_starts) AS t(s)
                                     WHERE s > __schema__.kestrel_now() - lim.period),
                        %(limit)s)) AS n
      FROM lim
), queued_first AS (
    -- Queued and woken rows each through their own index, in order, stopping early (an OR
    -- of the two would read the whole queue); the best of both within the budget win.
    SELECT e.id, e.priority, e.created_at
      FROM __schema__.workflow_executions AS e
     WHERE e.status = 'queued' AND e.queue = %(queue)s
       AND (%(any_workflow)s OR e.workflow = ANY(%(workflows)s::text[]))
       AND (e.given_back_by IS NULL OR %(app_version)s::text IS NULL
            OR %(app_version)s::text <> ALL (e.given_back_by))
     ORDER BY e.priority DESC, e.created_at
     LIMIT greatest((SELECT n FROM budget), 0)
       FOR UPDATE SKIP LOCKED
), woken_first AS (
    SELECT e.id, e.priority, e.created_at
      FROM __schema__.workflow_executions AS e
     WHERE e.status = 'waiting' AND e.wake_at <= __schema__.kestrel_now()
       AND e.queue = %(queue)s
       AND (%(any_workflow)s OR e.workflow = ANY(%(workflows)s::text[]))
       AND (e.given_back_by IS NULL OR %(app_version)s::text IS NULL
            OR %(app_version)s::text <> ALL (e.given_back_by))
     ORDER BY e.wake_at
     LIMIT greatest((SELECT n FROM budget), 0)
       FOR UPDATE SKIP LOCKED
), candidate AS (
    SELECT c.id
      FROM (SELECT * FROM queued_first UNION ALL SELECT * FROM woken_first) AS c
     ORDER BY c.priority DESC, c.created_at
     LIMIT greatest((SELECT n FROM budget), 0)
), claimed AS (
-- include: claim_flip
), started AS (
    UPDATE __schema__.queue_limits AS l
       SET recent_starts = (
               SELECT coalesce(array_agg(s ORDER BY s), '{}')
                 FROM (SELECT s FROM unnest(l.recent_starts || array_fill(
                                    __schema__.kestrel_now(),
                                    ARRAY[(SELECT count(*) FROM claimed)::int])) AS t(s)
                        ORDER BY s DESC
                        LIMIT coalesce(l.rate, 0)) AS kept)
     WHERE l.queue = %(queue)s AND l.rate IS NOT NULL
       AND (SELECT count(*) FROM claimed) > 0
 RETURNING 1
)
-- include: claim_result
 WHERE (SELECT count(*) FROM started) >= 0;

-- name: db_now
SELECT __schema__.kestrel_now();

-- name: upsert_schedule
-- Register a schedule; a new one starts from the tick before now (no back-fill).
INSERT INTO __schema__.schedules (name, cron, workflow, last_tick)
VALUES (%(name)s, %(cron)s, %(workflow)s, %(last_tick)s)
    ON CONFLICT (name) DO UPDATE SET cron = excluded.cron, workflow = excluded.workflow,
                                     updated_at = excluded.updated_at  -- docs/citus.md
RETURNING last_tick;

-- name: advance_schedule
-- Compare-and-set: only the process that moves last_tick from what it read starts the tick.
UPDATE __schema__.schedules
   SET last_tick = %(tick)s, updated_at = now()
 WHERE name = %(name)s AND last_tick = %(seen)s
RETURNING name;

-- name: get_schedule
SELECT last_tick FROM __schema__.schedules WHERE name = %(name)s;
