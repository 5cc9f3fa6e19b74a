"""One worker process: claim executions, run them, group-commit their writes.

Shape (DESIGN §3): a claim loop takes up to ``min(free slots, batch_size)`` executions per
statement and runs each as an asyncio task under a :class:`~kestrel.lease.Lease`. Their
checkpoints and completions go through the writers (:mod:`kestrel.writer`), which send
everything that is ready as one statement and one commit while the workflows that wrote them
wait for that commit. The heartbeat thread (:mod:`kestrel.lease`) extends every lease in one
statement while the process makes progress. The periodic services (:mod:`kestrel.services`)
sweep, keep history partitions, start cron ticks, export stats and listen for wake-ups.

Structured concurrency: :meth:`Worker.run` is one task group of the claim loop and every
service. A service that ends — by an error or by returning — ends the process with an error
and the supervisor starts a new one (crash-only; leases recover the work).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from kestrel import codec, db, metrics
from kestrel.config import Config
from kestrel.db import AnyConn
from kestrel.errors import (
    Cancelled,
    DeadlineExceeded,
    KestrelError,
    LeaseLost,
    UnknownWorkflow,
    WriteRejected,
)
from kestrel.failpoints import afailpoint, failpoint
from kestrel.lease import Heartbeat, Lease, Leases
from kestrel.schedule import schedules
from kestrel.services import Listener, Scheduler, Stats, Sweeper, Upkeep
from kestrel.sql import queries
from kestrel.types import Claimed, Finish, SignalTaken, Status, StepSaved, StepWrite
from kestrel.workflow import Context, Park, WorkflowFn, describe_error
from kestrel.writer import Backoff, GroupCommit

log = logging.getLogger("kestrel.worker")

Out = TypeVar("Out")


class ServiceEnded(RuntimeError):
    """A worker service returned: services run for the life of the process."""


@dataclass
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    fenced: int = 0
    parked: int = 0
    released: int = 0
    claims: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _write_size(w: StepWrite) -> int:
    return len(w.output or "") + len(w.error or "") + len(w.name)


def _finish_size(f: Finish) -> int:
    return len(f.result or "") + len(f.error or "")


class Worker:
    """Claim and run executions until :meth:`stop`; then drain."""

    def __init__(self, cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str,
                 collect_queue_stats: bool = False, stats_interval: float = 5.0) -> None:
        self.cfg = cfg
        self.dsn = dsn
        self.id = cfg.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self._workflows = workflows
        self._names = sorted(workflows)
        self._q = queries(cfg.schema)
        self.leases = Leases()
        self._stopping = asyncio.Event()
        self._work = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._drain_timeout = cfg.drain_timeout
        self._loop_tick = time.monotonic()
        self._pool = db.make_pool(dsn, max_size=cfg.pool_size, name=f"kestrel-{self.id}",
                                  prepared=cfg.prepared_statements)
        self._listen_dsn = cfg.notify_dsn(dsn)
        self._executor = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="kestrel-step")
        specs = cfg.queue_specs()
        # Queues with limits are claimed one at a time under their row lock; the rest, in
        # one claim statement that never touches the limits table.
        self._limited = [specs[q] for q in cfg.queues if q in specs and specs[q].limited]
        self._unlimited = [q for q in cfg.queues if not (q in specs and specs[q].limited)]
        self._schedules = [s for s in schedules().values() if s.workflow in workflows]
        self._limited_retry: dict[str, float] = {}
        self.checkpoints: GroupCommit[StepWrite, StepSaved] = GroupCommit(
            "checkpoint", self._flush_checkpoints, size=_write_size)
        self.completions: GroupCommit[Finish, bool] = GroupCommit(
            "completion", self._flush_completions, size=_finish_size)
        self.sweeper = Sweeper(self._pool, self._q, cfg, self._work.set)
        self.upkeep = Upkeep(self._pool, self._q, cfg)
        self.scheduler = Scheduler(self._pool, self._q, cfg, self._schedules)
        self._stats = Stats(self._pool, self._q, workflows=self._names,
                            collect_queues=collect_queue_stats, interval=stats_interval,
                            running=lambda: len(self.leases))
        self.heartbeat: Heartbeat | None = None
        self.stats = WorkerStats()

    # -- what a Context asks of its worker (kestrel.workflow.Writer) --------------------------

    async def save_step(self, write: StepWrite) -> StepSaved:
        return await self.checkpoints.submit(write)

    async def _with_retries(self, lease: Lease, op: Callable[[AnyConn], Awaitable[Out]]) -> Out:
        """Run a workflow's own database call, retrying while the database is unreachable
        and the lease is still trusted (the calls are fenced or idempotent, so a retry after
        a lost reply changes nothing twice). A statement the database refuses raises."""
        backoff = Backoff()
        while True:
            try:
                async with self._pool.connection() as conn:
                    return await op(conn)
            except Exception as exc:
                if not db.is_transient(exc):
                    raise
                if not lease.trusted():
                    raise LeaseLost(f"database unreachable past the lease of "
                                    f"{lease.claimed.id}") from exc
                await asyncio.sleep(backoff.next_delay())

    async def park(self, lease: Lease, *, step_id: int, waiting_for: str,
                   seconds: float | None, seen_seq: int | None) -> str:
        lease.finish()  # a heartbeat that now misses the row is seeing our own park

        async def park(conn: AnyConn) -> str:
            outcome = await db.park(conn, self._q, id=lease.claimed.id,
                                    epoch=lease.claimed.epoch, step_id=step_id,
                                    waiting_for=waiting_for, seconds=seconds,
                                    seen_seq=seen_seq)
            await afailpoint("after_park_commit")
            return outcome

        outcome = "lost"
        try:
            outcome = await self._with_retries(lease, park)
        finally:
            if outcome != "parked":
                lease.unfinish()
        return outcome

    async def consume_signal(self, lease: Lease, *, step_id: int, name: str,
                             step_name: str) -> SignalTaken:
        c = lease.claimed
        return await self._with_retries(lease, lambda conn: db.consume_signal(
            conn, self._q, id=c.id, epoch=c.epoch, step_id=step_id, name=name,
            step_name=step_name))

    async def set_event(self, lease: Lease, key: str, value: str) -> bool:
        c = lease.claimed
        return await self._with_retries(lease, lambda conn: db.set_event(
            conn, self._q, id=c.id, epoch=c.epoch, key=key, value=value))

    async def submit_child(self, lease: Lease, *, workflow: str, args: str, queue: str,
                           priority: int, key: str, timeout_s: float | None) -> uuid.UUID:
        params = db.submit_params(workflow=workflow, args=args, queue=queue, priority=priority,
                                  idempotency_key=key, parent=lease.claimed.id,
                                  timeout_s=timeout_s)
        child: uuid.UUID = await self._with_retries(
            lease, lambda conn: db.call(conn, self._q.submit, params, key=key))
        return child

    async def send_signal(self, lease: Lease, execution_id: uuid.UUID, name: str,
                          payload: str | None, key: str) -> bool:
        params = {"id": execution_id, "name": name, "payload": payload,
                  "idempotency_key": key}
        return bool(await self._with_retries(
            lease, lambda conn: db.call(conn, self._q.signal, params)))

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self, *, drain_timeout: float | None = None) -> None:
        """Stop claiming; running executions get *drain_timeout* seconds, then are released."""
        if drain_timeout is not None:
            self._drain_timeout = drain_timeout
        self._stopping.set()
        self._work.set()
        self._slot_freed.set()

    async def _register(self) -> None:
        """Write this process's queue limits and schedules (idempotent upserts)."""
        async with self._pool.connection() as conn:
            for spec in self._limited:
                await db.upsert_queue_limit(conn, self._q, queue=spec.name,
                                            concurrency=spec.concurrency, rate=spec.rate,
                                            period_s=spec.period)
            if self._schedules:
                now = await db.db_now(conn, self._q)
                for sch in self._schedules:
                    await db.upsert_schedule(conn, self._q, name=sch.name, cron=sch.cron.text,
                                             workflow=sch.workflow, last_tick=now)

    def services(self) -> dict[str, Callable[[], Coroutine[Any, Any, NoReturn]]]:
        """The services this process runs for its whole life, by name."""
        found: dict[str, Callable[[], Coroutine[Any, Any, NoReturn]]] = {
            "checkpoint-writer": self.checkpoints.run,
            "completion-writer": self.completions.run,
            "sweeper": self.sweeper.run,
            "upkeep": self.upkeep.run,
            "stats": self._stats.run,
            "ticker": self._tick,
        }
        if self._schedules:
            found["scheduler"] = self.scheduler.run
        if self.cfg.listen and self._listen_dsn is not None:
            found["listener"] = Listener(self._listen_dsn, self._q, self._work.set).run
        return found

    async def run(self) -> None:
        """Run until :meth:`stop` is called, then drain and return. Raises if a service ends."""
        loop = asyncio.get_running_loop()
        await self._pool.open(wait=False)
        await self._register()
        self.heartbeat = Heartbeat(self.leases, dsn=self.dsn, q=self._q, lease_s=self.cfg.lease,
                                   interval=self.cfg.heartbeat,
                                   prepared=self.cfg.prepared_statements, loop=loop,
                                   progressing=self._progressing)
        self.heartbeat.start()
        services = self.services()
        log.info("worker %s started: concurrency=%d batch_size=%d queues=%s wake-ups=%s "
                 "connections=%s prepared=%s", self.id, self.cfg.concurrency,
                 self.cfg.batch_size, ",".join(self.cfg.queues),
                 "LISTEN/NOTIFY + polling" if "listener" in services else "polling only",
                 self.cfg.connection_mode, "yes" if self.cfg.prepared_statements else "no")
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._service(name, fn), name=name)
                         for name, fn in services.items()]
                await self._claim_loop()
                await self._drain()
                for t in tasks:
                    t.cancel()
        finally:
            for lease in self.leases:
                if lease.task is not None:
                    lease.task.cancel()
            await self.heartbeat.stop()
            await self._pool.close()
            self._executor.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped: %s", self.id, self.stats)

    @staticmethod
    async def _service(name: str, fn: Callable[[], Coroutine[Any, Any, NoReturn]]) -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("worker service %s crashed; the worker exits", name)
            raise
        log.error("worker service %s returned; the worker exits", name)
        raise ServiceEnded(f"worker service {name} returned")

    async def _tick(self) -> NoReturn:
        """Mark the event loop as running, for the heartbeat's watchdog."""
        while True:
            self._loop_tick = time.monotonic()
            await asyncio.sleep(min(1.0, self.cfg.heartbeat / 2))

    def _progressing(self) -> str | None:
        """None while this process makes progress; else why not (heartbeat thread)."""
        now = time.monotonic()
        limit = self.cfg.lease
        if now - self._loop_tick > limit:
            return f"the event loop has not run for {now - self._loop_tick:.1f}s"
        for writer in (self.checkpoints, self.completions):
            stalled = writer.stalled_for(now)
            if stalled > limit:
                return f"the {writer.name} writer has made no progress for {stalled:.1f}s"
        return None

    async def _drain(self) -> None:
        tasks = [h.task for h in self.leases if h.task is not None]
        if tasks:
            log.info("draining %d running executions for up to %.1fs", len(tasks),
                     self._drain_timeout)
            if self._drain_timeout > 0:
                await asyncio.wait(tasks, timeout=self._drain_timeout)
        remaining = list(self.leases)
        if not remaining:
            return
        for h in remaining:
            if h.task is not None:
                h.task.cancel()
        await asyncio.gather(*(h.task for h in remaining if h.task), return_exceptions=True)
        held = [h.key for h in remaining if not h.lost]
        if self.heartbeat is not None:
            self.heartbeat.paused = True  # released rows are not lost leases
        if held:
            try:
                async with self._pool.connection(timeout=5) as conn:
                    released = await db.release_batch(conn, self._q, held=held)
            except Exception as exc:  # the leases will expire and the sweeper recovers them
                log.warning("could not release %d executions (%s); they will be recovered "
                            "when their leases expire", len(held), exc)
            else:
                self.stats.released += len(released)
                log.info("released %d executions back to the queue", len(released))
        self.leases.clear()

    # -- claiming -----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            free = self.cfg.concurrency - len(self.leases)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                more = await self._claim_round(free)
            except Exception as exc:
                delay = backoff.next_delay()
                level = logging.WARNING if db.is_transient(exc) else logging.ERROR
                log.log(level, "claim failed (%s: %s); retrying in %.2fs", type(exc).__name__,
                        str(exc).strip()[:200], delay)
                await self._sleep_unless_stopping(delay)
                continue
            backoff.reset()
            if not more:
                await self._wait_for_work()

    async def _claim_round(self, free: int) -> bool:
        """Claim into *free* slots; True if a claim came back full (claim again at once)."""
        more = False
        if self._unlimited:
            limit = min(free, self.cfg.batch_size)
            got = await self._claim(limit, None)
            more = got == limit
        for spec in self._limited:
            # A limited queue that came back short (at its limit, empty, or busy with another
            # claimer) is tried again after a poll interval, so the unlimited queues' claim
            # loop does not pay for it on every round.
            if time.monotonic() < self._limited_retry.get(spec.name, 0.0):
                continue
            room = self.cfg.concurrency - len(self.leases)
            if spec.per_process is not None:
                mine = sum(1 for h in self.leases if h.queue == spec.name)
                room = min(room, spec.per_process - mine)
            limit = min(room, self.cfg.batch_size)
            if limit > 0:
                got = await self._claim(limit, spec.name)
                more = more or got == limit
                if got < limit:
                    self._limited_retry[spec.name] = time.monotonic() + (
                        self.cfg.poll_interval * random.uniform(0.8, 1.2))
        return more

    async def _claim(self, limit: int, queue: str | None) -> int:
        """One claim statement (of a limited *queue*, or of the unlimited ones); start what
        it returns. Returns how many were claimed; 0 when a limited queue's row is busy
        (its holder is claiming; this process looks again after the poll interval)."""
        sent = time.monotonic()
        async with self._pool.connection() as conn:
            if queue is None:
                claimed = await db.claim_batch(
                    conn, self._q, owner=self.id, queues=self._unlimited, limit=limit,
                    lease_s=self.cfg.lease, workflows=self._names,
                    max_history_bytes=self.cfg.max_history_bytes,
                    take_suspect=not self._holds_suspect())
            else:
                got = await db.claim_limited(
                    conn, self._q, queue=queue, owner=self.id, limit=limit,
                    lease_s=self.cfg.lease, workflows=self._names,
                    max_history_bytes=self.cfg.max_history_bytes)
                if got is None:
                    return 0  # another process is claiming from it right now
                claimed = got
            failpoint("after_claim_commit")
        m = metrics.get()
        m.claim_seconds.observe(time.monotonic() - sent)
        if claimed:
            m.claim_batch.observe(len(claimed))
        self.stats.claims += 1
        self.stats.claimed += len(claimed)
        for c in claimed:
            if c.attempt == 1 and not c.steps and c.wait_step is None:
                m.started.labels(c.workflow).inc()
                if c.db_now is not None and c.created_at is not None:
                    m.submit_to_start.labels(c.workflow).observe(
                        max(0.0, (c.db_now - c.created_at).total_seconds()))
            self._start(Lease(c, trusted_until=sent + self.cfg.lease, claimed_at=sent,
                              queue=queue, cancel_requested=c.cancel_requested))
        return len(claimed)

    def _start(self, lease: Lease) -> None:
        c = lease.claimed
        self.leases.add(lease)  # an older claim of the same id held here is lost (X5)
        lease.task = asyncio.create_task(self._execute(lease), name=f"execution-{c.id}")
        if c.deadline is not None and c.db_now is not None:
            left = (c.deadline - c.db_now).total_seconds()
            lease.deadline_timer = asyncio.get_running_loop().call_later(
                max(left, 0.0), self._deadline_passed, lease)

    def _deadline_passed(self, lease: Lease) -> None:
        # A completion already on its way wins over the deadline (FAULTS X6).
        if lease.task is not None and not lease.task.done() and not lease.finishing:
            lease.deadline_hit = True
            lease.task.cancel()

    def _holds_suspect(self) -> bool:
        # attempt counts this claim, so a suspect arrives with attempt > SUSPECT_AFTER.
        return any(h.claimed.attempt > db.SUSPECT_AFTER for h in self.leases)

    async def _wait_for_work(self) -> None:
        self._work.clear()
        timeout = self.cfg.poll_interval * random.uniform(0.8, 1.2)
        try:
            await asyncio.wait_for(self._work.wait(), timeout)
        except TimeoutError:
            pass

    async def _sleep_unless_stopping(self, delay: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
        except TimeoutError:
            pass

    # -- running one execution ----------------------------------------------------------------

    async def _execute(self, lease: Lease) -> None:
        c = lease.claimed
        ctx = Context(c, c.workflow, self, lease, self._executor, self.cfg.max_payload_bytes,
                      claimed_mono=lease.claimed_at)
        try:
            finish = await self._outcome(ctx, lease)
            if finish is not None:
                await self._finish(lease, finish)
        except asyncio.CancelledError:
            if lease.lost or self._stopping.is_set():
                return  # lost: the new owner finishes it; stopping: _drain releases it
            raise
        finally:
            if lease.deadline_timer is not None:
                lease.deadline_timer.cancel()
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
            value = await fn(ctx, *c.args)
        except Park:
            self.stats.parked += 1
            metrics.get().parked.labels(c.workflow).inc()
            return None
        except asyncio.CancelledError:
            if not lease.deadline_hit or lease.lost or self._stopping.is_set():
                raise
            outcome = DeadlineExceeded(f"workflow {c.workflow!r} ran past its deadline "
                                       f"{c.deadline}")
        except Exception as exc:
            outcome = exc
        outcome = ctx.decision or outcome
        if isinstance(outcome, LeaseLost):
            self.stats.lost += 1
            metrics.get().leases_lost.inc()
            log.info("dropping %s: %s", c.id, outcome)
            return None
        if isinstance(outcome, Cancelled):
            return Finish(c.id, c.epoch, Status.CANCELLED, None, codec.encode(
                {"type": "Cancelled", "message": "cancelled by request"}, what="error"))
        if outcome is None:
            try:
                result = codec.encode(value, what=f"result of workflow {c.workflow!r}",
                                      max_bytes=self.cfg.max_payload_bytes)
            except KestrelError as exc:
                return self._failure(c, exc)
            return Finish(c.id, c.epoch, Status.COMPLETED, result, None)
        return self._failure(c, outcome)

    async def _finish(self, lease: Lease, finish: Finish) -> None:
        c = lease.claimed
        lease.finish()
        m = metrics.get()
        try:
            done = await self.completions.submit(finish)
        except Exception as exc:
            if not db.is_data_error(exc) or finish.status is Status.FAILED:
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
            done = await self.completions.submit(finish)
        if done:
            if finish.status is Status.COMPLETED:
                self.stats.completed += 1
            else:
                self.stats.failed += 1
            m.finished.labels(c.workflow, finish.status.value).inc()
            if c.db_now is not None and c.created_at is not None:
                # Database time at the claim plus what elapsed here since.
                took = (c.db_now - c.created_at).total_seconds() + (
                    time.monotonic() - lease.claimed_at)
                m.submit_to_finish.labels(c.workflow).observe(max(0.0, took))
        else:
            self.stats.fenced += 1
            m.fenced.labels("completion").inc()
            log.info("completion of %s was fenced: a newer claim owns it", c.id)

    def _failure(self, c: Claimed, error: BaseException) -> Finish:
        described = describe_error(error)
        log.info("execution %s (%s) failed: %s: %s", c.id, c.workflow, described["type"],
                 described["message"][:500])
        return Finish(c.id, c.epoch, Status.FAILED, None,
                      codec.encode(described, what="workflow error"))

    # -- group-commit flushes -----------------------------------------------------------------

    async def _flush_checkpoints(self, writes: list[StepWrite]) -> list[StepSaved]:
        started = time.monotonic()
        async with self._pool.connection() as conn:
            await afailpoint("before_checkpoint_commit")
            saved = await db.save_steps(conn, self._q, writes)
            failpoint("after_checkpoint_commit_before_ack")
            m = metrics.get()
            m.checkpoint_seconds.observe(time.monotonic() - started)
            m.checkpoint_batch.observe(len(writes))
            fenced = sum(1 for s in saved if not s.owned)
            if fenced:
                m.fenced.labels("checkpoint").inc(fenced)
            # A conflicting row committed after our snapshot is invisible to the statement
            # (only possible across epochs, which are fenced anyway): read it back.
            for i, (w, s) in enumerate(zip(writes, saved, strict=True)):
                if s.owned and s.recorded is None and not s.cancelled:
                    rec = await db.load_step(conn, self._q, execution_id=w.execution_id,
                                             step_id=w.step_id)
                    saved[i] = StepSaved(owned=True, inserted=False, recorded=rec)
        return saved

    async def _flush_completions(self, finishes: list[Finish]) -> list[bool]:
        started = time.monotonic()
        async with self._pool.connection() as conn:
            await afailpoint("before_complete")
            done = await db.complete_batch(conn, self._q, finishes)
            failpoint("after_complete_commit")
            missing = [f for f in finishes if f.execution_id not in done]
            if missing:
                # Not finished by this statement: fenced by a newer claim, or finished by an
                # earlier try whose reply was lost (FAULTS X4). History tells which.
                done |= await db.finished_readback(conn, self._q, missing)
        m = metrics.get()
        m.completion_seconds.observe(time.monotonic() - started)
        m.completion_batch.observe(len(finishes))
        return [f.execution_id in done for f in finishes]


def run_worker(cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str,
               install_signals: bool = True, collect_queue_stats: bool = False) -> WorkerStats:
    """Run a worker on a fresh uvloop event loop until SIGTERM/SIGINT; return its stats."""
    import signal

    import uvloop

    async def main() -> WorkerStats:
        worker = Worker(cfg, workflows, dsn=dsn, collect_queue_stats=collect_queue_stats)
        if install_signals:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, worker.stop)
            loop.add_signal_handler(signal.SIGINT, worker.stop)
            # The supervisor died (PR_SET_PDEATHSIG or the ppid poll): release and exit now.
            loop.add_signal_handler(signal.SIGUSR1, lambda: worker.stop(drain_timeout=0))
        await worker.run()
        return worker.stats

    return uvloop.run(main())
