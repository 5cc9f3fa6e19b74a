-- 0014: give-backs that back off, are counted and are visible (issue 22, FAULTS O5).
--
-- A worker whose code is older than an execution's history (a patch marker it does not know:
-- CodeTooOld) gives the execution back instead of running it down the old path. Before this,
-- the give-back re-queued it at once and the same old worker claimed it again, for ever.
-- Now the give-back parks the row as 'waiting' with wake_at pushed out by a backoff that
-- grows with its count (the claim reads waiting rows through workflow_executions_wake_idx
-- in wake_at order, so a row not yet due costs no claim anything), and records which app
-- versions gave it back: their claims skip it; a worker of any other version takes it.
--
--   give_backs     how many times a worker gave this execution back (never reset while live)
--   given_back_by  the app versions that gave it back (NULL: none); each once
--   given_back_at  when it was last given back; cleared by the next claim, so it is set
--                  exactly while the row waits for a worker of another version
ALTER TABLE __schema__.workflow_executions
    ADD COLUMN give_backs integer NOT NULL DEFAULT 0,
    ADD COLUMN given_back_by text[],
    ADD COLUMN given_back_at timestamptz;

-- Unclaimable now also means: every live worker that registers the workflow and queue runs
-- a version that gave the execution back (a rollback left only old workers). The view gains
-- given_back_by (appended: CREATE OR REPLACE VIEW may only add columns at the end).
CREATE OR REPLACE VIEW __schema__.unclaimable AS
SELECT e.id, e.workflow, e.queue, e.status, e.created_at, e.app_version, e.given_back_by
  FROM __schema__.workflow_executions AS e
 WHERE e.status IN ('queued', 'waiting')
   AND NOT EXISTS (
        -- The live (workflow, queue) pairs as rows, hashed once (see 0010); the version
        -- test is a join filter on the few rows that were given back.
        SELECT 1 FROM __schema__.workers AS w, unnest(w.workflows) AS wf, unnest(w.queues) AS wq
         WHERE w.seen_at + w.stale_after > __schema__.kestrel_now()
           AND wf = e.workflow
           AND wq = e.queue
           AND (e.given_back_by IS NULL OR w.app_version <> ALL (e.given_back_by)));
