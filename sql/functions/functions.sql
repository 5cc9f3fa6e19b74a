-- Every kestrel SQL function as it is now: the one place to read or change one.
--
-- `kestrel-runtime migrate` applies this file after the migrations, every time (CREATE OR
-- REPLACE), so a change to a function is made here and needs no migration. Migrations only
-- change tables, indexes and views — and DROP a function whose signature or return type
-- changes (CREATE OR REPLACE cannot change those; it would add an overload instead).
-- tests/integration/test_schema.py checks that the schema holds exactly the functions
-- defined here and in sql/partitions.

-- name: kestrel_functions_version
-- The version of these functions that code relies on: raised here when a function changes
-- so that code calling it depends on the change (2: finish_batch() writes the completion's
-- tail, issue 23; 3: save_steps() and finish_batch() keep a step's failed tries, issue
-- 42; 4: submit() debounces, issue 42; 5: submit() takes a concurrency key and tags, and
-- history keeps them, issue 42). migrate installs it with the rest, every time; a
-- runtime role that may not migrate checks it at boot (boot.check_schema_current) as it
-- checks the migration:
-- functions older than its code needs refuse the boot (a call would silently do the old
-- thing), newer ones serve it (a function keeps serving code one version older). The number
-- is read from this text by kestrel.sql.functions_version(): this is its one home.
CREATE OR REPLACE FUNCTION __schema__.kestrel_functions_version() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 5
$$;

-- name: kestrel_now
-- The database clock: every lease, timer and sleep decision reads it, never a worker's
-- clock (DESIGN §2.5). Plain now(), inlined into every statement that calls it; nothing the
-- runtime role may write can move it. A schema made for tests replaces it with now() plus
-- an offset the tests move (sql/testclock, migration 0016).
CREATE OR REPLACE FUNCTION __schema__.kestrel_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT now()
$$;

-- name: kestrel_bucket
-- The bucket this schema is of a namespace spread over several schemas (kestrel.buckets), or
-- NULL for an ordinary schema. migrate replaces it, in a bucket's schema, with one that
-- returns the number the schema's bucket table records (an immutable constant, so every
-- statement inlines it and no statement reads a table for it).
CREATE OR REPLACE FUNCTION __schema__.kestrel_bucket() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT NULL::integer
$$;

-- name: check_bucket_id
-- An id a caller chose for a new execution (p_id of submit and fork) in a bucket's schema
-- must name that bucket in its eighth byte, as every id kestrel makes does
-- (kestrel.buckets.with_bucket): it is how every later call finds the execution. Refused
-- before anything is written; nothing to check in an ordinary schema.
CREATE OR REPLACE FUNCTION __schema__.check_bucket_id(p_id uuid) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    IF p_id IS NOT NULL AND __schema__.kestrel_bucket() IS NOT NULL
            AND get_byte(uuid_send(p_id), 7) <> __schema__.kestrel_bucket() THEN
        RAISE EXCEPTION 'execution id % names bucket % in its eighth byte, and this schema is bucket %; make it with kestrel.buckets.with_bucket',
            p_id, get_byte(uuid_send(p_id), 7), __schema__.kestrel_bucket()
            USING ERRCODE = 'KS002';
    END IF;
END
$$;

-- name: new_execution_id
-- A new execution's id: a UUIDv7 (RFC 9562) of the database clock, its first 48 bits the
-- milliseconds since 1970, the rest random but, in a bucket's schema, its eighth byte: the
-- bucket (kestrel_bucket()), which is how any id says which schema holds its execution.
-- operation_outputs is range-partitioned by execution id (migration 0019), so a period's
-- executions keep their checkpoints in that period's partition; kestrel.ids.new_id() makes
-- the same ids in Python.
CREATE OR REPLACE FUNCTION __schema__.new_execution_id() RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT encode(set_byte(set_byte(r.b, 6, (get_byte(r.b, 6) & 15) | 112), 7,
                           coalesce(__schema__.kestrel_bucket(), get_byte(r.b, 7))),
                  'hex')::uuid
      FROM (SELECT overlay(uuid_send(gen_random_uuid())
                           PLACING substring(int8send(floor(extract(epoch FROM
                               __schema__.kestrel_now()) * 1000)::bigint) FROM 3)
                           FROM 1 FOR 6) AS b) AS r
$$;

-- name: execution_id_at
-- The smallest UUIDv7 of the millisecond at p_at: the bound of a partition of
-- operation_outputs that starts at p_at.
CREATE OR REPLACE FUNCTION __schema__.execution_id_at(p_at timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM p_at) * 1000)::bigint), 12, '0')
            || repeat('0', 20))::uuid
$$;

-- name: check_name
-- A name or key: 1-1024 characters and at most 2048 bytes of UTF-8 (codec.check_text). The
-- byte bound keeps every indexed name (history by workflow, pending signals by name, events
-- by key, idempotency and dedup keys) inside a btree entry (2704 bytes), so no name can be
-- accepted at the door and fail later in a worker's batch. NUL and invalid UTF-8 cannot
-- reach a text value in PostgreSQL at all.
CREATE OR REPLACE FUNCTION __schema__.check_name(p_value text, p_what text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF p_value IS NULL OR p_value = '' THEN
        RAISE EXCEPTION '% must not be empty', p_what USING ERRCODE = 'KS007';
    END IF;
    IF char_length(p_value) > 1024 THEN
        RAISE EXCEPTION '% is % characters, over the limit of 1024', p_what,
            char_length(p_value) USING ERRCODE = 'KS007';
    END IF;
    IF octet_length(p_value) > 2048 THEN
        RAISE EXCEPTION '% is % bytes as UTF-8, over the limit of 2048', p_what,
            octet_length(p_value) USING ERRCODE = 'KS007';
    END IF;
END
$$;

-- name: valid_queue_name
-- The queue rule of kestrel.config.QUEUE_NAME: 1-128 of A-Z a-z 0-9 _ . : -
CREATE OR REPLACE FUNCTION __schema__.valid_queue_name(p_queue text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT p_queue IS NOT NULL AND p_queue ~ '^[A-Za-z0-9_.:-]{1,128}$'
$$;

-- name: check_tags
-- An execution's tags (migration 0025): a JSON object of at most 32 tags, each name 1-64 of
-- A-Z a-z 0-9 _ . - and each value a string of 1-256 characters; NULL is no tags. The rule
-- of kestrel.codec.check_tags, checked again here for the callers of submit() in SQL.
CREATE OR REPLACE FUNCTION __schema__.check_tags(p_tags jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_key text;
    v_value jsonb;
    v_n integer := 0;
BEGIN
    IF p_tags IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_tags) <> 'object' THEN
        RAISE EXCEPTION 'tags must be a JSON object of names to text, got %', jsonb_typeof(p_tags)
            USING ERRCODE = 'KS002';
    END IF;
    FOR v_key, v_value IN SELECT * FROM jsonb_each(p_tags) LOOP
        v_n := v_n + 1;
        IF v_n > 32 THEN
            RAISE EXCEPTION 'at most 32 tags, got %', (SELECT count(*) FROM jsonb_object_keys(p_tags))
                USING ERRCODE = 'KS002';
        END IF;
        IF v_key !~ '^[A-Za-z0-9_.-]{1,64}$' THEN
            RAISE EXCEPTION 'invalid tag name %: 1-64 of A-Z a-z 0-9 _ . -',
                quote_literal(left(v_key, 80)) USING ERRCODE = 'KS002';
        END IF;
        IF jsonb_typeof(v_value) <> 'string' OR char_length(v_value #>> '{}') NOT BETWEEN 1 AND 256 THEN
            RAISE EXCEPTION 'tag % must be text of 1-256 characters', v_key USING ERRCODE = 'KS002';
        END IF;
    END LOOP;
END
$$;

-- name: merge_tags
-- An execution's tags after ctx.set_tags(p_changes): p_changes merged into p_tags, a JSON
-- null removing its tag; the result must keep the rule of check_tags (KS002 otherwise, the
-- tags unchanged) and is NULL when no tag is left (the GIN indexes hold no row without
-- tags). Merging the same changes again gives the same tags: a replay sets them harmlessly.
CREATE OR REPLACE FUNCTION __schema__.merge_tags(p_tags jsonb, p_changes jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_merged jsonb;
BEGIN
    IF p_changes IS NULL OR jsonb_typeof(p_changes) <> 'object' THEN
        RAISE EXCEPTION 'tag changes must be a JSON object of names to text or null'
            USING ERRCODE = 'KS002';
    END IF;
    -- Tag values are strings, so stripping nulls only drops the removed tags.
    v_merged := jsonb_strip_nulls(coalesce(p_tags, '{}'::jsonb) || p_changes);
    PERFORM __schema__.check_tags(v_merged);
    RETURN nullif(v_merged, '{}'::jsonb);
END
$$;

-- name: float8_or_null
-- p_n as the nearest float64 (PostgreSQL reads it with strtod, as orjson and Python do:
-- correctly rounded, ties to even), or NULL when that is infinite or 0 for a number that is
-- not 0 (from 2^1024 - 2^970 up, and up to 2^-1075), where the cast would raise instead.
CREATE OR REPLACE FUNCTION __schema__.float8_or_null(p_n numeric) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN abs(p_n) > 1.7976931348623157e308
             AND abs(p_n) >= power(2::numeric, 1024) - power(2::numeric, 970) THEN NULL
        WHEN abs(p_n) < 2.4703282292062328e-324 AND p_n <> 0
             AND abs(p_n) <= power(5::numeric, 1075) * 1e-1075 THEN NULL
        ELSE p_n::double precision END
$$;

-- name: number_reads_back
-- The one number rule of every door (codec.decode_exact holds the same): whether orjson
-- reads p_n, as jsonb writes it, and writes the same number back. An integer written
-- without a point (scale 0) in [-2^63, 2^64 - 1] is read exactly. Every other number is read
-- as the nearest float64 f and written back as the shortest decimal that reads as f (of
-- those, the nearest to f), so p_n must be that decimal: 1e400 overflows, 1e-400 becomes
-- 0.0, 2^70, 0.12345678901234567890 and 9007199254740993.0 lose digits; 1e20, 5e-324 and
-- 18446744073709552000 (the shortest form of the float64 2^64) are exact.
--
-- PostgreSQL writes f's shortest form too (extra_float_digits 1) but never one that lies on
-- the edge of f's rounding interval, which orjson and Python write when it is shorter (1e23;
-- PostgreSQL writes 9.999999999999999e+22). So p_n is f's form when it is PostgreSQL's or
-- has fewer digits (it is then on that edge), and no decimal with fewer significant digits
-- reads as f: the two nearest p_n with one digit less tell, as every decimal between them
-- and p_n reads as f too. At most 15 significant digits in float64's normal range always
-- read back (DBL_DIG), which spares most numbers the casts.
CREATE OR REPLACE FUNCTION __schema__.number_reads_back(p_n numeric) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET extra_float_digits = 1 AS $$
DECLARE
    v_abs numeric := abs(p_n);
    v_text text := abs(p_n)::text;
    v_frac text := split_part(abs(p_n)::text, '.', 2);
    v_k integer;     -- significant digits of p_n
    v_lead integer;  -- p_n's first significant digit is at 10^v_lead
    v_f double precision;
    v_s numeric;
    v_cut numeric;
BEGIN
    IF v_abs = 0 OR (scale(p_n) = 0 AND p_n BETWEEN -9223372036854775808
                                                AND 18446744073709551615) THEN
        RETURN true;
    END IF;
    v_k := length(rtrim(ltrim(replace(v_text, '.', ''), '0'), '0'));
    IF v_k <= 15 AND v_abs BETWEEN 2.2250738585072014e-308 AND 1.7976931348623157e308 THEN
        RETURN true;
    END IF;
    v_f := __schema__.float8_or_null(v_abs);
    IF v_f IS NULL THEN
        RETURN false;
    END IF;
    v_s := v_f::text::numeric;
    IF v_s <> v_abs
       AND v_k >= length(rtrim(ltrim(replace(v_s::text, '.', ''), '0'), '0')) THEN
        RETURN false;
    END IF;
    IF v_k = 1 THEN
        RETURN true;
    END IF;
    v_lead := CASE WHEN v_abs >= 1 THEN length(split_part(v_text, '.', 1)) - 1
                   ELSE length(ltrim(v_frac, '0')) - length(v_frac) - 1 END;
    v_cut := trunc(v_abs, v_k - 2 - v_lead);  -- p_n cut to k - 1 significant digits
    RETURN NOT (__schema__.float8_or_null(v_cut) IS NOT DISTINCT FROM v_f
                OR __schema__.float8_or_null(v_cut + ('1e' || (v_lead - v_k + 2))::numeric)
                   IS NOT DISTINCT FROM v_f);
END
$$;

-- name: undecodable_number
-- The first number in p_value that does not read back unchanged (number_reads_back), or
-- NULL when there is none. Only numbers that are not integers of at most 2^53 in magnitude
-- are looked at (one jsonpath pass finds them): those always read back.
CREATE OR REPLACE FUNCTION __schema__.undecodable_number(p_value jsonb) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT j::numeric
      FROM jsonb_path_query(p_value, 'strict $.** ? (@.type() == "number" && (
                @ != @.floor() || @ < -9007199254740992 || @ > 9007199254740992))') AS j
     WHERE NOT __schema__.number_reads_back(j::numeric)
     LIMIT 1
$$;

-- name: check_payload
-- A JSON value the runtime can decode unchanged: at most 16 MiB as jsonb text (what a
-- worker reads; codec.DEFAULT_MAX_PAYLOAD_BYTES) unless the calling transaction raised the
-- cap with set_config('kestrel.max_payload_bytes', N, true) (a runtime configured with a
-- larger --max-payload-bytes does, e.g. for a 25 MB GitHub delivery; at most 200 MiB, the
-- ceiling of --max-history-bytes; transaction-local, so safe behind PgBouncer), nesting at
-- most 254 levels deep counting
-- the outermost array or object (orjson, and so codec.encode, refuses deeper values), and
-- only numbers that read back unchanged (undecodable_number). Strings need no check:
-- jsonb itself refuses \u0000 and lone surrogates.
CREATE OR REPLACE FUNCTION __schema__.check_payload(p_value jsonb, p_what text) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    v_bytes bigint;
    v_cap bigint := 16777216;
    v_set text := current_setting('kestrel.max_payload_bytes', true);
    v_bad numeric;
    v_shown text;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    IF v_set ~ '^[0-9]{1,12}$' THEN
        v_cap := least(greatest(v_set::bigint, 1024), 209715200);
    END IF;
    v_bytes := octet_length(p_value::text);
    IF v_bytes > v_cap THEN
        RAISE EXCEPTION '% is % bytes as JSON text, over the cap of % bytes', p_what, v_bytes,
            v_cap USING ERRCODE = 'KS008';
    END IF;
    -- An array or object at level 254 below the outermost one is the 255th level.
    IF jsonb_path_exists(p_value, 'strict $.**{254 to last} ? (@.type() == "array"
                                                            || @.type() == "object")') THEN
        RAISE EXCEPTION '% nest deeper than 254 levels of arrays and objects', p_what
            USING ERRCODE = 'KS007';
    END IF;
    IF jsonb_path_exists(p_value, 'strict $.** ? (@.type() == "number" && (
            @ != @.floor() || @ < -9007199254740992 || @ > 9007199254740992))') THEN
        v_bad := __schema__.undecodable_number(p_value);
        IF v_bad IS NOT NULL THEN
            v_shown := v_bad::text;
            IF length(v_shown) > 40 THEN
                v_shown := 'about ' || trim(to_char(v_bad, '9.999999999999999EEEE'));
            END IF;
            RAISE EXCEPTION '% contain the number %, which would not read back unchanged: '
                'integers must lie in [-2^63, 2^64 - 1], other numbers must be finite '
                'float64 values in their shortest form', p_what, v_shown
                USING ERRCODE = 'KS007';
        END IF;
    END IF;
END
$$;

-- name: trace_parent_or_null
-- p_value when it is a W3C traceparent as the recommendation writes version 00
-- (https://www.w3.org/TR/trace-context/#traceparent-header): 00-<32 hex>-<16 hex>-<2 hex>,
-- lowercase, with a trace id and a parent id that are not all zeros; otherwise NULL. Trace
-- context is advisory: a malformed one is ignored, never stored, never an error.
-- kestrel.tracing.parse_traceparent holds the same rule.
CREATE OR REPLACE FUNCTION __schema__.trace_parent_or_null(p_value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_value ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
                     AND substr(p_value, 4, 32) <> repeat('0', 32)
                     AND substr(p_value, 37, 16) <> repeat('0', 16)
                THEN p_value END
$$;

-- name: trace_state_or_null
-- p_value when it is a W3C tracestate (https://www.w3.org/TR/trace-context/#tracestate-header)
-- of at most 512 characters: list members separated by commas (spaces and tabs around them
-- and empty members allowed), at most 32 of them, each key=value with the recommendation's
-- key grammar and a value of 1-256 printable ASCII characters without ',' or '=' that does
-- not end in a space; otherwise (or with no member at all) NULL.
-- kestrel.tracing.parse_tracestate holds the same rule.
CREATE OR REPLACE FUNCTION __schema__.trace_state_or_null(p_value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_member text;
    v_key text;
    v_val text;
    v_count integer := 0;
BEGIN
    IF p_value IS NULL OR char_length(p_value) > 512 THEN
        RETURN NULL;
    END IF;
    FOREACH v_member IN ARRAY string_to_array(p_value, ',') LOOP
        v_member := btrim(v_member, E' \t');
        CONTINUE WHEN v_member = '';
        v_count := v_count + 1;
        IF v_count > 32 OR strpos(v_member, '=') = 0 THEN
            RETURN NULL;
        END IF;
        v_key := split_part(v_member, '=', 1);
        v_val := substr(v_member, strpos(v_member, '=') + 1);
        IF NOT (v_key ~ '^([a-z][a-z0-9_*/-]{0,255}|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})$'
                AND char_length(v_val) BETWEEN 1 AND 256
                AND v_val ~ '^[ -~]*$'
                AND strpos(v_val, '=') = 0
                AND right(v_val, 1) <> ' ') THEN
            RETURN NULL;
        END IF;
    END LOOP;
    RETURN CASE WHEN v_count > 0 THEN p_value END;
END
$$;

-- name: submit
-- submit(): every argument is checked before anything is written. p_start_at (migration
-- 0015) is the time before which it is not claimed, as the database clock reads it; give it
-- or p_delay_s (seconds from now), not both. An idempotency key covers the whole request:
-- the same key with other arguments, queue, priority, timeout, delay, start time, dedup key
-- or on_duplicate is refused (KS001), never answered with the first execution. Keys
-- stored before 0015 hold the digest of the arguments only ('v2:' marks the whole-request
-- digest), and are compared on those. A child (p_parent) takes a KEY SHARE lock on its parent's row and is refused when
-- the parent is being cancelled or has finished. The lock conflicts with cancel()'s FOR
-- UPDATE and with the DELETE that finishes the parent, so either the child commits first and
-- cancel() (which walks the tree after taking its locks) sees it, or cancel() commits first
-- and this reads its flag. KEY SHARE does not conflict with the parent's heartbeats and
-- checkpoints (NO KEY UPDATE), so a child start never stalls its own parent.
--
-- p_traceparent and p_tracestate (migration 0018) are the submitter's W3C trace context: the
-- workers' spans for this execution continue that trace. Each is kept only when well formed
-- (trace_parent_or_null, trace_state_or_null; a tracestate only with a traceparent), and is
-- ignored otherwise, never an error. A child given none inherits its parent's. They are not
-- part of an idempotency key's request: the same submit sent again from another trace is the
-- same request.
--
-- p_debounce_key, p_debounce_s, p_debounce_max_s (migration 0024: what debounce is, and the
-- locks it takes): a submit of a key whose execution has not started yet replaces that
-- one's arguments, priority and timeout (which counts from its start), pushes its start
-- back, and returns its id. The maximum wait (this submit's; ten windows by default) counts
-- from the key's first submit. Not with a dedup key, a delay, a start time or a parent.
CREATE OR REPLACE FUNCTION __schema__.submit(
    p_workflow text,
    p_args jsonb DEFAULT '[]',
    p_queue text DEFAULT 'default',
    p_priority integer DEFAULT 0,
    p_idempotency_key text DEFAULT NULL,
    p_id uuid DEFAULT NULL,
    p_parent uuid DEFAULT NULL,
    p_timeout_s double precision DEFAULT NULL,
    p_delay_s double precision DEFAULT NULL,
    p_dedup_key text DEFAULT NULL,
    p_on_duplicate text DEFAULT 'return',
    p_start_at timestamptz DEFAULT NULL,
    p_traceparent text DEFAULT NULL,
    p_tracestate text DEFAULT NULL,
    p_debounce_key text DEFAULT NULL,
    p_debounce_s double precision DEFAULT NULL,
    p_debounce_max_s double precision DEFAULT NULL,
    p_concurrency_key text DEFAULT NULL,
    p_tags jsonb DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := coalesce(p_id, __schema__.new_execution_id());
    v_traceparent text := __schema__.trace_parent_or_null(p_traceparent);
    v_tracestate text;
    v_parent_traceparent text;
    v_parent_tracestate text;
    v_delay_s double precision := p_delay_s;
    -- The moment of the call on the database clock: a deadline and a delay count from the
    -- call, not from the caller's BEGIN (kestrel_now() is the transaction's start; a submit
    -- in a transaction open for minutes would be created minutes late, FAULTS C6).
    v_now timestamptz := __schema__.kestrel_now() + (clock_timestamp() - now());
    v_wake timestamptz;
    v_digest text;
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_live uuid;
    v_cancelling boolean;
    v_status text;
    v_pending uuid;
    v_first timestamptz;
    v_workflow text;
    v_pushed timestamptz;
    v_deadline timestamptz;
BEGIN
    PERFORM __schema__.check_name(p_workflow, 'workflow name');
    IF p_id IS NOT NULL THEN  -- most submits choose no id: no call for them
        PERFORM __schema__.check_bucket_id(p_id);
    END IF;
    IF NOT __schema__.valid_queue_name(p_queue) THEN
        RAISE EXCEPTION 'invalid queue name %: 1-128 of A-Z a-z 0-9 _ . : -',
            coalesce(quote_literal(left(p_queue, 200)), 'NULL') USING ERRCODE = 'KS002';
    END IF;
    IF p_priority IS NULL THEN
        RAISE EXCEPTION 'priority must not be NULL' USING ERRCODE = 'KS002';
    END IF;
    IF p_args IS NULL OR jsonb_typeof(p_args) <> 'array' THEN
        RAISE EXCEPTION 'args must be a JSON array, got %', coalesce(jsonb_typeof(p_args), 'NULL')
            USING ERRCODE = 'KS002';
    END IF;
    PERFORM __schema__.check_payload(p_args, 'args');
    IF p_timeout_s IS NOT NULL AND NOT (p_timeout_s > 0 AND p_timeout_s <= 3155760000) THEN
        RAISE EXCEPTION 'timeout must be positive and at most 3155760000 seconds (100 years), got %',
            p_timeout_s USING ERRCODE = 'KS002';
    END IF;
    IF p_start_at IS NOT NULL THEN
        IF p_delay_s IS NOT NULL THEN
            RAISE EXCEPTION 'give delay or start_at, not both' USING ERRCODE = 'KS002';
        END IF;
        v_delay_s := greatest(0, extract(epoch FROM p_start_at - v_now));
    END IF;
    IF v_delay_s IS NOT NULL AND NOT (v_delay_s >= 0 AND v_delay_s <= 3155760000) THEN
        RAISE EXCEPTION 'delay must be between 0 and 3155760000 seconds (100 years), got %',
            v_delay_s USING ERRCODE = 'KS002';
    END IF;
    IF v_delay_s > 0 THEN  -- computed here: no STABLE operator inside a CASE (Citus)
        v_wake := v_now + make_interval(secs => v_delay_s);
    END IF;
    IF p_on_duplicate IS NULL OR p_on_duplicate NOT IN ('return', 'reject') THEN
        RAISE EXCEPTION 'on_duplicate must be return or reject, got %',
            coalesce(quote_literal(left(p_on_duplicate, 200)), 'NULL') USING ERRCODE = 'KS002';
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
    END IF;
    IF p_dedup_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_dedup_key, 'dedup key');
    END IF;
    IF p_concurrency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_concurrency_key, 'concurrency key');
    END IF;
    IF p_tags IS NOT NULL THEN
        PERFORM __schema__.check_tags(p_tags);
    END IF;
    IF p_debounce_key IS NOT NULL OR p_debounce_s IS NOT NULL
            OR p_debounce_max_s IS NOT NULL THEN
        IF p_debounce_key IS NULL OR p_debounce_s IS NULL THEN
            RAISE EXCEPTION 'debounce takes a debounce key and a window (debounce seconds), both'
                USING ERRCODE = 'KS002';
        END IF;
        PERFORM __schema__.check_name(p_debounce_key, 'debounce key');
        -- (NaN > 0 holds in PostgreSQL, NaN <= x does not: NaN is refused too.)
        IF NOT (p_debounce_s > 0 AND p_debounce_s <= 31536000) THEN
            RAISE EXCEPTION 'debounce must be positive and at most 31536000 seconds (a year), got %',
                p_debounce_s USING ERRCODE = 'KS002';
        END IF;
        IF p_debounce_max_s IS NOT NULL
                AND NOT (p_debounce_max_s >= p_debounce_s AND p_debounce_max_s <= 31536000) THEN
            RAISE EXCEPTION 'debounce_max must be at least debounce and at most 31536000 seconds, got %',
                p_debounce_max_s USING ERRCODE = 'KS002';
        END IF;
        IF p_dedup_key IS NOT NULL OR v_delay_s IS NOT NULL OR p_parent IS NOT NULL THEN
            RAISE EXCEPTION 'a debounced submit takes no dedup key, delay, start time or parent: its window is its delay'
                USING ERRCODE = 'KS002';
        END IF;
        v_delay_s := p_debounce_s;
        v_wake := v_now + make_interval(secs => p_debounce_s);
    END IF;
    IF p_parent IS NOT NULL THEN
        SELECT e.cancel_requested, e.traceparent, e.tracestate
          INTO v_cancelling, v_parent_traceparent, v_parent_tracestate
          FROM __schema__.workflow_executions AS e
         WHERE e.id = p_parent
           FOR KEY SHARE;
        IF NOT FOUND THEN
            SELECT h.status INTO v_status FROM __schema__.workflow_history AS h
             WHERE h.id = p_parent;
            IF v_status = 'cancelled' THEN
                RAISE EXCEPTION 'parent execution % was cancelled; it starts no children', p_parent
                    USING ERRCODE = 'KS009';
            ELSIF v_status IS NOT NULL THEN
                RAISE EXCEPTION 'parent execution % has already finished (%)', p_parent, v_status
                    USING ERRCODE = 'KS004';
            END IF;
            RAISE EXCEPTION 'no parent execution %', p_parent USING ERRCODE = 'KS003';
        END IF;
        IF v_cancelling THEN
            RAISE EXCEPTION 'parent execution % is being cancelled; it starts no children',
                p_parent USING ERRCODE = 'KS009';
        END IF;
    END IF;
    IF v_traceparent IS NOT NULL THEN
        v_tracestate := __schema__.trace_state_or_null(p_tracestate);
    ELSE
        v_traceparent := v_parent_traceparent;
        v_tracestate := v_parent_tracestate;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        -- The request as sent (p_start_at as an instant, whatever the session's time zone).
        v_digest := 'v2:' || md5(jsonb_build_array(
            p_args, p_queue, p_priority, p_timeout_s, p_delay_s,
            extract(epoch FROM p_start_at), p_dedup_key, p_on_duplicate)::text
            -- (as before 0024 without debounce, so keys stored then still match)
            || CASE WHEN p_debounce_key IS NULL THEN ''
                    ELSE jsonb_build_array(p_debounce_key, p_debounce_s,
                                           p_debounce_max_s)::text END
            -- (and as before 0025 without a concurrency key or tags)
            || CASE WHEN p_concurrency_key IS NULL AND p_tags IS NULL THEN ''
                    ELSE jsonb_build_array(p_concurrency_key, p_tags)::text END);
        INSERT INTO __schema__.idempotency_keys (idempotency_key, execution_id, workflow, args_digest)
        VALUES (p_idempotency_key, v_id, p_workflow, v_digest)
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF NOT FOUND THEN
            -- ON CONFLICT waited for the other inserter to commit, so this read sees its row.
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF left(v_existing.args_digest, 3) <> 'v2:' THEN  -- stored before 0015
                v_digest := md5(p_args::text);
            END IF;
            IF v_existing.workflow <> p_workflow OR v_existing.args_digest <> v_digest THEN
                RAISE EXCEPTION 'idempotency key % is already used by execution % with other arguments or options (workflow, queue, priority, timeout, delay, start time, dedup key, debounce, concurrency key, tags)',
                    p_idempotency_key, v_existing.execution_id
                    USING ERRCODE = 'KS001';
            END IF;
            RETURN v_existing.execution_id;
        END IF;
    END IF;
    IF p_debounce_key IS NOT NULL THEN
        LOOP
            INSERT INTO __schema__.debounces (queue, debounce_key, execution_id, first_at)
            VALUES (p_queue, p_debounce_key, v_id, v_now)
            ON CONFLICT (queue, debounce_key) DO NOTHING;
            EXIT WHEN FOUND;  -- the key's first submit: a new execution, below
            -- The key's row, locked: the key's submits take turns from here to commit.
            SELECT d.execution_id, d.first_at INTO v_pending, v_first
              FROM __schema__.debounces AS d
             WHERE d.queue = p_queue AND d.debounce_key = p_debounce_key
               FOR UPDATE;
            CONTINUE WHEN NOT FOUND;  -- upkeep dropped it in between: insert again
            v_pushed := least(v_now + make_interval(secs => p_debounce_s),
                              v_first + make_interval(
                                  secs => coalesce(p_debounce_max_s, 10 * p_debounce_s)));
            -- A debounced execution's timeout counts from its start, pushed with it.
            v_deadline := v_pushed + make_interval(secs => p_timeout_s);
            -- Still pending (never claimed): it takes this submit's arguments, priority and
            -- timeout and waits longer.
            UPDATE __schema__.workflow_executions AS e
               SET args = p_args, priority = p_priority, wake_at = v_pushed,
                   deadline = v_deadline, concurrency_key = p_concurrency_key, tags = p_tags,
                   updated_at = v_now
             WHERE e.id = v_pending AND e.status = 'waiting' AND e.lease_epoch = 0
               AND NOT e.cancel_requested AND e.workflow = p_workflow
            RETURNING e.id INTO v_pending;
            IF FOUND THEN
                IF p_idempotency_key IS NOT NULL THEN
                    UPDATE __schema__.idempotency_keys SET execution_id = v_pending
                     WHERE idempotency_key = p_idempotency_key;
                END IF;
                RETURN v_pending;
            END IF;
            SELECT e.workflow INTO v_workflow FROM __schema__.workflow_executions AS e
             WHERE e.id = (SELECT d.execution_id FROM __schema__.debounces AS d
                            WHERE d.queue = p_queue AND d.debounce_key = p_debounce_key)
               AND e.status = 'waiting' AND e.lease_epoch = 0;
            IF FOUND AND v_workflow <> p_workflow THEN
                RAISE EXCEPTION 'debounce key % on queue % is pending for workflow %, not %',
                    p_debounce_key, p_queue, v_workflow, p_workflow USING ERRCODE = 'KS006';
            END IF;
            -- It started (or ended): this submit starts the key's next one.
            UPDATE __schema__.debounces AS d SET execution_id = v_id, first_at = v_now
             WHERE d.queue = p_queue AND d.debounce_key = p_debounce_key;
            EXIT;
        END LOOP;
        v_deadline := v_wake + make_interval(secs => p_timeout_s);
    ELSE
        v_deadline := v_now + make_interval(secs => p_timeout_s);
    END IF;
    LOOP
        INSERT INTO __schema__.workflow_executions
               (id, workflow, queue, priority, args, idempotency_key, parent_id, deadline,
                dedup_key, status, wake_at, traceparent, tracestate, concurrency_key, tags)
        VALUES (v_id, p_workflow, p_queue, p_priority, p_args, p_idempotency_key, p_parent,
                v_deadline, p_dedup_key,
                CASE WHEN v_delay_s > 0 THEN 'waiting' ELSE 'queued' END,
                v_wake,
                v_traceparent, v_tracestate, p_concurrency_key, p_tags)
        ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING;
        EXIT WHEN FOUND;
        -- A live execution holds the dedup key (ON CONFLICT waited for it to commit).
        SELECT id INTO v_live FROM __schema__.workflow_executions
         WHERE queue = p_queue AND dedup_key = p_dedup_key;
        IF FOUND THEN
            IF p_on_duplicate = 'reject' THEN
                RAISE EXCEPTION 'queue % already has a live execution % with dedup key %',
                    p_queue, v_live, p_dedup_key USING ERRCODE = 'KS006';
            END IF;
            IF p_idempotency_key IS NOT NULL THEN  -- the key answers for what we returned
                UPDATE __schema__.idempotency_keys SET execution_id = v_live
                 WHERE idempotency_key = p_idempotency_key;
            END IF;
            RETURN v_live;
        END IF;
        -- It finished between the conflict and the read: the key is free, try again.
    END LOOP;
    -- Delivered at commit only; workers also poll, so a lost notification costs latency only.
    PERFORM pg_notify('kestrel.__schema_name__', p_queue);
    RETURN v_id;
END
$$;

-- name: child_finished
-- A finished child tells its parent: a signal named 'kestrel.child:<id>' whose payload is
-- the child's outcome, which wakes the parent if it waits for it.
--
-- PL/pgSQL, the clock read into a variable (issue 24): Citus plans no statement of a SQL
-- function that uses its parameters ("could not create distributed plan"), and refuses a
-- function that is not IMMUTABLE inside CASE in an UPDATE; a PL/pgSQL variable reaches the
-- statement as a parameter, a constant to Citus.
CREATE OR REPLACE FUNCTION __schema__.child_finished(
    p_parent uuid, p_child uuid, p_status text, p_result jsonb, p_error jsonb
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := __schema__.kestrel_now();
BEGIN
    WITH bumped AS (
        UPDATE __schema__.workflow_executions AS p
           SET signal_seq = p.signal_seq + 1,
               wake_at = CASE WHEN p.status = 'waiting'
                                   AND p.waiting_for = 'kestrel.child:' || p_child
                              THEN v_now ELSE p.wake_at END
         WHERE p.id = p_parent
     RETURNING p.id
    )
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT p_parent, 'kestrel.child:' || p_child,
           jsonb_build_object('status', p_status, 'result', p_result, 'error', p_error),
           'kestrel.child:' || p_child
      FROM bumped
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
END
$$;

-- name: signal
-- signal(): the name, key and payload follow the same rules as submit's, checked before
-- the execution's row is locked.
CREATE OR REPLACE FUNCTION __schema__.signal(
    p_execution uuid, p_name text, p_payload jsonb DEFAULT NULL,
    p_idempotency_key text DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_try integer;
    -- Read once, used inside CASE as a parameter (Citus refuses the call there: issue 24).
    v_now timestamptz := __schema__.kestrel_now();
BEGIN
    PERFORM __schema__.check_name(p_name, 'signal name');
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
    END IF;
    PERFORM __schema__.check_payload(p_payload, 'payload');
    -- Lock the execution row first (the same order as park), then store the signal. If the
    -- row this waited for was deleted, a transaction that cancelled and retried the
    -- execution may have inserted it again, invisible to this statement's snapshot: look
    -- once more, in a new statement.
    FOR v_try IN 1..2 LOOP
        UPDATE __schema__.workflow_executions AS e
           SET signal_seq = e.signal_seq + 1,
               wake_at = CASE WHEN e.status = 'waiting' AND e.waiting_for = p_name
                              THEN v_now ELSE e.wake_at END
         WHERE e.id = p_execution
        RETURNING e.status INTO v_status;
        EXIT WHEN FOUND;
    END LOOP;
    IF v_status IS NULL THEN
        SELECT h.status INTO v_status FROM __schema__.workflow_history AS h
         WHERE h.id = p_execution;
        IF FOUND THEN
            -- A keyed signal sent again after its reply was lost may find the execution
            -- finished since, maybe on that very signal: already delivered, not an error
            -- (FAULTS R1; a workflow's ctx.signal would otherwise fail its sender).
            -- Its signals left with it (archive_finished): look in history too.
            IF p_idempotency_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM __schema__.signals AS s
                     WHERE s.execution_id = p_execution
                       AND s.idempotency_key = p_idempotency_key
                    UNION ALL
                    SELECT 1 FROM __schema__.signal_history AS s
                     WHERE s.execution_id = p_execution
                       AND s.idempotency_key = p_idempotency_key) THEN
                RETURN false;
            END IF;
            RAISE EXCEPTION 'execution % has already finished (%)', p_execution, v_status
                USING ERRCODE = 'KS004';
        END IF;
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    VALUES (p_execution, p_name, p_payload, p_idempotency_key)
    ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('kestrel.__schema_name__', 'signal');
    RETURN true;
END
$$;

-- name: cancel
-- cancel(): 0005 found the tree and locked it in one statement, whose snapshot predates its
-- locks: a child committed while the statement waited for a lock was never seen, and
-- survived its cancelled parent (FAULTS X7). Now the walk is repeated, each time in a new
-- statement whose snapshot is taken after the previous statement's locks were granted,
-- until a walk finds no live member it has not locked. That is complete: a child submit
-- holds KEY SHARE on its parent until it commits, which FOR UPDATE waits for, so every
-- child of a locked node is either committed before the next walk (and seen by it) or not
-- started until this transaction ends (and then refused). Each walk locks what it found in
-- id order, as 0005 did (the order heartbeats and completions lock in); a second walk only
-- finds something when a child was started during the first. The rest is 0005's.
CREATE OR REPLACE FUNCTION __schema__.cancel(p_execution uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_tree uuid[] := '{}';
    v_more uuid[];
    v_moved uuid[];
    v_parents uuid[];
    v_finished_at timestamptz;
    v_try integer;
BEGIN
    -- A second try when the first walk locked nothing: the root's row it waited for may
    -- have been deleted and inserted again by a transaction that cancelled and retried the
    -- execution, invisible to that walk's snapshot (a new statement sees it).
    FOR v_try IN 1..2 LOOP
        LOOP
            WITH RECURSIVE tree AS (
                SELECT id FROM __schema__.workflow_executions WHERE id = p_execution
                UNION
                SELECT e.id FROM __schema__.workflow_executions AS e
                  JOIN tree ON e.parent_id = tree.id
            )
            SELECT array_agg(l.id) INTO v_more
              FROM (SELECT e.id FROM __schema__.workflow_executions AS e
                      JOIN tree USING (id)
                     WHERE e.id <> ALL (v_tree)
                     ORDER BY e.id
                       FOR UPDATE OF e) AS l;
            EXIT WHEN v_more IS NULL;
            v_tree := v_tree || v_more;
        END LOOP;
        EXIT WHEN cardinality(v_tree) > 0;
    END LOOP;
    WITH flagged AS (
        UPDATE __schema__.workflow_executions AS e
           SET cancel_requested = true
         WHERE e.id = ANY (v_tree) AND e.status = 'running'
    ), removed AS (
        DELETE FROM __schema__.workflow_executions AS e
         WHERE e.id = ANY (v_tree) AND e.status IN ('queued', 'waiting')
     RETURNING e.*
    ), moved AS (
        INSERT INTO __schema__.workflow_history
               (id, workflow, queue, priority, status, args, result, error, idempotency_key,
                lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
                app_version, concurrency_key, tags)
        SELECT id, workflow, queue, priority, 'cancelled', args, NULL,
               jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'),
               idempotency_key, lease_epoch, attempts, created_at, started_at,
               __schema__.kestrel_now(), parent_id, deadline, app_version,
               concurrency_key, tags
          FROM removed
        RETURNING id, parent_id, workflow, finished_at
    ), uncounted AS (
        -- No worker sees these finish: the metrics collector counts them
        -- (take_uncounted_finishes) in kestrel_workflows_finished_total, once per finish
        -- (a row each: cancel, retry, cancel again is two; migrations 0011, 0016).
        INSERT INTO __schema__.uncounted_finishes (execution_id, workflow, status)
        SELECT id, workflow, 'cancelled' FROM moved
    )
    SELECT array_agg(id), array_agg(parent_id), min(finished_at)
      INTO v_moved, v_parents, v_finished_at FROM moved;
    IF v_moved IS NOT NULL THEN
        PERFORM __schema__.child_finished(t.parent, t.child, 'cancelled', NULL,
                    jsonb_build_object('type', 'Cancelled', 'message', 'cancelled by request'))
           FROM unnest(v_parents, v_moved) AS t(parent, child)
          WHERE t.parent IS NOT NULL;
        PERFORM __schema__.archive_finished(v_moved, v_finished_at);
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

-- name: retry
-- retry(): 0003 brought back every checkpoint without an error, also those recorded after
-- the failed step. A workflow that caught StepFailed and took another branch then found the
-- other branch's checkpoints at positions its re-run reaches by the first branch, and
-- failed with NonDeterminismError (FAULTS X7). Now only the checkpoints before the first
-- failed one are kept (where they were written: migration 0019); the rest are dropped and
-- run again. A child whose parent was
-- cancelled is not brought back (KS009), as submit() would not start it.
--
-- The re-run is a fresh run from the first failed step (FAULTS O1, O2), so what the dropped
-- checkpoints took is given back with them: signals consumed at a dropped position are
-- pending again, patch markers asked at or after it (output {"at": position}) are dropped,
-- and each child's end is delivered again from the child's own record (restore_child_outcomes:
-- a child keeps its id, since its idempotency key is its parent's and the step's). Signals
-- and events come back from history with the execution (archive_finished moved them there).
--
-- With p_idempotency_key (migration 0015), a retry sent again after its reply was lost
-- returns as the first did instead of finding the execution live (KS005): the key is stored
-- with the retry, in the same transaction, and a second call with it changes nothing. A key
-- already used for another operation (a submit, a fork, a retry of another execution)
-- raises KS001.
CREATE OR REPLACE FUNCTION __schema__.retry(p_execution uuid,
                                            p_idempotency_key text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_parent uuid;
    v_cancelling boolean;
    v_cut integer;
    v_children uuid[];
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_workflow text;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
        -- ON CONFLICT waits for a concurrent call with the same key, then sees its row.
        -- The workflow is read first: Citus 13.2.2 sends an INSERT … SELECT from the
        -- executions view with ON CONFLICT to the node with an empty qual, `( IS NOT
        -- NULL)`, a syntax error there (issue 24: a keyed retry failed on every distributed
        -- schema). With no such execution nothing is inserted and FOUND stays false.
        SELECT x.workflow INTO v_workflow FROM __schema__.executions AS x
         WHERE x.id = p_execution;
        IF FOUND THEN
            INSERT INTO __schema__.idempotency_keys
                   (idempotency_key, execution_id, workflow, args_digest)
            VALUES (p_idempotency_key, p_execution, v_workflow, md5('retry:' || p_execution))
            ON CONFLICT (idempotency_key) DO NOTHING;
        END IF;
        IF NOT FOUND THEN
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF FOUND THEN
                IF v_existing.execution_id <> p_execution
                        OR v_existing.args_digest <> md5('retry:' || p_execution) THEN
                    RAISE EXCEPTION 'idempotency key % is already used by another operation (execution %)',
                        p_idempotency_key, v_existing.execution_id USING ERRCODE = 'KS001';
                END IF;
                RETURN;  -- retried under this key already (its reply may have been lost)
            END IF;
            -- No such execution: KS003 below.
        END IF;
    END IF;
    SELECT parent_id INTO v_parent FROM __schema__.workflow_history
     WHERE id = p_execution AND status IN ('failed', 'cancelled', 'quarantined');
    IF v_parent IS NOT NULL THEN
        SELECT e.cancel_requested INTO v_cancelling
          FROM __schema__.workflow_executions AS e
         WHERE e.id = v_parent
           FOR KEY SHARE;
        IF NOT FOUND THEN
            SELECT h.status = 'cancelled' INTO v_cancelling
              FROM __schema__.workflow_history AS h WHERE h.id = v_parent;
        END IF;
        IF v_cancelling THEN
            RAISE EXCEPTION 'parent execution % was cancelled; retry the parent instead', v_parent
                USING ERRCODE = 'KS009';
        END IF;
    END IF;
    WITH removed AS (
        DELETE FROM __schema__.workflow_history AS h
         WHERE h.id = p_execution AND h.status IN ('failed', 'cancelled', 'quarantined')
     RETURNING h.*
    )
    INSERT INTO __schema__.workflow_executions
           (id, workflow, queue, priority, args, idempotency_key, lease_epoch, created_at,
            started_at, parent_id, app_version, concurrency_key, tags)
    SELECT id, workflow, queue, priority, args, idempotency_key, lease_epoch, created_at,
           started_at, parent_id, app_version, concurrency_key, tags
      FROM removed;
    IF FOUND THEN
        -- The first failed step's position: it and everything after it runs again.
        SELECT coalesce(min(o.step_id), 2147483647) INTO v_cut
          FROM __schema__.operation_outputs AS o
         WHERE o.execution_id = p_execution AND o.step_id >= 0 AND o.error IS NOT NULL;
        -- The checkpoints stay where they were written (migration 0019); those from the
        -- first failure on go.
        DELETE FROM __schema__.operation_outputs AS o
         WHERE o.execution_id = p_execution
           AND NOT CASE WHEN o.step_id >= 0 THEN o.step_id < v_cut
                        ELSE __schema__.marker_position(o.output) < v_cut END;
        WITH back AS (
            DELETE FROM __schema__.signal_history AS s
             WHERE s.execution_id = p_execution
         RETURNING s.*
        )
        INSERT INTO __schema__.signals
               (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
                consumed_at)
        SELECT id, execution_id, name, payload, idempotency_key, created_at,
               CASE WHEN consumed_step < v_cut THEN consumed_step END,
               CASE WHEN consumed_step < v_cut THEN consumed_at END
          FROM back;
        WITH back AS (
            DELETE FROM __schema__.event_history AS v
             WHERE v.execution_id = p_execution
         RETURNING v.*
        )
        INSERT INTO __schema__.events (execution_id, key, value, updated_at)
        SELECT execution_id, key, value, updated_at FROM back;
        SELECT array_agg(c.id) INTO v_children
          FROM (SELECT id FROM __schema__.workflow_executions WHERE parent_id = p_execution
                UNION ALL
                SELECT id FROM __schema__.workflow_history WHERE parent_id = p_execution) AS c;
        IF v_children IS NOT NULL THEN
            PERFORM __schema__.restore_child_outcomes(p_execution, v_children);
        END IF;
        PERFORM pg_notify('kestrel.__schema_name__', 'retry');
        RETURN;
    END IF;
    SELECT status INTO v_status FROM __schema__.workflow_executions WHERE id = p_execution;
    IF NOT FOUND THEN
        SELECT status INTO v_status FROM __schema__.workflow_history WHERE id = p_execution;
    END IF;
    IF v_status IS NULL THEN
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    RAISE EXCEPTION 'execution % is %; only failed, cancelled or quarantined executions can be retried',
        p_execution, v_status USING ERRCODE = 'KS005';
END
$$;

-- name: marker_position
-- The step position a patch marker (a checkpoint at a negative id, output {"at": position})
-- was recorded at: the first position whose re-run may ask the patch again. A marker of an
-- unexpected form counts as recorded at 0, so whatever reruns drops it (the re-run asks
-- again and records it again).
CREATE OR REPLACE FUNCTION __schema__.marker_position(p_output jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(p_output -> 'at') = 'number'
                 AND (p_output ->> 'at') ~ '^[0-9]{1,9}$'
                THEN (p_output ->> 'at')::integer ELSE 0 END
$$;

-- name: restore_child_outcomes
-- Deliver again to p_execution the ends of its children p_children that no checkpoint it
-- keeps has consumed, from each child's own record: a retried or forked execution is told
-- every child's end, however the first delivery went (consumed by a dropped wait, never made
-- because the parent had left the hot table in the same statement, or stale because the
-- child was retried since). A pending signal of a child that is live again is dropped: the
-- child tells its parent when it ends (child_finished). A child found nowhere (its history
-- dropped by retention) keeps whatever signal there is.
CREATE OR REPLACE FUNCTION __schema__.restore_child_outcomes(
    p_execution uuid, p_children uuid[]
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM __schema__.signals AS s
     USING __schema__.workflow_executions AS c
     WHERE c.id = ANY (p_children)
       AND s.execution_id = p_execution
       AND s.idempotency_key = 'kestrel.child:' || c.id
       AND s.consumed_step IS NULL;
    UPDATE __schema__.signals AS s
       SET payload = jsonb_build_object('status', h.status, 'result', h.result,
                                        'error', h.error)
      FROM __schema__.workflow_history AS h
     WHERE h.id = ANY (p_children)
       AND s.execution_id = p_execution
       AND s.idempotency_key = 'kestrel.child:' || h.id
       AND s.consumed_step IS NULL;
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT p_execution, 'kestrel.child:' || h.id,
           jsonb_build_object('status', h.status, 'result', h.result, 'error', h.error),
           'kestrel.child:' || h.id
      FROM __schema__.workflow_history AS h
     WHERE h.id = ANY (p_children)
     ORDER BY h.finished_at, h.id
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
END
$$;

-- name: fork
-- fork(): a new execution that replays the original's first p_from_step positions and runs
-- the rest afresh (FAULTS O3). It copies every checkpoint below the position, recorded errors
-- included (a caught failure is part of the history the copied branch depends on, as retry
-- keeps it), and the patch markers asked before it. What the copy needs from outside comes
-- with it: each child started below the position whose end no copied checkpoint consumed is
-- told to the fork from the child's record; a child still running is refused (KS005, naming
-- the step): its end reaches the original only. The original's signals not consumed below the
-- position are copied as pending, in their order (the fork re-runs the waits that took
-- them), and its events are rebuilt from the set_event checkpoints below the position (which
-- record the value; older ones, without it, are skipped). The position may be at most one
-- past the last recorded one (or the wait the original is parked at): beyond is refused
-- (KS002). The new execution's source is recorded in forks. p_id, the fork's id when the
-- caller chooses it, makes the call idempotent: sent again after a lost reply, it returns
-- the fork it made (KS001 if that id forked something else).
-- p_idempotency_key (migration 0015) does the same for a key the caller names: the
-- same key returns the fork the first call made (KS001 when it names another operation).
CREATE OR REPLACE FUNCTION __schema__.fork(
    p_execution uuid, p_from_step integer, p_id uuid DEFAULT NULL,
    p_idempotency_key text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_new uuid := coalesce(p_id, __schema__.new_execution_id());
    v_src __schema__.executions%ROWTYPE;
    v_last integer;
    v_child record;
    v_children uuid[];
    v_made __schema__.forks%ROWTYPE;
    v_existing __schema__.idempotency_keys%ROWTYPE;
    v_event_keys text[];
    v_event_values jsonb[];
    v_key text;
    v_tags jsonb;
BEGIN
    IF p_id IS NOT NULL THEN
        PERFORM __schema__.check_bucket_id(p_id);
    END IF;
    IF p_from_step IS NULL OR p_from_step < 0 THEN
        RAISE EXCEPTION 'from_step must not be negative' USING ERRCODE = 'KS002';
    END IF;
    SELECT * INTO v_made FROM __schema__.forks WHERE id = v_new;
    IF FOUND THEN
        IF (v_made.forked_from, v_made.from_step) = (p_execution, p_from_step) THEN
            RETURN v_new;
        END IF;
        RAISE EXCEPTION 'fork id % is already used by the fork of % from step %', v_new,
            v_made.forked_from, v_made.from_step USING ERRCODE = 'KS001';
    END IF;
    SELECT * INTO v_src FROM __schema__.executions WHERE id = p_execution;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no execution %', p_execution USING ERRCODE = 'KS003';
    END IF;
    SELECT greatest(max(s.step_id), (SELECT e.wait_step FROM __schema__.workflow_executions AS e
                                      WHERE e.id = p_execution AND e.status = 'waiting'))
      INTO v_last
      FROM __schema__.workflow_steps AS s
     WHERE s.execution_id = p_execution AND s.step_id >= 0;
    IF p_from_step > coalesce(v_last, -1) + 1 THEN
        RAISE EXCEPTION 'cannot fork execution % from step %: it has recorded positions up to %, so a fork may start at step % at most',
            p_execution, p_from_step, coalesce(v_last, -1), coalesce(v_last, -1) + 1
            USING ERRCODE = 'KS002';
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        PERFORM __schema__.check_name(p_idempotency_key, 'idempotency key');
        INSERT INTO __schema__.idempotency_keys
               (idempotency_key, execution_id, workflow, args_digest)
        VALUES (p_idempotency_key, v_new, v_src.workflow,
                md5('fork:' || p_execution || ':' || p_from_step))
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF NOT FOUND THEN
            SELECT * INTO v_existing FROM __schema__.idempotency_keys
             WHERE idempotency_key = p_idempotency_key;
            IF v_existing.args_digest <> md5('fork:' || p_execution || ':' || p_from_step) THEN
                RAISE EXCEPTION 'idempotency key % is already used by another operation (execution %)',
                    p_idempotency_key, v_existing.execution_id USING ERRCODE = 'KS001';
            END IF;
            RETURN v_existing.execution_id;  -- forked under this key already
        END IF;
    END IF;
    -- Children started below the position whose end no copied checkpoint consumed.
    FOR v_child IN
        SELECT k.step_id, k.id, h.id IS NOT NULL AS ended
          FROM (SELECT s.step_id,
                       CASE WHEN s.output #>> '{}' ~ '^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$'
                            THEN (s.output #>> '{}')::uuid END AS id
                  FROM __schema__.workflow_steps AS s
                 WHERE s.execution_id = p_execution AND s.step_id >= 0
                   AND s.step_id < p_from_step
                   AND s.step_name LIKE 'kestrel.start_child:%' AND s.error IS NULL
                   AND jsonb_typeof(s.output) = 'string') AS k
          LEFT JOIN __schema__.workflow_history AS h ON h.id = k.id
         WHERE k.id IS NOT NULL
           AND NOT EXISTS (
                SELECT 1 FROM __schema__.workflow_steps AS w
                 WHERE w.execution_id = p_execution AND w.step_id >= 0
                   AND w.step_id < p_from_step
                   AND w.step_name = 'kestrel.signal:kestrel.child:' || k.id)
         ORDER BY k.step_id
    LOOP
        IF NOT v_child.ended THEN
            RAISE EXCEPTION 'cannot fork execution % from step %: step % started child %, which has not ended (or is no longer recorded); its end would reach % only. Fork once it has ended, or from step % or before',
                p_execution, p_from_step, v_child.step_id, v_child.id, p_execution,
                v_child.step_id USING ERRCODE = 'KS005';
        END IF;
        v_children := v_children || v_child.id;
    END LOOP;
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
            finished_at, tries)
    SELECT v_new, step_id, step_name, output, error, attempt, 0, started_at, finished_at,
           tries
      FROM __schema__.workflow_steps
     WHERE execution_id = p_execution
       AND CASE WHEN step_id >= 0 THEN step_id < p_from_step
                ELSE __schema__.marker_position(output) < p_from_step END;
    -- The fork keeps the original's concurrency key and tags (not in the executions view:
    -- read from whichever table holds it).
    SELECT k.concurrency_key, k.tags INTO v_key, v_tags
      FROM (SELECT e.concurrency_key, e.tags FROM __schema__.workflow_executions AS e
             WHERE e.id = p_execution
            UNION ALL
            SELECT h.concurrency_key, h.tags FROM __schema__.workflow_history AS h
             WHERE h.id = p_execution) AS k;
    INSERT INTO __schema__.workflow_executions
           (id, workflow, queue, priority, args, idempotency_key, concurrency_key, tags)
    VALUES (v_new, v_src.workflow, v_src.queue, v_src.priority, v_src.args, p_idempotency_key,
            v_key, v_tags);
    INSERT INTO __schema__.forks (id, forked_from, from_step)
    VALUES (v_new, p_execution, p_from_step);
    -- The original's inputs from the position on, as the fork's pending signals.
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key, created_at)
    SELECT v_new, s.name, s.payload, s.idempotency_key, s.created_at
      FROM (SELECT id, name, payload, idempotency_key, created_at, consumed_step
              FROM __schema__.signals WHERE execution_id = p_execution
            UNION ALL
            SELECT id, name, payload, idempotency_key, created_at, consumed_step
              FROM __schema__.signal_history WHERE execution_id = p_execution) AS s
     WHERE s.name NOT LIKE 'kestrel.child:%'
       AND (s.consumed_step IS NULL OR s.consumed_step >= p_from_step)
     ORDER BY s.id;
    IF v_children IS NOT NULL THEN
        PERFORM __schema__.restore_child_outcomes(v_new, v_children);
    END IF;
    -- Read, then written from the arrays: Citus 13.2.2 sends this INSERT … SELECT from the
    -- workflow_steps view to the node with an empty qual, `( IS NOT NULL)`, a syntax error
    -- there (issue 24: fork failed on every distributed schema).
    SELECT array_agg(e.key), array_agg(e.value) INTO v_event_keys, v_event_values
      FROM (SELECT DISTINCT ON (s.step_name)
                   substr(s.step_name, length('kestrel.set_event:') + 1) AS key,
                   s.output -> 'value' AS value
              FROM __schema__.workflow_steps AS s
             WHERE s.execution_id = p_execution AND s.step_id >= 0 AND s.step_id < p_from_step
               AND s.step_name LIKE 'kestrel.set_event:%' AND s.error IS NULL
               AND jsonb_typeof(s.output) = 'object' AND s.output ? 'value'
             ORDER BY s.step_name, s.step_id DESC) AS e;
    IF v_event_keys IS NOT NULL THEN
        INSERT INTO __schema__.events (execution_id, key, value)
        SELECT v_new, u.key, u.value
          FROM unnest(v_event_keys, v_event_values) AS u(key, value);
    END IF;
    PERFORM pg_notify('kestrel.__schema_name__', v_src.queue);
    RETURN v_new;
END
$$;

-- name: archive_finished
-- What finished executions had besides their checkpoints, moved by complete/cancel/
-- quarantine/deadline in the statement that moves them to history: their signals (consumed
-- or not) to signal_history and their events to event_history (migration 0013), each stamped
-- with p_finished_at, the finish time the caller wrote to workflow_history and that
-- partitions it, so the hot tables hold live work only and retention drops all of it with
-- the execution. retry() brings it back. Checkpoints stay where they were written
-- (operation_outputs, partitioned by execution id: migration 0019). Returns the number of
-- rows moved. Each DELETE finds its rows by an index that leads with the execution id; an
-- execution that never signalled or published costs two index probes.
--
-- The time is passed, never read again here: a second read of the clock can differ from
-- the first (a test clock moved while the finishing statement waited on a row a client held;
-- the operator machine's soak found the execution in history with its signals under another
-- time).
--
-- PL/pgSQL (issue 24): Citus plans no statement of a SQL function that uses its parameters.
CREATE OR REPLACE FUNCTION __schema__.archive_finished(p_ids uuid[],
                                                       p_finished_at timestamptz)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint;
BEGIN
    WITH signals_moved AS (
        DELETE FROM __schema__.signals AS s
         WHERE s.execution_id = ANY(p_ids)
     RETURNING s.*
    ), signals_archived AS (
        INSERT INTO __schema__.signal_history
               (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
                consumed_at, execution_finished_at)
        SELECT id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
               consumed_at, p_finished_at
          FROM signals_moved
        RETURNING 1
    ), events_moved AS (
        DELETE FROM __schema__.events AS v
         WHERE v.execution_id = ANY(p_ids)
     RETURNING v.*
    ), events_archived AS (
        INSERT INTO __schema__.event_history
               (execution_id, key, value, updated_at, execution_finished_at)
        SELECT execution_id, key, value, updated_at, p_finished_at
          FROM events_moved
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM signals_archived) + (SELECT count(*) FROM events_archived)
      INTO v_n;
    RETURN v_n;
END
$$;

-- name: archive_steps
-- archive_finished at the current time, for the statements of workers one version older
-- during a rolling deploy (this version's statements pass the time they wrote).
CREATE OR REPLACE FUNCTION __schema__.archive_steps(p_ids uuid[]) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    RETURN __schema__.archive_finished(p_ids, __schema__.kestrel_now());
END
$$;

-- name: save_steps
-- save_steps(): a group commit of step checkpoints from every running execution of a process
-- (kestrel.commits.CheckpointCommits), one JSON array of rows, each [execution, epoch, step,
-- name, [output] or null, [error] or null, attempt, ran_s, waited_s] (statements/steps.py;
-- output and error come wrapped in a one-element array, so SQL NULL, none, and JSON null, a
-- step that returned None, stay apart). A row is written only while its execution is still
-- running under the writer's epoch: the FOR SHARE lock makes a concurrent claim (which
-- updates the row) wait or be waited for, and READ COMMITTED re-checks the epoch on the
-- newest row version, so a superseded epoch can never slip in; a cancelled execution
-- records nothing more (it stops at this step boundary). Returns, per input row, whether the
-- writer still owns the execution, whether this call wrote the row, and what is now
-- recorded there: our row as jsonb normalized it (so the live run returns exactly what a
-- replay will), or the row recorded first.
--
-- p_if_recorded false (what every group commit sends first) inserts without ON CONFLICT:
-- INSERT … ON CONFLICT inserts speculatively and confirms each row with a second WAL record
-- (Heap/HEAP_CONFIRM, 48 bytes a checkpoint; BENCHMARKS.md). A conflict needs a row for the
-- same (execution, step) already there, and under the epoch-checked lock only this
-- process's own earlier try of the same batch can have written one (a lost reply, FAULTS
-- F3). Then the call fails as a whole with unique_violation, nothing of it is written, and
-- db.run calls again with p_if_recorded true (Stmt.if_recorded): ON CONFLICT DO NOTHING
-- keeps the first committed output, which the last statement returns.
--
-- started_at and finished_at are the database clock less the seconds since the body started
-- and ended (the worker's monotonic clock): a worker whose wall clock is skewed or jumps never
-- writes its time into a row.
--
-- The Citus form of save_new_steps_batch / save_steps_batch (sql/queries/steps.sql): the
-- worker sends it instead of them where its schema is a Citus distributed schema
-- (distributed_schema()), and there migrate delegates it to the tenant's node
-- (delegate_functions), so a batch is one round trip, run on that node, with no other node
-- in its transaction. Three plain statements (lock, insert, read back), because Citus plans
-- a statement with an INSERT in a CTE CTE by CTE even on the tenant's node, and that
-- statement's final join then reads the whole checkpoint table back (docs/citus.md). On one
-- PostgreSQL the statements are cheaper (bench/checkpoint_batch.py), so they stay there.
CREATE OR REPLACE FUNCTION __schema__.save_steps(p_rows jsonb, p_if_recorded boolean)
RETURNS TABLE (execution_id uuid, step_id integer, owned boolean, inserted boolean,
               step_name text, output jsonb, error jsonb, cancelled boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_owned text[];      -- 'execution/epoch' of the executions written for, locked
    v_writable uuid[];   -- of those, the ones not cancelled
    v_new text[] := '{}';  -- 'execution/step' of the rows this call wrote
    v_key text;
BEGIN
    -- 1. Lock what this batch writes for, in id order (lock order: see heartbeat).
    -- By primary key; whether each runs is asked of the locked row, in FILTER (a condition
    -- over the locked subquery is pushed into its scan; the rule for held rows: see the
    -- heartbeat statement). The epoch is matched in step 2.
    SELECT coalesce(array_agg(o.id::text || '/' || o.lease_epoch)
                        FILTER (WHERE o.status = 'running'), '{}'),
           coalesce(array_agg(o.id)
                        FILTER (WHERE o.status = 'running' AND NOT o.cancel_requested), '{}')
      INTO v_owned, v_writable
      FROM (SELECT e.id, e.lease_epoch, e.status, e.cancel_requested
              FROM __schema__.workflow_executions AS e
             WHERE e.id = ANY (ARRAY(SELECT (r->>0)::uuid FROM jsonb_array_elements(p_rows) AS r))
             ORDER BY e.id
               FOR SHARE OF e) AS o;
    -- 2. Write the rows of executions owned under their epoch and not cancelled.
    IF p_if_recorded THEN
        FOR v_key IN
            INSERT INTO __schema__.operation_outputs AS o
                   (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                    started_at, finished_at, tries)
            SELECT (r->>0)::uuid, (r->>2)::integer, r->>3,
                   CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
                   CASE WHEN jsonb_typeof(r->5) = 'array' THEN r->5->0 END,
                   (r->>6)::integer, (r->>1)::integer,
                   __schema__.kestrel_now() - make_interval(secs => (r->>7)::float8),
                   __schema__.kestrel_now() - make_interval(secs => (r->>8)::float8),
                   CASE WHEN jsonb_typeof(r->9) = 'array' THEN r->9 END
              FROM jsonb_array_elements(p_rows) AS r
             WHERE (r->>0) || '/' || (r->>1) = ANY (v_owned)
               AND (r->>0)::uuid = ANY (v_writable)
                ON CONFLICT (execution_id, step_id) DO NOTHING
            RETURNING o.execution_id::text || '/' || o.step_id
        LOOP
            v_new := v_new || v_key;
        END LOOP;
    ELSE
        FOR v_key IN
            INSERT INTO __schema__.operation_outputs AS o
                   (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                    started_at, finished_at, tries)
            SELECT (r->>0)::uuid, (r->>2)::integer, r->>3,
                   CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
                   CASE WHEN jsonb_typeof(r->5) = 'array' THEN r->5->0 END,
                   (r->>6)::integer, (r->>1)::integer,
                   __schema__.kestrel_now() - make_interval(secs => (r->>7)::float8),
                   __schema__.kestrel_now() - make_interval(secs => (r->>8)::float8),
                   CASE WHEN jsonb_typeof(r->9) = 'array' THEN r->9 END
              FROM jsonb_array_elements(p_rows) AS r
             WHERE (r->>0) || '/' || (r->>1) = ANY (v_owned)
               AND (r->>0)::uuid = ANY (v_writable)
            RETURNING o.execution_id::text || '/' || o.step_id
        LOOP
            v_new := v_new || v_key;
        END LOOP;
    END IF;
    -- 3. Per position: owned, written by this call, and for one it did not write the row
    -- recorded first. The plain INSERT above wrote every position it could or failed whole,
    -- so only the ON CONFLICT form looks for rows recorded first (a pseudo-constant join
    -- condition: no probe at all in the other); the worker knows what it wrote.
    RETURN QUERY
    SELECT (r->>0)::uuid, (r->>2)::integer,
           (r->>0) || '/' || (r->>1) = ANY (v_owned),
           (r->>0) || '/' || (r->>2) = ANY (v_new),
           p.step_name, p.output, p.error,
           (r->>0) || '/' || (r->>1) = ANY (v_owned) AND NOT (r->>0)::uuid = ANY (v_writable)
      FROM jsonb_array_elements(p_rows) AS r
      LEFT JOIN __schema__.operation_outputs AS p
             ON p_if_recorded AND NOT ((r->>0) || '/' || (r->>2) = ANY (v_new))
            AND p.execution_id = (r->>0)::uuid AND p.step_id = (r->>2)::integer;
END;
$$;

-- name: move_finished
-- move_finished(): what finishing executions does, as plain statements, for the Citus forms
-- of the statements that finish them (finish_batch(), sweep_expired(), fail_late()): each of
-- p_ids (locked by the caller, in id order with the parents they tell) ends with
-- p_status[i], p_result[i], p_error[i]. Tell each parent that does not finish here, one
-- word per child (child_finished(): its signal, its signal_seq, its wake-up when it waits
-- for that child; a parent no longer live gets none); move the executions to history under
-- p_now, their signals and events after them (archive_finished(); their checkpoints stay
-- where they were written, migration 0019). Plain
-- statements because Citus plans a statement with an INSERT in a CTE CTE by CTE even on the
-- tenant's node (docs/citus.md); on one PostgreSQL those statements stay (one statement is
-- cheaper there).
CREATE OR REPLACE FUNCTION __schema__.move_finished(
    p_ids uuid[], p_status text[], p_result jsonb[], p_error jsonb[], p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_children uuid[];  -- the finishing rows, and their parents (NULL: none)
    v_parents uuid[];
    v_live uuid[];      -- of those parents, the ones still live
BEGIN
    -- Read once, by primary key alone, and only then asked for a parent (the rule for
    -- held rows: see the heartbeat statement; `parent_id IS NOT NULL` in this scan would
    -- read the parent index, every child's entry).
    SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(c.parent_id), '{}')
      INTO v_children, v_parents
      FROM __schema__.workflow_executions AS c
     WHERE c.id = ANY (p_ids);
    SELECT coalesce(array_agg(p.id), '{}') INTO v_live
      FROM __schema__.workflow_executions AS p
     WHERE p.id = ANY (v_parents);
    UPDATE __schema__.workflow_executions AS p
       SET signal_seq = p.signal_seq + t.n,
           wake_at = CASE WHEN p.status = 'waiting' AND p.waiting_for = ANY (t.waits)
                          THEN p_now ELSE p.wake_at END
      FROM (SELECT c.parent_id, count(*) AS n, array_agg('kestrel.child:' || c.id) AS waits
              FROM unnest(v_children, v_parents) AS c(id, parent_id)
             WHERE c.parent_id IS NOT NULL
               AND NOT c.parent_id = ANY (p_ids)
             GROUP BY c.parent_id) AS t
     WHERE p.id = t.parent_id;
    INSERT INTO __schema__.signals (execution_id, name, payload, idempotency_key)
    SELECT c.parent_id, 'kestrel.child:' || c.id,
           jsonb_build_object('status', f.status, 'result', f.result, 'error', f.error),
           'kestrel.child:' || c.id
      FROM unnest(v_children, v_parents) AS c(id, parent_id)
      JOIN unnest(p_ids, p_status, p_result, p_error) AS f(id, status, result, error)
        ON f.id = c.id
     WHERE c.parent_id IS NOT NULL
       AND NOT c.parent_id = ANY (p_ids)
       AND c.parent_id = ANY (v_live)  -- (Citus: no correlated subquery beside unnest)
        ON CONFLICT (execution_id, idempotency_key) DO NOTHING;
    INSERT INTO __schema__.workflow_history
           (id, workflow, queue, priority, status, args, result, error, idempotency_key,
            lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
            app_version, concurrency_key, tags)
    SELECT e.id, e.workflow, e.queue, e.priority, f.status, e.args, f.result, f.error,
           e.idempotency_key, e.lease_epoch, e.attempts, e.created_at, e.started_at, p_now,
           e.parent_id, e.deadline, e.app_version, e.concurrency_key, e.tags
      FROM __schema__.workflow_executions AS e
      JOIN unnest(p_ids, p_status, p_result, p_error) AS f(id, status, result, error)
        ON f.id = e.id;
    INSERT INTO __schema__.signal_history
           (id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
            consumed_at, execution_finished_at)
    SELECT id, execution_id, name, payload, idempotency_key, created_at, consumed_step,
           consumed_at, p_now
      FROM __schema__.signals
     WHERE execution_id = ANY (p_ids);
    DELETE FROM __schema__.signals WHERE execution_id = ANY (p_ids);
    INSERT INTO __schema__.event_history
           (execution_id, key, value, updated_at, execution_finished_at)
    SELECT execution_id, key, value, updated_at, p_now
      FROM __schema__.events
     WHERE execution_id = ANY (p_ids);
    DELETE FROM __schema__.events WHERE execution_id = ANY (p_ids);
    DELETE FROM __schema__.workflow_executions WHERE id = ANY (p_ids);
END;
$$;

-- name: finish_batch
-- finish_batch(): complete_batch in its Citus form (sql/queries/executions.sql), as
-- save_steps() is the checkpoint batch's: the worker sends it where its schema is a Citus
-- distributed schema, and there migrate delegates it to the tenant's node, so a batch of
-- completions is one round trip, run there, with no other node in its transaction (the
-- statement is planned CTE by CTE: 15 commands, intermediate results copied to every node,
-- a two-phase commit on each, so a node that is down stalls every tenant's completions).
-- p_rows as complete_batch's: [execution, epoch, status, [result] or null, [error] or null]
-- and the tail's seven fields, or none.
-- In the statement's order: lock the finishing executions and the parents they tell in id
-- order; take those still running under the batch's epoch (the others were fenced); finish
-- them (move_finished()); return their ids. It raises no notification: one raised on the
-- tenant's node would not reach the listeners on the coordinator, so the worker sends
-- notify_done there after it.
CREATE OR REPLACE FUNCTION __schema__.finish_batch(p_rows jsonb)
RETURNS TABLE (id uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_locked uuid[];     -- the rows locked: the batch's and their parents
    v_epochs integer[];  -- their epochs and states, as locked
    v_states text[];
    v_ids uuid[];
    v_status text[];
    v_result jsonb[];
    v_error jsonb[];
BEGIN
    -- Lock every row this call changes, in id order (lock order: see heartbeat).
    -- Each by its primary key, as complete_batch does (an `IN (…)` planned sequential scans).
    -- Which of them still run under the batch's epoch is asked of the locked rows, not of
    -- the table again (the rule for held rows: see the heartbeat statement).
    SELECT coalesce(array_agg(l.id), '{}'), coalesce(array_agg(l.lease_epoch), '{}'),
           coalesce(array_agg(l.status), '{}')
      INTO v_locked, v_epochs, v_states
      FROM (SELECT e.id, e.lease_epoch, e.status
              FROM __schema__.workflow_executions AS e
             WHERE e.id = ANY (ARRAY(SELECT (r->>0)::uuid FROM jsonb_array_elements(p_rows) AS r
                                     UNION
                                     SELECT c.parent_id
                                       FROM __schema__.workflow_executions AS c
                                      WHERE c.id = ANY (ARRAY(SELECT (r->>0)::uuid
                                                                FROM jsonb_array_elements(p_rows)
                                                                  AS r))))
             ORDER BY e.id
               FOR UPDATE OF e) AS l;
    SELECT coalesce(array_agg(l.id), '{}'), array_agg(r->>2),
           array_agg(CASE WHEN jsonb_typeof(r->3) = 'array' THEN r->3->0 END),
           array_agg(CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END)
      INTO v_ids, v_status, v_result, v_error
      FROM unnest(v_locked, v_epochs, v_states) AS l(id, lease_epoch, status)
      JOIN jsonb_array_elements(p_rows) AS r
        ON l.id = (r->>0)::uuid AND l.lease_epoch = (r->>1)::integer
     WHERE l.status = 'running'
       AND NOT EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                        WHERE o.execution_id = l.id AND o.step_id = (r->>5)::integer);
    IF cardinality(v_ids) > 0 THEN
        -- The tails of those finishing (complete_batch: what a tail is, and why one whose
        -- position is recorded already leaves its execution unfinished).
        INSERT INTO __schema__.operation_outputs
               (execution_id, step_id, step_name, output, error, attempt, lease_epoch,
                started_at, finished_at, tries)
        SELECT (r->>0)::uuid, (r->>5)::integer, r->>6,
               CASE WHEN jsonb_typeof(r->7) = 'array' THEN r->7->0 END,
               CASE WHEN jsonb_typeof(r->8) = 'array' THEN r->8->0 END,
               (r->>9)::integer, (r->>1)::integer,
               __schema__.kestrel_now() - make_interval(secs => (r->>10)::float8),
               __schema__.kestrel_now() - make_interval(secs => (r->>11)::float8),
               CASE WHEN jsonb_typeof(r->12) = 'array' THEN r->12 END
          FROM jsonb_array_elements(p_rows) AS r
         WHERE (r->>0)::uuid = ANY (v_ids)
           AND r->>5 IS NOT NULL;
        PERFORM __schema__.move_finished(v_ids, v_status, v_result, v_error,
                                         __schema__.kestrel_now());
    END IF;
    RETURN QUERY SELECT unnest(v_ids);
END;
$$;

-- name: sweep_expired
-- sweep_expired(): reenqueue_expired in its Citus form (sql/queries/sweeper.sql), delegated
-- to the tenant's node like finish_batch(): the sweeper's round is then one round trip to
-- that node with no other node in its transaction, where the statement commits in two
-- phases on every node (so a node that is down stalled every tenant's recovery). The same
-- steps: lock up to p_limit running executions whose lease expired, oldest expiry first,
-- skipping rows someone holds; put those with attempts left back in the queue; quarantine
-- the others (move_finished(), a parent told). Returns what the statement's caller reads
-- of it: requeued, quarantined, examined.
CREATE OR REPLACE FUNCTION __schema__.sweep_expired(p_limit integer, p_max_attempts integer)
RETURNS TABLE (requeued bigint, quarantined bigint, examined bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := __schema__.kestrel_now();
    v_expired uuid[];
    v_poisoned uuid[];
    v_errors jsonb[];
    v_requeued bigint := 0;
BEGIN
    SELECT coalesce(array_agg(x.id), '{}'),
           coalesce(array_agg(x.id) FILTER (WHERE x.attempts >= p_max_attempts), '{}'),
           coalesce(array_agg(jsonb_build_object(
               'type', 'Quarantined',
               'message', format('claimed %s times without finishing (max_attempts = %s): '
                                 'the execution keeps losing its worker',
                                 x.attempts, p_max_attempts)))
               FILTER (WHERE x.attempts >= p_max_attempts), '{}')
      INTO v_expired, v_poisoned, v_errors
      FROM (SELECT e.id, e.attempts
              FROM __schema__.workflow_executions AS e
             WHERE e.status = 'running'
               AND e.lease_expires_at < v_now
             ORDER BY e.lease_expires_at
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) AS x;
    UPDATE __schema__.workflow_executions AS e
       SET status = 'queued',
           lease_owner = NULL,
           lease_expires_at = NULL,
           updated_at = v_now
     WHERE e.id = ANY (v_expired)
       AND NOT e.id = ANY (v_poisoned);
    GET DIAGNOSTICS v_requeued = ROW_COUNT;
    IF cardinality(v_poisoned) > 0 THEN
        PERFORM __schema__.move_finished(
            v_poisoned, array_fill('quarantined'::text, ARRAY[cardinality(v_poisoned)]),
            array_fill(NULL::jsonb, ARRAY[cardinality(v_poisoned)]), v_errors, v_now);
    END IF;
    RETURN QUERY SELECT v_requeued, cardinality(v_poisoned)::bigint,
                        cardinality(v_expired)::bigint;
END;
$$;

-- name: fail_late
-- fail_late(): expire_deadlines in its Citus form (sql/queries/sweeper.sql), delegated to
-- the tenant's node like sweep_expired(): fail up to p_limit queued and waiting executions
-- whose workflow deadline passed, earliest first, skipping rows someone holds; each leaves
-- a row for the metrics collector (uncounted_finishes); their parents are told
-- (move_finished()). Returns how many it failed.
CREATE OR REPLACE FUNCTION __schema__.fail_late(p_limit integer)
RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := __schema__.kestrel_now();
    v_ids uuid[];
    v_errors jsonb[];
BEGIN
    SELECT coalesce(array_agg(x.id), '{}'),
           coalesce(array_agg(jsonb_build_object(
               'type', 'kestrel.errors.DeadlineExceeded',
               'message', format('workflow deadline %s passed', x.deadline))), '{}')
      INTO v_ids, v_errors
      FROM (SELECT e.id, e.deadline
              FROM __schema__.workflow_executions AS e
             WHERE e.deadline < v_now
               AND e.status IN ('queued', 'waiting')
             ORDER BY e.deadline
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) AS x;
    IF cardinality(v_ids) > 0 THEN
        INSERT INTO __schema__.uncounted_finishes (execution_id, workflow, status, deadline)
        SELECT e.id, e.workflow, 'failed', true
          FROM __schema__.workflow_executions AS e
         WHERE e.id = ANY (v_ids);
        PERFORM __schema__.move_finished(
            v_ids, array_fill('failed'::text, ARRAY[cardinality(v_ids)]),
            array_fill(NULL::jsonb, ARRAY[cardinality(v_ids)]), v_errors, v_now);
    END IF;
    RETURN cardinality(v_ids);
END;
$$;

-- name: distributed_schema
-- distributed_schema(): whether this schema is a Citus distributed schema (schema-based
-- sharding), where the worker sends the Citus forms of its statements (save_steps()). False
-- anywhere else: plain PostgreSQL, a Citus schema that is not distributed. The catalog is
-- read through EXECUTE: it does not exist without Citus.
CREATE OR REPLACE FUNCTION __schema__.distributed_schema() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_distributed boolean := false;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_schema') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_schema '
                'WHERE schemaid = $1::regnamespace)'
           INTO v_distributed USING '__schema__';
    END IF;
    RETURN v_distributed;
END;
$$;

-- name: consume_signal
-- consume_signal(): take the oldest pending signal p_name for an execution this worker owns
-- under p_epoch and record it as the checkpoint of the wait at p_step_id, so the signal is
-- consumed exactly when the checkpoint is written. Returns ownership, the cancel flag, the
-- recorded output (NULL when no signal is pending) and signal_seq for a following park: any
-- signal() that bumped signal_seq before the lock was granted is visible to the scan.
--
-- Idempotent per position (FAULTS R2): when the wait's position already has a checkpoint (an
-- earlier call committed and its reply was lost), that recorded output is returned and no
-- other signal is taken. Under the epoch's row lock only this attempt writes checkpoints of
-- this execution, and nothing but this wait records at its position, so what is there is
-- this wait's: the signal it consumed, or its timeout. The row lock is exclusive (NO KEY
-- UPDATE, which heartbeats and signal() conflict with anyway), so a retry that reaches the
-- server while the lost call still runs there waits for it and then finds its checkpoint;
-- the INSERT has no ON CONFLICT: a conflict would undo the signal's consumption with it.
CREATE OR REPLACE FUNCTION __schema__.consume_signal(
    p_id uuid, p_epoch integer, p_step_id integer, p_name text, p_step_name text,
    OUT owned boolean, OUT cancelled boolean, OUT output jsonb, OUT signal_seq bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_payload jsonb;
BEGIN
    SELECT e.signal_seq, e.cancel_requested INTO signal_seq, cancelled
      FROM __schema__.workflow_executions AS e
     WHERE e.id = p_id AND e.lease_epoch = p_epoch AND e.status = 'running'
       FOR NO KEY UPDATE;
    owned := FOUND;
    cancelled := coalesce(cancelled, false);
    IF NOT owned OR cancelled THEN
        RETURN;
    END IF;
    SELECT o.output INTO output
      FROM __schema__.operation_outputs AS o
     WHERE o.execution_id = p_id AND o.step_id = p_step_id;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A new statement, a new snapshot: it sees every signal committed before the lock.
    UPDATE __schema__.signals AS s
       SET consumed_step = p_step_id, consumed_at = __schema__.kestrel_now()
     WHERE s.id = (SELECT p.id FROM __schema__.signals AS p
                    WHERE p.execution_id = p_id AND p.name = p_name
                      AND p.consumed_step IS NULL
                    ORDER BY p.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED)
    RETURNING s.payload INTO v_payload;
    IF FOUND THEN
        INSERT INTO __schema__.operation_outputs
               (execution_id, step_id, step_name, output, attempt, lease_epoch, started_at)
        VALUES (p_id, p_step_id, p_step_name,
                jsonb_build_object('received', true, 'payload', v_payload), 1, p_epoch,
                __schema__.kestrel_now())
        RETURNING operation_outputs.output INTO output;
    END IF;
END
$$;

-- name: park_execution
-- park_execution(): park a running execution at a wait (no lease, no slot, one row) and say
-- what happened, so the worker never mistakes a decision for a lost lease (FAULTS X2, X4):
--   parked     parked now, or by an earlier call whose reply was lost (same epoch, same wait)
--   cancelled  a cancel was requested: the worker finishes the execution as cancelled
--   signalled  a signal arrived since p_seen_seq was read: look for it again
--   lost       a newer claim owns it, or it has left the hot table
--   recorded   the wait's position already has a checkpoint (FAULTS R2): nothing is parked;
--              the worker replays that checkpoint (a parked position must have none, or the
--              wake-up would replay it and the wait would never be looked at again)
-- A re-park of the same wait keeps the original deadline; attempts restart at 0 (a clean
-- park is progress, not a lost worker).
CREATE OR REPLACE FUNCTION __schema__.park_execution(
    p_id uuid, p_epoch integer, p_step_id integer, p_waiting_for text,
    p_seconds double precision, p_seen_seq bigint
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v record;
    -- Read once, used inside CASE as a parameter (Citus refuses the call there: issue 24),
    -- and so is the wait's end: timestamptz + interval is STABLE too, and inside a CASE it
    -- failed every timed wait on Citus (issue 44).
    v_now timestamptz := __schema__.kestrel_now();
    v_until timestamptz := v_now + make_interval(secs => p_seconds);
BEGIN
    UPDATE __schema__.workflow_executions AS e
       SET status = 'waiting',
           lease_owner = NULL,
           lease_expires_at = NULL,
           attempts = 0,
           waiting_for = p_waiting_for,
           wait_deadline = CASE
               WHEN e.wait_step IS NOT DISTINCT FROM p_step_id AND e.wait_deadline IS NOT NULL
               THEN e.wait_deadline
               ELSE v_until END,
           wake_at = CASE
               WHEN e.wait_step IS NOT DISTINCT FROM p_step_id AND e.wait_deadline IS NOT NULL
               THEN e.wait_deadline
               ELSE v_until END,
           wait_step = p_step_id,
           updated_at = v_now
     WHERE e.id = p_id
       AND e.lease_epoch = p_epoch
       AND e.status = 'running'
       AND NOT e.cancel_requested
       AND (p_seen_seq IS NULL OR e.signal_seq = p_seen_seq)
       AND NOT EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                        WHERE o.execution_id = p_id AND o.step_id = p_step_id);
    IF FOUND THEN
        RETURN 'parked';
    END IF;
    SELECT e.status, e.lease_epoch, e.wait_step, e.cancel_requested INTO v
      FROM __schema__.workflow_executions AS e
     WHERE e.id = p_id
       FOR SHARE;
    IF NOT FOUND OR v.lease_epoch <> p_epoch THEN
        RETURN 'lost';
    END IF;
    IF v.status = 'waiting' AND v.wait_step = p_step_id THEN
        RETURN 'parked';
    END IF;
    IF v.status <> 'running' THEN
        RETURN 'lost';
    END IF;
    IF v.cancel_requested THEN
        RETURN 'cancelled';
    END IF;
    IF EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                WHERE o.execution_id = p_id AND o.step_id = p_step_id) THEN
        RETURN 'recorded';
    END IF;
    RETURN 'signalled';
END
$$;

-- name: history_of
-- Kept for the claims of workers one version older during a rolling deploy: this version's
-- claim writes the same in the statement (sql/fragments/claim.sql, claim_result).
-- history_of(): an execution's checkpoints as a replay needs them, as JSON text
-- ([[step_id, name, output, error], ...]), or {"too_large": bytes} when they are over
-- p_max_bytes. The aggregate only ever holds p_max_bytes, so no history, however large, can
-- make a claim fail for the executions claimed beside it (jsonb's 256 MB limit, out of
-- memory). NULL when nothing is recorded.
CREATE OR REPLACE FUNCTION __schema__.history_of(p_id uuid, p_max_bytes bigint) RETURNS text
LANGUAGE sql STABLE AS $$
    WITH s AS (
        SELECT o.step_id, t, sum(octet_length(t)) OVER (ORDER BY o.step_id) AS upto
          FROM __schema__.operation_outputs AS o,
               LATERAL (SELECT jsonb_build_array(o.step_id, o.step_name, o.output,
                                                 o.error)::text AS t) AS x
         WHERE o.execution_id = p_id
    )
    SELECT CASE WHEN max(upto) > p_max_bytes
                THEN format('{"too_large": %s}', max(upto))
                ELSE '[' || string_agg(t, ',' ORDER BY step_id)
                            FILTER (WHERE upto <= p_max_bytes) || ']' END
      FROM s
$$;
