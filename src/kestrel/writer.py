"""Group commit with per-item failure semantics: the writer service of a worker.

Callers submit one item each (a checkpoint, a completion) and wait for its result; one flush
sends everything that is waiting as one statement and one commit. While a flush is in flight
new items queue up, so the batch size follows the load with no timer and no added latency
when idle. A batch is bounded by count and by encoded bytes, so it never approaches
PostgreSQL's 1 GB message limit.

Up to *in_flight* flushes may be on their way at once, each on its own connection, so the
process need not sit idle for a whole round trip and commit while the next batch gathers
(the runtime keeps one, ``runner.FLUSHES_IN_FLIGHT``: two and three measured no better on
the 2-core VM, BENCHMARKS.md). This
never reorders an execution's writes: a workflow awaits each checkpoint before its next step
and its completion only after every checkpoint, so no execution ever has two writes of one
kind racing, and each statement carries the lease epoch, so fencing holds whichever flush
commits first. Concurrent flushes lock execution rows in id order like every other
multi-row statement, so they cannot deadlock each other (FAULTS X3).

What a failed flush means depends on the error, never on who else shared the batch:

* A connection-level failure (:func:`kestrel.connections.is_transient`) retries the same batch with
  backoff, for as long as it takes; the statements are idempotent (``ON CONFLICT``,
  epoch-guarded), so a retry after a lost reply changes nothing twice. Callers keep waiting;
  their leases decide when waiting is pointless.
* Contention (:func:`kestrel.connections.is_contended`: a lock or statement timeout, a deadlock, a
  serialization failure, too many connections, a full disk) and a pool that gave no
  connection in time retry the whole batch with backoff, bounded by the items' leases: an
  item whose lease is no longer trusted leaves the batch and its caller gets
  :class:`~kestrel.errors.LeaseLost` (its execution is dropped, neither failed nor counted
  as a refused write). Nothing about the items is wrong, so none of them fails for it. A
  batch that keeps meeting a lock or statement timeout is split in halves that go on
  retrying on their own, so one row a client holds (or one slow item) delays only the half
  it is in. While contended, a flush counts as backing off for the lease watchdog (moving
  the work elsewhere would meet the same lock); waiting for a pool connection does not
  (FAULTS R3: the connections are this process's, the work may move).
* A refusal of what the batch says (a data exception, a program limit, anything else the
  server raised) is isolated: the batch is split in halves, sent concurrently, down to the
  single item that causes it, and that item's caller, and only its caller, gets the error
  at once, never retried (it would fail identically). A poison item costs O(log n)
  statements, and its batch-mates do not wait for its isolation to end. The log says it in
  one line with the SQLSTATE, and quotes no data. The writer keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, NoReturn, TypeVar

from kestrel import connections, metrics
from kestrel.errors import LeaseLost
from kestrel.loops import Backoff
from kestrel.outage import OUTAGE

log = logging.getLogger("kestrel.writer")

In = TypeVar("In")
Out = TypeVar("Out")

MAX_BATCH_BYTES = 64 * 1024 * 1024
"""Largest batch a flush sends, by the items' encoded size (one item may exceed it alone)."""

ISOLATE_CONCURRENCY = 2
"""Statements one flight's halves may have on their way at once: both halves of a split go
together, and many poison items or a split contended batch cannot take the whole pool."""

SPLIT_AFTER = 2
"""Failed tries of one batch on a lock or statement timeout before it is split in halves
that retry on their own (:data:`_SPLIT_ON`)."""

_SPLIT_ON = {"55P03", "57014"}  # a row someone holds, a statement too slow for its batch

CONTENTION_LOG_S = 10.0
"""At most one warning about contention per writer this often (each names its SQLSTATE)."""


_Waiter = tuple[In, "asyncio.Future[Out]"]


class _Leg:
    """One batch (a flight's, or a half of it) on its way: since when it has been waiting,
    and whether it is backing off on purpose (the database unreachable, which the heartbeats
    notice by themselves; or contended, which another worker would meet as well). A leg
    waiting for a pool connection is not backing off: its clock keeps running."""

    __slots__ = ("backing_off", "no_connection", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.backing_off = False
        self.no_connection = False


class GroupCommit(Generic[In, Out]):
    """One writer: ``submit`` an item and wait; ``run`` flushes until cancelled.

    *flush* sends a list of items in one statement and returns one result per item, in
    order. *size* gives an item's encoded size in bytes for the byte bound. *trusted* says
    whether an item's lease is still trusted: contention is retried only for those.
    *retry_delay* is the base of the backoff between tries. *acquiring* says whether a
    flush is waiting for a pool connection right now (before its wait has timed out), for
    :meth:`stall`'s reason.
    """

    def __init__(
        self, name: str, flush: Callable[[list[In]], Awaitable[list[Out]]], *,
        max_items: int = 1000, max_bytes: int = MAX_BATCH_BYTES,
        size: Callable[[In], int] = lambda _: 0,
        trusted: Callable[[In], bool] = lambda _: True,
        retry_delay: float = 0.1, in_flight: int = 1,
        acquiring: Callable[[], bool] = lambda: False,
    ) -> None:
        self.name = name
        self._flush = flush
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._size = size
        self._trusted = trusted
        self._retry_delay = retry_delay
        self._in_flight = max(1, in_flight)
        self._acquiring = acquiring
        self._flights: set[asyncio.Task[None]] = set()
        self._legs: set[_Leg] = set()
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._wake = asyncio.Event()
        self._said_contention = float("-inf")
        self.flushes = 0
        self.items = 0
        self.rejected = 0
        self.retries = 0
        # Since when items have waited with no flush on its way (None otherwise); with the
        # legs' own clocks, the lease watchdog reads it (stalled_for) to tell a stuck
        # writer (a statement that never returns) from an idle one.
        self.busy_since: float | None = None

    async def submit(self, item: In) -> Out:
        """Queue *item* for the next flush; return its result (or raise its own error)."""
        fut: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        if self.busy_since is None and not self._flights:
            self.busy_since = time.monotonic()
        self._pending.append((item, fut))
        self._wake.set()
        return await fut

    async def run(self) -> NoReturn:
        """Flush forever, up to *in_flight* batches at once. If this task ends (cancelled or
        crashed, a flight's crash included), every flight is cancelled and every waiter with
        it: a writer's death is never turned into an execution's failure."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                for task in [t for t in self._flights if t.done()]:
                    self._flights.discard(task)
                    task.result()  # a flight that crashed ends the writer (crash-only)
                while self._pending and len(self._flights) < self._in_flight:
                    batch = [w for w in self._take() if not w[1].done()]
                    if not batch:
                        continue
                    task = asyncio.create_task(self._fly(batch), name=f"{self.name}-flush")
                    self._flights.add(task)
                    task.add_done_callback(lambda _: self._wake.set())
                # Whatever still waits is behind a flight on its way (stalled_for reads
                # the legs' clocks).
                self.busy_since = None
        finally:
            for task in self._flights:
                task.cancel()
            self._flights.clear()
            for _, fut in self._pending:
                fut.cancel()
            self._pending.clear()

    async def _fly(self, batch: list[tuple[In, asyncio.Future[Out]]]) -> None:
        try:
            await self._send(batch, asyncio.Semaphore(ISOLATE_CONCURRENCY))
        finally:
            # A waiter whose flight ended without a result (cancelled with the writer) is
            # cancelled too, never left waiting.
            for _, fut in batch:
                if not fut.done():
                    fut.cancel()

    def _take(self) -> list[tuple[In, asyncio.Future[Out]]]:
        count, total = 0, 0
        for item, _ in self._pending:
            total += self._size(item)
            if count and (count >= self._max_items or total > self._max_bytes):
                break
            count += 1
        batch = self._pending[:count]
        del self._pending[:count]
        return batch

    async def _split(self, live: list[tuple[In, asyncio.Future[Out]]],
                     gate: asyncio.Semaphore) -> None:
        """Send both halves of *live* at once: whichever holds the trouble, the other goes
        on without waiting for it."""
        half = len(live) // 2
        await asyncio.gather(self._send(live[:half], gate), self._send(live[half:], gate))

    async def _send(self, live: list[tuple[In, asyncio.Future[Out]]],
                    gate: asyncio.Semaphore) -> None:
        backoff = Backoff(base=self._retry_delay)
        leg = _Leg(time.monotonic())
        self._legs.add(leg)
        try:
            await self._send_leg(live, gate, backoff, leg)
        finally:
            self._legs.discard(leg)

    async def _send_leg(self, live: list[tuple[In, asyncio.Future[Out]]],
                        gate: asyncio.Semaphore, backoff: Backoff, leg: _Leg) -> None:
        contended = 0
        while True:
            live = [w for w in live if not w[1].done()]
            if not live:
                return
            # Waiting for the gate behind this flight's other legs is not this leg's stall
            # (those legs are measured while they hold it): a batch split under contention
            # queues many legs, and counting their queueing tripped the watchdog (FAULTS O6).
            leg.backing_off = True
            try:
                await gate.acquire()
            finally:
                leg.backing_off = False
            leg.since = time.monotonic()
            try:
                try:
                    results = await self._flush([item for item, _ in live])
                finally:
                    gate.release()
            except Exception as exc:
                pool = connections.is_pool_timeout(exc) and not OUTAGE.down
                if connections.is_transient(exc) and not pool:
                    OUTAGE.failed(exc, f"{self.name} flush")
                    await self._back_off(leg, backoff)
                    continue
                if pool or connections.is_contended(exc):
                    if pool:
                        OUTAGE.failed(exc, f"{self.name} flush")  # says "no connection"
                    else:
                        self._contention(exc, len(live))
                    live = self._only_trusted(live, exc)
                    contended += 1
                    if (contended >= SPLIT_AFTER and len(live) > 1
                            and getattr(exc, "sqlstate", None) in _SPLIT_ON):
                        leg.backing_off = True  # its halves are measured instead
                        await self._split(live, gate)
                        return
                    if pool:
                        # Not backing off: this process's own connections are the trouble,
                        # and the watchdog must see it (FAULTS R3).
                        leg.no_connection = True
                        await asyncio.sleep(backoff.next_delay())
                    else:
                        await self._back_off(leg, backoff)
                    continue
                if len(live) > 1:
                    leg.backing_off = True  # its halves are measured instead
                    await self._split(live, gate)
                    return
                self.rejected += 1
                log.warning("%s: the database refused one item (%s); only its caller is "
                            "affected", self.name, connections.sqlstate(exc))
                live[0][1].set_exception(exc)
                return
            OUTAGE.succeeded()
            if contended:
                log.info("%s: a contended batch of %d went through after %d tries",
                         self.name, len(live), contended + 1)
            self.flushes += 1
            self.items += len(live)
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
            return

    async def _back_off(self, leg: _Leg, backoff: Backoff) -> None:
        leg.backing_off = True
        try:
            await asyncio.sleep(backoff.next_delay())
        finally:
            leg.backing_off = False
            leg.no_connection = False
            leg.since = time.monotonic()

    def _contention(self, exc: BaseException, count: int) -> None:
        self.retries += 1
        metrics.get().write_retries.labels(self.name, getattr(exc, "sqlstate", None) or "-").inc()
        now = time.monotonic()
        if now - self._said_contention >= CONTENTION_LOG_S:
            self._said_contention = now
            log.warning("%s: a batch of %d was refused for contention (%s: a lock or "
                        "statement timeout, a deadlock, a serialization failure, too many "
                        "connections or a full disk); retrying it with backoff while its "
                        "leases hold", self.name, count, connections.sqlstate(exc))

    def _only_trusted(self, live: list[tuple[In, asyncio.Future[Out]]],
                      exc: BaseException) -> list[tuple[In, asyncio.Future[Out]]]:
        """The waiters of *live* whose leases are still trusted; the others learn LeaseLost
        (their executions are dropped: whoever claims them next runs them)."""
        kept = []
        for item, fut in live:
            if self._trusted(item):
                kept.append((item, fut))
            elif not fut.done():
                fut.set_exception(LeaseLost(
                    f"{self.name}: the lease ran out while the write was retried "
                    f"({connections.sqlstate(exc)})"))
        return kept

    def stall(self, now: float) -> tuple[float, str]:
        """Seconds the oldest batch on its way has waited, or items have waited with no
        flush on its way (0 when idle or backing off), and why ("no connection" when that
        batch is waiting for a pool connection, else ""); *now* is ``time.monotonic()``
        (safe to call from the heartbeat thread). One stuck batch counts even while others
        complete: its executions make no progress. A flush waiting for a connection says so
        before its wait times out: the watchdog's limit and the pool's timeout can be equal,
        and the first report must name the reason (FAULTS R3)."""
        worst, why = 0.0, ""
        for leg in tuple(self._legs):
            if not leg.backing_off and now - leg.since > worst:
                worst, why = now - leg.since, "no connection" if leg.no_connection else ""
        if worst and not why and self._acquiring():
            why = "no connection"
        busy = self.busy_since
        if busy is not None and now - busy > worst:
            worst, why = now - busy, ""
        return worst, why

    def stalled_for(self, now: float) -> float:
        """:meth:`stall`'s seconds."""
        return self.stall(now)[0]
