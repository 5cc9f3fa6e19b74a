-- 0017: web UI sessions held by the server; submit() takes a start time (issue 26).
--
-- The UI's session cookie was the API token itself: it worked as a bearer token on the API,
-- outlived a logout and expired only in the browser. A login now makes a session row; the
-- cookie holds a random session secret, of which only the SHA-256 is stored (as for
-- tokens). A session lasts until it expires, its logout deletes it, or its token is revoked
-- (the lookup joins the live token, so a revoked token's sessions end at once).
CREATE TABLE __schema__.ui_sessions (
    secret_hash bytea PRIMARY KEY,
    token_id    text NOT NULL REFERENCES __schema__.http_tokens (id),
    created_at  timestamptz NOT NULL DEFAULT __schema__.kestrel_now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX ui_sessions_expires_idx ON __schema__.ui_sessions (expires_at);

-- submit() gains p_start_at (the time before which the execution is not claimed), so that an
-- idempotency key can cover the start time as sent: a client resending the same start time
-- computed another delay each time. The new signature replaces the old one (sql/functions
-- re-creates it after the migrations); calls without it resolve to the new one.
DROP FUNCTION __schema__.submit(text, jsonb, text, integer, text, uuid, uuid, double precision,
                                double precision, text, text);
