-- Statements of `kestrel-runtime migrate` (kestrel/migrate.py). They run in one
-- transaction; the advisory lock is transaction-level, released at COMMIT.

-- name: migrate_lock
SELECT pg_advisory_xact_lock(hashtext('kestrel.migrate.__schema_name__'));

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS __schema__;

-- name: migrations_table_exists
SELECT to_regclass('__schema__.schema_migrations') IS NOT NULL;

-- name: applied_migrations
SELECT version FROM __schema__.schema_migrations;

-- name: current_migration
SELECT coalesce(max(version), 0) FROM __schema__.schema_migrations;

-- name: record_migration
INSERT INTO __schema__.schema_migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: ensure_current_partitions
-- The current period's partition only on install or upgrade (%(current)s), when nothing
-- else writes yet; the runtime's upkeep only ever adds future ones.
SELECT __schema__.kestrel_ensure_history_partitions_v1(%(interval)s, %(ahead)s, %(current)s);

-- name: set_clock_kind
-- Which clock a migration that makes one (0016) gives the schema: 'on' for a schema made for
-- tests. Local to migrate's transaction: no session state is left behind.
SELECT set_config('kestrel.test_clock', %(test_clock)s, true);

-- name: has_test_clock
-- Whether the schema was made for tests: it has the clock tests move (migration 0016).
SELECT to_regclass('__schema__.clock_offset') IS NOT NULL;

-- name: lock_test_clock
-- Wait for a test moving the clock to commit: migrate and the clock trigger both replace
-- kestrel_now(), and two transactions replacing one function at once fail.
SELECT offset_by FROM __schema__.clock_offset FOR UPDATE;

-- name: delegate_functions
-- On Citus, in a distributed schema (schema-based sharding): run save_steps() on the tenant's
-- node, so a checkpoint batch is one round trip to that node, its statements executed
-- there, with no other node in its transaction (docs/citus.md). Anywhere else (plain
-- PostgreSQL, a Citus schema that is not distributed) it does nothing; a schema distributed
-- later gets it from the next migrate. Idempotent.
DO $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_schema') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_dist_schema
                    WHERE schemaid = '__schema__'::regnamespace) THEN
            PERFORM create_distributed_function(
                '__schema__.save_steps(jsonb, boolean)'::regprocedure,
                colocate_with => '__schema__.workflow_executions');
        END IF;
    END IF;
END
$$;
