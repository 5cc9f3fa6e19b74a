"""The periodic services of a worker process: sweeper, partition upkeep, scheduler, stats
and the LISTEN connection.

Each has the one shape of a worker's services (:class:`kestrel.loops.Service`): a ``name``;
``run_once()`` does one round and returns what it did (tests and the stats use it); ``run()``
repeats it forever. A round that fails because the database is
unreachable, or because one statement was refused, is logged and tried again next round: a
periodic service never turns one bad round into a crash loop. Anything else escaping
``run()`` — or ``run()`` returning at all — is a bug, and the worker's task group turns it
into a crash of the whole process, which the supervisor restarts (FAULTS L1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import psycopg
from psycopg_pool import AsyncConnectionPool

from kestrel import codec, connections, db, forms, metrics, statements
from kestrel.config import Config
from kestrel.failpoints import failpoint
from kestrel.loops import Backoff, every
from kestrel.outage import OUTAGE
from kestrel.schedule import Schedule, due_ticks
from kestrel.sql import Queries

log = logging.getLogger("kestrel.worker")

Pool = AsyncConnectionPool[Any]


class Sweeper:
    """Re-enqueue executions whose lease expired; quarantine those out of attempts; fail
    queued and waiting executions past their deadline."""

    name = "sweeper"

    def __init__(self, pool: Pool, q: Queries, cfg: Config, on_work: Callable[[], None]) -> None:
        self._pool, self._q, self._cfg, self._on_work = pool, q, cfg, on_work

    async def run(self) -> NoReturn:
        """Call :meth:`run_once` forever, a jittered ``--sweep-interval`` apart.

        Each gap is 0.5 to 1 times the interval; a round the database failed is logged.
        """
        await every(lambda: self._cfg.sweep_interval * random.uniform(0.5, 1.0),
                     self.run_once, "sweep")

    async def run_once(self) -> tuple[int, int]:
        """One sweep in bounded passes; return (requeued, quarantined)."""
        failpoint("sweeper_round")
        requeued = quarantined = 0
        limit = 500
        while True:
            async with self._pool.connection() as conn:
                r = await db.run(conn, statements.sweeper.reenqueue_expired(
                    self._q, limit=limit, max_attempts=self._cfg.max_attempts,
                    delegated=await forms.delegated(conn, self._q)))
            requeued += r.requeued
            quarantined += r.quarantined
            if r.examined < limit:
                break
        while True:
            async with self._pool.connection() as conn:
                expired = await db.run(conn, statements.sweeper.expire_deadlines(
                    self._q, limit=limit, delegated=await forms.delegated(conn, self._q)))
            if expired:
                log.info("failed %d queued or waiting executions past their deadline", expired)
            if expired < limit:
                break
        if requeued:
            metrics.get().leases_expired.inc(requeued)
            log.info("sweeper re-enqueued %d executions with expired leases", requeued)
            self._on_work()
        if quarantined:
            metrics.get().quarantined.inc(quarantined)
            log.warning("sweeper quarantined %d executions that exhausted max_attempts=%d",
                        quarantined, self._cfg.max_attempts)
        return requeued, quarantined


class Upkeep:
    """History partition upkeep (create ahead, drop past retention), one process at a time.

    Under a least-privilege runtime role upkeep is the schema owner's job: the service then
    stands down — it stays alive and idle, it does not return (FAULTS L1)."""

    name = "upkeep"

    def __init__(self, pool: Pool, q: Queries, cfg: Config) -> None:
        self._pool, self._q, self._cfg = pool, q, cfg
        self.stood_down = False
        self._asked = False  # whether this role may run upkeep's DDL, asked once

    async def run(self) -> NoReturn:
        """Call :meth:`run_once` forever, a jittered ``--maintenance-interval`` apart.

        Each gap is 0.5 to 1 times the interval; a round the database failed is logged.
        """
        await every(lambda: self._cfg.maintenance_interval * random.uniform(0.5, 1.0),
                     self.run_once, "history partition upkeep")

    async def run_once(self) -> tuple[bool, int, int]:
        """One upkeep round unless another process is doing it (or this role may not)."""
        if self.stood_down:
            return False, 0, 0
        try:
            async with self._pool.connection() as conn:
                if not self._asked:
                    # Asked before it is tried: DDL this role may not run would leave an
                    # ERROR in the server's log (on Citus, in each worker node's).
                    if not await db.run(conn, statements.migrate.may_migrate(self._q)):
                        raise psycopg.errors.InsufficientPrivilege("not the schema's owner")
                    self._asked = True
                ran, created, dropped = await db.run_script(
                    conn, statements.history.run_maintenance(
                        self._q, interval=self._cfg.history_interval,
                        ahead=self._cfg.history_ahead,
                        retention_days=self._cfg.history_retention_days))
        except psycopg.errors.LockNotAvailable:
            # lock_timeout: something held the history table; try again next round.
            log.warning("history partition upkeep skipped (a lock was busy)")
            return False, 0, 0
        except psycopg.errors.InsufficientPrivilege:
            self.stood_down = True
            log.warning("history partition upkeep needs the schema owner's rights; run "
                        "`kestrel-runtime partitions` as the owner (e.g. from cron)")
            return False, 0, 0
        if created or dropped:
            log.info("history partitions: created %d, dropped %d", created, dropped)
        return ran, created, dropped


class Scheduler:
    """Start every due cron tick of the schedules this process knows, once across the fleet."""

    name = "scheduler"

    def __init__(self, pool: Pool, q: Queries, cfg: Config, schedules: list[Schedule]) -> None:
        self._pool, self._q, self._cfg, self._schedules = pool, q, cfg, schedules

    async def run(self) -> NoReturn:
        """Call :meth:`run_once` forever, sleeping until the next tick it reports.

        Each sleep is jittered by up to 10%; after a round the database failed it lasts
        ``--poll-interval``.
        """
        while True:
            try:
                wait = await self.run_once()
            except psycopg.Error as exc:
                if connections.is_transient(exc):
                    OUTAGE.failed(exc, "scheduler")
                else:
                    log.warning("scheduler round failed (%s)", type(exc).__name__)
                wait = self._cfg.poll_interval
            await asyncio.sleep(wait * random.uniform(0.9, 1.1))

    async def run_once(self) -> float:
        """Start every due tick this process wins; return seconds until the next tick."""
        nearest = self._cfg.poll_interval
        async with self._pool.connection() as conn:
            now = await db.run(conn, statements.queues.db_now(self._q))
            for sch in self._schedules:
                last = await db.run(conn, statements.queues.get_schedule(self._q, name=sch.name))
                if last is None:
                    continue
                for tick in due_ticks(sch.cron, last, now, sch.catch_up):
                    iso = tick.isoformat()
                    params = statements.client.submit_params(
                        workflow=sch.workflow, args=codec.encode([iso], what="tick"),
                        queue=sch.queue, priority=0,
                        idempotency_key=f"kestrel.cron:{sch.name}:{iso}")
                    if not await db.run_script(conn, statements.queues.start_tick(
                            self._q, name=sch.name, seen=last, tick=tick, params=params)):
                        break  # another process started it (and will start the rest)
                    log.info("schedule %s: started the %s tick", sch.name, iso)
                    last = tick
                until = (sch.cron.next_after(max(last, now)) - now) / timedelta(seconds=1)
                nearest = min(nearest, max(until, 0.05))
        return nearest


MAX_WAITING_SERIES = 100
"""Most (workflow, waiting_for) label sets the waiting gauge exports from one process."""


class Stats:
    """Every few seconds: this process's pool and running gauges; in the one process chosen
    by the supervisor, queue depth from one cheap query for the whole fleet."""

    name = "stats"

    def __init__(self, pool: Pool, q: Queries, *, workflows: list[str], collect_queues: bool,
                 interval: float, running: Callable[[], int],
                 queues: tuple[str, ...] = ()) -> None:
        self._pool, self._q = pool, q
        self._workflows = workflows
        self._collect_queues = collect_queues
        self._interval = interval
        self._running = running
        # The queues this runtime serves have a depth and an oldest age (0) from the first
        # round, not only once something queued there (a dashboard panel said "No data").
        self._known: set[tuple[str, str]] = {(queue, "queued") for queue in queues}
        self._known_waits: set[tuple[str, str]] = set()
        # Counting finishes no worker saw: this collector's name, and the finish ids it has
        # counted and not yet seen deleted (acknowledged in the next round).
        self._collector = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._counted: set[int] = set()

    async def run(self) -> NoReturn:
        """Call :meth:`run_once` every *interval* seconds forever.

        First marks the worker up and creates the known label values, at 0.
        """
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
            m.deadlines.labels(wf)
        while True:
            await self.run_once()
            await asyncio.sleep(self._interval)

    async def run_once(self) -> None:
        """Set the pool and running gauges; in the collecting process, the queue gauges too.

        The queue gauges are the depth and the oldest queued age (0 for what emptied); a failed
        query skips them this round.
        """
        m = metrics.get()
        stats = self._pool.get_stats()
        size, idle = stats.get("pool_size", 0), stats.get("pool_available", 0)
        m.pool.labels("in_use").set(size - idle)
        m.pool.labels("idle").set(idle)
        m.pool.labels("waiting").set(stats.get("requests_waiting", 0))
        m.running.set(self._running())
        if not self._collect_queues:
            return
        try:
            async with self._pool.connection() as conn:
                rows = await db.run(conn, statements.client.queue_stats(self._q))
                acked = sorted(self._counted)
                finishes = await db.run(conn, statements.history.take_uncounted_finishes(
                    self._q, workflows=self._workflows, collector=self._collector,
                    acked=acked))
        except psycopg.Error:
            return  # what that round took comes back next round (it was not acknowledged)
        self._counted.difference_update(acked)  # deleted by that round
        for finish_id, wf, status, deadline in finishes:
            if finish_id in self._counted:
                continue
            self._counted.add(finish_id)
            m.finished.labels(wf, status).inc()
            if deadline:
                m.deadlines.labels(wf).inc()
        seen = set()
        for row in rows:
            seen.add((row.queue, row.status))
            m.queue_depth.labels(row.queue, row.status).set(row.count)
            if row.oldest_age_s is not None:
                m.oldest_queued.labels(row.queue).set(row.oldest_age_s)
        for queue, status in self._known - seen:
            m.queue_depth.labels(queue, status).set(0)
            if status == "queued":
                m.oldest_queued.labels(queue).set(0)
        self._known |= seen
        await self._collect_waiting()

    async def _collect_waiting(self) -> None:
        """Set the waiting gauge: executions waiting, by workflow and what they wait for.

        Signal names come from workflow code but may be built at run time, so the label sets
        this process ever exports are capped (MAX_WAITING_SERIES): past the cap, new names
        count under ``other`` (FAULTS S2: labels stay bounded).
        """
        m = metrics.get()
        try:
            async with self._pool.connection() as conn:
                rows = await db.run(conn, statements.waits.waiting_stats(
                    self._q, workflows=self._workflows, limit=MAX_WAITING_SERIES))
        except psycopg.Error:
            return
        counts: dict[tuple[str, str], int] = {}
        for workflow, waiting_for, n in rows:
            key = (workflow, waiting_for)
            if key not in self._known_waits and len(self._known_waits) >= MAX_WAITING_SERIES:
                key = (workflow, "other")
            counts[key] = counts.get(key, 0) + n
        for key in self._known_waits - counts.keys():
            m.waiting.labels(*key).set(0)
        for key, n in counts.items():
            m.waiting.labels(*key).set(n)
        self._known_waits |= counts.keys()


class Listener:
    """LISTEN for submissions and wake-ups on a direct connection; polling runs regardless,
    so a lost connection costs latency only."""

    name = "listener"

    def __init__(self, dsn: str, q: Queries, on_work: Callable[[], None]) -> None:
        self._dsn, self._q, self._on_work = dsn, q, on_work
        self._backoff = Backoff(base=0.2, cap=10.0)

    async def run(self) -> NoReturn:
        """LISTEN forever (:meth:`run_once`), calling *on_work* on each (re)connect and each
        notification.

        Reconnects with backoff when the connection is lost.
        """
        backoff = self._backoff
        while True:
            try:
                await self.run_once()
            except (psycopg.Error, OSError) as exc:
                delay = backoff.next_delay()
                if connections.is_transient(exc):
                    OUTAGE.failed(exc, "LISTEN")
                else:
                    log.warning("LISTEN connection lost (%s); polling until it is back in "
                                "%.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)

    async def run_once(self) -> None:
        """One connection's life: connect, LISTEN, call *on_work* once (anything submitted
        while nobody listened) and on each notification, until the connection is lost (which
        raises)."""
        conn = await connections.connect_async(
            self._dsn, link=True, application_name="kestrel-listen")
        async with conn:
            await db.run(conn, statements.notify.listen(self._q))
            OUTAGE.succeeded(pooled=False)
            self._backoff.reset()
            self._on_work()  # anything submitted while we were not listening
            async for _ in conn.notifies():
                self._on_work()
