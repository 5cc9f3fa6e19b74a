-- HISTORICAL FUNCTION BODIES: the functions this migration creates were replaced since;
-- sql/functions/functions.sql holds every function as it is now and is applied on every
-- migrate, and sql/schema.sql holds the tables, indexes and views as they are now.
-- 0005: cancel() told parents about cancelled children inside the same statement that
-- deleted them. When the parent was in the cancelled tree too, the notification's UPDATE
-- of the parent row and the statement's own DELETE of it collided ("tuple to be deleted was
-- already modified by an operation triggered by the current command"). Parents are now
-- told in a statement of their own, and only those that are still live.
CREATE OR REPLACE FUNCTION __schema__.cancel(p_execution uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_moved uuid[];
    v_parents uuid[];
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
