-- Kestrel SQL functions, applied by every migrate after the migrations (00_rules.sql says
-- how). This file: Waits: consuming a signal, parking an execution, its checkpoints as the
-- claim reads them, and where a schema lives on Citus.

-- name: distributed_schema
-- distributed_schema(): whether this schema is a Citus distributed schema (schema-based
-- sharding), where the worker sends the Citus forms of its statements (save_steps()). False
-- anywhere else: plain PostgreSQL, a Citus schema that is not distributed. The catalog is
-- read through EXECUTE: it does not exist without Citus.
CREATE OR REPLACE FUNCTION __schema__.distributed_schema() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_distributed boolean := false;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_schema') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_schema '
                'WHERE schemaid = $1::regnamespace)'
           INTO v_distributed USING '__schema__';
    END IF;
    RETURN v_distributed;
END;
$$;

-- name: consume_signal
-- consume_signal(): take the oldest pending signal p_name for an execution this worker owns
-- under p_epoch and record it as the checkpoint of the wait at p_step_id, so the signal is
-- consumed exactly when the checkpoint is written. Returns ownership, the cancel flag, the
-- recorded output (NULL when no signal is pending) and signal_seq for a following park: any
-- signal() that bumped signal_seq before the lock was granted is visible to the scan.
--
-- Idempotent per position (FAULTS R2): when the wait's position already has a checkpoint (an
-- earlier call committed and its reply was lost), that recorded output is returned and no
-- other signal is taken. Under the epoch's row lock only this attempt writes checkpoints of
-- this execution, and nothing but this wait records at its position, so what is there is
-- this wait's: the signal it consumed, or its timeout. The row lock is exclusive (NO KEY
-- UPDATE, which heartbeats and signal() conflict with anyway), so a retry that reaches the
-- server while the lost call still runs there waits for it and then finds its checkpoint;
-- the INSERT has no ON CONFLICT: a conflict would undo the signal's consumption with it.
CREATE OR REPLACE FUNCTION __schema__.consume_signal(
    p_id uuid, p_epoch integer, p_step_id integer, p_name text, p_step_name text,
    OUT owned boolean, OUT cancelled boolean, OUT output jsonb, OUT signal_seq bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_payload jsonb;
BEGIN
    SELECT e.signal_seq, e.cancel_requested INTO signal_seq, cancelled
      FROM __schema__.workflow_executions AS e
     WHERE e.id = p_id AND e.lease_epoch = p_epoch AND e.status = 'running'
       FOR NO KEY UPDATE;
    owned := FOUND;
    cancelled := coalesce(cancelled, false);
    IF NOT owned OR cancelled THEN
        RETURN;
    END IF;
    SELECT o.output INTO output
      FROM __schema__.operation_outputs AS o
     WHERE o.execution_id = p_id AND o.step_id = p_step_id;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A new statement, a new snapshot: it sees every signal committed before the lock.
    UPDATE __schema__.signals AS s
       SET consumed_step = p_step_id, consumed_at = __schema__.kestrel_now()
     WHERE s.id = (SELECT p.id FROM __schema__.signals AS p
                    WHERE p.execution_id = p_id AND p.name = p_name
                      AND p.consumed_step IS NULL
                    ORDER BY p.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED)
    RETURNING s.payload INTO v_payload;
    IF FOUND THEN
        INSERT INTO __schema__.operation_outputs
               (execution_id, step_id, step_name, output, attempt, lease_epoch, started_at)
        VALUES (p_id, p_step_id, p_step_name,
                jsonb_build_object('received', true, 'payload', v_payload), 1, p_epoch,
                __schema__.kestrel_now())
        RETURNING operation_outputs.output INTO output;
    END IF;
END
$$;

-- name: park_execution
-- park_execution(): park a running execution at a wait (no lease, no slot, one row) and say
-- what happened, so the worker never mistakes a decision for a lost lease (FAULTS X2, X4):
--   parked     parked now, or by an earlier call whose reply was lost (same epoch, same wait)
--   cancelled  a cancel was requested: the worker finishes the execution as cancelled
--   signalled  a signal arrived since p_seen_seq was read: look for it again
--   lost       a newer claim owns it, or it has left the hot table
--   recorded   the wait's position already has a checkpoint (FAULTS R2): nothing is parked;
--              the worker replays that checkpoint (a parked position must have none, or the
--              wake-up would replay it and the wait would never be looked at again)
-- A re-park of the same wait keeps the original deadline; attempts restart at 0 (a clean
-- park is progress, not a lost worker).
CREATE OR REPLACE FUNCTION __schema__.park_execution(
    p_id uuid, p_epoch integer, p_step_id integer, p_waiting_for text,
    p_seconds double precision, p_seen_seq bigint
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v record;
    -- Read once, used inside CASE as a parameter (Citus refuses the call there: issue 24),
    -- and so is the wait's end: timestamptz + interval is STABLE too, and inside a CASE it
    -- failed every timed wait on Citus (issue 44).
    v_now timestamptz := __schema__.kestrel_now();
    v_until timestamptz := v_now + make_interval(secs => p_seconds);
BEGIN
    UPDATE __schema__.workflow_executions AS e
       SET status = 'waiting',
           lease_owner = NULL,
           lease_expires_at = NULL,
           attempts = 0,
           waiting_for = p_waiting_for,
           wait_deadline = CASE
               WHEN e.wait_step IS NOT DISTINCT FROM p_step_id AND e.wait_deadline IS NOT NULL
               THEN e.wait_deadline
               ELSE v_until END,
           wake_at = CASE
               WHEN e.wait_step IS NOT DISTINCT FROM p_step_id AND e.wait_deadline IS NOT NULL
               THEN e.wait_deadline
               ELSE v_until END,
           wait_step = p_step_id,
           updated_at = v_now
     WHERE e.id = p_id
       AND e.lease_epoch = p_epoch
       AND e.status = 'running'
       AND NOT e.cancel_requested
       AND (p_seen_seq IS NULL OR e.signal_seq = p_seen_seq)
       AND NOT EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                        WHERE o.execution_id = p_id AND o.step_id = p_step_id);
    IF FOUND THEN
        RETURN 'parked';
    END IF;
    SELECT e.status, e.lease_epoch, e.wait_step, e.cancel_requested INTO v
      FROM __schema__.workflow_executions AS e
     WHERE e.id = p_id
       FOR SHARE;
    IF NOT FOUND OR v.lease_epoch <> p_epoch THEN
        RETURN 'lost';
    END IF;
    IF v.status = 'waiting' AND v.wait_step = p_step_id THEN
        RETURN 'parked';
    END IF;
    IF v.status <> 'running' THEN
        RETURN 'lost';
    END IF;
    IF v.cancel_requested THEN
        RETURN 'cancelled';
    END IF;
    IF EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                WHERE o.execution_id = p_id AND o.step_id = p_step_id) THEN
        RETURN 'recorded';
    END IF;
    RETURN 'signalled';
END
$$;

-- name: history_of
-- Kept for the claims of workers one version older during a rolling deploy: this version's
-- claim writes the same in the statement (sql/fragments/claim.sql, claim_result).
-- history_of(): an execution's checkpoints as a replay needs them, as JSON text
-- ([[step_id, name, output, error], ...]), or {"too_large": bytes} when they are over
-- p_max_bytes. The aggregate only ever holds p_max_bytes, so no history, however large, can
-- make a claim fail for the executions claimed beside it (jsonb's 256 MB limit, out of
-- memory). NULL when nothing is recorded.
CREATE OR REPLACE FUNCTION __schema__.history_of(p_id uuid, p_max_bytes bigint) RETURNS text
LANGUAGE sql STABLE AS $$
    WITH s AS (
        SELECT o.step_id, t, sum(octet_length(t)) OVER (ORDER BY o.step_id) AS upto
          FROM __schema__.operation_outputs AS o,
               LATERAL (SELECT jsonb_build_array(o.step_id, o.step_name, o.output,
                                                 o.error)::text AS t) AS x
         WHERE o.execution_id = p_id
    )
    SELECT CASE WHEN max(upto) > p_max_bytes
                THEN format('{"too_large": %s}', max(upto))
                ELSE '[' || string_agg(t, ',' ORDER BY step_id)
                            FILTER (WHERE upto <= p_max_bytes) || ']' END
      FROM s
$$;
