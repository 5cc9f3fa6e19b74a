"""Group commit with per-item failure semantics: the writer service of a worker.

Callers submit one item each (a checkpoint, a completion) and wait for its result; one flush
sends everything that is waiting as one statement and one commit. While a flush is in flight
new items queue up, so the batch size follows the load with no timer and no added latency
when idle. A batch is bounded by count and by encoded bytes, so it never approaches
PostgreSQL's 1 GB message limit.

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


class GroupCommit(Generic[In, Out]):
    """One writer: ``submit`` an item and wait; ``run`` flushes until cancelled.

    *flush* sends a list of items in one statement and returns one result per item, in
    order. *size* gives an item's encoded size in bytes for the byte bound.
    """

    def __init__(
        self, name: str, flush: Callable[[list[In]], Awaitable[list[Out]]], *,
        max_items: int = 1000, max_bytes: int = MAX_BATCH_BYTES,
        size: Callable[[In], int] = lambda _: 0, statement_retries: int = STATEMENT_RETRIES,
        retry_delay: float = 0.1,
    ) -> None:
        self.name = name
        self._flush = flush
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._size = size
        self._statement_retries = statement_retries
        self._retry_delay = retry_delay
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._wake = asyncio.Event()
        self.flushes = 0
        self.items = 0
        self.rejected = 0
        # Since when the writer has had items and no flush attempt has ended (None when
        # idle). The lease watchdog reads it (stalled_for) to tell a stuck writer (a
        # statement that never returns) from an idle one or one backing off while the
        # database is unreachable, which its heartbeats notice by themselves.
        self.busy_since: float | None = None
        self._backing_off = False

    async def submit(self, item: In) -> Out:
        """Queue *item* for the next flush; return its result (or raise its own error)."""
        fut: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        if self.busy_since is None:
            self.busy_since = time.monotonic()
        self._pending.append((item, fut))
        self._wake.set()
        return await fut

    async def run(self) -> NoReturn:
        """Flush forever. If this task ends (cancelled or crashed), every waiter is cancelled:
        a writer's death is never turned into an execution's failure."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    batch = self._take()
                    await self._send([w for w in batch if not w[1].done()], Backoff())
                    self.busy_since = time.monotonic() if self._pending else None
        finally:
            for _, fut in self._pending:
                fut.cancel()
            self._pending.clear()

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

    async def _send(self, live: list[tuple[In, asyncio.Future[Out]]], backoff: Backoff) -> None:
        tries = 0
        while live:
            try:
                results = await self._flush([item for item, _ in live])
            except Exception as exc:
                if db.is_transient(exc):
                    delay = backoff.next_delay()
                    OUTAGE.failed(exc, f"{self.name} flush")
                    self._backing_off = True
                    try:
                        await asyncio.sleep(delay)
                    finally:
                        self._backing_off = False
                        self.busy_since = time.monotonic()
                    live = [w for w in live if not w[1].done()]
                    continue
                if len(live) > 1:
                    # Isolate: whichever half holds the item that fails, the other goes on.
                    half = len(live) // 2
                    await self._send(live[:half], backoff)
                    await self._send([w for w in live[half:] if not w[1].done()], backoff)
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
        """Seconds items have waited with no flush completing (0 when idle); *now* is
        ``time.monotonic()`` (safe to call from the heartbeat thread)."""
        if self.busy_since is None or self._backing_off:
            return 0.0
        return max(0.0, now - self.busy_since)
