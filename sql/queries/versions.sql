-- Versions and rolling deploys (migration 0010): which workers are live with which
-- workflows, what no live worker can claim, and which executions recorded which patches.

-- name: register_worker
-- Upsert this worker's row (every heartbeat period; one statement, no session state) and
-- forget rows of workers presumed dead for an hour (killed without a clean stop), so the
-- table stays as small as the fleet.
-- Written as Citus runs it (issue 24): the clock is read outside any expression over a
-- column (`timestamptz + interval` is STABLE, and Citus refuses a STABLE function of a
-- column in a modification; `timestamptz - timestamptz` is IMMUTABLE), and DO UPDATE SET
-- takes the time from the row offered (Citus allows only IMMUTABLE functions there).
WITH forgotten AS (
    DELETE FROM __schema__.workers
     WHERE __schema__.kestrel_now() - seen_at > stale_after + interval '1 hour'
)
INSERT INTO __schema__.workers (worker_id, app_version, workflows, queues, stale_after,
                                seen_at)
VALUES (%(worker_id)s, %(app_version)s, %(workflows)s::text[], %(queues)s::text[],
        make_interval(secs => %(stale_after_s)s), __schema__.kestrel_now())
    ON CONFLICT (worker_id) DO UPDATE
   SET app_version = excluded.app_version, workflows = excluded.workflows,
       queues = excluded.queues, stale_after = excluded.stale_after,
       seen_at = excluded.seen_at;

-- name: unregister_worker
-- A clean stop: this worker no longer claims anything.
DELETE FROM __schema__.workers WHERE worker_id = %(worker_id)s;

-- name: live_workers
-- Workers seen within their lifetime, newest first.
SELECT worker_id, app_version, workflows, queues, started_at, seen_at
  FROM __schema__.workers
 WHERE seen_at + stale_after > __schema__.kestrel_now()
 ORDER BY started_at DESC, worker_id;

-- name: unclaimable_total
-- For the gauges: how many live executions no live worker can claim, under how many
-- distinct workflow names (the names themselves never become labels: FAULTS P4, S2), and
-- how many live executions were given back and not claimed since (migration 0014).
-- Counted per (workflow, queue, versions that gave them back) first, then the groups no
-- live worker of another version serves: one pass over the live rows whatever the
-- backlog's shape (0.35 s with 1M queued on the 2-core machine).
WITH grouped AS (
    SELECT workflow, queue, given_back_by, count(*) AS n,
           count(*) FILTER (WHERE given_back_at IS NOT NULL) AS given_back
      FROM __schema__.workflow_executions
     WHERE status IN ('queued', 'waiting')
     GROUP BY workflow, queue, given_back_by
), judged AS (
    SELECT g.workflow, g.n, g.given_back, NOT EXISTS (
            SELECT 1 FROM __schema__.workers AS w, unnest(w.workflows) AS wf,
                          unnest(w.queues) AS wq
             WHERE w.seen_at + w.stale_after > __schema__.kestrel_now()
               AND wf = g.workflow
               AND wq = g.queue
               AND (g.given_back_by IS NULL OR w.app_version <> ALL (g.given_back_by))
           ) AS stuck
      FROM grouped AS g
)
SELECT coalesce(sum(n) FILTER (WHERE stuck), 0)::bigint,
       count(DISTINCT workflow) FILTER (WHERE stuck),
       coalesce(sum(given_back), 0)::bigint
  FROM judged;

-- name: unclaimable_by_workflow
-- For `kestrel-runtime unclaimable`: by workflow, queue and the versions that gave them back
-- (NULL: no live worker registers them at all), the most first, bounded (a hostile stream of
-- made-up names cannot make the answer unbounded).
SELECT workflow, queue, count(*), min(created_at), given_back_by
  FROM __schema__.unclaimable
 GROUP BY workflow, queue, given_back_by
 ORDER BY count(*) DESC, workflow, queue
 LIMIT %(limit)s;

-- name: patch_summary
-- For `kestrel-runtime patches`: per workflow and patch, the live executions that recorded
-- the marker (they take the new path) and the live executions of that workflow that have
-- not (they may still need the old path: remove the old branch once this is 0).
WITH marked AS (
    SELECT workflow, patch, count(*) FILTER (WHERE execution_status IN
               ('queued', 'running', 'waiting')) AS live_with,
           count(*) AS total_with, min(at_step) AS at_step
      FROM __schema__.patch_markers
     WHERE %(patch)s::text IS NULL OR patch = %(patch)s::text
     GROUP BY workflow, patch
)
SELECT m.workflow, m.patch, m.at_step, m.total_with, m.live_with,
       (SELECT count(*) FROM __schema__.workflow_executions AS e
         WHERE e.workflow = m.workflow
           AND NOT EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                            WHERE o.execution_id = e.id AND o.step_id < 0
                              AND o.step_name = 'kestrel.patch:' || m.patch)) AS live_without
  FROM marked AS m
 ORDER BY m.workflow, m.patch;

-- name: replay_history
-- For `kestrel-runtime replay` and `export-histories`: one execution, live or finished, as a
-- replay needs it. Its arguments and checkpoints come back as JSON text, the checkpoints in
-- the claim's shape ([[step_id, name, output, error], ...], patch markers at negative ids,
-- from the workflow_steps view, hot and history alike), bounded as history_of() bounds a
-- claim's: over %(max_history_bytes)s they are {"too_large": bytes}. A parked execution also
-- gives the position and kind of its wait (the replay checks the call there). Reads only.
SELECT e.id, e.workflow, e.status, e.args::text, e.wait_step, e.waiting_for, e.app_version,
       e.created_at,
       (SELECT CASE WHEN max(h.upto) > %(max_history_bytes)s
                    THEN '{"too_large": ' || max(h.upto) || '}'
                    ELSE '[' || string_agg(h.t, ',' ORDER BY h.step_id)
                                FILTER (WHERE h.upto <= %(max_history_bytes)s) || ']' END
          FROM (SELECT s.step_id, x.t, sum(octet_length(x.t)) OVER (ORDER BY s.step_id) AS upto
                  FROM __schema__.workflow_steps AS s,
                       LATERAL (SELECT jsonb_build_array(s.step_id, s.step_name, s.output,
                                                         s.error)::text AS t) AS x
                 WHERE s.execution_id = e.id) AS h) AS steps
  FROM (SELECT id, workflow, status, args, wait_step, waiting_for, app_version, created_at
          FROM __schema__.workflow_executions WHERE id = %(id)s
        UNION ALL
        SELECT id, workflow, status, args, NULL::integer, NULL::text, app_version, created_at
          FROM __schema__.workflow_history WHERE id = %(id)s) AS e;
