-- Fragments of the list statements (sql/queries/http.sql), written once and included
-- where a statement says `-- include: <name>` (see claim.sql).

-- name: page_filter
-- The list page's filters (NULL = any) and its keyset cursor (created_at, id), for each
-- branch that reads the page's rows in its (created_at DESC, id DESC) order; also what a
-- bulk action counts and pages through (count_executions, kestrel.client's bulk).
AND (%(status)s::text IS NULL OR status = %(status)s::text)
            AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
            AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
            AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
            AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
            AND (%(app_version)s::text IS NULL OR app_version = %(app_version)s::text)
            -- Tags (migration 0025): every one given must match. Containment, so that the
            -- tags' GIN index (jsonb_path_ops, rows with tags only) answers it.
            AND (%(tags)s::jsonb IS NULL OR tags @> %(tags)s::jsonb)
            -- With a patch (list_executions): those that recorded its marker, or (not
            -- with_patch) those of its workflows that did not.
            AND (%(patch)s::text IS NULL
                 OR EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                             WHERE o.execution_id = id AND o.step_id < 0
                               AND o.step_name = 'kestrel.patch:' || %(patch)s::text)
                    = %(with_patch)s
                    AND workflow IN (SELECT p.workflow FROM __schema__.patch_markers AS p
                                      WHERE p.patch = %(patch)s::text))
            AND (%(after_at)s::timestamptz IS NULL
                 OR (created_at, id) < (%(after_at)s::timestamptz, %(after_id)s::uuid))
