"""Apply the forward-only migrations in ``sql/migrations`` under an advisory lock, then
(re)install every function from ``sql/functions`` and ``sql/partitions``.

All pending migrations run in one transaction that first takes a transaction-level advisory
lock keyed on the schema, so concurrent starts serialize and the later ones find nothing to
do. A transaction-level lock is released at COMMIT: no session state is left behind, which
keeps this safe behind PgBouncer in transaction mode.
"""

from __future__ import annotations

import logging

import psycopg

from kestrel import db
from kestrel.errors import MigrationError
from kestrel.sql import functions, migrations, queries

log = logging.getLogger("kestrel.migrate")


def migrate(dsn: str, schema: str, *, history_interval: str = "day",
            history_ahead: int = 3) -> list[int]:
    """Bring *schema* up to date; return the versions applied now (empty if none).

    Also creates the history partitions of the next *history_ahead* periods, and on install
    or upgrade the current period's (the runtime's upkeep only ever adds future ones).

    Raises:
        MigrationError: the database has migrations newer than this code knows.
    """
    pending = migrations(schema)
    q = queries(schema)
    # No prepared statements: through a transaction-mode PgBouncer a statement psycopg
    # prepares here (it runs the same INSERT once per migration) would outlive this
    # transaction on the server connection and collide with the next migrate's.
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn, \
            conn.transaction():
        db.run_sync(conn, db.command(q.migrate_lock))
        db.run_sync(conn, db.command(q.create_schema))
        applied: set[int] = set()
        if db.run_sync(conn, db.value(q.migrations_table_exists, {})):
            applied = set(db.run_sync(conn, db.Stmt(q.applied_migrations, None,
                                                    lambda rows: [r[0] for r in rows])))
        newest = max((m.version for m in pending), default=0)
        if applied and max(applied) > newest:
            raise MigrationError(
                f"schema {schema!r} is at migration {max(applied)}, newer than this kestrel "
                f"knows ({newest}); upgrade kestrel"
            )
        done = []
        for m in pending:
            if m.version in applied:
                continue
            db.run_sync(conn, db.command(m.text))
            db.run_sync(conn, db.command(q.record_migration,
                                         {"version": m.version, "name": m.name}))
            done.append(m.version)
            log.info("applied migration %04d_%s to schema %s", m.version, m.name, schema)
        # Every function is replaced on every run (CREATE OR REPLACE) from sql/functions and
        # sql/partitions, the one place each is defined: a change to one needs no migration.
        for statement in functions(schema):
            db.run_sync(conn, db.command(statement))
        db.run_sync(conn, db.command(q.ensure_current_partitions, {
            "interval": history_interval, "ahead": history_ahead, "current": bool(done)}))
    return done


def readiness(dsn: str, schema: str) -> tuple[bool, str]:
    """/readyz of a metrics endpoint: whether the database answers and *schema* is at this
    code's version, and why not."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as conn:
            have = current_version(conn, schema)
    except psycopg.Error as exc:
        return False, f"database unreachable: {type(exc).__name__}"
    want = len(migrations(schema))
    if have != want:
        return False, f"schema {schema} is at migration {have}, code needs {want}"
    return True, f"schema {schema} at migration {have}"


def current_version(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int:
    """Return the newest applied migration of *schema*, 0 when none."""
    q = queries(schema)
    if not db.run_sync(conn, db.value(q.migrations_table_exists, {})):
        return 0
    return int(db.run_sync(conn, db.value(q.current_migration, {})) or 0)
