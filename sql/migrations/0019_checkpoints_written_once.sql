-- 0019: a checkpoint is written once, into storage it never leaves (issue 23, item 2).
--
-- Until now a checkpoint was inserted into operation_outputs, copied to step_history when its
-- execution finished (partitioned by the finish time, for retention) and deleted: three
-- writes and two index entries for one row, about 900 of the ~3,000 bytes of WAL a 3-step
-- workflow cost (BENCHMARKS.md). Now operation_outputs is the one home of every checkpoint,
-- live or finished, range-partitioned by execution_id: execution ids are UUIDv7 from now on
-- (new_execution_id(), kestrel.ids), whose first 48 bits are the creation time in
-- milliseconds, so each partition holds the executions created in one period (the history
-- interval: a day by default), a lookup by execution id prunes to one partition, and
-- retention drops a period's partition once none of its executions is live or in history
-- (kestrel_drop_history_partitions_v1). Ids that are no UUIDv7 of a covered period (ids
-- from before this migration, ids a caller chose) land in the DEFAULT partition, which
-- retention trims by DELETE. The primary key (execution_id, step_id) is unchanged: it holds
-- the partition key, and a statement of a worker one version older writes the same rows.
--
-- step_history becomes a view: the checkpoints of finished executions, with the finish time
-- their history row has (what the table stored per row).
--
-- The new table is made under a name of its own, filled, and takes the old one's name once
-- that is dropped, with its constraints added then: Citus renames no constraint of a
-- distributed table (issue 24).
CREATE TABLE __schema__.operation_outputs_0019 (
    execution_id uuid NOT NULL,
    step_id integer NOT NULL,
    step_name text NOT NULL,
    output jsonb,
    error jsonb,
    attempt integer NOT NULL,
    lease_epoch integer NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT __schema__.kestrel_now()
) PARTITION BY RANGE (execution_id);
CREATE TABLE __schema__.operation_outputs_default
    PARTITION OF __schema__.operation_outputs_0019 DEFAULT;

-- A partition for every period workflow_history has one for (the same suffix), bounded by
-- the UUIDv7 ids of the period's first millisecond and the next period's.
DO $$
DECLARE
    v_part record;
BEGIN
    FOR v_part IN
        SELECT substr(child.relname, length('workflow_history') + 1) AS suffix,
               substring(pg_get_expr(child.relpartbound, child.oid)
                         FROM $r$FROM \('([^']+)'\)$r$)::timestamptz AS lo,
               substring(pg_get_expr(child.relpartbound, child.oid)
                         FROM $r$TO \('([^']+)'\)$r$)::timestamptz AS hi
          FROM pg_inherits AS i
          JOIN pg_class AS child ON child.oid = i.inhrelid
         WHERE i.inhparent = '__schema__.workflow_history'::regclass
           AND pg_get_expr(child.relpartbound, child.oid) <> 'DEFAULT'
    LOOP
        CONTINUE WHEN v_part.lo IS NULL OR v_part.hi IS NULL;
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.operation_outputs_0019 '
                       'FOR VALUES FROM (%L) TO (%L)', '__schema_name__',
                       'operation_outputs' || v_part.suffix, '__schema_name__',
                       lpad(to_hex((extract(epoch FROM v_part.lo) * 1000)::bigint), 12, '0')
                       || repeat('0', 20),
                       lpad(to_hex((extract(epoch FROM v_part.hi) * 1000)::bigint), 12, '0')
                       || repeat('0', 20));
    END LOOP;
END
$$;

INSERT INTO __schema__.operation_outputs_0019
       (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
        finished_at)
SELECT execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
       finished_at
  FROM __schema__.operation_outputs;
INSERT INTO __schema__.operation_outputs_0019
       (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
        finished_at)
SELECT execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
       finished_at
  FROM __schema__.step_history;

DROP VIEW __schema__.patch_markers;
DROP VIEW __schema__.workflow_steps;
DROP TABLE __schema__.operation_outputs;
DROP TABLE __schema__.step_history;
ALTER TABLE __schema__.operation_outputs_0019 RENAME TO operation_outputs;
ALTER TABLE __schema__.operation_outputs
    ADD CONSTRAINT operation_outputs_pkey PRIMARY KEY (execution_id, step_id);
ALTER TABLE __schema__.operation_outputs
    ADD CONSTRAINT operation_outputs_check CHECK (output IS NULL OR error IS NULL);

-- The checkpoints of finished executions, under their execution's finish time.
CREATE VIEW __schema__.step_history AS
SELECT o.execution_id, o.step_id, o.step_name, o.output, o.error, o.attempt, o.lease_epoch,
       o.started_at, o.finished_at, h.finished_at AS execution_finished_at
  FROM __schema__.operation_outputs AS o
  JOIN __schema__.workflow_history AS h ON h.id = o.execution_id;

CREATE VIEW __schema__.workflow_steps AS
SELECT o.execution_id, e.workflow, e.queue, e.status AS execution_status, o.step_id,
       o.step_name, o.attempt, o.output, o.error, o.started_at, o.finished_at,
       o.finished_at - o.started_at AS duration, NULL::timestamptz AS execution_finished_at
  FROM __schema__.operation_outputs AS o
  JOIN __schema__.workflow_executions AS e ON e.id = o.execution_id
UNION ALL
SELECT o.execution_id, h.workflow, h.queue, h.status, o.step_id,
       o.step_name, o.attempt, o.output, o.error, o.started_at, o.finished_at,
       o.finished_at - o.started_at, h.finished_at
  FROM __schema__.operation_outputs AS o
  JOIN __schema__.workflow_history AS h ON h.id = o.execution_id;

CREATE VIEW __schema__.patch_markers AS
SELECT execution_id, workflow, execution_status, substr(step_name, 15) AS patch,
       (output ->> 'at')::integer AS at_step, started_at AS recorded_at
  FROM __schema__.workflow_steps
 WHERE step_id < 0 AND step_name LIKE 'kestrel.patch:%';
