-- name: listen
-- Wake-ups for idle workers. Only on a direct (non-pooled) connection; polling covers any
-- notification that is lost while this connection is down.
LISTEN "kestrel.__schema_name__";

-- name: wake_workers
-- Wake idle workers at commit: work is claimable now (a dead worker's leases were ended).
-- A statement on its own that reads no table, so Citus raises it on the coordinator.
SELECT pg_notify('kestrel.__schema_name__', 'recovered');
