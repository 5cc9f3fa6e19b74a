"""The process machine (FAULTS.md): real ``kestrel-runtime`` processes, real signals.

Rules submit workflows (sequential ones, long runs of short steps, and fan-outs of parallel
steps with a sleep and children inside: FAULTS C1, C2), SIGKILL a worker *while a step body
runs* (the body writes a "start" line to the ledger first, so the kill lands mid-step), and
SIGSTOP a worker past its lease
before SIGCONT (a zombie). After every rule: each recorded checkpoint is the model's value
and is recorded once. At the end, everything submitted is completed with the model's
result, and no step body ran more often than the kills that hit it allow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.apps import parallel_app
from tests.helpers import alive, q, start_runtime, stop_runtime, wait_until, worker_pids

settings.register_profile(
    "process-ci", max_examples=4, stateful_step_count=8, deadline=None, derandomize=True,
    suppress_health_check=list(HealthCheck))
settings.register_profile(
    "process-soak", max_examples=10, stateful_step_count=15, deadline=None,
    suppress_health_check=list(HealthCheck))

ENV: dict[str, Any] = {}


class ProcessMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.dsn, self.schema, tmp = ENV["dsn"], ENV["schema"], ENV["tmp"]
        q(self.dsn, self.schema, "TRUNCATE {s}.workflow_executions, {s}.operation_outputs, "
          "{s}.workflow_history, {s}.idempotency_keys")
        q(self.dsn, self.schema, "UPDATE {s}.clock_offset SET offset_by = '0'")
        self.tmp = Path(tmp)
        self.ledger = self.tmp / f"ledger-{uuid.uuid4().hex}.jsonl"
        self.log = open(self.tmp / "rt.log", "ab")  # noqa: SIM115 - closed in teardown
        self._start_runtime()
        self.client = SyncClient(self.dsn, schema=self.schema, pool_size=0)
        self.expected: dict[uuid.UUID, int] = {}
        self.epochs: dict[uuid.UUID, int] = {}
        self.kills = 0

    def _start_runtime(self) -> None:
        self.proc = start_runtime(self.dsn, self.schema,
                                  # 64 in flight: the bound on bodies run again (invariant)
                                  args=["--max-attempts", "10", "--concurrency", "64"],
                                  env={"KESTREL_TEST_LEDGER": str(self.ledger)}, out=self.log,
                                  app="tests.apps.ledger_app,tests.apps.parallel_app")
        wait_until(lambda: len(worker_pids(self.proc.pid)) == 2, timeout=20, what="workers")

    def teardown(self) -> None:
        if not hasattr(self, "proc"):
            return
        try:
            for eid, want in self.expected.items():
                assert self.client.result(eid, timeout=60) == want
            per_step = q(self.dsn, self.schema, "SELECT count(*) FROM {s}.workflow_steps "
                         "GROUP BY execution_id, step_id")
            assert all(r[0] == 1 for r in per_step)
            bodies = [e for e in app.read_ledger(self.ledger) if e["kind"] == "body"]
            recorded = q(self.dsn, self.schema, "SELECT count(*) FROM {s}.workflow_steps "
                         "WHERE step_name NOT LIKE 'kestrel.%%'")[0][0]
            # Each kill or freeze can cost at most the bodies in flight in that process.
            assert recorded <= len(bodies) <= recorded + 64 * self.kills
        finally:
            stop_runtime(self.proc)
            self.log.close()

    @rule(n=st.integers(0, 99),
          kind=st.sampled_from(["fast", "slow", "sleeper", "short", "fan"]))
    def submit(self, n: int, kind: str) -> None:
        if kind == "short":  # 40 short steps in a row: batches hold the row (FAULTS C2)
            h = self.client.submit(app.short_steps, n, 40)
            self.expected[h.id] = app.model(n, 40)
        elif kind == "fan":  # children, parallel steps and a sleep at once (FAULTS C1)
            h = self.client.submit(parallel_app.fan_children, n % 5 + 2)
            self.expected[h.id] = parallel_app.model_fan_children(n % 5 + 2)
        elif kind == "slow":
            h = self.client.submit(app.slow_middle, n, 1.0)
            self.expected[h.id] = app.model(n)
        elif kind == "sleeper":  # a durable 5 s sleep between two steps
            h = self.client.submit(app.sleeper, n, 5.0)
            self.expected[h.id] = app.model_step(n, 0) + app.model_step(n, 1)
        else:
            h = self.client.submit(app.three_steps, n)
            self.expected[h.id] = app.model(n)

    @rule(graceful=st.booleans())
    def restart_the_runtime(self, graceful: bool) -> None:
        """SIGTERM (drain, release) or SIGKILL (children die with their parent) the
        supervisor, then start a new one."""
        if graceful:
            self.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.kills += 2
        self.proc.wait(timeout=30)
        self._start_runtime()

    @rule(seconds=st.sampled_from([1, 5, 30]))
    def advance_time(self, seconds: int) -> None:
        """Move the database clock: leases it passes expire at once (their holders are
        fenced, their bodies may run again) and sleeps it passes are due."""
        q(self.dsn, self.schema, "UPDATE {s}.clock_offset SET offset_by = offset_by + "
          "make_interval(secs => %s)", [seconds])
        if seconds > 1:
            self.kills += 2

    @rule()
    def kill_a_worker_mid_step(self) -> None:
        """SIGKILL the process whose slow step body has started and not finished."""
        def running_start() -> dict[str, Any] | None:
            entries = app.read_ledger(self.ledger)
            ended = {(e["execution_id"], e["step_id"], e["pid"]) for e in entries
                     if e["kind"] == "body"}
            alive = set(worker_pids(self.proc.pid))
            for e in entries:
                key = (e["execution_id"], e["step_id"], e["pid"])
                if e["kind"] == "start" and key not in ended and e["pid"] in alive:
                    return e
            return None

        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            victim = running_start()
            if victim:
                os.kill(victim["pid"], signal.SIGKILL)
                self.kills += 1
                return
            time.sleep(0.05)

    @rule()
    def freeze_a_worker_past_its_lease(self) -> None:
        # Live ones: a worker another rule just killed is a zombie until its supervisor
        # reaps it, and gone by the time it would be continued.
        pids = [p for p in worker_pids(self.proc.pid) if alive(p)]
        if not pids:
            return
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(3.0)  # lease is 2 s: the sweeper requeues, another worker re-claims
        with contextlib.suppress(ProcessLookupError):  # it died while stopped: killed too
            os.kill(pids[0], signal.SIGCONT)
        self.kills += 1

    @rule()
    def let_it_run(self) -> None:
        time.sleep(0.5)

    @invariant()
    def epochs_never_go_back_and_no_sleep_ends_early(self) -> None:
        if not hasattr(self, "expected"):
            return
        rows = q(self.dsn, self.schema, "SELECT id, lease_epoch FROM {s}.workflow_executions "
                 "UNION ALL SELECT id, lease_epoch FROM {s}.workflow_history")
        for eid, epoch in rows:
            assert epoch >= self.epochs.get(eid, 0)
            self.epochs[eid] = epoch
        # The step after a 5 s sleep starts 5 s or more after the step before it ended, by
        # the database clock (which advance_time only moves forward).
        early = q(self.dsn, self.schema, "SELECT a.execution_id FROM {s}.workflow_steps a "
                  "JOIN {s}.workflow_steps b USING (execution_id) WHERE a.workflow = "
                  "'sleeper' AND a.step_id = 0 AND b.step_id = 2 AND b.started_at < "
                  "a.finished_at + interval '5 seconds'")
        assert early == []

    @invariant()
    def recorded_values_are_the_models(self) -> None:
        if not hasattr(self, "expected"):
            return
        for eid, step, out, name in q(self.dsn, self.schema, "SELECT execution_id, step_id, "
                                      "output, step_name FROM {s}.workflow_steps"):
            ex = self.client.get(eid)
            if ex.workflow == "par_child":  # its one step, g of its argument
                assert (step, out) == (0, f"g({ex.args[0]})")
                continue
            if ex.workflow == "par_fan_children":
                # Two child starts at 0 and 1, so the fan-out's i-th step is at 2 + i; the
                # sleep and the children's waits are checked by the results at the end.
                if name == "par_g":
                    assert out == f"g({step - 2})"
                continue
            if ex.workflow == "sleeper" and step == 1:
                assert out == {"slept": True}
                continue
            step = 1 if ex.workflow == "sleeper" and step == 2 else step
            assert out == app.model_step(ex.args[0], step)


@pytest.fixture
def process_env(pg_dsn: str, schema: str, tmp_path: Path) -> None:
    ENV.update(dsn=pg_dsn, schema=schema, tmp=str(tmp_path))


@pytest.mark.usefixtures("process_env")
class TestProcesses(ProcessMachine.TestCase):  # type: ignore[name-defined,misc]
    settings = settings.get_profile(
        "process-soak" if os.environ.get("KESTREL_HYPOTHESIS_PROFILE") == "soak"
        else "process-ci")
