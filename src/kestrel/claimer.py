"""The claimer: claims due executions into this process's free slots.

One claim statement takes up to ``min(free slots, batch_size)`` executions of the queues
without limits; each limited queue is claimed on its own under its row lock, and a queue that
came back short is looked at again only after a poll interval. A process takes at most one
suspect (an execution that already lost two workers) at a time. Idle, it waits for a
wake-up (LISTEN, the sweeper) or the poll interval, whichever comes first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from kestrel import buckets, connections, db, metrics, statements
from kestrel.config import Config
from kestrel.failpoints import failpoint
from kestrel.lease import Lease
from kestrel.loops import Backoff
from kestrel.outage import OUTAGE
from kestrel.queues import QueueSpec
from kestrel.runner import Runner
from kestrel.slots import Slots
from kestrel.sql import Queries, queries
from kestrel.types import Claimed

log = logging.getLogger("kestrel.worker")


@dataclass(frozen=True, slots=True)
class ClaimRound:
    """What one round of claims did: how many it claimed, and whether a claim came back
    full (so there is probably more to claim right away)."""

    claimed: int
    more: bool


@dataclass(frozen=True, slots=True)
class Wakeups:
    """What the claimer waits for, set by the rest of the worker."""

    stopping: asyncio.Event
    """The worker stops: claim nothing more."""
    work: asyncio.Event
    """There may be work to claim (a notification, the sweeper re-queued some)."""
    slot_freed: asyncio.Event
    """An execution ended: a full process has a slot again."""


class Claimer:
    """Claims into free slots until the worker stops, and starts what it claimed on
    *runner*, whose leases (their count is the slots taken) and stats it shares; the claims
    take *workflows* of ``cfg.queues`` under the process's lease, named by *owner()*
    (``runner.id`` by default). *stalled* says why the process makes no progress (None
    while it does)."""

    name = "claimer"

    def __init__(self, cfg: Config, runner: Runner, *, pool: AsyncConnectionPool[Any],
                 workflows: list[str], wakeups: Wakeups,
                 stalled: Callable[[], str | None] = lambda: None,
                 namespace: list[Queries] | None = None,
                 owner: Callable[[], str] | None = None,
                 trust: Callable[[], float] | None = None) -> None:
        self.cfg = cfg
        self._runner = runner
        self.id = runner.id
        # The name of the process's lease its claims renew (the heartbeat's: a new one once
        # a lease ran out, kestrel.lease.Heartbeat).
        self._owner = owner or (lambda: self.id)
        # Until when (monotonic) that lease is surely ours (the heartbeat's): a claim renews
        # nothing, so it claims only while the lease has a heartbeat interval left, and
        # trusts what it claimed no longer than the lease.
        self._trust = trust or (lambda: math.inf)
        self.leases = runner.leases
        self.stats = runner.stats
        self._pool = pool
        self._q = queries(cfg.schema)
        # Every bucket's schema, by bucket, in a namespace: a limited queue's limits hold
        # across all of them (statements.queues.claim_limited).
        self._namespace = namespace or [self._q]
        self._names = workflows
        self._stopping = wakeups.stopping
        self._work = wakeups.work
        self._slot_freed = wakeups.slot_freed
        self._stalled = stalled
        specs = cfg.queue_specs()
        # The limits this process declares (its code's kestrel.queue, --queue-limits): its
        # start writes them (Worker._register), and they are the limits it claims under
        # until it first looks at the database's (:meth:`look_at_limits`).
        self.declared: list[QueueSpec] = [specs[q] for q in cfg.queues
                                          if q in specs and specs[q].limited]
        self._limited_retry: dict[str, float] = {}
        self._limits_seen_at = -math.inf
        self._use_limits({spec.name: spec for spec in self.declared})
        self.slots = Slots(cfg.concurrency or None, work=runner.committed)
        metrics.get().concurrency_limit.set(self.slots.limit)

    async def run(self) -> None:
        """Claim until the worker stops; a failed claim backs off and tries again."""
        backoff = Backoff()
        while not self._stopping.is_set():
            limit = self.slots.limit
            self.slots.observe(len(self.leases))
            if self.slots.limit != limit:
                metrics.get().concurrency_limit.set(self.slots.limit)
            free = self.slots.limit - len(self.leases)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            if self._trust() - time.monotonic() < self.cfg.heartbeat:
                # No lease yet (the first beat is on its way), or one about to run out
                # that the heartbeat could not extend: what it claimed would be cancelled
                # before it ran.
                await self._sleep_unless_stopping(min(0.05, self.cfg.poll_interval))
                continue
            if self._stalled() is not None:
                # A writer is stuck: the heartbeat no longer certifies this process, so a
                # fresh claim would only be a fresh lease on stuck work (FAULTS L2).
                await self._sleep_unless_stopping(self.cfg.poll_interval)
                continue
            try:
                more = (await self.run_once(free)).more
            except Exception as exc:
                delay = backoff.next_delay()
                if connections.is_transient(exc):
                    OUTAGE.failed(exc, "claim")  # one line per outage, not one per retry
                elif connections.is_contended(exc):
                    # A client or an operator holds what the claim locks (a Citus move
                    # blocking writes, a queue's limit row): nothing is wrong with it.
                    log.warning("claim waited too long on other transactions (%s: %s); "
                                "retrying in %.2fs", type(exc).__name__,
                                str(exc).strip()[:200], delay)
                else:
                    log.error("claim failed (%s: %s); retrying in %.2fs", type(exc).__name__,
                              str(exc).strip()[:200], delay)
                await self._sleep_unless_stopping(delay)
                continue
            OUTAGE.succeeded()
            backoff.reset()
            if not more:
                self.slots.short()
                await self._wait_for_work()

    def _use_limits(self, found: dict[str, QueueSpec]) -> None:
        """Claim the served queues in *found* (their limits, by queue) one at a time under
        their row lock, and the rest in one claim statement. A process's ``per_process``
        is its own: kept from its declaration."""
        mine = {spec.name: spec for spec in self.declared}
        self.limited = [dataclasses.replace(found[q], per_process=mine[q].per_process)
                        if q in mine else found[q] for q in self.cfg.queues if q in found]
        self._unlimited = [q for q in self.cfg.queues if q not in found]
        # Each limited queue's home bucket in a namespace, where its limits are held.
        ns = self._namespace
        self._homes = {spec.name: ns[buckets.home(spec.name, len(ns))] for spec in self.limited}
        self._keyed = {spec.name: spec.per_key is not None for spec in self.limited}

    async def look_at_limits(self) -> None:
        """Claim under the limits in the database: a queue's row in ``queue_limits``, written
        by whichever worker declared it, is the limit, also for a process that does not
        declare it (a rolling deploy, another service serving the queue); a queue whose row
        an operator removed (``kestrel-runtime remove-limits``) is claimed unlimited. The
        claim of the unlimited queues leaves out a queue with a row in the meantime
        (claim_batch), so a limit holds from the moment it is written (FAULTS C4)."""
        async with self._pool.connection() as conn:
            found = await db.run(conn, statements.queues.limits_of(self._q,
                                                                   queues=self.cfg.queues))
        self._use_limits({name: QueueSpec(name=name, **limits)
                          for name, limits in found.items()})
        self._limits_seen_at = time.monotonic()

    async def run_once(self, free: int | None = None) -> ClaimRound:
        """Claim into *free* slots (by default, every slot not taken), from the unlimited
        queues and each limited one, after a look at the limits once a heartbeat interval."""
        if time.monotonic() - self._limits_seen_at >= self.cfg.heartbeat:
            await self.look_at_limits()
        if free is None:
            free = self.slots.limit - len(self.leases)
        more = False
        total = 0
        if self._unlimited:
            limit = min(free, self.cfg.batch_size)
            got = await self._claim(limit, None)
            total += got
            more = got == limit
        for spec in self.limited:
            # A limited queue that came back short (at its limit, empty, or busy with another
            # claimer) is tried again after a poll interval, so the unlimited queues' claim
            # loop does not pay for it on every round.
            if time.monotonic() < self._limited_retry.get(spec.name, 0.0):
                continue
            room = self.slots.limit - len(self.leases)
            if spec.per_process is not None:
                mine = sum(1 for h in self.leases if h.queue == spec.name)
                room = min(room, spec.per_process - mine)
            limit = min(room, self.cfg.batch_size)
            if limit > 0:
                got = await self._claim(limit, spec.name)
                total += got
                more = more or got == limit
                if got < limit:
                    self._limited_retry[spec.name] = time.monotonic() + (
                        self.cfg.poll_interval * random.uniform(0.8, 1.2))
        return ClaimRound(total, more)

    async def _claim(self, limit: int, queue: str | None) -> int:
        """One claim statement (of a limited *queue*, or of the unlimited ones); start what
        it returns. Returns how many were claimed; 0 when a limited queue's row is busy
        (its holder is claiming; this process looks again after the poll interval)."""
        sent = time.monotonic()
        self.leases.claiming += 1
        try:
            claimed = await self._send_claim(limit, queue)
        except Exception:
            # Its reply lost, the claim may have committed rows under this process's
            # lease that nobody here runs: the heartbeat looks (Leases.adopt).
            self.leases.audit = True
            raise
        finally:
            self.leases.claiming -= 1
        if claimed is None:
            return 0  # another process is claiming from the limited queue right now
        m = metrics.get()
        m.claim_seconds.observe(time.monotonic() - sent)
        if claimed:
            m.claim_batch.observe(len(claimed))
        self.stats.claims += 1
        self.stats.claimed += len(claimed)
        for c in claimed:
            if c.attempt == 1 and not c.steps and c.wait_step is None:
                m.child(m.started, c.workflow).inc()
                if c.db_now is not None and c.created_at is not None:
                    m.child(m.submit_to_start, c.workflow).observe(
                        max(0.0, (c.db_now - c.created_at).total_seconds()))
            trusted = min(sent + self.cfg.lease, self._trust())
            self._runner.start(Lease(c, trusted_until=trusted, claimed_at=sent, queue=queue,
                                     cancel_requested=c.cancel_requested))
        return len(claimed)

    async def _send_claim(self, limit: int, queue: str | None) -> list[Claimed] | None:
        """The claim statement itself: its rows, or None when a limited queue's row is
        busy."""
        async with self._pool.connection() as conn:
            if queue is None:
                claimed: list[Claimed] | None = await db.run(
                    conn, statements.executions.claim_batch(
                        self._q, owner=self._owner(), queues=self._unlimited, limit=limit,
                        lease_s=self.cfg.lease, workflows=self._names,
                        max_history_bytes=self.cfg.max_history_bytes,
                        take_suspect=not self._holds_suspect(),
                        app_version=self.cfg.app_version))
            else:
                claimed = await db.run_script(conn, statements.queues.claim_limited(
                    self._q, queue=queue, owner=self._owner(), limit=limit,
                    lease_s=self.cfg.lease, workflows=self._names,
                    max_history_bytes=self.cfg.max_history_bytes,
                    app_version=self.cfg.app_version, namespace=self._namespace,
                    home=self._homes[queue], keyed=self._keyed[queue]))
            failpoint("after_claim_commit")
        return claimed

    def _holds_suspect(self) -> bool:
        # attempt counts this claim, so a suspect arrives with attempt > SUSPECT_AFTER.
        return any(h.claimed.attempt > statements.executions.SUSPECT_AFTER for h in self.leases)

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
