"""Apply the forward-only migrations in ``sql/migrations`` under an advisory lock, then
(re)install the partition upkeep functions of ``sql/partitions``.

All pending migrations run in one transaction that first takes a transaction-level advisory
lock keyed on the schema, so concurrent starts serialize and the later ones find nothing to
do. A transaction-level lock is released at COMMIT: no session state is left behind, which
keeps this safe behind PgBouncer in transaction mode.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg import sql as pgsql

from kestrel.errors import MigrationError
from kestrel.sql import migrations, partition_functions

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
    # No prepared statements: through a transaction-mode PgBouncer a statement psycopg
    # prepares here (it runs the same INSERT once per migration) would outlive this
    # transaction on the server connection and collide with the next migrate's.
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn, \
            conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"kestrel.migrate.{schema}"])
        conn.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(pgsql.Identifier(schema)))
        exists = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", [f'"{schema}".schema_migrations']
        ).fetchone()
        applied: set[int] = set()
        if exists and exists[0]:
            rows = conn.execute(
                pgsql.SQL("SELECT version FROM {}.schema_migrations").format(
                    pgsql.Identifier(schema)
                )
            ).fetchall()
            applied = {r[0] for r in rows}
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
            conn.execute(m.text.encode())
            conn.execute(
                pgsql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)")
                .format(pgsql.Identifier(schema)),
                [m.version, m.name],
            )
            done.append(m.version)
            log.info("applied migration %04d_%s to schema %s", m.version, m.name, schema)
        # Partition upkeep functions are replaced on every run (CREATE OR REPLACE), so a
        # fix to them needs no migration.
        for statement in partition_functions(schema):
            conn.execute(statement.encode())
        # The current period only on install or upgrade, when nothing else writes yet.
        conn.execute(pgsql.SQL("SELECT {}.kestrel_ensure_history_partitions_v1(%s, %s, %s)")
                     .format(pgsql.Identifier(schema)),
                     [history_interval, history_ahead, bool(done)])
    return done


def current_version(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int:
    """Return the newest applied migration of *schema*, 0 when none."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", [f'"{schema}".schema_migrations']
    ).fetchone()
    if not row or not row[0]:
        return 0
    got = conn.execute(
        pgsql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(
            pgsql.Identifier(schema)
        )
    ).fetchone()
    return int(str(got[0])) if got else 0
