-- HISTORICAL FUNCTION BODIES: the functions this migration creates were replaced since;
-- sql/functions/functions.sql holds every function as it is now and is applied on every
-- migrate, and sql/schema.sql holds the tables, indexes and views as they are now.
-- 0001_initial: the hot queue, step checkpoints, history, idempotency keys, submit().
--
-- `__schema__` is replaced by the quoted, validated schema name (kestrel/sql.py).
-- Forward-only: never edit a migration that has shipped; add the next one.

-- The database clock. Every lease, timer and sleep decision reads kestrel_now(), never a
-- worker's clock (DESIGN §2.5). Tests move time by writing clock_offset; production leaves
-- the single row at zero. STABLE + one-row lookup: inlined and cheap.
CREATE TABLE __schema__.clock_offset (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    offset_by interval NOT NULL DEFAULT interval '0'
);
INSERT INTO __schema__.clock_offset DEFAULT VALUES;

CREATE FUNCTION __schema__.kestrel_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT now() + (SELECT offset_by FROM __schema__.clock_offset)
$$;

-- The hot queue: only live executions (queued, running, waiting). Finished rows leave in the
-- same statement that finishes them (complete_batch, reenqueue_expired), so this table stays
-- as small as the live work, whatever the history.
CREATE TABLE __schema__.workflow_executions (
    id               uuid PRIMARY KEY,
    workflow         text NOT NULL,
    queue            text NOT NULL DEFAULT 'default',
    priority         integer NOT NULL DEFAULT 0,
    status           text NOT NULL DEFAULT 'queued'
                     CHECK (status IN ('queued', 'running', 'waiting')),
    args             jsonb NOT NULL,
    idempotency_key  text,
    -- Fencing token: incremented by every claim. Every write from a worker carries the epoch
    -- it claimed with; a superseded epoch matches zero rows.
    lease_epoch      integer NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    -- Number of claims. A claim that never finishes (the worker died) counts; past
    -- max_attempts the sweeper quarantines instead of re-enqueueing.
    attempts         integer NOT NULL DEFAULT 0,
    wake_at          timestamptz,
    created_at       timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    started_at       timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT __schema__.kestrel_now()
-- Every claim, heartbeat and requeue rewrites the row. Leaving 30% of each page free lets
-- those updates stay HOT (same page, no index writes) since no indexed column but status
-- changes on a heartbeat.
) WITH (fillfactor = 70,
        -- The table is small and churns: vacuum it after a few hundred dead rows rather than
        -- after 20% of the table, so dead tuples never dominate the claim's index scans.
        autovacuum_vacuum_scale_factor = 0.0,
        autovacuum_vacuum_threshold = 500,
        autovacuum_analyze_scale_factor = 0.0,
        autovacuum_analyze_threshold = 1000,
        autovacuum_vacuum_cost_delay = 0);

-- The claim reads only queued rows, best priority first, oldest first within it.
CREATE INDEX workflow_executions_claim_idx
    ON __schema__.workflow_executions (queue, priority DESC, created_at)
    WHERE status = 'queued';
-- The sweeper reads only running rows, earliest expiry first.
CREATE INDEX workflow_executions_lease_idx
    ON __schema__.workflow_executions (lease_expires_at)
    WHERE status = 'running';

-- Step checkpoints. The primary key is the exactly-once guarantee: INSERT … ON CONFLICT DO
-- NOTHING keeps the first committed output of a step and every replay reads that one.
CREATE TABLE __schema__.operation_outputs (
    execution_id uuid NOT NULL,
    step_id      integer NOT NULL,
    step_name    text NOT NULL,
    output       jsonb,
    error        jsonb,
    attempt      integer NOT NULL,
    lease_epoch  integer NOT NULL,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    PRIMARY KEY (execution_id, step_id),
    CHECK ((output IS NULL) OR (error IS NULL))
);

-- Finished executions, append-only, range-partitioned by finish time so retention drops
-- whole partitions instead of running DELETEs. The DEFAULT partition catches everything until
-- partition upkeep creates dated ones.
CREATE TABLE __schema__.workflow_history (
    id              uuid NOT NULL,
    workflow        text NOT NULL,
    queue           text NOT NULL,
    priority        integer NOT NULL,
    status          text NOT NULL
                    CHECK (status IN ('completed', 'failed', 'cancelled', 'quarantined')),
    args            jsonb NOT NULL,
    result          jsonb,
    error           jsonb,
    idempotency_key text,
    lease_epoch     integer NOT NULL,
    attempts        integer NOT NULL,
    created_at      timestamptz NOT NULL,
    started_at      timestamptz,
    finished_at     timestamptz NOT NULL
) PARTITION BY RANGE (finished_at);
CREATE TABLE __schema__.workflow_history_default
    PARTITION OF __schema__.workflow_history DEFAULT;
CREATE INDEX workflow_history_id_idx ON __schema__.workflow_history (id);
CREATE INDEX workflow_history_status_idx
    ON __schema__.workflow_history (status, finished_at);

-- Idempotency keys outlive the hot row: an execution that already finished and moved to
-- history still answers for its key. A row here is written in the same statement as the
-- execution, and never moves, so there is no window in which a key has no owner.
CREATE TABLE __schema__.idempotency_keys (
    idempotency_key text PRIMARY KEY,
    execution_id    uuid NOT NULL,
    workflow        text NOT NULL,
    args_digest     text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT __schema__.kestrel_now()
);

-- submit(): the one way to enqueue, from Python, the CLI, another language or a trigger.
-- Runs in the caller's transaction, so the execution commits or rolls back with the caller's
-- data. Same key and same arguments → the existing id; same key, other arguments → SQLSTATE
-- KS001 and nothing written.
CREATE FUNCTION __schema__.submit(
    p_workflow text,
    p_args jsonb DEFAULT '[]',
    p_queue text DEFAULT 'default',
    p_priority integer DEFAULT 0,
    p_idempotency_key text DEFAULT NULL,
    p_id uuid DEFAULT NULL
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
    INSERT INTO __schema__.workflow_executions (id, workflow, queue, priority, args, idempotency_key)
    VALUES (v_id, p_workflow, p_queue, p_priority, p_args, p_idempotency_key);
    -- Delivered at commit only; workers also poll, so a lost notification costs latency only.
    PERFORM pg_notify('kestrel.__schema_name__', p_queue);
    RETURN v_id;
END
$$;

-- One row per applied migration (kestrel/migrate.py).
CREATE TABLE __schema__.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
