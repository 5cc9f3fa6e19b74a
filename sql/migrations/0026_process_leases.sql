-- 0026: one lease per worker process, in a narrow row only the runtime writes (issue 38
-- item 2, FAULTS C2/C3; issue 40 item 1).
--
-- Until now each running execution carried its own lease (lease_expires_at), and the
-- heartbeat extended it by locking the execution's row. Anything else holding that row (the
-- worker's own checkpoint batches, FOR SHARE; a client's signal() in a transaction left
-- open) stopped it being extended: a healthy worker's lease could lapse, its execution be
-- re-run as a new attempt.
--
-- Now a process holds one row here, `owner` (host:pid:nonce, never reused) good until
-- `expires_at`. Its heartbeat extends only that row, and only while it has not run out: a
-- lease that lapsed is never revived, its owner takes a new name (owner~1, owner~2, …). An
-- execution claimed by the process says lease_owner = owner and has no lease_expires_at of
-- its own (NULL); it is the sweeper's once its owner's row has run out. No lock on an
-- execution row, nor on the executions table, can stand between a heartbeat and its row.
--
-- Rows with a lease_expires_at of their own (claimed by code before this migration, still
-- running during the upgrade) keep the per-row rule: swept once it has passed. The sweeper
-- drops a process's row a day after it ran out, when nothing runs under it any more.
CREATE TABLE __schema__.leases (
    owner text NOT NULL,
    expires_at timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    PRIMARY KEY (owner)
);
