-- Fragments of statements, written once and included where a statement of sql/queries says
-- `-- include: <name>` (kestrel.sql resolves them before anything else reads the text).

-- name: claim_lease
-- The claiming process's lease (migration 0026), which its heartbeat takes and extends: the
-- claim writes nothing to it, and claims nothing once it has run out (the sweeper may be
-- re-queuing its rows; the process takes a new lease under a new name). The row `renewed`
-- (none: nothing is claimed) is what claim_flip joins.
SELECT %(owner)s::text AS owner
 WHERE NOT EXISTS (SELECT 1 FROM __schema__.leases AS l
                    WHERE l.owner = %(owner)s AND l.expires_at <= __schema__.kestrel_now())

-- name: claim_flip
-- The claim's change to each candidate row (claim_batch, claim_limited): running under this
-- worker process's lease (lease_owner: its row in `leases`, which only its heartbeat writes;
-- the row carries no expiry of its own, migration 0026) with the epoch bumped (every later
-- write of the worker carries it and is fenced by it), one more attempt, the wake-up and a
-- give-back cleared, the first claiming app version stamped. Returns what the claim's
-- result reads.
--
-- The clock inside the COALESCE is read as a column of `clk` (issue 24: Citus refuses a
-- function that is not IMMUTABLE inside CASE or COALESCE in an UPDATE; PostgreSQL pulls the
-- one-row subquery up, so the plan is the one a call in place gives).
UPDATE __schema__.workflow_executions AS e
   SET status = 'running',
       lease_epoch = e.lease_epoch + 1,
       lease_owner = renewed.owner,
       lease_expires_at = NULL,
       attempts = e.attempts + 1,
       wake_at = NULL,
       started_at = coalesce(e.started_at, clk.now),
       app_version = coalesce(e.app_version, %(app_version)s),
       given_back_at = NULL,
       updated_at = __schema__.kestrel_now()
  FROM candidate, renewed, (SELECT __schema__.kestrel_now() AS now) AS clk
 WHERE e.id = candidate.id
 RETURNING e.id, e.workflow, e.args, e.lease_epoch, e.attempts, e.wait_step, e.wait_deadline,
       e.signal_seq, e.deadline, e.cancel_requested, e.created_at, e.waiting_for,
       e.traceparent, e.tracestate

-- name: claim_result
-- What a claim returns per execution, named as kestrel.types.Claimed's fields
-- (statements/executions.py decodes by name): arguments and checkpoints as JSON text, the
-- wait it was parked at, the database clock at the claim, the submitter's trace context.
--
-- The checkpoints are history_of()'s text, written here in the statement (issue 24): a
-- function that reads a table, called inside a statement Citus routed to a tenant's node,
-- is a nested distributed query there. In step order, each `[step_id, name, output,
-- error]`, and never more than %(max_history_bytes)s of them loaded: past the bound, only
-- `{"too_large": <bytes>}` (FAULTS P3). NULL when nothing is recorded.
SELECT c.id, c.workflow, c.args::text AS args, c.lease_epoch AS epoch, c.attempts AS attempt,
       h.steps AS steps,
       c.wait_step, c.wait_deadline, c.signal_seq, c.deadline, c.cancel_requested,
       __schema__.kestrel_now() AS db_now, c.created_at, c.waiting_for, c.traceparent,
       c.tracestate
  FROM claimed AS c
 CROSS JOIN LATERAL (
     SELECT CASE WHEN max(s.upto) > %(max_history_bytes)s
                 THEN '{"too_large": ' || max(s.upto) || '}'
                 ELSE '[' || string_agg(s.t, ',' ORDER BY s.step_id)
                             FILTER (WHERE s.upto <= %(max_history_bytes)s) || ']' END AS steps
       FROM (SELECT o.step_id, x.t, sum(octet_length(x.t)) OVER (ORDER BY o.step_id) AS upto
               FROM __schema__.operation_outputs AS o,
                    LATERAL (SELECT jsonb_build_array(o.step_id, o.step_name, o.output,
                                                      o.error)::text AS t) AS x
              WHERE o.execution_id = c.id) AS s
 ) AS h

-- name: limited_candidates
-- The rows a claim of a limited queue takes (claim_limited, claim_limited_in_namespace): at
-- most the `budget` CTE's n, queued and woken rows each through their own index, in order,
-- stopping early (an OR of the two would read the whole queue); the best of both win.
queued_first AS (
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
)

-- name: record_starts
-- The starts of a limited queue's claim (the rows of the `claimed` CTE), kept for its rate
-- limit: the newest `rate` of them, oldest first.
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
