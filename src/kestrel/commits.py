"""The two group commits of a worker: checkpoints and completions, each owning its statement.

Like River's completer, each is an object of its own: it holds the writer
(:class:`~kestrel.writer.GroupCommit`) that gathers what the running workflows hand it, and
the flush that sends one batch as one statement and maps what came back to one result per
item. The :class:`~kestrel.runner.Runner` submits to them (``writer.submit``) and waits; the
worker runs them as services (``run``). ``run_once`` is one round: one batch, one statement,
one commit.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from kestrel import connections, db, forms, metrics
from kestrel.failpoints import afailpoint, failpoint
from kestrel.lease import Leases
from kestrel.sql import Queries
from kestrel.statements import executions, notify, steps
from kestrel.types import Finish, StepSaved, StepWrite
from kestrel.writer import GroupCommit

log = logging.getLogger("kestrel.writer")


class _Fenced(Protocol):
    """A write fenced by its claim: ``(execution_id, epoch)``."""

    @property
    def execution_id(self) -> uuid.UUID:
        """The execution written to."""

    @property
    def epoch(self) -> int:
        """The claim's epoch the write carries."""


In = TypeVar("In", bound=_Fenced)
Out = TypeVar("Out")


class _Commits(Generic[In, Out]):
    """A group commit of one kind of fenced write: its writer, whose every flush is one
    :meth:`run_once`; an item is retried for contention only while its lease is trusted."""

    name: str  # the service's, in the worker's log lines
    kind: ClassVar[str]  # the writer's, in its log lines and metrics labels

    def __init__(self, pool: AsyncConnectionPool[Any], q: Queries, leases: Leases, *,
                 in_flight: int) -> None:
        self._pool, self._q = pool, q
        self._acquiring = 0  # flushes waiting for a pool connection now
        self.writer: GroupCommit[In, Out] = GroupCommit(
            self.kind, self.run_once, size=self.size,
            trusted=lambda item: leases.trusted(item.execution_id, item.epoch),
            in_flight=in_flight, acquiring=lambda: self._acquiring > 0)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pool connection, counted while it is being waited for (the writer's stall
        reason, FAULTS R3): ``pool.connection()``, and nothing else of the pool's."""
        self._acquiring += 1
        waiting = True
        try:
            async with self._pool.connection() as conn:
                self._acquiring -= 1
                waiting = False
                yield conn
        finally:
            if waiting:
                self._acquiring -= 1

    async def run(self) -> NoReturn:
        """Flush forever (:meth:`GroupCommit.run`)."""
        await self.writer.run()

    @staticmethod
    def size(item: Any) -> int:
        """*item*'s encoded bytes, for the batch's byte bound."""
        raise NotImplementedError

    async def run_once(self, batch: list[In]) -> list[Out]:
        """Commit *batch* in one statement; return one result per item, in order."""
        raise NotImplementedError


class CheckpointCommits(_Commits[StepWrite, StepSaved]):
    """Checkpoints, group-committed: ``writer.submit`` one and wait for what is recorded."""

    name = "checkpoint-writer"
    kind = "checkpoint"

    @staticmethod
    def size(item: StepWrite) -> int:
        """The checkpoint's output, error and name, in characters."""
        return len(item.output or "") + len(item.error or "") + len(item.name)

    async def run_once(self, writes: list[StepWrite]) -> list[StepSaved]:
        """Checkpoint *writes* in one statement; return what each position now records."""
        started = time.monotonic()
        async with self._connection() as conn:
            await afailpoint("before_checkpoint_commit")
            delegated = await forms.delegated(conn, self._q)
            saved = await db.run(conn, steps.save_steps(self._q, writes, delegated=delegated))
            failpoint("after_checkpoint_commit_before_ack", writes)
            m = metrics.get()
            m.checkpoint_seconds.observe(time.monotonic() - started)
            m.checkpoint_batch.observe(len(writes))
            fenced = sum(1 for s in saved if not s.owned)
            if fenced:
                m.fenced.labels("checkpoint").inc(fenced)
            # A conflicting row committed after our snapshot is invisible to the statement
            # (only possible across epochs, which are fenced anyway): read it back.
            for i, (w, s) in enumerate(zip(writes, saved, strict=True)):
                if s.owned and not s.inserted and s.recorded is None and not s.cancelled:
                    rec = await db.run(conn, steps.load_step(
                        self._q, execution_id=w.execution_id, step_id=w.step_id))
                    saved[i] = StepSaved(owned=True, inserted=False, recorded=rec)
        return saved


class Completions(_Commits[Finish, bool]):
    """Completions, group-committed: ``writer.submit`` a Finish and learn whether it ended
    the execution (False: fenced by a newer claim)."""

    name = "completion-writer"
    kind = "completion"

    @staticmethod
    def size(item: Finish) -> int:
        """The result and error, and the tail's, in characters."""
        tail = item.tail
        return len(item.result or "") + len(item.error or "") + (
            0 if tail is None else CheckpointCommits.size(tail))

    async def run_once(self, finishes: list[Finish]) -> list[bool]:
        """Finish *finishes* in one statement (in the Citus form, a notification after it);
        return, for each, whether it is finished by this claim (by this statement or by an
        earlier try whose reply was lost)."""
        started = time.monotonic()
        async with self._connection() as conn:
            await afailpoint("before_complete")
            delegated = await forms.delegated(conn, self._q)
            done = await db.run(conn, executions.complete_batch(self._q, finishes,
                                                                delegated=delegated))
            failpoint("after_complete_commit")
            tails = [f.tail for f in finishes if f.tail is not None]
            if tails:
                # Those checkpoints committed here, with their ends (FAULTS F2 for them).
                failpoint("after_checkpoint_commit_before_ack", tails)
            missing = [f for f in finishes if f.execution_id not in done]
            if missing:
                # Not finished by this statement: fenced by a newer claim, or finished by an
                # earlier try whose reply was lost (FAULTS X4). History tells which.
                done |= await db.run(conn, executions.finished_readback(
                    self._q, missing))
            if delegated and done:
                # Committed on the tenant's node, and result() waiters listen on the
                # coordinator. A lost connection here retries the batch, which learns these
                # finishes from history above and notifies again; a notification refused
                # (a full NOTIFY queue) fails no finish that committed: waiters recheck
                # every second anyway.
                try:
                    failpoint("before_notify_done")
                    await db.run(conn, notify.notify_done(self._q))
                except psycopg.Error as exc:
                    if connections.is_transient(exc):
                        raise
                    log.warning("completions committed, but their notification was refused "
                                "(%s); result() waiters learn of them by their recheck",
                                connections.sqlstate(exc))
        m = metrics.get()
        m.completion_seconds.observe(time.monotonic() - started)
        m.completion_batch.observe(len(finishes))
        return [f.execution_id in done for f in finishes]
