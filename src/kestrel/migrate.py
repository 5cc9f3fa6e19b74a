"""Apply the forward-only migrations in ``sql/migrations`` under an advisory lock, then
(re)install every function from ``sql/functions`` and ``sql/partitions``.

Each pending migration runs in a transaction of its own (:func:`migrate` says why) that
first takes a transaction-level advisory lock keyed on the schema and looks again at what is
applied, so concurrent starts serialize and the later ones find nothing to do. A
transaction-level lock is released at COMMIT: no session state is left behind, which keeps
this safe behind PgBouncer in transaction mode.

The clock (migration 0016): a production schema's ``kestrel_now()`` is ``now()``; a schema
made for tests (``test_clock=True``: kestrel.testing's and the test suite's) gets a clock the
tests move (``sql/testclock``). The kind is chosen when the schema is made and recorded in it,
so a later ``migrate`` (a runtime starting on a test's schema) keeps it.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from kestrel import connections, db, statements
from kestrel.errors import MigrationError
from kestrel.sql import (
    Migration,
    Queries,
    functions,
    functions_version,
    migrations,
    movable_clock,
    queries,
)

log = logging.getLogger("kestrel.migrate")

CLOCK_MIGRATION = 16
"""The migration that gives each schema its kind of clock (production's or a test's)."""

BUCKET_MIGRATION = 21
"""The migration that makes the table naming a bucket's number (:mod:`kestrel.buckets`)."""


def migrate(dsn: str, schema: str, *, history_interval: str = "day",
            history_ahead: int = 3, test_clock: bool = False,
            bucket: tuple[int, int] | None = None) -> list[int]:
    """Bring *schema* up to date; return the versions applied now (empty if none).

    *bucket*, ``(k, n)``, makes the schema bucket *k* of a namespace of *n*
    (:mod:`kestrel.buckets`; :func:`migrate_namespace` migrates them all); a schema that is
    a bucket stays the one it was made as, and its ``kestrel_bucket()`` is reinstalled
    with the functions every time.

    Also creates the history partitions of the next *history_ahead* periods, and on install
    or upgrade the current period's (the runtime's upkeep only ever adds future ones).

    *test_clock* makes the schema one for tests, whose clock tests move (kestrel.testing);
    only a new schema (or one from before migration 0016) can be made so. Without it a
    schema keeps the clock it was made with.

    The work is a few short transactions, each under the advisory lock: the schema, then each
    migration with its record, then the functions. A migrate stopped part-way (its reply
    lost, its process killed) leaves whole migrations behind, and the next one goes on from
    there. One transaction for everything failed on Citus for a role without superuser: a
    ``bigserial`` made in the transaction that made its schema (and the function its default
    calls) is recorded by Citus over a connection of its own, which cannot see either yet
    (issue 44).

    Raises:
        MigrationError: the database has migrations newer than this code knows, or
            *test_clock* was asked of a production schema, or *bucket* of a schema that
            is another bucket already or an ordinary one.
    """
    pending = migrations(schema)
    q = queries(schema)
    # No prepared statements: through a transaction-mode PgBouncer a statement psycopg
    # prepares here (it runs the same INSERT once per migration) would outlive this
    # transaction on the server connection and collide with the next migrate's.
    with connections.connect(dsn, prepare_threshold=None) as conn:
        applied = _in_transaction(conn, q, _begin, schema, pending, test_clock, bucket)
        done = []
        for m in pending:
            if m.version not in applied and _in_transaction(conn, q, _apply, m, test_clock,
                                                            bucket):
                done.append(m.version)
                log.debug("applied migration %04d_%s to schema %s", m.version, m.name, schema)
        _in_transaction(conn, q, _finish, schema, history_interval, history_ahead, bool(done),
                        bucket)
    return done


def _in_transaction(conn: psycopg.Connection[Any], q: Queries, body: Any, *args: Any) -> Any:
    """*body(run, q, *args)* in a transaction of its own, begun with the advisory lock; *run*
    executes one named statement and remembers it for the lost-reply failpoints."""
    sent: list[statements.Stmt[Any]] = []

    def run(stmt: statements.Stmt[Any]) -> Any:
        sent.append(stmt)
        return db.run_sync(conn, stmt)

    with conn.transaction():
        run(statements.migrate.migrate_lock(q))
        result = body(run, q, *args)
    db.committed_sync(conn, sent)
    return result


def _begin(run: Any, q: Queries, schema: str, pending: list[Migration], test_clock: bool,
           bucket: tuple[int, int] | None) -> set[int]:
    """The schema, made and committed before any table in it; and the checks that refuse
    this migrate before it writes anything else. Returns the migrations applied already."""
    run(statements.migrate.create_schema(q))
    applied = _applied(run, q)
    if test_clock and CLOCK_MIGRATION in applied and not run(statements.migrate.has_test_clock(q)):
        raise MigrationError(
            f"schema {schema!r} is a production schema: its clock is now() and cannot be "
            "made movable for tests; test on a schema of its own")
    newest = max((m.version for m in pending), default=0)
    if applied and max(applied) > newest:
        raise MigrationError(
            f"schema {schema!r} is at migration {max(applied)}, newer than this kestrel "
            f"knows ({newest}); upgrade kestrel"
        )
    if bucket is not None:
        made = _bucket_made(run, q)
        if made is not None and made != bucket:
            raise _another_bucket(schema, made, bucket)
        if made is None and run(statements.migrate.migrate_finished(q)):
            raise _ordinary(schema)
    return applied


def _applied(run: Any, q: Queries) -> set[int]:
    if not run(statements.migrate.migrations_table_exists(q)):
        return set()
    applied: set[int] = run(statements.migrate.applied_migrations(q))
    return applied


def _bucket_made(run: Any, q: Queries) -> tuple[int, int] | None:
    if not run(statements.migrate.bucket_table_exists(q)):
        return None
    made: tuple[int, int] | None = run(statements.migrate.read_bucket(q))
    return made


def _apply(run: Any, q: Queries, m: Migration, test_clock: bool,
           bucket: tuple[int, int] | None) -> bool:
    """Migration *m* and its record, unless another migrate applied it first. A bucket's
    number is recorded with the migration that makes its table: a migrate stopped after it
    leaves a bucket, not a schema that looks ordinary."""
    if m.version in _applied(run, q):
        return False
    run(statements.migrate.set_clock_kind(q, test_clock=test_clock))
    # One statement at a time: Citus propagates a DDL command to its worker nodes with
    # the text the client sent, and a worker refuses a text of several commands.
    for statement in m.statements:
        run(statements.migrate.apply(statement))
    run(statements.migrate.record_migration(q, version=m.version, name=m.name))
    if m.version == BUCKET_MIGRATION and bucket is not None:
        run(statements.migrate.record_bucket(q, bucket=bucket[0], buckets=bucket[1]))
    return True


def _finish(run: Any, q: Queries, schema: str, history_interval: str, history_ahead: int,
            upgraded: bool, bucket: tuple[int, int] | None) -> None:
    """Every function, the bucket's number, and the history partitions."""
    made = _bucket_made(run, q)
    if bucket is not None and made != bucket:
        # Another migrate made it something else between our transactions.
        raise _ordinary(schema) if made is None else _another_bucket(schema, made, bucket)
    # Installed for the first time (a migrate stopped part-way before) or older than this
    # code: the current period's partition too, as on an upgrade.
    fresh = upgraded or not run(statements.migrate.migrate_finished(q))
    for_tests = run(statements.migrate.has_test_clock(q))
    if for_tests:
        run(statements.migrate.lock_test_clock(q))
    # Every function is replaced on every run (CREATE OR REPLACE) from sql/functions and
    # sql/partitions, the one place each is defined: a change to one needs no migration.
    for statement in functions(schema):
        run(statements.migrate.apply(statement))
    if for_tests:
        for statement in movable_clock(schema):
            run(statements.migrate.apply(statement))
    if made is not None:
        run(statements.migrate.set_bucket(q, made[0]))
    run(statements.migrate.delegate_functions(q))
    run(statements.migrate.ensure_current_partitions(
        q, interval=history_interval, ahead=history_ahead, current=fresh))


def bucket_of_schema(dsn: str, schema: str) -> tuple[int, int] | None:
    """``(bucket, buckets)`` when *schema* is a bucket of a namespace; None for an ordinary
    schema or one not made yet."""
    q = queries(schema)
    with connections.connect(dsn, prepare_threshold=None) as conn:
        if not db.run_sync(conn, statements.migrate.bucket_table_exists(q)):
            return None
        made: tuple[int, int] | None = db.run_sync(conn, statements.migrate.read_bucket(q))
    return made


def namespace_buckets(dsn: str, namespace: str) -> int:
    """How many buckets *namespace* has: the count its bucket 0 records, or 1 for an
    ordinary schema, one not made yet, or a bucket other than 0 named by its own schema
    (which every tool but the runtime reads as one schema)."""
    from kestrel.buckets import served_by

    return len(served_by(namespace, bucket_of_schema(dsn, namespace)))


def migrate_namespace(dsn: str, namespace: str, *, buckets: int = 0,
                      history_interval: str = "day", history_ahead: int = 3,
                      test_clock: bool = False) -> dict[str, list[int]]:
    """Bring every schema of *namespace* up to date, bucket 0 first; return the versions
    applied now to each.

    *buckets* (2 or more) makes a namespace of that many buckets, or checks that the
    namespace has that many; 0 takes the count it was made with (1: an ordinary schema,
    which :func:`migrate` alone brings up to date).

    Raises:
        MigrationError: *buckets* is not the namespace's count, or a schema a bucket needs
            is another one's.
    """
    have = namespace_buckets(dsn, namespace)
    if buckets and have > 1 and buckets != have:
        raise MigrationError(
            f"namespace {namespace!r} has {have} buckets, not {buckets}: a namespace keeps "
            "the bucket count it was made with (every id names its bucket by it)")
    if buckets == 1 and have > 1:
        raise MigrationError(f"namespace {namespace!r} has {have} buckets; it cannot become "
                             "an ordinary schema")
    count = buckets or have
    kw: dict[str, Any] = {"history_interval": history_interval,
                          "history_ahead": history_ahead, "test_clock": test_clock}
    if count == 1:
        return {namespace: migrate(dsn, namespace, **kw)}
    from kestrel.buckets import check_count, schemas

    check_count(count)
    names = schemas(namespace, count)
    # Every bucket's schema is checked before the first is made: a namespace is never left
    # half made over a schema that is something else.
    for k, name in enumerate(names):
        made = bucket_of_schema(dsn, name)
        if made is not None and made != (k, count):
            raise _another_bucket(name, made, (k, count))
        if made is None and _finished(dsn, name):
            raise _ordinary(name)
    return {name: migrate(dsn, name, bucket=(k, count), **kw)
            for k, name in enumerate(names)}


def _finished(dsn: str, schema: str) -> bool:
    """Whether a migrate ever finished on *schema* (one stopped part-way made no schema of
    a kind yet: it goes on as the bucket it was being made)."""
    with connections.connect(dsn, prepare_threshold=None) as conn:
        return db.run_sync(conn, statements.migrate.migrate_finished(queries(schema)))


def _ordinary(schema: str) -> MigrationError:
    # Its ids name no bucket: they would be looked for in the wrong schemas.
    return MigrationError(
        f"schema {schema!r} is an ordinary kestrel schema already; a namespace's buckets are "
        "schemas made as such (choose a namespace whose schemas do not exist yet)")


def _another_bucket(schema: str, made: tuple[int, int], want: tuple[int, int],
                    ) -> MigrationError:
    return MigrationError(
        f"schema {schema!r} is bucket {made[0]} of a namespace of {made[1]}, not bucket "
        f"{want[0]} of {want[1]}: a namespace keeps the bucket count it was made with (every "
        "id names its bucket by it)")


def may_migrate(dsn: str, schema: str) -> bool:
    """Whether this role may migrate *schema*: it owns it (superusers own everything), or
    may create it when it does not exist yet."""
    with connections.connect(dsn, prepare_threshold=None) as conn:
        return db.run_sync(conn, statements.migrate.may_migrate(queries(schema)))


def current_version_of(dsn: str, schema: str) -> int:
    """:func:`current_version` of *schema* on a connection of its own."""
    with connections.connect(dsn, prepare_threshold=None) as conn:
        return current_version(conn, schema)


def readiness(dsn: str, schema: str) -> tuple[bool, str]:
    """/readyz of a metrics endpoint: whether the database answers and *schema* is at this
    code's version, and why not."""
    try:
        with connections.connect(dsn, connect_timeout=3) as conn:
            why = behind(conn, schema)
    except psycopg.Error as exc:
        return False, f"database unreachable: {type(exc).__name__}"
    if why is not None:
        return False, why
    return True, f"schema {schema} at migration {len(migrations(schema))}"


def current_version(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int:
    """Return the newest applied migration of *schema*, 0 when none."""
    q = queries(schema)
    if not db.run_sync(conn, statements.migrate.migrations_table_exists(q)):
        return 0
    return db.run_sync(conn, statements.migrate.current_migration(q))


def current_functions(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int:
    """Return the version of *schema*'s functions (``kestrel_functions_version()``), 0 for
    functions installed before it existed. *conn* is in autocommit mode."""
    try:
        return db.run_sync(conn, statements.migrate.functions_version(queries(schema)))
    except psycopg.errors.UndefinedFunction:
        return 0


def behind(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> str | None:
    """Why *schema* cannot serve this code, or None when it can: its migration is not this
    code's, or its functions are older than this code calls (functions newer than that
    serve it: a function keeps serving code one version older)."""
    have, want = current_version(conn, schema), len(migrations(schema))
    if have != want:
        return f"schema {schema} is at migration {have}, this code needs {want}"
    have, want = current_functions(conn, schema), functions_version()
    if have < want:
        return (f"schema {schema}'s functions are at version {have}, this code needs {want} "
                "(the migration is current, but migrate has not run since this code's "
                "functions changed)")
    return None
