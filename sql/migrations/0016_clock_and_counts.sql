-- 0016: production time is now(); every finish no worker saw is counted once per finish,
-- deadline failures included (issue 22).

-- Finishes no worker saw (migration 0011) are keyed per finish, not per execution: cancel,
-- retry and cancel again are two cancellations, and the second must not be dropped as a
-- duplicate of the first while that one waits for the collector. `deadline` marks the
-- executions the sweeper failed past their workflow deadline (expire_deadlines), counted in
-- kestrel_deadlines_exceeded_total as well as in kestrel_workflows_finished_total.
--
-- The table is made anew with the new columns and its rows copied (the same table, columns
-- in the same order, as ADD COLUMNs would leave it, ids given in the rows' order): Citus
-- gives a table an identity column only in its CREATE TABLE (issue 24).
ALTER TABLE __schema__.uncounted_finishes DROP CONSTRAINT uncounted_finishes_pkey;
ALTER TABLE __schema__.uncounted_finishes RENAME TO uncounted_finishes_before_0016;
CREATE TABLE __schema__.uncounted_finishes (
    execution_id uuid NOT NULL,
    workflow     text NOT NULL,
    status       text NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    finish_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    deadline     boolean NOT NULL DEFAULT false,
    -- Which collector took a row and when (take_uncounted_finishes): a row stays until the
    -- collector that counted it says so in its next round, so a take whose reply was lost
    -- is taken again by the same collector, never dropped uncounted (FAULTS R1).
    taken_by     text,
    taken_at     timestamptz
);
INSERT INTO __schema__.uncounted_finishes (execution_id, workflow, status, finished_at)
SELECT execution_id, workflow, status, finished_at
FROM __schema__.uncounted_finishes_before_0016 ORDER BY finished_at, execution_id;
DROP TABLE __schema__.uncounted_finishes_before_0016;

-- The clock. kestrel_now() was now() plus a one-row table read by a sub-select: never
-- inlined (about 20 times the cost of now() per call), and a runtime role with DML on the
-- schema could move time, or delete the row. A production schema drops the table and its
-- kestrel_now() is `SELECT now()` (sql/functions), inlined into every statement. A schema
-- made for tests (kestrel.migrate.migrate(..., test_clock=True), as kestrel.testing and the
-- test suite make theirs) keeps the table, and there kestrel_now() is now() plus a constant
-- that a trigger on the table rewrites whenever a test moves the clock (sql/testclock): no
-- kestrel_now() reads a table. The table is the durable record of which kind a schema is, so
-- every later migrate keeps it. migrate() says which kind it makes in kestrel.test_clock, a
-- setting local to its transaction.
DO $$
BEGIN
    IF coalesce(current_setting('kestrel.test_clock', true), '') <> 'on' THEN
        DROP TABLE __schema__.clock_offset;
    END IF;
END
$$;
