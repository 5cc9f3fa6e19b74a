-- 0012: history's status index holds the outcomes worth finding, not every success (issue 16).
--
-- workflow_history_status_idx indexed (status, finished_at) for every finished execution, so
-- every completion wrote one more index entry: about 80 bytes of WAL per workflow, 2.7% of
-- all the WAL a 3-step workflow costs (bench.run --wal-by-relation, BENCHMARKS.md). Who
-- looks executions up by status looks for the failed, cancelled and quarantined ones ("which
-- workflows failed last month"); the completed ones are most of every partition, where an
-- index would not be used anyway, and history is range-partitioned by finished_at, so a
-- time window is pruned to its partitions without any index. A query for status =
-- 'failed' (or any status but 'completed') still uses this partial index.
--
-- On a large existing history the new index is built in this migration's transaction
-- (PostgreSQL cannot build an index on a partitioned table CONCURRENTLY): run `migrate`
-- when a scan of history is acceptable.
DROP INDEX __schema__.workflow_history_status_idx;
CREATE INDEX workflow_history_status_idx
    ON __schema__.workflow_history (status, finished_at)
    WHERE status <> 'completed';
