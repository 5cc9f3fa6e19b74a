-- Partition upkeep for workflow_history and what leaves the hot tables with an execution:
-- signal_history and event_history, range-partitioned by finish time with identical bounds;
-- and for operation_outputs, every checkpoint, range-partitioned by execution id (UUIDv7:
-- creation time) with the ids of the same periods' bounds (migration 0019). Installed by
-- `migrate`, replaced on every run: the _v1 names change if the signatures ever do.
--
-- Upkeep creates partitions ahead of time and drops (or detaches) those wholly older than
-- the retention: history is never trimmed with DELETE. A period of operation_outputs goes
-- once none of the executions created in it is live or in history any more (a two-week
-- wait keeps its checkpoints); its DEFAULT partition (ids that are no UUIDv7 of a covered
-- period) is trimmed of the checkpoints of executions that are gone, in a round that drops
-- history. Partition names and bounds derive from a validated
-- interval ('day', 'week' or 'month') and timestamps, never from caller text, and every
-- identifier goes through format('%I'). Each function runs with a short lock_timeout (set on
-- the function, so no session state leaks): if a lock is contended it fails fast and the
-- next upkeep round tries again, instead of queueing ahead of the hot path's inserts.

-- name: ensure
-- Create the partitions of the next p_ahead periods. The current period's partition is
-- created only with p_include_current (at migrate, before traffic): attaching a partition
-- for a range that inserts are landing in right now would race them (an insert routed to
-- DEFAULT would fail the new partition constraint). A period whose partition was never
-- created ahead (upkeep stopped for longer than p_ahead periods) stays in DEFAULT.
CREATE OR REPLACE FUNCTION __schema__.kestrel_ensure_history_partitions_v1(
    p_interval text, p_ahead integer, p_include_current boolean DEFAULT false
) RETURNS integer
LANGUAGE plpgsql
SET lock_timeout = '200ms'
AS $$
DECLARE
    v_step interval;
    v_format text;
    v_start timestamptz;
    v_end timestamptz;
    v_table text;
    v_name text;
    v_column text;
    v_lo text;
    v_hi text;
    v_created integer := 0;
BEGIN
    CASE p_interval
        WHEN 'day' THEN v_step := interval '1 day'; v_format := 'YYYYMMDD';
        WHEN 'week' THEN v_step := interval '1 week'; v_format := 'IYYY"w"IW';
        WHEN 'month' THEN v_step := interval '1 month'; v_format := 'YYYYMM';
        ELSE RAISE EXCEPTION 'history interval must be day, week or month, not %', p_interval
                 USING ERRCODE = 'KS002';
    END CASE;
    IF p_ahead < 0 OR p_ahead > 366 THEN
        RAISE EXCEPTION 'partitions ahead must be 0-366, not %', p_ahead USING ERRCODE = 'KS002';
    END IF;
    v_start := date_trunc(p_interval, __schema__.kestrel_now() AT TIME ZONE 'UTC')
               AT TIME ZONE 'UTC';
    FOR i IN 0 .. p_ahead LOOP
        v_end := ((v_start AT TIME ZONE 'UTC') + v_step) AT TIME ZONE 'UTC';
        FOREACH v_table IN ARRAY ARRAY['workflow_history', 'signal_history', 'event_history',
                                       'operation_outputs'] LOOP
            CONTINUE WHEN i = 0 AND NOT p_include_current;
            v_column := CASE v_table WHEN 'workflow_history' THEN 'finished_at'
                                     WHEN 'operation_outputs' THEN 'execution_id'
                                     ELSE 'execution_finished_at' END;
            IF v_table = 'operation_outputs' THEN
                v_lo := __schema__.execution_id_at(v_start)::text;
                v_hi := __schema__.execution_id_at(v_end)::text;
            ELSE
                v_lo := v_start::text;
                v_hi := v_end::text;
            END IF;
            v_name := v_table || '_p' || to_char(v_start AT TIME ZONE 'UTC', v_format);
            CONTINUE WHEN to_regclass(format('%I.%I', '__schema_name__', v_name)) IS NOT NULL;
            -- Rows that landed in the DEFAULT partition for this range (before upkeep first
            -- ran) move into the new partition, which is attached afterwards. Writes to the
            -- table wait (for milliseconds) from before the move to the commit: a row routed
            -- to DEFAULT in between failed the attach with 23514 under traffic (FAULTS C6).
            -- The parent is what they wait on, before they are routed, so once this commits
            -- they go to the new partition (a lock on DEFAULT alone failed them instead).
            EXECUTE format('LOCK TABLE %I.%I IN SHARE ROW EXCLUSIVE MODE', '__schema_name__',
                           v_table);
            EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                           '__schema_name__', v_name, '__schema_name__', v_table);
            IF v_table <> 'operation_outputs' THEN
                -- No key to find a row by: the whole row is its identity, so that Citus's
                -- rebalancer can move it by logical replication (migration 0022).
                EXECUTE format('ALTER TABLE %I.%I REPLICA IDENTITY FULL', '__schema_name__',
                               v_name);
            END IF;
            EXECUTE format('WITH moved AS (DELETE FROM %I.%I WHERE %I >= %L AND %I < %L RETURNING *) '
                           'INSERT INTO %I.%I SELECT * FROM moved',
                           '__schema_name__', v_table || '_default', v_column, v_lo, v_column,
                           v_hi, '__schema_name__', v_name);
            BEGIN
                EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                               '__schema_name__', v_table, '__schema_name__', v_name, v_lo,
                               v_hi);
                v_created := v_created + 1;
            EXCEPTION WHEN invalid_object_definition THEN
                -- It overlaps partitions of an earlier interval setting: leave this period
                -- to those (or to DEFAULT) and create the new width once they are past.
                RAISE NOTICE 'history partition % overlaps an existing one; skipped', v_name;
                EXECUTE format('DROP TABLE %I.%I', '__schema_name__', v_name);
            END;
        END LOOP;
        v_start := v_end;
    END LOOP;
    RETURN v_created;
END
$$;

-- name: drop
CREATE OR REPLACE FUNCTION __schema__.kestrel_drop_history_partitions_v1(
    p_retention interval, p_detach_only boolean DEFAULT false
) RETURNS integer
LANGUAGE plpgsql
SET lock_timeout = '200ms'
AS $$
DECLARE
    v_part record;
    v_dropped integer := 0;
    v_history_dropped integer;
BEGIN
    IF p_retention <= interval '0' THEN
        RAISE EXCEPTION 'retention must be positive, not %', p_retention USING ERRCODE = 'KS002';
    END IF;
    FOR v_part IN
        SELECT parent.relname AS parent, child.relname AS child,
               substring(pg_get_expr(child.relpartbound, child.oid)
                         FROM $r$TO \('([^']+)'\)$r$)::timestamptz AS upper_bound
          FROM pg_inherits AS i
          JOIN pg_class AS child ON child.oid = i.inhrelid
          JOIN pg_class AS parent ON parent.oid = i.inhparent
          JOIN pg_namespace AS n ON n.oid = parent.relnamespace
         WHERE n.nspname = '__schema_name__'
           AND parent.relname IN ('workflow_history', 'signal_history', 'event_history')
           AND NOT child.relispartition IS DISTINCT FROM true
         ORDER BY 3
    LOOP
        CONTINUE WHEN v_part.upper_bound IS NULL;  -- the DEFAULT partition
        CONTINUE WHEN v_part.upper_bound > __schema__.kestrel_now() - p_retention;
        IF p_detach_only THEN
            EXECUTE format('ALTER TABLE %I.%I DETACH PARTITION %I.%I', '__schema_name__',
                           v_part.parent, '__schema_name__', v_part.child);
        ELSE
            EXECUTE format('DROP TABLE %I.%I', '__schema_name__', v_part.child);
        END IF;
        v_dropped := v_dropped + 1;
    END LOOP;
    v_history_dropped := v_dropped;
    -- Checkpoints: a period's partition goes when the period is past the retention and no
    -- execution created in it is live or in history (after the drops above). Locked first,
    -- so no checkpoint lands in it between the look and the drop.
    FOR v_part IN
        SELECT child.relname AS child,
               substring(pg_get_expr(child.relpartbound, child.oid)
                         FROM $r$FROM \('([^']+)'\)$r$)::uuid AS lo,
               substring(pg_get_expr(child.relpartbound, child.oid)
                         FROM $r$TO \('([^']+)'\)$r$)::uuid AS hi
          FROM pg_inherits AS i
          JOIN pg_class AS child ON child.oid = i.inhrelid
          JOIN pg_class AS parent ON parent.oid = i.inhparent
          JOIN pg_namespace AS n ON n.oid = parent.relnamespace
         WHERE n.nspname = '__schema_name__'
           AND parent.relname = 'operation_outputs'
         ORDER BY 3
    LOOP
        CONTINUE WHEN v_part.hi IS NULL;  -- the DEFAULT partition
        CONTINUE WHEN v_part.hi > __schema__.execution_id_at(__schema__.kestrel_now()
                                                              - p_retention);
        EXECUTE format('LOCK TABLE %I.%I IN ACCESS EXCLUSIVE MODE', '__schema_name__',
                       v_part.child);
        CONTINUE WHEN EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                               WHERE e.id >= v_part.lo AND e.id < v_part.hi)
                   OR EXISTS (SELECT 1 FROM __schema__.workflow_history AS h
                               WHERE h.id >= v_part.lo AND h.id < v_part.hi);
        IF p_detach_only THEN
            EXECUTE format('ALTER TABLE %I.operation_outputs DETACH PARTITION %I.%I',
                           '__schema_name__', '__schema_name__', v_part.child);
        ELSE
            EXECUTE format('DROP TABLE %I.%I', '__schema_name__', v_part.child);
        END IF;
        v_dropped := v_dropped + 1;
    END LOOP;
    -- DEFAULT: the checkpoints of executions neither live nor in history. Only in a round
    -- that dropped history (what makes them so), not every round: the look reads all of
    -- DEFAULT, which after an upgrade holds the retention's worth of older checkpoints.
    -- The idempotency keys of those executions go in the same round and transaction: kept,
    -- a key sent again would return an id nothing answers for (ExecutionNotFound); gone, it
    -- makes a new execution (FAULTS C6). A key younger than the retention cannot name an
    -- execution that left history, so only older ones are looked at.
    IF v_history_dropped > 0 THEN
        DELETE FROM __schema__.operation_outputs_default AS d
         WHERE NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                            WHERE e.id = d.execution_id)
           AND NOT EXISTS (SELECT 1 FROM __schema__.workflow_history AS h
                            WHERE h.id = d.execution_id);
        -- A debounce key's row older than the retention whose execution is not live any
        -- more names nothing pending (migration 0024); the key's next submit makes a new one.
        DELETE FROM __schema__.debounces AS d
         WHERE d.first_at < __schema__.kestrel_now() - p_retention
           AND NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                            WHERE e.id = d.execution_id);
        DELETE FROM __schema__.idempotency_keys AS k
         WHERE k.created_at < __schema__.kestrel_now() - p_retention
           AND NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                            WHERE e.id = k.execution_id)
           AND NOT EXISTS (SELECT 1 FROM __schema__.workflow_history AS h
                            WHERE h.id = k.execution_id);
    END IF;
    RETURN v_dropped;
END
$$;
