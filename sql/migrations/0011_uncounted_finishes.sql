-- 0011: finishes no worker saw (issue 18).
--
-- cancel() moves a queued or waiting execution to history itself, so no worker counts it in
-- kestrel_workflows_finished_total. It leaves a row here instead; the metrics collector of a
-- process that registers the workflow takes rows with DELETE ... RETURNING (SKIP LOCKED), so
-- each is counted once fleet-wide and history stays append-only. Rows of names no live
-- worker registers are dropped after a day.
CREATE TABLE __schema__.uncounted_finishes (
    execution_id uuid PRIMARY KEY,
    workflow     text NOT NULL,
    status       text NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT __schema__.kestrel_now()
);
