-- Kestrel SQL functions, applied by every migrate after the migrations (00_rules.sql says
-- how). This file: Starting work and telling it: submit (keys, dedup, debounce, children),
-- a child's outcome to its parent, and signals.

-- name: submit
-- submit(): every argument is checked before anything is written. p_start_at (migration
-- 0015) is the time before which it is not claimed, as the database clock reads it; give it
-- or p_delay_s (seconds from now), not both. An idempotency key covers the whole request:
-- the same key with other arguments, queue, priority, timeout, delay, start time, dedup key
-- or on_duplicate is refused (KS001), never answered with the first execution. Keys
-- stored before 0015 hold the digest of the arguments only ('v2:' marks the whole-request
-- digest), and are compared on those. A child (p_parent) takes a KEY SHARE lock on its parent's row and is refused when
-- the parent is being cancelled or has finished. The lock conflicts with cancel()'s FOR
-- UPDATE and with the DELETE that finishes the parent, so either the child commits first and
-- cancel() (which walks the tree after taking its locks) sees it, or cancel() commits first
-- and this reads its flag. KEY SHARE does not conflict with the parent's heartbeats and
-- checkpoints (NO KEY UPDATE), so a child start never stalls its own parent.
--
-- p_traceparent and p_tracestate (migration 0018) are the submitter's W3C trace context: the
-- workers' spans for this execution continue that trace. Each is kept only when well formed
-- (trace_parent_or_null, trace_state_or_null; a tracestate only with a traceparent), and is
-- ignored otherwise, never an error. A child given none inherits its parent's. They are not
-- part of an idempotency key's request: the same submit sent again from another trace is the
-- same request.
--
-- p_debounce_key, p_debounce_s, p_debounce_max_s (migration 0024: what debounce is, and the
-- locks it takes): a submit of a key whose execution has not started yet replaces that
-- one's arguments, priority and timeout (which counts from its start), pushes its start
-- back, and returns its id. The maximum wait (this submit's; ten windows by default) counts
-- from the key's first submit. Not with a dedup key, a delay, a start time or a parent.
CREATE OR REPLACE FUNCTION __schema__.submit(
    p_workflow text,
    p_args jsonb DEFAULT '[]',
    p_queue text DEFAULT 'default',
    p_priority integer DEFAULT 0,
    p_idempotency_key text DEFAULT NULL,
    p_id uuid DEFAULT NULL,
    p_parent uuid DEFAULT NULL,
    p_timeout_s double precision DEFAULT NULL,
    p_delay_s double precision DEFAULT NULL,
    p_dedup_key text DEFAULT NULL,
    p_on_duplicate text DEFAULT 'return',
    p_start_at timestamptz DEFAULT NULL,
    p_traceparent text DEFAULT NULL,
    p_tracestate text DEFAULT NULL,
    p_debounce_key text DEFAULT NULL,
    p_debounce_s double precision DEFAULT NULL,
    p_debounce_max_s double precision DEFAULT NULL,
    p_concurrency_key text DEFAULT NULL,
    p_tags jsonb DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := coalesce(p_id, __schema__.new_execution_id());
    v_traceparent text := __schema__.trace_parent_or_null(p_traceparent);
    v_tracestate text;
    v_parent_traceparent text;
    v_parent_tracestate text;
    v_delay_s double precision := p_delay_s;
    -- The moment of the call on the database clock: a deadline and a delay count from the
    -- call, not from the caller's BEGIN (kestrel_now() is the transaction's start; a submit
    -- in a transaction open for minutes would be created minutes late, FAULTS C6).
    v_now timestamptz := __schema__.kestrel_now() + (clock_timestamp() - now());
    v_wake timestamptz;
    v_digest text;
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_live uuid;
    v_cancelling boolean;
    v_status text;
    v_pending uuid;
    v_first timestamptz;
    v_workflow text;
    v_pushed timestamptz;
    v_deadline timestamptz;
BEGIN
    PERFORM __schema__.check_name(p_workflow, 'workflow name');
    IF p_id IS NOT NULL THEN  -- most submits choose no id: no call for them
        PERFORM __schema__.check_bucket_id(p_id);
    END IF;
    IF NOT __schema__.valid_queue_name(p_queue) THEN
        RAISE EXCEPTION 'invalid queue name %: 1-128 of A-Z a-z 0-9 _ . : -',
            coalesce(quote_literal(left(p_queue, 200)), 'NULL') USING ERRCODE = 'KS002';
    END IF;
    IF p_priority IS NULL THEN
        RAISE EXCEPTION 'priority must not be NULL' USING ERRCODE = 'KS002';
    END IF;
    IF p_args IS NULL OR jsonb_typeof(p_args) <> 'array' THEN
        RAISE EXCEPTION 'args must be a JSON array, got %', coalesce(jsonb_typeof(p_args), 'NULL')
            USING ERRCODE = 'KS002';
    END IF;
    PERFORM __schema__.check_payload(p_args, 'args');
    IF p_timeout_s IS NOT NULL AND NOT (p_timeout_s > 0 AND p_timeout_s <= 3155760000) THEN
        RAISE EXCEPTION 'timeout must be positive and at most 3155760000 seconds (100 years), got %',
            p_timeout_s USING ERRCODE = 'KS002';
    END IF;
    IF p_start_at IS NOT NULL THEN
        IF p_delay_s IS NOT NULL THEN
            RAISE EXCEPTION 'give delay or start_at, not both' USING ERRCODE = 'KS002';
        END IF;
        v_delay_s := greatest(0, extract(epoch FROM p_start_at - v_now));
    END IF;
    IF v_delay_s IS NOT NULL AND NOT (v_delay_s >= 0 AND v_delay_s <= 3155760000) THEN
        RAISE EXCEPTION 'delay must be between 0 and 3155760000 seconds (100 years), got %',
            v_delay_s USING ERRCODE = 'KS002';
    END IF;
    IF v_delay_s > 0 THEN  -- computed here: no STABLE operator inside a CASE (Citus)
        v_wake := v_now + make_interval(secs => v_delay_s);
    END IF;
    IF p_on_duplicate IS NULL OR p_on_duplicate NOT IN ('return', 'reject') THEN
        RAISE EXCEPTION 'on_duplicate must be return or reject, got %',
            coalesce(quote_literal(left(p_on_duplicate, 200)), 'NULL') USING ERRCODE = 'KS002';
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
    END IF;
    IF p_dedup_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_dedup_key, 'dedup key');
    END IF;
    IF p_concurrency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_concurrency_key, 'concurrency key');
    END IF;
    IF p_tags IS NOT NULL THEN
        PERFORM __schema__.check_tags(p_tags);
    END IF;
    IF p_debounce_key IS NOT NULL OR p_debounce_s IS NOT NULL
            OR p_debounce_max_s IS NOT NULL THEN
        IF p_debounce_key IS NULL OR p_debounce_s IS NULL THEN
            RAISE EXCEPTION 'debounce takes a debounce key and a window (debounce seconds), both'
                USING ERRCODE = 'KS002';
        END IF;
        PERFORM __schema__.check_name(p_debounce_key, 'debounce key');
        -- (NaN > 0 holds in PostgreSQL, NaN <= x does not: NaN is refused too.)
        IF NOT (p_debounce_s > 0 AND p_debounce_s <= 31536000) THEN
            RAISE EXCEPTION 'debounce must be positive and at most 31536000 seconds (a year), got %',
                p_debounce_s USING ERRCODE = 'KS002';
        END IF;
        IF p_debounce_max_s IS NOT NULL
                AND NOT (p_debounce_max_s >= p_debounce_s AND p_debounce_max_s <= 31536000) THEN
            RAISE EXCEPTION 'debounce_max must be at least debounce and at most 31536000 seconds, got %',
                p_debounce_max_s USING ERRCODE = 'KS002';
        END IF;
        IF p_dedup_key IS NOT NULL OR v_delay_s IS NOT NULL OR p_parent IS NOT NULL THEN
            RAISE EXCEPTION 'a debounced submit takes no dedup key, delay, start time or parent: its window is its delay'
                USING ERRCODE = 'KS002';
        END IF;
        v_delay_s := p_debounce_s;
        v_wake := v_now + make_interval(secs => p_debounce_s);
    END IF;
    IF p_parent IS NOT NULL THEN
        SELECT e.cancel_requested, e.traceparent, e.tracestate
          INTO v_cancelling, v_parent_traceparent, v_parent_tracestate
          FROM __schema__.workflow_executions AS e
         WHERE e.id = p_parent
           FOR KEY SHARE;
        IF NOT FOUND THEN
            SELECT h.status INTO v_status FROM __schema__.workflow_history AS h
             WHERE h.id = p_parent;
            IF v_status = 'cancelled' THEN
                RAISE EXCEPTION 'parent execution % was cancelled; it starts no children', p_parent
                    USING ERRCODE = 'KS009';
            ELSIF v_status IS NOT NULL THEN
                RAISE EXCEPTION 'parent execution % has already finished (%)', p_parent, v_status
                    USING ERRCODE = 'KS004';
            END IF;
            RAISE EXCEPTION 'no parent execution %', p_parent USING ERRCODE = 'KS003';
        END IF;
        IF v_cancelling THEN
            RAISE EXCEPTION 'parent execution % is being cancelled; it starts no children',
                p_parent USING ERRCODE = 'KS009';
        END IF;
    END IF;
    IF v_traceparent IS NOT NULL THEN
        v_tracestate := __schema__.trace_state_or_null(p_tracestate);
    ELSE
        v_traceparent := v_parent_traceparent;
        v_tracestate := v_parent_tracestate;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        -- The request as sent (p_start_at as an instant, whatever the session's time zone).
        v_digest := 'v2:' || md5(jsonb_build_array(
            p_args, p_queue, p_priority, p_timeout_s, p_delay_s,
            extract(epoch FROM p_start_at), p_dedup_key, p_on_duplicate)::text
            -- (as before 0024 without debounce, so keys stored then still match)
            || CASE WHEN p_debounce_key IS NULL THEN ''
                    ELSE jsonb_build_array(p_debounce_key, p_debounce_s,
                                           p_debounce_max_s)::text END
            -- (and as before 0025 without a concurrency key or tags)
            || CASE WHEN p_concurrency_key IS NULL AND p_tags IS NULL THEN ''
                    ELSE jsonb_build_array(p_concurrency_key, p_tags)::text END);
        INSERT INTO __schema__.idempotency_keys (idempotency_key, execution_id, workflow, args_digest)
        VALUES (p_idempotency_key, v_id, p_workflow, v_digest)
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF NOT FOUND THEN
            -- ON CONFLICT waited for the other inserter to commit, so this read sees its row.
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF left(v_existing.args_digest, 3) <> 'v2:' THEN  -- stored before 0015
                v_digest := md5(p_args::text);
            END IF;
            IF v_existing.workflow <> p_workflow OR v_existing.args_digest <> v_digest THEN
                RAISE EXCEPTION 'idempotency key % is already used by execution % with other arguments or options (workflow, queue, priority, timeout, delay, start time, dedup key, debounce, concurrency key, tags)',
                    p_idempotency_key, v_existing.execution_id
                    USING ERRCODE = 'KS001';
            END IF;
            RETURN v_existing.execution_id;
        END IF;
    END IF;
    IF p_debounce_key IS NOT NULL THEN
        LOOP
            INSERT INTO __schema__.debounces (queue, debounce_key, execution_id, first_at)
            VALUES (p_queue, p_debounce_key, v_id, v_now)
            ON CONFLICT (queue, debounce_key) DO NOTHING;
            EXIT WHEN FOUND;  -- the key's first submit: a new execution, below
            -- The key's row, locked: the key's submits take turns from here to commit.
            SELECT d.execution_id, d.first_at INTO v_pending, v_first
              FROM __schema__.debounces AS d
             WHERE d.queue = p_queue AND d.debounce_key = p_debounce_key
               FOR UPDATE;
            CONTINUE WHEN NOT FOUND;  -- upkeep dropped it in between: insert again
            v_pushed := least(v_now + make_interval(secs => p_debounce_s),
                              v_first + make_interval(
                                  secs => coalesce(p_debounce_max_s, 10 * p_debounce_s)));
            -- A debounced execution's timeout counts from its start, pushed with it.
            v_deadline := v_pushed + make_interval(secs => p_timeout_s);
            -- Still pending (never claimed): it takes this submit's arguments, priority and
            -- timeout and waits longer.
            UPDATE __schema__.workflow_executions AS e
               SET args = p_args, priority = p_priority, wake_at = v_pushed,
                   deadline = v_deadline, concurrency_key = p_concurrency_key, tags = p_tags,
                   updated_at = v_now
             WHERE e.id = v_pending AND e.status = 'waiting' AND e.lease_epoch = 0
               AND NOT e.cancel_requested AND e.workflow = p_workflow
            RETURNING e.id INTO v_pending;
            IF FOUND THEN
                IF p_idempotency_key IS NOT NULL THEN
                    UPDATE __schema__.idempotency_keys SET execution_id = v_pending
                     WHERE idempotency_key = p_idempotency_key;
                END IF;
                RETURN v_pending;
            END IF;
            SELECT e.workflow INTO v_workflow FROM __schema__.workflow_executions AS e
             WHERE e.id = (SELECT d.execution_id FROM __schema__.debounces AS d
                            WHERE d.queue = p_queue AND d.debounce_key = p_debounce_key)
               AND e.status = 'waiting' AND e.lease_epoch = 0;
            IF FOUND AND v_workflow <> p_workflow THEN
                RAISE EXCEPTION 'debounce key % on queue % is pending for workflow %, not %',
                    p_debounce_key, p_queue, v_workflow, p_workflow USING ERRCODE = 'KS006';
            END IF;
            -- It started (or ended): this submit starts the key's next one.
            UPDATE __schema__.debounces AS d SET execution_id = v_id, first_at = v_now
             WHERE d.queue = p_queue AND d.debounce_key = p_debounce_key;
            EXIT;
        END LOOP;
        v_deadline := v_wake + make_interval(secs => p_timeout_s);
    ELSE
        v_deadline := v_now + make_interval(secs => p_timeout_s);
    END IF;
    LOOP
        INSERT INTO __schema__.workflow_executions
               (id, workflow, queue, priority, args, idempotency_key, parent_id, deadline,
                dedup_key, status, wake_at, traceparent, tracestate, concurrency_key, tags)
        VALUES (v_id, p_workflow, p_queue, p_priority, p_args, p_idempotency_key, p_parent,
                v_deadline, p_dedup_key,
                CASE WHEN v_delay_s > 0 THEN 'waiting' ELSE 'queued' END,
                v_wake,
                v_traceparent, v_tracestate, p_concurrency_key, p_tags)
        ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING;
        EXIT WHEN FOUND;
        -- A live execution holds the dedup key (ON CONFLICT waited for it to commit).
        SELECT id INTO v_live FROM __schema__.workflow_executions
         WHERE queue = p_queue AND dedup_key = p_dedup_key;
        IF FOUND THEN
            IF p_on_duplicate = 'reject' THEN
                RAISE EXCEPTION 'queue % already has a live execution % with dedup key %',
                    p_queue, v_live, p_dedup_key USING ERRCODE = 'KS006';
            END IF;
            IF p_idempotency_key IS NOT NULL THEN  -- the key answers for what we returned
                UPDATE __schema__.idempotency_keys SET execution_id = v_live
                 WHERE idempotency_key = p_idempotency_key;
            END IF;
            RETURN v_live;
        END IF;
        -- It finished between the conflict and the read: the key is free, try again.
    END LOOP;
    -- Delivered at commit only; workers also poll, so a lost notification costs latency only.
    PERFORM pg_notify('kestrel.__schema_name__', p_queue);
    RETURN v_id;
END
$$;

-- name: child_finished
-- A finished child tells its parent: a signal named 'kestrel.child:<id>' whose payload is
-- the child's outcome, which wakes the parent if it waits for it.
--
-- PL/pgSQL, the clock read into a variable (issue 24): Citus plans no statement of a SQL
-- function that uses its parameters ("could not create distributed plan"), and refuses a
-- function that is not IMMUTABLE inside CASE in an UPDATE; a PL/pgSQL variable reaches the
-- statement as a parameter, a constant to Citus.
CREATE OR REPLACE FUNCTION __schema__.child_finished(
    p_parent uuid, p_child uuid, p_status text, p_result jsonb, p_error jsonb
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := __schema__.kestrel_now();
BEGIN
    WITH bumped AS (
        UPDATE __schema__.workflow_executions AS p
           SET signal_seq = p.signal_seq + 1,
               wake_at = CASE WHEN p.status = 'waiting'
                                   AND p.waiting_for = 'kestrel.child:' || p_child
                              THEN v_now ELSE p.wake_at END
         WHERE p.id = p_parent
     RETURNING p.id
    )
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT p_parent, 'kestrel.child:' || p_child,
           jsonb_build_object('status', p_status, 'result', p_result, 'error', p_error),
           'kestrel.child:' || p_child
      FROM bumped
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
END
$$;

-- name: signal
-- signal(): the name, key and payload follow the same rules as submit's, checked before
-- the execution's row is locked.
CREATE OR REPLACE FUNCTION __schema__.signal(
    p_execution uuid, p_name text, p_payload jsonb DEFAULT NULL,
    p_idempotency_key text DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_try integer;
    -- Read once, used inside CASE as a parameter (Citus refuses the call there: issue 24).
    v_now timestamptz := __schema__.kestrel_now();
BEGIN
    PERFORM __schema__.check_name(p_name, 'signal name');
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
    END IF;
    PERFORM __schema__.check_payload(p_payload, 'payload');
    -- Lock the execution row first (the same order as park), then store the signal. If the
    -- row this waited for was deleted, a transaction that cancelled and retried the
    -- execution may have inserted it again, invisible to this statement's snapshot: look
    -- once more, in a new statement.
    FOR v_try IN 1..2 LOOP
        UPDATE __schema__.workflow_executions AS e
           SET signal_seq = e.signal_seq + 1,
               wake_at = CASE WHEN e.status = 'waiting' AND e.waiting_for = p_name
                              THEN v_now ELSE e.wake_at END
         WHERE e.id = p_execution
        RETURNING e.status INTO v_status;
        EXIT WHEN FOUND;
    END LOOP;
    IF v_status IS NULL THEN
        SELECT h.status INTO v_status FROM __schema__.workflow_history AS h
         WHERE h.id = p_execution;
        IF FOUND THEN
            -- A keyed signal sent again after its reply was lost may find the execution
            -- finished since, maybe on that very signal: already delivered, not an error
            -- (FAULTS R1; a workflow's ctx.signal would otherwise fail its sender).
            -- Its signals left with it (archive_finished): look in history too.
            IF p_idempotency_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM __schema__.signals AS s
                     WHERE s.execution_id = p_execution
                       AND s.idempotency_key = p_idempotency_key
                    UNION ALL
                    SELECT 1 FROM __schema__.signal_history AS s
                     WHERE s.execution_id = p_execution
                       AND s.idempotency_key = p_idempotency_key) THEN
                RETURN false;
            END IF;
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
