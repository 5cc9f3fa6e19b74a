"""O8's statement: what a supervisor runs when it reaps a dead worker (recover_dead_worker).
The end-to-end measure is F1 in tests/chaos/test_process_faults.py."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from kestrel import connections, db, statements
from kestrel.sql import queries
from kestrel.types import SweepResult
from tests.helpers import q, q1, submit_many, take_lease


def _claim(dsn: str, schema: str, owner: str, limit: int) -> list[object]:
    take_lease(dsn, schema, owner, 3600)

    async def main() -> list[object]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True,
                                                         prepare_threshold=None) as c:
            connections.configure_connection(c)
            got = await db.run(
                c,
                statements.executions.claim_batch(
                    queries(schema), owner=owner, queues=["default"], limit=limit, lease_s=3600
                ),
            )
            return [x.id for x in got]

    return asyncio.run(main())


def _recover(dsn: str, schema: str, owner: str, max_attempts: int = 5,
             delegated: bool | None = None) -> SweepResult:
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        return db.run_script_sync(conn, statements.sweeper.recover_dead_worker(
            queries(schema), worker_id=owner, max_attempts=max_attempts,
            delegated=delegated))


# None: the script asks the database (plain PostgreSQL: the statement); True: the Citus
# form a distributed schema gets (sweep_expired(), which runs here too).
@pytest.mark.parametrize("form", [None, True], ids=["asked", "citus-form"])
def test_only_the_dead_incarnations_rows_are_released_and_a_crash_counts_as_an_attempt(
    pg_dsn: str, schema: str, form: bool | None
) -> None:
    """The dead worker's rows go back to the queue at once, their attempt counted; a row
    out of attempts is quarantined, as the sweeper would; rows of another process (the same
    host and pid, another incarnation) keep their hour-long lease. Again, it does nothing."""
    submit_many(pg_dsn, schema, "quick", "jsonb_build_array(i)", 5)
    dead = _claim(pg_dsn, schema, "host:42:dead", 3)
    alive = _claim(pg_dsn, schema, "host:42:alive", 2)
    poison = dead[0]
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET attempts = 5 WHERE id = %s",
      [poison])
    q(pg_dsn, schema, "INSERT INTO {s}.workers (worker_id, app_version, workflows, queues, "
      "stale_after) VALUES ('host:42:dead', '', ARRAY['quick'], ARRAY['default'], "
      "interval '1 hour')")
    assert _recover(pg_dsn, schema, "host:42:dead", delegated=form) == SweepResult(
        requeued=2, quarantined=1, examined=3)
    rows = dict((r[0], r[1:]) for r in q(
        pg_dsn, schema, "SELECT e.id, e.status, e.lease_owner, e.attempts, "
        "l.expires_at > now() + interval '50 minutes' FROM {s}.workflow_executions AS e "
        "LEFT JOIN {s}.leases AS l ON l.owner = e.lease_owner"))
    for eid in dead[1:]:
        assert rows[eid] == ("queued", None, 1, None)  # the crash is an attempt
    for eid in alive:
        assert rows[eid] == ("running", "host:42:alive", 1, True)
    assert q(pg_dsn, schema, "SELECT status FROM {s}.workflow_history WHERE id = %s",
             [poison]) == [("quarantined",)]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workers") == 0
    # A retry after a lost reply, or a second reap of the same id: nothing more to do.
    assert _recover(pg_dsn, schema, "host:42:dead", delegated=form) == SweepResult(0, 0, 0)
    assert _recover(pg_dsn, schema, "host:42:never-lived") == SweepResult(0, 0, 0)
