-- Every kestrel SQL function as it is now, one family a file: the one place to read or
-- change one. `migrate` creates them in file order (00_ to 40_): a SQL-language function
-- after the functions it calls (PL/pgSQL bodies are resolved when they run).
--
-- `kestrel-runtime migrate` applies these files after the migrations, every time (CREATE
-- OR REPLACE), so a change to a function is made here and needs no migration. Migrations
-- only change tables, indexes and views — and DROP a function whose signature or return
-- type changes (CREATE OR REPLACE cannot change those; it would add an overload instead).
-- tests/integration/test_schema.py checks that the schema holds exactly the functions
-- defined here and in sql/partitions.
--
-- This file: The rules every door shares: the functions version, the clock, bucket and id
-- helpers, and the checks of names, tags, numbers, payloads and trace context.

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
