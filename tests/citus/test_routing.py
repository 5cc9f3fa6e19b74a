"""Where each hot statement of a tenant runs on Citus (issue 24): the worker's protocol
driven statement by statement through the coordinator with ``citus.log_remote_commands``,
every command Citus sends counted with the node it goes to. Each statement reaches only the
tenant's node with its reads and writes (only intermediate results go elsewhere), in the
number of commands written here (docs/citus.md shows the same table)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel import buckets, connections, db, statements
from kestrel.migrate import migrate_namespace
from kestrel.sql import queries
from kestrel.types import Finish, RecordedStep, Status, StepWrite
from tests.citus.conftest import sharding_dsn
from tests.citus.test_tenants import node_of
from tests.helpers import take_lease

_SERVER = re.compile(r"on server \S+@[\d.]+:(\d+)")
_TXN = re.compile(r"^(BEGIN|COMMIT|ROLLBACK|PREPARE|SELECT assign_distributed_transaction_id"
                  r"|SET |RESET )", re.IGNORECASE)


class Commands:
    """The commands Citus sends to other nodes, by node port (transaction control apart)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.sent: list[tuple[int, str]] = []
        conn.add_notice_handler(self._notice)
        conn.execute("SET citus.log_remote_commands = on")

    def _notice(self, diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if not text.startswith("issuing "):
            return
        command = text.removeprefix("issuing ")
        m = _SERVER.search(diag.message_detail or "")
        if m and not _TXN.match(command):
            self.sent.append((int(m.group(1)), command))

    def take(self) -> list[tuple[int, str]]:
        sent, self.sent = self.sent, []
        return sent


@pytest.fixture
def conn(citus_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(citus_dsn, autocommit=True, prepare_threshold=None) as c:
        connections.configure_connection(c)
        yield c


# (commands to the tenant's node, intermediate results copied to the other node) per
# statement, as Citus 13.2.2 plans them. Routed whole: one command. Planned CTE by CTE (an
# INSERT in a CTE): a command per CTE, those of the PL/pgSQL functions it calls (the archive
# of a finished execution's signals and events), and each subplan's result copied
# to every worker node, the tenant's and the other, in a transaction that commits on both in
# two phases (docs/citus.md: what delegating them to the tenant's node measured, and what is
# next).
EXPECTED = {
    "submit": (1, 0),       # a function run on the coordinator: its INSERT routed
    "claim_batch": (1, 0),  # routed whole
    "heartbeat": (2, 0),    # the process's lease taken, then its executions read
    "save_steps": (1, 0),   # the Citus form: save_steps() delegated to the tenant's node
    "save_steps as a statement": (5, 2),  # the form plain PostgreSQL gets, for comparison
    "complete_batch": (1, 0),  # the Citus form: finish_batch() delegated to the tenant's node
    "notify_done": (0, 0),  # reads no table: raised on the coordinator, where clients listen
    "complete_batch as a statement": (13, 4),  # the form plain PostgreSQL gets (with a tail)
    "reenqueue_expired": (1, 0),  # the Citus form: sweep_expired() delegated
    "reenqueue_expired as a statement": (13, 3),
    "expire_deadlines": (1, 0),  # the Citus form: fail_late() delegated
    "expire_deadlines as a statement": (9, 4),
    "recover_dead_worker": (6, 0),  # one transaction; its pass in the Citus form, each
    # statement of sweep_expired() routed (in a transaction Citus delegates no call)
    "recover_dead_worker with the statement": (15, 3),
}


def test_each_hot_statement_touches_only_the_tenant_node(citus_dsn: str, tenant: str,
                                                         conn: psycopg.Connection[Any]) -> None:
    _each_hot_statement_on_one_node(citus_dsn, tenant, conn)


def test_each_hot_statement_of_a_bucket_touches_only_its_node(
        citus_dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Step 2: a namespace's bucket is a distributed schema like a tenant, so its hot
    statements are routed to its node alone, in the same commands (issue 24)."""
    name = f"cr_{uuid.uuid4().hex[:12]}"
    migrate_namespace(sharding_dsn(citus_dsn), name, buckets=2)
    try:
        _each_hot_statement_on_one_node(citus_dsn, buckets.schema_of(name, 1), conn)
    finally:
        for schema in buckets.schemas(name, 2):
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                pgsql.Identifier(schema)))


def _each_hot_statement_on_one_node(citus_dsn: str, tenant: str,
                                    conn: psycopg.Connection[Any]) -> None:
    q = queries(tenant)
    node = node_of(citus_dsn, tenant)
    seen = Commands(conn)
    trips: dict[str, tuple[int, int]] = {}

    def run(name: str, stmt: Any) -> Any:
        result = (db.run_sync(conn, stmt) if isinstance(stmt, statements.Stmt)
                  else db.run_script_sync(conn, stmt))
        sent = seen.take()
        elsewhere = [cmd for port, cmd in sent if port != node]
        # Only intermediate results ever reach another node; every read or write of the
        # tenant's tables runs on its own.
        assert all(re.match(r'COPY "\d+_\d+" FROM STDIN WITH \(format result\)', c)
                   for c in elsewhere), (name, elsewhere)
        trips[name] = (len(sent) - len(elsewhere), len(elsewhere))
        return result

    eid = run("submit", statements.client.submit(q, statements.client.submit_params(
        workflow="three_steps", args="[1]", queue="default", priority=0,
        idempotency_key=None)))
    [c] = run("claim_batch", statements.executions.claim_batch(
        q, owner="routing", queues=["default"], limit=4, lease_s=30))
    assert c.id == eid
    db.run_sync(conn, statements.client.submit(q, statements.client.submit_params(
        workflow="three_steps", args="[2]", queue="default", priority=0,
        idempotency_key=None)))
    [c2] = db.run_sync(conn, statements.executions.claim_batch(
        q, owner="routing", queues=["default"], limit=4, lease_s=30))
    seen.take()
    assert run("heartbeat", statements.executions.heartbeat(
        q, owner="routing", held=[(c.id, c.epoch)], lease_s=30)).owned == {c.id: False}
    now = time.monotonic()
    assert db.run_sync(conn, statements.migrate.distributed_schema(q)) is True
    seen.take()
    saved = run("save_steps", statements.steps.save_steps(q, [
        StepWrite(c.id, c.epoch, k, "add", str(k), None, 1, 0.01, now) for k in range(3)],
        delegated=True))
    assert [s.inserted for s in saved] == [True] * 3
    saved = run("save_steps as a statement", statements.steps.save_steps(q, [
        StepWrite(c.id, c.epoch, k, "add", str(k), None, 1, 0.01, now) for k in range(3, 5)]))
    assert [s.inserted for s in saved] == [True] * 2
    # The execution with checkpoints (its archive has the most to do) by each form in turn.
    # Each with its last checkpoint (the tail) in the completion's statement.
    assert run("complete_batch as a statement", statements.executions.complete_batch(
        q, [Finish(c.id, c.epoch, Status.COMPLETED, "3", None,
                   StepWrite(c.id, c.epoch, 5, "add", "5", None, 1, 0.01, now))])) == {c.id}
    db.run_sync(conn, statements.steps.save_steps(q, [
        StepWrite(c2.id, c2.epoch, k, "add", str(k), None, 1, 0.01, now) for k in range(5)],
        delegated=True))
    seen.take()
    assert run("complete_batch", statements.executions.complete_batch(
        q, [Finish(c2.id, c2.epoch, Status.COMPLETED, "6", None,
                   StepWrite(c2.id, c2.epoch, 5, "add", "5", None, 1, 0.01, now))],
        delegated=True)) == {c2.id}
    run("notify_done", statements.notify.notify_done(q))
    run("reenqueue_expired", statements.sweeper.reenqueue_expired(
        q, limit=10, max_attempts=5, delegated=True))
    run("reenqueue_expired as a statement", statements.sweeper.reenqueue_expired(
        q, limit=10, max_attempts=5))
    run("expire_deadlines", statements.sweeper.expire_deadlines(q, limit=10, delegated=True))
    run("expire_deadlines as a statement", statements.sweeper.expire_deadlines(q, limit=10))
    # The supervisor's release of a reaped worker's leases, one transaction, in each form
    # (the script asks which one it is: a distributed schema).
    for name, form in (("recover_dead_worker", None),
                       ("recover_dead_worker with the statement", False)):
        db.run_sync(conn, statements.client.submit(q, statements.client.submit_params(
            workflow="three_steps", args="[3]", queue="default", priority=0,
            idempotency_key=None)))
        take_lease(citus_dsn, tenant, f"dead:{name}")
        db.run_sync(conn, statements.executions.claim_batch(
            q, owner=f"dead:{name}", queues=["default"], limit=1, lease_s=30))
        seen.take()
        assert run(name, statements.sweeper.recover_dead_worker(
            q, worker_id=f"dead:{name}", max_attempts=5, delegated=form)).requeued == 1
    assert trips == EXPECTED, trips
    for done in (c, c2):  # the tails, written on the tenant's node with their ends
        assert db.run_sync(conn, statements.steps.load_step(
            q, execution_id=done.id, step_id=5)) == RecordedStep("add", 5, None)
