-- name: waiting_stats
-- Waiting executions of the given (registered) workflows by what they wait for: a signal's
-- name, kestrel.sleep or kestrel.child (children by kind, never by id). The largest groups
-- first, at most %(limit)s of them: the metric built from this stays bounded.
SELECT workflow,
       CASE WHEN waiting_for LIKE 'kestrel.child:%%' THEN 'kestrel.child'
            ELSE coalesce(waiting_for, 'unknown') END AS waiting_for,
       count(*) AS n
  FROM __schema__.workflow_executions
 WHERE status = 'waiting'
   AND workflow = ANY(%(workflows)s)
 GROUP BY 1, 2
 ORDER BY n DESC, 1, 2
 LIMIT %(limit)s;
