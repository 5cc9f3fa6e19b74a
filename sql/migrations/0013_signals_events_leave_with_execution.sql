-- 0013: signals and events leave the hot tables with their execution; fork records its
-- source.
--
-- A finished execution's signals and events stayed in the hot, unpartitioned tables for
-- ever, outside retention (issue 22, row 12). archive_steps now moves them in the statement
-- that moves the execution to history (complete, cancel, quarantine, deadline expiry) into
-- signal_history and event_history, partitioned by the execution's finish time with the same
-- bounds as workflow_history and step_history, so retention drops all four together. retry()
-- brings them back with the execution.

CREATE TABLE __schema__.signal_history (
    id                    bigint NOT NULL,   -- its id in signals, kept for the order
    execution_id          uuid NOT NULL,
    name                  text NOT NULL,
    payload               jsonb,
    idempotency_key       text,
    created_at            timestamptz NOT NULL,
    consumed_step         integer,
    consumed_at           timestamptz,
    execution_finished_at timestamptz NOT NULL
) PARTITION BY RANGE (execution_finished_at);
CREATE TABLE __schema__.signal_history_default
    PARTITION OF __schema__.signal_history DEFAULT;
CREATE INDEX signal_history_execution_idx ON __schema__.signal_history (execution_id, id);

CREATE TABLE __schema__.event_history (
    execution_id          uuid NOT NULL,
    key                   text NOT NULL,
    value                 jsonb,
    updated_at            timestamptz NOT NULL,
    execution_finished_at timestamptz NOT NULL
) PARTITION BY RANGE (execution_finished_at);
CREATE TABLE __schema__.event_history_default
    PARTITION OF __schema__.event_history DEFAULT;
CREATE INDEX event_history_execution_idx ON __schema__.event_history (execution_id, key);

-- The new tables get a partition for every period workflow_history has one for (the same
-- name after the table's, the same bounds), so what is moved below lands in the partition
-- retention drops with its execution's.
DO $$
DECLARE
    v_part record;
    v_table text;
BEGIN
    FOR v_part IN
        SELECT substr(child.relname, length('workflow_history') + 1) AS suffix,
               pg_get_expr(child.relpartbound, child.oid) AS bound
          FROM pg_inherits AS i
          JOIN pg_class AS child ON child.oid = i.inhrelid
         WHERE i.inhparent = '__schema__.workflow_history'::regclass
           AND pg_get_expr(child.relpartbound, child.oid) <> 'DEFAULT'
    LOOP
        FOREACH v_table IN ARRAY ARRAY['signal_history', 'event_history'] LOOP
            EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.%I %s', '__schema_name__',
                           v_table || v_part.suffix, '__schema_name__', v_table, v_part.bound);
        END LOOP;
    END LOOP;
END
$$;

-- What finished executions left behind moves to history now; what belongs to no execution
-- any more (its history was dropped by retention) goes.
WITH moved AS (
    DELETE FROM __schema__.signals AS s
     USING __schema__.workflow_history AS h
     WHERE h.id = s.execution_id
 RETURNING s.*, h.finished_at
)
INSERT INTO __schema__.signal_history
       (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
        consumed_at, execution_finished_at)
SELECT id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
       consumed_at, finished_at
  FROM moved;
WITH moved AS (
    DELETE FROM __schema__.events AS v
     USING __schema__.workflow_history AS h
     WHERE h.id = v.execution_id
 RETURNING v.*, h.finished_at
)
INSERT INTO __schema__.event_history (execution_id, key, value, updated_at,
                                      execution_finished_at)
SELECT execution_id, key, value, updated_at, finished_at FROM moved;
DELETE FROM __schema__.signals AS s
 WHERE NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                    WHERE e.id = s.execution_id);
DELETE FROM __schema__.events AS v
 WHERE NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                    WHERE e.id = v.execution_id);

-- Which execution a fork copied, and from which step (written by fork(); never moved).
CREATE TABLE __schema__.forks (
    id          uuid PRIMARY KEY,
    forked_from uuid NOT NULL,
    from_step   integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT __schema__.kestrel_now()
);
CREATE INDEX forks_forked_from_idx ON __schema__.forks (forked_from);

-- fork() takes the fork's id from its caller (a retry after a lost reply returns the fork
-- already made): a new signature, defined in sql/functions.
DROP FUNCTION __schema__.fork(uuid, integer);
