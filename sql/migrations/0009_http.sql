-- 0009: the HTTP door (kestrel-runtime serve): API tokens, and indexes for its reads.

-- Bearer tokens of the HTTP API. The token itself is never stored: only the SHA-256 of its
-- secret part, compared in constant time by the server (kestrel/http/auth.py). A token is
-- found by its public id (the part before the secret), so a lookup never depends on the
-- secret. Revoked rows stay for the record; a name is unique among live tokens.
CREATE TABLE __schema__.http_tokens (
    id          text PRIMARY KEY,
    name        text NOT NULL,
    scopes      text[] NOT NULL
                CHECK (scopes <@ ARRAY['read', 'operate', 'submit']::text[]
                       AND cardinality(scopes) > 0),
    secret_hash bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    revoked_at  timestamptz
);
CREATE UNIQUE INDEX http_tokens_live_name_idx ON __schema__.http_tokens (name)
    WHERE revoked_at IS NULL;

-- Keyset paging over history, newest first: (created_at, id) < cursor, in index order.
CREATE INDEX workflow_history_created_idx
    ON __schema__.workflow_history (created_at DESC, id DESC);
-- An execution page lists its children, finished ones included.
CREATE INDEX workflow_history_parent_idx
    ON __schema__.workflow_history (parent_id)
    WHERE parent_id IS NOT NULL;
-- The hot queue is small, but its page of the list is read in the same order.
CREATE INDEX workflow_executions_created_idx
    ON __schema__.workflow_executions (created_at DESC, id DESC);
