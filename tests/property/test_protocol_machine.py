"""The protocol machine (FAULTS.md): simulated workers, one protocol action per rule.

Real runtime statements against a real PostgreSQL, but each rule is one step of the
protocol — claim, run a step body, checkpoint (optionally losing the commit's reply),
heartbeat, complete, crash, sweep, move the database clock — so Hypothesis controls the
interleavings and shrinks failures to a handful of actions. A pure-Python model says what
must hold after every action.

Profiles: ``ci`` (default, derandomized, minutes) and ``soak``
(``KESTREL_HYPOTHESIS_PROFILE=soak``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)
from psycopg import sql as pgsql

from kestrel import codec, connections, db, statements
from kestrel.client import SyncClient
from kestrel.errors import IdempotencyConflict
from kestrel.sql import queries
from kestrel.types import Finish, Status, StepWrite

STEPS = 3
LEASE = 30.0
MAX_ATTEMPTS = 3

settings.register_profile(
    "ci", max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile(
    "soak", max_examples=300, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def step_output(n: int, k: int) -> int:
    return n * 10 + k


def model_result(n: int) -> int:
    return sum(step_output(n, k) for k in range(STEPS))


@dataclass
class SimWorker:
    name: str
    eid: uuid.UUID | None = None
    epoch: int = 0
    n: int = 0
    recorded: dict[int, Any] = field(default_factory=dict)
    pending: tuple[int, int] | None = None  # (step, output) computed but not recorded

    def next_step(self) -> int | None:
        for k in range(STEPS):
            if k not in self.recorded:
                return k
        return None


class ProtocolMachine(RuleBasedStateMachine):
    workers = Bundle("workers")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()

    @initialize()
    def setup(self) -> None:
        self.dsn, self.schema = DB["dsn"], DB["schema"]
        self.q = queries(self.schema)
        self.conn = self.loop.run_until_complete(psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, prepare_threshold=None))
        connections.configure_connection(self.conn)
        self.sql(
            "TRUNCATE {s}.workflow_executions, {s}.operation_outputs, {s}.workflow_history,"
            " {s}.idempotency_keys, {s}.signals, {s}.events,"
            " {s}.signal_history, {s}.event_history")
        self.sql("UPDATE {s}.clock_offset SET offset_by = '0'")
        self.client = SyncClient(self.dsn, schema=self.schema, pool_size=0)
        self.args: dict[uuid.UUID, int] = {}
        self.keys: dict[str, tuple[uuid.UUID, int]] = {}
        self.first: dict[tuple[uuid.UUID, int], Any] = {}
        self.max_epoch: dict[uuid.UUID, int] = {}
        self.finished: dict[uuid.UUID, tuple[str, Any]] = {}
        self.body_runs: dict[tuple[uuid.UUID, int], int] = {}
        self.lost_attempts: dict[tuple[uuid.UUID, int], int] = {}
        self.counter = 0

    def teardown(self) -> None:
        try:
            if hasattr(self, "conn"):
                self.drain_and_check()
        finally:
            if hasattr(self, "conn"):
                self.loop.run_until_complete(self.conn.close())
            self.loop.close()

    # -- helpers --------------------------------------------------------------------------

    def sql(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        stmt = pgsql.SQL(text).format(s=pgsql.Identifier(self.schema))  # type: ignore[arg-type]
        cur = self.loop.run_until_complete(self.conn.execute(stmt, params))
        return self.loop.run_until_complete(cur.fetchall()) if cur.description else []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def lose(self, w: SimWorker) -> None:
        """The worker's attempt is gone: whatever it was computing may run again."""
        if w.eid is not None:
            k = w.next_step()
            if k is not None:
                key = (w.eid, k)
                self.lost_attempts[key] = self.lost_attempts.get(key, 0) + 1
        w.eid, w.pending, w.recorded = None, None, {}
        # As a worker process whose lease ran out does (kestrel.lease.Heartbeat): a new name,
        # whose lease its next claim makes (a lease that ran out is never extended again).
        w.name += "~"

    # -- rules ----------------------------------------------------------------------------

    @rule(n=st.integers(-50, 50), key=st.sampled_from(["k0", "k1", None]))
    def submit(self, n: int, key: str | None) -> None:
        if key is not None and key in self.keys:
            eid, first_n = self.keys[key]
            if n != first_n:
                with pytest.raises(IdempotencyConflict):
                    self.client.submit("fold", n, idempotency_key=key)
                return
            assert self.client.submit("fold", n, idempotency_key=key).id == eid  # I6
            return
        eid = self.client.submit("fold", n, idempotency_key=key).id
        self.args[eid] = n
        if key is not None:
            self.keys[key] = (eid, n)

    @rule(target=workers)
    def start_worker(self) -> SimWorker:
        self.counter += 1
        return SimWorker(f"w{self.counter}")

    @rule(w=workers)
    def claim(self, w: SimWorker) -> None:
        if w.eid is not None:
            return
        got = self.run(
            db.run(
                self.conn,
                statements.executions.claim_batch(
                    self.q, owner=w.name, queues=["default"], limit=1, lease_s=LEASE
                ),
            )
        )
        if not got:
            return
        c = got[0]
        assert c.epoch > self.max_epoch.get(c.id, 0)  # I2: epochs only grow
        if c.id in self.max_epoch:
            # A re-claim: whatever the previous holder was running is a lost attempt (it
            # may still finish its body as a zombie, but can no longer record it).
            nxt = next((k for k in range(STEPS) if k not in c.steps), None)
            if nxt is not None:
                key = (c.id, nxt)
                self.lost_attempts[key] = self.lost_attempts.get(key, 0) + 1
        self.max_epoch[c.id] = c.epoch
        w.eid, w.epoch, w.n = c.id, c.epoch, c.args[0]
        w.recorded = {k: s.output for k, s in c.steps.items()}
        for k, out in w.recorded.items():
            assert out == self.first[(c.id, k)]  # a replay reads what was recorded first

    @rule(w=workers)
    def run_body(self, w: SimWorker) -> None:
        k = w.next_step() if w.eid is not None else None
        if k is None or w.pending is not None:
            return
        assert w.eid is not None
        self.body_runs[(w.eid, k)] = self.body_runs.get((w.eid, k), 0) + 1
        # I4: a body runs again only after an attempt at it was lost.
        assert self.body_runs[(w.eid, k)] <= 1 + self.lost_attempts.get((w.eid, k), 0)
        w.pending = (k, step_output(w.n, k))

    @rule(w=workers, lose_ack=st.booleans())
    def checkpoint(self, w: SimWorker, lose_ack: bool) -> None:
        if w.eid is None or w.pending is None:
            return
        k, out = w.pending
        write = StepWrite(w.eid, w.epoch, k, "add", str(out), None, 1, 0.0)
        (saved,) = self.run(db.run(self.conn, statements.steps.save_steps(self.q, [write])))
        current = self.sql("SELECT lease_epoch, status FROM {s}.workflow_executions "
                           "WHERE id = %s", [w.eid])
        holds = bool(current) and current[0] == (w.epoch, "running")
        if not saved.owned:
            # I3: refused only when the claim is no longer current (finished, requeued by
            # the sweeper, or superseded by a newer epoch).
            assert not holds
            self.lose(w)
            return
        # I3: a write is accepted only from the current claim's holder.
        assert holds, "a write from a claim that is no longer current was accepted"
        key = (w.eid, k)
        if saved.inserted:
            # Written by this statement: it comes back without its value, which is what
            # jsonb stores of what was sent. A position recorded before is never written again.
            assert key not in self.first, "I1: a recorded checkpoint was written again"
            output = codec.stored(write.output or "null")
        else:
            assert saved.recorded is not None
            output = saved.recorded.output
        if key in self.first:
            assert output == self.first[key]  # I1: the first write wins
        else:
            assert saved.inserted
            self.first[key] = output
        if lose_ack:
            return  # committed, reply lost: the worker retries the same write later
        w.recorded[k] = output
        w.pending = None

    @rule(w=workers)
    def heartbeat(self, w: SimWorker) -> None:
        if w.eid is None:
            return
        owned = self.run(
            db.run_script(
                self.conn,
                statements.executions.heartbeat(self.q, owner=w.name, held=[(w.eid, w.epoch)],
                                                lease_s=LEASE),
            )
        ).owned
        if w.eid not in owned:
            self.lose(w)

    @rule(w=workers)
    def complete(self, w: SimWorker) -> None:
        if w.eid is None or w.next_step() is not None:
            return
        result = sum(w.recorded.values())
        done = self.run(db.run(self.conn, statements.executions.complete_batch(self.q, [Finish(
            w.eid, w.epoch, Status.COMPLETED, str(result), None)])))
        if w.eid in done:
            assert w.eid not in self.finished  # I5: one terminal transition
            assert result == model_result(self.args[w.eid])
            self.finished[w.eid] = ("completed", result)
            w.eid, w.recorded = None, {}
        else:
            self.lose(w)

    @rule(w=consumes(workers))
    def crash(self, w: SimWorker) -> None:
        self.lose(w)

    @rule(seconds=st.sampled_from([1, 10, 31, 120]))
    def advance_time(self, seconds: int) -> None:
        self.sql("UPDATE {s}.clock_offset SET offset_by = offset_by + make_interval(secs => %s)",
                 [seconds])

    @rule()
    def lease_expires(self) -> None:
        """Time passes beyond every lease and the sweeper runs: whoever held one is now a
        zombie candidate (its state kept, its epoch about to be superseded)."""
        self.advance_time(int(LEASE) + 1)
        self.sweep()

    @rule(w=workers, lose_ack=st.booleans())
    def step_and_checkpoint(self, w: SimWorker, lose_ack: bool) -> None:
        self.run_body(w)
        self.checkpoint(w, lose_ack)

    @rule(w=workers, lose_ack=st.booleans())
    def zombie_write(self, w: SimWorker, lose_ack: bool) -> None:
        """FAULTS' zombie: w's lease lapses (only w's row, by the database clock), the
        sweeper requeues it, a fresh worker claims it under the next epoch, and then w —
        which never noticed — runs its step and tries to record it."""
        if w.eid is None:
            return
        self.sql("UPDATE {s}.workflow_executions SET lease_expires_at = "
                 "{s}.kestrel_now() - interval '1 second' WHERE id = %s AND status = 'running'",
                 [w.eid])
        self.sweep()
        for _ in range(50):  # claim until the requeued execution is taken again
            self.counter += 1
            other = SimWorker(f"w{self.counter}")
            self.claim(other)
            if other.eid is None or other.eid == w.eid:
                break
        self.run_body(w)
        self.checkpoint(w, lose_ack)

    @rule()
    def sweep(self) -> None:
        r = self.run(db.run(self.conn, statements.sweeper.reenqueue_expired(self.q, limit=100,
                                          max_attempts=MAX_ATTEMPTS)))
        assert r.examined >= r.requeued + r.quarantined

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def checkpoints_immutable_and_unique(self) -> None:
        if not hasattr(self, "conn"):
            return
        rows = self.sql("SELECT execution_id, step_id, output, count(*) OVER "
                        "(PARTITION BY execution_id, step_id) FROM {s}.workflow_steps")
        for eid, k, out, n in rows:
            assert n == 1
            assert out == self.first[(eid, k)] == step_output(self.args[eid], k)

    @invariant()
    def terminal_states_never_change(self) -> None:
        if not hasattr(self, "conn"):
            return
        rows = dict((r[0], (r[1], r[2])) for r in self.sql(
            "SELECT id, status, result FROM {s}.workflow_history"))
        for eid, (status, result) in self.finished.items():
            assert rows[eid] == (status, result)
        live = {r[0] for r in self.sql("SELECT id FROM {s}.workflow_executions")}
        assert not live & set(rows)  # exactly one place

    @invariant()
    def one_live_owner(self) -> None:
        if not hasattr(self, "conn"):
            return
        # Live: under a lease of its own not yet passed, or (migration 0026) under its
        # process's lease, not yet run out.
        rows = self.sql("SELECT e.id, e.lease_epoch FROM {s}.workflow_executions AS e "
                        "LEFT JOIN {s}.leases AS l ON l.owner = e.lease_owner "
                        "WHERE e.status = 'running' AND (e.lease_expires_at > {s}.kestrel_now() "
                        "OR (e.lease_expires_at IS NULL AND l.expires_at > {s}.kestrel_now()))")
        for eid, epoch in rows:
            assert self.max_epoch[eid] == epoch

    # -- liveness at the end --------------------------------------------------------------

    def drain_and_check(self) -> None:
        self.advance_time(10_000)
        self.sweep()
        closer = SimWorker("closer")
        for _ in range(10_000):
            self.claim(closer)
            if closer.eid is None:
                break
            while closer.eid is not None and closer.next_step() is not None:
                self.run_body(closer)
                self.checkpoint(closer, False)
            if closer.eid is not None:
                self.complete(closer)
        hot = self.sql("SELECT count(*) FROM {s}.workflow_executions")[0][0]
        assert hot == 0, "an execution was left behind"
        for eid, status, result, attempts in self.sql(
                "SELECT id, status, result, attempts FROM {s}.workflow_history"):
            if status == "quarantined":
                assert attempts >= MAX_ATTEMPTS
            else:
                assert (status, result) == ("completed", model_result(self.args[eid]))


DB: dict[str, str] = {}


@pytest.fixture
def protocol_db(pg_dsn: str, schema: str) -> None:
    DB.update(dsn=pg_dsn, schema=schema)


@pytest.mark.usefixtures("protocol_db")
class TestProtocol(ProtocolMachine.TestCase):  # type: ignore[name-defined,misc]
    settings = settings.get_profile(
        "soak" if os.environ.get("KESTREL_HYPOTHESIS_PROFILE") == "soak" else "ci")

