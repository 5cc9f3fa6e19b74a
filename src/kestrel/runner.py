"""The runner: runs one execution and maps every way it can end to exactly one action.

A claimed execution becomes a task under its :class:`~kestrel.lease.Lease`. Its workflow
runs with a :class:`~kestrel.workflow.Context` whose every database call goes through this
module (the ``Writer`` protocol): checkpoints and completions through their group commits
(:mod:`kestrel.commits`, which own those statements), waits and signals as single fenced
statements. When the workflow ends, :meth:`Runner._outcome` turns what happened — a result,
an error, a park, a cancel, a lost lease, a passed deadline, a refused write — into one
action: a Finish to commit, or nothing (parked, or dropped for the owner of a newer epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from psycopg_pool import AsyncConnectionPool

from kestrel import codec, connections, db, metrics, tracing
from kestrel.buckets import bucket_of
from kestrel.commits import CheckpointCommits, Completions
from kestrel.config import Config
from kestrel.db import AnyConn
from kestrel.definitions import retired_patches
from kestrel.errors import (
    Cancelled,
    CodeTooOld,
    DeadlineExceeded,
    KestrelError,
    LeaseLost,
    UnknownWorkflow,
    WriteRejected,
)
from kestrel.failpoints import afailpoint, failpoint
from kestrel.lease import Lease, Leases
from kestrel.loops import Backoff
from kestrel.outage import OUTAGE
from kestrel.sql import Queries
from kestrel.statements import client, executions, steps
from kestrel.types import (
    Claimed,
    Finish,
    RecordedStep,
    SignalTaken,
    Status,
    StepSaved,
    StepWrite,
)
from kestrel.workflow import Context, WorkflowFn, describe_error
from kestrel.workflow.waits import Park

log = logging.getLogger("kestrel.worker")

Out = TypeVar("Out")

GIVE_BACK_BASE_S = 1.0
GIVE_BACK_CAP_S = 60.0
"""A give-back (CodeTooOld) makes the execution wait ``min(cap, base * 2**n)`` seconds after
its n-th earlier give-back before a worker of another version may claim it (the version that
gave it back never does again): a fleet of several old versions cannot pass it around in a
loop, and a newer worker deployed later waits at most the cap."""

FLUSHES_IN_FLIGHT = 1
"""Group commits each writer keeps on their way at once (:class:`GroupCommit`'s in_flight).
Two and three were measured against one on the 2-core VM (BENCHMARKS.md, issue 16): no
difference in throughput, CPU or commits per workflow showed above the shared machine's
noise, so the writers keep one until a machine with idle cores shows a gain."""


@dataclass
class WorkerStats:
    """What one worker process did, for its last log line and for tests."""

    claimed: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    fenced: int = 0
    parked: int = 0
    released: int = 0
    claims: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Runner:
    """Runs claimed executions; the ``Writer`` every Context talks to."""

    def __init__(self, cfg: Config, workflows: dict[str, WorkflowFn], *,
                 pool: AsyncConnectionPool[Any], q: Queries, leases: Leases,
                 executor: Executor, stats: WorkerStats, worker_id: str,
                 stopping: asyncio.Event, slot_freed: asyncio.Event,
                 namespace: list[Queries] | None = None) -> None:
        self.cfg = cfg
        self.id = worker_id
        self._workflows = workflows
        self._pool = pool
        self._q = q
        # The schemas of this worker's namespace by bucket (kestrel.buckets): a signal to
        # another execution goes to the bucket its id names. [q] for an ordinary schema.
        self._namespace = namespace or [q]
        self.leases = leases
        self._executor = executor
        self.stats = stats
        self._stopping = stopping
        self._slot_freed = slot_freed
        # The group commits, each owning its statement; the worker runs them as services.
        self.checkpoints = CheckpointCommits(pool, q, leases, in_flight=FLUSHES_IN_FLIGHT)
        self.completions = Completions(pool, q, leases, in_flight=FLUSHES_IN_FLIGHT)
        # Workflow calls (_with_retries) waiting for a pool connection, and since when: the
        # lease watchdog reads them (no_connection_for), FAULTS R3.
        self._no_connection: dict[object, float] = {}

    def committed(self) -> int:
        """Checkpoints and completions this process's writers have committed so far: the
        work the adaptive concurrency limit measures (:mod:`kestrel.slots`)."""
        return self.checkpoints.writer.items + self.completions.writer.items

    # -- what a Context asks of its worker (kestrel.workflow.steps.Writer) --------------------

    async def save_step(self, write: StepWrite) -> StepSaved:
        """Checkpoint *write* in the next group commit; return what is now recorded."""
        return await self.checkpoints.writer.submit(write)

    async def _with_retries(self, lease: Lease, op: Callable[[AnyConn], Awaitable[Out]]) -> Out:
        """Run a workflow's own database call, retrying while the lease is still trusted: while
        the database is unreachable, the pool gives no connection, or the statement meets
        contention (a lock a client holds, a lock or statement timeout, a deadlock). The calls
        are fenced or idempotent, so a retry after a lost reply changes nothing twice. A
        statement the database refuses for what it says raises at once.

        Waiting for a pool connection counts for the lease watchdog (no_connection_for): the
        process's own connections are the trouble, and the work may move elsewhere."""
        backoff = Backoff()
        token = object()
        try:
            while True:
                started = time.monotonic()
                try:
                    async with self._pool.connection() as conn:
                        self._no_connection.pop(token, None)
                        return await op(conn)
                except Exception as exc:
                    pool = connections.is_pool_timeout(exc) and not OUTAGE.down
                    if pool:
                        self._no_connection.setdefault(token, started)
                    if not (connections.is_transient(exc) or connections.is_contended(exc)):
                        raise
                    if connections.is_transient(exc) or pool:
                        OUTAGE.failed(exc, "workflow call")
                    elif not backoff.failures:
                        log.warning("a database call of %s met contention (%s); retrying "
                                    "with backoff while its lease holds", lease.claimed.id,
                                    connections.sqlstate(exc))
                    if not lease.trusted():
                        raise LeaseLost(f"{connections.sqlstate(exc)} past the lease of "
                                        f"{lease.claimed.id}") from exc
                    await asyncio.sleep(backoff.next_delay())
        finally:
            self._no_connection.pop(token, None)

    def no_connection_for(self, now: float) -> float:
        """Seconds the longest-waiting workflow call has had no pool connection (0: none
        waits); *now* is ``time.monotonic()`` (safe to call from the heartbeat thread)."""
        return max([0.0, *(now - t for t in tuple(self._no_connection.values()))])

    async def park(self, lease: Lease, *, step_id: int, waiting_for: str,
                   seconds: float | None, seen_seq: int | None) -> str:
        """Park the execution at a wait; return parked, cancelled, signalled or lost.

        See :func:`kestrel.statements.executions.park`. The lease counts as finishing while
        the statement is on its way, and is held again unless it parked. Retried while the
        database is unreachable and the lease is trusted; past that it raises LeaseLost. If
        the workflow deadline passed meanwhile and the park found a signal (the workflow
        would go on), it raises CancelledError as the deadline timer would: the execution
        fails DeadlineExceeded.
        """
        lease.finish()  # a heartbeat that now misses the row is seeing our own park

        async def park(conn: AnyConn) -> str:
            await afailpoint("before_park")
            outcome = await db.run(conn, executions.park(
                self._q, id=lease.claimed.id, epoch=lease.claimed.epoch, step_id=step_id,
                waiting_for=waiting_for, seconds=seconds, seen_seq=seen_seq))
            await afailpoint("after_park_commit")
            return outcome

        outcome = "lost"
        try:
            outcome = await self._with_retries(lease, park)
        finally:
            if outcome != "parked":
                lease.unfinish()
        lease.ended = outcome == "parked"
        if outcome == "signalled" and lease.deadline_due:
            # The deadline passed while the park was on its way, and the park did not end the
            # claim (a signal had arrived): the workflow would go on past its deadline. It
            # ends here, as the deadline timer ends a running one (FAULTS O7).
            lease.deadline_hit = True
            raise asyncio.CancelledError("the workflow deadline passed during a park")
        return outcome

    async def consume_signal(self, lease: Lease, *, step_id: int, name: str,
                             step_name: str) -> SignalTaken:
        """Consume a pending signal into the wait's checkpoint; retried as :meth:`park` is
        (the statement is idempotent per position: a retry after a lost reply returns the
        checkpoint the first call recorded, never a second signal)."""
        c = lease.claimed

        async def consume(conn: AnyConn) -> SignalTaken:
            taken = await db.run(conn, steps.consume_signal(
                self._q, id=c.id, epoch=c.epoch, step_id=step_id, name=name, step_name=step_name))
            failpoint("after_consume_signal_commit", taken)
            return taken

        return await self._with_retries(lease, consume)

    async def load_step(self, lease: Lease, *, step_id: int) -> RecordedStep | None:
        """Read the checkpoint recorded at *step_id*; retried as :meth:`park` is."""
        return await self._with_retries(lease, lambda conn: db.run(conn, steps.load_step(
            self._q, execution_id=lease.claimed.id, step_id=step_id)))

    async def set_event(self, lease: Lease, key: str, value: str) -> bool:
        """Upsert an event value, fenced by the epoch; False if the lease is gone.

        Retried as :meth:`park` is.
        """
        c = lease.claimed
        return await self._with_retries(lease, lambda conn: db.run(conn, steps.set_event(
            self._q, id=c.id, epoch=c.epoch, key=key, value=value)))

    async def set_tags(self, lease: Lease, tags: str) -> bool:
        """Merge *tags* (a JSON object as text, None values removing) into the execution's
        tags, fenced by the epoch; False if the lease is gone. Retried as :meth:`park` is
        (the merge is idempotent)."""
        c = lease.claimed
        return await self._with_retries(lease, lambda conn: db.run(conn, steps.set_tags(
            self._q, id=c.id, epoch=c.epoch, tags=tags)))

    async def submit_child(self, lease: Lease, *, workflow: str, args: str, queue: str,
                           priority: int, key: str, timeout_s: float | None) -> uuid.UUID:
        """Submit a child of *lease*'s execution under idempotency key *key*; return its id.

        Retried as :meth:`park` is.
        """
        # The child continues this step's span when tracing is on; else submit() gives it
        # its parent's trace context (migration 0018).
        trace = tracing.current()
        params = client.submit_params(workflow=workflow, args=args, queue=queue,
                                      priority=priority, idempotency_key=key,
                                      parent=lease.claimed.id, timeout_s=timeout_s,
                                      traceparent=trace[0] if trace else None,
                                      tracestate=trace[1] if trace else None)
        child: uuid.UUID = await self._with_retries(
            lease, lambda conn: db.run(conn, client.submit(self._q, params)))
        return child

    async def send_signal(self, lease: Lease, execution_id: uuid.UUID, name: str,
                          payload: str | None, key: str) -> bool:
        """Deliver a signal to *execution_id* under idempotency key *key*.

        Returns False if that key was used already. Retried as :meth:`park` is.
        """
        ns = self._namespace
        q = ns[bucket_of(execution_id, len(ns))] if len(ns) > 1 else self._q
        return await self._with_retries(lease, lambda conn: db.run(conn, client.signal(
            q, id=execution_id, name=name, payload=payload, idempotency_key=key)))

    # -- running one execution ----------------------------------------------------------------

    def start(self, lease: Lease) -> None:
        """Hold *lease* and run its execution as a task (with its deadline timer)."""
        c = lease.claimed
        self.leases.add(lease)  # an older claim of the same id held here is lost (X5)
        lease.task = asyncio.create_task(self._execute(lease), name=f"execution-{c.id}")
        if c.deadline is not None and c.db_now is not None:
            left = (c.deadline - c.db_now).total_seconds()
            lease.deadline_timer = asyncio.get_running_loop().call_later(
                max(left, 0.0), self._deadline_passed, lease)

    def _deadline_passed(self, lease: Lease) -> None:
        if lease.task is None or lease.task.done():
            return
        if lease.finishing:
            # A completion already on its way wins over the deadline (FAULTS X6). A park on
            # its way may yet not end the claim: park() enforces the deadline then (O7).
            lease.deadline_due = True
            return
        lease.deadline_hit = True
        lease.task.cancel()

    async def _execute(self, lease: Lease) -> None:
        c = lease.claimed
        fn = self._workflows.get(c.workflow)
        attempt = tracing.start_attempt(c, self.id)  # None: tracing is off
        if attempt is not None:
            attempt.attach()
        ctx = Context(c, c.workflow, self, lease, self._executor, self.cfg.max_payload_bytes,
                      claimed_mono=lease.claimed_at,
                      retired_patches=retired_patches(fn) if fn is not None else frozenset(),
                      trace=attempt)
        try:
            finish = await self._outcome(ctx, lease)
            if finish is not None:
                await self._finish(lease, finish, attempt)
        except asyncio.CancelledError:
            if lease.lost or self._stopping.is_set():
                # lost: the new owner finishes it, or, if the row still runs under this
                # process's lease, the heartbeat gives it back; stopping: _drain releases it
                tracing.mark(attempt, "lost" if lease.lost else "released")
                return
            raise
        finally:
            if attempt is not None:
                attempt.end()
            if lease.deadline_timer is not None:
                lease.deadline_timer.cancel()
            if not lease.ended:
                # Ends here without a statement that ended its claim: the row may still run
                # under this process's lease, which the sweeper never takes; the heartbeat
                # ends its lease (Heartbeat._end_dropped).
                self.leases.drop(lease)
            self.leases.remove(lease)
            self._slot_freed.set()

    async def _outcome(self, ctx: Context, lease: Lease) -> Finish | None:
        """Run the workflow and map whatever happened to exactly one action: a Finish to
        commit (completed, failed, cancelled), or None (parked, or dropped because the lease
        is gone). A decision the runtime took (lease lost, cancelled, non-determinism, a
        refused write) wins over whatever the workflow code did after it (FAULTS P6)."""
        c = ctx.claimed
        outcome: BaseException | None = None
        value: Any = None
        ran = False
        try:
            if c.broken is not None:
                raise c.broken
            if c.deadline is not None and c.db_now is not None and c.db_now >= c.deadline:
                raise DeadlineExceeded(f"workflow {c.workflow!r} passed its deadline "
                                       f"{c.deadline}")
            fn = self._workflows.get(c.workflow)
            if fn is None:
                raise UnknownWorkflow(f"workflow {c.workflow!r} is not registered in worker "
                                      f"{self.id}")
            ran = True
            value = await ctx.run_workflow(fn, *c.args)
        except Park:
            tracing.mark(ctx.trace, "parked")
            self.stats.parked += 1
            m = metrics.get()
            m.child(m.parked, c.workflow).inc()
            return None
        except asyncio.CancelledError:
            if not lease.deadline_hit or lease.lost or self._stopping.is_set():
                raise
            outcome = DeadlineExceeded(f"workflow {c.workflow!r} ran past its deadline "
                                       f"{c.deadline}")
        except Exception as exc:
            outcome = exc
        if ran and not lease.deadline_hit:
            # The workflow's own end, its result or an error it raised, is recorded only if
            # this code knows every patch its history holds (FAULTS O5): otherwise the
            # decision is CodeTooOld, and it wins below.
            with contextlib.suppress(CodeTooOld):
                ctx.check_end()
        outcome = ctx.decision or outcome
        # From here on: whether the deadline is what ends this attempt (counted in _finish).
        lease.deadline_hit = isinstance(outcome, DeadlineExceeded)
        if isinstance(outcome, CodeTooOld):
            # A step this code ran before its end was found too old stays recorded: the
            # newer code replays it rather than running it again.
            with contextlib.suppress(KestrelError):
                await ctx.send_tail()
        if isinstance(outcome, CodeTooOld) and not await self._give_back(lease, outcome):
            tracing.mark(ctx.trace, "given_back")
            return None
        if isinstance(outcome, LeaseLost):
            tracing.mark(ctx.trace, "lost")
            self.stats.lost += 1
            metrics.get().leases_lost.inc()
            log.info("dropping %s: %s", c.id, outcome)
            return None
        # The last step's checkpoint, if its write waits (the run ended right after it): the
        # completion writes it, unless the execution ends cancelled (which records nothing
        # more) or is dropped above (a crash right after the step, for whoever runs it next).
        tail = ctx.take_tail()
        if isinstance(outcome, Cancelled | CodeTooOld):  # CodeTooOld: cancelled meanwhile
            return Finish(c.id, c.epoch, Status.CANCELLED, None, codec.encode(
                {"type": "Cancelled", "message": "cancelled by request"}, what="error"))
        if outcome is None:
            try:
                result = codec.encode(value, what=f"result of workflow {c.workflow!r}",
                                      max_bytes=self.cfg.max_payload_bytes)
            except KestrelError as exc:
                outcome = exc
            else:
                return Finish(c.id, c.epoch, Status.COMPLETED, result, None, tail)
        if ctx.trace is not None:
            ctx.trace.failed(outcome)
        return self._failure(c, outcome, tail)

    async def _give_back(self, lease: Lease, why: CodeTooOld) -> bool:
        """Give back an execution that newer code ran, unfailed and without counting the
        attempt, for a worker of another version (a rolling deploy, a rollback): it waits
        out a backoff that grows with its give-backs, and the claims of this app version
        skip it from now on (statements.executions.give_back). Retried while the database is
        unreachable and the lease trusted; if that fails, the lease expires and the sweeper
        re-queues it.
        True when it was not given back because a cancel was requested meanwhile: the
        caller finishes it as cancelled."""
        c = lease.claimed
        lease.finish()
        self.stats.extra["given_back"] = self.stats.extra.get("given_back", 0) + 1
        m = metrics.get()
        m.child(m.give_backs, c.workflow).inc()
        try:
            given = await self._with_retries(lease, lambda conn: db.run(conn, executions.give_back(
                self._q, id=c.id, epoch=c.epoch, app_version=self.cfg.app_version,
                base_s=GIVE_BACK_BASE_S, cap_s=GIVE_BACK_CAP_S)))
        except Exception as exc:
            log.warning("could not give %s back (%s); its lease will expire", c.id,
                        type(exc).__name__)
            return False
        if given is None:
            log.info("giving %s back: no longer ours", c.id)
            return False
        if given == "cancelled":
            lease.unfinish()  # the completion that cancels it marks it finishing again
            return True
        lease.ended = True
        count, wake_at = given
        log.warning("giving %s (%s) back (give-back %d; app version %s skips it; others from "
                    "%s): %s", c.id, c.workflow, count, self.cfg.app_version,
                    wake_at.isoformat(timespec="seconds"), why)
        return False

    async def _finish(self, lease: Lease, finish: Finish,
                      attempt: tracing.Attempt | None = None) -> None:
        c = lease.claimed
        lease.finish()
        m = metrics.get()
        tracing.mark(attempt, "refused")  # until the completion says otherwise
        try:
            done = await self.completions.writer.submit(finish)
        except LeaseLost as exc:
            # Retried for contention until the lease was no longer trusted: not refused,
            # not counted; whoever claims it next finishes it.
            tracing.mark(attempt, "lost")
            self.stats.lost += 1
            m.leases_lost.inc()
            log.info("dropping the completion of %s: %s", c.id, exc)
            return
        except Exception as exc:
            if not connections.is_data_error(exc) or finish.status is Status.FAILED:
                # Refused for a reason of the database's (a limit, its disk): this attempt
                # ends here and counts; the sweeper retries it or quarantines it.
                log.error("completion of %s refused (%s: %s); dropping this attempt", c.id,
                          type(exc).__name__, str(exc).strip()[:200])
                m.rejected_writes.labels("completion").inc()
                return
            m.rejected_writes.labels("completion").inc()
            finish = self._failure(c, WriteRejected(
                f"the database refused the result of workflow {c.workflow!r}: "
                f"{type(exc).__name__}: {exc}"))
            done = await self.completions.writer.submit(finish)
        tracing.mark(attempt, finish.status.value if done else "fenced")
        lease.ended = bool(done)
        if done:
            if finish.status is Status.COMPLETED:
                self.stats.completed += 1
            else:
                self.stats.failed += 1
            m.child(m.finished, c.workflow, finish.status.value).inc()
            if lease.deadline_hit and finish.status is Status.FAILED:
                m.child(m.deadlines, c.workflow).inc()
            if c.db_now is not None and c.created_at is not None:
                # Database time at the claim plus what elapsed here since.
                took = (c.db_now - c.created_at).total_seconds() + (
                    time.monotonic() - lease.claimed_at)
                m.child(m.submit_to_finish, c.workflow).observe(max(0.0, took))
        else:
            self.stats.fenced += 1
            m.fenced.labels("completion").inc()
            if finish.tail is None:
                log.info("completion of %s was fenced: a newer claim owns it", c.id)
            else:
                # The statement cannot tell these apart without another round trip, and
                # either way this attempt ends here; in the second the execution stays
                # ours until its lease runs out and the next claim replays the recorded step.
                log.info("completion of %s not recorded: a newer claim owns it, or an older "
                         "claim recorded the position of its last step first", c.id)

    def _failure(self, c: Claimed, error: BaseException, tail: StepWrite | None = None
                 ) -> Finish:
        described = describe_error(error)
        log.info("execution %s (%s) failed: %s: %s", c.id, c.workflow, described["type"],
                 described["message"][:500])
        return Finish(c.id, c.epoch, Status.FAILED, None,
                      codec.encode(described, what="workflow error"), tail)
