-- name: listen
-- Wake-ups for idle workers. Only on a direct (non-pooled) connection; polling covers any
-- notification that is lost while this connection is down.
LISTEN "kestrel.__schema_name__";

-- name: wake_workers
-- Wake idle workers at commit: work is claimable now (a dead worker's leases were ended).
-- A statement on its own that reads no table, so Citus raises it on the coordinator.
SELECT pg_notify('kestrel.__schema_name__', 'recovered');

-- name: notify_done
-- Wake result() waiters after a completion in its Citus form (complete_batch_delegated),
-- which commits on the tenant's node, where no notification reaches the coordinator's
-- listeners. Reads no table: raised on the coordinator. Sent after that commit, so a worker
-- that dies between the two leaves the waiters to their next recheck (client waits recheck
-- every few seconds while they listen).
SELECT pg_notify('kestrel.__schema_name__.done', '');
