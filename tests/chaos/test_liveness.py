"""Liveness of a worker (FAULTS.md L1, L2) with the real supervisor, real worker processes and
a real PostgreSQL, and F8's bound seen from the other side.

L1: a service inside a worker that ends (here: the sweeper, by an error, through the
``sweeper_round=crash`` failpoint) ends the whole worker process with a non-zero exit, and the
supervisor starts a new one; upkeep without DDL rights stands down and stays alive, so a later
death of another service still ends the worker. L2: a worker whose event loop (``sleep``
failpoint: blocks the loop) or checkpoint writer (``hang`` failpoint: suspends the flush while
the loop runs) makes no progress for a whole lease stops extending its leases although its
heartbeat thread lives, so the sweeper of a second runtime recovers the work, and whatever the
stuck worker writes later is fenced.

Every runtime runs with lease 2 s, heartbeat 0.5 s, sweep 0.5 s and poll 0.2 s
(tests.helpers.FAST) unless a test says otherwise. Timing bounds below are the ones FAULTS.md
states ("within a second", "within one lease") plus slack for a shared two-core CI machine;
they decide whether the mechanism worked at all, they are not performance assertions.
"""

from __future__ import annotations

import calendar
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql as pgsql

from tests.apps import ledger_app as app
from tests.helpers import (
    alive,
    audit,
    finished_count,
    metric,
    q,
    q1,
    runtime,
    start_runtime,
    stop_runtime,
    submit_many,
    wait_until,
    worker_pids,
)
from tests.pgbouncer import free_port

LEASE = 2.0
HEARTBEAT = 0.5
# FAULTS L1 says "within a second"; a worker's exit also waits for its pool and heartbeat
# thread to close, and the supervisor reaps every 50 ms. On a shared two-core machine a
# process may not be scheduled for a while, so one more second of slack.
EXIT_WITHIN = 1.0 + 1.0
# FAULTS L2: the watchdog notices a stall once it has lasted a lease, at the next beat (one
# heartbeat period later); that beat is the first one that does not extend. Slack as above.
STOP_EXTENDING_WITHIN = LEASE + HEARTBEAT + 1.0
UPKEEP_STANDS_DOWN = "history partition upkeep needs the schema owner's rights"

# The text log format: an RFC 3339 UTC time with milliseconds, the level, logger[pid], message.
_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})Z +\w+ +([\w.]+)\[(\d+)\] (.*)$")


@dataclass(frozen=True)
class Event:
    t: float  # wall clock (the runtime's log timestamp)
    logger: str
    pid: int
    msg: str


def events(log: Path, needle: str, *, pid: int | None = None,
           logger: str | None = None) -> list[Event]:
    """The log lines of a runtime that contain *needle* (from process *pid*, logged by
    *logger*), in order."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m is None or needle not in m.group(5):
            continue
        if (pid is not None and int(m.group(4)) != pid) or (
                logger is not None and m.group(3) != logger):
            continue
        t = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + int(m.group(2)) / 1000
        found.append(Event(t, m.group(3), int(m.group(4)), m.group(5)))
    return found


def exit_of(log: Path, pid: int) -> Event | None:
    """The supervisor's line about worker *pid*'s exit, if it has exited."""
    found = events(log, f"worker {pid} ", logger="kestrel.supervisor")
    return next((e for e in found if " exited (" in e.msg), None)


def labelled(port: int, name: str, **labels: str) -> float:
    """The sum of the samples of *name* with these *labels* on a runtime's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class LeaseWatch:
    """Samples ``workflow_executions``: for each claim (id, epoch) its owner, when it was
    first seen and the latest expiry seen of the lease it runs under (its process's row in
    ``leases``, migration 0026), so a test can tell when a process's leases stopped being
    extended."""

    def __init__(self, dsn: str, schema: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        self._stmt = pgsql.SQL(
            "SELECT e.id, e.lease_epoch, e.lease_owner, l.expires_at "
            "FROM {s}.workflow_executions AS e JOIN {s}.leases AS l ON l.owner = e.lease_owner "
            "WHERE e.status = 'running'").format(s=pgsql.Identifier(schema))
        self.owner: dict[tuple[uuid.UUID, int], str] = {}
        self.last_expiry: dict[tuple[uuid.UUID, int], datetime] = {}
        self.first_seen: dict[tuple[uuid.UUID, int], float] = {}

    def sample(self) -> None:
        now = time.time()
        for eid, epoch, owner, expires in self._conn.execute(self._stmt).fetchall():
            key = (eid, epoch)
            self.owner[key] = owner
            self.first_seen.setdefault(key, now)
            if key not in self.last_expiry or expires > self.last_expiry[key]:
                self.last_expiry[key] = expires

    def held_by(self, pid: int, *, claimed_before: float = float("inf"),
                ) -> dict[tuple[uuid.UUID, int], float]:
        """The claims process *pid* held (first seen before *claimed_before*, wall clock),
        each with the last expiry seen (epoch seconds)."""
        return {k: self.last_expiry[k].timestamp() for k, owner in self.owner.items()
                if owner.rsplit(":", 2)[-2] == str(pid)  # host:pid:nonce
                and self.first_seen[k] < claimed_before}

    def close(self) -> None:
        self._conn.close()


def _as_role(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


@contextmanager
def least_privilege_role(dsn: str, schema: str) -> Iterator[str]:
    """FAULTS S4's runtime role: DML on the kestrel schema, USAGE on its sequences, no DDL
    (as in tests/integration/test_security.py). Yields a DSN that logs in as it."""
    role = f"kestrel_rt_{uuid.uuid4().hex[:8]}"
    s, r = pgsql.Identifier(schema), pgsql.Identifier(role)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(r))
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                               "{} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, r))
    try:
        yield _as_role(dsn, role)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
            conn.execute(pgsql.SQL("DROP ROLE {}").format(r))


def _finish_with_a_clean_runtime(dsn: str, schema: str, n: int, log: Path,
                                 procs: int = 1) -> None:
    """Every worker of a runtime with ``sweeper_round=crash`` dies at its first sweep round,
    before the round does anything: what its crashed workers held is finished by a runtime
    without the failpoint."""
    with runtime(dsn, schema, procs=procs, log=log):
        wait_until(lambda: finished_count(dsn, schema) == n, timeout=90,
                   what="every workflow, finished by a runtime without the failpoint")


# -- L1 ---------------------------------------------------------------------------------------

def test_l1a_a_crashing_service_ends_its_worker_and_the_supervisor_restarts_it(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """The sweeper raises at its first round (``sweeper_round=crash``): that worker process
    exits non-zero within about a second and the supervisor forks another, which works.
    Every worker of this runtime does the same at its own first sweep (1-2 s after start)."""
    slow, quick = 16, 40
    # The first worker claims all 16 and is still in their 3 s step when its sweeper crashes.
    # The supervisor re-queues them at once (O8) and the next worker, which crashes too,
    # claims them again: each crash is an attempt, so after two they are suspects, which a
    # process takes one at a time (F9's guard) and the clean runtime finishes at the end.
    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 3.0)", slow)
    port = free_port()
    log = tmp_path / "crashing.log"
    with runtime(pg_dsn, schema, procs=1, log=log,
                 args=["--sweep-interval", "2", "--metrics-port", str(port),
                       "--concurrency", "64"],  # the bound on bodies run again, below
                 env={"KESTREL_FAILPOINTS": "sweeper_round=crash:1"}) as rt:
        fired = wait_until(lambda: events(log, "failpoint sweeper_round fired"), timeout=60,
                           what="the sweeper's crash")[0]
        victim = fired.pid
        exited = wait_until(lambda: exit_of(log, victim), timeout=30,
                            what=f"worker {victim} to exit after its sweeper crashed")
        assert "exit code 1" in exited.msg, exited.msg  # non-zero: a crash, not a stop
        assert exited.t - fired.t <= EXIT_WITHIN, (
            f"worker {victim} exited {exited.t - fired.t:.2f}s after its sweeper crashed")
        assert events(log, "worker service sweeper crashed; the worker exits", pid=victim)
        # The supervisor restarts the slot: a new process, which claims and finishes work.
        restarted = wait_until(lambda: [p for p in worker_pids(rt.pid) if p != victim],
                               timeout=30, what="the supervisor to fork a new worker")[0]
        assert events(log, f"started worker {restarted} (slot 0)")
        assert metric(port, "kestrel_worker_restarts_total") >= 1
        submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i + 1000)", quick)
        wait_until(lambda: finished_count(pg_dsn, schema) >= 1, timeout=30,
                   what="a restarted worker to finish an execution")
    n = slow + quick
    assert not alive(victim)
    crashes = len(events(log, "failpoint sweeper_round fired"))
    # Every worker that died, died of its sweeper (and nothing else ended a worker).
    for e in events(log, " exited (exit code"):
        if "restarting in" in e.msg:
            pid = int(e.msg.split()[1])
            assert events(log, "worker service sweeper crashed", pid=pid), e.msg
    _finish_with_a_clean_runtime(pg_dsn, schema, n, tmp_path / "clean.log", procs=2)
    # One checkpoint per step, every result the model's; a crash re-runs at most the bodies
    # that were in flight in the worker it ended (concurrency 64).
    assert audit(pg_dsn, schema, n, ledger_path) <= 64 * crashes


def test_l1b_upkeep_without_ddl_rights_stands_down_and_a_later_service_death_still_ends_the_worker(
    direct_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """Under the least-privilege role (S4) upkeep must create history partitions
    (--history-ahead 6) and may not: it stands down, logs that it needs the owner's rights,
    and stays alive - no worker exits for it. Later (the first sweep comes 1.5-3 s after
    start, upkeep's round 0.1-0.2 s) the sweeper crashes: that still ends the worker. Before
    the fix the stood-down upkeep *returned*, which used up the worker's only wait for a
    service to end, and the sweeper's later death left a worker running without it."""
    n = 60
    # Their middle step ends about 0.5 s after the start: after upkeep stood down.
    submit_many(direct_dsn, schema, "slow_middle", "jsonb_build_array(i, 0.5)", n)
    port = free_port()
    log = tmp_path / "restricted.log"
    args = ["--maintenance-interval", "0.2", "--history-ahead", "6", "--sweep-interval", "3",
            "--metrics-port", str(port), "--concurrency", "64"]  # the bound below
    with least_privilege_role(direct_dsn, schema) as runtime_dsn:
        with psycopg.connect(runtime_dsn, autocommit=True) as conn, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):  # no DDL for this role
            conn.execute(pgsql.SQL("CREATE TABLE {}.intruder (x int)").format(
                pgsql.Identifier(schema)))
        with runtime(runtime_dsn, schema, procs=1, log=log, args=args,
                     env={"KESTREL_FAILPOINTS": "sweeper_round=crash:1"}) as rt:
            # (The CLI says so too, once, at start; these are the workers' upkeep services.)
            stood = wait_until(lambda: events(log, UPKEEP_STANDS_DOWN, logger="kestrel.worker"),
                               timeout=60, what="upkeep to stand down")[0]
            first = stood.pid
            fired = wait_until(lambda: events(log, "failpoint sweeper_round fired", pid=first),
                               timeout=30, what="the sweeper's crash")[0]
            assert stood.t < fired.t  # upkeep had stood down before the sweeper died ...
            # ... and the worker lived on with it stood down, doing work, until then.
            assert [e for e in app.read_ledger(ledger_path, kind="body", pid=first)
                    if stood.t < e["t"] < fired.t], "no work done with upkeep stood down"
            exited = wait_until(lambda: exit_of(log, first), timeout=30,
                                what=f"worker {first} to exit after its sweeper crashed "
                                     "(upkeep had stood down before)")
            assert "exit code 1" in exited.msg, exited.msg
            assert exited.t - fired.t <= EXIT_WITHIN, (
                f"worker {first} exited {exited.t - fired.t:.2f}s after its sweeper crashed")
            assert events(log, "worker service sweeper crashed; the worker exits", pid=first)
            second = wait_until(lambda: [p for p in worker_pids(rt.pid) if p != first],
                                timeout=30, what="the supervisor to fork a new worker")[0]
            # The new worker stands down too (and lives on until its own sweeper crashes).
            wait_until(lambda: events(log, UPKEEP_STANDS_DOWN, pid=second), timeout=30,
                       what="the new worker's upkeep to stand down")
            assert metric(port, "kestrel_worker_restarts_total") >= 1
        text = log.read_text()
        assert "worker service upkeep" not in text  # upkeep never returned nor crashed
        assert "worker service sweeper crashed" in text
        # Every worker exit of this runtime is a sweeper's crash, none upkeep's stand-down.
        for e in events(log, " exited (exit code"):
            if "restarting in" in e.msg:
                pid = int(e.msg.split()[1])
                assert events(log, "worker service sweeper crashed", pid=pid), e.msg
        crashes = len(events(log, "failpoint sweeper_round fired"))
        _finish_with_a_clean_runtime(runtime_dsn, schema, n, tmp_path / "clean.log")
    assert audit(direct_dsn, schema, n, ledger_path) <= 64 * crashes


# -- L2 ---------------------------------------------------------------------------------------

@dataclass
class Stall:
    runtime: subprocess.Popen[bytes]  # runtime A, still running
    pid: int  # A's worker that stalled
    began: float  # when its failpoint fired (wall clock)
    watch: LeaseWatch
    port: int  # A's metrics
    log: Path  # A's log
    rescuer_log: Path  # B's log


@contextmanager
def stall_and_recover(pg_dsn: str, schema: str, n: int, failpoint: str,
                      tmp_path: Path) -> Iterator[Stall]:
    """Run runtime A (one worker, *failpoint*, metrics on a port) on *n* submitted
    executions; when the failpoint fires start runtime B, and sample the leases until every
    execution has finished. Stops B then; A runs until the block ends."""
    port = free_port()
    log_a, log_b = tmp_path / "stalled.log", tmp_path / "rescuer.log"
    with open(log_a, "ab") as out_a, open(log_b, "ab") as out_b:
        watch = LeaseWatch(pg_dsn, schema)
        a = start_runtime(pg_dsn, schema, procs=1, args=["--metrics-port", str(port)],
                          env={"KESTREL_FAILPOINTS": failpoint}, out=out_a)
        b = None
        try:
            deadline = time.monotonic() + 120
            fired: list[Event] = []
            while finished_count(pg_dsn, schema) < n:
                assert time.monotonic() < deadline, "the executions did not finish in 120 s"
                watch.sample()
                if not fired:
                    fired = events(log_a, "failpoint ")
                    if fired:
                        b = start_runtime(pg_dsn, schema, procs=1, out=out_b)
                time.sleep(0.1)
            assert fired, "the executions finished without the failpoint firing"
            if b is not None:
                stop_runtime(b)
            yield Stall(a, fired[0].pid, fired[0].t, watch, port, log_a, log_b)
        finally:
            if b is not None:
                stop_runtime(b)
            stop_runtime(a)
            watch.close()


def held_at_stall(st: Stall) -> dict[tuple[uuid.UUID, int], float]:
    """The claims the stalled worker held when it stalled. (Claims it took during the first
    lease of the stall count too; no lease of it can have expired then, so none of these is
    a re-claim of its own recovered work.)"""
    return st.watch.held_by(st.pid, claimed_before=st.began + LEASE)


def assert_leases_stopped_and_work_recovered(pg_dsn: str, schema: str, st: Stall) -> None:
    held = held_at_stall(st)
    assert held, f"worker {st.pid} held no lease when it stalled"
    for (eid, epoch), expiry in held.items():
        # The last extension was sent at expiry - LEASE: within about a lease of the stall.
        extended_for = expiry - LEASE - st.began
        assert extended_for <= STOP_EXTENDING_WITHIN, (
            f"worker {st.pid} kept extending the lease of {eid} (epoch {epoch}) for "
            f"{extended_for:.1f}s into its stall")
        # Recovered: finished under a later claim than the stuck worker's.
        done = q(pg_dsn, schema, "SELECT status, lease_epoch FROM {s}.workflow_history "
                 "WHERE id = %s", [eid])
        assert done and done[0][0] == "completed" and done[0][1] > epoch, (eid, epoch, done)
    swept = events(st.rescuer_log, "sweeper re-enqueued") + events(st.log, "sweeper re-enqueued")
    assert swept, "no sweeper requeued the stalled worker's executions"


def test_l2a_an_event_loop_stalled_past_the_lease_stops_extending_its_leases(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """``before_complete=sleep(8)`` blocks runtime A's event loop for 8 s (four leases) in its
    first completion flush, while its heartbeat thread lives and every one of its
    executions waits on that loop. Its leases stop moving within about a lease, runtime B's
    sweeper requeues them and B completes them; A counts the stall, and what A writes after
    it wakes is fenced."""
    n = 6
    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 1.0)", n)
    with stall_and_recover(pg_dsn, schema, n, "before_complete=sleep(8)", tmp_path) as st:
        assert_leases_stopped_and_work_recovered(pg_dsn, schema, st)
        assert events(st.log, "not extending leases: the event loop has not run for",
                      pid=st.pid), "the stall was not logged"
        assert metric(st.port, "kestrel_stalls_total") >= 1
        # A wakes 8 s in: its blocked completion (old epoch) and heartbeat are fenced, and
        # the process lives on (a stall is not a crash).
        wait_until(lambda: labelled(st.port, "kestrel_fenced_writes_total",
                                    kind="completion") >= 1, timeout=30,
                   what="the stalled worker's late completion to be fenced")
        assert st.pid in worker_pids(st.runtime.pid)
    # Every body that ran more than once ran first in the stalled worker (its checkpoint or
    # completion fenced); the rescuer never ran one twice.
    mine = app.read_ledger(ledger_path, kind="body", pid=st.pid)
    assert audit(pg_dsn, schema, n, ledger_path) <= len(mine)


def test_l2b_a_stalled_writer_stops_extending_leases_and_its_late_writes_are_fenced(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """``before_checkpoint_commit=hang(10)`` suspends runtime A's first checkpoint flush for
    10 s (five leases) while A's event loop runs on: every execution of A waits on that
    writer. A stops extending its leases within about a lease, runtime B recovers and
    completes the executions, and A's hung batch, sent when it wakes, is fenced: exactly one
    checkpoint per (execution, step), none of them A's."""
    n = 20
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", n)
    failpoint = "before_checkpoint_commit=hang(10)"
    with stall_and_recover(pg_dsn, schema, n, failpoint, tmp_path) as st:
        assert_leases_stopped_and_work_recovered(pg_dsn, schema, st)
        assert events(st.log, "not extending leases: the checkpoint writer has made no "
                      "progress", pid=st.pid), "the writer's stall was not logged"
        assert metric(st.port, "kestrel_stalls_total") >= 1
        # A's hung batch goes out 10 s in, under A's epochs: every row of it is fenced.
        wait_until(lambda: labelled(st.port, "kestrel_fenced_writes_total",
                                    kind="checkpoint") >= 1, timeout=30,
                   what="the stalled writer's batch to be fenced")
        assert st.pid in worker_pids(st.runtime.pid)
        held = held_at_stall(st)
    recorded = q1(pg_dsn, schema, "SELECT count(*) FROM {s}.step_history WHERE "
                  "(execution_id, lease_epoch) IN (SELECT * FROM unnest(%s::uuid[], "
                  "%s::int[]))", [[eid for eid, _ in held], [e for _, e in held]])
    assert recorded == 0, f"{recorded} checkpoints written under the stalled worker's claims"
    # Under those claims the stalled worker never started a step after the one it could not
    # checkpoint.
    epochs = {e for _, e in held}
    assert {e["step_id"] for e in app.read_ledger(ledger_path, pid=st.pid)
            if e["epoch"] in epochs} <= {0}
    mine = app.read_ledger(ledger_path, kind="body", pid=st.pid)
    assert audit(pg_dsn, schema, n, ledger_path) <= len(mine)  # A's bodies, run again by B


def test_l2b_a_worker_whose_writer_is_stalled_takes_no_fresh_lease(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """FAULTS L2, "never a fresh lease on stuck work": once runtime A's watchdog has seen
    its checkpoint writer make no progress for a lease (``before_checkpoint_commit=hang``),
    work submitted after that is not claimed by A (whose every execution would only wait
    on the stalled writer), and is run by runtime B."""
    log = tmp_path / "stalled.log"
    submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 1)
    with runtime(pg_dsn, schema, procs=1, log=log,
                 env={"KESTREL_FAILPOINTS": "before_checkpoint_commit=hang(10)"}):
        stall = wait_until(lambda: events(log, "not extending leases: the checkpoint writer"),
                           timeout=60, what="the writer's stall to be noticed")[0]
        submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i + 100)", 5)
        time.sleep(2.0)  # ten poll intervals (and LISTEN wakes a claimer at once)
        taken = q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions WHERE "
                   "(args->>0)::int > 100 AND lease_owner LIKE %s", [f"%:{stall.pid}:%"])
        assert taken == 0, f"the stalled worker claimed {taken} of 5 new executions"
        with runtime(pg_dsn, schema, procs=1, log=tmp_path / "rescuer.log"):
            wait_until(lambda: finished_count(pg_dsn, schema) == 6, timeout=60,
                       what="every execution, run by the healthy runtime")
    assert audit(pg_dsn, schema, 6, ledger_path) <= 1  # the stalled worker's first body


# -- F8, seen from L2's side -------------------------------------------------------------------

def test_f8_a_loop_blocked_for_three_heartbeats_under_the_lease_keeps_its_lease(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    """FAULTS F8 with its own numbers: the step blocks its worker's event loop for three
    heartbeat periods (1.5 s), less than the 2 s lease. The heartbeat thread keeps the lease
    (the L2 watchdog only gives up on a loop silent for a whole lease): nobody re-claims it
    and the body runs once. One execution only: two in one process would block its loop
    one after the other, for twice as long."""
    from kestrel.client import SyncClient

    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log = tmp_path / "rt.log"
    with runtime(pg_dsn, schema, procs=1, log=log):
        h = client.submit(app.hog, 3 * HEARTBEAT)
        assert client.result(h.id, timeout=30) == 1
    kinds = [e["kind"] for e in app.read_ledger(ledger_path, execution_id=str(h.id))]
    assert kinds == ["start", "body"]  # B(s) = 1, no overlap
    assert client.get(h.id).attempts == 1  # never requeued
    assert "not extending leases" not in log.read_text()  # the watchdog let it be


async def stopped(task: Any, timeout: float = 120.0) -> None:
    """Await a stopped worker's task; if it has not ended in *timeout* seconds, fail with
    the stack of every task still pending (a stop that hangs fails this test with where it
    hangs, instead of holding the run until its per-test timeout kills it whole)."""
    import asyncio
    import io

    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        out = io.StringIO()
        for pending in asyncio.all_tasks():
            if pending is not asyncio.current_task():
                pending.print_stack(file=out)
        import sys

        # Straight to the run's output too: should the pending tasks ignore the cancellation
        # asyncio.run sends them next, this is all a hung run would say.
        print(f"the worker did not stop in {timeout}s; pending tasks:\n{out.getvalue()}",
              file=sys.__stderr__, flush=True)
        raise AssertionError(f"the worker did not stop in {timeout}s; pending tasks:\n"
                             f"{out.getvalue()}") from None


# -- R3: no connection from the pool while the heartbeat's own connection works --------------

def test_r3_a_worker_whose_pool_gives_no_connection_stops_extending_and_says_so(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    """FAULTS R3 (issue 22, row 8): worker A runs in this process; once its executions are
    in their slow step the test takes every connection of A's pool (what six ctx.signal()
    calls blocked by a client's lock did). A's heartbeat has a connection of its own and
    works, but A's checkpoint writer cannot get one: the watchdog counts that as a stall,
    A stops extending its leases and runtime B takes the work over; the log says "no
    connection", never "database unreachable". Before the fix a pool timeout counted as an
    outage and the writer as backing off: A kept every lease fresh, and nothing moved."""
    import asyncio
    import logging

    from kestrel.worker import Worker
    from kestrel.workflow import registry
    from tests.helpers import config

    n = 4
    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 2.0)", n)
    caplog.set_level(logging.INFO, logger="kestrel")

    def said(needle: str) -> bool:
        return any(needle in r.getMessage() for r in caplog.records)

    async def until(predicate: Callable[[], object], what: str, timeout: float = 60) -> None:
        await asyncio.to_thread(wait_until, predicate, timeout=timeout, interval=0.1, what=what)

    async def main() -> set[tuple[uuid.UUID, int]]:
        worker = Worker(config(schema, pool_size=2), registry(), dsn=pg_dsn)
        task = asyncio.create_task(worker.run())
        try:
            await until(lambda: len(app.read_ledger(ledger_path, kind="start")) == n,
                        "every execution in its slow step")
            mine = {h.key for h in worker.leases}
            assert len(mine) == n
            pool = worker._pool
            held = [await pool.getconn(timeout=30) for _ in range(2)]
            try:
                await until(lambda: said("not extending leases"), "the stall to be noticed")
                with (tmp_path / "rescuer.log").open("ab") as out:
                    rescuer = start_runtime(pg_dsn, schema, procs=1, out=out)
                    try:
                        await until(lambda: finished_count(pg_dsn, schema) == n,
                                    "runtime B to finish the work")
                    finally:
                        stop_runtime(rescuer)
            finally:
                for conn in held:
                    await pool.putconn(conn)
        finally:
            worker.stop(drain_timeout=0)
            await stopped(task)
        return mine

    mine = asyncio.run(main())
    stall = [r.getMessage() for r in caplog.records if "not extending leases" in r.getMessage()]
    assert "the checkpoint writer has made no progress" in stall[0]
    assert "no connection" in stall[0]
    assert said("no connection from the pool")
    assert not said("database unreachable")
    done = dict(q(pg_dsn, schema, "SELECT id, lease_epoch FROM {s}.workflow_history "
                  "WHERE status = 'completed'"))
    assert all(done[eid] > epoch for eid, epoch in mine)  # finished by B's later claims
    # A wrote nothing past its first step under its claims: its slow step's checkpoint
    # never got a connection, and was dropped once its lease was no longer trusted.
    recorded = q(pg_dsn, schema, "SELECT execution_id, lease_epoch, step_id FROM "
                 "{s}.step_history")
    assert {s for eid, epoch, s in recorded if (eid, epoch) in mine} == {0}
