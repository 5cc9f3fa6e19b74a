-- The movable clock of a schema made for tests (migration 0016): applied by migrate, after
-- sql/functions, to a schema that has the clock_offset table, and never to any other.
--
-- A test moves time by writing clock_offset (kestrel.testing's advance_clock, or an UPDATE
-- of its own). The trigger rewrites kestrel_now() as now() plus the new offset, written as
-- a constant: the clock function reads no table, is inlined like production's `now()`, and
-- PostgreSQL invalidates every cached plan that inlined the old one. Only the schema's owner
-- may replace the function, so a runtime role that can write the table still cannot move
-- time. The offset is written in ISO 8601 (the function's IntervalStyle), which reads back
-- the same whatever IntervalStyle the session calling kestrel_now() has.

-- name: kestrel_test_clock_moved
-- Its one row is moved, never deleted (the clock would stay where it was, unmovable).
CREATE OR REPLACE FUNCTION __schema__.kestrel_test_clock_moved() RETURNS trigger
LANGUAGE plpgsql SET "IntervalStyle" TO 'iso_8601' AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'the test clock of schema % is moved, not deleted', TG_TABLE_SCHEMA
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    EXECUTE format('CREATE OR REPLACE FUNCTION %I.kestrel_now() RETURNS timestamptz '
                   'LANGUAGE sql STABLE PARALLEL SAFE AS %L', TG_TABLE_SCHEMA,
                   format('SELECT now() + %L::interval', NEW.offset_by::text));
    RETURN NULL;
END
$$;

-- name: test_clock_trigger
DROP TRIGGER IF EXISTS clock_moved ON __schema__.clock_offset;
CREATE TRIGGER clock_moved AFTER UPDATE OR DELETE ON __schema__.clock_offset
    FOR EACH ROW EXECUTE FUNCTION __schema__.kestrel_test_clock_moved();

-- name: test_clock_sync
-- Install the clock of the current offset (sql/functions just put production's back).
UPDATE __schema__.clock_offset SET offset_by = offset_by;
