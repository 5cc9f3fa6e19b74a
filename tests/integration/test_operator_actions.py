"""Lost replies to waits and what operators do to executions that waited (issue 22).

FAULTS R2 (a wait never parks at a recorded position; a lost reply to consume_signal takes no
second signal), O1 (retry gives back what the dropped checkpoints took), O2 (cancel a parent
and its child, retry the parent), O3 (fork from any position) and row 12 of the issue:
signals and events leave the hot tables with their execution and come back with a retry.

Every test runs a real worker in this process (kestrel.testing) on a real PostgreSQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kestrel
from kestrel import db, failpoints, statements
from kestrel.errors import (
    ChildFailed,
    ConfigError,
    ExecutionNotFound,
    IdempotencyConflict,
    InvalidState,
    SerializationError,
    StepFailed,
)
from kestrel.sql import queries
from kestrel.testing import KestrelTestEnv
from kestrel.workflow import Context
from tests.helpers import config, q, q1, run_worker_until

# -- workflows ---------------------------------------------------------------------------------


@kestrel.step(name="ops.try_first")
async def try_first() -> str:
    return "first ok"


@kestrel.step(name="ops.fallback")
async def fallback() -> str:
    return "fallback"


@kestrel.step(name="ops.finish")
async def finish(value: Any) -> Any:
    return value


@kestrel.step(name="ops.double")
async def double(x: int) -> int:
    return 2 * x


@kestrel.workflow(name="ops.one_approval")
async def one_approval(ctx: Context) -> Any:
    got = await ctx.wait_for_signal("approval")
    return got.payload


@kestrel.workflow(name="ops.catch_wait_fail")
async def catch_wait_fail(ctx: Context) -> Any:
    """0 a step whose failure is caught, 1 a wait, 2 an event, 3 a step that may fail."""
    try:
        first = await ctx.step(try_first)
    except StepFailed:
        first = "first failed"
    got = await ctx.wait_for_signal("go")
    await ctx.set_event("progress", {"waited": got.payload})
    return [first, await ctx.step(finish, got.payload)]


@kestrel.workflow(name="ops.child")
async def child(ctx: Context, x: int) -> int:
    return await ctx.step(double, x)


@kestrel.workflow(name="ops.catch_child_fail")
async def catch_child_fail(ctx: Context, x: int) -> Any:
    """0 a step whose failure is caught, 1 start_child, 2 its wait, 3 a step that may fail."""
    try:
        first = await ctx.step(try_first)
    except StepFailed:
        first = "first failed"
    result = await ctx.child(child, x)
    return [first, await ctx.step(finish, result)]


@kestrel.workflow(name="ops.waits_forever")
async def waits_forever(ctx: Context) -> Any:
    return (await ctx.wait_for_signal("never")).payload


@kestrel.workflow(name="ops.parent_of_waiter")
async def parent_of_waiter(ctx: Context) -> Any:
    try:
        return await ctx.child(waits_forever)
    except ChildFailed as exc:
        return f"child {exc.status}"


@kestrel.workflow(name="ops.start_then_wait")
async def start_then_wait(ctx: Context, x: int) -> Any:
    """0 start_child, 1 its wait, 2 a step."""
    handle = await ctx.start_child(child, x)
    result = await ctx.wait_child(handle)
    return await ctx.step(finish, result)


@kestrel.workflow(name="ops.start_waiter_then_wait")
async def start_waiter_then_wait(ctx: Context) -> Any:
    handle = await ctx.start_child(waits_forever)
    return await ctx.wait_child(handle)


@kestrel.workflow(name="ops.caught")
async def caught(ctx: Context) -> Any:
    """0 a step whose failure is caught, then the fallback branch."""
    try:
        first = await ctx.step(try_first)
    except StepFailed:
        first = await ctx.step(fallback)
    return await ctx.step(finish, first)


@kestrel.workflow(name="ops.publishes")
async def publishes(ctx: Context) -> Any:
    """Events at 0, 1 and 2, a step at 3."""
    await ctx.set_event("stage", "one")
    await ctx.set_event("stage", "two")
    await ctx.set_event("other", {"n": 1})
    return await ctx.step(finish, "done")


@kestrel.workflow(name="ops.patched")
async def patched(ctx: Context) -> Any:
    """A step at 0, a patch asked at 1 (its marker records {"at": 1}), a step at 1."""
    a = await ctx.step(finish, "a")
    new = await ctx.patched("ops-p1")
    return [a, new, await ctx.step(finish, "b")]


@kestrel.workflow(name="ops.catch_patch_fail")
async def catch_patch_fail(ctx: Context) -> Any:
    """A caught failure at 0, a patch asked at 1, a step that may fail at 1."""
    try:
        first = await ctx.step(try_first)
    except StepFailed:
        first = "first failed"
    new = await ctx.patched("ops-p2")
    return [first, new, await ctx.step(finish, "b")]


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_faults_left() -> Iterator[None]:
    yield
    failpoints.disarm()


def signals_of(env: KestrelTestEnv, eid: object) -> list[tuple[Any, Any]]:
    """(payload, consumed_step) of every signal the execution has, hot or archived."""
    return q(env.dsn, env.schema,
             "SELECT payload, consumed_step FROM (SELECT id, payload, consumed_step "
             "FROM {s}.signals WHERE execution_id = %s UNION ALL SELECT id, payload, "
             "consumed_step FROM {s}.signal_history WHERE execution_id = %s) s ORDER BY id",
             [eid, eid])


def hot_rows(env: KestrelTestEnv, eid: object) -> tuple[int, int]:
    """How many signals and events of the execution are in the hot tables."""
    row = q(env.dsn, env.schema,
            "SELECT (SELECT count(*) FROM {s}.signals WHERE execution_id = %s), "
            "(SELECT count(*) FROM {s}.events WHERE execution_id = %s)", [eid, eid])[0]
    return int(row[0]), int(row[1])


def run_until(env: KestrelTestEnv, done: Any) -> None:
    run_worker_until(env.dsn, config(env.schema), done, timeout=30)


def status(env: KestrelTestEnv, eid: object) -> str:
    return env.client.get(str(eid)).status.value


# -- R2: lost replies at a wait ---------------------------------------------------------------


def test_a_lost_reply_to_consume_signal_takes_no_second_signal(
        kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    h = client.submit(one_approval)
    client.signal(h.id, "approval", "first")
    client.signal(h.id, "approval", "second")
    # consume_signal commits (the first signal is taken into the wait's checkpoint), then
    # the connection dies before the reply: the runner sends it again.
    failpoints.arm("after_consume_signal_commit", "raise", times=1)
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == "first"
    assert signals_of(kestrel_env, h.id) == [("first", 0), ("second", None)]


def test_a_wait_replays_the_checkpoint_its_position_got_instead_of_parking(
        kestrel_env: KestrelTestEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    client = kestrel_env.client
    h = client.submit(one_approval)
    real_run = db.run
    park = queries(kestrel_env.schema).park
    recorded = {"received": True, "payload": "recorded meanwhile"}

    async def park_after_a_record(conn: db.AnyConn, stmt: statements.Stmt[Any]) -> Any:
        if stmt.query == park:
            # The position got its checkpoint between the look for a signal and the park.
            kw = dict(stmt.params or {})
            await conn.execute(
                f'INSERT INTO "{kestrel_env.schema}".operation_outputs (execution_id, '
                "step_id, step_name, output, attempt, lease_epoch, started_at) VALUES (%s, %s, "
                "'kestrel.signal:approval', %s::jsonb, 1, %s, now()) ON CONFLICT DO NOTHING",
                [kw["id"], kw["step_id"], '{"received": true, "payload": "recorded meanwhile"}',
                 kw["epoch"]])
        return await real_run(conn, stmt)

    monkeypatch.setattr(db, "run", park_after_a_record)
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == recorded["payload"]
    assert run.timeline == [("kestrel.signal:approval", 1, "ok")]


def test_park_refuses_a_position_that_has_a_checkpoint(kestrel_env: KestrelTestEnv) -> None:
    dsn, schema = kestrel_env.dsn, kestrel_env.schema
    h = kestrel_env.client.submit(one_approval)
    q(dsn, schema, "UPDATE {s}.workflow_executions SET status = 'running', lease_epoch = 1, "
      "lease_owner = 't', lease_expires_at = {s}.kestrel_now() + interval '1 minute' "
      "WHERE id = %s", [h.id])
    q(dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES (%s, 0, 'kestrel.signal:approval', "
      "'{{\"received\": true, \"payload\": 1}}', 1, 1, now())", [h.id])
    assert q1(dsn, schema, "SELECT {s}.park_execution(%s, 1, 0, 'approval', NULL, NULL)",
              [h.id]) == "recorded"
    assert q1(dsn, schema, "SELECT {s}.park_execution(%s, 1, 0, 'approval', NULL, "
              "(SELECT signal_seq FROM {s}.workflow_executions WHERE id = %s))",
              [h.id, h.id]) == "recorded"
    assert status(kestrel_env, h.id) == "running"
    # consume_signal at that position returns what is recorded and takes nothing.
    kestrel_env.client.signal(h.id, "approval", 2)
    assert q(dsn, schema, "SELECT owned, output FROM {s}.consume_signal(%s, 1, 0, "
             "'approval', 'kestrel.signal:approval')", [h.id]) == [
                 (True, {"received": True, "payload": 1})]
    assert signals_of(kestrel_env, h.id) == [(2, None)]


# -- O1, O2: retry ----------------------------------------------------------------------------


def test_retry_gives_back_the_signal_a_dropped_wait_consumed(
        kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    kestrel_env.fail_step(try_first, times=1)  # caught: the branch continues
    kestrel_env.fail_step(finish, times=1)     # not caught: the execution fails
    h = client.submit(catch_wait_fail)
    client.signal(h.id, "go", 7)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_timeline([
        ("ops.try_first", 1, "error"), "kestrel.signal:go", "kestrel.set_event:progress",
        ("ops.finish", 1, "error")])
    assert status(kestrel_env, h.id) == "failed"
    client.retry(h.id)
    # A fresh run from the first failed step (0): the wait at 1 gets the signal again.
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == ["first ok", 7]
    assert signals_of(kestrel_env, h.id) == [(7, 1)]


def test_retry_after_a_child_was_waited_for_gets_the_childs_result(
        kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    kestrel_env.fail_step(try_first, times=1)
    kestrel_env.fail_step(finish, times=1)
    h = client.submit(catch_child_fail, 5)
    kestrel_env.run_until_finished(h.id, timeout=20)
    assert status(kestrel_env, h.id) == "failed"
    [child_id] = [r[0] for r in q(kestrel_env.dsn, kestrel_env.schema,
                                  "SELECT id FROM {s}.workflow_history WHERE parent_id = %s",
                                  [h.id])]
    client.retry(h.id)
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == ["first ok", 10]
    # The same child (its key is the parent's and the step's), its end consumed once.
    assert q(kestrel_env.dsn, kestrel_env.schema, "SELECT id FROM {s}.workflow_history "
             "WHERE parent_id = %s", [h.id]) == [(child_id,)]
    assert [s[1] for s in signals_of(kestrel_env, h.id)] == [2]


def test_cancel_a_parent_waiting_for_its_child_then_retry_the_parent_ends(
        kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    h = client.submit(parent_of_waiter)
    run_until(kestrel_env, lambda: q1(
        kestrel_env.dsn, kestrel_env.schema,
        "SELECT count(*) FROM {s}.workflow_executions WHERE status = 'waiting'") == 2)
    assert client.cancel(h.id) == "cancelled"  # the parent and its child, one statement
    assert q1(kestrel_env.dsn, kestrel_env.schema, "SELECT count(*) FROM "
              "{s}.workflow_history WHERE status = 'cancelled'") == 2
    client.retry(h.id)
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == "child cancelled"


def test_retry_drops_the_patch_markers_of_the_positions_it_drops(
        kestrel_env: KestrelTestEnv) -> None:
    dsn, schema = kestrel_env.dsn, kestrel_env.schema
    kestrel_env.fail_step(try_first, times=1)
    kestrel_env.fail_step(finish, times=1)
    h = kestrel_env.client.submit(catch_patch_fail)
    kestrel_env.run_until_finished(h.id, timeout=20)
    assert q(dsn, schema, "SELECT step_id, output FROM {s}.step_history WHERE execution_id "
             "= %s AND step_id < 0", [h.id]) == [(-1, {"at": 1})]
    kestrel_env.client.retry(h.id)
    # The first failed step is at 0: the marker asked at 1 belongs to the dropped branch.
    assert q(dsn, schema, "SELECT step_id FROM {s}.operation_outputs WHERE execution_id = %s",
             [h.id]) == []
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == ["first ok", True, "b"]


# -- O3: fork ---------------------------------------------------------------------------------


def test_fork_after_a_start_child_gets_the_childs_result(kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    h = client.submit(start_then_wait, 4)
    assert kestrel_env.run_until_finished(h.id, timeout=20).assert_completed() == 8
    forked = client.fork(h.id, 1)  # keeps start_child, re-runs its wait
    assert kestrel_env.run_until_finished(forked.id, timeout=20).assert_completed() == 8
    assert q1(kestrel_env.dsn, kestrel_env.schema, "SELECT count(*) FROM "
              "{s}.workflow_history WHERE workflow = 'ops.child'") == 1
    assert q(kestrel_env.dsn, kestrel_env.schema, "SELECT forked_from, from_step FROM "
             "{s}.forks WHERE id = %s", [forked.id]) == [(h.id, 1)]


def test_fork_while_the_child_still_runs_is_refused_naming_the_step(
        kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    h = client.submit(start_waiter_then_wait)
    run_until(kestrel_env, lambda: q1(
        kestrel_env.dsn, kestrel_env.schema,
        "SELECT count(*) FROM {s}.workflow_executions WHERE status = 'waiting'") == 2)
    with pytest.raises(InvalidState, match=r"step 0 started child .* which has not ended"):
        client.fork(h.id, 1)
    assert q1(kestrel_env.dsn, kestrel_env.schema,
              "SELECT count(*) FROM {s}.workflow_executions") == 2  # nothing written
    client.fork(h.id, 0)  # before the start_child: the fork starts its own child


def test_fork_past_a_caught_failure_replays_the_branch_it_took(
        kestrel_env: KestrelTestEnv) -> None:
    kestrel_env.fail_step(try_first, times=1)
    h = kestrel_env.client.submit(caught)
    run = kestrel_env.run_until_finished(h.id, timeout=20)
    assert run.assert_completed() == "fallback"
    forked = kestrel_env.client.fork(h.id, 2)
    run = kestrel_env.run_until_finished(forked.id, timeout=20)
    assert run.assert_completed() == "fallback"
    assert run.timeline == [("ops.try_first", 1, "error"), ("ops.fallback", 1, "ok"),
                            ("ops.finish", 1, "ok")]


def test_fork_carries_the_events_set_before_its_position(kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    h = client.submit(publishes)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_completed()
    forked = client.fork(h.id, 2)
    # Before the fork runs at all: what the copied history had published.
    assert client.get_event(forked.id, "stage", timeout=0) == "two"
    with pytest.raises(TimeoutError):
        client.get_event(forked.id, "other", timeout=0)
    kestrel_env.run_until_finished(forked.id, timeout=20).assert_completed()
    assert client.get_event(forked.id, "other", timeout=0) == {"n": 1}
    assert client.get_event(h.id, "stage", timeout=0) == "two"  # the original's, finished


def test_fork_past_the_end_is_refused(kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    h = client.submit(publishes)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_completed()
    with pytest.raises(ConfigError, match="a fork may start at step 4 at most"):
        client.fork(h.id, 5)
    with pytest.raises(ConfigError, match="must not be negative"):
        client.fork(h.id, -1)
    forked = client.fork(h.id, 4)  # everything replays
    assert kestrel_env.run_until_finished(forked.id, timeout=20).assert_completed() == "done"
    waiting = client.submit(one_approval)
    run_until(kestrel_env, lambda: status(kestrel_env, waiting.id) == "waiting")
    client.fork(waiting.id, 1)  # the parked wait counts as a position it reached
    with pytest.raises(ConfigError):
        client.fork(waiting.id, 2)


def test_fork_sent_again_after_a_lost_reply_returns_the_fork_it_made(
        kestrel_env: KestrelTestEnv) -> None:
    dsn, schema = kestrel_env.dsn, kestrel_env.schema
    h = kestrel_env.client.submit(publishes)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_completed()
    new = uuid.uuid4()
    for _ in range(2):  # the second call is the retry of a call whose reply was lost
        assert q1(dsn, schema, "SELECT {s}.fork(%s, 2, %s)", [h.id, new]) == new
    assert q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 1
    assert q1(dsn, schema, "SELECT count(*) FROM {s}.operation_outputs "
              "WHERE execution_id = %s", [new]) == 2
    with pytest.raises(IdempotencyConflict, match="already used by the fork of"):
        kestrel_env.client._run(statements.value(kestrel_env.client._q.fork, {
            "id": h.id, "from_step": 1, "new_id": new, "idempotency_key": None}))


def test_fork_copies_the_patch_markers_asked_before_its_position(
        kestrel_env: KestrelTestEnv) -> None:
    dsn, schema = kestrel_env.dsn, kestrel_env.schema
    h = kestrel_env.client.submit(patched)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_completed()
    after = kestrel_env.client.fork(h.id, 2)
    at = kestrel_env.client.fork(h.id, 1)
    markers = "SELECT count(*) FROM {s}.operation_outputs WHERE execution_id = %s AND step_id < 0"
    assert q1(dsn, schema, markers, [after.id]) == 1
    assert q1(dsn, schema, markers, [at.id]) == 0  # asked at 1: the fork asks again
    for f in (after, at):
        assert kestrel_env.run_until_finished(f.id, timeout=20).assert_completed() == [
            "a", True, "b"]


# -- row 12: signals and events leave with their execution ------------------------------------


def test_signals_and_events_leave_with_the_execution_and_come_back_with_retry(
        kestrel_env: KestrelTestEnv) -> None:
    client = kestrel_env.client
    kestrel_env.fail_step(try_first, times=1)
    kestrel_env.fail_step(finish, times=1)
    h = client.submit(catch_wait_fail)
    client.signal(h.id, "go", 1)
    client.signal(h.id, "go", 2)  # never consumed
    kestrel_env.run_until_finished(h.id, timeout=20)
    assert status(kestrel_env, h.id) == "failed"
    assert hot_rows(kestrel_env, h.id) == (0, 0)
    assert client.get_event(h.id, "progress", timeout=0) == {"waited": 1}
    client.retry(h.id)
    assert hot_rows(kestrel_env, h.id) == (2, 1)
    assert signals_of(kestrel_env, h.id) == [(1, None), (2, None)]  # the wait at 1 is dropped
    assert kestrel_env.run_until_finished(h.id, timeout=20).assert_completed() == [
        "first ok", 1]
    assert hot_rows(kestrel_env, h.id) == (0, 0)
    assert signals_of(kestrel_env, h.id) == [(1, 1), (2, None)]
    assert client.get_event(h.id, "progress", timeout=0) == {"waited": 1}
    # A cancelled execution's signals leave with it too.
    waiting = client.submit(one_approval)
    client.signal(waiting.id, "other", "x")
    client.cancel(waiting.id)
    assert hot_rows(kestrel_env, waiting.id) == (0, 0)
    assert signals_of(kestrel_env, waiting.id) == [("x", None)]
    # So do those of one whose deadline passed while it waited (the sweeper fails it).
    late = client.submit(one_approval, timeout=60)
    client.signal(late.id, "other", "y")
    run_until(kestrel_env, lambda: status(kestrel_env, late.id) == "waiting")
    kestrel_env.advance_clock(61)
    assert kestrel_env.run_until_finished(late.id, timeout=20).status.value == "failed"
    assert hot_rows(kestrel_env, late.id) == (0, 0)
    assert signals_of(kestrel_env, late.id) == [("y", None)]


def test_retention_drops_signals_and_events_with_their_execution(
        kestrel_env: KestrelTestEnv) -> None:
    dsn, schema = kestrel_env.dsn, kestrel_env.schema
    q(dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '-40 days'")
    assert q1(dsn, schema, "SELECT {s}.kestrel_ensure_history_partitions_v1('day', 0, true)"
              ) == 4  # the partitions of that day: three history tables, the checkpoints
    client = kestrel_env.client
    h = client.submit(catch_wait_fail)
    client.signal(h.id, "go", 3)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_completed()
    assert hot_rows(kestrel_env, h.id) == (0, 0)
    q(dsn, schema, "UPDATE {s}.clock_offset SET offset_by = '0'")
    assert q1(dsn, schema, "SELECT {s}.kestrel_drop_history_partitions_v1(interval '30 days')"
              ) == 4
    for table in ("workflow_history", "operation_outputs", "signal_history", "event_history"):
        where = "id" if table == "workflow_history" else "execution_id"
        assert q1(dsn, schema, f"SELECT count(*) FROM {{s}}.{table} WHERE {where} = %s",
                  [h.id]) == 0, table


def test_the_migration_moves_what_finished_executions_left_behind(
        kestrel_env: KestrelTestEnv) -> None:
    """Migration 0013's backfill, run again on rows put back where older code left them."""
    from pathlib import Path

    dsn, schema = kestrel_env.dsn, kestrel_env.schema
    h = kestrel_env.client.submit(catch_wait_fail)
    kestrel_env.client.signal(h.id, "go", 1)
    kestrel_env.run_until_finished(h.id, timeout=20).assert_completed()
    q(dsn, schema, "WITH m AS (DELETE FROM {s}.signal_history RETURNING *) INSERT INTO "
      "{s}.signals (id, execution_id, name, payload, idempotency_key, created_at, "
      "consumed_step, consumed_at) SELECT id, execution_id, name, payload, idempotency_key, "
      "created_at, consumed_step, consumed_at FROM m")
    q(dsn, schema, "INSERT INTO {s}.events (execution_id, key, value) VALUES (%s, 'k', '1'), "
      "(%s, 'k', '2')", [h.id, uuid.uuid4()])
    text = (Path(__file__).resolve().parents[2] / "sql" / "migrations"
            / "0013_signals_events_leave_with_execution.sql").read_text()
    backfill = text.split("-- What finished executions left behind", 1)[1]
    backfill = backfill.split("\n", 1)[1].split("-- Which execution a fork copied", 1)[0]
    code = "\n".join(line for line in backfill.splitlines() if not line.startswith("--"))
    for statement in filter(str.strip, code.split(";")):
        q(dsn, schema, statement.replace("__schema__", "{s}"))
    assert hot_rows(kestrel_env, h.id) == (0, 0)
    assert q1(dsn, schema, "SELECT count(*) FROM {s}.events") == 0  # the orphan went
    assert signals_of(kestrel_env, h.id) == [(1, 1)]
    assert kestrel_env.client.get_event(h.id, "k", timeout=0) == 1


# -- hostile input at the operator doors --------------------------------------------------------

HOSTILE_KEYS = ["", "nul\x00key", "lone \ud800 surrogate", "k" * 1025, "é" * 1025]


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=["empty", "nul", "surrogate", "long",
                                                   "wide"])
def test_hostile_retry_and_fork_keys_are_refused_with_nothing_written(
        kestrel_env: KestrelTestEnv, key: str) -> None:
    """retry() and fork() take idempotency keys (issue 22): a key no door may store is a
    typed refusal before anything is written, from Python as from SQL."""
    client = kestrel_env.client
    h = client.submit(one_approval)
    assert client.cancel(h.id) == "cancelled"
    before = q(kestrel_env.dsn, kestrel_env.schema,
               "SELECT (SELECT count(*) FROM {s}.executions), "
               "(SELECT count(*) FROM {s}.idempotency_keys)")
    with pytest.raises(SerializationError):
        client.retry(h.id, idempotency_key=key)
    with pytest.raises(SerializationError):
        client.fork(h.id, 0, idempotency_key=key)
    if "\x00" not in key and "\ud800" not in key:  # libpq cannot even send those
        for call in ("SELECT {s}.retry(%s, %s)", "SELECT {s}.fork(%s, 0, NULL, %s)"):
            with pytest.raises(Exception, match="idempotency key"):
                q(kestrel_env.dsn, kestrel_env.schema, call, (h.id, key))
    assert q(kestrel_env.dsn, kestrel_env.schema,
             "SELECT (SELECT count(*) FROM {s}.executions), "
             "(SELECT count(*) FROM {s}.idempotency_keys)") == before
    assert status(kestrel_env, h.id) == "cancelled"


@pytest.mark.parametrize("step", [-1, 2**31, 2**64])
def test_hostile_fork_positions_are_refused_with_nothing_written(
        kestrel_env: KestrelTestEnv, step: int) -> None:
    client = kestrel_env.client
    h = client.submit(one_approval)
    assert client.cancel(h.id) == "cancelled"
    with pytest.raises(Exception):  # noqa: B017 - KS002 (ConfigError) or a numeric overflow
        client.fork(h.id, step)
    assert q1(kestrel_env.dsn, kestrel_env.schema,
              "SELECT count(*) FROM {s}.executions") == 1
    unknown = uuid.UUID(int=2**64)
    with pytest.raises(ExecutionNotFound):
        client.fork(unknown, 0)
    with pytest.raises(ExecutionNotFound):
        client.retry(unknown, idempotency_key="retry-unknown")
    assert q1(kestrel_env.dsn, kestrel_env.schema,
              "SELECT count(*) FROM {s}.idempotency_keys") == 0
