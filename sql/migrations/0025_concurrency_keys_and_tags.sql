-- 0025: concurrency keys and tags (issue 42, items 1 and 3).
--
-- Concurrency keys: `kestrel.queue("deploys", concurrency=5, per_key=1)` and
-- `submit(…, concurrency_key="svc-a")`: at most per_key of a key run at once, the queue's
-- limit overall, and the keys take turns. A keyed queue is a limited queue: its claims go
-- one at a time through the queue's row (as every limited claim does), which also keeps the
-- rotation's place (key_turn: the key the last claim ended on; the next starts after it).
-- The claim walks the queued keys from there through their own index, one probe per key,
-- so a key with ten thousand queued costs what a key with one does. The index holds only
-- rows that carry a key: a submit without one writes nothing more than before.
ALTER TABLE __schema__.queue_limits
    ADD COLUMN per_key integer,
    ADD COLUMN key_turn text;
-- (Named, and apart: Citus refuses a column added with an unnamed constraint.)
ALTER TABLE __schema__.queue_limits
    ADD CONSTRAINT queue_limits_per_key_check CHECK (per_key > 0);

ALTER TABLE __schema__.workflow_executions
    ADD COLUMN concurrency_key text,
    -- Tags: {"customer": "acme", "env": "prod"}, text to text (check_tags), NULL when none.
    ADD COLUMN tags jsonb;

CREATE INDEX workflow_executions_key_claim_idx ON __schema__.workflow_executions
    (queue, concurrency_key, priority DESC, created_at)
    WHERE status = 'queued' AND concurrency_key IS NOT NULL;

-- A filter by tag (`list --tag customer=acme`: tags @> '{"customer": "acme"}') is a lookup
-- in these, live and in history; rows without tags are in neither.
CREATE INDEX workflow_executions_tags_idx ON __schema__.workflow_executions
    USING gin (tags jsonb_path_ops) WHERE tags IS NOT NULL;

ALTER TABLE __schema__.workflow_history
    ADD COLUMN concurrency_key text,
    ADD COLUMN tags jsonb;

CREATE INDEX workflow_history_tags_idx ON __schema__.workflow_history
    USING gin (tags jsonb_path_ops) WHERE tags IS NOT NULL;

-- The new signature replaces the old one (sql/functions re-creates it after the migrations).
DROP FUNCTION IF EXISTS __schema__.submit(text, jsonb, text, integer, text, uuid, uuid,
                                          double precision, double precision, text, text,
                                          timestamptz, text, text, text, double precision,
                                          double precision);
