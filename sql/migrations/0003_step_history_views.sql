-- HISTORICAL FUNCTION BODIES: the functions this migration creates were replaced since;
-- sql/functions/functions.sql holds every function as it is now and is applied on every
-- migrate, and sql/schema.sql holds the tables, indexes and views as they are now.
-- 0003: step checkpoints follow their execution into history; observability views.
--
-- A finished execution's checkpoints leave operation_outputs in the same statement that
-- moves the execution to workflow_history, so the hot tables hold live work only and every
-- row is in exactly one place at every moment. step_history is partitioned by the
-- execution's finish time with the same bounds as workflow_history, so retention drops the
-- partitions of both together.

CREATE TABLE __schema__.step_history (
    execution_id          uuid NOT NULL,
    step_id               integer NOT NULL,
    step_name             text NOT NULL,
    output                jsonb,
    error                 jsonb,
    attempt               integer NOT NULL,
    lease_epoch           integer NOT NULL,
    started_at            timestamptz NOT NULL,
    finished_at           timestamptz NOT NULL,
    execution_finished_at timestamptz NOT NULL
) PARTITION BY RANGE (execution_finished_at);
CREATE TABLE __schema__.step_history_default
    PARTITION OF __schema__.step_history DEFAULT;
CREATE INDEX step_history_execution_idx ON __schema__.step_history (execution_id, step_id);
-- "Which steps failed": only failed steps are indexed.
CREATE INDEX step_history_errors_idx ON __schema__.step_history (execution_finished_at)
    WHERE error IS NOT NULL;

CREATE INDEX workflow_history_workflow_idx
    ON __schema__.workflow_history (workflow, finished_at);

-- Everything finished executions had, moved by complete/cancel/quarantine/deadline.
CREATE FUNCTION __schema__.archive_steps(p_ids uuid[]) RETURNS bigint
LANGUAGE sql AS $$
    WITH moved AS (
        DELETE FROM __schema__.operation_outputs AS o
         WHERE o.execution_id = ANY(p_ids)
     RETURNING o.*
    ), archived AS (
        INSERT INTO __schema__.step_history
               (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                started_at, finished_at, execution_finished_at)
        SELECT execution_id, step_id, step_name, output, error, attempt, lease_epoch,
               started_at, finished_at, __schema__.kestrel_now()
          FROM moved
        RETURNING 1
    )
    SELECT count(*) FROM archived
$$;

-- Every execution, live or finished, one row each.
CREATE VIEW __schema__.executions AS
SELECT id, workflow, queue, priority, status, args, NULL::jsonb AS result, NULL::jsonb AS error,
       attempts, lease_epoch, parent_id, created_at, started_at, NULL::timestamptz AS finished_at,
       __schema__.kestrel_now() - created_at AS age, NULL::interval AS duration
  FROM __schema__.workflow_executions
UNION ALL
SELECT id, workflow, queue, priority, status, args, result, error,
       attempts, lease_epoch, parent_id, created_at, started_at, finished_at,
       finished_at - created_at AS age, finished_at - started_at AS duration
  FROM __schema__.workflow_history;

-- Every recorded step with its execution, live or finished: "which workflows failed last
-- month, and at which step" is one SELECT on this view.
CREATE VIEW __schema__.workflow_steps AS
SELECT o.execution_id, e.workflow, e.queue, e.status AS execution_status, o.step_id,
       o.step_name, o.attempt, o.output, o.error, o.started_at, o.finished_at,
       o.finished_at - o.started_at AS duration, NULL::timestamptz AS execution_finished_at
  FROM __schema__.operation_outputs AS o
  JOIN __schema__.workflow_executions AS e ON e.id = o.execution_id
UNION ALL
SELECT s.execution_id, h.workflow, h.queue, h.status, s.step_id,
       s.step_name, s.attempt, s.output, s.error, s.started_at, s.finished_at,
       s.finished_at - s.started_at, s.execution_finished_at
  FROM __schema__.step_history AS s
  JOIN __schema__.workflow_history AS h
    ON h.id = s.execution_id AND h.finished_at = s.execution_finished_at;

-- retry() now brings the execution's good checkpoints back from history with it.
CREATE OR REPLACE FUNCTION __schema__.retry(p_execution uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
BEGIN
    WITH removed AS (
        DELETE FROM __schema__.workflow_history AS h
         WHERE h.id = p_execution AND h.status IN ('failed', 'cancelled', 'quarantined')
     RETURNING h.*
    )
    INSERT INTO __schema__.workflow_executions
           (id, workflow, queue, priority, args, idempotency_key, lease_epoch, created_at,
            started_at, parent_id)
    SELECT id, workflow, queue, priority, args, idempotency_key, lease_epoch, created_at,
           started_at, parent_id
      FROM removed;
    IF FOUND THEN
        WITH back AS (
            DELETE FROM __schema__.step_history AS s
             WHERE s.execution_id = p_execution
         RETURNING s.*
        )
        INSERT INTO __schema__.operation_outputs
               (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                started_at, finished_at)
        SELECT execution_id, step_id, step_name, output, error, attempt, lease_epoch,
               started_at, finished_at
          FROM back
         WHERE error IS NULL;
        PERFORM pg_notify('kestrel.__schema_name__', 'retry');
        RETURN;
    END IF;
    SELECT status INTO v_status FROM __schema__.workflow_executions WHERE id = p_execution;
    IF NOT FOUND THEN
        SELECT status INTO v_status FROM __schema__.workflow_history WHERE id = p_execution;
    END IF;
    IF v_status IS NULL THEN
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    RAISE EXCEPTION 'execution % is %; only failed, cancelled or quarantined executions can be retried',
        p_execution, v_status USING ERRCODE = 'KS005';
END
$$;

-- fork() copies checkpoints from wherever the original's are.
CREATE OR REPLACE FUNCTION __schema__.fork(p_execution uuid, p_from_step integer) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_new uuid := gen_random_uuid();
    v_src __schema__.executions%ROWTYPE;
BEGIN
    SELECT * INTO v_src FROM __schema__.executions WHERE id = p_execution;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    IF p_from_step < 0 THEN
        RAISE EXCEPTION 'from_step must not be negative' USING ERRCODE = 'KS002';
    END IF;
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
            finished_at)
    SELECT v_new, step_id, step_name, output, error, attempt, 0, started_at, finished_at
      FROM __schema__.workflow_steps
     WHERE execution_id = p_execution AND step_id < p_from_step AND error IS NULL;
    INSERT INTO __schema__.workflow_executions (id, workflow, queue, priority, args)
    VALUES (v_new, v_src.workflow, v_src.queue, v_src.priority, v_src.args);
    PERFORM pg_notify('kestrel.__schema_name__', v_src.queue);
    RETURN v_new;
END
$$;

-- cancel() archives the checkpoints of what it moves to history.
CREATE OR REPLACE FUNCTION __schema__.cancel(p_execution uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_moved uuid[];
BEGIN
    WITH RECURSIVE tree AS (
        SELECT id FROM __schema__.workflow_executions WHERE id = p_execution
        UNION
        SELECT e.id FROM __schema__.workflow_executions AS e JOIN tree ON e.parent_id = tree.id
    ), locked AS (
        SELECT e.id, e.status FROM __schema__.workflow_executions AS e
          JOIN tree USING (id)
         ORDER BY e.id
           FOR UPDATE OF e
    ), flagged AS (
        UPDATE __schema__.workflow_executions AS e
           SET cancel_requested = true
          FROM locked
         WHERE e.id = locked.id AND locked.status = 'running'
    ), removed AS (
        DELETE FROM __schema__.workflow_executions AS e
         USING locked
         WHERE e.id = locked.id AND locked.status IN ('queued', 'waiting')
     RETURNING e.*
    ), moved AS (
        INSERT INTO __schema__.workflow_history
               (id, workflow, queue, priority, status, args, result, error, idempotency_key,
                lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline)
        SELECT id, workflow, queue, priority, 'cancelled', args, NULL,
               jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'),
               idempotency_key, lease_epoch, attempts, created_at, started_at,
               __schema__.kestrel_now(), parent_id, deadline
          FROM removed
        RETURNING id, parent_id
    ), told AS (
        SELECT __schema__.child_finished(m.parent_id, m.id, 'cancelled', NULL,
                   jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'))
          FROM moved AS m WHERE m.parent_id IS NOT NULL
    )
    SELECT array_agg(id) INTO v_moved FROM moved WHERE (SELECT count(*) FROM told) >= 0;
    IF v_moved IS NOT NULL THEN
        PERFORM __schema__.archive_steps(v_moved);
    END IF;
    SELECT status INTO v_status FROM __schema__.workflow_executions WHERE id = p_execution;
    IF FOUND THEN
        RETURN 'cancelling';
    END IF;
    SELECT status INTO v_status FROM __schema__.workflow_history WHERE id = p_execution;
    IF FOUND THEN
        RETURN v_status;
    END IF;
    RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
END
$$;
