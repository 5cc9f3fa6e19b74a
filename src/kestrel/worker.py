"""One worker process: its services wired into one task group.

Shape (DESIGN §3): the :class:`~kestrel.claimer.Claimer` claims up to
``min(free slots, batch_size)`` executions per statement; the
:class:`~kestrel.runner.Runner` runs each as a task under a :class:`~kestrel.lease.Lease`,
its checkpoints and completions going through the writers (:mod:`kestrel.writer`), which
send everything that is ready as one statement and one commit while the workflows that wrote
them wait for that commit. The :class:`~kestrel.lease.Heartbeat` thread extends every lease in
one statement while the process makes progress. The periodic services
(:mod:`kestrel.services`) sweep, keep history partitions, start cron ticks, export stats and
listen for wake-ups.

Structured concurrency: :meth:`Worker.run` is one task group of the claimer and every
service (:meth:`Worker.services`, each a :class:`~kestrel.loops.Service`). A service that
ends — by an error or by returning — ends the process with an error and the supervisor
starts a new one (crash-only; leases recover the work).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import psycopg

from kestrel import connections, db, statements
from kestrel.claimer import Claimer, Wakeups
from kestrel.config import Config, incarnation_id
from kestrel.definitions import WorkflowFn
from kestrel.lease import Heartbeat, Leases
from kestrel.loops import Service
from kestrel.runner import Runner, WorkerStats
from kestrel.schedule import schedules
from kestrel.services import Listener, Scheduler, Stats, Sweeper, Upkeep
from kestrel.sql import queries
from kestrel.versions import Registration, resolve_app_version

log = logging.getLogger("kestrel.worker")

__all__ = ["ServiceEnded", "Worker", "WorkerStats", "run_worker"]


class ServiceEnded(RuntimeError):
    """A worker service returned: services run for the life of the process."""


class Ticker:
    """Marks the event loop as running, for the heartbeat's watchdog: ``last`` is when the
    loop last ran it (monotonic)."""

    name = "ticker"

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last = time.monotonic()

    async def run(self) -> NoReturn:
        """Call :meth:`run_once` every *interval* seconds forever."""
        while True:
            self.run_once()
            await asyncio.sleep(self.interval)

    def run_once(self) -> None:
        """Mark the loop as running now."""
        self.last = time.monotonic()


class Worker:
    """Claim and run executions until :meth:`stop`; then drain. *cron*: whether it starts
    the app's cron ticks (a namespace's bucket 0 only, kestrel.buckets). *namespace*: the
    schemas of the namespace *cfg.schema* is a bucket of, by bucket (a workflow's signal to
    another execution goes to that one's bucket); by default *cfg.schema* alone."""

    def __init__(self, cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str,
                 collect_queue_stats: bool = False, stats_interval: float = 5.0,
                 cron: bool = True, namespace: list[str] | None = None) -> None:
        cfg = resolve_app_version(cfg, workflows)  # recorded by this worker's first claims
        self.cfg = cfg
        self.dsn = dsn
        # One id per process incarnation (host:pid:nonce), never reused: it is the lease
        # owner the supervisor releases when it reaps this process (FAULTS O8).
        self.id = cfg.worker_id or incarnation_id(os.getpid(), secrets.token_hex(4))
        self._q = queries(cfg.schema)
        self.leases = Leases()
        self.stats = WorkerStats()
        self._stopping = asyncio.Event()
        self._work = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._drain_timeout = cfg.drain_timeout
        self.ticker = Ticker(min(1.0, cfg.heartbeat / 2))
        self._pool = connections.make_pool(dsn, max_size=cfg.pool_size,
                                           name=f"kestrel-{self.id}",
                                           prepared=cfg.prepared_statements,
                                           lock_timeout=cfg.statement_lock_timeout,
                                           session=cfg.connection_mode == "direct")
        self._listen_dsn = cfg.notify_dsn(dsn)
        self._executor = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="kestrel-step")
        # Cron ticks start in one schema of a namespace (bucket 0's), or each tick would
        # start once per bucket.
        self._schedules = [s for s in schedules().values()
                           if cron and s.workflow in workflows]
        self._namespace = [queries(n) for n in namespace or [cfg.schema]]
        self.runner = Runner(cfg, workflows, pool=self._pool, q=self._q, leases=self.leases,
                             executor=self._executor, stats=self.stats, worker_id=self.id,
                             stopping=self._stopping, slot_freed=self._slot_freed,
                             namespace=self._namespace)
        self.checkpoints = self.runner.checkpoints
        self.completions = self.runner.completions
        self.claimer = Claimer(cfg, self.runner, pool=self._pool, workflows=sorted(workflows),
                               wakeups=Wakeups(self._stopping, self._work, self._slot_freed),
                               stalled=self._progressing, namespace=self._namespace,
                               owner=lambda: self.heartbeat.owner,
                               trust=lambda: self.heartbeat.trusted_until)
        self.sweeper = Sweeper(self._pool, self._q, cfg, self._work.set)
        self.upkeep = Upkeep(self._pool, self._q, cfg)
        self.scheduler = Scheduler(self._pool, self._q, cfg, self._schedules)
        self._stats = Stats(self._pool, self._q, workflows=sorted(workflows),
                            collect_queues=collect_queue_stats, interval=stats_interval,
                            running=lambda: len(self.leases), queues=cfg.queues)
        self.registration = Registration(self._pool, self._q, cfg, worker_id=self.id,
                                         workflows=sorted(workflows),
                                         collect=collect_queue_stats)
        self.heartbeat = Heartbeat(self.leases, dsn=dsn, q=self._q, owner=self.id,
                                   lease_s=cfg.lease,
                                   interval=cfg.heartbeat, prepared=cfg.prepared_statements,
                                   progressing=self._progressing,
                                   lock_timeout=cfg.statement_lock_timeout,
                                   session=cfg.connection_mode == "direct")

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self, *, drain_timeout: float | None = None) -> None:
        """Stop claiming; running executions get *drain_timeout* seconds, then are released."""
        if drain_timeout is not None:
            self._drain_timeout = drain_timeout
        self._stopping.set()
        self._work.set()
        self._slot_freed.set()

    async def _starting(self, step: Callable[[], Awaitable[None]]) -> None:
        """One step of the start, sent again while other transactions hold it up (a lock or
        statement timeout, FAULTS D10: the upserts are idempotent); any other failure fails
        the start, and the supervisor starts a new worker (a lost connection, say)."""
        while True:
            try:
                return await step()
            except psycopg.Error as exc:
                if not connections.is_contended(exc) or self._stopping.is_set():
                    raise
                log.warning("worker %s start waited too long on other transactions (%s: %s); "
                            "trying again", self.id, type(exc).__name__, str(exc).strip()[:200])
                await asyncio.sleep(self.cfg.poll_interval * random.uniform(0.8, 1.2))

    async def _register(self) -> None:
        """Write this process's queue limits and schedules (idempotent upserts). In a
        namespace of buckets, a queue's limits go to every bucket: its home bucket holds
        them for every claim of the queue (:func:`kestrel.buckets.home`), and each bucket's
        row tells the processes claiming there that the queue is limited, whether or not
        they declare it (FAULTS C4; `show` and the HTTP door read it too)."""
        ns = self._namespace
        async with self._pool.connection() as conn:
            for spec in self.claimer.declared:
                for q in ns:
                    await db.run(conn, statements.queues.upsert_queue_limit(
                        q, queue=spec.name, concurrency=spec.concurrency, rate=spec.rate,
                        period_s=spec.period, per_key=spec.per_key))
            if self._schedules:
                now = await db.run(conn, statements.queues.db_now(self._q))
                for sch in self._schedules:
                    await db.run(conn, statements.queues.upsert_schedule(
                        self._q, name=sch.name, cron=sch.cron.text, workflow=sch.workflow,
                        last_tick=now))

    def services(self) -> list[Service]:
        """The services this process runs beside the claimer for its whole life."""
        found: list[Service] = [self.heartbeat, self.checkpoints, self.completions,
                                self.sweeper, self.upkeep, self._stats, self.ticker,
                                self.registration]
        if self._schedules:
            found.append(self.scheduler)
        if self.cfg.listen and self._listen_dsn is not None:
            found.append(Listener(self._listen_dsn, self._q, self._work.set))
        return found

    async def run(self) -> None:
        """Run until :meth:`stop` is called, then drain and return. Raises if a service ends."""
        await self._pool.open(wait=False)
        # Everything after the pool opens is inside the try: a start that fails (a lost reply
        # to a registration statement, say) still closes the pool. An unclosed pool's
        # maintenance worker swallows the cancellation asyncio.run sends it while a
        # connection attempt is in flight and waits for ever: the embedding program hangs.
        try:
            await self._starting(self._register)
            # Live (claimable names known) before claiming; the gauges come with the rounds.
            await self._starting(self.registration.register)
            services = self.services()
            log.info("worker %s started: concurrency=%s batch_size=%d queues=%s wake-ups=%s "
                     "connections=%s prepared=%s app_version=%s", self.id,
                     self.cfg.concurrency or f"adaptive (from {self.claimer.slots.limit})",
                     self.cfg.batch_size, ",".join(self.cfg.queues),
                     "LISTEN/NOTIFY + polling" if any(s.name == "listener" for s in services)
                     else "polling only",
                     self.cfg.connection_mode, "yes" if self.cfg.prepared_statements else "no",
                     self.cfg.app_version)
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._service(service), name=service.name)
                         for service in services]
                await self.claimer.run()
                await self._drain()
                await _cancel_all(tasks)
        finally:
            for lease in self.leases:
                if lease.task is not None:
                    lease.task.cancel()
            await self.heartbeat.stop()  # stopped with its task, unless that never started
            await self.registration.unregister()
            await self._pool.close()
            self._executor.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped: %s", self.id, self.stats)

    @staticmethod
    async def _service(service: Service) -> None:
        name = service.name
        try:
            await service.run()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("worker service %s crashed; the worker exits", name)
            raise
        log.error("worker service %s returned; the worker exits", name)
        raise ServiceEnded(f"worker service {name} returned")

    def _progressing(self) -> str | None:
        """None while this process makes progress; else why not (heartbeat thread)."""
        now = time.monotonic()
        limit = self.cfg.lease
        if now - self.ticker.last > limit:
            return f"the event loop has not run for {now - self.ticker.last:.1f}s"
        for writer in (self.checkpoints.writer, self.completions.writer):
            stalled, why = writer.stall(now)
            if stalled > limit:
                return (f"the {writer.name} writer has made no progress for {stalled:.1f}s"
                        + (f" ({why} from the pool)" if why else ""))
        waited = self.runner.no_connection_for(now)
        if waited > limit:
            return f"a workflow's database call has had no connection from the pool for " \
                   f"{waited:.1f}s"
        return None

    async def _drain(self) -> None:
        tasks = [h.task for h in self.leases if h.task is not None]
        if tasks:
            log.info("draining %d running executions for up to %.1fs", len(tasks),
                     self._drain_timeout)
            if self._drain_timeout > 0:
                await asyncio.wait(tasks, timeout=self._drain_timeout)
        remaining = list(self.leases)
        for h in remaining:
            if h.task is not None:
                h.task.cancel()
        await asyncio.gather(*(h.task for h in remaining if h.task), return_exceptions=True)
        held = [h.key for h in remaining if not h.lost]
        # What was dropped without ending its claim (lost leases, attempts cut short): the
        # heartbeat ends their lease while it beats; it stops now, so that is done here.
        dropped = [k for k in self.leases.take_dropped() if k not in set(held)]
        self.heartbeat.paused = True  # released rows are not lost leases
        if dropped:
            try:
                async with self._pool.connection(timeout=5) as conn:
                    await db.run(conn, statements.executions.end_leases(self._q, held=dropped))
            except Exception as exc:  # they stay under the lease, which runs out now
                log.warning("could not end the lease of %d dropped executions (%s); the "
                            "sweeper takes them once this process's lease runs out",
                            len(dropped), exc)
        if held:
            try:
                async with self._pool.connection(timeout=5) as conn:
                    released = await db.run(conn, statements.executions.release_batch(
                        self._q, held=held))
            except Exception as exc:  # the leases will expire and the sweeper recovers them
                log.warning("could not release %d executions (%s); they will be recovered "
                            "when their leases expire", len(held), exc)
            else:
                self.stats.released += len(released)
                log.info("released %d executions back to the queue", len(released))
        self.leases.clear()


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel *tasks* and wait until each has ended, cancelling again every second those
    that have not: a cancellation can be lost (psycopg_pool hands a connection to a waiting
    client at the moment its task is cancelled, and the task goes on without ever seeing
    it: psycopg/psycopg#1275, #1345), and a service that goes on would hold the worker's
    stop for ever."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


def run_worker(cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str,
               install_signals: bool = True, collect_queue_stats: bool = False,
               cron: bool = True, namespace: list[str] | None = None) -> WorkerStats:
    """Run a worker on a fresh uvloop event loop until SIGTERM/SIGINT; return its stats.
    *cron* and *namespace*: as :class:`Worker` takes them."""
    import gc
    import signal

    import uvloop

    async def main() -> WorkerStats:
        worker = Worker(cfg, workflows, dsn=dsn, collect_queue_stats=collect_queue_stats,
                        cron=cron, namespace=namespace)
        if install_signals:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, worker.stop)
            loop.add_signal_handler(signal.SIGINT, worker.stop)
            # The supervisor died (PR_SET_PDEATHSIG or the ppid poll): release and exit now.
            loop.add_signal_handler(signal.SIGUSR1, lambda: worker.stop(drain_timeout=0))
        await worker.run()
        return worker.stats

    # The app, kestrel and their libraries are loaded: keep their objects out of every
    # collection, and collect the young generation every 10,000 allocations rather than 700,
    # so the objects of executions in flight (a few ms old) mostly die before one looks at
    # them (issue 23: -2% of a worker's CPU, BENCHMARKS.md). Cycles are still collected.
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    return uvloop.run(main())
