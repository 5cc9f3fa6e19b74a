-- 0008: claims whose cost does not grow with the backlog.
--
-- A claim reads each queue through an index in (priority, age) order and stops after the
-- rows it takes (sql/queries/executions.sql, queues.sql). These partial indexes serve the
-- parts that had none: suspects (claimed twice without finishing: a handful, read on every
-- claim) and the running count of a limited queue (its concurrency limit).

CREATE INDEX workflow_executions_suspect_idx
    ON __schema__.workflow_executions (queue, priority DESC, created_at)
    WHERE status = 'queued' AND attempts >= 2;

CREATE INDEX workflow_executions_running_queue_idx
    ON __schema__.workflow_executions (queue)
    WHERE status = 'running';
