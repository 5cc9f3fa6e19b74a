"""A workflow's last checkpoint and its end are one write (issue 23, item 3).

A step's checkpoint is held back (the tail) while the workflow's own code runs on with the
value the write will store (codec.stored): the next call sends it first and waits for it,
or, when the workflow ends right after the step, the completion writes it in its own
statement. These tests hold each part of that: codec.stored against a real jsonb, the
value a live run sees against the one a replay of its history sees, the tail committed in
the completion's transaction, and a tail whose position an older claim recorded leaving the
execution unfinished for the next claim, in both forms of the statement (complete_batch and
finish_batch(), docs/citus.md)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from typing import Any

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kestrel
from kestrel import codec, forms, statements
from kestrel.client import SyncClient
from kestrel.errors import KestrelError
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, q, q1, run_worker_until
from tests.integration.test_finish_forms import claim_all, run


@pytest.fixture(params=[False, True], ids=["statement", "citus-form"])
def form(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def work_in_form(pg_dsn: str, schema: str, form: bool, n: int) -> None:
    """Run a worker until *n* executions finished, sending the Citus forms of the write
    path if *form* (here on plain PostgreSQL, where the same functions run)."""
    with forms.forced(queries(schema)) if form else contextlib.nullcontext():
        run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == n)


# -- codec.stored is what jsonb gives back ----------------------------------------------------

_keys = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=6)
_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.sampled_from([1e16, 1e20, -1.2345678901234568e20, 1e300, 5e-324, 1.5e-7,
                               18446744073709551615.0, 9.223372036854776e18, 1e15, 123.0])
            | _keys)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(_keys, inner, max_size=5), max_leaves=25)


def _exactly(value: Any) -> bytes:
    """A value's JSON with its key order and its int/float kinds (1 is not 1.0 here)."""
    return orjson.dumps(value)


def test_stored_is_what_jsonb_gives_back(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:

        def through_jsonb(text: str) -> Any:
            row = conn.execute("SELECT %s::jsonb::text", [text]).fetchone()
            assert row is not None
            return codec.decode(row[0])

        fixed = [{"bb": 1, "a": 2, "ccc": {"é": 1, "z": 2, "éé": 3, "zzz": 4}},
                 {"ab": 1, "b": 2, "aa": 3}, [1e16, 1e20, {"x": 1e+17}], "{not an object}",
                 {"k": "1e+16"}, 2**64 - 1, -(2**63), 1e16, 1.0, 0.0, [], {}]
        for value in fixed:
            text = codec.encode(value, what="v")
            assert _exactly(codec.stored(text)) == _exactly(through_jsonb(text)), value

        @settings(max_examples=400, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(_values)
        def holds(value: Any) -> None:
            try:
                text = codec.encode(value, what="v")
            except KestrelError:
                return  # what the codec refuses never reaches a checkpoint
            assert _exactly(codec.stored(text)) == _exactly(through_jsonb(text))

        holds()


# -- a live run sees what a replay sees -----------------------------------------------------

SHAPES = {"bb": [1e16, 1e20, 2.5], "a": {"zz": 1, "y": 2.0}, "é": None, "ccc": "x"}


@kestrel.step(name="tail.shape")
async def shape() -> Any:
    return SHAPES


def _describe(value: Any) -> Any:
    """What workflow code can tell of a value: its key order and its number kinds."""
    if isinstance(value, dict):
        return [[k, _describe(v)] for k, v in value.items()]
    if isinstance(value, list):
        return [_describe(v) for v in value]
    return [type(value).__name__, value]


@kestrel.workflow(name="tail.describe")
async def describe(ctx: kestrel.Context) -> Any:
    return _describe(await ctx.step(shape))


def test_the_live_run_sees_what_a_replay_of_its_history_sees(pg_dsn: str,
                                                             schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    live = client.submit(describe)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    # The fork replays the step from its checkpoint and runs only the workflow's end.
    replayed = client.fork(live.id, 1)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
    seen = client.get(live.id).result
    assert seen == client.get(replayed.id).result
    # jsonb's order of keys (by length, then bytes) and its numbers: 1e16 reads back as an
    # integer, 1e20 (beyond 64 bits) as a float.
    assert seen == [["a", [["y", ["float", 2.0]], ["zz", ["int", 1]]]],
                    ["bb", [["int", 10**16], ["float", 1e20], ["float", 2.5]]],
                    ["é", ["NoneType", None]], ["ccc", ["str", "x"]]]


# -- the tail is written by the completion ----------------------------------------------------


def test_the_last_checkpoint_is_written_in_the_completions_transaction(
        pg_dsn: str, schema: str, form: bool) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    handles = [client.submit(app.three_steps, i) for i in range(12)]
    work_in_form(pg_dsn, schema, form, 12)
    rows = q(pg_dsn, schema, "SELECT o.execution_id, o.step_id, o.xmin::text = h.xmin::text, "
             "o.lease_epoch = h.lease_epoch FROM {s}.operation_outputs AS o "
             "JOIN {s}.workflow_history AS h ON h.id = o.execution_id ORDER BY 1, 2")
    assert len(rows) == 36
    for i, h in enumerate(handles):
        done = client.get(h.id)
        assert (done.status.value, done.result) == ("completed", app.model(i))
        mine = [(step, same_tx, epoch) for eid, step, same_tx, epoch in rows if eid == h.id]
        # Steps 0 and 1 were sent before the next step, each in a checkpoint batch; step 2's
        # went with the end, in the completion's statement, under the same epoch.
        assert mine == [(0, False, True), (1, False, True), (2, True, True)]


def test_a_completion_batch_writes_tails_once_and_only_for_what_it_finishes(
        pg_dsn: str, schema: str, form: bool) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ids = [client.submit(app.three_steps, i).id for i in range(5)]
    epochs = claim_all(pg_dsn, schema, 5)
    done_tail, no_tail, clashed, fenced, failed = ids

    def tail(eid: uuid.UUID, output: Any, epoch: int | None = None) -> StepWrite:
        return StepWrite(eid, epochs[eid] if epoch is None else epoch, 0, "add",
                         codec.encode(output, what="o"), None, 1, 0.25)

    # An older claim's write of `clashed`'s tail position, committed before the completion.
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at, finished_at) "
      "VALUES (%s, 0, 'add', '\"older\"', 1, %s, now(), now())",
      [clashed, epochs[clashed] - 1])
    finishes = [
        Finish(done_tail, epochs[done_tail], Status.COMPLETED, '"r"', None,
               tail(done_tail, {"b": 1, "a": 1e16})),
        Finish(no_tail, epochs[no_tail], Status.COMPLETED, '"r"', None),
        Finish(clashed, epochs[clashed], Status.COMPLETED, '"r"', None, tail(clashed, "mine")),
        Finish(fenced, epochs[fenced] + 1, Status.COMPLETED, '"r"', None,
               tail(fenced, "late", epochs[fenced] + 1)),
        Finish(failed, epochs[failed], Status.FAILED, None, '{"type": "E", "message": ""}',
               StepWrite(failed, epochs[failed], 0, "add", None,
                         '{"type": "E", "message": "boom"}', 3, 0.5)),
    ]
    stmt = statements.executions.complete_batch(qs, finishes, delegated=form)
    assert run(pg_dsn, stmt) == {done_tail, no_tail, failed}
    # Sent again (a lost reply's retry): nothing more is finished or written.
    assert run(pg_dsn, stmt) == set()
    outputs = {(r[0], r[1]): r[2:] for r in q(
        pg_dsn, schema, "SELECT execution_id, step_id, output, error, attempt, lease_epoch, "
        "xmin::text, finished_at <= now() AND started_at <= finished_at "
        "FROM {s}.operation_outputs")}
    history = {r[0]: r[1:] for r in q(pg_dsn, schema, "SELECT id, status, xmin::text "
                                      "FROM {s}.workflow_history")}
    assert set(history) == {done_tail, no_tail, failed}
    assert outputs[(done_tail, 0)][:4] == ({"a": 10**16, "b": 1}, None, 1, epochs[done_tail])
    assert outputs[(done_tail, 0)][4] == history[done_tail][1]  # one transaction
    assert outputs[(done_tail, 0)][5] is True
    assert outputs[(failed, 0)][:3] == (None, {"type": "E", "message": "boom"}, 3)
    assert (no_tail, 0) not in outputs and (fenced, 0) not in outputs
    # The clash: the older claim's value stays, and the execution is not finished (still
    # running under this claim, whose lease will run out).
    assert outputs[(clashed, 0)][0] == "older"
    assert q1(pg_dsn, schema, "SELECT status FROM {s}.workflow_executions WHERE id = %s",
              [clashed]) == "running"
    assert len(outputs) == 3


@kestrel.step(name="tail.older_claim_wrote_first")
async def older_claim_wrote_first(dsn: str, schema: str, delay: float) -> str:
    """The body of a step whose position an older claim records meanwhile: committed before
    this returns (delay 0), or held open in a transaction and committed *delay* seconds
    later, after the completion took its snapshot."""
    from kestrel.definitions import current_step

    info = current_step()
    assert info is not None
    if info.lease_epoch > 1:
        return "second claim ran the body"  # the replay of the recorded value never does
    conn = psycopg.connect(dsn)
    conn.execute(f"INSERT INTO {schema}.operation_outputs (execution_id, step_id, step_name, "
                 "output, attempt, lease_epoch, started_at, finished_at) VALUES "
                 "(%s, %s, 'tail.older_claim_wrote_first', '\"recorded\"', 1, 0, now(), now())",
                 [info.execution_id, info.step_id])
    if delay == 0:
        conn.commit()
        conn.close()
    else:
        def later() -> None:
            time.sleep(delay)
            conn.commit()
            conn.close()

        threading.Thread(target=later, daemon=True).start()
    return "handed"


@kestrel.workflow(name="tail.clash")
async def clash(ctx: kestrel.Context, dsn: str, schema: str, delay: float) -> str:
    value = await ctx.step(older_claim_wrote_first, dsn, schema, delay)
    return f"ended on {value}"


@pytest.mark.parametrize("delay", [0.0, 0.8], ids=["before-snapshot", "after-snapshot"])
def test_a_tail_an_older_claim_recorded_is_replayed_not_overwritten(
        pg_dsn: str, schema: str, form: bool, delay: float) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(clash, pg_dsn, schema, delay)
    work_in_form(pg_dsn, schema, form, 1)
    done = client.get(h.id)
    # The end the first claim computed from its own value was never recorded: the second
    # claim replayed the recorded one.
    assert (done.status.value, done.result) == ("completed", "ended on recorded")
    assert done.attempts == 2
    assert q(pg_dsn, schema, "SELECT step_id, output FROM {s}.operation_outputs "
             "WHERE execution_id = %s", [h.id]) == [(0, "recorded")]


def test_lost_reply_of_a_completion_with_tail_is_learned(pg_dsn: str, schema: str) -> None:
    """The retry of a committed completion finishes nothing, writes no tail twice, and the
    worker learns the finish from history (finished_readback)."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 3)
    epochs = claim_all(pg_dsn, schema, 1)
    f = Finish(h.id, epochs[h.id], Status.COMPLETED, "30", None,
               StepWrite(h.id, epochs[h.id], 2, "add", "32", None, 1, 0.1))
    stmt = statements.executions.complete_batch(queries(schema), [f])
    assert run(pg_dsn, stmt) == {h.id}
    assert run(pg_dsn, stmt) == set()
    assert run(pg_dsn, statements.executions.finished_readback(queries(schema), [f])) == {h.id}
    assert q(pg_dsn, schema, "SELECT step_id, output FROM {s}.operation_outputs "
             "WHERE execution_id = %s", [h.id]) == [(2, 32)]
