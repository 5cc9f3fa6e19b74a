-- HISTORICAL FUNCTION BODIES: the functions this migration creates were replaced since;
-- sql/functions/functions.sql holds every function as it is now and is applied on every
-- migrate, and sql/schema.sql holds the tables, indexes and views as they are now.
-- 0002: durable waits, signals, events, cancellation, retry, fork, child workflows, deadlines.
--
-- A waiting execution is one row with status 'waiting': no lease, no worker slot, no
-- coroutine. It is claimed again when wake_at passes (a sleep ends, a signal wait times out)
-- or when a signal for it arrives (signal() sets wake_at to now).

-- Three statements where there was one ALTER TABLE (the same schema): Citus runs an ADD
-- CONSTRAINT only as an ALTER TABLE of its own (issue 24).
ALTER TABLE __schema__.workflow_executions
    DROP CONSTRAINT workflow_executions_status_check;
ALTER TABLE __schema__.workflow_executions
    ADD CONSTRAINT workflow_executions_status_check
        CHECK (status IN ('queued', 'running', 'waiting'));
ALTER TABLE __schema__.workflow_executions
    -- The step position the execution is parked at, what it waits for, and the wait's own
    -- deadline (kept across spurious wake-ups; wake_at is when to claim it next).
    ADD COLUMN wait_step integer,
    ADD COLUMN waiting_for text,
    ADD COLUMN wait_deadline timestamptz,
    -- Bumped by every signal, under the row lock. park() only parks if it is unchanged since
    -- the worker looked for a signal, so a signal can never slip in between look and park.
    ADD COLUMN signal_seq bigint NOT NULL DEFAULT 0,
    ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false,
    ADD COLUMN parent_id uuid,
    ADD COLUMN deadline timestamptz;

CREATE INDEX workflow_executions_wake_idx
    ON __schema__.workflow_executions (wake_at)
    WHERE status = 'waiting';
CREATE INDEX workflow_executions_parent_idx
    ON __schema__.workflow_executions (parent_id)
    WHERE parent_id IS NOT NULL;
CREATE INDEX workflow_executions_deadline_idx
    ON __schema__.workflow_executions (deadline)
    WHERE deadline IS NOT NULL;

ALTER TABLE __schema__.workflow_history
    ADD COLUMN parent_id uuid,
    ADD COLUMN deadline timestamptz;

-- Signals: delivered to an execution by name, consumed exactly once by the wait at
-- consumed_step. One sent before the wait is kept until a wait consumes it.
CREATE TABLE __schema__.signals (
    id              bigserial PRIMARY KEY,
    execution_id    uuid NOT NULL,
    name            text NOT NULL,
    payload         jsonb,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    consumed_step   integer,
    consumed_at     timestamptz,
    UNIQUE (execution_id, idempotency_key)
);
CREATE INDEX signals_pending_idx ON __schema__.signals (execution_id, name, id)
    WHERE consumed_step IS NULL;

-- Events: the latest value per (execution, key), for callers following progress.
CREATE TABLE __schema__.events (
    execution_id uuid NOT NULL,
    key          text NOT NULL,
    value        jsonb,
    updated_at   timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    PRIMARY KEY (execution_id, key)
);

-- A finished child tells its parent: a signal named 'kestrel.child:<id>' whose payload is
-- the child's outcome, which wakes the parent if it waits for it.
CREATE FUNCTION __schema__.child_finished(
    p_parent uuid, p_child uuid, p_status text, p_result jsonb, p_error jsonb
) RETURNS void
LANGUAGE sql AS $$
    WITH bumped AS (
        UPDATE __schema__.workflow_executions AS p
           SET signal_seq = p.signal_seq + 1,
               wake_at = CASE WHEN p.status = 'waiting'
                                   AND p.waiting_for = 'kestrel.child:' || p_child
                              THEN __schema__.kestrel_now() ELSE p.wake_at END
         WHERE p.id = p_parent
     RETURNING p.id
    )
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT p_parent, 'kestrel.child:' || p_child,
           jsonb_build_object('status', p_status, 'result', p_result, 'error', p_error),
           'kestrel.child:' || p_child
      FROM bumped
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING
$$;

-- signal(): deliver a named signal. Returns true when stored, false when its idempotency key
-- was already used (the signal counts once). Errors: KS003 no such execution, KS004 it has
-- already finished.
CREATE FUNCTION __schema__.signal(
    p_execution uuid, p_name text, p_payload jsonb DEFAULT NULL,
    p_idempotency_key text DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
BEGIN
    -- Lock the execution row first (the same order as park), then store the signal.
    UPDATE __schema__.workflow_executions AS e
       SET signal_seq = e.signal_seq + 1,
           wake_at = CASE WHEN e.status = 'waiting' AND e.waiting_for = p_name
                          THEN __schema__.kestrel_now() ELSE e.wake_at END
     WHERE e.id = p_execution
    RETURNING e.status INTO v_status;
    IF NOT FOUND THEN
        SELECT h.status INTO v_status FROM __schema__.workflow_history AS h
         WHERE h.id = p_execution;
        IF FOUND THEN
            RAISE EXCEPTION 'execution % has already finished (%)', p_execution, v_status
                USING ERRCODE = 'KS004';
        END IF;
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    VALUES (p_execution, p_name, p_payload, p_idempotency_key)
    ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('kestrel.__schema_name__', 'signal');
    RETURN true;
END
$$;

-- cancel(): cancel an execution and its live descendants. Queued and waiting ones move to
-- history as 'cancelled' at once; running ones are flagged and stop at their next step
-- boundary (their later checkpoints are rejected). Returns the execution's status after the
-- call: 'cancelled', 'cancelling', or the terminal status it already had. KS003: no such id.
CREATE FUNCTION __schema__.cancel(p_execution uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
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
    )
    SELECT count(*) INTO v_status FROM (
        SELECT __schema__.child_finished(m.parent_id, m.id, 'cancelled', NULL,
                   jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'))
          FROM moved AS m WHERE m.parent_id IS NOT NULL
    ) AS notified;
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

-- retry(): put a failed, cancelled or quarantined execution back in the queue. Its recorded
-- steps stay, except the failed ones, so it replays up to its last good checkpoint and runs
-- from there. KS003: no such id; KS005: it is live or completed.
CREATE FUNCTION __schema__.retry(p_execution uuid) RETURNS void
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
        DELETE FROM __schema__.operation_outputs
         WHERE execution_id = p_execution AND error IS NOT NULL;
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

-- fork(): a new execution of the same workflow and arguments that starts with the first
-- p_from_step checkpoints of the original (steps 0 .. p_from_step - 1) and runs the rest.
CREATE FUNCTION __schema__.fork(p_execution uuid, p_from_step integer) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_new uuid := gen_random_uuid();
    v_workflow text;
    v_queue text;
    v_priority integer;
    v_args jsonb;
BEGIN
    SELECT workflow, queue, priority, args INTO v_workflow, v_queue, v_priority, v_args
      FROM (SELECT workflow, queue, priority, args FROM __schema__.workflow_executions
             WHERE id = p_execution
            UNION ALL
            SELECT workflow, queue, priority, args FROM __schema__.workflow_history
             WHERE id = p_execution) AS src
     LIMIT 1;
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
      FROM __schema__.operation_outputs
     WHERE execution_id = p_execution AND step_id < p_from_step AND error IS NULL;
    INSERT INTO __schema__.workflow_executions (id, workflow, queue, priority, args)
    VALUES (v_new, v_workflow, v_queue, v_priority, v_args);
    PERFORM pg_notify('kestrel.__schema_name__', v_queue);
    RETURN v_new;
END
$$;

-- submit() gains a parent and a deadline.
DROP FUNCTION __schema__.submit(text, jsonb, text, integer, text, uuid);
CREATE FUNCTION __schema__.submit(
    p_workflow text,
    p_args jsonb DEFAULT '[]',
    p_queue text DEFAULT 'default',
    p_priority integer DEFAULT 0,
    p_idempotency_key text DEFAULT NULL,
    p_id uuid DEFAULT NULL,
    p_parent uuid DEFAULT NULL,
    p_timeout_s double precision DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := coalesce(p_id, gen_random_uuid());
    v_existing __schema__.idempotency_keys%ROWTYPE;
BEGIN
    IF p_workflow IS NULL OR p_workflow = '' THEN
        RAISE EXCEPTION 'workflow name must not be empty' USING ERRCODE = 'KS002';
    END IF;
    IF p_args IS NULL OR jsonb_typeof(p_args) <> 'array' THEN
        RAISE EXCEPTION 'args must be a JSON array, got %', coalesce(jsonb_typeof(p_args), 'NULL')
            USING ERRCODE = 'KS002';
    END IF;
    IF p_timeout_s IS NOT NULL AND NOT p_timeout_s > 0 THEN
        RAISE EXCEPTION 'timeout must be positive, got %', p_timeout_s USING ERRCODE = 'KS002';
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        INSERT INTO __schema__.idempotency_keys (idempotency_key, execution_id, workflow, args_digest)
        VALUES (p_idempotency_key, v_id, p_workflow, md5(p_args::text))
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF NOT FOUND THEN
            -- ON CONFLICT waited for the other inserter to commit, so this read sees its row.
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF v_existing.workflow <> p_workflow OR v_existing.args_digest <> md5(p_args::text) THEN
                RAISE EXCEPTION 'idempotency key % is already used by execution % with other arguments',
                    p_idempotency_key, v_existing.execution_id
                    USING ERRCODE = 'KS001';
            END IF;
            RETURN v_existing.execution_id;
        END IF;
    END IF;
    INSERT INTO __schema__.workflow_executions
           (id, workflow, queue, priority, args, idempotency_key, parent_id, deadline)
    VALUES (v_id, p_workflow, p_queue, p_priority, p_args, p_idempotency_key, p_parent,
            __schema__.kestrel_now() + make_interval(secs => p_timeout_s));
    -- Delivered at commit only; workers also poll, so a lost notification costs latency only.
    PERFORM pg_notify('kestrel.__schema_name__', p_queue);
    RETURN v_id;
END
$$;
