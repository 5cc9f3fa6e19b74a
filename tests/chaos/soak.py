"""The real-process fault scenarios at length, with the ledger audit at the end (FAULTS.md).

    python -m tests.chaos.soak --minutes 30

A PostgreSQL cluster of its own, the real supervisor and workers, a steady stream of
submissions, and a nemesis that every few seconds picks one fault: SIGKILL a worker
(mid-step: most of the time a step is running), SIGSTOP a worker past its lease then SIGCONT
it (a zombie), SIGKILL the supervisor and start a new one, terminate kestrel backends
(LISTEN included), PostgreSQL fast restart, immediate restart (crash recovery) and a SIGKILL
of the postmaster. When time is up the nemesis stops, the queue drains and the audit runs:

- lost: submitted but not finished after quiesce;
- duplicated_checkpoint: more than one checkpoint row for one (execution, step);
- unexpected: a finished execution or checkpoint nobody submitted;
- divergent: a result or a checkpointed output that differs from the model;
- extra_body_runs: step bodies run beyond the checkpoints (allowed: crashes cut bodies
  short), with the worst single step.

Exits 1 if lost, duplicated_checkpoint, unexpected or divergent is not zero.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from kestrel.migrate import migrate
from tests.apps import ledger_app as app
from tests.helpers import finished_count, q, q1, start_runtime, stop_runtime, worker_pids
from tests.pgcluster import Cluster

SCHEMA = "soak"
FAULTS = ("kill_worker", "stop_worker", "kill_supervisor", "terminate_backends",
          "pg_fast_restart", "pg_immediate_restart", "pg_kill9")


class Soak:
    def __init__(self, args: argparse.Namespace, cluster: Cluster) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.cluster = cluster
        self.cluster.start()
        self.dsn = self.cluster.dsn
        migrate(self.dsn, SCHEMA)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ledger = self.out / "ledger.jsonl"
        self.ledger.unlink(missing_ok=True)
        self.log = open(self.out / "runtime.log", "ab")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None
        self.submitted = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.missed: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.error: str | None = None

    # -- the system under test ----------------------------------------------------------------

    def start_runtime(self) -> None:
        self.proc = start_runtime(self.dsn, SCHEMA, procs=self.args.procs,
                                  args=["--max-attempts", "1000"], out=self.log,
                                  env={"KESTREL_TEST_LEDGER": str(self.ledger)})

    def stop_runtime(self) -> None:
        if self.proc:
            stop_runtime(self.proc, timeout=60)

    def _query(self, fn: Any, default: Any = None) -> Any:
        """A harness query that rides out the database's own restarts."""
        for _ in range(100):
            try:
                return fn()
            except psycopg.OperationalError:
                time.sleep(0.3)
        return default

    # -- load -----------------------------------------------------------------------------------

    def submitter(self) -> None:
        """A steady stream: --rate workflows a second, at most --backlog waiting. Odd ids run
        slow_middle (its middle step sleeps, so kills land mid-step), even ones three_steps;
        both have the result n * 30 + 3."""
        chunk = max(1, self.args.rate // 5)
        unsure = False  # the last chunk failed: it may have committed (a lost reply)
        while not self.stop.is_set() or unsure:
            started = time.monotonic()
            try:
                waiting = q1(self.dsn, SCHEMA, "SELECT count(*) FROM {s}.workflow_executions")
                if waiting < self.args.backlog or unsure:
                    unsure = True
                    first = self.submitted + 1
                    q(self.dsn, SCHEMA,
                      "SELECT CASE WHEN i %% 2 = 1 THEN {s}.submit('slow_middle', "
                      "jsonb_build_array(i, 0.3), p_idempotency_key => 'soak-' || i) "
                      "ELSE {s}.submit('three_steps', jsonb_build_array(i), "
                      "p_idempotency_key => 'soak-' || i) END "
                      "FROM generate_series(%s::int, %s::int) AS i",
                      [first, first + chunk - 1])
                    self.submitted += chunk
                    unsure = False
            except psycopg.OperationalError:
                # The database is restarting: the same ids go again, with the same keys, until
                # they are known to be in (even after the stop, so none is left uncounted).
                pass
            except Exception as exc:
                self.error = f"submitter died: {exc!r}"
                self.stop.set()
                raise
            time.sleep(max(0.0, 0.2 - (time.monotonic() - started)))

    # -- faults ---------------------------------------------------------------------------------

    def nemesis(self) -> None:
        while not self.stop.wait(self.rng.uniform(self.args.min_gap, self.args.max_gap)):
            fault = self.rng.choice(FAULTS)
            try:
                getattr(self, fault)()
                self.faults[fault] += 1
            except Exception as exc:  # a fault that could not land (e.g. no worker yet)
                self.missed[fault] += 1
                print(f"  fault {fault} not injected: {exc!r}", flush=True)

    def _worker(self) -> int:
        assert self.proc is not None
        pids = worker_pids(self.proc.pid)
        if not pids:
            raise RuntimeError("no worker running")
        return self.rng.choice(pids)

    def kill_worker(self) -> None:
        os.kill(self._worker(), signal.SIGKILL)

    def stop_worker(self) -> None:
        pid = self._worker()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2 + self.rng.uniform(1, 3))  # past the 2 s lease: it becomes a zombie
        os.kill(pid, signal.SIGCONT)

    def kill_supervisor(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        time.sleep(self.rng.uniform(0, 2))
        self.start_runtime()

    def terminate_backends(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                         "application_name LIKE 'kestrel-%%' "
                         "AND random() < 0.5")

    def pg_fast_restart(self) -> None:
        self.cluster.restart("fast")

    def pg_immediate_restart(self) -> None:
        self.cluster.restart("immediate")

    def pg_kill9(self) -> None:
        self.cluster.kill9()
        time.sleep(self.rng.uniform(0, 2))
        self.cluster.start()

    # -- the run and the audit --------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start_runtime()
        threads = [threading.Thread(target=self.submitter, daemon=True),
                   threading.Thread(target=self.nemesis, daemon=True)]
        for t in threads:
            t.start()
        began = time.monotonic()
        end = began + self.args.minutes * 60
        while time.monotonic() < end and not self.stop.is_set():
            self.stop.wait(min(60.0, max(0.0, end - time.monotonic())))
            done = self._query(lambda: finished_count(self.dsn, SCHEMA), -1)
            print(f"{(time.monotonic() - began) / 60:5.1f} min: {self.submitted} submitted, "
                  f"{done} finished, faults {dict(self.faults)}", flush=True)
        self.stop.set()
        submitter, nemesis = threads
        nemesis.join()
        if not self.cluster.running():  # a fault that failed halfway left it down
            self.cluster.start()
        submitter.join()
        if self.proc is None or self.proc.poll() is not None:
            self.start_runtime()  # the nemesis may have been between kill and start
        quiesce = time.monotonic()
        while self._query(lambda: q1(self.dsn, SCHEMA,
                                     "SELECT count(*) FROM {s}.workflow_executions"), 1):
            if time.monotonic() - quiesce > 600:
                break
            time.sleep(1)
        drained = time.monotonic() - quiesce
        self.stop_runtime()
        result = self.audit()
        result.update(error=self.error, minutes=self.args.minutes, procs=self.args.procs,
                      seed=self.args.seed, faults=dict(self.faults),
                      faults_not_injected=dict(self.missed),
                      quiesce_seconds=round(drained, 1))
        return result

    def audit(self) -> dict[str, Any]:
        dsn = self.dsn
        submitted = self.submitted
        pending = q1(dsn, SCHEMA, "SELECT count(*) FROM {s}.workflow_executions")
        rows = q(dsn, SCHEMA, "SELECT id::text, (args->>0)::int, status, result "
                 "FROM {s}.workflow_history")
        ns = collections.Counter(n for _, n, _, _ in rows)
        finished_ids = {i for i in ns if 1 <= i <= submitted}
        lost = submitted - len(finished_ids)
        unexpected = sum(1 for n, c in ns.items() if not 1 <= n <= submitted) + \
            sum(c - 1 for c in ns.values() if c > 1)
        divergent = sum(1 for _, n, status, result in rows
                        if status != "completed" or result != app.model(n))
        dup = q1(dsn, SCHEMA, "SELECT count(*) FROM (SELECT 1 FROM {s}.workflow_steps "
                 "GROUP BY execution_id, step_id HAVING count(*) > 1) d")
        orphans = q1(dsn, SCHEMA, "SELECT count(*) FROM {s}.workflow_steps s WHERE NOT EXISTS "
                     "(SELECT 1 FROM {s}.workflow_history h WHERE h.id = s.execution_id)")
        wrong_outputs = q1(dsn, SCHEMA, "SELECT count(*) FROM {s}.workflow_steps s JOIN "
                           "{s}.workflow_history h ON h.id = s.execution_id WHERE s.output <> "
                           "to_jsonb((h.args->>0)::int * 10 + s.step_id)")
        checkpoints = q1(dsn, SCHEMA, "SELECT count(*) FROM {s}.workflow_steps")
        runs = collections.Counter(
            (e["execution_id"], e["step_id"]) for e in app.read_ledger(self.ledger)
            if e["kind"] == "body")
        never_recorded = len(set(runs) - {
            (i, s) for i, s in q(dsn, SCHEMA, "SELECT execution_id::text, step_id "
                                 "FROM {s}.workflow_steps")})
        return {
            "submitted": submitted, "finished": len(rows), "still_pending": pending,
            "lost": lost, "duplicated_checkpoint": dup, "unexpected": unexpected + orphans,
            "divergent": divergent + wrong_outputs, "checkpoints": checkpoints,
            "body_runs": sum(runs.values()),
            "extra_body_runs": sum(runs.values()) - checkpoints,
            "max_runs_of_one_step": max(runs.values(), default=0),
            "bodies_without_checkpoint": never_recorded,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the nemesis runs")
    p.add_argument("--procs", type=int, default=3, help="worker processes")
    p.add_argument("--rate", type=int, default=150, help="workflows submitted a second")
    p.add_argument("--backlog", type=int, default=1500, help="most executions waiting")
    p.add_argument("--min-gap", type=float, default=2.0, help="least seconds between faults")
    p.add_argument("--max-gap", type=float, default=8.0, help="most seconds between faults")
    p.add_argument("--seed", type=int, default=int(time.time()), help="nemesis seed")
    p.add_argument("--out", default=".soak", help="folder for the ledger, log and audit")
    args = p.parse_args(argv)
    cluster = Cluster("kestrel-soak", conf={"max_connections": "300"})
    try:
        soak = Soak(args, cluster)
        print(f"soak: {args.minutes} min, {args.procs} procs, seed {args.seed}, "
              f"PostgreSQL at {soak.dsn}, output in {args.out}", flush=True)
        try:
            result = soak.run()
        finally:
            soak.stop.set()
            soak.stop_runtime()
            soak.log.close()
    finally:
        cluster.destroy()
    text = json.dumps(result, indent=2)
    (Path(args.out) / "audit.json").write_text(text + "\n")
    print(text)
    bad = {k: result[k] for k in ("lost", "duplicated_checkpoint", "unexpected", "divergent")
           if result[k]}
    if result["error"] or not result["finished"] or not sum(result["faults"].values()):
        bad["run"] = result["error"] or "nothing finished or no fault injected"
    if bad:
        print(f"AUDIT FAILED: {bad}", file=sys.stderr)
        return 1
    print("audit: nothing lost, nothing recorded twice, nothing unexpected or divergent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
