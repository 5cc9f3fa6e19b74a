-- The HTTP door (kestrel/http): tokens and the reads of the JSON API. Reads only, apart
-- from the token rows: every change to an execution goes through the SQL functions that the
-- clients and the CLI call (submit, signal, cancel, retry, fork).

-- name: set_statement_timeout
-- The HTTP door's budget (--http-statement-timeout): the time a request has left, sent in front
-- of each of its statements in one pipeline (one round trip, one Sync, one implicit
-- transaction), or first in its transaction; the setting ends with it, so nothing is left on
-- a pooled connection (connections.BudgetConnection). The server ends what waits longer.
SELECT set_config('statement_timeout', %(timeout)s, true);

-- name: create_token
-- Sent again with the same id and hash after a lost reply (the CLI resends), it returns the
-- stored row's time instead of failing: the no-op update only matches our own row.
INSERT INTO __schema__.http_tokens (id, name, scopes, secret_hash)
VALUES (%(id)s, %(name)s, %(scopes)s::text[], %(secret_hash)s)
    ON CONFLICT (id) DO UPDATE SET id = excluded.id
 WHERE http_tokens.secret_hash = excluded.secret_hash
RETURNING created_at;

-- name: list_tokens
SELECT id, name, scopes, created_at, revoked_at
  FROM __schema__.http_tokens
 ORDER BY created_at, id;

-- name: revoke_token
-- By id, or by name when no live token has that id: one live token at most (a key that is
-- one token's id and another's name revokes the token with that id only). Returns the id
-- revoked. Its UI sessions end with it (they are looked up through the live token).
WITH by_id AS (
    UPDATE __schema__.http_tokens
       SET revoked_at = __schema__.kestrel_now()
     WHERE id = %(key)s AND revoked_at IS NULL
    RETURNING id
), by_name AS (
    UPDATE __schema__.http_tokens AS t
       SET revoked_at = __schema__.kestrel_now()
     WHERE t.name = %(key)s AND t.revoked_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM __schema__.http_tokens AS i
                        WHERE i.id = %(key)s AND i.revoked_at IS NULL)
    RETURNING t.id
)
SELECT id FROM by_id
UNION ALL
SELECT id FROM by_name;

-- name: get_token
-- A live token by its public id: its scopes and the hash of its secret.
SELECT name, scopes, secret_hash
  FROM __schema__.http_tokens
 WHERE id = %(id)s AND revoked_at IS NULL;

-- name: live_token
-- Whether token %(token_id)s is live: a login's first statement (create_session follows in
-- the same transaction). A token revoked after it leaves a session that opens nothing:
-- get_session reads through the live token.
SELECT 1 FROM __schema__.http_tokens WHERE id = %(token_id)s AND revoked_at IS NULL;

-- name: create_session
-- A web UI session of a live token (kestrel/http/sessions.py): only the hash of its secret is
-- stored. Expired sessions are deleted on the way (a login is rare; the index finds them).
-- VALUES, not INSERT … SELECT from http_tokens: Citus sends an INSERT … SELECT into a
-- distributed schema's table to the node with an empty qual, `( IS NOT NULL)`, a syntax
-- error there (docs/citus.md); live_token asks first.
WITH expired AS (
    DELETE FROM __schema__.ui_sessions WHERE expires_at < __schema__.kestrel_now()
)
INSERT INTO __schema__.ui_sessions (secret_hash, token_id, expires_at)
VALUES (%(secret_hash)s, %(token_id)s,
        __schema__.kestrel_now() + make_interval(secs => %(ttl_s)s))
RETURNING expires_at;

-- name: get_session
-- A live session: not expired, not ended, and its token not revoked. The token's id, name
-- and scopes (read now, so a changed token changes its sessions at once).
SELECT t.id, t.name, t.scopes
  FROM __schema__.ui_sessions AS s
  JOIN __schema__.http_tokens AS t ON t.id = s.token_id AND t.revoked_at IS NULL
 WHERE s.secret_hash = %(secret_hash)s AND s.expires_at > __schema__.kestrel_now();

-- name: end_session
-- Logout: the session is gone on the server, whatever the browser keeps. Sent again, it
-- deletes nothing and is still done.
DELETE FROM __schema__.ui_sessions WHERE secret_hash = %(secret_hash)s;

-- name: end_token_sessions
-- Log out everywhere: every session of the token is gone, in every browser, while the token
-- itself (and its API callers) goes on. Sent again, it deletes nothing and is still done.
DELETE FROM __schema__.ui_sessions WHERE token_id = %(token_id)s;

-- name: page_executions
-- Newest first, live and finished, filtered (NULL = any), after a keyset cursor
-- (created_at, id): each branch reads its (created_at DESC, id DESC) index and stops after
-- %(limit)s rows, so a page costs the same on the thousandth page as on the first. Running
-- rows have no entry in the hot table's index (a claim would write one, migration 0020):
-- their branch sorts them, a set as small as the work in flight. (One branch over a
-- UNION ALL of both halves of the hot table reads nothing in order: PostgreSQL 15 sorts
-- the whole union.) The filters: sql/fragments/list.sql (a tag filter is a lookup in the
-- tags' GIN index of each table, its few rows then sorted).
SELECT id, workflow, queue, status, attempts, created_at, finished_at, parent_id, app_version,
       lease_epoch, tags
  FROM ((SELECT id, workflow, queue, status, attempts, created_at,
                NULL::timestamptz AS finished_at, parent_id, app_version, lease_epoch, tags
           FROM __schema__.workflow_executions
          WHERE status <> 'running'
            -- include: page_filter
          ORDER BY created_at DESC, id DESC
          LIMIT %(limit)s)
        UNION ALL
        (SELECT id, workflow, queue, status, attempts, created_at,
                NULL::timestamptz AS finished_at, parent_id, app_version, lease_epoch, tags
           FROM __schema__.workflow_executions
          WHERE status = 'running'
            -- include: page_filter
          ORDER BY created_at DESC, id DESC
          LIMIT %(limit)s)
        UNION ALL
        (SELECT id, workflow, queue, status, attempts, created_at, finished_at, parent_id,
                app_version, lease_epoch, tags
           FROM __schema__.workflow_history
          WHERE true
            -- include: page_filter
          ORDER BY created_at DESC, id DESC
          LIMIT %(limit)s)) AS page
 ORDER BY created_at DESC, id DESC
 LIMIT %(limit)s;

-- name: count_executions
-- How many executions, live and finished, page_executions' filters match (a bulk action's
-- --dry-run; its cursor is NULL here).
SELECT (SELECT count(*) FROM __schema__.workflow_executions WHERE true
            -- include: page_filter
        )
     + (SELECT count(*) FROM __schema__.workflow_history WHERE true
            -- include: page_filter
        );

-- name: get_wait
-- What a live execution waits for and until when, its deadline and parent; for a finished
-- one only the parent and deadline it had.
SELECT status, waiting_for, wait_deadline, wake_at, deadline, parent_id, cancel_requested,
       app_version
  FROM __schema__.workflow_executions WHERE id = %(id)s
UNION ALL
SELECT status, NULL, NULL, NULL, deadline, parent_id, false, app_version
  FROM __schema__.workflow_history WHERE id = %(id)s;

-- name: list_events
-- Live or finished (a finished execution's events are in event_history).
SELECT key, value, updated_at
  FROM __schema__.events WHERE execution_id = %(id)s
UNION ALL
SELECT key, value, updated_at
  FROM __schema__.event_history WHERE execution_id = %(id)s
 ORDER BY key;

-- name: pending_signals
-- Signals sent and not consumed yet, oldest first (a child's completion is one too); for a
-- finished execution, those it never consumed (in signal_history).
SELECT id, name, payload, created_at
  FROM (SELECT id, name, payload, created_at FROM __schema__.signals
         WHERE execution_id = %(id)s AND consumed_step IS NULL
        UNION ALL
        SELECT id, name, payload, created_at FROM __schema__.signal_history
         WHERE execution_id = %(id)s AND consumed_step IS NULL) AS s
 ORDER BY id
 LIMIT 1000;

-- name: list_children
SELECT id, workflow, status, created_at, NULL::timestamptz AS finished_at
  FROM __schema__.workflow_executions WHERE parent_id = %(id)s
UNION ALL
SELECT id, workflow, status, created_at, finished_at
  FROM __schema__.workflow_history WHERE parent_id = %(id)s
 ORDER BY created_at, id
 LIMIT 1000;

-- name: list_queue_limits
SELECT queue, concurrency, rate, extract(epoch FROM period), per_key
  FROM __schema__.queue_limits
 ORDER BY queue;

-- name: list_schedules
SELECT name, cron, workflow, last_tick, updated_at
  FROM __schema__.schedules
 ORDER BY name;

-- name: signal_sent
-- Whether a signal with this idempotency key reached the execution: a replay of a request
-- that signalled an execution which has finished since is answered "already delivered".
SELECT EXISTS (SELECT 1 FROM __schema__.signals
                WHERE execution_id = %(id)s AND idempotency_key = %(key)s)
    OR EXISTS (SELECT 1 FROM __schema__.signal_history
                WHERE execution_id = %(id)s AND idempotency_key = %(key)s);

-- name: hook_submit
-- A webhook's execution. Its one argument is the body as the sender signed it, parsed by
-- PostgreSQL alone (never into Python floats and back), or, with an envelope, that object
-- with the body as its "payload"; submit() then applies the rules of every door. The cap is
-- this server's --max-payload-bytes: the subquery sets it for this statement's transaction
-- before submit() checks the arguments (a subquery with a volatile target list is scanned
-- first, never pulled up). Idempotent by the delivery's key like any submit. The request's
-- traceparent and tracestate headers, when given, are the execution's trace context.
SELECT __schema__.submit(%(workflow)s,
                         jsonb_build_array(CASE WHEN h.envelope IS NULL THEN h.arg
                                                ELSE h.envelope || jsonb_build_object(
                                                         'payload', h.arg) END),
                         %(queue)s, 0, %(idempotency_key)s,
                         p_traceparent => %(traceparent)s, p_tracestate => %(tracestate)s)
  FROM (SELECT set_config('kestrel.max_payload_bytes', %(max_bytes)s, true) AS cap,
               %(arg)s::jsonb AS arg, %(envelope)s::jsonb AS envelope) AS h;
