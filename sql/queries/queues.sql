-- Limited queues and schedules. None of this runs for queues without limits.

-- name: upsert_queue_limit
-- Declare (or change) a queue's limits; the recent starts are kept across restarts.
INSERT INTO __schema__.queue_limits (queue, concurrency, rate, period, per_key)
VALUES (%(queue)s, %(concurrency)s, %(rate)s, make_interval(secs => %(period_s)s),
        %(per_key)s)
    ON CONFLICT (queue) DO UPDATE
   SET concurrency = excluded.concurrency, rate = excluded.rate, period = excluded.period,
       per_key = excluded.per_key,
       updated_at = excluded.updated_at;  -- the clock of the row offered (docs/citus.md)

-- name: limits_of
-- The limits of the queues a process serves (%(queues)s) that have them, declared by
-- whichever worker: what its claims honour, also for a queue it does not declare (FAULTS C4).
-- Read each time the process looks at the limits (claimer.Claimer), in its own bucket, where
-- every declaring worker writes them.
SELECT queue, concurrency, rate, extract(epoch FROM period)::float8 AS period_s, per_key
  FROM __schema__.queue_limits
 WHERE queue = ANY(%(queues)s::text[])
 ORDER BY queue;

-- name: remove_queue_limit
-- An operator removes a queue's limits (`kestrel-runtime remove-limits`): its row goes, with
-- its recent starts and its keys' turn, and workers claim the queue as unlimited from their
-- next look at the limits. Sent again after a lost reply it removes nothing more. Returns
-- the queue when there was a row.
DELETE FROM __schema__.queue_limits WHERE queue = %(queue)s RETURNING queue;

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
, renewed AS (
-- include: claim_lease
), claimed AS (
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
-- home bucket (buckets.home), or skips the queue for now; it returns the concurrency limit,
-- the starts the rate limit leaves in its window and the limit per concurrency key (NULL: no
-- such limit). A keyed queue's claims take this way on one schema too (claim_keyed).
SELECT concurrency,
       rate - (SELECT count(*) FROM unnest(recent_starts) AS t(s)
                WHERE s > __schema__.kestrel_now() - period),
       per_key
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
, renewed AS (
-- include: claim_lease
), claimed AS (
-- include: claim_flip
)
-- include: claim_result
;

-- name: running_by_key
-- A keyed queue's running executions in this bucket by concurrency key ('' for those without
-- one), read under the home row's lock as running_in_queue is.
SELECT coalesce(concurrency_key, ''), count(*) FROM __schema__.workflow_executions
 WHERE queue = %(queue)s AND status = 'running'
 GROUP BY 1;

-- name: claim_keyed
-- Claim at most %(budget)s of a keyed queue in this bucket (migration 0025), under the home
-- row's lock: at most %(per_key)s running per key, counting %(run_keys)s/%(run_counts)s (what
-- runs in every bucket, by key), and the keys take turns.
--
-- The turn: the keys with queued rows are walked in key order from just after the one the
-- last claim ended on (queue_limits.key_turn) round to it again, one index probe per key
-- (a loose scan of workflow_executions_key_claim_idx, never a key's rows), until
-- %(want_keys)s keys that may start one more are found, or %(max_keys)s keys. Each
-- key offers its best rows (priority, then age) up to what it may still start; the first
-- row of every key goes before the second of any, and the place moves to the last key
-- served (to the last key walked when none was). A key with ten thousand queued is one key.
-- Rows without a key (submitted before the queue had per_key, or without one) are one key,
-- '', found among the queue's first 2 × %(want_keys)s rows in claim order (they come up as
-- the queue drains); woken rows (a sleep or a wait ended) go first, within their key's
-- limit.
--
-- The walk reads and locks nothing; only the rows chosen are locked, SKIP LOCKED, their
-- state checked again on the row's newest version. Same row changes and version filter as
-- claim_limited.
WITH RECURSIVE budget AS (
    SELECT %(budget)s::bigint AS n
), turn AS (
    SELECT (SELECT l.key_turn FROM __schema__.queue_limits AS l
             WHERE l.queue = %(queue)s) AS k
), running AS (
    SELECT r.k, r.n FROM unnest(%(run_keys)s::text[], %(run_counts)s::bigint[]) AS r(k, n)
), walk(k, i, found, wrapped) AS (
    -- One index probe per key (OFFSET 0: each probe is made once, not once per use).
    SELECT x.k, 1,
           (%(per_key)s > coalesce((SELECT r.n FROM running AS r WHERE r.k = x.k), 0))::int,
           x.k <= coalesce((SELECT k FROM turn), '')
      FROM (SELECT coalesce(
                (SELECT e.concurrency_key FROM __schema__.workflow_executions AS e
                  WHERE e.status = 'queued' AND e.queue = %(queue)s
                    AND e.concurrency_key > coalesce((SELECT k FROM turn), '')
                  ORDER BY e.concurrency_key LIMIT 1),
                (SELECT e.concurrency_key FROM __schema__.workflow_executions AS e
                  WHERE e.status = 'queued' AND e.queue = %(queue)s
                    AND e.concurrency_key > ''
                  ORDER BY e.concurrency_key LIMIT 1)) AS k
            OFFSET 0) AS x
    UNION ALL
    SELECT x.k, w.i + 1,
           w.found + (%(per_key)s > coalesce((SELECT r.n FROM running AS r WHERE r.k = x.k),
                                              0))::int,
           w.wrapped OR x.k <= w.k
      FROM walk AS w
     CROSS JOIN LATERAL (
         SELECT coalesce(
                    (SELECT e.concurrency_key FROM __schema__.workflow_executions AS e
                      WHERE e.status = 'queued' AND e.queue = %(queue)s
                        AND e.concurrency_key > w.k
                      ORDER BY e.concurrency_key LIMIT 1),
                    (SELECT e.concurrency_key FROM __schema__.workflow_executions AS e
                      WHERE NOT w.wrapped AND e.status = 'queued' AND e.queue = %(queue)s
                        AND e.concurrency_key > ''
                      ORDER BY e.concurrency_key LIMIT 1)) AS k
         OFFSET 0) AS x
     WHERE w.k IS NOT NULL AND w.i < %(max_keys)s AND w.found < %(want_keys)s
       AND NOT (w.wrapped AND w.k >= coalesce((SELECT k FROM turn), ''))
), rotation AS (
    -- Each key once: the walk stops where it came round past the turn.
    SELECT w.k, w.i::float8 AS pos, w.wrapped FROM walk AS w
     WHERE w.k IS NOT NULL AND NOT (w.wrapped AND w.k > coalesce((SELECT k FROM turn), ''))
), room AS (
    SELECT r.k, r.pos, %(per_key)s - coalesce(run.n, 0) AS n
      FROM rotation AS r LEFT JOIN running AS run ON run.k = r.k
     WHERE %(per_key)s - coalesce(run.n, 0) > 0
), keyed AS (
    SELECT x.id, x.priority, x.created_at, m.k, m.pos, false AS woke
      FROM room AS m
     CROSS JOIN LATERAL (
         SELECT e.id, e.priority, e.created_at
           FROM __schema__.workflow_executions AS e
          WHERE e.status = 'queued' AND e.queue = %(queue)s AND e.concurrency_key = m.k
            AND (%(any_workflow)s OR e.workflow = ANY(%(workflows)s::text[]))
            AND (e.given_back_by IS NULL OR %(app_version)s::text IS NULL
                 OR %(app_version)s::text <> ALL (e.given_back_by))
          ORDER BY e.priority DESC, e.created_at
          LIMIT least(m.n, (SELECT n FROM budget))
     ) AS x
), unkeyed AS (
    SELECT f.id, f.priority, f.created_at, '' AS k,
           coalesce((SELECT min(r.pos) FROM rotation AS r WHERE r.wrapped),
                    (SELECT max(r.pos) + 1 FROM rotation AS r), 1) - 0.5 AS pos,
           false AS woke
      FROM (SELECT w.id, w.priority, w.created_at, w.concurrency_key, w.workflow,
                   w.given_back_by
              FROM __schema__.workflow_executions AS w
             WHERE w.status = 'queued' AND w.queue = %(queue)s
             ORDER BY w.priority DESC, w.created_at
             LIMIT 2 * %(want_keys)s) AS f
     WHERE f.concurrency_key IS NULL
       AND (%(any_workflow)s OR f.workflow = ANY(%(workflows)s::text[]))
       AND (f.given_back_by IS NULL OR %(app_version)s::text IS NULL
            OR %(app_version)s::text <> ALL (f.given_back_by))
     LIMIT least(greatest(%(per_key)s - coalesce((SELECT n FROM running WHERE k = ''), 0), 0),
                 (SELECT n FROM budget))
), woken AS (
    SELECT e.id, e.priority, e.created_at, coalesce(e.concurrency_key, '') AS k,
           -1::float8 AS pos, true AS woke
      FROM __schema__.workflow_executions AS e
     WHERE e.status = 'waiting' AND e.wake_at <= __schema__.kestrel_now()
       AND e.queue = %(queue)s
       AND (%(any_workflow)s OR e.workflow = ANY(%(workflows)s::text[]))
       AND (e.given_back_by IS NULL OR %(app_version)s::text IS NULL
            OR %(app_version)s::text <> ALL (e.given_back_by))
     ORDER BY e.wake_at
     LIMIT %(max_keys)s
), ranked AS (
    SELECT p.id, p.k, p.pos, p.created_at,
           row_number() OVER (PARTITION BY p.k
                              ORDER BY p.woke DESC, p.priority DESC, p.created_at) AS rank
      FROM (SELECT * FROM keyed UNION ALL SELECT * FROM unkeyed
            UNION ALL SELECT * FROM woken) AS p
), chosen AS (
    SELECT r.id, r.k, r.pos, r.rank
      FROM ranked AS r LEFT JOIN running AS run ON run.k = r.k
     WHERE r.rank <= %(per_key)s - coalesce(run.n, 0)
     ORDER BY r.rank, r.pos, r.created_at
     LIMIT (SELECT n FROM budget)
), candidate AS (
    -- The chosen rows locked, each still queued (or woken) on its newest version; one that
    -- a client holds is left for the next claim. By an array of ids: the planner takes it
    -- for a handful of rows (its estimate of the walk is no guide) and goes by primary key.
    SELECT e.id
      FROM __schema__.workflow_executions AS e
     WHERE e.id = ANY (ARRAY(SELECT c.id FROM chosen AS c))
       AND e.queue = %(queue)s
       AND e.status <> 'running'
       AND (e.status = 'queued' OR e.wake_at <= __schema__.kestrel_now())
       FOR UPDATE SKIP LOCKED
), renewed AS (
-- include: claim_lease
), claimed AS (
-- include: claim_flip
), turned AS (
    -- The place for the next claim: the key of the last row chosen in turn order, or the
    -- last key walked when none was (a walk that found nothing to start moves on).
    UPDATE __schema__.queue_limits AS l
       SET key_turn = t.k
      FROM (SELECT coalesce(
                (SELECT c.k FROM chosen AS c WHERE c.pos >= 0
                  ORDER BY c.rank DESC, c.pos DESC LIMIT 1),
                (SELECT r.k FROM rotation AS r ORDER BY r.pos DESC LIMIT 1)) AS k) AS t
     WHERE l.queue = %(queue)s AND t.k IS NOT NULL
    RETURNING 1
)
-- include: claim_result
 WHERE (SELECT count(*) FROM turned) >= 0;

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
