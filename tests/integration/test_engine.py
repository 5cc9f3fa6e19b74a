"""The worker engine against a real PostgreSQL: steps, replays, failures, bad output."""

from __future__ import annotations

from pathlib import Path

import pytest

import kestrel
from kestrel.client import SyncClient
from kestrel.testing import KestrelTestEnv
from kestrel.workflow import _registry as workflow_registry
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, q, q1, run_worker_until


def test_steps_checkpoint_once_and_result_matches_model(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    handles = [client.submit(app.three_steps, n) for n in range(20)]
    handles += [client.submit("three_sync_steps", n) for n in range(20, 30)]
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 30)
    for n, h in enumerate(handles):
        assert h.result(timeout=1) == app.model(n)
    per_step = q(pg_dsn, schema, "SELECT execution_id, step_id, count(*) FROM "
                 "{s}.workflow_steps GROUP BY 1, 2")
    assert len(per_step) == 90 and {r[2] for r in per_step} == {1}
    assert len(app.read_ledger(ledger_path)) == 90  # no body ran twice
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0


def test_sync_steps_run_in_threads_not_on_the_loop(pg_dsn: str, schema: str) -> None:
    seen: list[str] = []

    @kestrel.step(name="where_am_i")
    def where_am_i() -> str:
        import threading

        seen.append(threading.current_thread().name)
        return "ok"

    @kestrel.workflow(name="thread_probe")
    async def thread_probe(ctx: kestrel.Context) -> str:
        return await ctx.step(where_am_i)

    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit(thread_probe)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    assert h.result(timeout=1) == "ok"
    assert seen and seen[0].startswith("kestrel-step")


def test_replay_reads_checkpoints_instead_of_rerunning(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    """Recorded steps are returned from the checkpoint on a later claim; only the rest run."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 7)
    # Record step 0 and 1 as a previous claim would have, with a distinctive output for step
    # 0: the replay must return the *recorded* value, not recompute it.
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES (%s, 0, 'add', '1000', 1, 1, now()), "
      "(%s, 1, 'add', %s, 1, 1, now())", [h.id, h.id, str(app.model_step(7, 1))])
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    assert h.result(timeout=1) == 1000 + app.model_step(7, 1) + app.model_step(7, 2)
    ran = [(e["step_id"]) for e in app.read_ledger(ledger_path)]
    assert ran == [2]


def test_nondeterminism_fails_the_execution_naming_the_step(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 1)
    q(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
      "output, attempt, lease_epoch, started_at) VALUES (%s, 0, 'renamed_step', '5', 1, 1, "
      "now())", [h.id])
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.FAILED
    assert ex.error is not None
    assert ex.error["type"].endswith("NonDeterminismError")
    assert "'add'" in ex.error["message"] and "'renamed_step'" in ex.error["message"]
    # Nothing new was recorded after the mismatch.
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps") == 1


def test_step_retries_with_backoff_then_succeeds(
    kestrel_env: KestrelTestEnv, ledger_path: Path
) -> None:
    run = kestrel_env.run_to_completion(app.flaky_wf, "k-retry", 2)
    assert run.assert_completed() == "ok after 3"
    assert [e["attempt"] for e in app.read_ledger(ledger_path)] == [1, 2, 3]
    assert run.timeline == [("flaky", 3, "ok")]


def test_non_retryable_error_is_recorded_and_fails_the_workflow(
    kestrel_env: KestrelTestEnv, ledger_path: Path
) -> None:
    run = kestrel_env.run_to_completion(app.fails_in_step)
    assert run.status is kestrel.Status.FAILED
    assert len(app.read_ledger(ledger_path)) == 1  # ValueError is not in retry_on
    assert run.timeline == [("not_retried", 1, "error")]
    assert run.step("not_retried").error["type"] == "builtins.ValueError"


def test_workflow_exception_stores_type_message_and_traceback(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.raises, "disk on fire")
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.FAILED and ex.error is not None
    assert ex.error["type"] == "builtins.RuntimeError"
    assert ex.error["message"] == "disk on fire"
    assert "raise RuntimeError(message)" in ex.error["traceback"]


@pytest.mark.parametrize("kind", ["set", "nan", "nul", "obj"])
def test_unserializable_step_output_fails_the_step_cleanly(
    pg_dsn: str, schema: str, kind: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    bad = client.submit(app.bad_output, kind)
    good = client.submit(app.three_steps, 3)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
    message = bad.result(timeout=1)
    assert message.startswith("caught kestrel.errors.SerializationError")
    assert "'returns_bad'" in message and "'bad_output'" in message
    assert good.result(timeout=1) == app.model(3)  # the worker kept going


def test_live_run_returns_exactly_what_a_replay_returns(pg_dsn: str, schema: str) -> None:
    """jsonb normalizes numbers (1e20 → an integer): the live run sees the stored value."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.echo_float)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    live = h.result(timeout=1)["live"]
    stored = q1(pg_dsn, schema, "SELECT output FROM {s}.workflow_steps")
    assert live == stored
    assert live == {"big": 100000000000000000000, "tuple": [1, 2], "small": 0.1}


def test_unknown_workflow_waits_for_a_worker_that_knows_it(pg_dsn: str, schema: str) -> None:
    """P4: a name no worker registers (a typo, a rolling deploy) is never claimed or failed;
    it waits until a worker that registers it appears, and then runs normally."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    late = client.submit("arrives_in_the_next_deploy", 5)
    known = client.submit(app.three_steps, 1)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    assert known.result(timeout=1) == app.model(1)
    status, attempts, epoch = q(pg_dsn, schema, "SELECT status, attempts, lease_epoch FROM "
                                "{s}.workflow_executions WHERE id = %s", [late.id])[0]
    assert (status, attempts, epoch) == ("queued", 0, 0)

    @kestrel.workflow(name="arrives_in_the_next_deploy")
    async def next_deploy(ctx: kestrel.Context, n: int) -> int:
        return n * 2

    try:
        run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
    finally:
        workflow_registry.pop("arrives_in_the_next_deploy", None)
    assert late.result(timeout=1) == 10
