-- 0007: one set of rules at every door, children that cannot outlive a cancel, retry that
-- replays deterministically.
--
-- The Python client, the CLI, a worker starting a child and any other language all pass
-- through submit() and signal(), so those functions are where the rules live (bug 17: the
-- SQL function accepted a queue name no runtime can be configured for and arguments over
-- the client's cap; FAULTS P2: arguments valid as jsonb that the runtime cannot decode).
-- The client checks the same rules before its round trip; tests/integration/test_doors.py
-- holds both sides to one table of cases.
--
-- SQLSTATEs (kestrel/db.py maps them to typed errors):
--   KS002 ConfigError       a setting: queue name, priority, timeout, delay, on_duplicate
--   KS007 SerializationError a value that could not be stored or read back unchanged
--   KS008 PayloadTooLarge   a JSON value over 16 MiB
--   KS009 ParentCancelled   a child of a cancelled parent (submit, retry)

-- A name or key: 1-1024 characters and at most 2048 bytes of UTF-8 (codec.check_text). The
-- byte bound keeps every indexed name (history by workflow, pending signals by name, events
-- by key, idempotency and dedup keys) inside a btree entry (2704 bytes), so no name can be
-- accepted at the door and fail later in a worker's batch. NUL and invalid UTF-8 cannot
-- reach a text value in PostgreSQL at all.
CREATE FUNCTION __schema__.check_name(p_value text, p_what text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF p_value IS NULL OR p_value = '' THEN
        RAISE EXCEPTION '% must not be empty', p_what USING ERRCODE = 'KS007';
    END IF;
    IF char_length(p_value) > 1024 THEN
        RAISE EXCEPTION '% is % characters, over the limit of 1024', p_what,
            char_length(p_value) USING ERRCODE = 'KS007';
    END IF;
    IF octet_length(p_value) > 2048 THEN
        RAISE EXCEPTION '% is % bytes as UTF-8, over the limit of 2048', p_what,
            octet_length(p_value) USING ERRCODE = 'KS007';
    END IF;
END
$$;

-- The queue rule of kestrel.config.QUEUE_NAME: 1-128 of A-Z a-z 0-9 _ . : -
CREATE FUNCTION __schema__.valid_queue_name(p_queue text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT p_queue IS NOT NULL AND p_queue ~ '^[A-Za-z0-9_.:-]{1,128}$'
$$;

-- The first number in p_value that the runtime (orjson) would not read back as the same
-- number, or NULL when there is none. orjson reads an integer in [-2^63, 2^64 - 1] exactly;
-- every other number becomes the nearest float64, which is exact only when the number is
-- that float64 written in its shortest form (0.1, 1e20, 5e-324): 1e400 overflows, 1e-400
-- becomes 0.0, 2^70 and 0.12345678901234567890 lose digits. Such numbers are refused.
--
-- "Shortest form" is PostgreSQL's float8 text (shortest at extra_float_digits 1), or fewer
-- digits than that: PostgreSQL never writes a form that lies exactly halfway between two
-- float64 values, while orjson and Python do when it is the shortest (6274480000000000000000
-- reads as the float64 that PostgreSQL writes 6.274480000000001e+21 and orjson 6.27448e+21).
-- Only numbers that are not in-range integers are looked at (one jsonpath pass finds them).
CREATE FUNCTION __schema__.undecodable_number(p_value jsonb) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET extra_float_digits = 1 AS $$
    SELECT c.n
      FROM (SELECT j::numeric AS n
              FROM jsonb_path_query(p_value, 'strict $.** ? (@.type() == "number" && (
                        @ != @.floor() || @ < -9223372036854775808
                        || @ > 18446744073709551615))') AS j) AS c
     CROSS JOIN LATERAL (
            SELECT CASE WHEN abs(c.n) > 1.7976931348623157e308
                          OR abs(c.n) <= 2.4703282292062328e-324 THEN NULL
                        ELSE c.n::float8::text::numeric END AS s) AS f
     CROSS JOIN LATERAL (
            SELECT length(trim(BOTH '0' FROM replace(abs(c.n)::text, '.', ''))) AS n_digits,
                   length(trim(BOTH '0' FROM replace(abs(f.s)::text, '.', ''))) AS s_digits
         ) AS d
     WHERE CASE WHEN abs(c.n) > 1.7976931348623157e308 THEN true       -- overflows
                WHEN abs(c.n) <= 2.4703282292062328e-324 THEN c.n <> 0  -- underflows to 0
                ELSE f.s <> c.n AND d.n_digits >= d.s_digits END        -- loses digits
     LIMIT 1
$$;

-- A JSON value the runtime can decode unchanged: at most 16 MiB as jsonb text (what a
-- worker reads; codec.DEFAULT_MAX_PAYLOAD_BYTES), nesting at most 254 levels deep counting
-- the outermost array or object (orjson, and so codec.encode, refuses deeper values), and
-- only numbers that read back unchanged (undecodable_number). Strings need no check:
-- jsonb itself refuses \u0000 and lone surrogates.
CREATE FUNCTION __schema__.check_payload(p_value jsonb, p_what text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_bytes bigint;
    v_bad numeric;
    v_shown text;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    v_bytes := octet_length(p_value::text);
    IF v_bytes > 16777216 THEN
        RAISE EXCEPTION '% is % bytes as JSON text, over the cap of 16777216 bytes (16 MiB)',
            p_what, v_bytes USING ERRCODE = 'KS008';
    END IF;
    -- An array or object at level 254 below the outermost one is the 255th level.
    IF jsonb_path_exists(p_value, 'strict $.**{254 to last} ? (@.type() == "array"
                                                            || @.type() == "object")') THEN
        RAISE EXCEPTION '% nest deeper than 254 levels of arrays and objects', p_what
            USING ERRCODE = 'KS007';
    END IF;
    IF jsonb_path_exists(p_value, 'strict $.** ? (@.type() == "number" && (
            @ != @.floor() || @ < -9223372036854775808 || @ > 18446744073709551615))') THEN
        v_bad := __schema__.undecodable_number(p_value);
        IF v_bad IS NOT NULL THEN
            v_shown := v_bad::text;
            IF length(v_shown) > 40 THEN
                v_shown := 'about ' || trim(to_char(v_bad, '9.999999999999999EEEE'));
            END IF;
            RAISE EXCEPTION '% contain the number %, which would not read back unchanged: '
                'integers must lie in [-2^63, 2^64 - 1], other numbers must be finite '
                'float64 values in their shortest form', p_what, v_shown
                USING ERRCODE = 'KS007';
        END IF;
    END IF;
END
$$;

-- submit(): the same signature as 0004; every argument is checked before anything is
-- written. A child (p_parent) takes a KEY SHARE lock on its parent's row and is refused when
-- the parent is being cancelled or has finished. The lock conflicts with cancel()'s FOR
-- UPDATE and with the DELETE that finishes the parent, so either the child commits first and
-- cancel() (which walks the tree after taking its locks) sees it, or cancel() commits first
-- and this reads its flag. KEY SHARE does not conflict with the parent's heartbeats and
-- checkpoints (NO KEY UPDATE), so a child start never stalls its own parent.
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
    p_on_duplicate text DEFAULT 'return'
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := coalesce(p_id, gen_random_uuid());
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_live uuid;
    v_cancelling boolean;
    v_status text;
BEGIN
    PERFORM __schema__.check_name(p_workflow, 'workflow name');
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
    IF p_delay_s IS NOT NULL AND NOT (p_delay_s >= 0 AND p_delay_s <= 3155760000) THEN
        RAISE EXCEPTION 'delay must be between 0 and 3155760000 seconds (100 years), got %',
            p_delay_s USING ERRCODE = 'KS002';
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
    IF p_parent IS NOT NULL THEN
        SELECT e.cancel_requested INTO v_cancelling
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
    LOOP
        INSERT INTO __schema__.workflow_executions
               (id, workflow, queue, priority, args, idempotency_key, parent_id, deadline,
                dedup_key, status, wake_at)
        VALUES (v_id, p_workflow, p_queue, p_priority, p_args, p_idempotency_key, p_parent,
                __schema__.kestrel_now() + make_interval(secs => p_timeout_s), p_dedup_key,
                CASE WHEN p_delay_s > 0 THEN 'waiting' ELSE 'queued' END,
                CASE WHEN p_delay_s > 0
                     THEN __schema__.kestrel_now() + make_interval(secs => p_delay_s) END)
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

-- signal(): the name, key and payload follow the same rules as submit's, checked before
-- the execution's row is locked.
CREATE OR REPLACE FUNCTION __schema__.signal(
    p_execution uuid, p_name text, p_payload jsonb DEFAULT NULL,
    p_idempotency_key text DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
BEGIN
    PERFORM __schema__.check_name(p_name, 'signal name');
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
    END IF;
    PERFORM __schema__.check_payload(p_payload, 'payload');
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

-- cancel(): 0005 found the tree and locked it in one statement, whose snapshot predates its
-- locks: a child committed while the statement waited for a lock was never seen, and
-- survived its cancelled parent (FAULTS X7). Now the walk is repeated, each time in a new
-- statement whose snapshot is taken after the previous statement's locks were granted,
-- until a walk finds no live member it has not locked. That is complete: a child submit
-- holds KEY SHARE on its parent until it commits, which FOR UPDATE waits for, so every
-- child of a locked node is either committed before the next walk (and seen by it) or not
-- started until this transaction ends (and then refused). Each walk locks what it found in
-- id order, as 0005 did (the order heartbeats and completions lock in); a second walk only
-- finds something when a child was started during the first. The rest is 0005's.
CREATE OR REPLACE FUNCTION __schema__.cancel(p_execution uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_tree uuid[] := '{}';
    v_more uuid[];
    v_moved uuid[];
    v_parents uuid[];
BEGIN
    LOOP
        WITH RECURSIVE tree AS (
            SELECT id FROM __schema__.workflow_executions WHERE id = p_execution
            UNION
            SELECT e.id FROM __schema__.workflow_executions AS e JOIN tree ON e.parent_id = tree.id
        )
        SELECT array_agg(l.id) INTO v_more
          FROM (SELECT e.id FROM __schema__.workflow_executions AS e
                  JOIN tree USING (id)
                 WHERE e.id <> ALL (v_tree)
                 ORDER BY e.id
                   FOR UPDATE OF e) AS l;
        EXIT WHEN v_more IS NULL;
        v_tree := v_tree || v_more;
    END LOOP;
    WITH flagged AS (
        UPDATE __schema__.workflow_executions AS e
           SET cancel_requested = true
         WHERE e.id = ANY (v_tree) AND e.status = 'running'
    ), removed AS (
        DELETE FROM __schema__.workflow_executions AS e
         WHERE e.id = ANY (v_tree) AND e.status IN ('queued', 'waiting')
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
    SELECT array_agg(id), array_agg(parent_id) INTO v_moved, v_parents FROM moved;
    IF v_moved IS NOT NULL THEN
        PERFORM __schema__.child_finished(t.parent, t.child, 'cancelled', NULL,
                    jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'))
           FROM unnest(v_parents, v_moved) AS t(parent, child)
          WHERE t.parent IS NOT NULL;
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

-- retry(): 0003 brought back every checkpoint without an error, also those recorded after
-- the failed step. A workflow that caught StepFailed and took another branch then found the
-- other branch's checkpoints at positions its re-run reaches by the first branch, and
-- failed with NonDeterminismError (FAULTS X7). Now only the checkpoints before the first
-- failed one come back; the rest are dropped and run again. A child whose parent was
-- cancelled is not brought back (KS009), as submit() would not start it.
CREATE OR REPLACE FUNCTION __schema__.retry(p_execution uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_parent uuid;
    v_cancelling boolean;
BEGIN
    SELECT parent_id INTO v_parent FROM __schema__.workflow_history
     WHERE id = p_execution AND status IN ('failed', 'cancelled', 'quarantined');
    IF v_parent IS NOT NULL THEN
        SELECT e.cancel_requested INTO v_cancelling
          FROM __schema__.workflow_executions AS e
         WHERE e.id = v_parent
           FOR KEY SHARE;
        IF NOT FOUND THEN
            SELECT h.status = 'cancelled' INTO v_cancelling
              FROM __schema__.workflow_history AS h WHERE h.id = v_parent;
        END IF;
        IF v_cancelling THEN
            RAISE EXCEPTION 'parent execution % was cancelled; retry the parent instead', v_parent
                USING ERRCODE = 'KS009';
        END IF;
    END IF;
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
         WHERE step_id < coalesce((SELECT min(step_id) FROM back WHERE error IS NOT NULL),
                                  2147483647);
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
