"""``ctx.patched`` / ``ctx.deprecate_patch`` replay semantics against a real PostgreSQL.

Old executions are made the honest way: their history is recorded by an earlier version of
the workflow (a checkpoint row as that code wrote it), then the new code replays it.
"""

from __future__ import annotations

from typing import Any

import pytest

import kestrel
from kestrel.client import SyncClient
from tests.helpers import config, finished_count, q, q1, run_worker_until

calls: dict[str, int] = {}


@kestrel.step(name="patching.a")
async def step_a(n: int) -> int:
    calls["a"] = calls.get("a", 0) + 1
    return n + 1


@kestrel.step(name="patching.new")
async def step_new(n: int) -> int:
    calls["new"] = calls.get("new", 0) + 1
    return n * 100


@kestrel.step(name="patching.b")
async def step_b(n: int) -> int:
    return n + 2


@kestrel.workflow(name="patching.flow")
async def flow(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    """v2 of a flow whose v1 was: a, b. The patch sits between them."""
    a = await ctx.step(step_a, n)
    took = await ctx.patched("add-new")
    again = await ctx.patched("add-new")  # the same id twice: the same answer, one marker
    extra = await ctx.step(step_new, a) if took else None
    return {"took": took, "again": again, "extra": extra, "b": await ctx.step(step_b, a)}


@kestrel.workflow(name="patching.deprecated")
async def deprecated(ctx: kestrel.Context, n: int) -> int:
    """The cleanup phase of patching.flow: only the new path is left."""
    a = await ctx.step(step_a, n)
    await ctx.deprecate_patch("add-new")
    await ctx.step(step_new, a)
    return await ctx.step(step_b, a)


@kestrel.workflow(name="patching.hostile")
async def hostile(ctx: kestrel.Context, patch_id: str, surrogate: bool) -> bool:
    return await ctx.patched(patch_id + ("\ud800" if surrogate else ""))


def run_all(dsn: str, schema: str, n: int) -> None:
    run_worker_until(dsn, config(schema), lambda: finished_count(dsn, schema) == n)


def steps(dsn: str, schema: str, eid: Any) -> list[tuple[int, str]]:
    return [(r[0], r[1]) for r in q(dsn, schema, "SELECT step_id, step_name FROM "
                                    "{s}.workflow_steps WHERE execution_id = %s ORDER BY "
                                    "step_id", [eid])]


def record_as_v1(dsn: str, schema: str, eid: Any, upto: int) -> None:
    """Checkpoints v1 (a, b) wrote: step 0 (a), and step 1 (b) when *upto* is 1."""
    q(dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) SELECT %s, i, (ARRAY['patching.a', "
      "'patching.b'])[i + 1], to_jsonb(11 + i), 1, 1, now() FROM generate_series(0, %s) AS i",
      [eid, upto])


def test_a_new_execution_takes_the_new_path_and_records_one_marker_outside_the_steps(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(flow, 10)
    run_all(pg_dsn, schema, 1)
    assert h.result(timeout=1) == {"took": True, "again": True, "extra": 1100, "b": 13}
    # The marker is at a negative id: the steps keep the numbers they have without the patch.
    assert steps(pg_dsn, schema, h.id) == [(-1, "kestrel.patch:add-new"), (0, "patching.a"),
                                           (1, "patching.new"), (2, "patching.b")]
    assert q1(pg_dsn, schema, "SELECT at_step FROM {s}.patch_markers WHERE execution_id = %s",
              [h.id]) == 1


def test_an_execution_that_passed_the_point_before_the_change_replays_the_old_path(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    passed = client.submit(flow, 10)
    record_as_v1(pg_dsn, schema, passed.id, upto=1)  # v1 ran a and b, then lost its worker
    before = client.submit(flow, 20)
    record_as_v1(pg_dsn, schema, before.id, upto=0)  # v1 ran a only: not yet at the patch
    calls.clear()
    run_all(pg_dsn, schema, 2)
    assert passed.result(timeout=1) == {"took": False, "again": False, "extra": None, "b": 12}
    assert steps(pg_dsn, schema, passed.id) == [(0, "patching.a"), (1, "patching.b")]
    # Not yet at the patch when the new code came: it takes the new path, recorded.
    assert before.result(timeout=1) == {"took": True, "again": True, "extra": 1100, "b": 13}
    assert steps(pg_dsn, schema, before.id)[0] == (-1, "kestrel.patch:add-new")
    assert calls == {"new": 1}  # step a was replayed from its checkpoints, never rerun


def test_a_replay_after_a_new_path_run_answers_true_again(pg_dsn: str, schema: str) -> None:
    """A crash after the marker and the new step: the replay sees the marker, takes the new
    path again and reads the new step's checkpoint instead of misnumbering it."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(flow, 10)
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES "
      "(%s, -1, 'kestrel.patch:add-new', jsonb_build_object('at', 1), 1, 1, now()), "
      "(%s, 0, 'patching.a', '11', 1, 1, now()), (%s, 1, 'patching.new', '4242', 1, 1, now())",
      [h.id, h.id, h.id])
    calls.clear()
    run_all(pg_dsn, schema, 1)
    assert h.result(timeout=1) == {"took": True, "again": True, "extra": 4242, "b": 13}
    assert calls == {}
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps WHERE execution_id = %s "
              "AND step_id < 0", [h.id]) == 1


def test_deprecate_patch_keeps_new_executions_and_refuses_ones_that_need_the_old_path(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    fresh = client.submit(deprecated, 1)
    old = client.submit(deprecated, 2)
    record_as_v1(pg_dsn, schema, old.id, upto=1)
    run_all(pg_dsn, schema, 2)
    assert fresh.result(timeout=1) == 4
    assert steps(pg_dsn, schema, fresh.id)[0] == (-1, "kestrel.patch:add-new")
    with pytest.raises(kestrel.WorkflowFailed, match="needs the old code path"):
        old.result(timeout=1)
    error = q1(pg_dsn, schema, "SELECT error FROM {s}.executions WHERE id = %s", [old.id])
    assert error["type"].endswith("NonDeterminismError")


@pytest.mark.parametrize(("patch_id", "surrogate", "why"), [
    ("bad\x00id", False, "NUL"),
    ("x", True, "lone surrogate"),
    ("p" * 1025, False, "over the limit of 1024"),
    ("€" * 700, False, "bytes as UTF-8"),
    ("", False, "must not be empty"),
])
def test_a_hostile_patch_id_fails_its_execution_with_a_typed_error_and_writes_no_marker(
    pg_dsn: str, schema: str, patch_id: str, surrogate: bool, why: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    good = client.submit(flow, 1)
    if "\x00" in patch_id:
        # NUL cannot even travel as a JSON argument through PostgreSQL: build it in code.
        bad = client.submit(hostile, "bad", False)
        q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET workflow = 'patching.nul' "
          "WHERE id = %s", [bad.id])
    else:
        bad = client.submit(hostile, patch_id, surrogate)
    run_all(pg_dsn, schema, 2)
    assert good.result(timeout=1)["took"] is True  # its neighbour is unharmed
    with pytest.raises(kestrel.WorkflowFailed) as info:
        bad.result(timeout=1)
    assert why in str(info.value)
    error = q1(pg_dsn, schema, "SELECT error FROM {s}.executions WHERE id = %s", [bad.id])
    assert error["type"].endswith("SerializationError")
    assert steps(pg_dsn, schema, bad.id) == []  # nothing was written


@kestrel.workflow(name="patching.nul")
async def nul(ctx: kestrel.Context, *_: Any) -> bool:
    return await ctx.patched("bad\x00id")


def test_sql_looking_and_unicode_patch_ids_are_stored_verbatim(pg_dsn: str, schema: str
                                                               ) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ids = ["x'); DROP TABLE operation_outputs; --", "ünïcødé ✓ 补丁", "%(patch)s", "a" * 1024]
    handles = [client.submit(hostile, i, False) for i in ids]
    run_all(pg_dsn, schema, len(ids))
    for i, h in zip(ids, handles, strict=True):
        assert h.result(timeout=1) is True
        assert q1(pg_dsn, schema, "SELECT patch FROM {s}.patch_markers WHERE execution_id = %s",
                  [h.id]) == i
    [use] = SyncClient(pg_dsn, schema=schema, pool_size=0).patches(ids[0])
    assert (use.workflow, use.total_with) == ("patching.hostile", 1)


@kestrel.workflow(name="patching.two")
async def two_patches(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    """Two patches taken in one attempt, then a park: the replay after the signal must see
    both markers as this code's own and read every checkpoint back."""
    a = await ctx.step(step_a, n)
    first = await ctx.step(step_new, a) if await ctx.patched("first") else None
    b = await ctx.step(step_b, a)
    second = await ctx.step(step_new, b) if await ctx.patched("second") else None
    go = await ctx.wait_for_signal("go", timeout=3600)
    return {"first": first, "second": second, "go": go.payload, "last": await ctx.step(step_b, b)}


def test_two_patches_taken_in_one_attempt_replay_without_a_false_divergence(
    pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(two_patches, 1)
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(h.id).status.value == "waiting")
    calls.clear()
    client.signal(h.id, "go", "yes")
    run_all(pg_dsn, schema, 1)
    assert client.get(h.id).status.value == "completed"
    assert h.result(timeout=1) == {"first": 200, "second": 400, "go": "yes", "last": 6}
    assert steps(pg_dsn, schema, h.id) == [
        (-2, "kestrel.patch:second"), (-1, "kestrel.patch:first"), (0, "patching.a"),
        (1, "patching.new"), (2, "patching.b"), (3, "patching.new"), (4, "kestrel.signal:go"),
        (5, "patching.b")]
    assert calls == {}  # the replay read every step back; nothing ran twice
