-- Kestrel SQL functions, applied by every migrate after the migrations (00_rules.sql says
-- how). This file: What an operator does to executions: cancel (a tree), retry and fork,
-- with what they restore.

-- name: cancel
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
    v_finished_at timestamptz;
    v_try integer;
BEGIN
    -- A second try when the first walk locked nothing: the root's row it waited for may
    -- have been deleted and inserted again by a transaction that cancelled and retried the
    -- execution, invisible to that walk's snapshot (a new statement sees it).
    FOR v_try IN 1..2 LOOP
        LOOP
            WITH RECURSIVE tree AS (
                SELECT id FROM __schema__.workflow_executions WHERE id = p_execution
                UNION
                SELECT e.id FROM __schema__.workflow_executions AS e
                  JOIN tree ON e.parent_id = tree.id
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
        EXIT WHEN cardinality(v_tree) > 0;
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
                lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
                app_version, concurrency_key, tags)
        SELECT id, workflow, queue, priority, 'cancelled', args, NULL,
               jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'),
               idempotency_key, lease_epoch, attempts, created_at, started_at,
               __schema__.kestrel_now(), parent_id, deadline, app_version,
               concurrency_key, tags
          FROM removed
        RETURNING id, parent_id, workflow, finished_at
    ), uncounted AS (
        -- No worker sees these finish: the metrics collector counts them
        -- (take_uncounted_finishes) in kestrel_workflows_finished_total, once per finish
        -- (a row each: cancel, retry, cancel again is two; migrations 0011, 0016).
        INSERT INTO __schema__.uncounted_finishes (execution_id, workflow, status)
        SELECT id, workflow, 'cancelled' FROM moved
    )
    SELECT array_agg(id), array_agg(parent_id), min(finished_at)
      INTO v_moved, v_parents, v_finished_at FROM moved;
    IF v_moved IS NOT NULL THEN
        PERFORM __schema__.child_finished(t.parent, t.child, 'cancelled', NULL,
                    jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'))
           FROM unnest(v_parents, v_moved) AS t(parent, child)
          WHERE t.parent IS NOT NULL;
        PERFORM __schema__.archive_finished(v_moved, v_finished_at);
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

-- name: retry
-- retry(): 0003 brought back every checkpoint without an error, also those recorded after
-- the failed step. A workflow that caught StepFailed and took another branch then found the
-- other branch's checkpoints at positions its re-run reaches by the first branch, and
-- failed with NonDeterminismError (FAULTS X7). Now only the checkpoints before the first
-- failed one are kept (where they were written: migration 0019); the rest are dropped and
-- run again. A child whose parent was
-- cancelled is not brought back (KS009), as submit() would not start it.
--
-- The re-run is a fresh run from the first failed step (FAULTS O1, O2), so what the dropped
-- checkpoints took is given back with them: signals consumed at a dropped position are
-- pending again, patch markers asked at or after it (output {"at": position}) are dropped,
-- and each child's end is delivered again from the child's own record (restore_child_outcomes:
-- a child keeps its id, since its idempotency key is its parent's and the step's). Signals
-- and events come back from history with the execution (archive_finished moved them there).
--
-- With p_idempotency_key (migration 0015), a retry sent again after its reply was lost
-- returns as the first did instead of finding the execution live (KS005): the key is stored
-- with the retry, in the same transaction, and a second call with it changes nothing. A key
-- already used for another operation (a submit, a fork, a retry of another execution)
-- raises KS001.
CREATE OR REPLACE FUNCTION __schema__.retry(p_execution uuid,
                                            p_idempotency_key text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_parent uuid;
    v_cancelling boolean;
    v_cut integer;
    v_children uuid[];
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_workflow text;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
        -- ON CONFLICT waits for a concurrent call with the same key, then sees its row.
        -- The workflow is read first: Citus 13.2.2 sends an INSERT … SELECT from the
        -- executions view with ON CONFLICT to the node with an empty qual, `( IS NOT
        -- NULL)`, a syntax error there (issue 24: a keyed retry failed on every distributed
        -- schema). With no such execution nothing is inserted and FOUND stays false.
        SELECT x.workflow INTO v_workflow FROM __schema__.executions AS x
         WHERE x.id = p_execution;
        IF FOUND THEN
            INSERT INTO __schema__.idempotency_keys
                   (idempotency_key, execution_id, workflow, args_digest)
            VALUES (p_idempotency_key, p_execution, v_workflow, md5('retry:' || p_execution))
            ON CONFLICT (idempotency_key) DO NOTHING;
        END IF;
        IF NOT FOUND THEN
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF FOUND THEN
                IF v_existing.execution_id <> p_execution
                        OR v_existing.args_digest <> md5('retry:' || p_execution) THEN
                    RAISE EXCEPTION 'idempotency key % is already used by another operation (execution %)',
                        p_idempotency_key, v_existing.execution_id USING ERRCODE = 'KS001';
                END IF;
                RETURN;  -- retried under this key already (its reply may have been lost)
            END IF;
            -- No such execution: KS003 below.
        END IF;
    END IF;
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
            started_at, parent_id, app_version, concurrency_key, tags)
    SELECT id, workflow, queue, priority, args, idempotency_key, lease_epoch, created_at,
           started_at, parent_id, app_version, concurrency_key, tags
      FROM removed;
    IF FOUND THEN
        -- The first failed step's position: it and everything after it runs again.
        SELECT coalesce(min(o.step_id), 2147483647) INTO v_cut
          FROM __schema__.operation_outputs AS o
         WHERE o.execution_id = p_execution AND o.step_id >= 0 AND o.error IS NOT NULL;
        -- The checkpoints stay where they were written (migration 0019); those from the
        -- first failure on go.
        DELETE FROM __schema__.operation_outputs AS o
         WHERE o.execution_id = p_execution
           AND NOT CASE WHEN o.step_id >= 0 THEN o.step_id < v_cut
                        ELSE __schema__.marker_position(o.output) < v_cut END;
        WITH back AS (
            DELETE FROM __schema__.signal_history AS s
             WHERE s.execution_id = p_execution
         RETURNING s.*
        )
        INSERT INTO __schema__.signals
               (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
                consumed_at)
        SELECT id, execution_id, name, payload, idempotency_key, created_at,
               CASE WHEN consumed_step < v_cut THEN consumed_step END,
               CASE WHEN consumed_step < v_cut THEN consumed_at END
          FROM back;
        WITH back AS (
            DELETE FROM __schema__.event_history AS v
             WHERE v.execution_id = p_execution
         RETURNING v.*
        )
        INSERT INTO __schema__.events (execution_id, key, value, updated_at)
        SELECT execution_id, key, value, updated_at FROM back;
        SELECT array_agg(c.id) INTO v_children
          FROM (SELECT id FROM __schema__.workflow_executions WHERE parent_id = p_execution
                UNION ALL
                SELECT id FROM __schema__.workflow_history WHERE parent_id = p_execution) AS c;
        IF v_children IS NOT NULL THEN
            PERFORM __schema__.restore_child_outcomes(p_execution, v_children);
        END IF;
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

-- name: marker_position
-- The step position a patch marker (a checkpoint at a negative id, output {"at": position})
-- was recorded at: the first position whose re-run may ask the patch again. A marker of an
-- unexpected form counts as recorded at 0, so whatever reruns drops it (the re-run asks
-- again and records it again).
CREATE OR REPLACE FUNCTION __schema__.marker_position(p_output jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(p_output -> 'at') = 'number'
                 AND (p_output ->> 'at') ~ '^[0-9]{1,9}$'
                THEN (p_output ->> 'at')::integer ELSE 0 END
$$;

-- name: restore_child_outcomes
-- Deliver again to p_execution the ends of its children p_children that no checkpoint it
-- keeps has consumed, from each child's own record: a retried or forked execution is told
-- every child's end, however the first delivery went (consumed by a dropped wait, never made
-- because the parent had left the hot table in the same statement, or stale because the
-- child was retried since). A pending signal of a child that is live again is dropped: the
-- child tells its parent when it ends (child_finished). A child found nowhere (its history
-- dropped by retention) keeps whatever signal there is.
CREATE OR REPLACE FUNCTION __schema__.restore_child_outcomes(
    p_execution uuid, p_children uuid[]
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM __schema__.signals AS s
     USING __schema__.workflow_executions AS c
     WHERE c.id = ANY (p_children)
       AND s.execution_id = p_execution
       AND s.idempotency_key = 'kestrel.child:' || c.id
       AND s.consumed_step IS NULL;
    UPDATE __schema__.signals AS s
       SET payload = jsonb_build_object('status', h.status, 'result', h.result,
                                        'error', h.error)
      FROM __schema__.workflow_history AS h
     WHERE h.id = ANY (p_children)
       AND s.execution_id = p_execution
       AND s.idempotency_key = 'kestrel.child:' || h.id
       AND s.consumed_step IS NULL;
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT p_execution, 'kestrel.child:' || h.id,
           jsonb_build_object('status', h.status, 'result', h.result, 'error', h.error),
           'kestrel.child:' || h.id
      FROM __schema__.workflow_history AS h
     WHERE h.id = ANY (p_children)
     ORDER BY h.finished_at, h.id
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
END
$$;

-- name: fork
-- fork(): a new execution that replays the original's first p_from_step positions and runs
-- the rest afresh (FAULTS O3). It copies every checkpoint below the position, recorded errors
-- included (a caught failure is part of the history the copied branch depends on, as retry
-- keeps it), and the patch markers asked before it. What the copy needs from outside comes
-- with it: each child started below the position whose end no copied checkpoint consumed is
-- told to the fork from the child's record; a child still running is refused (KS005, naming
-- the step): its end reaches the original only. The original's signals not consumed below the
-- position are copied as pending, in their order (the fork re-runs the waits that took
-- them), and its events are rebuilt from the set_event checkpoints below the position (which
-- record the value; older ones, without it, are skipped). The position may be at most one
-- past the last recorded one (or the wait the original is parked at): beyond is refused
-- (KS002). The new execution's source is recorded in forks. p_id, the fork's id when the
-- caller chooses it, makes the call idempotent: sent again after a lost reply, it returns
-- the fork it made (KS001 if that id forked something else).
-- p_idempotency_key (migration 0015) does the same for a key the caller names: the
-- same key returns the fork the first call made (KS001 when it names another operation).
CREATE OR REPLACE FUNCTION __schema__.fork(
    p_execution uuid, p_from_step integer, p_id uuid DEFAULT NULL,
    p_idempotency_key text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_new uuid := coalesce(p_id, __schema__.new_execution_id());
    v_src __schema__.executions%ROWTYPE;
    v_last integer;
    v_child record;
    v_children uuid[];
    v_made __schema__.forks%ROWTYPE;
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_event_keys text[];
    v_event_values jsonb[];
    v_key text;
    v_tags jsonb;
BEGIN
    IF p_id IS NOT NULL THEN
        PERFORM __schema__.check_bucket_id(p_id);
    END IF;
    IF p_from_step IS NULL OR p_from_step < 0 THEN
        RAISE EXCEPTION 'from_step must not be negative' USING ERRCODE = 'KS002';
    END IF;
    SELECT * INTO v_made FROM __schema__.forks WHERE id = v_new;
    IF FOUND THEN
        IF (v_made.forked_from, v_made.from_step) = (p_execution, p_from_step) THEN
            RETURN v_new;
        END IF;
        RAISE EXCEPTION 'fork id % is already used by the fork of % from step %', v_new,
            v_made.forked_from, v_made.from_step USING ERRCODE = 'KS001';
    END IF;
    SELECT * INTO v_src FROM __schema__.executions WHERE id = p_execution;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    SELECT greatest(max(s.step_id), (SELECT e.wait_step FROM __schema__.workflow_executions AS e
                                      WHERE e.id = p_execution AND e.status = 'waiting'))
      INTO v_last
      FROM __schema__.workflow_steps AS s
     WHERE s.execution_id = p_execution AND s.step_id >= 0;
    IF p_from_step > coalesce(v_last, -1) + 1 THEN
        RAISE EXCEPTION 'cannot fork execution % from step %: it has recorded positions up to %, so a fork may start at step % at most',
            p_execution, p_from_step, coalesce(v_last, -1), coalesce(v_last, -1) + 1
            USING ERRCODE = 'KS002';
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
        INSERT INTO __schema__.idempotency_keys
               (idempotency_key, execution_id, workflow, args_digest)
        VALUES (p_idempotency_key, v_new, v_src.workflow,
                md5('fork:' || p_execution || ':' || p_from_step))
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF NOT FOUND THEN
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF v_existing.args_digest <> md5('fork:' || p_execution || ':' || p_from_step) THEN
                RAISE EXCEPTION 'idempotency key % is already used by another operation (execution %)',
                    p_idempotency_key, v_existing.execution_id USING ERRCODE = 'KS001';
            END IF;
            RETURN v_existing.execution_id;  -- forked under this key already
        END IF;
    END IF;
    -- Children started below the position whose end no copied checkpoint consumed.
    FOR v_child IN
        SELECT k.step_id, k.id, h.id IS NOT NULL AS ended
          FROM (SELECT s.step_id,
                       CASE WHEN s.output #>> '{}' ~ '^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$'
                            THEN (s.output #>> '{}')::uuid END AS id
                  FROM __schema__.workflow_steps AS s
                 WHERE s.execution_id = p_execution AND s.step_id >= 0
                   AND s.step_id < p_from_step
                   AND s.step_name LIKE 'kestrel.start_child:%' AND s.error IS NULL
                   AND jsonb_typeof(s.output) = 'string') AS k
          LEFT JOIN __schema__.workflow_history AS h ON h.id = k.id
         WHERE k.id IS NOT NULL
           AND NOT EXISTS (
                SELECT 1 FROM __schema__.workflow_steps AS w
                 WHERE w.execution_id = p_execution AND w.step_id >= 0
                   AND w.step_id < p_from_step
                   AND w.step_name = 'kestrel.signal:kestrel.child:' || k.id)
         ORDER BY k.step_id
    LOOP
        IF NOT v_child.ended THEN
            RAISE EXCEPTION 'cannot fork execution % from step %: step % started child %, which has not ended (or is no longer recorded); its end would reach % only. Fork once it has ended, or from step % or before',
                p_execution, p_from_step, v_child.step_id, v_child.id, p_execution,
                v_child.step_id USING ERRCODE = 'KS005';
        END IF;
        v_children := v_children || v_child.id;
    END LOOP;
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
            finished_at, tries)
    SELECT v_new, step_id, step_name, output, error, attempt, 0, started_at, finished_at,
           tries
      FROM __schema__.workflow_steps
     WHERE execution_id = p_execution
       AND CASE WHEN step_id >= 0 THEN step_id < p_from_step
                ELSE __schema__.marker_position(output) < p_from_step END;
    -- The fork keeps the original's concurrency key and tags (not in the executions view:
    -- read from whichever table holds it).
    SELECT k.concurrency_key, k.tags INTO v_key, v_tags
      FROM (SELECT e.concurrency_key, e.tags FROM __schema__.workflow_executions AS e
             WHERE e.id = p_execution
            UNION ALL
            SELECT h.concurrency_key, h.tags FROM __schema__.workflow_history AS h
             WHERE h.id = p_execution) AS k;
    INSERT INTO __schema__.workflow_executions
           (id, workflow, queue, priority, args, idempotency_key, concurrency_key, tags)
    VALUES (v_new, v_src.workflow, v_src.queue, v_src.priority, v_src.args, p_idempotency_key,
            v_key, v_tags);
    INSERT INTO __schema__.forks (id, forked_from, from_step)
    VALUES (v_new, p_execution, p_from_step);
    -- The original's inputs from the position on, as the fork's pending signals.
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key, created_at)
    SELECT v_new, s.name, s.payload, s.idempotency_key, s.created_at
      FROM (SELECT id, name, payload, idempotency_key, created_at, consumed_step
              FROM __schema__.signals WHERE execution_id = p_execution
            UNION ALL
            SELECT id, name, payload, idempotency_key, created_at, consumed_step
              FROM __schema__.signal_history WHERE execution_id = p_execution) AS s
     WHERE s.name NOT LIKE 'kestrel.child:%'
       AND (s.consumed_step IS NULL OR s.consumed_step >= p_from_step)
     ORDER BY s.id;
    IF v_children IS NOT NULL THEN
        PERFORM __schema__.restore_child_outcomes(v_new, v_children);
    END IF;
    -- Read, then written from the arrays: Citus 13.2.2 sends this INSERT … SELECT from the
    -- workflow_steps view to the node with an empty qual, `( IS NOT NULL)`, a syntax error
    -- there (issue 24: fork failed on every distributed schema).
    SELECT array_agg(e.key), array_agg(e.value) INTO v_event_keys, v_event_values
      FROM (SELECT DISTINCT ON (s.step_name)
                   substr(s.step_name, length('kestrel.set_event:') + 1) AS key,
                   s.output -> 'value' AS value
              FROM __schema__.workflow_steps AS s
             WHERE s.execution_id = p_execution AND s.step_id >= 0 AND s.step_id < p_from_step
               AND s.step_name LIKE 'kestrel.set_event:%' AND s.error IS NULL
               AND jsonb_typeof(s.output) = 'object' AND s.output ? 'value'
             ORDER BY s.step_name, s.step_id DESC) AS e;
    IF v_event_keys IS NOT NULL THEN
        INSERT INTO __schema__.events (execution_id, key, value)
        SELECT v_new, u.key, u.value
          FROM unnest(v_event_keys, v_event_values) AS u(key, value);
    END IF;
    PERFORM pg_notify('kestrel.__schema_name__', v_src.queue);
    RETURN v_new;
END
$$;
