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

* A connection-level failure (:func:`kestrel.db.is_transient`) retries the same batch with
  backoff, for as long as it takes; the statements are idempotent (``ON CONFLICT``,
  epoch-guarded), so a retry after a lost reply changes nothing twice. Callers keep waiting;
  their leases decide when waiting is pointless.
* A statement-level error is isolated: the batch is split in halves and each half sent on
  its own, down to the single item that causes it. That item is retried a bounded number of
  times (a lock or statement timeout may pass) and then its caller, and only its caller,
  gets the error. The writer keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Generic, NoReturn, TypeVar

from kestrel import db
from kestrel.outage import OUTAGE

log = logging.getLogger("kestrel.writer")

In = TypeVar("In")
Out = TypeVar("Out")

MAX_BATCH_BYTES = 64 * 1024 * 1024
"""Largest batch a flush sends, by the items' encoded size (one item may exceed it alone)."""

STATEMENT_RETRIES = 2
"""Extra tries of a single item whose statement failed, before its caller gets the error."""


class Backoff:
    """Exponential backoff with full jitter, reset on success."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self.base, self.cap, self.failures = base, cap, 0

    def next_delay(self) -> float:
        """Count a failure; return the seconds to wait before the next try."""
        self.failures += 1
        return random.uniform(0, min(self.cap, self.base * 2 ** self.failures))

    def reset(self) -> None:
        """Forget the failures: the next delay starts from *base* again."""
        self.failures = 0


_Waiter = tuple[In, "asyncio.Future[Out]"]


class _Flight:
    """One flush on its way: since when its current attempt has been waiting, and whether it
    is backing off (the database unreachable: the heartbeats notice that by themselves)."""

    __slots__ = ("backing_off", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.backing_off = False


class GroupCommit(Generic[In, Out]):
    """One writer: ``submit`` an item and wait; ``run`` flushes until cancelled.

    *flush* sends a list of items in one statement and returns one result per item, in
    order. *size* gives an item's encoded size in bytes for the byte bound.
    """

    def __init__(
        self, name: str, flush: Callable[[list[In]], Awaitable[list[Out]]], *,
        max_items: int = 1000, max_bytes: int = MAX_BATCH_BYTES,
        size: Callable[[In], int] = lambda _: 0, statement_retries: int = STATEMENT_RETRIES,
        retry_delay: float = 0.1, in_flight: int = 1,
    ) -> None:
        self.name = name
        self._flush = flush
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._size = size
        self._statement_retries = statement_retries
        self._retry_delay = retry_delay
        self._in_flight = max(1, in_flight)
        self._flights: dict[asyncio.Task[None], _Flight] = {}
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._wake = asyncio.Event()
        self.flushes = 0
        self.items = 0
        self.rejected = 0
        # Since when items have waited with no flush on its way (None otherwise); with the
        # flights' own clocks, the lease watchdog reads it (stalled_for) to tell a stuck
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
                    del self._flights[task]
                    task.result()  # a flight that crashed ends the writer (crash-only)
                while self._pending and len(self._flights) < self._in_flight:
                    batch = [w for w in self._take() if not w[1].done()]
                    if not batch:
                        continue
                    flight = _Flight(time.monotonic())
                    task = asyncio.create_task(self._fly(batch, flight),
                                               name=f"{self.name}-flush")
                    self._flights[task] = flight
                    task.add_done_callback(lambda _: self._wake.set())
                # Whatever still waits is behind a flight on its way (stalled_for reads
                # the flights' clocks).
                self.busy_since = None
        finally:
            for task in self._flights:
                task.cancel()
            self._flights.clear()
            for _, fut in self._pending:
                fut.cancel()
            self._pending.clear()

    async def _fly(self, batch: list[tuple[In, asyncio.Future[Out]]], flight: _Flight) -> None:
        try:
            await self._send(batch, Backoff(), flight)
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

    async def _send(self, live: list[tuple[In, asyncio.Future[Out]]], backoff: Backoff,
                    flight: _Flight) -> None:
        tries = 0
        while live:
            try:
                results = await self._flush([item for item, _ in live])
            except Exception as exc:
                if db.is_transient(exc):
                    delay = backoff.next_delay()
                    OUTAGE.failed(exc, f"{self.name} flush")
                    flight.backing_off = True
                    try:
                        await asyncio.sleep(delay)
                    finally:
                        flight.backing_off = False
                        flight.since = time.monotonic()
                    live = [w for w in live if not w[1].done()]
                    continue
                if len(live) > 1:
                    # Isolate: whichever half holds the item that fails, the other goes on.
                    half = len(live) // 2
                    await self._send(live[:half], backoff, flight)
                    await self._send([w for w in live[half:] if not w[1].done()], backoff,
                                     flight)
                    return
                tries += 1
                if tries <= self._statement_retries:
                    await asyncio.sleep(self._retry_delay * tries * random.uniform(0.5, 1.0))
                    continue
                self.rejected += 1
                log.warning("%s: the database refused one item after %d tries (%s: %s); "
                            "only its execution is affected", self.name, tries,
                            type(exc).__name__, str(exc).strip()[:200])
                if not live[0][1].done():
                    live[0][1].set_exception(exc)
                return
            OUTAGE.succeeded()
            backoff.reset()
            self.flushes += 1
            self.items += len(live)
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
            return

    def stalled_for(self, now: float) -> float:
        """Seconds the oldest flush on its way has waited, or items have waited with no
        flush on its way (0 when idle or backing off); *now* is ``time.monotonic()`` (safe
        to call from the heartbeat thread). One stuck flight counts even while others
        complete: its executions make no progress."""
        waits = [now - f.since for f in tuple(self._flights.values()) if not f.backing_off]
        busy = self.busy_since
        if busy is not None:
            waits.append(now - busy)
        return max([0.0, *waits])
