-- Statements of `kestrel-runtime migrate` (kestrel/migrate.py). They run in a few short
-- transactions (the schema, each migration, the functions), each of which takes the advisory
-- lock first; the lock is transaction-level, released at COMMIT.

-- name: migrate_lock
SELECT pg_advisory_xact_lock(hashtext('kestrel.migrate.__schema_name__'));

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS __schema__;

-- name: may_migrate
-- Whether this role may migrate the schema: own it (or be a member of its owner's role, or
-- a superuser) when it exists, or be allowed to create schemas in the database when it does
-- not. A least-privilege runtime then checks the schema instead of sending DDL it may not
-- run, which would leave an ERROR in the server's log (and, on Citus, in every worker
-- node's) at each start.
SELECT CASE WHEN n.oid IS NULL THEN has_database_privilege(current_database(), 'CREATE')
            ELSE pg_has_role(current_user, n.nspowner, 'USAGE') END
  FROM (SELECT NULL) AS one
  LEFT JOIN pg_catalog.pg_namespace AS n ON n.nspname = '__schema_name__';

-- name: migrations_table_exists
-- Read from the catalog tables, not to_regclass(): a transaction that waited for another
-- migrate's advisory lock may still hold that backend's cached "no such table" from before
-- the wait (to_regclass takes no lock, so it processes no invalidation; a concurrent migrate
-- then applied migration 1 twice). Scanning pg_class takes its lock, which does. The same
-- for the three checks below.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class
                WHERE relnamespace = (SELECT oid FROM pg_catalog.pg_namespace
                                     WHERE nspname = '__schema_name__')
                  AND relname = 'schema_migrations');

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
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class
                WHERE relnamespace = (SELECT oid FROM pg_catalog.pg_namespace
                                     WHERE nspname = '__schema_name__')
                  AND relname = 'clock_offset');

-- name: lock_test_clock
-- Wait for a test moving the clock to commit: migrate and the clock trigger both replace
-- kestrel_now(), and two transactions replacing one function at once fail.
SELECT offset_by FROM __schema__.clock_offset FOR UPDATE;

-- name: delegate_functions
-- In a Citus distributed schema: run save_steps(), finish_batch(), sweep_expired() and
-- fail_late() on the tenant's node, so a checkpoint batch, a batch of completions or a
-- sweeper's pass is one round trip to that node, executed there, with no other node in its
-- transaction (docs/citus.md). Anywhere else it does nothing; a schema distributed later
-- gets it from the next migrate. Idempotent.
DO $$
BEGIN
    IF __schema__.distributed_schema() THEN
        PERFORM create_distributed_function(
            '__schema__.save_steps(jsonb, boolean)'::regprocedure,
            colocate_with => '__schema__.workflow_executions');
        PERFORM create_distributed_function(
            '__schema__.finish_batch(jsonb)'::regprocedure,
            colocate_with => '__schema__.workflow_executions');
        PERFORM create_distributed_function(
            '__schema__.sweep_expired(integer, integer)'::regprocedure,
            colocate_with => '__schema__.workflow_executions');
        PERFORM create_distributed_function(
            '__schema__.fail_late(integer)'::regprocedure,
            colocate_with => '__schema__.workflow_executions');
    END IF;
END
$$;

-- name: bucket_table_exists
-- Whether the schema has the bucket table (migration 0021): a schema that does not exist
-- yet, or is older, has none and is no bucket.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class
                WHERE relnamespace = (SELECT oid FROM pg_catalog.pg_namespace
                                     WHERE nspname = '__schema_name__') AND relname = 'bucket');

-- name: migrate_finished
-- Whether a migrate ever finished on this schema: its last transaction installs the functions
-- (sql/functions), the first of which says their version. A schema whose migrate stopped
-- part-way has migrations and no functions.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_proc
                WHERE pronamespace = (SELECT oid FROM pg_catalog.pg_namespace
                                     WHERE nspname = '__schema_name__')
                  AND proname = 'kestrel_functions_version');

-- name: read_bucket
-- The bucket this schema is of its namespace, and the namespace's bucket count (migration
-- 0021); no row for an ordinary schema.
SELECT bucket, buckets FROM __schema__.bucket;

-- name: record_bucket
-- Make this schema bucket %(bucket)s of %(buckets)s, once: a schema that is already a bucket
-- keeps its row (migrate compares it first and refuses another).
INSERT INTO __schema__.bucket (bucket, buckets) VALUES (%(bucket)s, %(buckets)s)
ON CONFLICT (one) DO NOTHING;

-- name: set_bucket
-- kestrel_bucket() of a bucket's schema: the bucket's number as an immutable constant
-- (migrate writes the number in place of __bucket__, an integer it has checked; a DDL body
-- takes no parameters).
CREATE OR REPLACE FUNCTION __schema__.kestrel_bucket() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT __bucket__
$$;

-- name: functions_version
-- The version of the schema's functions (kestrel_functions_version(), sql/functions); the
-- caller takes a schema without that function (installed before it existed) for version 0.
SELECT __schema__.kestrel_functions_version();

-- name: distributed_schema
-- Whether this schema is a Citus distributed schema: the worker then sends the Citus forms
-- of its statements (save_new_steps_delegated, save_steps_delegated,
-- complete_batch_delegated and notify_done, reenqueue_expired_delegated,
-- expire_deadlines_delegated).
SELECT __schema__.distributed_schema();

-- name: node_lock_timeout
-- On a Citus coordinator: the lock_timeout this role's sessions get on the worker nodes,
-- where a routed statement waits for its locks. A session setting (the runtime's
-- --lock-timeout rides on one) stays on the coordinator; a role or database setting
-- (ALTER ROLE … SET lock_timeout) Citus propagates to every node, and its connections there
-- run as this role (docs/citus.md). The most specific setting wins, as PostgreSQL applies
-- them; '0' when there is none; NULL when this is no Citus coordinator.
SELECT CASE WHEN to_regclass('pg_catalog.pg_dist_node') IS NOT NULL THEN
       coalesce((SELECT substr(c, length('lock_timeout=') + 1)
                   FROM pg_catalog.pg_db_role_setting AS s,
                        unnest(s.setconfig) AS c
                  WHERE s.setrole IN (0, (SELECT oid FROM pg_catalog.pg_roles
                                           WHERE rolname = current_user))
                    AND s.setdatabase IN (0, (SELECT oid FROM pg_catalog.pg_database
                                               WHERE datname = current_database()))
                    AND c LIKE 'lock\_timeout=%%'
                  ORDER BY s.setrole <> 0 DESC, s.setdatabase <> 0 DESC
                  LIMIT 1), '0') END;
