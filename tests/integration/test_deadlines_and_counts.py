"""Deadlines and counts (issue 22, rows 9 and 12; FAULTS O7): a deadline that passes while a
park is on its way is enforced, and every finish is counted once per finish: cancels and
deadlines no worker saw as well as those a worker committed."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import kestrel
from kestrel import failpoints
from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, q, q1, run_worker_until, runtime, wait_until
from tests.pgbouncer import free_port

# -- O7: a deadline passing while a park is on its way --------------------------------------


@kestrel.step(name="o7_after_the_wait")
async def _after_the_wait(payload: int) -> int:
    return payload + 1


@kestrel.workflow(name="o7_waits_then_steps")
async def _waits_then_steps(ctx: kestrel.Context) -> int:
    sig = await ctx.wait_for_signal("go")
    return int(await ctx.step(_after_the_wait, sig.payload))


def _in_process(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_o7_a_deadline_passing_while_a_park_is_on_its_way_is_enforced(
    pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O7: a 2 s deadline passes while the park is on its way (failpoint before_park hangs
    it 4 s), and a signal arrives meanwhile, so the park does not end the claim: it returns
    'signalled' and the workflow would go on. The deadline is enforced there: the execution
    ends DeadlineExceeded, the step after the wait never runs, and the deadline failure is
    counted once. Before the fix the timer ignored the lease while it was finishing, nothing
    re-armed it, and the execution completed seconds past its deadline."""
    monkeypatch.setattr(failpoints, "_FAILPOINTS",
                        failpoints._parse_failpoints("before_park=hang(4)"))
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(_waits_then_steps, timeout=2.0)
    deadline = q1(pg_dsn, schema, "SELECT deadline FROM {s}.workflow_executions WHERE id = %s",
                  [h.id])
    counted = _in_process("kestrel_deadlines_exceeded_total", workflow="o7_waits_then_steps")
    signalled_at = []

    def done() -> bool:
        if not signalled_at and failpoints._FAILPOINTS["before_park"][2] == 0:
            # The park is on its way (held before its statement): a signal arrives now.
            signalled_at.append(q1(pg_dsn, schema, "SELECT {s}.kestrel_now()"))
            assert client.signal(h.id, "go", 41) is True
        return bool(finished_count(pg_dsn, schema) == 1)

    # A long lease: nothing but the deadline may end this attempt.
    worker = run_worker_until(pg_dsn, config(schema, lease=20, heartbeat=1), done, timeout=40)
    assert signalled_at and signalled_at[0] < deadline, "the park did not start before the deadline"
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.FAILED, f"{ex.status.value} ({ex.result!r}) past {deadline}"
    assert ex.error is not None and ex.error["type"].endswith("DeadlineExceeded")
    assert ex.finished_at is not None and ex.finished_at > deadline
    ran = q(pg_dsn, schema, "SELECT step_name FROM {s}.step_history WHERE execution_id = %s",
            [h.id])
    assert ("o7_after_the_wait",) not in ran, "a step ran past the deadline"
    assert worker.stats.failed == 1 and worker.stats.completed == 0
    assert _in_process("kestrel_deadlines_exceeded_total",
                       workflow="o7_waits_then_steps") == counted + 1


# -- row 12: every finish counted once per finish --------------------------------------------


def _samples(port: int, name: str) -> dict[tuple[str, ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {tuple(sorted(s.labels.values())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name and s.value}


def test_every_finish_is_counted_once_per_finish(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """Cancel, retry and cancel again before any collector ran is two cancellations: two
    rows wait to be counted, and the metric counts two (before the fix uncounted_finishes
    was keyed by execution, and the second cancel was dropped as a duplicate). Deadline
    failures are counted by both paths: a waiting execution the sweeper fails and a running
    one its worker stops (before, neither was counted in any metric, and the sweeper's
    failure not even in kestrel_workflows_finished_total)."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    twice = client.submit(app.quick, 1, delay=3600)
    assert client.cancel(twice.id) == "cancelled"
    client.retry(twice.id)
    assert client.cancel(twice.id) == "cancelled"
    assert q(pg_dsn, schema, "SELECT workflow, status, deadline FROM {s}.uncounted_finishes "
             "WHERE execution_id = %s", [twice.id]) == [("quick", "cancelled", False)] * 2
    port = free_port()
    with runtime(pg_dsn, schema, procs=2, args=["--metrics-port", str(port)],
                 log=tmp_path / "rt.log"):
        wait_until(lambda: q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workers") == 2,
                   timeout=30, what="the workers")
        waiting = client.submit(app.waiter, timeout=3)  # parks; the sweeper fails it
        running = client.submit(app.slow_middle, 1, 30.0, timeout=3)  # its worker does
        wait_until(lambda: finished_count(pg_dsn, schema) == 3, timeout=60,
                   what="both deadlines")
        for h, by in ((waiting, "workflow deadline"), (running, "ran past its deadline")):
            ex = client.get(h.id)
            assert ex.status is kestrel.Status.FAILED and ex.error is not None
            assert ex.error["type"].endswith("DeadlineExceeded")
            assert by in ex.error["message"], ex.error["message"]
        wanted = {("waiter",): 1.0, ("slow_middle",): 1.0}
        wait_until(lambda: _samples(port, "kestrel_deadlines_exceeded_total") == wanted,
                   timeout=60, what="both deadline failures counted")
        assert _samples(port, "kestrel_workflows_finished_total") == {
            ("cancelled", "quick"): 2.0, ("failed", "waiter"): 1.0,
            ("failed", "slow_middle"): 1.0}
        # Each row goes once the collector that counted it acknowledges it (its next round):
        # none can be counted again.
        wait_until(lambda: q(pg_dsn, schema, "SELECT count(*) FROM {s}.uncounted_finishes")
                   == [(0,)], timeout=30, what="the counted rows acknowledged")
