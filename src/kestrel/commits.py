"""The two group commits of a worker: checkpoints and completions, each owning its statement.

Like River's completer, each is an object of its own: it holds the writer
(:class:`~kestrel.writer.GroupCommit`) that gathers what the running workflows hand it, and
the flush that sends one batch as one statement and maps what came back to one result per
item. The :class:`~kestrel.runner.Runner` submits to them (``writer.submit``) and waits; the
worker runs them as services (``run``). ``run_once`` is one round: one batch, one statement,
one commit.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from psycopg_pool import AsyncConnectionPool

from kestrel import db, metrics
from kestrel.failpoints import afailpoint, failpoint
from kestrel.lease import Leases
from kestrel.sql import Queries
from kestrel.types import Finish, StepSaved, StepWrite
from kestrel.writer import GroupCommit


def _write_size(w: StepWrite) -> int:
    return len(w.output or "") + len(w.error or "") + len(w.name)


def _finish_size(f: Finish) -> int:
    return len(f.result or "") + len(f.error or "")


class CheckpointCommits:
    """Checkpoints, group-committed: ``writer.submit`` one and wait for what is recorded."""

    name = "checkpoint-writer"

    def __init__(self, pool: AsyncConnectionPool[Any], q: Queries, leases: Leases, *,
                 in_flight: int) -> None:
        self._pool, self._q = pool, q
        self.writer: GroupCommit[StepWrite, StepSaved] = GroupCommit(
            "checkpoint", self.run_once, size=_write_size,
            trusted=lambda w: leases.trusted(w.execution_id, w.epoch), in_flight=in_flight)

    async def run(self) -> NoReturn:
        """Flush forever (:meth:`GroupCommit.run`)."""
        await self.writer.run()

    async def run_once(self, writes: list[StepWrite]) -> list[StepSaved]:
        """Checkpoint *writes* in one statement; return what each position now records."""
        started = time.monotonic()
        async with self._pool.connection() as conn:
            await afailpoint("before_checkpoint_commit")
            saved = await db.save_steps(conn, self._q, writes)
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
                if s.owned and s.recorded is None and not s.cancelled:
                    rec = await db.load_step(conn, self._q, execution_id=w.execution_id,
                                             step_id=w.step_id)
                    saved[i] = StepSaved(owned=True, inserted=False, recorded=rec)
        return saved


class Completions:
    """Completions, group-committed: ``writer.submit`` a Finish and learn whether it ended
    the execution (False: fenced by a newer claim)."""

    name = "completion-writer"

    def __init__(self, pool: AsyncConnectionPool[Any], q: Queries, leases: Leases, *,
                 in_flight: int) -> None:
        self._pool, self._q = pool, q
        self.writer: GroupCommit[Finish, bool] = GroupCommit(
            "completion", self.run_once, size=_finish_size,
            trusted=lambda f: leases.trusted(f.execution_id, f.epoch), in_flight=in_flight)

    async def run(self) -> NoReturn:
        """Flush forever (:meth:`GroupCommit.run`)."""
        await self.writer.run()

    async def run_once(self, finishes: list[Finish]) -> list[bool]:
        """Finish *finishes* in one statement; return, for each, whether it is finished by
        this claim (by this statement or by an earlier try whose reply was lost)."""
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
