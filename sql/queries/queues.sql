-- Limited queues and schedules. None of this runs for queues without limits.

-- name: upsert_queue_limit
-- Declare (or change) a queue's limits; the recent starts are kept across restarts.
INSERT INTO __schema__.queue_limits (queue, concurrency, rate, period)
VALUES (%(queue)s, %(concurrency)s, %(rate)s, make_interval(secs => %(period_s)s))
    ON CONFLICT (queue) DO UPDATE
   SET concurrency = excluded.concurrency, rate = excluded.rate, period = excluded.period,
       updated_at = excluded.updated_at;  -- the clock of the row offered (docs/citus.md)

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
),
-- include: limited_candidates
, claimed AS (
-- include: claim_flip
), started AS (
-- include: record_starts
 RETURNING 1
)
-- include: claim_result
 WHERE (SELECT count(*) FROM started) >= 0;

-- name: lock_namespace_limit
-- A namespace of buckets (kestrel.buckets) holds a queue's limits across all its buckets:
-- the first statement of a limited claim in any bucket takes the queue's row in the queue's
-- home bucket (buckets.home), or skips the queue for now; it returns the concurrency limit
-- and the starts the rate limit leaves in its window (NULL: no such limit).
SELECT concurrency,
       rate - (SELECT count(*) FROM unnest(recent_starts) AS t(s)
                WHERE s > __schema__.kestrel_now() - period)
  FROM __schema__.queue_limits WHERE queue = %(queue)s FOR UPDATE SKIP LOCKED;

-- name: running_in_queue
-- How many of the queue's executions run in this bucket, read under the home row's lock
-- (every claim of the queue, in any bucket, takes it before its rows turn running).
SELECT count(*) FROM __schema__.workflow_executions
 WHERE queue = %(queue)s AND status = 'running';

-- name: claim_limited_in_namespace
-- Claim at most %(budget)s of the queue in this bucket: what the limits leave across the
-- namespace, worked out under the home row's lock. Same row changes and version filter as
-- claim_limited.
WITH budget AS (
    SELECT %(budget)s::bigint AS n
),
-- include: limited_candidates
, claimed AS (
-- include: claim_flip
)
-- include: claim_result
;

-- name: record_namespace_starts
-- In the home bucket, after a claim in any bucket took %(started)s: the starts, for the
-- rate limit's window.
WITH claimed AS (
    SELECT generate_series(1, %(started)s)
)
-- include: record_starts
;

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
