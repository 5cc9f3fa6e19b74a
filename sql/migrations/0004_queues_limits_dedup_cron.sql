-- HISTORICAL FUNCTION BODIES: the functions this migration creates were replaced since;
-- sql/functions/functions.sql holds every function as it is now and is applied on every
-- migrate, and sql/schema.sql holds the tables, indexes and views as they are now.
-- 0004: queue limits (global concurrency, rate), deduplication, delayed start, schedules.

-- One row per limited queue. Claims from a limited queue lock its row first (SKIP LOCKED:
-- a process finding it busy claims elsewhere and comes back), so the running count and the
-- recent starts it reads are exact: limits hold under any number of processes. Queues
-- without a row are never locked and pay nothing.
CREATE TABLE __schema__.queue_limits (
    queue         text PRIMARY KEY,
    concurrency   integer CHECK (concurrency > 0),
    rate          integer CHECK (rate > 0),
    period        interval CHECK (period > interval '0'),
    -- The last `rate` claim times: a claim is allowed while fewer than `rate` of them lie
    -- within the last `period` (an exact sliding window, not a token bucket that can burst
    -- to twice the rate across a window boundary).
    recent_starts timestamptz[] NOT NULL DEFAULT '{}',
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CHECK ((rate IS NULL) = (period IS NULL))
);

-- Deduplication: at most one live execution per (queue, dedup_key). Only live rows are in
-- workflow_executions, so the key is free again once the execution finishes.
ALTER TABLE __schema__.workflow_executions ADD COLUMN dedup_key text;
CREATE UNIQUE INDEX workflow_executions_dedup_idx
    ON __schema__.workflow_executions (queue, dedup_key)
    WHERE dedup_key IS NOT NULL;

-- Schedules: the last tick each cron schedule started. A tick is started by whichever
-- process advances last_tick first (compare-and-set), with an idempotency key made of the
-- schedule and the tick time as a second guard.
CREATE TABLE __schema__.schedules (
    name       text PRIMARY KEY,
    cron       text NOT NULL,
    workflow   text NOT NULL,
    last_tick  timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

DROP FUNCTION __schema__.submit(text, jsonb, text, integer, text, uuid, uuid, double precision);
CREATE FUNCTION __schema__.submit(
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
    IF p_delay_s IS NOT NULL AND p_delay_s < 0 THEN
        RAISE EXCEPTION 'delay must not be negative, got %', p_delay_s USING ERRCODE = 'KS002';
    END IF;
    IF p_on_duplicate NOT IN ('return', 'reject') THEN
        RAISE EXCEPTION 'on_duplicate must be return or reject, got %', p_on_duplicate
            USING ERRCODE = 'KS002';
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
