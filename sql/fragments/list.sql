-- Fragments of the list statements (sql/queries/http.sql), written once and included
-- where a statement says `-- include: <name>` (see claim.sql).

-- name: page_filter
-- The list page's filters (NULL = any) and its keyset cursor (created_at, id), for each
-- branch that reads the page's rows in its (created_at DESC, id DESC) order.
AND (%(status)s::text IS NULL OR status = %(status)s::text)
            AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
            AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
            AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
            AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
            AND (%(after_at)s::timestamptz IS NULL
                 OR (created_at, id) < (%(after_at)s::timestamptz, %(after_id)s::uuid))
