"""The statements of ``kestrel-runtime migrate`` (``sql/queries/migrate.sql``), run in a few
short transactions by :mod:`kestrel.migrate`, each under the (transaction-level) advisory
lock."""

from __future__ import annotations

from kestrel.sql import Queries, derived
from kestrel.statements.stmt import Stmt, command, first


def migrate_lock(q: Queries) -> Stmt[None]:
    """Wait for any other migrate of this schema (released at COMMIT)."""
    return command(q.migrate_lock)


def create_schema(q: Queries) -> Stmt[None]:
    """Create the schema if it does not exist."""
    return command(q.create_schema)


def may_migrate(q: Queries) -> Stmt[bool]:
    """Whether this role may migrate the schema (owns it, or may create it)."""
    return Stmt(q.may_migrate, None, lambda rows: bool(first(rows)))


def migrations_table_exists(q: Queries) -> Stmt[bool]:
    """Whether the schema has its migration record."""
    return Stmt(q.migrations_table_exists, None, lambda rows: bool(first(rows)))


def applied_migrations(q: Queries) -> Stmt[set[int]]:
    """The versions of the migrations applied."""
    return Stmt(q.applied_migrations, None, lambda rows: {int(r[0]) for r in rows})


def current_migration(q: Queries) -> Stmt[int]:
    """The newest applied migration, 0 when none."""
    return Stmt(q.current_migration, None, lambda rows: int(first(rows) or 0))


def record_migration(q: Queries, *, version: int, name: str) -> Stmt[None]:
    """Record migration *version* as applied."""
    return command(q.record_migration, {"version": version, "name": name})


def apply(text: str) -> Stmt[None]:
    """One migration or function definition of ``sql/`` (rendered for the schema)."""
    return command(text)


def ensure_current_partitions(q: Queries, *, interval: str, ahead: int,
                              current: bool) -> Stmt[None]:
    """History partitions *ahead*, and the current period's on install or upgrade only."""
    return command(q.ensure_current_partitions,
                   {"interval": interval, "ahead": ahead, "current": current})


def set_clock_kind(q: Queries, *, test_clock: bool) -> Stmt[None]:
    """Which clock a migration that makes one gives the schema (transaction-local)."""
    return command(q.set_clock_kind, {"test_clock": "on" if test_clock else "off"})


def has_test_clock(q: Queries) -> Stmt[bool]:
    """Whether the schema was made for tests (it has the movable clock)."""
    return Stmt(q.has_test_clock, None, lambda rows: bool(first(rows)))


def lock_test_clock(q: Queries) -> Stmt[None]:
    """Wait for a test moving the clock to commit."""
    return command(q.lock_test_clock)


def delegate_functions(q: Queries) -> Stmt[None]:
    """In a Citus distributed schema: run save_steps() on the tenant's node."""
    return command(q.delegate_functions)


def distributed_schema(q: Queries) -> Stmt[bool]:
    """Whether the schema is a Citus distributed schema (the Citus forms are sent there)."""
    return Stmt(q.distributed_schema, None, lambda rows: bool(rows and rows[0][0]))


def functions_version(q: Queries) -> Stmt[int]:
    """The version of the schema's functions (fails with undefined_function on a schema
    whose functions predate ``kestrel_functions_version()``: version 0)."""
    return Stmt(q.functions_version, None, lambda rows: int(rows[0][0]))


def node_lock_timeout(q: Queries) -> Stmt[str | None]:
    """On a Citus coordinator, the lock_timeout this role gets on the worker nodes ('0':
    none); None elsewhere."""
    return Stmt(q.node_lock_timeout, None, first)


def bucket_table_exists(q: Queries) -> Stmt[bool]:
    """Whether the schema has the bucket table (migration 0021)."""
    return Stmt(q.bucket_table_exists, None, lambda rows: bool(first(rows)))


def migrate_finished(q: Queries) -> Stmt[bool]:
    """Whether a migrate ever finished on the schema (its functions are installed)."""
    return Stmt(q.migrate_finished, None, lambda rows: bool(first(rows)))


def read_bucket(q: Queries) -> Stmt[tuple[int, int] | None]:
    """``(bucket, buckets)`` of a bucket's schema; None for an ordinary schema."""
    return Stmt(q.read_bucket, None,
                lambda rows: (int(rows[0][0]), int(rows[0][1])) if rows else None)


def record_bucket(q: Queries, *, bucket: int, buckets: int) -> Stmt[None]:
    """Make the schema bucket *bucket* of *buckets* unless it is a bucket already."""
    return command(q.record_bucket, {"bucket": bucket, "buckets": buckets})


def set_bucket(q: Queries, bucket: int) -> Stmt[None]:
    """Give the schema's ``kestrel_bucket()`` the number *bucket* (an ``int``, checked here:
    it is written into the function's body)."""
    if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket < 256:
        raise ValueError(f"not a bucket: {bucket!r}")
    return command(derived("set_bucket", q.set_bucket.replace("__bucket__", str(bucket))))
