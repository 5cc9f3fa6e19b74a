"""The database clock (issue 22, row 11): production time is now(), inlined, and nothing the
runtime role may write moves it; a schema made for tests has a clock the tests move, kept by
every later migrate; the test kit refuses a schema that is not made for tests."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel.client import SyncClient
from kestrel.errors import ConfigError, MigrationError
from kestrel.migrate import migrate
from kestrel.testing import KestrelTestEnv
from tests.helpers import q, q1


def _plan(dsn: str, schema: str, query: str) -> str:
    return "\n".join(r[0] for r in q(dsn, schema, "EXPLAIN (VERBOSE, COSTS OFF) " + query))


def test_a_production_schemas_clock_is_now_inlined(pg_dsn: str, production_schema: str) -> None:
    """kestrel_now() is now(), inlined into the statements that call it: no function call
    and no table read per row. Before, its body read clock_offset through a sub-select, it was
    never inlined, and each call cost about 20 times now()."""
    assert q1(pg_dsn, production_schema,
              "SELECT to_regclass(%s)", [f"{production_schema}.clock_offset"]) is None
    plan = _plan(pg_dsn, production_schema, "SELECT {s}.kestrel_now()")
    assert "Output: now()" in plan and "kestrel_now" not in plan, plan
    # Inlined in a runtime statement too: the sweeper's expiry scan compares with now().
    plan = _plan(pg_dsn, production_schema, "SELECT id FROM {s}.workflow_executions "
                 "WHERE status = 'running' AND lease_expires_at < {s}.kestrel_now()")
    assert "now()" in plan and "kestrel_now" not in plan and "clock_offset" not in plan, plan


def test_a_test_schemas_clock_moves_for_every_session_and_survives_a_migrate(
    direct_dsn: str, schema: str, production_schema: str
) -> None:
    """In a schema made for tests, a move of clock_offset is what every session reads next,
    a plan prepared before the move included (the clock is inlined there too, and
    PostgreSQL re-plans when the function changes). A later migrate without the option (a
    runtime starting on the test's schema) keeps the test clock and its offset; asking for a
    test clock on a production schema is refused."""
    plan = _plan(direct_dsn, schema, "SELECT {s}.kestrel_now()")
    assert "kestrel_now" not in plan and "clock_offset" not in plan, plan
    ahead = pgsql.SQL("SELECT {}.kestrel_now() - now()").format(pgsql.Identifier(schema))
    with psycopg.connect(direct_dsn, autocommit=True) as watcher:
        for _ in range(3):  # prepared and cached by now
            assert watcher.execute(ahead, prepare=True).fetchone() == (timedelta(0),)
        q(direct_dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '1 hour'")
        assert watcher.execute(ahead, prepare=True).fetchone() == (timedelta(hours=1),)
        assert migrate(direct_dsn, schema) == []
        assert watcher.execute(ahead, prepare=True).fetchone() == (timedelta(hours=1),)
    assert migrate(direct_dsn, schema, test_clock=True) == []
    with pytest.raises(MigrationError, match="production schema"):
        migrate(direct_dsn, production_schema, test_clock=True)
    assert q1(direct_dsn, production_schema,
              "SELECT to_regclass(%s)", [f"{production_schema}.clock_offset"]) is None


def test_the_test_kit_refuses_a_production_schema(
    pg_dsn: str, production_schema: str
) -> None:
    """KestrelTestEnv on a production schema refuses before writing anything: reset() would
    empty every table. Before, it accepted it, and reset() truncated production's tables."""
    client = SyncClient(pg_dsn, schema=production_schema, pool_size=0)
    live = client.submit("quick", 1)
    env = KestrelTestEnv(pg_dsn, production_schema)
    for call in (env.reset, lambda: env.advance_clock(60),
                 lambda: env.run_until_finished(live.id, timeout=1),
                 lambda: env.run_to_completion("quick", 2, timeout=1)):
        with pytest.raises(ConfigError, match="not made for tests"):
            call()
    assert q(pg_dsn, production_schema, "SELECT id, status FROM {s}.workflow_executions") == [
        (live.id, "queued")]
    # The SQL refuses it too, whoever runs it.
    from kestrel import db, statements
    from kestrel.sql import queries

    with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn, \
            pytest.raises(psycopg.errors.InsufficientPrivilege, match="not made for tests"):
        db.run_sync(conn, statements.testing.reset_for_test(queries(production_schema)))
    assert q1(pg_dsn, production_schema, "SELECT count(*) FROM {s}.workflow_executions") == 1


def _role(dsn: str, schema: str) -> str:
    """A role with DML on every table of *schema* and nothing more (the runtime's, S4)."""
    role = f"kestrel_rt_{uuid.uuid4().hex[:8]}"
    s, r = pgsql.Identifier(schema), pgsql.Identifier(role)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(r))
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                               "{} TO {}").format(s, r))
    return role


def test_the_runtime_role_cannot_change_time(direct_dsn: str, production_schema: str,
                                            schema: str) -> None:
    """S4 for time: a role with DML on every table of the schema (the runtime's) cannot move
    the clock: a production schema has nothing to write, and kestrel_now() (owned by the
    schema owner) cannot be replaced. Not even in a schema made for tests, where moving
    clock_offset replaces the function, which only its owner may, and its row cannot be
    deleted. Before, UPDATE clock_offset moved (or DELETE broke) the clock of every worker."""
    from urllib.parse import urlsplit, urlunsplit

    roles = []
    try:
        for target in (production_schema, schema):
            role = _role(direct_dsn, target)
            roles.append(role)
            parts = urlsplit(direct_dsn)
            as_role = urlunsplit(parts._replace(
                netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))
            with psycopg.connect(as_role, autocommit=True) as conn:
                s = pgsql.Identifier(target)
                attempts: list[Any] = [
                    pgsql.SQL("UPDATE {}.clock_offset SET offset_by = '1 hour'").format(s),
                    pgsql.SQL("DELETE FROM {}.clock_offset").format(s),
                    pgsql.SQL("CREATE OR REPLACE FUNCTION {}.kestrel_now() RETURNS timestamptz "
                              "LANGUAGE sql STABLE AS 'SELECT now() + interval ''1 hour'''")
                    .format(s),
                    pgsql.SQL("ALTER FUNCTION {}.kestrel_now() RENAME TO was_now").format(s),
                ]
                for attempt in attempts:
                    with pytest.raises((psycopg.errors.UndefinedTable,
                                        psycopg.errors.InsufficientPrivilege)):
                        conn.execute(attempt)
                row = conn.execute(pgsql.SQL("SELECT {}.kestrel_now() = now()").format(s))
                assert row.fetchone() == (True,)
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            for role in roles:
                conn.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))
                conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))


def test_a_finish_held_by_a_client_lock_across_a_clock_move_keeps_its_checkpoints(
        direct_dsn: str, schema: str) -> None:
    """Found by the operator machine's soak profile: a completion waited on a row a
    client's open transaction held while the clock moved; the history row took the finish
    time planned before the wait and its checkpoints the time after, so workflow_steps
    (which joins them on that time) showed a completed execution with no steps. The finish
    time is now written once and carried to everything archived with it. Direct connections,
    in the PgBouncer pass too: the test finds the completion's server backend by its pid."""
    import asyncio

    from kestrel import db, statements
    from kestrel.sql import queries
    from kestrel.types import Finish, Status, StepWrite

    pg_dsn = direct_dsn
    qs = queries(schema)
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit("clock.two_steps", 1)

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            [c] = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=1, lease_s=60
                ),
            )
            await db.run(
                conn,
                statements.steps.save_steps(
                    qs, [StepWrite(c.id, c.epoch, 0, "clock.a", "1", None, 1, 0.0)]
                ),
            )
            with psycopg.connect(pg_dsn, autocommit=False) as client_tx:
                client_tx.execute(pgsql.SQL("SELECT 1 FROM {}.workflow_executions WHERE id = %s"
                                            " FOR UPDATE").format(pgsql.Identifier(schema)),
                                  [c.id])  # a client's open transaction holds the row
                done = asyncio.ensure_future(db.run(conn, statements.executions.complete_batch(qs, [
                    Finish(c.id, c.epoch, Status.COMPLETED, "7", None)])))
                pid = conn.info.backend_pid
                with psycopg.connect(pg_dsn, autocommit=True) as admin:
                    for _ in range(3000):  # until it is planned and waits on the row
                        if admin.execute("SELECT wait_event_type FROM pg_stat_activity "
                                         "WHERE pid = %s", [pid]).fetchone() == ("Lock",):
                            break
                        await asyncio.sleep(0.01)
                    else:
                        raise AssertionError("the completion never waited on the row")
                with psycopg.connect(pg_dsn, autocommit=True) as admin:
                    db.run_sync(admin, statements.testing.advance_clock(qs, seconds=3600))
                client_tx.commit()
            assert await done == {c.id}

    asyncio.run(run())
    assert q(pg_dsn, schema, "SELECT step_id, step_name FROM {s}.workflow_steps WHERE "
             "execution_id = %s", [h.id]) == [(0, "clock.a")]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.step_history AS s JOIN "
              "{s}.workflow_history AS h ON h.id = s.execution_id AND h.finished_at = "
              "s.execution_finished_at WHERE h.id = %s", [h.id]) == 1
