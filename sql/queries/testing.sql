-- Statements of kestrel.testing, the kit users test their workflows with. Time moves the way
-- the runtime reads it: every lease, sleep and timeout decision reads kestrel_now(), which in
-- a schema made for tests is now() plus clock_offset (migration 0016, sql/testclock), so
-- moving the offset moves the database's clock for the runtime and nothing else. A
-- production schema has no clock_offset: these fail there, and the kit refuses it first.

-- name: advance_clock
-- Move the database clock forward by %(seconds)s; return the new kestrel_now().
UPDATE __schema__.clock_offset
   SET offset_by = offset_by + make_interval(secs => %(seconds)s)
RETURNING now() + offset_by;

-- name: skip_to_next_sleep
-- When nothing can run now (no queued or running execution, no wait already due), move the
-- clock to the earliest end of a durable sleep (ctx.sleep) so it wakes; return how far it
-- moved, in seconds, or no row. Waits for a signal and their timeouts are left alone: a test
-- sends the signal, or moves the clock past the timeout itself.
WITH live AS (
    SELECT count(*) FILTER (WHERE status IN ('queued', 'running')
                               OR (status = 'waiting'
                                   AND wake_at <= __schema__.kestrel_now())) AS busy,
           min(wake_at) FILTER (WHERE status = 'waiting'
                                  AND waiting_for = 'kestrel.sleep') AS wake
      FROM __schema__.workflow_executions
)
UPDATE __schema__.clock_offset AS c
   SET offset_by = c.offset_by + (live.wake - __schema__.kestrel_now())
  FROM live
 WHERE live.busy = 0 AND live.wake > __schema__.kestrel_now()
-- kestrel_now() here still reads the statement's snapshot: the clock before the move.
RETURNING extract(epoch FROM live.wake - __schema__.kestrel_now())::float8;

-- name: waiting_for
-- What a live execution waits for (a signal name, kestrel.sleep, kestrel.child:…) and until
-- when; no row once it finished.
SELECT status, waiting_for, wake_at
  FROM __schema__.workflow_executions
 WHERE id = %(id)s;

-- name: reset_for_test
-- Empty every table of the schema but the migration record and set the clock back: each
-- test starts from a fresh schema without paying for the migrations again. Only a schema
-- made for tests: any other is refused before anything is emptied.
DO $$
DECLARE
    v_tables text;
BEGIN
    IF to_regclass('__schema__.clock_offset') IS NULL THEN
        RAISE EXCEPTION 'schema __schema_name__ was not made for tests: not emptying it'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT string_agg(format('%I.%I', schemaname, tablename), ', ')
      INTO v_tables
      FROM pg_tables
     WHERE schemaname = '__schema_name__'
       AND tablename NOT IN ('schema_migrations', 'clock_offset');
    IF v_tables IS NOT NULL THEN
        EXECUTE 'TRUNCATE ' || v_tables;
    END IF;
    UPDATE __schema__.clock_offset SET offset_by = interval '0';
END
$$;

-- name: drop_schema
-- Drop a test session's schema with everything in it.
DROP SCHEMA IF EXISTS __schema__ CASCADE;
