"""One worker process: claim executions, run them, group-commit their writes.

Shape (DESIGN §3): a claim loop takes up to ``min(free slots, batch_size)`` executions per
statement and runs each as an asyncio task. Their checkpoints and completions do not go to
the database one by one: each goes into a :class:`Batcher`, which sends everything that is
ready as one statement and one commit, while the workflows that wrote them wait for that
commit. One heartbeat statement extends every lease the process holds. Side tasks: the
heartbeat, a LISTEN connection for wake-ups (polling runs regardless), and the sweeper.

Leases. A claim or heartbeat sent at monotonic time ``t`` makes the lease good until
``t + lease`` on the database clock, which has started counting no earlier than ``t``. So
until ``t + lease`` by this process's monotonic clock the lease is surely still ours;
past that the execution may belong to someone else and no new step starts ("trusted until").
Whatever a stale worker still sends is fenced by the epoch in the database.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import psycopg

from kestrel import codec, db, metrics
from kestrel.config import Config
from kestrel.db import AnyConn
from kestrel.errors import Cancelled, DeadlineExceeded, LeaseLost, UnknownWorkflow
from kestrel.schedule import due_ticks, schedules
from kestrel.sql import queries
from kestrel.types import Claimed, Finish, SignalTaken, Status, StepSaved, StepWrite
from kestrel.workflow import Context, Park, WorkflowFn, current_step, describe_error

log = logging.getLogger("kestrel.worker")

In = TypeVar("In")
Out = TypeVar("Out")

# Errors that mean "the database is unreachable right now": wait and retry, never crash.
TRANSIENT = (psycopg.OperationalError, psycopg.errors.AdminShutdown, OSError)


def _parse_failpoints(spec: str) -> dict[str, list[Any]]:
    """``name[=mode][:N]`` items, comma-separated: mode is ``raise`` (the default), ``exit``
    or ``sleep(SECONDS)``; N is how many times it fires in each process (default 1)."""
    points: dict[str, list[Any]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, _, times = item.partition(":")
        name, _, mode = head.partition("=")
        mode = mode or "raise"
        match = re.fullmatch(r"raise|exit|sleep\((\d+(?:\.\d+)?)\)", mode)
        if name not in FAILPOINTS or match is None or not (times or "1").isdigit():
            raise ValueError(f"KESTREL_FAILPOINTS: cannot read {item!r}; expected "
                             f"NAME[=raise|exit|sleep(SECONDS)][:N] with NAME one of "
                             f"{', '.join(FAILPOINTS)}")
        points[name] = [mode.partition("(")[0], float(match.group(1) or 0), int(times or 1)]
    return points


# Where the fault suite can inject a fault. ``raise`` at an ``after_*`` point is Temporal's
# ExecuteAndTimeout: the statement committed, the worker hears an error instead of the reply.
FAILPOINTS = ("after_claim_commit", "before_checkpoint_commit",
              "after_checkpoint_commit_before_ack", "before_complete")
_FAILPOINTS = _parse_failpoints(os.environ.get("KESTREL_FAILPOINTS", ""))


def failpoint(name: str) -> None:
    """Fault injection for the fault suite, off unless ``KESTREL_FAILPOINTS`` names *name*.
    ``raise`` raises the error a lost connection would; ``exit`` kills this process with
    SIGKILL (no cleanup, as a crash); ``sleep(S)`` blocks the event loop for S seconds (the
    heartbeat thread keeps the leases, as in a CPU-bound stall)."""
    point = _FAILPOINTS.get(name)
    if point is None or point[2] <= 0:
        return
    point[2] -= 1
    mode, seconds = point[0], point[1]
    log.warning("failpoint %s fired (%s)", name, mode)
    if mode == "exit":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sleep":
        time.sleep(seconds)
        return
    raise psycopg.OperationalError(f"failpoint {name}: connection lost")


class Backoff:
    """Exponential backoff with full jitter, reset on success."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self.base, self.cap, self.failures = base, cap, 0

    def next_delay(self) -> float:
        self.failures += 1
        return random.uniform(0, min(self.cap, self.base * 2 ** self.failures))

    def reset(self) -> None:
        self.failures = 0


class Batcher(Generic[In, Out]):
    """Group commit: callers submit one item each; one flush sends all that are waiting.

    While a flush is in flight new items queue up, so the batch size follows the load with
    no timer and no added latency when idle. A transient database error retries the same
    batch (the statements are idempotent: ON CONFLICT / epoch-guarded); callers keep waiting.
    """

    def __init__(
        self, name: str, flush: Callable[[list[In]], Awaitable[list[Out]]], *, max_batch: int
    ) -> None:
        self.name = name
        self._flush = flush
        self._max_batch = max_batch
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._wake = asyncio.Event()
        self.flushes = 0
        self.items = 0

    async def submit(self, item: In) -> Out:
        fut: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        self._wake.set()
        return await fut

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                live = [(item, fut) for item, fut in batch if not fut.done()]
                if not live:
                    continue
                while True:
                    try:
                        results = await self._flush([item for item, _ in live])
                    except TRANSIENT as exc:
                        delay = backoff.next_delay()
                        log.warning("%s flush failed (%s: %s); retrying in %.2fs", self.name,
                                    type(exc).__name__, str(exc).strip()[:200], delay)
                        await asyncio.sleep(delay)
                        continue
                    except BaseException as exc:
                        # Not transient: tell every waiter, then die (crash-only; the
                        # supervisor restarts the process and leases recover the work).
                        for _, fut in live:
                            if fut.done():
                                continue
                            if isinstance(exc, asyncio.CancelledError):
                                fut.cancel()
                            else:
                                fut.set_exception(exc)
                        raise
                    backoff.reset()
                    break
                self.flushes += 1
                self.items += len(live)
                for (_, fut), result in zip(live, results, strict=True):
                    if not fut.done():
                        fut.set_result(result)


@dataclass(eq=False)
class _Held:
    claimed: Claimed
    trusted_until: float
    task: asyncio.Task[None] | None = None
    lost: bool = False
    cancel_requested: bool = False
    # Set before the statement that ends this claim (complete, park): a heartbeat that then
    # misses the row is seeing that statement's effect, not a lost lease.
    finishing: bool = False
    deadline_hit: bool = False
    deadline_timer: asyncio.TimerHandle | None = None
    claimed_at: float = 0.0
    queue: str | None = None  # set for executions of limited queues (per-process counts)


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


class Worker:
    """Claim and run executions until :meth:`stop`; then drain."""

    def __init__(self, cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str,
                 collect_queue_stats: bool = False, stats_interval: float = 5.0) -> None:
        self.cfg = cfg
        self.collect_queue_stats = collect_queue_stats
        self.stats_interval = stats_interval
        self.dsn = dsn
        self.id = cfg.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self._workflows = workflows
        self._q = queries(cfg.schema)
        self._held: dict[uuid.UUID, _Held] = {}
        self._stopping = asyncio.Event()
        self._work = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._drain_timeout = cfg.drain_timeout
        self._releasing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hb_stop = threading.Event()
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
        self._checkpoints: Batcher[StepWrite, StepSaved] = Batcher(
            "checkpoint", self._flush_checkpoints, max_batch=1000)
        self._completions: Batcher[Finish, bool] = Batcher(
            "completion", self._flush_completions, max_batch=1000)
        self.stats = WorkerStats()

    # -- the Writer protocol used by Context ------------------------------------------------

    async def save_step(self, write: StepWrite) -> StepSaved:
        return await self._checkpoints.submit(write)

    def trusted(self, execution_id: uuid.UUID) -> bool:
        held = self._held.get(execution_id)
        return held is not None and not held.lost and time.monotonic() < held.trusted_until

    def cancel_requested(self, execution_id: uuid.UUID) -> bool:
        held = self._held.get(execution_id)
        return held is not None and held.cancel_requested

    async def _with_retries(self, claimed: Claimed, op: Callable[[AnyConn], Awaitable[Out]]
                            ) -> Out:
        """Run a workflow's own database call, retrying while the database is unreachable
        and the lease is still trusted (the calls are fenced or idempotent, so a retry after
        a lost reply changes nothing twice)."""
        backoff = Backoff()
        while True:
            try:
                async with self._pool.connection() as conn:
                    return await op(conn)
            except TRANSIENT as exc:
                if not self.trusted(claimed.id):
                    raise LeaseLost(f"database unreachable past the lease of {claimed.id}"
                                    ) from exc
                await asyncio.sleep(backoff.next_delay())

    async def park(self, claimed: Claimed, *, step_id: int, waiting_for: str,
                   seconds: float | None, seen_seq: int | None) -> bool:
        held = self._held.get(claimed.id)
        if held is not None:
            held.finishing = True
        parked = await self._with_retries(claimed, lambda conn: db.park(
            conn, self._q, id=claimed.id, epoch=claimed.epoch, step_id=step_id,
            waiting_for=waiting_for, seconds=seconds, seen_seq=seen_seq))
        if held is not None and not parked:
            held.finishing = False
        return parked

    async def consume_signal(self, claimed: Claimed, *, step_id: int, name: str,
                             step_name: str) -> SignalTaken:
        return await self._with_retries(claimed, lambda conn: db.consume_signal(
            conn, self._q, id=claimed.id, epoch=claimed.epoch, step_id=step_id, name=name,
            step_name=step_name))

    async def set_event(self, claimed: Claimed, key: str, value: str) -> bool:
        return await self._with_retries(claimed, lambda conn: db.set_event(
            conn, self._q, id=claimed.id, epoch=claimed.epoch, key=key, value=value))

    async def submit_child(self, *, workflow: str, args: str, queue: str, priority: int,
                           key: str, parent: uuid.UUID, timeout_s: float | None) -> uuid.UUID:
        held = self._held[parent]
        params = db.submit_params(workflow=workflow, args=args, queue=queue, priority=priority,
                                  idempotency_key=key, parent=parent, timeout_s=timeout_s)
        child: uuid.UUID = await self._with_retries(
            held.claimed, lambda conn: db.call(conn, self._q.submit, params, key=key))
        return child

    async def send_signal(self, execution_id: uuid.UUID, name: str, payload: str | None,
                          key: str) -> bool:
        step = current_step()
        held = self._held[step.execution_id]
        params = {"id": execution_id, "name": name, "payload": payload,
                  "idempotency_key": key}
        return bool(await self._with_retries(
            held.claimed, lambda conn: db.call(conn, self._q.signal, params)))

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
                await conn.execute(self._q.upsert_queue_limit, {
                    "queue": spec.name, "concurrency": spec.concurrency, "rate": spec.rate,
                    "period_s": spec.period})
            if self._schedules:
                now = await db.db_now(conn, self._q)
                for sch in self._schedules:
                    await conn.execute(self._q.upsert_schedule, {
                        "name": sch.name, "cron": sch.cron.text, "workflow": sch.workflow,
                        "last_tick": now})

    async def run(self) -> None:
        """Run until :meth:`stop` is called, then drain and return."""
        self._loop = asyncio.get_running_loop()
        await self._pool.open(wait=False)
        await self._register()
        heartbeat = threading.Thread(target=self._heartbeat_thread, name="kestrel-heartbeat",
                                     daemon=True)
        heartbeat.start()
        side = [
            asyncio.create_task(self._checkpoints.run(), name="checkpoint-writer"),
            asyncio.create_task(self._completions.run(), name="completion-writer"),
            asyncio.create_task(self._sweep_loop(), name="sweeper"),
            asyncio.create_task(self._maintenance_loop(), name="maintenance"),
            asyncio.create_task(self._stats_loop(), name="stats"),
        ]
        if self._schedules:
            side.append(asyncio.create_task(self._schedule_loop(), name="scheduler"))
        listening = self.cfg.listen and self._listen_dsn is not None
        if listening:
            side.append(asyncio.create_task(self._listen_loop(), name="listener"))
        log.info("worker %s started: concurrency=%d batch_size=%d queues=%s wake-ups=%s "
                 "connections=%s prepared=%s", self.id, self.cfg.concurrency,
                 self.cfg.batch_size, ",".join(self.cfg.queues),
                 "LISTEN/NOTIFY + polling" if listening else "polling only",
                 self.cfg.connection_mode, "yes" if self.cfg.prepared_statements else "no")
        claim = asyncio.create_task(self._claim_loop(), name="claim")
        try:
            # Crash-only: if a side task dies, the worker dies, and the supervisor restarts it.
            done, _ = await asyncio.wait([claim, *side], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not claim and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            await claim
            await self._drain()
        finally:
            self._hb_stop.set()
            await asyncio.to_thread(heartbeat.join, self.cfg.heartbeat + 5)
            for t in side:
                t.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            claim.cancel()
            await self._pool.close()
            self._executor.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped: %s", self.id, self.stats)

    async def _drain(self) -> None:
        tasks = [h.task for h in self._held.values() if h.task is not None]
        if tasks:
            log.info("draining %d running executions for up to %.1fs", len(tasks),
                     self._drain_timeout)
            if self._drain_timeout > 0:
                await asyncio.wait(tasks, timeout=self._drain_timeout)
        remaining = list(self._held.values())
        if not remaining:
            return
        for h in remaining:
            if h.task is not None:
                h.task.cancel()
        await asyncio.gather(*(h.task for h in remaining if h.task), return_exceptions=True)
        held = [(h.claimed.id, h.claimed.epoch) for h in remaining if not h.lost]
        self._releasing = True  # the heartbeat must not report released rows as lost
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
        self._held.clear()

    # -- claiming -----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            free = self.cfg.concurrency - len(self._held)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                more = False
                if self._unlimited:
                    limit = min(free, self.cfg.batch_size)
                    got = await self._claim(limit, None)
                    more = got == limit
                for spec in self._limited:
                    # A limited queue that came back short (at its limit, empty, or busy
                    # with another claimer) is tried again after a poll interval, so the
                    # unlimited queues' claim loop does not pay for it on every round.
                    if time.monotonic() < self._limited_retry.get(spec.name, 0.0):
                        continue
                    room = self.cfg.concurrency - len(self._held)
                    if spec.per_process is not None:
                        mine = sum(1 for h in self._held.values() if h.queue == spec.name)
                        room = min(room, spec.per_process - mine)
                    limit = min(room, self.cfg.batch_size)
                    if limit > 0:
                        got = await self._claim(limit, spec.name)
                        more = more or got == limit
                        if got < limit:
                            self._limited_retry[spec.name] = time.monotonic() + (
                                self.cfg.poll_interval * random.uniform(0.8, 1.2))
            except TRANSIENT as exc:
                delay = backoff.next_delay()
                log.warning("claim failed (%s); retrying in %.2fs", type(exc).__name__, delay)
                await self._sleep_unless_stopping(delay)
                continue
            backoff.reset()
            if not more:
                await self._wait_for_work()

    async def _claim(self, limit: int, queue: str | None) -> int:
        """One claim statement (of a limited *queue*, or of the unlimited ones); start what
        it returns. Returns how many were claimed; 0 when a limited queue's row is busy
        (its holder is claiming; this process looks again after the poll interval)."""
        sent = time.monotonic()
        async with self._pool.connection() as conn:
            if queue is None:
                claimed = await db.claim_batch(
                    conn, self._q, owner=self.id, queues=self._unlimited, limit=limit,
                    lease_s=self.cfg.lease, take_suspect=not self._holds_suspect())
            else:
                got = await db.claim_limited(conn, self._q, queue=queue, owner=self.id,
                                             limit=limit, lease_s=self.cfg.lease)
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
            held = _Held(c, trusted_until=sent + self.cfg.lease,
                         cancel_requested=c.cancel_requested, claimed_at=sent, queue=queue)
            self._held[c.id] = held
            held.task = asyncio.create_task(self._execute(held), name=f"execution-{c.id}")
            if c.deadline is not None and c.db_now is not None:
                left = (c.deadline - c.db_now).total_seconds()
                held.deadline_timer = asyncio.get_running_loop().call_later(
                    max(left, 0.0), self._deadline_passed, held)
        return len(claimed)

    def _deadline_passed(self, held: _Held) -> None:
        if held.task is not None and not held.task.done():
            held.deadline_hit = True
            held.task.cancel()

    def _holds_suspect(self) -> bool:
        # attempt counts this claim, so a suspect arrives with attempt > SUSPECT_AFTER.
        return any(h.claimed.attempt > db.SUSPECT_AFTER for h in self._held.values())

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

    async def _execute(self, held: _Held) -> None:
        c = held.claimed
        ctx = Context(c, c.workflow, self, self._executor, self.cfg.max_payload_bytes,
                      claimed_mono=held.claimed_at)
        try:
            try:
                finish = await self._run_workflow(ctx)
            except asyncio.CancelledError:
                if not held.deadline_hit or held.lost or self._stopping.is_set():
                    raise
                finish = self._failure(c, DeadlineExceeded(
                    f"workflow {c.workflow!r} ran past its deadline {c.deadline}"))
            if finish is None:
                return
            held.finishing = True
            m = metrics.get()
            if await self._completions.submit(finish):
                if finish.status is Status.COMPLETED:
                    self.stats.completed += 1
                else:
                    self.stats.failed += 1
                m.finished.labels(c.workflow, finish.status.value).inc()
                if c.db_now is not None and c.created_at is not None:
                    # Database time at the claim plus what elapsed here since.
                    took = (c.db_now - c.created_at).total_seconds() + (
                        time.monotonic() - held.claimed_at)
                    m.submit_to_finish.labels(c.workflow).observe(max(0.0, took))
            else:
                self.stats.fenced += 1
                m.fenced.labels("completion").inc()
                log.info("completion of %s was fenced: a newer claim owns it", c.id)
        except asyncio.CancelledError:
            if held.lost or self._stopping.is_set():
                return  # lost: the new owner finishes it; stopping: _drain releases it
            raise
        finally:
            if held.deadline_timer is not None:
                held.deadline_timer.cancel()
            # Identity check: after a lost lease this worker may hold a newer claim of the
            # same execution under the same id.
            if self._held.get(c.id) is held:
                del self._held[c.id]
            self._slot_freed.set()

    def _failure(self, c: Claimed, error: BaseException) -> Finish:
        log.info("execution %s (%s) failed: %s: %s", c.id, c.workflow,
                 type(error).__name__, error)
        return Finish(c.id, c.epoch, Status.FAILED, None,
                      codec.encode(describe_error(error), what="workflow error"))

    async def _run_workflow(self, ctx: Context) -> Finish | None:
        c = ctx.claimed
        fn = self._workflows.get(c.workflow)
        if c.deadline is not None and c.db_now is not None and c.db_now >= c.deadline:
            return self._failure(c, DeadlineExceeded(
                f"workflow {c.workflow!r} passed its deadline {c.deadline}"))
        try:
            if fn is None:
                raise UnknownWorkflow(
                    f"workflow {c.workflow!r} is not registered in worker {self.id} "
                    f"(registered: {', '.join(sorted(self._workflows)) or 'none'})")
            value = await fn(ctx, *c.args)
            if ctx.nondeterminism is not None:
                raise ctx.nondeterminism
            if ctx.cancelled:
                raise Cancelled(f"execution {c.id} was cancelled")
            result = codec.encode(value, what=f"result of workflow {c.workflow!r}",
                                  max_bytes=self.cfg.max_payload_bytes)
            return Finish(c.id, c.epoch, Status.COMPLETED, result, None)
        except Park:
            self.stats.parked += 1
            metrics.get().parked.labels(c.workflow).inc()
            return None
        except LeaseLost as exc:
            self.stats.lost += 1
            metrics.get().leases_lost.inc()
            log.info("dropping %s: %s", c.id, exc)
            return None
        except Exception as exc:
            if ctx.nondeterminism is None and (ctx.cancelled or isinstance(exc, Cancelled)):
                return Finish(c.id, c.epoch, Status.CANCELLED, None, codec.encode(
                    {"type": "Cancelled", "message": "cancelled by request"}, what="error"))
            return self._failure(c, ctx.nondeterminism or exc)

    # -- group-commit flushes -----------------------------------------------------------------

    async def _flush_checkpoints(self, writes: list[StepWrite]) -> list[StepSaved]:
        started = time.monotonic()
        async with self._pool.connection() as conn:
            failpoint("before_checkpoint_commit")
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
            failpoint("before_complete")
            done = await db.complete_batch(conn, self._q, finishes)
        m = metrics.get()
        m.completion_seconds.observe(time.monotonic() - started)
        m.completion_batch.observe(len(finishes))
        return [f.execution_id in done for f in finishes]

    # -- side tasks ---------------------------------------------------------------------------

    def heartbeat_once(self, conn: psycopg.Connection[Any]) -> None:
        """Extend every held lease in one statement (runs on the heartbeat thread); hand the
        executions whose lease is gone to the event loop to abandon."""
        snapshot = [h for h in list(self._held.values()) if not h.lost]
        if not snapshot or self._releasing:
            return
        sent = time.monotonic()
        owned = db.heartbeat_sync(conn, self._q, held=[(h.claimed.id, h.claimed.epoch)
                                                       for h in snapshot],
                                  lease_s=self.cfg.lease)
        gone = []
        for h in snapshot:
            if h.claimed.id in owned:
                h.trusted_until = sent + self.cfg.lease
                if owned[h.claimed.id]:
                    h.cancel_requested = True
            else:
                gone.append(h)
        if gone and self._loop is not None:
            self._loop.call_soon_threadsafe(self._abandon, gone)

    def _abandon(self, gone: list[_Held]) -> None:
        for h in gone:
            if self._held.get(h.claimed.id) is not h or h.finishing or h.lost:
                continue  # finished or parked meanwhile: the row left on our own write
            h.lost = True
            self.stats.lost += 1
            metrics.get().leases_lost.inc()
            metrics.get().fenced.labels("heartbeat").inc()
            log.warning("lease on %s was lost (expired or re-claimed); abandoning it",
                        h.claimed.id)
            if h.task is not None:
                h.task.cancel()

    def _heartbeat_thread(self) -> None:
        """Heartbeats from a thread and a connection of their own, so that a step blocking
        the event loop (CPU-bound code in an ``async def``) does not let its lease lapse and
        a second worker run the same step alongside it (FAULTS F8). The price: a step that
        never returns holds its lease for as long as the process lives."""
        conn: psycopg.Connection[Any] | None = None
        backoff = Backoff(base=0.2, cap=self.cfg.heartbeat)
        while not self._hb_stop.wait(self.cfg.heartbeat if not backoff.failures
                                     else backoff.next_delay()):
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, **{
                        **db.link_params(self.dsn), "autocommit": True,
                        "application_name": "kestrel-heartbeat",
                        "prepare_threshold": 0 if self.cfg.prepared_statements else None,
                        "connect_timeout": max(1, int(self.cfg.heartbeat))})
                self.heartbeat_once(conn)
                backoff.reset()
            except psycopg.Error as exc:
                log.warning("heartbeat failed (%s); leases are trusted until they run out",
                            type(exc).__name__)
                backoff.failures += 1
                if conn is not None:
                    conn.close()
                    conn = None
        if conn is not None:
            conn.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval * random.uniform(0.5, 1.0))
            try:
                await self.sweep_once()
            except TRANSIENT as exc:
                log.warning("sweep failed (%s)", type(exc).__name__)

    async def sweep_once(self) -> tuple[int, int]:
        """Re-enqueue expired leases in bounded passes; return (requeued, quarantined)."""
        requeued = quarantined = 0
        limit = 500
        while True:
            async with self._pool.connection() as conn:
                r = await db.reenqueue_expired(conn, self._q, limit=limit,
                                               max_attempts=self.cfg.max_attempts)
            requeued += r.requeued
            quarantined += r.quarantined
            if r.examined < limit:
                break
        while True:
            async with self._pool.connection() as conn:
                expired = await db.expire_deadlines(conn, self._q, limit=limit)
            if expired:
                log.info("failed %d queued or waiting executions past their deadline", expired)
            if expired < limit:
                break
        if requeued:
            metrics.get().leases_expired.inc(requeued)
            log.info("sweeper re-enqueued %d executions with expired leases", requeued)
            self._work.set()
        if quarantined:
            metrics.get().quarantined.inc(quarantined)
            log.warning("sweeper quarantined %d executions that exhausted max_attempts=%d",
                        quarantined, self.cfg.max_attempts)
        return requeued, quarantined

    async def _stats_loop(self) -> None:
        """Every few seconds: this process's pool and running gauges; in the one process
        chosen by the supervisor, queue depth from one cheap query for the whole fleet."""
        m = metrics.get()
        m.workers.set(1)
        # Known label values start at 0, so a rate() over them has data before the first
        # event (and absence means "no such thing", not "not happened yet").
        for kind in ("checkpoint", "completion", "heartbeat"):
            m.fenced.labels(kind)
        for wf in self._workflows:
            m.started.labels(wf)
            for outcome in ("completed", "failed", "cancelled"):
                m.finished.labels(wf, outcome)
        known: set[tuple[str, str]] = set()
        while True:
            stats = self._pool.get_stats()
            size, idle = stats.get("pool_size", 0), stats.get("pool_available", 0)
            m.pool.labels("in_use").set(size - idle)
            m.pool.labels("idle").set(idle)
            m.pool.labels("waiting").set(stats.get("requests_waiting", 0))
            m.running.set(len(self._held))
            if self.collect_queue_stats:
                try:
                    async with self._pool.connection() as conn:
                        rows = await db.queue_stats(conn, self._q)
                except TRANSIENT:
                    rows = None
                if rows is not None:
                    seen = set()
                    for queue, status, count, oldest in rows:
                        seen.add((queue, status))
                        m.queue_depth.labels(queue, status).set(count)
                        if status == "queued":
                            m.oldest_queued.labels(queue).set(oldest)
                    for queue, status in known - seen:
                        m.queue_depth.labels(queue, status).set(0)
                        if status == "queued":
                            m.oldest_queued.labels(queue).set(0)
                    known |= seen
            await asyncio.sleep(self.stats_interval)

    async def _schedule_loop(self) -> None:
        while True:
            try:
                wait = await self.schedule_once()
            except TRANSIENT as exc:
                log.warning("scheduler round failed (%s)", type(exc).__name__)
                wait = self.cfg.poll_interval
            await asyncio.sleep(wait * random.uniform(0.9, 1.1))

    async def schedule_once(self) -> float:
        """Start every due tick this process wins; return seconds until the next tick."""
        from datetime import timedelta

        nearest = self.cfg.poll_interval
        async with self._pool.connection() as conn:
            now = await db.db_now(conn, self._q)
            for sch in self._schedules:
                last = await db.get_schedule(conn, self._q, name=sch.name)
                if last is None:
                    continue
                for tick in due_ticks(sch.cron, last, now, sch.catch_up):
                    iso = tick.isoformat()
                    params = db.submit_params(
                        workflow=sch.workflow, args=codec.encode([iso], what="tick"),
                        queue=sch.queue, priority=0,
                        idempotency_key=f"kestrel.cron:{sch.name}:{iso}")
                    if not await db.start_tick(conn, self._q, name=sch.name, seen=last,
                                               tick=tick, submit=params):
                        break  # another process started it (and will start the rest)
                    log.info("schedule %s: started the %s tick", sch.name, iso)
                    last = tick
                until = (sch.cron.next_after(max(last, now)) - now) / timedelta(seconds=1)
                nearest = min(nearest, max(until, 0.05))
        return nearest

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.maintenance_interval * random.uniform(0.5, 1.0))
            try:
                await self.maintain_once()
            except (*TRANSIENT, psycopg.errors.LockNotAvailable) as exc:
                # lock_timeout: something held the history table; try again next round.
                log.warning("history partition upkeep skipped (%s)", type(exc).__name__)
            except psycopg.errors.InsufficientPrivilege:
                # A least-privilege runtime role: upkeep is the owner's job.
                log.warning("history partition upkeep needs the schema owner's rights; run "
                            "`kestrel-runtime partitions` as the owner (e.g. from cron)")
                return

    async def maintain_once(self) -> tuple[bool, int, int]:
        """One partition upkeep round unless another process is doing it."""
        async with self._pool.connection() as conn:
            ran, created, dropped = await db.run_maintenance(
                conn, self._q, interval=self.cfg.history_interval,
                ahead=self.cfg.history_ahead, retention_days=self.cfg.history_retention_days)
        if created or dropped:
            log.info("history partitions: created %d, dropped %d", created, dropped)
        return ran, created, dropped

    async def _listen_loop(self) -> None:
        backoff = Backoff(base=0.2, cap=10.0)
        while True:
            try:
                assert self._listen_dsn is not None
                conn = await psycopg.AsyncConnection.connect(
                    self._listen_dsn, autocommit=True, application_name="kestrel-listen",
                    **db.link_params(self._listen_dsn))
                async with conn:
                    await db.listen(conn, self._q)
                    backoff.reset()
                    self._work.set()  # anything submitted while we were not listening
                    async for _ in conn.notifies():
                        self._work.set()
            except TRANSIENT as exc:
                delay = backoff.next_delay()
                log.warning("LISTEN connection lost (%s); polling until it is back in %.1fs",
                            type(exc).__name__, delay)
                await asyncio.sleep(delay)


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
