-- Kestrel SQL functions, applied by every migrate after the migrations (00_rules.sql says
-- how). This file: Checkpoints and finishes: what leaves the hot tables with an execution,
-- the checkpoint batch, the move into history, and the sweeper's and the deadline's forms
-- (the statements Citus needs as functions).

-- name: archive_finished
-- What finished executions had besides their checkpoints, moved by complete/cancel/
-- quarantine/deadline in the statement that moves them to history: their signals (consumed
-- or not) to signal_history and their events to event_history (migration 0013), each stamped
-- with p_finished_at, the finish time the caller wrote to workflow_history and that
-- partitions it, so the hot tables hold live work only and retention drops all of it with
-- the execution. retry() brings it back. Checkpoints stay where they were written
-- (operation_outputs, partitioned by execution id: migration 0019). Returns the number of
-- rows moved. Each DELETE finds its rows by an index that leads with the execution id; an
-- execution that never signalled or published costs two index probes.
--
-- The time is passed, never read again here: a second read of the clock can differ from
-- the first (a test clock moved while the finishing statement waited on a row a client held;
-- the operator machine's soak found the execution in history with its signals under another
-- time).
--
-- PL/pgSQL (issue 24): Citus plans no statement of a SQL function that uses its parameters.
CREATE OR REPLACE FUNCTION __schema__.archive_finished(p_ids uuid[],
                                                       p_finished_at timestamptz)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint;
BEGIN
    WITH signals_moved AS (
        DELETE FROM __schema__.signals AS s
         WHERE s.execution_id = ANY(p_ids)
     RETURNING s.*
    ), signals_archived AS (
        INSERT INTO __schema__.signal_history
               (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
                consumed_at, execution_finished_at)
        SELECT id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
               consumed_at, p_finished_at
          FROM signals_moved
        RETURNING 1
    ), events_moved AS (
        DELETE FROM __schema__.events AS v
         WHERE v.execution_id = ANY(p_ids)
     RETURNING v.*
    ), events_archived AS (
        INSERT INTO __schema__.event_history
               (execution_id, key, value, updated_at, execution_finished_at)
        SELECT execution_id, key, value, updated_at, p_finished_at
          FROM events_moved
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM signals_archived) + (SELECT count(*) FROM events_archived)
      INTO v_n;
    RETURN v_n;
END
$$;

-- name: archive_steps
-- archive_finished at the current time, for the statements of workers one version older
-- during a rolling deploy (this version's statements pass the time they wrote).
CREATE OR REPLACE FUNCTION __schema__.archive_steps(p_ids uuid[]) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    RETURN __schema__.archive_finished(p_ids, __schema__.kestrel_now());
END
$$;

-- name: save_steps
-- save_steps(): a group commit of step checkpoints from every running execution of a process
-- (kestrel.commits.CheckpointCommits), one JSON array of rows, each [execution, epoch, step,
-- name, [output] or null, [error] or null, attempt, ran_s, waited_s] (statements/steps.py;
-- output and error come wrapped in a one-element array, so SQL NULL, none, and JSON null, a
-- step that returned None, stay apart). A row is written only while its execution is still
-- running under the writer's epoch: the FOR SHARE lock makes a concurrent claim (which
-- updates the row) wait or be waited for, and READ COMMITTED re-checks the epoch on the
-- newest row version, so a superseded epoch can never slip in; a cancelled execution
-- records nothing more (it stops at this step boundary). Returns, per input row, whether the
-- writer still owns the execution, whether this call wrote the row, and what is now
-- recorded there: our row as jsonb normalized it (so the live run returns exactly what a
-- replay will), or the row recorded first.
--
-- p_if_recorded false (what every group commit sends first) inserts without ON CONFLICT:
-- INSERT … ON CONFLICT inserts speculatively and confirms each row with a second WAL record
-- (Heap/HEAP_CONFIRM, 48 bytes a checkpoint; BENCHMARKS.md). A conflict needs a row for the
-- same (execution, step) already there, and under the epoch-checked lock only this
-- process's own earlier try of the same batch can have written one (a lost reply, FAULTS
-- F3). Then the call fails as a whole with unique_violation, nothing of it is written, and
-- db.run calls again with p_if_recorded true (Stmt.if_recorded): ON CONFLICT DO NOTHING
-- keeps the first committed output, which the last statement returns.
--
-- started_at and finished_at are the database clock less the seconds since the body started
-- and ended (the worker's monotonic clock): a worker whose wall clock is skewed or jumps never
-- writes its time into a row.
--
-- The Citus form of save_new_steps_batch / save_steps_batch (sql/queries/steps.sql): the
-- worker sends it instead of them where its schema is a Citus distributed schema
-- (distributed_schema()), and there migrate delegates it to the tenant's node
-- (delegate_functions), so a batch is one round trip, run on that node, with no other node
-- in its transaction. Three plain statements (lock, insert, read back), because Citus plans
-- a statement with an INSERT in a CTE CTE by CTE even on the tenant's node, and that
-- statement's final join then reads the whole checkpoint table back (docs/citus.md). On one
-- PostgreSQL the statements are cheaper (bench/checkpoint_batch.py), so they stay there.
CREATE OR REPLACE FUNCTION __schema__.save_steps(p_rows jsonb, p_if_recorded boolean)
RETURNS TABLE (execution_id uuid, step_id integer, owned boolean, inserted boolean,
               step_name text, output jsonb, error jsonb, cancelled boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_owned text[];      -- 'execution/epoch' of the executions written for, locked
    v_writable uuid[];   -- of those, the ones not cancelled
    v_new text[] := '{}';  -- 'execution/step' of the rows this call wrote
    v_key text;
BEGIN
    -- 1. Lock what this batch writes for, in id order (lock order: see heartbeat).
    -- By primary key; whether each runs is asked of the locked row, in FILTER (a condition
    -- over the locked subquery is pushed into its scan; the rule for held rows: see the
    -- heartbeat statement). The epoch is matched in step 2.
    SELECT coalesce(array_agg(o.id::text || '/' || o.lease_epoch)
                        FILTER (WHERE o.status = 'running'), '{}'),
           coalesce(array_agg(o.id)
                        FILTER (WHERE o.status = 'running' AND NOT o.cancel_requested), '{}')
      INTO v_owned, v_writable
      FROM (SELECT e.id, e.lease_epoch, e.status, e.cancel_requested
              FROM __schema__.workflow_executions AS e
             WHERE e.id = ANY (ARRAY(SELECT (r->>0)::uuid FROM jsonb_array_elements(p_rows) AS r))
             ORDER BY e.id
               FOR SHARE OF e) AS o;
    -- 2. Write the rows of executions owned under their epoch and not cancelled.
    IF p_if_recorded THEN
        FOR v_key IN
            INSERT INTO __schema__.operation_outputs AS o
                   (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                    started_at, finished_at, tries)
            SELECT (r->>0)::uuid, (r->>2)::integer, r->>3,
                   CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
                   CASE WHEN jsonb_typeof(r->5) = 'array' THEN r->5->0 END,
                   (r->>6)::integer, (r->>1)::integer,
                   __schema__.kestrel_now() - make_interval(secs => (r->>7)::float8),
                   __schema__.kestrel_now() - make_interval(secs => (r->>8)::float8),
                   CASE WHEN jsonb_typeof(r->9) = 'array' THEN r->9 END
              FROM jsonb_array_elements(p_rows) AS r
             WHERE (r->>0) || '/' || (r->>1) = ANY (v_owned)
               AND (r->>0)::uuid = ANY (v_writable)
                ON CONFLICT (execution_id, step_id) DO NOTHING
            RETURNING o.execution_id::text || '/' || o.step_id
        LOOP
            v_new := v_new || v_key;
        END LOOP;
    ELSE
        FOR v_key IN
            INSERT INTO __schema__.operation_outputs AS o
                   (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                    started_at, finished_at, tries)
            SELECT (r->>0)::uuid, (r->>2)::integer, r->>3,
                   CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
                   CASE WHEN jsonb_typeof(r->5) = 'array' THEN r->5->0 END,
                   (r->>6)::integer, (r->>1)::integer,
                   __schema__.kestrel_now() - make_interval(secs => (r->>7)::float8),
                   __schema__.kestrel_now() - make_interval(secs => (r->>8)::float8),
                   CASE WHEN jsonb_typeof(r->9) = 'array' THEN r->9 END
              FROM jsonb_array_elements(p_rows) AS r
             WHERE (r->>0) || '/' || (r->>1) = ANY (v_owned)
               AND (r->>0)::uuid = ANY (v_writable)
            RETURNING o.execution_id::text || '/' || o.step_id
        LOOP
            v_new := v_new || v_key;
        END LOOP;
    END IF;
    -- 3. Per position: owned, written by this call, and for one it did not write the row
    -- recorded first. The plain INSERT above wrote every position it could or failed whole,
    -- so only the ON CONFLICT form looks for rows recorded first (a pseudo-constant join
    -- condition: no probe at all in the other); the worker knows what it wrote.
    RETURN QUERY
    SELECT (r->>0)::uuid, (r->>2)::integer,
           (r->>0) || '/' || (r->>1) = ANY (v_owned),
           (r->>0) || '/' || (r->>2) = ANY (v_new),
           p.step_name, p.output, p.error,
           (r->>0) || '/' || (r->>1) = ANY (v_owned) AND NOT (r->>0)::uuid = ANY (v_writable)
      FROM jsonb_array_elements(p_rows) AS r
      LEFT JOIN __schema__.operation_outputs AS p
             ON p_if_recorded AND NOT ((r->>0) || '/' || (r->>2) = ANY (v_new))
            AND p.execution_id = (r->>0)::uuid AND p.step_id = (r->>2)::integer;
END;
$$;

-- name: move_finished
-- move_finished(): what finishing executions does, as plain statements, for the Citus forms
-- of the statements that finish them (finish_batch(), sweep_expired(), fail_late()): each of
-- p_ids (locked by the caller, in id order with the parents they tell) ends with
-- p_status[i], p_result[i], p_error[i]. Tell each parent that does not finish here, one
-- word per child (child_finished(): its signal, its signal_seq, its wake-up when it waits
-- for that child; a parent no longer live gets none); move the executions to history under
-- p_now, their signals and events after them (archive_finished(); their checkpoints stay
-- where they were written, migration 0019). Plain
-- statements because Citus plans a statement with an INSERT in a CTE CTE by CTE even on the
-- tenant's node (docs/citus.md); on one PostgreSQL those statements stay (one statement is
-- cheaper there).
CREATE OR REPLACE FUNCTION __schema__.move_finished(
    p_ids uuid[], p_status text[], p_result jsonb[], p_error jsonb[], p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_children uuid[];  -- the finishing rows, and their parents (NULL: none)
    v_parents uuid[];
    v_live uuid[];      -- of those parents, the ones still live
BEGIN
    -- Read once, by primary key alone, and only then asked for a parent (the rule for
    -- held rows: see the heartbeat statement; `parent_id IS NOT NULL` in this scan would
    -- read the parent index, every child's entry).
    SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(c.parent_id), '{}')
      INTO v_children, v_parents
      FROM __schema__.workflow_executions AS c
     WHERE c.id = ANY (p_ids);
    SELECT coalesce(array_agg(p.id), '{}') INTO v_live
      FROM __schema__.workflow_executions AS p
     WHERE p.id = ANY (v_parents);
    UPDATE __schema__.workflow_executions AS p
       SET signal_seq = p.signal_seq + t.n,
           wake_at = CASE WHEN p.status = 'waiting' AND p.waiting_for = ANY (t.waits)
                          THEN p_now ELSE p.wake_at END
      FROM (SELECT c.parent_id, count(*) AS n, array_agg('kestrel.child:' || c.id) AS waits
              FROM unnest(v_children, v_parents) AS c(id, parent_id)
             WHERE c.parent_id IS NOT NULL
               AND NOT c.parent_id = ANY (p_ids)
             GROUP BY c.parent_id) AS t
     WHERE p.id = t.parent_id;
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT c.parent_id, 'kestrel.child:' || c.id,
           jsonb_build_object('status', f.status, 'result', f.result, 'error', f.error),
           'kestrel.child:' || c.id
      FROM unnest(v_children, v_parents) AS c(id, parent_id)
      JOIN unnest(p_ids, p_status, p_result, p_error) AS f(id, status, result, error)
        ON f.id = c.id
     WHERE c.parent_id IS NOT NULL
       AND NOT c.parent_id = ANY (p_ids)
       AND c.parent_id = ANY (v_live)  -- (Citus: no correlated subquery beside unnest)
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
    INSERT INTO __schema__.workflow_history
           (id, workflow, queue, priority, status, args, result, error, idempotency_key,
            lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
            app_version, concurrency_key, tags)
    SELECT e.id, e.workflow, e.queue, e.priority, f.status, e.args, f.result, f.error,
           e.idempotency_key, e.lease_epoch, e.attempts, e.created_at, e.started_at, p_now,
           e.parent_id, e.deadline, e.app_version, e.concurrency_key, e.tags
      FROM __schema__.workflow_executions AS e
      JOIN unnest(p_ids, p_status, p_result, p_error) AS f(id, status, result, error)
        ON f.id = e.id;
    INSERT INTO __schema__.signal_history
           (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
            consumed_at, execution_finished_at)
    SELECT id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
           consumed_at, p_now
      FROM __schema__.signals
     WHERE execution_id = ANY (p_ids);
    DELETE FROM __schema__.signals WHERE execution_id = ANY (p_ids);
    INSERT INTO __schema__.event_history
           (execution_id, key, value, updated_at, execution_finished_at)
    SELECT execution_id, key, value, updated_at, p_now
      FROM __schema__.events
     WHERE execution_id = ANY (p_ids);
    DELETE FROM __schema__.events WHERE execution_id = ANY (p_ids);
    DELETE FROM __schema__.workflow_executions WHERE id = ANY (p_ids);
END;
$$;

-- name: finish_batch
-- finish_batch(): complete_batch in its Citus form (sql/queries/executions.sql), as
-- save_steps() is the checkpoint batch's: the worker sends it where its schema is a Citus
-- distributed schema, and there migrate delegates it to the tenant's node, so a batch of
-- completions is one round trip, run there, with no other node in its transaction (the
-- statement is planned CTE by CTE: 15 commands, intermediate results copied to every node,
-- a two-phase commit on each, so a node that is down stalls every tenant's completions).
-- p_rows as complete_batch's: [execution, epoch, status, [result] or null, [error] or null]
-- and the tail's seven fields, or none.
-- In the statement's order: lock the finishing executions and the parents they tell in id
-- order; take those still running under the batch's epoch (the others were fenced); finish
-- them (move_finished()); return their ids. It raises no notification: one raised on the
-- tenant's node would not reach the listeners on the coordinator, so the worker sends
-- notify_done there after it.
CREATE OR REPLACE FUNCTION __schema__.finish_batch(p_rows jsonb)
RETURNS TABLE (id uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_locked uuid[];     -- the rows locked: the batch's and their parents
    v_epochs integer[];  -- their epochs and states, as locked
    v_states text[];
    v_ids uuid[];
    v_status text[];
    v_result jsonb[];
    v_error jsonb[];
BEGIN
    -- Lock every row this call changes, in id order (lock order: see heartbeat).
    -- Each by its primary key, as complete_batch does (an `IN (…)` planned sequential scans).
    -- Which of them still run under the batch's epoch is asked of the locked rows, not of
    -- the table again (the rule for held rows: see the heartbeat statement).
    SELECT coalesce(array_agg(l.id), '{}'), coalesce(array_agg(l.lease_epoch), '{}'),
           coalesce(array_agg(l.status), '{}')
      INTO v_locked, v_epochs, v_states
      FROM (SELECT e.id, e.lease_epoch, e.status
              FROM __schema__.workflow_executions AS e
             WHERE e.id = ANY (ARRAY(SELECT (r->>0)::uuid FROM jsonb_array_elements(p_rows) AS r
                                     UNION
                                     SELECT c.parent_id
                                       FROM __schema__.workflow_executions AS c
                                      WHERE c.id = ANY (ARRAY(SELECT (r->>0)::uuid
                                                                FROM jsonb_array_elements(p_rows)
                                                                  AS r))))
             ORDER BY e.id
               FOR UPDATE OF e) AS l;
    SELECT coalesce(array_agg(l.id), '{}'), array_agg(r->>2),
           array_agg(CASE WHEN jsonb_typeof(r->3) = 'array' THEN r->3->0 END),
           array_agg(CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END)
      INTO v_ids, v_status, v_result, v_error
      FROM unnest(v_locked, v_epochs, v_states) AS l(id, lease_epoch, status)
      JOIN jsonb_array_elements(p_rows) AS r
        ON l.id = (r->>0)::uuid AND l.lease_epoch = (r->>1)::integer
     WHERE l.status = 'running'
       AND NOT EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                        WHERE o.execution_id = l.id AND o.step_id = (r->>5)::integer);
    IF cardinality(v_ids) > 0 THEN
        -- The tails of those finishing (complete_batch: what a tail is, and why one whose
        -- position is recorded already leaves its execution unfinished).
        INSERT INTO __schema__.operation_outputs
               (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                started_at, finished_at, tries)
        SELECT (r->>0)::uuid, (r->>5)::integer, r->>6,
               CASE WHEN jsonb_typeof(r->7) = 'array' THEN r->7->0 END,
               CASE WHEN jsonb_typeof(r->8) = 'array' THEN r->8->0 END,
               (r->>9)::integer, (r->>1)::integer,
               __schema__.kestrel_now() - make_interval(secs => (r->>10)::float8),
               __schema__.kestrel_now() - make_interval(secs => (r->>11)::float8),
               CASE WHEN jsonb_typeof(r->12) = 'array' THEN r->12 END
          FROM jsonb_array_elements(p_rows) AS r
         WHERE (r->>0)::uuid = ANY (v_ids)
           AND r->>5 IS NOT NULL;
        PERFORM __schema__.move_finished(v_ids, v_status, v_result, v_error,
                                         __schema__.kestrel_now());
    END IF;
    RETURN QUERY SELECT unnest(v_ids);
END;
$$;

-- name: sweep_expired
-- sweep_expired(): reenqueue_expired in its Citus form (sql/queries/sweeper.sql), delegated
-- to the tenant's node like finish_batch(): the sweeper's round is then one round trip to
-- that node with no other node in its transaction, where the statement commits in two
-- phases on every node (so a node that is down stalled every tenant's recovery). The same
-- steps: lock up to p_limit running executions whose own lease passed, oldest first, and
-- up to p_limit running under a process whose lease ran out or that has none (migration
-- 0026), skipping rows someone holds; put those with attempts left back in the queue;
-- quarantine the others (move_finished(), a parent told); drop the leases that ran out a
-- day ago and hold nothing. Returns what the statement's caller reads of it: requeued,
-- quarantined, examined.
CREATE OR REPLACE FUNCTION __schema__.sweep_expired(p_limit integer, p_max_attempts integer)
RETURNS TABLE (requeued bigint, quarantined bigint, examined bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := __schema__.kestrel_now();
    v_expired uuid[];
    v_poisoned uuid[];
    v_errors jsonb[];
    v_requeued bigint := 0;
    v_dead text[];
BEGIN
    SELECT coalesce(array_agg(d.owner), '{}') INTO v_dead
      FROM (SELECT l.owner FROM __schema__.leases AS l
             WHERE l.expires_at < v_now
            UNION
            SELECT DISTINCT e.lease_owner FROM __schema__.workflow_executions AS e
             WHERE e.status = 'running' AND e.lease_expires_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM __schema__.leases AS l
                                WHERE l.owner = e.lease_owner)) AS d(owner);
    WITH lapsed AS (
        SELECT e.id, e.attempts
          FROM __schema__.workflow_executions AS e
         WHERE e.status = 'running'
           AND e.lease_expires_at < v_now
         ORDER BY e.lease_expires_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    ), orphaned AS (
        SELECT e.id, e.attempts
          FROM __schema__.workflow_executions AS e
         WHERE e.status = 'running'
           AND e.lease_expires_at IS NULL
           AND e.lease_owner = ANY (v_dead)
           AND cardinality(v_dead) > 0
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    )
    SELECT coalesce(array_agg(x.id), '{}'),
           coalesce(array_agg(x.id) FILTER (WHERE x.attempts >= p_max_attempts), '{}'),
           coalesce(array_agg(jsonb_build_object(
               'type', 'Quarantined',
               'message', format('claimed %s times without finishing (max_attempts = %s): '
                                 'the execution keeps losing its worker',
                                 x.attempts, p_max_attempts)))
               FILTER (WHERE x.attempts >= p_max_attempts), '{}')
      INTO v_expired, v_poisoned, v_errors
      FROM (SELECT * FROM lapsed UNION ALL SELECT * FROM orphaned) AS x;
    UPDATE __schema__.workflow_executions AS e
       SET status = 'queued',
           lease_owner = NULL,
           lease_expires_at = NULL,
           updated_at = v_now
     WHERE e.id = ANY (v_expired)
       AND NOT e.id = ANY (v_poisoned);
    GET DIAGNOSTICS v_requeued = ROW_COUNT;
    IF cardinality(v_poisoned) > 0 THEN
        PERFORM __schema__.move_finished(
            v_poisoned, array_fill('quarantined'::text, ARRAY[cardinality(v_poisoned)]),
            array_fill(NULL::jsonb, ARRAY[cardinality(v_poisoned)]), v_errors, v_now);
    END IF;
    DELETE FROM __schema__.leases AS l
     WHERE l.expires_at < v_now - interval '1 day'
       AND NOT EXISTS (SELECT 1 FROM __schema__.workflow_executions AS e
                        WHERE e.status = 'running' AND e.lease_owner = l.owner);
    RETURN QUERY SELECT v_requeued, cardinality(v_poisoned)::bigint,
                        cardinality(v_expired)::bigint;
END;
$$;

-- name: fail_late
-- fail_late(): expire_deadlines in its Citus form (sql/queries/sweeper.sql), delegated to
-- the tenant's node like sweep_expired(): fail up to p_limit queued and waiting executions
-- whose workflow deadline passed, earliest first, skipping rows someone holds; each leaves
-- a row for the metrics collector (uncounted_finishes); their parents are told
-- (move_finished()). Returns how many it failed.
CREATE OR REPLACE FUNCTION __schema__.fail_late(p_limit integer)
RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := __schema__.kestrel_now();
    v_ids uuid[];
    v_errors jsonb[];
BEGIN
    SELECT coalesce(array_agg(x.id), '{}'),
           coalesce(array_agg(jsonb_build_object(
               'type', 'kestrel.errors.DeadlineExceeded',
               'message', format('workflow deadline %s passed', x.deadline))), '{}')
      INTO v_ids, v_errors
      FROM (SELECT e.id, e.deadline
              FROM __schema__.workflow_executions AS e
             WHERE e.deadline < v_now
               AND e.status IN ('queued', 'waiting')
             ORDER BY e.deadline
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) AS x;
    IF cardinality(v_ids) > 0 THEN
        INSERT INTO __schema__.uncounted_finishes (execution_id, workflow, status, deadline)
        SELECT e.id, e.workflow, 'failed', true
          FROM __schema__.workflow_executions AS e
         WHERE e.id = ANY (v_ids);
        PERFORM __schema__.move_finished(
            v_ids, array_fill('failed'::text, ARRAY[cardinality(v_ids)]),
            array_fill(NULL::jsonb, ARRAY[cardinality(v_ids)]), v_errors, v_now);
    END IF;
    RETURN cardinality(v_ids);
END;
$$;
