"""The two forms of every statement that finishes executions do the same: the statements
plain PostgreSQL gets (complete_batch, reenqueue_expired, expire_deadlines) and the calls a
Citus distributed schema gets (finish_batch(), sweep_expired(), fail_late(), the same
functions running here; docs/citus.md).

A batch of completions, every case at once: executions finished with a
result, a JSON null, none, an error; one fenced by a newer epoch; their checkpoints, signals
and events moved to history under the finish time; a waiting parent told by two children
(one word each, woken by the one it waits for); a parent finishing in the same batch as its
child told nothing; a batch sent again (a lost reply's retry) finishing nothing twice."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
import pytest

from kestrel import connections, db, statements
from kestrel.client import SyncClient
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite
from tests.apps import ledger_app as app
from tests.helpers import q, q1, take_lease


@pytest.fixture(params=[False, True], ids=["statement", "citus-form"])
def form(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def claim_all(pg_dsn: str, schema: str, n: int) -> dict[uuid.UUID, int]:
    """Claim the *n* queued executions as worker "w", under its lease; their epochs."""
    take_lease(pg_dsn, schema, "w")

    async def main() -> dict[uuid.UUID, int]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            connections.configure_connection(conn)
            claimed = await db.run(conn, statements.executions.claim_batch(
                queries(schema), owner="w", queues=["default"], limit=n, lease_s=30))
        return {x.id: x.epoch for x in claimed}

    return asyncio.run(main())


def run(pg_dsn: str, stmt: Any) -> Any:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            connections.configure_connection(conn)
            return await db.run(conn, stmt)

    return asyncio.run(main())


def test_both_forms_finish_a_batch_alike(pg_dsn: str, schema: str, form: bool) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ids = [client.submit(app.three_steps, i).id for i in range(7)]
    parent, a, b, c, fenced, solo, dup_parent = ids
    # Children: a and b of parent (which waits for b), c of dup_parent (both in the batch).
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET parent_id = %s WHERE id IN (%s, %s)",
      [parent, a, b])
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET parent_id = %s WHERE id = %s",
      [dup_parent, c])
    client.signal(a, "approve", {"by": "x'); DROP TABLE signals; --"})

    async def main() -> tuple[set[uuid.UUID], set[uuid.UUID]]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            connections.configure_connection(conn)
            claimed = await db.run(conn, statements.executions.claim_batch(
                qs, owner="w", queues=["default"], limit=7, lease_s=30))
            epoch = {x.id: x.epoch for x in claimed}
            assert set(epoch) == set(ids)
            await db.run(conn, statements.steps.save_steps(
                qs, [StepWrite(a, epoch[a], 0, "add", "10", None, 1, 0.0),
                     StepWrite(a, epoch[a], 1, "add", "11", None, 1, 0.0),
                     StepWrite(solo, epoch[solo], 0, "add", "null", None, 1, 0.0)]))
            assert await db.run(conn, statements.steps.set_event(
                qs, id=a, epoch=epoch[a], key="progress", value='"half"'))
            # The parent waits for b (parked), off its claim.
            q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'waiting', "
              "waiting_for = %s, wake_at = 'infinity', lease_owner = NULL "
              "WHERE id = %s", [f"kestrel.child:{b}", parent])
            batch = [
                Finish(a, epoch[a], Status.COMPLETED, "21", None),
                Finish(b, epoch[b], Status.COMPLETED, "null", None),  # JSON null
                Finish(c, epoch[c], Status.FAILED, None, '{"type": "Boom"}'),
                Finish(fenced, epoch[fenced] - 1, Status.COMPLETED, "1", None),
                Finish(solo, epoch[solo], Status.CANCELLED, None, None),  # none at all
                Finish(dup_parent, epoch[dup_parent], Status.COMPLETED, '"ü 🚀"', None),
            ]
            done = await db.run(conn, statements.executions.complete_batch(
                qs, batch, delegated=form))
            again = await db.run(conn, statements.executions.complete_batch(
                qs, batch, delegated=form))
            return done, again

    done, again = asyncio.run(main())
    assert done == {a, b, c, solo, dup_parent}
    assert again == set()  # the retry finishes nothing twice (finished_readback learns it)
    hist = {r[0]: r[1:] for r in q(pg_dsn, schema, "SELECT id, status, result, error, "
                                   "result IS NULL FROM {s}.workflow_history")}
    assert hist == {a: ("completed", 21, None, False), b: ("completed", None, None, False),
                    c: ("failed", None, {"type": "Boom"}, True),
                    solo: ("cancelled", None, None, True),
                    dup_parent: ("completed", "ü 🚀", None, False)}
    # The fenced one still runs under its newer epoch; nothing finished is left hot.
    assert q(pg_dsn, schema, "SELECT id, status FROM {s}.workflow_executions "
             "WHERE id <> %s", [parent]) == [(fenced, "running")]
    finished_at = q1(pg_dsn, schema, "SELECT finished_at FROM {s}.workflow_history "
                     "WHERE id = %s", [a])
    assert q(pg_dsn, schema, "SELECT execution_id, step_id, output, execution_finished_at "
             "FROM {s}.step_history ORDER BY 1, 2") == sorted(
        [(a, 0, 10, finished_at), (a, 1, 11, finished_at), (solo, 0, None, finished_at)])
    # Written once, never moved (migration 0019): the three rows are the ones above.
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs") == 3
    assert q(pg_dsn, schema, "SELECT execution_id, name, payload FROM {s}.signal_history") \
        == [(a, "approve", {"by": "x'); DROP TABLE signals; --"})]
    assert q(pg_dsn, schema, "SELECT execution_id, key, value FROM {s}.event_history") \
        == [(a, "progress", "half")]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.events") == 0
    # The waiting parent: one word per child, woken (it waits for b); dup_parent, finished
    # in the same batch as its child, was told nothing (and did not fail the batch).
    words = q(pg_dsn, schema, "SELECT execution_id, name, payload FROM {s}.signals "
              "ORDER BY name")
    assert sorted(words) == sorted([
        (parent, f"kestrel.child:{a}", {"status": "completed", "result": 21, "error": None}),
        (parent, f"kestrel.child:{b}", {"status": "completed", "result": None,
                                         "error": None})])
    seq, woken = q(pg_dsn, schema, "SELECT signal_seq, wake_at <= {s}.kestrel_now() "
                   "FROM {s}.workflow_executions WHERE id = %s", [parent])[0]
    assert seq == 2 and woken
    assert json.dumps(hist[dup_parent][1]) == json.dumps("ü 🚀")


def test_a_parent_waiting_for_another_child_sleeps_and_a_gone_parent_gets_no_word(
        pg_dsn: str, schema: str, form: bool) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    parent, child, orphan = (client.submit(app.three_steps, i).id for i in range(3))
    other = uuid.uuid4()
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET parent_id = %s WHERE id = %s",
      [parent, child])
    # orphan's parent finished long ago (it is in no hot row): nobody to tell.
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET parent_id = %s WHERE id = %s",
      [other, orphan])

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            connections.configure_connection(conn)
            claimed = await db.run(conn, statements.executions.claim_batch(
                qs, owner="w", queues=["default"], limit=3, lease_s=30))
            epoch: dict[Any, int] = {x.id: x.epoch for x in claimed}
            q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'waiting', "
              "waiting_for = %s, wake_at = 'infinity', lease_owner = NULL WHERE id = %s",
              [f"kestrel.child:{other}", parent])
            await db.run(conn, statements.executions.complete_batch(
                qs, [Finish(child, epoch[child], Status.COMPLETED, "1", None),
                     Finish(orphan, epoch[orphan], Status.COMPLETED, "2", None)],
                delegated=form))

    asyncio.run(main())
    seq, asleep = q(pg_dsn, schema, "SELECT signal_seq, wake_at = 'infinity' "
                    "FROM {s}.workflow_executions WHERE id = %s", [parent])[0]
    assert seq == 1 and asleep
    assert q(pg_dsn, schema, "SELECT execution_id, name FROM {s}.signals") == [
        (parent, f"kestrel.child:{child}")]


def test_both_forms_of_the_sweeper_requeue_quarantine_and_fail_alike(
        pg_dsn: str, schema: str, form: bool) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ids = [client.submit(app.three_steps, i).id for i in range(4)]
    lost, poisoned, alive, parent = ids
    epoch = claim_all(pg_dsn, schema, 4)
    run(pg_dsn, statements.steps.save_steps(
        qs, [StepWrite(poisoned, epoch[poisoned], 0, "add", "5", None, 1, 0.0)]))
    # lost's and poisoned's workers died (their leases ended); poisoned is out of attempts;
    # alive's lease holds. parent waits for poisoned.
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET lease_expires_at = "
      "{s}.kestrel_now() - interval '1 second' WHERE id IN (%s, %s)", [lost, poisoned])
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET attempts = 5, parent_id = %s "
      "WHERE id = %s", [parent, poisoned])
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'waiting', "
      "waiting_for = %s, wake_at = 'infinity', lease_owner = NULL, lease_expires_at = NULL "
      "WHERE id = %s", [f"kestrel.child:{poisoned}", parent])
    swept = run(pg_dsn, statements.sweeper.reenqueue_expired(
        qs, limit=10, max_attempts=5, delegated=form))
    assert (swept.requeued, swept.quarantined, swept.examined) == (1, 1, 2)
    again = run(pg_dsn, statements.sweeper.reenqueue_expired(
        qs, limit=10, max_attempts=5, delegated=form))
    assert (again.requeued, again.quarantined, again.examined) == (0, 0, 0)
    assert dict(q(pg_dsn, schema, "SELECT id, status FROM {s}.workflow_executions")) == {
        lost: "queued", alive: "running", parent: "waiting"}
    assert q1(pg_dsn, schema, "SELECT lease_owner FROM {s}.workflow_executions "
              "WHERE id = %s", [lost]) is None
    status, error = q(pg_dsn, schema, "SELECT status, error FROM {s}.workflow_history "
                      "WHERE id = %s", [poisoned])[0]
    assert status == "quarantined" and error == {
        "type": "Quarantined", "message": "claimed 5 times without finishing "
        "(max_attempts = 5): the execution keeps losing its worker"}
    assert q(pg_dsn, schema, "SELECT execution_id, output FROM {s}.step_history") == [
        (poisoned, 5)]
    assert q(pg_dsn, schema, "SELECT execution_id, name, payload FROM {s}.signals") == [
        (parent, f"kestrel.child:{poisoned}",
         {"status": "quarantined", "result": None, "error": error})]
    assert q1(pg_dsn, schema, "SELECT wake_at <= {s}.kestrel_now() "
              "FROM {s}.workflow_executions WHERE id = %s", [parent])


def test_both_forms_fail_the_queued_and_waiting_past_their_deadline_alike(
        pg_dsn: str, schema: str, form: bool) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    late_q, late_w, early, running, parent = (client.submit(app.three_steps, i).id
                                              for i in range(5))
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET deadline = "
      "{s}.kestrel_now() - interval '1 minute' WHERE id IN (%s, %s, %s)",
      [late_q, late_w, running])
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET deadline = "
      "{s}.kestrel_now() + interval '1 hour' WHERE id = %s", [early])
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'running', "
      "lease_owner = 'w', lease_expires_at = {s}.kestrel_now() + interval '1 minute' "
      "WHERE id = %s", [running])  # its own worker fails it: not the sweeper's
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'waiting', "
      "waiting_for = 'go', wake_at = 'infinity', parent_id = %s WHERE id = %s",
      [parent, late_w])
    assert run(pg_dsn, statements.sweeper.expire_deadlines(qs, limit=10, delegated=form)) == 2
    assert run(pg_dsn, statements.sweeper.expire_deadlines(qs, limit=10, delegated=form)) == 0
    rows = q(pg_dsn, schema, "SELECT id, status, error->>'type' FROM {s}.workflow_history")
    assert sorted(rows) == sorted([(late_q, "failed", "kestrel.errors.DeadlineExceeded"),
                                   (late_w, "failed", "kestrel.errors.DeadlineExceeded")])
    assert sorted(q(pg_dsn, schema, "SELECT execution_id, status, deadline "
                    "FROM {s}.uncounted_finishes")) == sorted(
        [(late_q, "failed", True), (late_w, "failed", True)])
    assert q(pg_dsn, schema, "SELECT execution_id, name FROM {s}.signals") == [
        (parent, f"kestrel.child:{late_w}")]
    assert {r[0] for r in q(pg_dsn, schema, "SELECT id FROM {s}.workflow_executions")} == {
        early, running, parent}
