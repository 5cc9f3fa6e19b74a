"""Execution leases held by one worker process, and the heartbeat that keeps them.

Inside a process an execution is identified by ``(id, epoch)``, never by its id alone: after
an outage longer than the lease the same process may claim the same execution again, and the
stale coroutine must never inherit the new claim (FAULTS X5). :class:`Lease` is the handle a
running execution holds; :class:`Leases` is the process's table of them.

Trust. A claim or heartbeat sent at monotonic time ``t`` makes the lease good until
``t + lease`` on the database clock, which started counting no earlier than ``t``. So until
``t + lease`` by this process's monotonic clock the lease is surely still ours; past that the
execution may belong to someone else and no new step starts. A run whose trust would end
before the next beat could renew it is cancelled first, so its step body is stopped before
the sweeper can hand the execution to another worker (FAULTS C3). Whatever a stale worker still
sends is fenced by the epoch in the database.

The heartbeat runs on a thread of its own with a connection of its own, so that a step
blocking the event loop for a while (CPU-bound code in an ``async def``) does not let its
lease lapse (FAULTS F8). It certifies progress, not just a live process: a watchdog stops
extending the leases once the event loop or a writer has made no progress for a whole lease,
so work stuck in a hung process is recovered by the sweeper (FAULTS L2); a writer or a
workflow call that gets no connection from the process's pool counts as such a stall
(FAULTS R3).

A process holds one lease, a row of its own that only the runtime writes (``leases``,
migration 0026); every execution it claims runs under it. The heartbeat extends that row
and reads, without locking them, which of its executions are still its own: nothing that
holds an execution's row (the worker's own checkpoint batches, a client's ``signal()`` in a
transaction left open) can delay a beat, so no lease lapses because of it (FAULTS C2, C3,
O4). A lease that ran out is never extended again: the sweeper may be re-queuing its rows.
The process then drops every execution and goes on under a new name (``owner~1``, …).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg

from kestrel import connections, db, metrics, statements
from kestrel.loops import Backoff
from kestrel.outage import OUTAGE
from kestrel.sql import Queries
from kestrel.types import Claimed

log = logging.getLogger("kestrel.lease")


class LeaseState(enum.Enum):
    """Where a claim is in this process."""

    HELD = "held"
    FINISHING = "finishing"  # the statement that ends the claim (complete, park) is on its way
    LOST = "lost"  # expired, re-claimed or superseded: write nothing more


@dataclass(eq=False)
class Lease:
    """One claim of one execution: ``(id, epoch)``, its trust clock and its task."""

    claimed: Claimed
    trusted_until: float
    claimed_at: float
    queue: str | None = None  # set for executions of limited queues (per-process counts)
    state: LeaseState = LeaseState.HELD
    cancel_requested: bool = False
    # The deadline timer cancelled the workflow; once it ended, whether the deadline is what
    # ended it (the runner counts those finishes).
    deadline_hit: bool = False
    # The deadline passed while the statement that ends the claim was on its way; enforced
    # if that statement does not end it after all (a park that finds a signal, FAULTS O7).
    deadline_due: bool = False
    task: asyncio.Task[None] | None = None
    deadline_timer: asyncio.TimerHandle | None = None
    # A statement ended the claim (completed, failed, parked, given back, released): what
    # ends here without one is dropped, and its lease ended (Leases.drop).
    ended: bool = False

    @property
    def key(self) -> tuple[uuid.UUID, int]:
        """``(id, epoch)``: the claim's identity in this process."""
        return self.claimed.id, self.claimed.epoch

    @property
    def lost(self) -> bool:
        """Whether the lease was lost: write nothing more."""
        return self.state is LeaseState.LOST

    @property
    def finishing(self) -> bool:
        """Whether the statement that ends the claim (a completion or a park) is on its way."""
        return self.state is LeaseState.FINISHING

    def trusted(self) -> bool:
        """Whether the lease is surely still ours (this process's monotonic clock)."""
        return self.state is not LeaseState.LOST and time.monotonic() < self.trusted_until

    def finish(self) -> None:
        """Mark the statement that ends the claim as on its way, if the lease is held.

        A heartbeat that no longer finds the row, and the deadline timer, then leave it alone.
        """
        if self.state is LeaseState.HELD:
            self.state = LeaseState.FINISHING

    def unfinish(self) -> None:
        """Undo :meth:`finish`: that statement did not end the claim, so it is held again."""
        if self.state is LeaseState.FINISHING:
            self.state = LeaseState.HELD

    def lose(self, why: str) -> bool:
        """Mark the lease lost and cancel its execution; False if it already was."""
        if self.state is LeaseState.LOST:
            return False
        self.state = LeaseState.LOST
        log.warning("lease on %s (epoch %d) was lost (%s); abandoning it", self.claimed.id,
                    self.claimed.epoch, why)
        if self.task is not None:
            self.task.cancel()
        return True


class Leases:
    """The claims this process holds, one current claim per execution id."""

    def __init__(self) -> None:
        self._by_id: dict[uuid.UUID, Lease] = {}
        # Claims dropped here without a statement that ended them (a lost lease, a run cut
        # short): the row may still run under this process's lease, which its heartbeat
        # keeps alive, so nobody else would ever take it. The heartbeat ends their lease.
        self._dropped: list[tuple[uuid.UUID, int]] = []
        self._dropped_lock = threading.Lock()
        # A claim whose reply was lost may have committed rows under this process's lease
        # that nobody here runs: the heartbeat then reads what runs under the lease and the
        # event loop drops what it does not hold (:meth:`adopt`), once no claim is on its way.
        self.audit = False
        self.claiming = 0  # claim statements on their way

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def add(self, lease: Lease) -> None:
        """Hold *lease*; an older claim of the same execution still held here is lost."""
        old = self._by_id.get(lease.claimed.id)
        if old is not None and old is not lease:
            old.lose(f"re-claimed here under epoch {lease.claimed.epoch}")
        self._by_id[lease.claimed.id] = lease

    def remove(self, lease: Lease) -> None:
        """Forget *lease* if it is still the current claim of its execution."""
        if self._by_id.get(lease.claimed.id) is lease:
            del self._by_id[lease.claimed.id]

    def current(self, lease: Lease) -> bool:
        """Whether *lease* is still the current claim of its execution."""
        return self._by_id.get(lease.claimed.id) is lease

    def trusted(self, id: uuid.UUID, epoch: int) -> bool:
        """Whether this process holds claim ``(id, epoch)`` and still trusts it."""
        lease = self._by_id.get(id)
        return lease is not None and lease.claimed.epoch == epoch and lease.trusted()

    def clear(self) -> None:
        """Forget every claim (at the end of a drain)."""
        self._by_id.clear()

    def adopt(self, running: list[tuple[uuid.UUID, int]]) -> int:
        """After a lost claim reply: of *running* (what runs under this process's lease), drop
        what is not held here, for its lease to be ended. The event loop calls it, so a
        claim whose rows are being started is not half seen. Returns how many; none while a
        claim is on its way (its rows are not held yet), when the audit stays asked for."""
        if self.claiming:
            return 0
        self.audit = False
        orphans = [(eid, epoch) for eid, epoch in running
                   if not ((h := self._by_id.get(eid)) and h.claimed.epoch == epoch)]
        for key in orphans:
            self.drop_key(key)
        return len(orphans)

    def drop(self, lease: Lease) -> None:
        """Note that *lease* ends here without a statement that ended its claim: it is to be
        handed to the heartbeat (:meth:`take_dropped`), which ends its lease."""
        self.drop_key(lease.key)

    def drop_key(self, key: tuple[uuid.UUID, int]) -> None:
        """:meth:`drop`, by ``(id, epoch)``."""
        with self._dropped_lock:
            self._dropped.append(key)

    def take_dropped(self) -> list[tuple[uuid.UUID, int]]:
        """The claims dropped since the last call (thread-safe: the heartbeat calls it)."""
        with self._dropped_lock:
            taken, self._dropped = self._dropped, []
        return taken


class Heartbeat:
    """The heartbeat: one statement extends every held lease, while the process makes
    progress, on a thread and a connection of its own.

    A worker's service (:class:`kestrel.loops.Service`): ``run()`` keeps the thread beating
    for as long as it runs, ``run_once()`` is one beat. *progressing* is called on the
    thread before each beat and returns None while the process makes progress, or why it
    does not.
    """

    name = "heartbeat"

    def __init__(self, leases: Leases, *, dsn: str, q: Queries, owner: str, lease_s: float,
                 interval: float, prepared: bool, progressing: Callable[[], str | None],
                 lock_timeout: float | None = None, session: bool = True) -> None:
        self._leases = leases
        self._dsn = dsn
        self._q = q
        self._base = owner
        self._renamed = 0
        self.owner = owner  # the name this process's lease goes by now (its claims' owner)
        # Until when (monotonic) the lease is surely still ours: a beat sent at t that took or
        # extended it makes it good until t + lease on the database clock. A claim renews
        # nothing, so what it claims is trusted no longer than this (kestrel.claimer).
        self.trusted_until = 0.0
        self._lease_s = lease_s
        self._interval = interval
        self._prepared = prepared
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._progressing = progressing
        self._lock_timeout = lock_timeout
        self._session = session
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kestrel-heartbeat",
                                        daemon=True)
        self.paused = False  # set while releasing: released rows are not lost leases
        self.stalled: str | None = None

    async def run(self) -> NoReturn:
        """Beat on the heartbeat thread for as long as this runs; stop the thread when it is
        cancelled. A thread of its own, so that a step blocking the event loop does not let
        the leases lapse (FAULTS F8)."""
        self.start()
        never = asyncio.Event()
        try:
            while True:
                await never.wait()
        finally:
            await self.stop()

    def start(self) -> None:
        """Start the heartbeat thread; it hands lost leases to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self) -> None:
        """Stop the heartbeat thread and wait for it to end, off the event loop.

        Waits at most one interval plus 5 s.
        """
        self._stop.set()
        if self._thread.ident is not None:  # started
            await asyncio.to_thread(self._thread.join, self._interval + 5)

    def run_once(self) -> None:
        """One beat (:meth:`beat`) on the heartbeat's own connection, opened first if there
        is none; blocking (the thread calls it). A failed beat closes the connection (the
        next opens a new one) and raises."""
        try:
            if self._conn is None:
                self._conn = connections.connect(
                    self._dsn, link=True, lock_timeout=self._lock_timeout,
                    session=self._session, application_name="kestrel-heartbeat",
                    prepare_threshold=0 if self._prepared else None,
                    connect_timeout=max(1, int(self._interval)))
            self.beat(self._conn)
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            raise

    def beat(self, conn: psycopg.Connection[Any]) -> None:
        """Extend the process's lease in one statement, idle or not (an idle process's next
        claim needs it live); hand the executions that are no longer ours to the event loop
        to abandon. Extends nothing while the process is not progressing."""
        stalled = self._progressing()
        if stalled is not None:
            if self.stalled is None:
                log.error("not extending leases: %s; the sweeper will recover this "
                          "process's executions", stalled)
                metrics.get().stalls.inc()
            self.stalled = stalled
            return
        if self.stalled is not None:
            log.warning("progress resumed; extending leases again")
            self.stalled = None
        if self.paused:
            return
        snapshot = [h for h in self._leases if not h.lost]
        sent = time.monotonic()
        beat = db.run_script_sync(conn, statements.executions.heartbeat(
            self._q, owner=self.owner, held=[h.key for h in snapshot], lease_s=self._lease_s))
        if not beat.renewed:
            self._rename(conn, len(snapshot))
            gone = snapshot
        else:
            self.trusted_until = sent + self._lease_s
            gone = []
            for h in snapshot:
                if h.claimed.id not in beat.owned:
                    gone.append(h)
                    continue
                h.trusted_until = sent + self._lease_s
                if beat.owned[h.claimed.id]:
                    h.cancel_requested = True
        if gone and self._loop is not None:
            self._loop.call_soon_threadsafe(self._abandon, gone)
        if beat.renewed:
            if self._leases.audit and self._loop is not None:
                running = db.run_sync(conn, statements.executions.running_under(
                    self._q, owner=self.owner))
                self._loop.call_soon_threadsafe(self._adopt, running)
            self._end_dropped(conn)

    def _end_dropped(self, conn: psycopg.Connection[Any]) -> None:
        """End the lease of what this process dropped without ending its claim (a run cut
        short, a completion refused or overtaken, rows of a claim whose reply was lost): the
        lease they run under is alive, so the sweeper would never take them. Their own lease,
        already passed, hands them to the sweeper's next round (attempt counted, quarantine
        as ever). A row another transaction holds is tried again at the next beat; one no
        longer ours is forgotten."""
        dropped = self._leases.take_dropped()
        if not dropped:
            return
        try:
            ended = db.run_sync(conn, statements.executions.end_leases(self._q, held=dropped))
        except psycopg.Error:
            for key in dropped:  # the next beat tries again
                self._leases.drop_key(key)
            raise
        for key in dropped:
            if ended.get(key[0]) is False:
                self._leases.drop_key(key)  # held by another transaction: next beat
        if n := sum(ended.values()):
            log.info("ended the lease of %d execution(s) this process dropped; the sweeper "
                     "re-queues them", n)

    def _adopt(self, running: list[tuple[uuid.UUID, int]]) -> None:
        if n := self._leases.adopt(running):
            log.warning("%d execution(s) run under this process's lease that it does not hold "
                        "(a claim whose reply was lost): ending their lease", n)

    def _rename(self, conn: psycopg.Connection[Any], held: int) -> None:
        """The lease ran out before a beat could extend it (the process froze, stalled or
        lost the database for a whole lease): it is never extended again, so take a lease
        under a new name. Claims go on under the old name, and claim nothing, until the new
        one is taken: rows claimed under a name with no lease are the sweeper's at once."""
        self._renamed += 1
        new = f"{self._base}~{self._renamed}"
        log.warning("this process's lease %s ran out before it could be extended; dropping "
                    "its %d execution(s) (the sweeper re-queues them) and taking a new lease "
                    "as %s", self.owner, held, new)
        sent = time.monotonic()
        beat = db.run_script_sync(conn, statements.executions.heartbeat(
            self._q, owner=new, held=[], lease_s=self._lease_s))
        if beat.renewed:
            self.owner, self.trusted_until = new, sent + self._lease_s

    def _give_up_running_out(self) -> None:
        """Stop the executions whose trust runs out before the next beat could save it.

        Past its trust a lease may be swept and the step run again elsewhere (a client's
        transaction kept the row past the lease, FAULTS C3; an outage): the run here is
        cancelled first, one heartbeat interval before its lease can run out in the
        database, so an ``async`` step body is stopped before any other run of it starts.
        (A ``def`` body on a thread cannot be stopped; it writes nothing once cancelled.)"""
        if self._loop is None:
            return
        soon = time.monotonic() + self._interval
        due = [h for h in self._leases
               if h.state is LeaseState.HELD and h.trusted_until < soon]
        if due:
            self._loop.call_soon_threadsafe(self._run_out, due)

    def _run_out(self, due: list[Lease]) -> None:
        m = metrics.get()
        for h in due:
            if (not self._leases.current(h) or h.state is not LeaseState.HELD
                    or h.trusted_until >= time.monotonic() + self._interval):
                continue  # finished, lost or extended meanwhile
            if h.lose("its lease runs out before the next heartbeat could extend it"):
                m.leases_lost.inc()

    def _abandon(self, gone: list[Lease]) -> None:
        m = metrics.get()
        for h in gone:
            if not self._leases.current(h) or h.finishing or h.lost:
                continue  # finished or parked meanwhile: the row left on our own write
            h.lose("expired or re-claimed")
            m.leases_lost.inc()
            m.fenced.labels("heartbeat").inc()

    def _run(self) -> None:
        backoff = Backoff(base=0.2, cap=self._interval)
        delay = 0.0  # the first beat at once: it takes the lease the claims run under
        while not self._stop.wait(delay):
            try:
                self.run_once()
                OUTAGE.succeeded(pooled=False)
                backoff.reset()
            except psycopg.Error as exc:
                if connections.is_transient(exc):
                    OUTAGE.failed(exc, "heartbeat")  # leases are trusted until they run out
                else:
                    log.warning("heartbeat failed (%s); leases are trusted until they run out",
                                type(exc).__name__)
                backoff.failures += 1
            except Exception:  # a bug must not end the thread: every lease would lapse
                log.exception("heartbeat failed; leases are trusted until they run out")
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                backoff.failures += 1
            self._give_up_running_out()
            delay = self._interval if not backoff.failures else backoff.next_delay()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
