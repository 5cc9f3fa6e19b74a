-- 0018: an execution carries the trace context of whoever submitted it (issue 27, traces).
--
-- A worker that claims an execution continues the submitter's OpenTelemetry trace: a span
-- per attempt and per step, on whichever worker runs it, as children of the span that
-- submitted it. The context travels in the row as the W3C trace context headers
-- (https://www.w3.org/TR/trace-context/): traceparent (version 00 only, lowercase hex, as
-- the recommendation writes it) and tracestate (at most 512 characters). submit() takes
-- both, stores them only when they are well formed (a malformed one is ignored, never
-- stored, never an error: trace context is advisory), and a child inherits its parent's
-- when its submitter gives none. The checks below only back up submit()'s: nothing else
-- writes these columns. NULL (most rows, and every row from before) means no trace.
--
-- The columns stay on the hot row only: the claim reads them; history does not keep them.
--
-- Each constraint named and added by an ALTER TABLE of its own (the same schema as one
-- ALTER TABLE made): Citus runs an ADD CONSTRAINT only so (issue 24).
ALTER TABLE __schema__.workflow_executions
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate text;
ALTER TABLE __schema__.workflow_executions
    ADD CONSTRAINT workflow_executions_traceparent_check
        CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$');
ALTER TABLE __schema__.workflow_executions
    ADD CONSTRAINT workflow_executions_tracestate_check
        CHECK (tracestate IS NULL OR (traceparent IS NOT NULL
                                      AND char_length(tracestate) <= 512));

-- submit() gains p_traceparent and p_tracestate (last, with defaults). The new signature
-- replaces the old one (sql/functions re-creates it after the migrations); calls without
-- them, positional or named, resolve to the new one. IF EXISTS: on a new schema the
-- migrations run before any function of sql/functions exists.
DROP FUNCTION IF EXISTS __schema__.submit(text, jsonb, text, integer, text, uuid, uuid, double precision,
                                double precision, text, text, timestamptz);
