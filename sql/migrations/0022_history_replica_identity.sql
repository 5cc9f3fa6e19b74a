-- 0022: every table of a schema can be moved by the Citus rebalancer's default mode (logical
-- replication), which refuses a table with neither a primary key nor a replica identity
-- (issue 44 row 5: `cannot use logical replication to transfer shards of the relation
-- workflow_history_default`). The three history tables partitioned by finish time have no
-- key a row can be found by (an execution, a signal, an event may be there under one id
-- more than once over its life): they and each of their partitions get REPLICA IDENTITY
-- FULL, and so does every partition upkeep adds (sql/partitions). On plain PostgreSQL at
-- wal_level = replica this changes nothing written: the old row is logged only for logical
-- decoding.
DO $$
DECLARE
    v_table regclass;
BEGIN
    FOR v_table IN
        SELECT c.oid::regclass
          FROM pg_class AS c
         WHERE c.relnamespace = '__schema_name__'::regnamespace
           AND (c.relname IN ('workflow_history', 'signal_history', 'event_history')
                OR c.oid IN (SELECT inhrelid FROM pg_inherits
                              WHERE inhparent IN ('__schema__.workflow_history'::regclass,
                                                  '__schema__.signal_history'::regclass,
                                                  '__schema__.event_history'::regclass)))
    LOOP
        EXECUTE format('ALTER TABLE %s REPLICA IDENTITY FULL', v_table);
    END LOOP;
END
$$;
