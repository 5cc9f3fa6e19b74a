"""Every worker statement carries a lock_timeout (issue 22, FAULTS O4/O6/D10), directly and
through PgBouncer in transaction mode (the suite's second pass), without session state.

Direct, the setting comes with the session (the ``options`` startup parameter). Behind a
transaction-mode pooler, which passes no startup options and shares server sessions, each
statement is pipelined after a transaction-local set_config: the statement sees it, and the
next transaction on the same server session does not.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from kestrel import connections, db, statements
from kestrel.config import Config
from kestrel.sql import queries
from kestrel.types import StepWrite
from tests.conftest import VIA_PGBOUNCER
from tests.helpers import q1, submit_many

SHOW = "SELECT current_setting('lock_timeout')"


def test_pooled_statements_and_transactions_carry_the_lock_timeout(pg_dsn: str) -> None:
    async def main() -> None:
        pool = connections.make_pool(pg_dsn, max_size=2, name="lt",
                                     prepared=not VIA_PGBOUNCER, lock_timeout=0.25,
                                     session=not VIA_PGBOUNCER)
        await pool.open(wait=True)
        try:
            async with pool.connection() as conn:
                assert (await (await conn.execute(SHOW)).fetchone()) == ("250ms",)
                async with conn.transaction():
                    assert (await (await conn.execute(SHOW)).fetchone()) == ("250ms",)
        finally:
            await pool.close()

    asyncio.run(main())
    if VIA_PGBOUNCER:
        # Transaction-local: nothing is left on the server sessions others get next.
        for _ in range(4):
            assert q1(pg_dsn, "public", SHOW) == "0"


def test_the_heartbeat_connection_carries_it_too(pg_dsn: str) -> None:
    with connections.connect(pg_dsn, lock_timeout=0.3, session=not VIA_PGBOUNCER,
                             autocommit=True, prepare_threshold=None) as conn:
        assert conn.execute(SHOW).fetchone() == ("300ms",)


def test_a_worker_statement_on_a_row_a_client_holds_times_out_instead_of_waiting(
    pg_dsn: str, direct_dsn: str, schema: str
) -> None:
    """The checkpoint statement locks the execution row (FOR SHARE, epoch check): with a
    client's UPDATE of that row open, it fails with 55P03 after lock_timeout, where before it
    waited for as long as the client kept its transaction."""
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 1)
    eid = q1(pg_dsn, schema, "SELECT id FROM {s}.workflow_executions")
    qs = queries(schema)
    cfg = Config(schema=schema, lease=2.0, heartbeat=0.5,
                 connection_mode="pgbouncer" if VIA_PGBOUNCER else "direct")
    assert cfg.statement_lock_timeout == 0.5

    async def main() -> None:
        pool = connections.make_pool(pg_dsn, max_size=2, name="lt",
                                     prepared=cfg.prepared_statements,
                                     lock_timeout=cfg.statement_lock_timeout,
                                     session=cfg.connection_mode == "direct")
        await pool.open(wait=True)
        try:
            async with pool.connection() as conn:
                (claimed,) = await db.run(
                    conn,
                    statements.executions.claim_batch(
                        qs, owner="t", queues=["default"], limit=1, lease_s=30
                    ),
                )
                assert claimed.id == eid
                with psycopg.connect(direct_dsn) as client:
                    client.execute(f'UPDATE "{schema}".workflow_executions SET priority = 1 '
                                   "WHERE id = %s", [eid])
                    with pytest.raises(psycopg.errors.LockNotAvailable) as err:
                        await db.run(conn, statements.steps.save_steps(qs, [StepWrite(
                            eid, claimed.epoch, 0, "add", "1", None, 1, 0.0)]))
                    assert connections.is_contended(err.value)
                    client.rollback()
                (saved,) = await db.run(conn, statements.steps.save_steps(qs, [StepWrite(
                    eid, claimed.epoch, 0, "add", "1", None, 1, 0.0)]))
                assert saved.owned and saved.inserted
        finally:
            await pool.close()

    asyncio.run(main())


def test_the_lock_timeout_setting_is_bounded_by_the_lease() -> None:
    from kestrel.errors import ConfigError

    assert Config(lease=30.0).statement_lock_timeout == 2.0
    assert Config(lease=30.0, lock_timeout=5).statement_lock_timeout == 5
    with pytest.raises(ConfigError, match="--lock-timeout"):
        Config(lease=4.0, heartbeat=1.0, lock_timeout=3)


def test_no_lock_on_the_rows_a_worker_holds_delays_its_heartbeat(
    pg_dsn: str, direct_dsn: str, schema: str
) -> None:
    """FAULTS C2/C3/O4 at the level of one beat. Of three claimed rows, one is held FOR SHARE
    (as the worker's own checkpoint batch holds it), one by a client's open UPDATE, one is
    free. The beat ends while both locks are still held, extends the process's lease and
    trusts all three for a whole lease longer: the lease is the process's own row (migration
    0026), which no lock on an execution stands in front of. Before, the beat skipped each
    held row, waited a lock_timeout on it, and did not extend the client's at all."""
    beat_against_locks(pg_dsn, direct_dsn, schema, session=not VIA_PGBOUNCER)


def beat_against_locks(pg_dsn: str, direct_dsn: str, schema: str, *, session: bool) -> None:
    """One beat over three claimed rows: one held FOR SHARE, one kept by a client's UPDATE,
    one free (see the test above). The beat must end while both are held."""
    import threading
    import time

    from kestrel.lease import Heartbeat, Lease, Leases

    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 3)
    qs = queries(schema)
    with connections.connect(pg_dsn, session=session, autocommit=True,
                             prepare_threshold=None) as conn:
        claimed = db.run_sync(conn, statements.executions.claim_batch(
            qs, owner="t", queues=["default"], limit=3, lease_s=30))
    claimed.sort(key=lambda c: c.id)
    leases = Leases()
    for c in claimed:
        leases.add(Lease(c, trusted_until=0.0, claimed_at=0.0))
    hb = Heartbeat(leases, dsn=pg_dsn, q=qs, owner="t", lease_s=30, interval=2.0,
                   prepared=False, progressing=lambda: None, lock_timeout=0.3,
                   session=session)
    by_id = {h.claimed.id: h for h in leases}
    short, kept, free = (by_id[c.id] for c in claimed)
    table = f'"{schema}".workflow_executions'
    with psycopg.connect(direct_dsn) as client, psycopg.connect(direct_dsn) as batch:
        client.execute(f"UPDATE {table} SET priority = 1 WHERE id = %s", [kept.claimed.id])
        batch.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR SHARE", [short.claimed.id])
        beat = threading.Thread(target=hb.run_once)
        started = time.monotonic()
        beat.start()
        beat.join(timeout=30)
        assert not beat.is_alive(), "the beat waited on a lock an execution's row held"
        batch.rollback()
        client.rollback()
    if hb._conn is not None:
        hb._conn.close()
    for h in (short, kept, free):
        assert h.trusted_until >= started + 30, h.claimed.id  # extended at this beat
    assert not any(h.lost for h in leases)
    assert q1(direct_dsn, schema, "SELECT expires_at > {s}.kestrel_now() + interval '25 s' "
              "FROM {s}.leases WHERE owner = 't'")
