-- 0024: debounce (issue 42, item 2): "re-index this document once, after the edits stop".
--
-- submit() gains p_debounce_key, p_debounce_s and p_debounce_max_s. The first submit of a
-- key in a queue starts an execution that waits p_debounce_s before it may be claimed; each
-- later submit of the key while that one has not started replaces its arguments and pushes
-- its start back to p_debounce_s from now, at most p_debounce_max_s after the first submit
-- (a stream of submits that never stops still runs). Once it has started, the next submit
-- of the key starts the next one. The caller always gets the id that will run.
--
-- One row per (queue, key) names the pending execution and when its first submit came.
-- Concurrent submits of a key take turns on that row (the INSERT … ON CONFLICT, then FOR
-- UPDATE); the pending execution's row is changed only while it has never been claimed
-- (lease_epoch = 0, status waiting), which a claim in flight decides either way: the claim
-- skips the row this submit holds, or this submit waits for the claim and sees it started.
-- Nothing of the hot path reads the table. A key's row outlives its execution and is
-- replaced by the key's next submit; upkeep drops those older than the retention.
CREATE TABLE __schema__.debounces (
    queue text NOT NULL,
    debounce_key text NOT NULL,
    execution_id uuid NOT NULL,
    first_at timestamptz NOT NULL,
    PRIMARY KEY (queue, debounce_key)
);

-- The new signature replaces the old one (sql/functions re-creates it after the migrations).
DROP FUNCTION IF EXISTS __schema__.submit(text, jsonb, text, integer, text, uuid, uuid,
                                          double precision, double precision, text, text,
                                          timestamptz, text, text);
