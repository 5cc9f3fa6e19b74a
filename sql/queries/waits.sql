-- name: waiting_stats
-- Waiting executions of the given (registered) workflows by what they wait for: a signal's
-- name, kestrel.sleep or kestrel.child (children by kind, never by id). The %(limit)s largest
-- groups by name; the rest of each workflow's counted under 'other', so the metric built
-- from this stays bounded and still adds up.
WITH groups AS (
    SELECT workflow,
           CASE WHEN waiting_for LIKE 'kestrel.child:%%' THEN 'kestrel.child'
                ELSE coalesce(waiting_for, 'unknown') END AS waiting_for,
           count(*) AS n
      FROM __schema__.workflow_executions
     WHERE status = 'waiting'
       AND workflow = ANY(%(workflows)s)
     GROUP BY 1, 2
), ranked AS (
    SELECT workflow, waiting_for, n,
           row_number() OVER (ORDER BY n DESC, workflow, waiting_for) AS rank
      FROM groups
)
SELECT workflow, CASE WHEN rank <= %(limit)s THEN waiting_for ELSE 'other' END, sum(n)
  FROM ranked
 GROUP BY 1, 2
 ORDER BY 3 DESC, 1, 2;
