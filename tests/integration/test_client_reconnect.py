"""Waiting for a result survives a restart of PostgreSQL (issue 18: ``SyncClient.result()``
raised a raw ``OperationalError`` at the first restart). Both clients, a real server
restarted under them; only the deadline ends a wait, with a typed TimeoutError."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from kestrel.client import Client, SyncClient
from kestrel.migrate import migrate
from tests.apps import ledger_app as app
from tests.helpers import config, q1, run_worker_until, wait_until
from tests.pgcluster import Cluster

SCHEMA = "reconnect"


@pytest.fixture(autouse=True)
def _own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # The PgBouncer pass points these at the session's server, not at this test's own.
    monkeypatch.delenv("KESTREL_LISTEN_DSN", raising=False)
    monkeypatch.delenv("KESTREL_CONNECTION_MODE", raising=False)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster("reconnect")
    c.start()
    migrate(c.dsn, SCHEMA)
    yield c
    c.destroy()


def _sync_wait(dsn: str, eid: str, timeout: float, mode: str = "direct") -> Any:
    with SyncClient(dsn, schema=SCHEMA, connection_mode=mode) as client:
        return client.result(eid, timeout=timeout)


def _async_wait(dsn: str, eid: str, timeout: float, mode: str = "direct") -> Any:
    async def main() -> Any:
        async with Client(dsn, schema=SCHEMA, connection_mode=mode) as client:
            return await client.result(eid, timeout=timeout)

    return asyncio.run(main())


WAITS: dict[str, Callable[[str, str, float], Any]] = {
    "sync": _sync_wait,
    "async": _async_wait,
    # No LISTEN (a pooler without --listen-dsn): the wait polls through the client's pool,
    # whose connections all break at the restart.
    "sync-polling-pool": lambda dsn, eid, t: _sync_wait(dsn, eid, t, "pgbouncer"),
    "async-polling-pool": lambda dsn, eid, t: _async_wait(dsn, eid, t, "pgbouncer"),
}


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the test to assert on
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _waiting_backends(dsn: str) -> int:
    return int(q1(dsn, SCHEMA, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = "
                  "'client backend' AND pid <> pg_backend_pid()"))


@pytest.mark.parametrize("mode", ["fast", "immediate"])
@pytest.mark.parametrize("kind", list(WAITS))
def test_result_rides_out_a_restart(cluster: Cluster, kind: str, mode: str) -> None:
    dsn = cluster.dsn
    handle = SyncClient(dsn, schema=SCHEMA, pool_size=0).submit(app.three_steps, 7)
    thread, box = _in_thread(lambda: WAITS[kind](dsn, str(handle.id), 120))
    wait_until(lambda: _waiting_backends(dsn) >= 1, timeout=30, what="the wait to start")
    cluster.restart(mode)  # every connection of the wait is cut
    run_worker_until(dsn, config(SCHEMA), lambda: not thread.is_alive(), timeout=120)
    thread.join(5)
    assert "error" not in box, box.get("error")
    assert box["result"] == app.model(7)


@pytest.mark.parametrize("kind", list(WAITS))
def test_a_restart_landing_on_the_namespace_lookup_is_ridden_out(
        cluster: Cluster, kind: str) -> None:
    """Issue 44 row 7: the wait's first statement, the lookup of the schema holding the id,
    was outside the wait's reconnect loop (CI failed once on ``AdminShutdown … read_bucket``).
    A lock on the bucket table holds the lookup in flight until the restart cuts it."""
    dsn = cluster.dsn
    handle = SyncClient(dsn, schema=SCHEMA, pool_size=0).submit(app.three_steps, 3)
    locker = psycopg.connect(dsn, autocommit=False)
    locker.execute(f"LOCK TABLE {SCHEMA}.bucket IN ACCESS EXCLUSIVE MODE")
    thread, box = _in_thread(lambda: WAITS[kind](dsn, str(handle.id), 120))
    wait_until(lambda: _lookups_waiting(dsn) >= 1, timeout=30, what="the lookup to wait")
    cluster.restart("fast")
    locker.close()
    run_worker_until(dsn, config(SCHEMA), lambda: not thread.is_alive(), timeout=120)
    thread.join(5)
    assert "error" not in box, box.get("error")
    assert box["result"] == app.model(3)


def _lookups_waiting(dsn: str) -> int:
    return int(q1(dsn, SCHEMA, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                  "'Lock' AND query LIKE '%read_bucket%'"))


@pytest.mark.parametrize("kind", list(WAITS))
def test_only_the_deadline_ends_a_wait_and_it_says_the_database_was_down(
        cluster: Cluster, kind: str) -> None:
    dsn = cluster.dsn
    handle = SyncClient(dsn, schema=SCHEMA, pool_size=0).submit(app.three_steps, 1)
    thread, box = _in_thread(lambda: WAITS[kind](dsn, str(handle.id), 4))
    wait_until(lambda: _waiting_backends(dsn) >= 1, timeout=30, what="the wait to start")
    cluster.stop("fast")
    thread.join(60)
    assert not thread.is_alive()
    error = box.get("error")
    assert type(error) is TimeoutError, repr(error)
    assert str(handle.id) in str(error) and "the database was unreachable" in str(error)
    assert "\n" not in str(error)
