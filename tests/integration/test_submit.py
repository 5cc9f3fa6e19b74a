"""Submission: idempotency, the caller's transaction, the SQL function, bad input."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import kestrel
from kestrel.client import Client, SyncClient
from kestrel.migrate import migrate
from kestrel.sql import migrations
from tests.apps import ledger_app as app
from tests.helpers import q, q1, wait_until


def rows(dsn: str, schema: str) -> int:
    return int(q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_executions"))


def test_same_key_same_args_gives_one_execution_under_100_concurrent_submits(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with ThreadPoolExecutor(max_workers=20) as pool:
        ids = list(pool.map(lambda _: client.submit(app.three_steps, 5,
                                                    idempotency_key="K").id, range(100)))
    assert len(set(ids)) == 1
    assert rows(pg_dsn, schema) == 1


def test_async_client_concurrent_idempotent_submits(pg_dsn: str, schema: str) -> None:
    client = Client(pg_dsn, schema=schema, pool_size=0)

    async def main() -> set[object]:
        handles = await asyncio.gather(*(client.submit(app.three_steps, 1, idempotency_key="A")
                                         for _ in range(50)))
        return {h.id for h in handles}

    assert len(asyncio.run(main())) == 1
    assert rows(pg_dsn, schema) == 1


def test_same_key_other_args_is_a_typed_conflict_and_writes_nothing(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    first = client.submit(app.three_steps, 1, idempotency_key="K2")
    with pytest.raises(kestrel.IdempotencyConflict) as info:
        client.submit(app.three_steps, 2, idempotency_key="K2")
    assert info.value.key == "K2" and str(first.id) in str(info.value)
    with pytest.raises(kestrel.IdempotencyConflict):
        client.submit(app.three_sync_steps, 1, idempotency_key="K2")
    assert rows(pg_dsn, schema) == 1


def test_key_still_answers_after_the_execution_moved_to_history(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    first = client.submit(app.three_steps, 1, idempotency_key="K3")
    # Finish it the way a worker does: the hot row leaves, history gets it.
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'running', lease_epoch = 1")
    q(pg_dsn, schema, "WITH d AS (DELETE FROM {s}.workflow_executions RETURNING *) "
      "INSERT INTO {s}.workflow_history SELECT id, workflow, queue, priority, 'completed', "
      "args, '1', NULL, idempotency_key, lease_epoch, attempts, created_at, started_at, now() "
      "FROM d")
    assert client.submit(app.three_steps, 1, idempotency_key="K3").id == first.id
    assert rows(pg_dsn, schema) == 0


@pytest.mark.parametrize("bad", [
    {1, 2}, math.nan, math.inf, "nul\x00byte", object(), {"deep": [float("-inf")]},
    "\ud800", 2**70,
])
def test_unserializable_args_are_rejected_before_anything_is_written(
    pg_dsn: str, schema: str, bad: object
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with pytest.raises(kestrel.SerializationError) as info:
        client.submit(app.three_steps, bad)
    assert "arguments of workflow 'three_steps'" in str(info.value)
    assert rows(pg_dsn, schema) == 0


def test_oversized_args_are_rejected_at_the_cap(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, max_payload_bytes=10_000, pool_size=0)
    with pytest.raises(kestrel.PayloadTooLarge):
        client.submit(app.three_steps, "x" * 10_000)
    client.submit(app.three_steps, "x" * 9_000)  # below the cap: accepted
    assert rows(pg_dsn, schema) == 1


def test_submit_in_callers_transaction_commits_and_rolls_back_with_it(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with psycopg.connect(pg_dsn) as conn:
        client.submit(app.three_steps, 1, conn=conn)
        assert rows(pg_dsn, schema) == 0  # not visible before the caller commits
        conn.rollback()
    assert rows(pg_dsn, schema) == 0
    with psycopg.connect(pg_dsn) as conn:
        h = client.submit(app.three_steps, 2, conn=conn)
        conn.commit()
    assert q1(pg_dsn, schema, "SELECT args FROM {s}.workflow_executions WHERE id = %s",
              [h.id]) == [2]


def test_a_deadline_and_a_delay_count_from_the_call_not_from_the_callers_begin(
    pg_dsn: str, schema: str
) -> None:
    """FAULTS C6: a submit in a transaction open for seconds is not created already late.
    now() is the transaction's start; the deadline and the wake time count from the call
    (the database's clock at the statement), whatever the caller did before it."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with psycopg.connect(pg_dsn) as conn:
        begun = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        conn.execute("SELECT pg_sleep(1.5)")
        called = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        late = client.submit(app.three_steps, 1, timeout=2.0, delay=1.0, conn=conn)
        undelayed = client.submit(app.three_steps, 2, timeout=2.0, conn=conn)
        conn.commit()
    deadline, wake_at, status = q(
        pg_dsn, schema, "SELECT deadline, wake_at, status FROM {s}.workflow_executions "
        "WHERE id = %s", [late.id])[0]
    assert status == "waiting"
    # From the call: at least 2 s (1 s) after `called`; from BEGIN it would be 0.5 s before it.
    assert (deadline - called).total_seconds() >= 2.0, (begun, called, deadline)
    assert (wake_at - called).total_seconds() >= 1.0, (begun, called, wake_at)
    assert (deadline - begun).total_seconds() >= 3.5
    other = q1(pg_dsn, schema, "SELECT deadline FROM {s}.workflow_executions WHERE id = %s",
               [undelayed.id])
    assert (other - called).total_seconds() >= 2.0


HOSTILE_SECONDS = [math.nan, math.inf, -1.0, 2**64, 3155760001.0]


@pytest.mark.parametrize(("field", "value"), [
    *(("timeout", v) for v in [*HOSTILE_SECONDS, 1e-400]),  # 1e-400 is 0.0: not positive
    *(("delay", v) for v in HOSTILE_SECONDS),  # (a delay of 0 is valid: it starts at once)
])
def test_hostile_timeouts_and_delays_are_refused_in_a_callers_transaction_too(
    pg_dsn: str, schema: str, field: str, value: float
) -> None:
    """The call-time clock (FAULTS C6) left the refusals as they were: NaN, infinities,
    negatives, 1e-400 (0.0: a timeout must be positive), 2^64 and past 100 years are refused,
    typed, before anything is sent, also in a caller's open transaction, which stays usable."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(kestrel.ConfigError, match=field):
            client.submit(app.three_steps, 1, conn=conn, **{field: value})
        assert conn.execute("SELECT 2").fetchone() == (2,)
        conn.commit()
    assert rows(pg_dsn, schema) == 0


def test_async_submit_in_callers_transaction(pg_dsn: str, schema: str) -> None:
    client = Client(pg_dsn, schema=schema, pool_size=0)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await client.submit(app.three_steps, 1, conn=conn)
            await conn.rollback()

    asyncio.run(main())
    assert rows(pg_dsn, schema) == 0


def test_sql_function_enqueues_from_any_language_or_trigger(pg_dsn: str, schema: str) -> None:
    q(pg_dsn, schema, "CREATE TABLE {s}.alerts (id serial, workload text)")
    q(pg_dsn, schema, """
        CREATE FUNCTION {s}.on_alert() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM {s}.submit('three_steps', jsonb_build_array(NEW.id), 'default', 5,
                               'alert-' || NEW.id);
            RETURN NEW;
        END $$""")
    q(pg_dsn, schema, "CREATE TRIGGER t AFTER INSERT ON {s}.alerts FOR EACH ROW "
      "EXECUTE FUNCTION {s}.on_alert()")
    q(pg_dsn, schema, "INSERT INTO {s}.alerts (workload) VALUES ('api'), ('db')")
    got = q(pg_dsn, schema, "SELECT workflow, args, priority, idempotency_key FROM "
            "{s}.workflow_executions ORDER BY idempotency_key")
    assert got == [("three_steps", [1], 5, "alert-1"), ("three_steps", [2], 5, "alert-2")]
    with pytest.raises(psycopg.Error) as info:
        q(pg_dsn, schema, "SELECT {s}.submit('x', '{{\"not\": \"an array\"}}')")
    assert info.value.sqlstate == "KS002"


def test_hostile_names_are_stored_verbatim(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    name = "x'); DROP TABLE workflow_executions; --\n\"$$ ünï"
    h = client.submit(name, "'; --", idempotency_key=name)
    ex = client.get(h.id)
    assert ex.workflow == name and ex.args == ["'; --"]


def test_migrations_are_idempotent_and_safe_to_race(pg_dsn: str, schema: str) -> None:
    assert migrate(pg_dsn, schema) == []  # the fixture already applied them
    fresh = schema + "_race"
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda _: migrate(pg_dsn, fresh), range(6)))
    newest = len(migrations(fresh))
    # Each migration commits on its own (kestrel.migrate): racing migrates share the work,
    # each migration applied by exactly one of them, in order, none twice.
    applied = sorted(v for r in results for v in r)
    assert applied == [m.version for m in migrations(fresh)]
    assert all(r == sorted(r) for r in results)
    assert q1(pg_dsn, fresh, "SELECT count(*) FROM {s}.schema_migrations") == newest
    assert q1(pg_dsn, fresh, "SELECT {s}.kestrel_functions_version()") >= 1
    q(pg_dsn, fresh, "DROP SCHEMA {s} CASCADE")


def test_pooled_clients_reuse_connections_and_close(direct_dsn: str, schema: str) -> None:
    """The client's own pool (counted in pg_stat_activity, so against the server itself)."""
    def backends() -> int:
        return int(q1(direct_dsn, schema, "SELECT count(*) FROM pg_stat_activity "
                      "WHERE application_name = %s", ["kestrel-pool-probe"]))

    dsn = (direct_dsn + ("&" if "?" in direct_dsn else "?")
           + "application_name=kestrel-pool-probe")
    with SyncClient(dsn, schema=schema, pool_size=2) as client, \
            ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(lambda n: client.submit(app.quick, n).id, range(100)))
        assert len(set(ids)) == 100
        assert 1 <= backends() <= 2
    # A backend leaves pg_stat_activity a moment after its client hangs up (the server
    # notices the closed socket and exits): closed means gone soon, not at once.
    wait_until(lambda: backends() == 0, timeout=10, what="the pool's backends to exit")

    async def main() -> int:
        async with Client(dsn, schema=schema, pool_size=3) as aclient:
            await asyncio.gather(*(aclient.submit(app.quick, n) for n in range(50)))
            return backends()

    assert 1 <= asyncio.run(main()) <= 3
    wait_until(lambda: backends() == 0, timeout=10, what="the pool's backends to exit")
