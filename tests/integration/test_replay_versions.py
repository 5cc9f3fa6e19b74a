"""Replay against code of another version, in one process (FAULTS O5, issue 22).

A code change is made the honest way: an execution runs under one workflow function until it
parks, then its row is pointed at another function registered for the same purpose (the
workflow column renamed), as a deploy of other code under the same name would do.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import kestrel
from kestrel import db, statements
from kestrel.client import SyncClient
from kestrel.errors import SerializationError
from kestrel.sql import queries
from kestrel.types import Claimed
from kestrel.workflow import registry
from tests.helpers import config, q, q1, run_worker_until


@kestrel.step(name="replayv.a")
async def step_a(n: int) -> int:
    return n + 1


@kestrel.step(name="replayv.new")
async def step_new(n: int) -> int:
    return n * 100


@kestrel.step(name="replayv.other")
async def step_other(n: int) -> int:
    return -n


@kestrel.step(name="replayv.b")
async def step_b(n: int) -> int:
    return n + 2


# -- the call at a parked wait's position must be that wait -----------------------------------

@kestrel.workflow(name="replayv.waits_for_approve")
async def waits_for_approve(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    got = await ctx.wait_for_signal("approve")
    return [a, got.payload, await ctx.step(step_b, a)]


@kestrel.workflow(name="replayv.sleeps")
async def sleeps(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    await ctx.sleep(3600)
    return await ctx.step(step_b, a)


@kestrel.workflow(name="replayv.sleeps_instead")
async def sleeps_instead(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    await ctx.sleep(0)
    return await ctx.step(step_b, a)


@kestrel.workflow(name="replayv.waits_for_other")
async def waits_for_other(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    await ctx.wait_for_signal("other", timeout=3600)
    return await ctx.step(step_b, a)


@kestrel.workflow(name="replayv.steps_instead")
async def steps_instead(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    return await ctx.step(step_b, a)


def status_of(dsn: str, schema: str, eid: Any) -> str:
    return str(q1(dsn, schema, "SELECT status FROM {s}.executions WHERE id = %s", [eid]))


def park(dsn: str, schema: str, client: SyncClient, workflow: str, n: int) -> Any:
    h = client.submit(workflow, n)
    run_worker_until(dsn, config(schema), lambda: status_of(dsn, schema, h.id) == "waiting")
    return h


def deploy(dsn: str, schema: str, eid: Any, workflow: str) -> None:
    """The execution's code changes: from now on *workflow* replays it."""
    q(dsn, schema, "UPDATE {s}.workflow_executions SET workflow = %s WHERE id = %s",
      [workflow, eid])


def wake(dsn: str, schema: str, eid: Any) -> None:
    """Make a parked execution due now, as a signal or the end of its sleep would."""
    q(dsn, schema, "UPDATE {s}.workflow_executions SET wake_at = {s}.kestrel_now() "
      "WHERE id = %s", [eid])


def error_of(dsn: str, schema: str, eid: Any) -> dict[str, Any]:
    error: dict[str, Any] = q1(dsn, schema, "SELECT error FROM {s}.executions WHERE id = %s",
                               [eid])
    return error


@pytest.mark.parametrize(("parked_at", "now_calls"), [
    ("replayv.waits_for_approve", "replayv.sleeps_instead"),
    ("replayv.waits_for_approve", "replayv.waits_for_other"),
    ("replayv.waits_for_approve", "replayv.steps_instead"),
    ("replayv.sleeps", "replayv.waits_for_other"),
    ("replayv.sleeps", "replayv.steps_instead"),
])
def test_the_call_at_a_parked_waits_position_must_be_that_wait(
    pg_dsn: str, schema: str, parked_at: str, now_calls: str
) -> None:
    """Parked at a wait, woken, replayed by code that calls something else there (another
    kind of wait, a signal of another name, a step): NonDeterminismError, not a run down
    another path nor a park for ever on a wait nothing will end."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = park(pg_dsn, schema, client, parked_at, 1)
    deploy(pg_dsn, schema, h.id, now_calls)
    if parked_at == "replayv.waits_for_approve":
        client.signal(h.id, "approve", "yes")
    else:
        wake(pg_dsn, schema, h.id)
    run_worker_until(pg_dsn, config(schema), lambda: status_of(pg_dsn, schema, h.id) in
                     ("completed", "failed"), timeout=15)
    assert status_of(pg_dsn, schema, h.id) == "failed"
    error = error_of(pg_dsn, schema, h.id)
    assert error["type"] == "kestrel.errors.NonDeterminismError"
    assert "parked there waiting for" in error["message"]
    # Nothing was run or recorded at the wait's position.
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps WHERE execution_id = %s "
              "AND step_id >= 1", [h.id]) == 0


def test_the_same_wait_replays_and_completes(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = park(pg_dsn, schema, client, "replayv.waits_for_approve", 1)
    client.signal(h.id, "approve", "yes")
    run_worker_until(pg_dsn, config(schema), lambda: status_of(pg_dsn, schema, h.id) ==
                     "completed")
    assert h.result(timeout=1) == [2, "yes", 4]


# -- a marker this code does not know: give back, whatever is called next --------------------

@kestrel.workflow(name="replayv.v2_parks_after_patch")
async def v2_parks_after_patch(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    payload = None
    if await ctx.patched("approve-first"):
        payload = (await ctx.wait_for_signal("approve")).payload
    return [a, payload, await ctx.step(step_b, a)]


def test_a_mismatched_wait_under_an_unknown_marker_is_given_back_not_failed(
    pg_dsn: str, schema: str
) -> None:
    """The marker says newer code parked there: the old code gives the execution back
    (CodeTooOld), unfailed, without consuming the signal; the newer code then ends it."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = park(pg_dsn, schema, client, "replayv.v2_parks_after_patch", 1)
    deploy(pg_dsn, schema, h.id, "replayv.waits_for_other")
    client.signal(h.id, "approve", "yes")
    old = config(schema, app_version="old")
    run_worker_until(pg_dsn, old, lambda: q1(pg_dsn, schema, "SELECT give_backs FROM "
                                                "{s}.workflow_executions WHERE id = %s",
                                                [h.id]) == 1)
    assert q(pg_dsn, schema, "SELECT status, given_back_by, attempts FROM "
             "{s}.workflow_executions WHERE id = %s", [h.id]) == [("waiting", ["old"], 0)]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.signals WHERE execution_id = %s AND "
              "consumed_at IS NULL", [h.id]) == 1
    deploy(pg_dsn, schema, h.id, "replayv.v2_parks_after_patch")
    run_worker_until(pg_dsn, config(schema, app_version="new"),
                     lambda: status_of(pg_dsn, schema, h.id) == "completed")
    assert h.result(timeout=1) == [2, "yes", 4]


@kestrel.workflow(name="replayv.knows_other_patch")
async def knows_other_patch(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    other = await ctx.step(step_other, a) if await ctx.patched("other-change") else None
    return [other, await ctx.step(step_b, a)]


def test_no_marker_is_written_beside_one_this_code_does_not_know(pg_dsn: str, schema: str
                                                                  ) -> None:
    """Newer code recorded its marker at position 1 and died before its step. Code that
    knows another patch there gives the execution back before writing its own marker: one
    the newer code would not know either, so that no version could go on."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit("replayv.knows_other_patch", 1)
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES "
      "(%s, -1, 'kestrel.patch:newer-change', jsonb_build_object('at', 1), 1, 1, now()), "
      "(%s, 0, 'replayv.a', '2', 1, 1, now())", [h.id, h.id])
    run_worker_until(pg_dsn, config(schema, app_version="old"), lambda: status_of(
        pg_dsn, schema, h.id) in ("completed", "failed", "waiting"), timeout=15)
    assert status_of(pg_dsn, schema, h.id) == "waiting"  # given back
    assert [r[0] for r in q(pg_dsn, schema, "SELECT step_name FROM {s}.workflow_steps WHERE "
                            "execution_id = %s ORDER BY step_id", [h.id])] \
        == ["kestrel.patch:newer-change", "replayv.a"]


# -- retired patches ---------------------------------------------------------------------------

@kestrel.workflow(name="replayv.retire_v2")
async def retire_v2(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    new = await ctx.step(step_new, a) if await ctx.patched("retire-me") else None
    await ctx.wait_for_signal("go")
    return [new, await ctx.step(step_b, a)]


@kestrel.workflow(name="replayv.retire_v3", retired_patches=["retire-me"])
async def retire_v3(ctx: kestrel.Context, n: int) -> Any:
    """The patch's last phase: only the new path left, the patch call removed, declared."""
    a = await ctx.step(step_a, n)
    new = await ctx.step(step_new, a)
    await ctx.wait_for_signal("go")
    return [new, await ctx.step(step_b, a)]


@kestrel.workflow(name="replayv.retire_v3_undeclared")
async def retire_v3_undeclared(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    new = await ctx.step(step_new, a)
    await ctx.wait_for_signal("go")
    return [new, await ctx.step(step_b, a)]


@kestrel.workflow(name="replayv.retire_v3_diverged", retired_patches=["retire-me"])
async def retire_v3_diverged(ctx: kestrel.Context, n: int) -> Any:
    """A real change under a running execution, on code that retired the patch."""
    a = await ctx.step(step_a, n)
    other = await ctx.step(step_other, a)
    await ctx.wait_for_signal("go")
    return [other, await ctx.step(step_b, a)]


def test_a_retired_patch_is_this_codes_own_and_real_nondeterminism_fails(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    kept = park(pg_dsn, schema, client, "replayv.retire_v2", 1)
    diverged = park(pg_dsn, schema, client, "replayv.retire_v2", 2)
    undeclared = park(pg_dsn, schema, client, "replayv.retire_v2", 3)
    deploy(pg_dsn, schema, kept.id, "replayv.retire_v3")
    deploy(pg_dsn, schema, diverged.id, "replayv.retire_v3_diverged")
    deploy(pg_dsn, schema, undeclared.id, "replayv.retire_v3_undeclared")
    for h in (kept, diverged, undeclared):
        client.signal(h.id, "go")
    run_worker_until(pg_dsn, config(schema), lambda: (
        status_of(pg_dsn, schema, kept.id) == "completed"
        and status_of(pg_dsn, schema, diverged.id) == "failed"
        and q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions WHERE id = %s "
               "AND give_backs = 1", [undeclared.id]) == 1), timeout=15)
    # Retired: the marker is the code's own, the history replays, the execution completes.
    assert kept.result(timeout=1) == [200, 4]
    # Retired, and the code really changed: NonDeterminismError, not a give-back loop.
    error = error_of(pg_dsn, schema, diverged.id)
    assert error["type"] == "kestrel.errors.NonDeterminismError"
    assert "'replayv.new'" in error["message"]
    # Not declared: the marker could be newer code's; the newest code gives it back.
    assert status_of(pg_dsn, schema, undeclared.id) == "waiting"


@pytest.mark.parametrize(("retired", "error"), [
    ("retire-me", TypeError),
    (["ok", "bad\x00id"], SerializationError),
    ([""], SerializationError),
    ([7], SerializationError),
])
def test_a_bad_retired_patches_declaration_is_refused_at_decoration(
    retired: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        kestrel.workflow(name="replayv.never", retired_patches=retired)
    assert "replayv.never" not in registry()


# -- the give-back statement -------------------------------------------------------------------

@pytest.mark.parametrize("limited", [False, True], ids=["claim_batch", "claim_limited"])
def test_a_give_back_backs_off_counts_learns_its_outcome_and_binds_its_version(
    pg_dsn: str, schema: str, limited: bool
) -> None:
    """give_back parks the row for min(cap, base * 2^n), counts and names the version; a
    retry after a lost reply gets the same answer; a stale epoch gets none; the version that
    gave it back never claims it again, another does (both claim statements)."""
    queue = "lim" if limited else "default"
    if limited:
        q(pg_dsn, schema, "INSERT INTO {s}.queue_limits (queue, concurrency) VALUES ('lim', 5)")
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit("replayv.steps_instead", 1, queue=queue)
    qs = queries(schema)

    async def claim(conn: Any, version: str) -> list[Claimed]:
        if limited:
            got = await db.run_script(
                conn,
                statements.queues.claim_limited(
                    qs, queue=queue, owner="w", limit=5, lease_s=30, app_version=version
                ),
            )
            assert got is not None
            return got
        return await db.run(
            conn,
            statements.executions.claim_batch(
                qs, owner="w", queues=[queue], limit=5, lease_s=30, app_version=version
            ),
        )

    async def give(conn: Any, c: Claimed, version: str, epoch: int | None = None) -> Any:
        return await db.run(
            conn,
            statements.executions.give_back(
                qs,
                id=c.id,
                epoch=c.epoch if epoch is None else epoch,
                app_version=version,
                base_s=1.0,
                cap_s=60.0,
            ),
        )

    def due_now() -> None:
        q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET wake_at = {s}.kestrel_now() "
          "WHERE id = %s", [h.id])

    def row() -> tuple[Any, ...]:
        [r] = q(pg_dsn, schema, "SELECT status, attempts, give_backs, given_back_by, "
                "extract(epoch FROM wake_at - given_back_at) FROM {s}.workflow_executions "
                "WHERE id = %s", [h.id])
        return (r[0], r[1], r[2], r[3], float(r[4]) if r[4] is not None else None)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                     prepare_threshold=None) as conn:
            [c] = await claim(conn, "old")
            assert c.waiting_for is None
            first = await give(conn, c, "old")
            assert first is not None and first[0] == 1
            assert await give(conn, c, "old") == first  # the retry of a lost reply
            assert await give(conn, c, "old", epoch=c.epoch - 1) is None  # not ours
            assert row() == ("waiting", 0, 1, ["old"], 1.0)
            due_now()
            assert await claim(conn, "old") == []  # never again by the version that gave it
            [c2] = await claim(conn, "new")
            assert (c2.id, c2.epoch) == (h.id, c.epoch + 1)
            assert q1(pg_dsn, schema, "SELECT given_back_at FROM {s}.workflow_executions "
                      "WHERE id = %s", [h.id]) is None  # claimed since
            second = await give(conn, c2, "new")
            assert second is not None and second[0] == 2
            assert row() == ("waiting", 0, 2, ["old", "new"], 2.0)  # the backoff doubles
            due_now()
            assert await claim(conn, "old") == []
            assert await claim(conn, "new") == []
            assert [x.id for x in await claim(conn, "newest")] == [h.id]

    asyncio.run(main())


def test_a_cancel_requested_before_the_give_back_is_not_parked_for_another_version(
    pg_dsn: str, schema: str
) -> None:
    """Found by the operator machine's soak profile: a cancel of a running execution whose
    old worker then gave it back left it waiting, cancel requested, for a newer version.
    give_back now refuses and says so, and the worker finishes it as cancelled at once (the
    runner's side runs in the operator machine, tests/property/test_operator_machine.py)."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit("replayv.steps_instead", 1)
    qs = queries(schema)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                     prepare_threshold=None) as conn:
            [c] = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=5, lease_s=30, app_version="old"
                ),
            )
            assert client.cancel(h.id) == "cancelling"
            for _ in range(2):  # and sent again after a lost reply: the same answer
                assert (
                    await db.run(
                        conn,
                        statements.executions.give_back(
                            qs, id=c.id, epoch=c.epoch, app_version="old", base_s=1.0, cap_s=60.0
                        ),
                    )
                    == "cancelled"
                )
            assert q(pg_dsn, schema, "SELECT status, give_backs FROM {s}.workflow_executions "
                     "WHERE id = %s", [h.id]) == [("running", 0)]

    asyncio.run(main())


@kestrel.workflow(name="replayv.v2_patch_after_wait")
async def v2_patch_after_wait(ctx: kestrel.Context, n: int) -> Any:
    a = await ctx.step(step_a, n)
    got = await ctx.wait_for_signal("approve")
    new = await ctx.step(step_new, a) if await ctx.patched("after-approve") else None
    return [a, got.payload, new, await ctx.step(step_b, a)]


def test_a_give_back_past_a_recorded_wait_is_not_parked_at_that_wait(
    pg_dsn: str, schema: str
) -> None:
    """Found by the operator machine's soak profile: newer code took the signal of the wait
    it was parked at, wrote its marker after it and crashed; the sweeper put the row back and
    an old worker gave it back. The row stayed 'waiting' at the wait whose position was
    recorded (show said it waited for 'approve', which it had). A give-back now clears a
    passed wait and keeps one not yet reached."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = park(pg_dsn, schema, client, "replayv.v2_patch_after_wait", 1)
    assert q(pg_dsn, schema, "SELECT wait_step, waiting_for FROM {s}.workflow_executions "
             "WHERE id = %s", [h.id]) == [(1, "approve")]
    # What the newer worker left when it crashed after the marker, and the sweeper after it.
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES "
      "(%s, 1, 'kestrel.signal:approve', '{{\"received\": true, \"payload\": \"yes\"}}', 1, "
      "1, now()), (%s, -1, 'kestrel.patch:after-approve', jsonb_build_object('at', 2), 1, 1,"
      " now())", [h.id, h.id])
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'queued' WHERE id = %s",
      [h.id])
    deploy(pg_dsn, schema, h.id, "replayv.waits_for_approve")  # old code: no patch there
    run_worker_until(pg_dsn, config(schema, app_version="old"), lambda: q1(
        pg_dsn, schema, "SELECT give_backs FROM {s}.workflow_executions WHERE id = %s",
        [h.id]) == 1)
    assert q(pg_dsn, schema, "SELECT status, wait_step, waiting_for, wait_deadline FROM "
             "{s}.workflow_executions WHERE id = %s", [h.id]) == [("waiting", None, None, None)]
    assert client.get(h.id).waiting_for is None  # what `show` prints
    deploy(pg_dsn, schema, h.id, "replayv.v2_patch_after_wait")
    run_worker_until(pg_dsn, config(schema, app_version="new"),
                     lambda: status_of(pg_dsn, schema, h.id) == "completed")
    assert h.result(timeout=1) == [2, "yes", 200, 4]


def test_a_give_back_before_the_wait_keeps_the_wait(pg_dsn: str, schema: str) -> None:
    """The other side: given back before replay reached the parked wait (the marker is
    before it), the row keeps its wait, so the signal sent for it still wakes it."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = park(pg_dsn, schema, client, "replayv.v2_parks_after_patch", 1)
    wait = q(pg_dsn, schema, "SELECT wait_step, waiting_for, wait_deadline FROM "
             "{s}.workflow_executions WHERE id = %s", [h.id])
    assert wait[0][:2] == (1, "approve")
    deploy(pg_dsn, schema, h.id, "replayv.waits_for_other")
    wake(pg_dsn, schema, h.id)
    run_worker_until(pg_dsn, config(schema, app_version="old"), lambda: q1(
        pg_dsn, schema, "SELECT give_backs FROM {s}.workflow_executions WHERE id = %s",
        [h.id]) == 1)
    assert q(pg_dsn, schema, "SELECT wait_step, waiting_for, wait_deadline FROM "
             "{s}.workflow_executions WHERE id = %s", [h.id]) == wait
