-- 0021: a schema can be one bucket of a namespace spread over several schemas (issue 24,
-- step 2; kestrel.buckets, docs/citus.md).
--
-- A bucket's schema holds one row here, its number and its namespace's bucket count, written
-- by `migrate --buckets N` when the namespace is made and never changed (ids made for a
-- bucket name it modulo the count). An ordinary schema holds none. migrate reads it to give
-- the schema's kestrel_bucket() its number, which new_execution_id() writes into every id it
-- makes.
CREATE TABLE __schema__.bucket (
    one     boolean PRIMARY KEY DEFAULT true CHECK (one),
    bucket  integer NOT NULL,
    buckets integer NOT NULL,
    CHECK (buckets BETWEEN 2 AND 256 AND bucket >= 0 AND bucket < buckets)
);
