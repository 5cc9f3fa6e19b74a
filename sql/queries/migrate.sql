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
