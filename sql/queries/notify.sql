-- name: listen
-- Wake-ups for idle workers. Only on a direct (non-pooled) connection; polling covers any
-- notification that is lost while this connection is down.
LISTEN "kestrel.__schema_name__";
