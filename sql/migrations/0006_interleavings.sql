-- 0007: decisions that hold against racing client transactions (FAULTS X), and histories
-- loaded within a bound (FAULTS P3).
--
-- At READ COMMITTED a statement *locks* the newest version of a row but *reads* every other
-- table in the snapshot it started with. A guard that locks a row and then reads another
-- table in the same statement can miss what the transaction it waited for wrote. The
-- functions below lock first, in a statement of their own, and read in the next one, which
-- takes a fresh snapshot.

-- consume_signal(): take the oldest pending signal p_name for an execution this worker owns
-- under p_epoch and record it as the checkpoint of the wait at p_step_id, so the signal is
-- consumed exactly when the checkpoint is written. Returns ownership, the cancel flag, the
-- recorded output (NULL when no signal is pending) and signal_seq for a following park: any
-- signal() that bumped signal_seq before the lock was granted is visible to the scan.
CREATE FUNCTION __schema__.consume_signal(
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
       FOR SHARE;
    owned := FOUND;
    cancelled := coalesce(cancelled, false);
    IF NOT owned OR cancelled THEN
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
            ON CONFLICT (execution_id, step_id) DO NOTHING
        RETURNING operation_outputs.output INTO output;
    END IF;
END
$$;

-- park_execution(): park a running execution at a wait (no lease, no slot, one row) and say
-- what happened, so the worker never mistakes a decision for a lost lease (FAULTS X2, X4):
--   parked     parked now, or by an earlier call whose reply was lost (same epoch, same wait)
--   cancelled  a cancel was requested: the worker finishes the execution as cancelled
--   signalled  a signal arrived since p_seen_seq was read: look for it again
--   lost       a newer claim owns it, or it has left the hot table
-- A re-park of the same wait keeps the original deadline; attempts restart at 0 (a clean
-- park is progress, not a lost worker).
CREATE FUNCTION __schema__.park_execution(
    p_id uuid, p_epoch integer, p_step_id integer, p_waiting_for text,
    p_seconds double precision, p_seen_seq bigint
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v record;
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
               ELSE __schema__.kestrel_now() + make_interval(secs => p_seconds) END,
           wake_at = CASE
               WHEN e.wait_step IS NOT DISTINCT FROM p_step_id AND e.wait_deadline IS NOT NULL
               THEN e.wait_deadline
               ELSE __schema__.kestrel_now() + make_interval(secs => p_seconds) END,
           wait_step = p_step_id,
           updated_at = __schema__.kestrel_now()
     WHERE e.id = p_id
       AND e.lease_epoch = p_epoch
       AND e.status = 'running'
       AND NOT e.cancel_requested
       AND (p_seen_seq IS NULL OR e.signal_seq = p_seen_seq);
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
    RETURN 'signalled';
END
$$;

-- history_of(): an execution's checkpoints as a replay needs them, as JSON text
-- ([[step_id, name, output, error], ...]), or {"too_large": bytes} when they are over
-- p_max_bytes. The aggregate only ever holds p_max_bytes, so no history, however large, can
-- make a claim fail for the executions claimed beside it (jsonb's 256 MB limit, out of
-- memory). NULL when nothing is recorded.
CREATE FUNCTION __schema__.history_of(p_id uuid, p_max_bytes bigint) RETURNS text
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
