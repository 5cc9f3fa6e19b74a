-- 0020: a claim writes two index entries fewer (issue 23, WAL per workflow).
--
-- A claim turns a queued row into a running one. status is in the predicates of the hot
-- table's partial indexes, so the claim's UPDATE is never HOT: the new row version gets an
-- entry in every index whose predicate it meets. Measured (bench.run --wal-by-relation):
-- 517 B of WAL a workflow for that version, 143 B of them for two entries no statement
-- needed.
--
-- * created_idx, the list page's order, indexed every row. Running rows leave it: the page
--   reads them, a set as small as the work in flight, from running_queue_idx and sorts them
--   (sql/queries/http.sql, page_executions).
-- * lease_idx (lease_expires_at WHERE running) and running_queue_idx (queue WHERE running)
--   indexed the same rows. One index on (queue, lease_expires_at) serves both: a limited
--   queue's count reads its queue's entries; the sweeper reads every running row's entry
--   (the work in flight, never the backlog) for the expired ones.
DROP INDEX __schema__.workflow_executions_created_idx;
CREATE INDEX workflow_executions_created_idx
    ON __schema__.workflow_executions (created_at DESC, id DESC)
    WHERE status <> 'running';
DROP INDEX __schema__.workflow_executions_lease_idx;
DROP INDEX __schema__.workflow_executions_running_queue_idx;
CREATE INDEX workflow_executions_running_queue_idx
    ON __schema__.workflow_executions (queue, lease_expires_at)
    WHERE status = 'running';
