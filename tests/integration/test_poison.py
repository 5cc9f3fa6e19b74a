"""Poison data: one bad input harms nobody else (FAULTS P), against real PostgreSQL.

Each test here is the regression test of one fix: it fails on the code before the fix and
passes after it. Workflows are defined here under unique ``rx_`` names; the cross-process
test runs this module as the runtime's app.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

import kestrel
from kestrel import codec, connections, db, statements
from kestrel.client import SyncClient
from kestrel.sql import queries
from kestrel.types import StepWrite
from tests.helpers import config, finished_count, q, q1, run_worker_until, runtime, wait_until

APP = "tests.integration.test_poison"


def _steps(dsn: str, schema: str, eid: object) -> list[tuple[Any, ...]]:
    """(step_id, step_name, error) of every checkpoint of *eid*, live or finished."""
    return q(dsn, schema, "SELECT step_id, step_name, error FROM {s}.operation_outputs "
             "WHERE execution_id = %s ORDER BY step_id", [eid])


def _outcomes(dsn: str, schema: str, workflow: str) -> dict[str, int]:
    return dict(q(dsn, schema, "SELECT status, count(*) FROM {s}.workflow_history "
                  "WHERE workflow = %s GROUP BY status", [workflow]))


@kestrel.step(name="rx_add")
async def _add(n: int, k: int) -> int:
    return n * 10 + k


@kestrel.workflow(name="rx_good")
async def _good(ctx: kestrel.Context, n: int) -> int:
    total = 0
    for k in range(3):
        total += await ctx.step(_add, n, k)
    return total


def _good_result(n: int) -> int:
    return 30 * n + 3


# -- P1: a name PostgreSQL cannot store, inside a workflow, among 40 good executions -----------

_BAD_DOORS = {
    "send_signal": "signal name contains a NUL character",
    "wait_for_signal": "signal name contains a lone surrogate",
    "set_event": "event key contains a lone surrogate",
    "start_child": "child workflow name contains a NUL character",
}


@kestrel.workflow(name="rx_p1_bad")
async def _p1_bad(ctx: kestrel.Context, door: str) -> str:
    await ctx.step(_add, 1, 0)
    if door == "send_signal":
        await ctx.signal(ctx.execution_id, "go\x00now")
    elif door == "wait_for_signal":
        await ctx.wait_for_signal("go\ud800")
    elif door == "set_event":
        await ctx.set_event("stage\udfff", "x")
    else:
        await ctx.start_child("child\x00name")
    return "unreachable"


@pytest.mark.parametrize("door", sorted(_BAD_DOORS))
def test_a_name_postgres_cannot_store_fails_only_its_own_execution(
    pg_dsn: str, schema: str, door: str
) -> None:
    """P1: a NUL or a lone surrogate in a signal name, event key or child name, inside a
    workflow, while 40 good executions share the group commits. Only the bad execution
    fails, with a SerializationError naming the problem; every good one completes; the
    worker keeps running. Before the fix the bad name reached the checkpoint writer as a
    step name, the whole batch failed with it, and the writer (and the worker) died."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    good = [client.submit(_good, n) for n in range(40)]
    bad = client.submit(_p1_bad, door)
    worker = run_worker_until(pg_dsn, config(schema, concurrency=64, batch_size=64),
                              lambda: finished_count(pg_dsn, schema) == 41)
    ex = client.get(bad.id)
    assert ex.status is kestrel.Status.FAILED and ex.error is not None
    assert ex.error["type"] == "kestrel.errors.SerializationError", ex.error
    assert _BAD_DOORS[door] in ex.error["message"]
    assert [s[1] for s in _steps(pg_dsn, schema, bad.id)] == ["rx_add"]
    assert _outcomes(pg_dsn, schema, "rx_good") == {"completed": 40}
    assert [h.result(timeout=1) for h in good] == [_good_result(n) for n in range(40)]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0
    assert worker.stats.completed == 40 and worker.stats.failed == 1


# -- P2: arguments valid as jsonb that the runtime cannot decode ------------------------------


def test_undecodable_arguments_fail_their_execution_at_claim_only(
    pg_dsn: str, schema: str
) -> None:
    """P2: '[1e400]' is valid jsonb but no double. Stored anyway (here by an UPDATE, as if
    submitted before SQL submit refused such numbers), that execution fails at claim with
    UndecodableInput and its batch-mates run normally. Before the fix decoding the claimed
    batch raised after the claim had committed: the worker died with the batch stranded
    'running'."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    bad = client.submit(_good, 0)
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET args = '[1e400]'::jsonb "
      "WHERE id = %s", [bad.id])
    good = [client.submit(_good, n) for n in range(1, 11)]
    worker = run_worker_until(pg_dsn, config(schema),
                              lambda: finished_count(pg_dsn, schema) == 11)
    # Read with SQL: the client decodes arguments too.
    status, error = q(pg_dsn, schema, "SELECT status, error FROM {s}.workflow_history "
                      "WHERE id = %s", [bad.id])[0]
    assert status == "failed" and error["type"] == "kestrel.errors.UndecodableInput", error
    assert str(bad.id) in error["message"]
    assert _steps(pg_dsn, schema, bad.id) == []
    assert [h.result(timeout=1) for h in good] == [_good_result(n) for n in range(1, 11)]
    assert worker.stats.completed == 10 and worker.stats.failed == 1


@kestrel.workflow(name="rx_p2_echo")
async def _p2_echo(ctx: kestrel.Context, n: Any) -> Any:
    return n


def test_integers_beyond_64_bits_are_never_silently_rounded(pg_dsn: str, schema: str) -> None:
    """P2, "no precision silently lost": 2**64 + 1 stored as an argument must fail its
    execution at claim (as 1e400 does), not run as 18446744073709552000."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_p2_echo, 0)
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET args = '[18446744073709551617]'::jsonb "
      "WHERE id = %s", [h.id])
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    status, result, error = q(pg_dsn, schema, "SELECT status, result, error FROM "
                              "{s}.workflow_history WHERE id = %s", [h.id])[0]
    assert (status, result) != ("completed", 18446744073709552000)
    assert status == "failed" and error["type"] == "kestrel.errors.UndecodableInput"


# -- P3: a history over the bound fails its own claim, not everyone's ------------------------


@kestrel.step(name="rx_p3_big")
async def _p3_big(k: int) -> str:
    return str(k) * 100_000


@kestrel.workflow(name="rx_p3_big_history")
async def _p3_big_history(ctx: kestrel.Context) -> int:
    return sum([len(await ctx.step(_p3_big, k)) for k in range(3)])


def test_a_history_over_the_bound_fails_at_claim_and_the_queue_moves(
    pg_dsn: str, schema: str
) -> None:
    """P3: an execution whose recorded checkpoints (3 x 100 KB) exceed max_history_bytes
    (250 KB) fails with HistoryTooLarge when it is claimed, while the executions claimed
    beside it complete. Before the fix nothing bounded the history a claim loaded: this one
    was simply replayed (and one over jsonb's 256 MB limit failed the claim statement, for
    the whole batch, on every poll)."""
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    big = client.submit(_p3_big_history)

    async def record_history() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as conn:
            connections.configure_connection(conn)
            (c,) = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="earlier", queues=["default"], limit=1, lease_s=30
                ),
            )
            await db.run(conn, statements.steps.save_steps(qs, [
                StepWrite(c.id, c.epoch, k, "rx_p3_big", orjson.dumps(str(k) * 100_000).decode(),
                          None, 1, 0.0) for k in range(3)]))
            assert await db.run(
                conn, statements.executions.release_batch(qs, held=[(c.id, c.epoch)])
            ) == {c.id}

    asyncio.run(record_history())
    good = [client.submit(_good, n) for n in range(10)]
    cfg = config(schema, max_payload_bytes=150_000, max_history_bytes=250_000)
    run_worker_until(pg_dsn, cfg, lambda: finished_count(pg_dsn, schema) == 11)
    ex = client.get(big.id)
    assert ex.status is kestrel.Status.FAILED and ex.error is not None, (
        f"{ex.status.value}: {ex.result if ex.result is None else 'result ' + str(ex.result)}")
    assert ex.error["type"] == "kestrel.errors.HistoryTooLarge", ex.error
    assert "max-history-bytes" in ex.error["message"]
    assert [h.result(timeout=1) for h in good] == [_good_result(n) for n in range(10)]


# -- P6: the runtime's decision is sticky ---------------------------------------------------

_P6_BODIES: dict[str, list[str]] = {}
_P6_SEEN: dict[str, list[str]] = {}


def _p6_body(name: str) -> Any:
    async def body(tag: str, dsn: str, schema: str, act: str) -> str:
        _P6_BODIES.setdefault(tag, []).append(name)
        if name == "first" and act == "cancel":
            # A client cancels while the step runs: its checkpoint is refused.
            q(dsn, schema, "SELECT {s}.cancel(%s)", [kestrel.current_step().execution_id])
        elif name == "first" and act == "lose":
            # Another worker claims the execution while the step runs (a newer epoch).
            q(dsn, schema, "UPDATE {s}.workflow_executions SET lease_epoch = lease_epoch + 1, "
              "lease_owner = 'someone-else' WHERE id = %s",
              [kestrel.current_step().execution_id])
        return name

    return kestrel.step(name=f"rx_p6_{name}")(body)


_p6_first, _p6_second, _p6_third = (_p6_body(n) for n in ("first", "second", "third"))


@kestrel.workflow(name="rx_p6_catches_everything")
async def _p6_catches_everything(ctx: kestrel.Context, tag: str, dsn: str, schema: str,
                                 act: str) -> list[str]:
    seen = []
    for fn in (_p6_first, _p6_second, _p6_third):
        try:
            await ctx.step(fn, tag, dsn, schema, act)
            seen.append("ran")
        except Exception as exc:  # what the fault suite forbids to matter
            seen.append(type(exc).__name__)
    try:
        await ctx.set_event("after", 1)
        seen.append("set_event")
    except Exception as exc:
        seen.append(type(exc).__name__)
    _P6_SEEN[tag] = seen
    return seen


def _run_p6(pg_dsn: str, schema: str, act: str) -> tuple[str, Any, Any]:
    tag = uuid.uuid4().hex
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_p6_catches_everything, tag, pg_dsn, schema, act)
    if act == "replay":
        # Recorded by an earlier version of the workflow: a different step at position 0.
        qs = queries(schema)

        async def record() -> None:
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                             prepare_threshold=None) as conn:
                connections.configure_connection(conn)
                (c,) = await db.run(
                    conn,
                    statements.executions.claim_batch(
                        qs, owner="v1", queues=["default"], limit=1, lease_s=30
                    ),
                )
                await db.run(
                    conn,
                    statements.steps.save_steps(
                        qs, [StepWrite(c.id, c.epoch, 0, "rx_p6_old_name", '"old"', None, 1, 0.0)]
                    ),
                )
                assert await db.run(
                    conn, statements.executions.release_batch(qs, held=[(c.id, c.epoch)])
                ) == {c.id}

        asyncio.run(record())
    # Rare heartbeats: the worker learns of the cancel or the lost lease from the refused
    # checkpoint, not from a heartbeat.
    cfg = config(schema, lease=30, heartbeat=10)
    worker = run_worker_until(pg_dsn, cfg, lambda: tag in _P6_SEEN and (
        act == "lose" or finished_count(pg_dsn, schema) == 1))
    return tag, h, worker.stats


@pytest.mark.parametrize("act,decision", [("replay", "NonDeterminismError"),
                                          ("cancel", "Cancelled"), ("lose", "LeaseLost")])
def test_a_decision_is_sticky_when_workflow_code_catches_it(
    pg_dsn: str, schema: str, act: str, decision: str
) -> None:
    """P6: workflow code catches Exception around ctx.step after the runtime decided
    (non-determinism at a recorded position, a cancel, a lost lease). Every later ctx call
    raises the decision again; no further step body runs and no checkpoint is written; the
    execution ends failed / cancelled / dropped. Before the fix the next ctx.step ran its
    body (and for non-determinism, checkpointed it) as if nothing had happened."""
    tag, h, stats = _run_p6(pg_dsn, schema, act)
    if act == "replay":
        assert _P6_SEEN[tag] == [decision] * 4
    else:
        # The refusal of the first step's checkpoint is learned when it is sent, at the next
        # call (issue 23, item 3: a step's write waits for the next call): that call and
        # every later one raise the decision.
        assert _P6_SEEN[tag] == ["ran"] + [decision] * 3
    expected_bodies = [] if act == "replay" else ["first"]
    assert _P6_BODIES.get(tag, []) == expected_bodies, "a step body ran after the decision"
    steps = [s[1] for s in _steps(pg_dsn, schema, h.id)]
    assert steps == (["rx_p6_old_name"] if act == "replay" else [])
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.events") == 0
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ex = client.get(h.id)
    if act == "replay":
        assert ex.status is kestrel.Status.FAILED and ex.error is not None
        assert ex.error["type"] == "kestrel.errors.NonDeterminismError"
    elif act == "cancel":
        assert ex.status is kestrel.Status.CANCELLED
    else:  # dropped: the newer claim owns it and finishes it
        assert ex.status is kestrel.Status.RUNNING and ex.lease_epoch == 2
        assert stats.lost == 1 and stats.fenced == 0 and stats.completed == 0


# -- P7: step names from a partial or a callable object --------------------------------------


def _p7_scale(factor: int, n: int) -> int:
    return factor * n


class _P7Doubler:
    def __call__(self, n: int) -> int:
        return 2 * n


@kestrel.workflow(name="rx_p7")
async def _p7(ctx: kestrel.Context, n: int) -> list[int]:
    a = await ctx.step(functools.partial(_p7_scale, 3), n)
    b = await ctx.step(_P7Doubler(), n)
    await ctx.sleep(2)  # the rest runs after a replay, in whichever process claims it
    c = await ctx.step(functools.partial(_p7_scale, 5), n)
    return [a, b, c]


def test_partial_and_callable_object_steps_replay_in_another_process(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """P7: a functools.partial step and a callable-object step are named from code (the
    function's and the class's qualified names), never from repr(): no address, no
    arguments. Recorded in this process, they replay in a runtime process without a
    NonDeterminismError. Before the fix both were named by repr(), which holds an address
    (and a partial's arguments), so every replay elsewhere failed."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_p7, 7)
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(h.id).status is kestrel.Status.WAITING)
    names = [s[1] for s in _steps(pg_dsn, schema, h.id)]
    assert names == ["_p7_scale", "_P7Doubler"]
    with runtime(pg_dsn, schema, procs=1, app=APP, log=tmp_path / "rt.log"):
        wait_until(lambda: finished_count(pg_dsn, schema) == 1, timeout=30,
                   what="the replay in the runtime process")
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.COMPLETED, ex.error
    assert ex.result == [21, 14, 35]
    assert [s[1] for s in _steps(pg_dsn, schema, h.id)] == [
        "_p7_scale", "_P7Doubler", "kestrel.sleep", "_p7_scale"]


# -- bug 19: an exception whose __str__ raises -----------------------------------------------


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


@kestrel.step(name="rx_b19_step")
async def _b19_step() -> None:
    raise _Unprintable()


@kestrel.workflow(name="rx_b19")
async def _b19(ctx: kestrel.Context) -> None:
    await ctx.step(_b19_step)


def test_a_step_error_whose_str_raises_is_recorded_as_a_step_failure(
    pg_dsn: str, schema: str
) -> None:
    """Bug 19: the step's checkpoint records the error type, and the workflow fails with
    StepFailed naming the step and the type. Before the fix describing the error raised
    inside the step's error handling: no step checkpoint, and the workflow failed with the
    RuntimeError from __str__."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_b19)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    steps = _steps(pg_dsn, schema, h.id)
    assert [s[:2] for s in steps] == [(0, "rx_b19_step")]
    assert steps[0][2]["type"].endswith("._Unprintable")
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.FAILED and ex.error is not None
    assert ex.error["type"] == "kestrel.errors.StepFailed", ex.error
    assert "rx_b19_step" in ex.error["message"] and "_Unprintable" in ex.error["message"]


# -- Hostile values through both forms of the write path --------------------------------------
# Every value the codec accepts reaches history unchanged through the statements and through
# their Citus forms (save_steps(), finish_batch(): rows carried as one jsonb array, so a
# value that could break out of its element would show here); every value it refuses fails
# only its own execution, before anything is written.


def _deep(n: int) -> Any:
    value: Any = "bottom"
    for _ in range(n):
        value = [value]
    return value


_STORABLE: dict[str, Any] = {
    "sql": "x'); DROP TABLE workflow_history; --",
    "breakout": '"]], [null, 0, "completed", ["pwned"]]',
    "escaped nul": "\\u0000 is six characters here",
    "backslashes": "\\\\\\",
    "astral": "ü 🚀 \U0010fffd",
    "u64 max": 2**64 - 1,
    "i64 min": -(2**63),
    "tiny float": 5e-324,
    "huge float": 1.7976931348623157e308,
    "deep": _deep(250),
    "wide": {f"k{i}": i for i in range(5_000)},
    "large": "é" * 1_000_000,
    "json null": None,
}

_REFUSED: dict[str, tuple[Any, str]] = {
    "nul": ("a\x00b", "NUL character"),
    "lone surrogate": ("a\ud800b", "not JSON-serializable"),
    "beyond 64 bits": (2**64, "not JSON-serializable"),
    "too deep": (_deep(300), "not JSON-serializable"),
    "nan": (float("nan"), "contains nan"),
}


@kestrel.step(name="rx_hostile_echo")
async def _hostile_echo(kind: str) -> Any:
    return _STORABLE[kind]


@kestrel.workflow(name="rx_hostile")
async def _hostile(ctx: kestrel.Context, kind: str) -> Any:
    if kind in _REFUSED:
        await ctx.step(_add, 1, 0)
        return _REFUSED[kind][0]
    if kind == "raises":
        raise ValueError("bad\x00 \ud800 '); DROP TABLE signals; --")
    return await ctx.step(_hostile_echo, kind)


@pytest.mark.parametrize("citus_form", [False, True], ids=["statements", "citus-forms"])
def test_hostile_values_reach_history_unchanged_or_fail_only_their_own_execution(
        pg_dsn: str, schema: str, citus_form: bool) -> None:
    from kestrel import forms

    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    good = [client.submit(_good, n) for n in range(20)]
    kinds = [*_STORABLE, *_REFUSED, "raises"]
    hostile = {kind: client.submit(_hostile, kind) for kind in kinds}
    with forms.forced(queries(schema)) if citus_form else contextlib.nullcontext():
        worker = run_worker_until(pg_dsn, config(schema, concurrency=64, batch_size=64),
                                  lambda: finished_count(pg_dsn, schema) == 20 + len(kinds))
    for kind, value in _STORABLE.items():
        ex = client.get(hostile[kind].id)
        assert ex.status is kestrel.Status.COMPLETED, (kind, ex.error)
        assert orjson.dumps(ex.result) == orjson.dumps(value), kind
        # As the runtime reads it back on a replay (jsonb writes 1.8e308 as 309 digits).
        (output,) = q(pg_dsn, schema, "SELECT output::text FROM {s}.step_history "
                      "WHERE execution_id = %s", [hostile[kind].id])
        assert orjson.dumps(codec.decode(output[0])) == orjson.dumps(value), kind
    for kind, (_, message) in _REFUSED.items():
        ex = client.get(hostile[kind].id)
        assert ex.status is kestrel.Status.FAILED and ex.error is not None, kind
        assert ex.error["type"] == "kestrel.errors.SerializationError", (kind, ex.error)
        assert message in ex.error["message"], (kind, ex.error["message"])
        assert ex.result is None
        assert [s[1] for s in _steps(pg_dsn, schema, hostile[kind].id)] == ["rx_add"]
    raised = client.get(hostile["raises"].id)
    assert raised.status is kestrel.Status.FAILED and raised.error is not None
    assert raised.error["type"] == "builtins.ValueError"
    assert "DROP TABLE signals" in raised.error["message"]
    assert "\x00" not in raised.error["message"] and "\ud800" not in raised.error["message"]
    assert [h.result(timeout=1) for h in good] == [_good_result(n) for n in range(20)]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0
    assert worker.stats.completed == 20 + len(_STORABLE)
    # Every checkpoint is a finished execution's, each once.
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs") == q1(
        pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps WHERE execution_finished_at "
        "IS NOT NULL") == 3 * 20 + len(_STORABLE) + len(_REFUSED)
