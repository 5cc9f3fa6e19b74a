"""Statements defined once, run by either side: :class:`Stmt` and :class:`Script` values.

A Stmt is one statement with its parameters and the function that turns its rows into a
result. It does no I/O: :func:`kestrel.db.run` executes it on an async connection and
:func:`kestrel.db.run_sync` on a blocking one, so the async client, the sync client, the
worker's heartbeat thread and the CLI share one definition of each statement instead of
hand-written twins. A Script is several statements in one transaction. ``kestrel.db``
re-exports every builder here, and is still the only module that executes SQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from kestrel.sql import Queries
from kestrel.types import (
    Execution,
    ExecutionSummary,
    LiveWorker,
    PatchUse,
    QueueStat,
    Stats,
    Status,
    StepRow,
    SweepResult,
    Unclaimable,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stmt(Generic[T]):
    """A statement, its parameters and how its rows become a result."""

    query: str
    params: Mapping[str, Any] | None
    decode: Callable[[list[tuple[Any, ...]]], T]
    key: str | None = None  # the idempotency key, for IdempotencyConflict's message


Script = Generator[Stmt[Any], Any, T]
"""Several statements in one transaction: a generator that yields each Stmt and is sent its
result, so one definition serves both sides (see :func:`run_script`)."""


def _first(rows: list[tuple[Any, ...]]) -> Any:
    return rows[0][0] if rows else None


def command(query: str, params: Mapping[str, Any] | None = None) -> Stmt[None]:
    """A statement whose rows, if any, are not needed (LISTEN, an upsert)."""
    return Stmt(query, params, lambda _: None)


def value(query: str, params: Mapping[str, Any], *, key: str | None = None) -> Stmt[Any]:
    """One call of a kestrel SQL function (submit, signal, cancel, retry, fork): its value."""
    return Stmt(query, params, _first, key)


def submit_params(
    *, workflow: str, args: str, queue: str, priority: int, idempotency_key: str | None,
    id: uuid.UUID | None = None, parent: uuid.UUID | None = None,
    timeout_s: float | None = None, delay_s: float | None = None,
    dedup_key: str | None = None, on_duplicate: str = "return",
    start_at: datetime | None = None, traceparent: str | None = None,
    tracestate: str | None = None,
) -> dict[str, Any]:
    """Return the named parameters of the ``submit`` statement.

    *args* is the encoded argument list. *start_at* (or *delay_s*, not both) is read by the
    database clock. *traceparent* and *tracestate* are the submitter's W3C trace context
    (:mod:`kestrel.tracing`), already checked.
    """
    return {"workflow": workflow, "args": args, "queue": queue, "priority": priority,
            "idempotency_key": idempotency_key, "id": id, "parent": parent,
            "timeout_s": timeout_s, "delay_s": delay_s, "dedup_key": dedup_key,
            "on_duplicate": on_duplicate, "start_at": start_at, "traceparent": traceparent,
            "tracestate": tracestate}


def _execution(row: Sequence[Any]) -> Execution:
    return Execution(
        id=row[0], workflow=row[1], queue=row[2], priority=row[3], status=Status(row[4]),
        args=row[5], result=row[6], error=row[7], attempts=row[8], lease_epoch=row[9],
        created_at=row[10], started_at=row[11], finished_at=row[12], deadline=row[13],
        waiting_for=row[14], wake_at=row[15], wait_deadline=row[16], queue_limit=row[17],
        give_backs=row[18] or 0, given_back_by=list(row[19]) if row[19] is not None else None,
        given_back_at=row[20],
    )


def _step_row(row: Sequence[Any]) -> StepRow:
    return StepRow(
        step_id=row[0], name=row[1], output=row[2], error=row[3], attempt=row[4],
        lease_epoch=row[5], started_at=row[6], finished_at=row[7],
    )


def heartbeat(q: Queries, *, held: Sequence[tuple[uuid.UUID, int]],
              lease_s: float) -> Stmt[dict[uuid.UUID, bool | None]]:
    """Extend the leases in *held*: the ids still owned, each with its cancel flag, or None
    when another transaction holds the row (busy: still ours, not extended this time)."""
    return Stmt(q.heartbeat, {"ids": [h[0] for h in held], "epochs": [h[1] for h in held],
                              "lease_s": lease_s},
                lambda rows: {r[0]: bool(r[1]) if r[2] else None for r in rows})


def get_event(q: Queries, *, id: uuid.UUID, key: str) -> Stmt[tuple[bool, Any]]:
    """The latest value of an event: (found, value)."""
    return Stmt(q.get_event, {"id": id, "key": key},
                lambda rows: (True, rows[0][0]) if rows else (False, None))


def get_execution(q: Queries, *, id: uuid.UUID) -> Stmt[Execution | None]:
    """One execution, live or finished."""
    return Stmt(q.get_execution, {"id": id},
                lambda rows: _execution(rows[0]) if rows else None)


def list_steps(q: Queries, *, id: uuid.UUID) -> Stmt[list[StepRow]]:
    """The checkpoints of one execution, live or finished."""
    return Stmt(q.list_steps, {"id": id}, lambda rows: [_step_row(r) for r in rows])


def _counts(rows: list[tuple[Any, ...]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status, n in rows:
        counts[status] = counts.get(status, 0) + n
    return counts


def count_by_status(q: Queries) -> Stmt[dict[str, int]]:
    """Executions by status, live and finished."""
    return Stmt(q.count_by_status, None, _counts)


def list_executions(q: Queries, *, status: str | None, workflow: str | None,
                    since: datetime | None, limit: int, app_version: str | None = None,
                    patch: str | None = None, with_patch: bool = True,
                    ) -> Stmt[list[ExecutionSummary]]:
    """Executions newest first, live and finished, optionally filtered (by status,
    workflow, creation time, the app version that started them, and whether they recorded
    *patch*'s marker)."""
    return Stmt(q.list_executions, {"status": status, "workflow": workflow, "since": since,
                                    "limit": limit, "app_version": app_version,
                                    "patch": patch, "with_patch": with_patch},
                lambda rows: [ExecutionSummary(id=r[0], workflow=r[1], queue=r[2],
                                               status=Status(r[3]), attempts=r[4],
                                               created_at=r[5], finished_at=r[6],
                                               app_version=r[7])
                              for r in rows])


def replay_history(q: Queries, *, id: uuid.UUID, max_history_bytes: int,
                   ) -> Stmt[tuple[Any, ...] | None]:
    """One execution as a replay reads it, or None: ``(id, workflow, status, args text,
    wait_step, waiting_for, app_version, created_at, checkpoints text)`` (the texts as the
    database holds them; see kestrel.replay)."""
    return Stmt(q.replay_history, {"id": id, "max_history_bytes": max_history_bytes},
                lambda rows: tuple(rows[0]) if rows else None)


def take_uncounted_finishes(q: Queries, *, workflows: list[str], collector: str,
                            acked: list[int]) -> Stmt[list[tuple[int, str, str, bool]]]:
    """Take the finishes of *workflows* no worker saw (what cancel() finished while queued or
    waiting, what the sweeper failed past its deadline) that no other collector took, and
    delete the ones this *collector* counted (*acked*): ``(finish_id, workflow, status,
    deadline)``, one per finish. Rows it took before and never acknowledged come back (a
    lost reply): see ``sql/queries/history.sql``."""
    return Stmt(q.take_uncounted_finishes,
                {"workflows": workflows, "collector": collector, "acked": acked},
                lambda rows: [(int(r[0]), r[1], r[2], bool(r[3])) for r in rows])


def queue_stats(q: Queries) -> Stmt[list[QueueStat]]:
    """Live executions by queue and status, with the oldest queued one's age."""
    return Stmt(q.queue_stats, None, lambda rows: [
        QueueStat(queue=r[0], status=r[1], count=int(r[2]),
                  oldest_age_s=float(r[3] or 0.0) if r[1] == "queued" else None)
        for r in rows])


def worker_stats(q: Queries) -> Stmt[dict[str, int]]:
    """Running executions by the worker holding their lease."""
    return Stmt(q.worker_stats, None, lambda rows: {r[0]: r[1] for r in rows})


def recover_dead_worker(q: Queries, *, worker_id: str, max_attempts: int,
                        limit: int = 500) -> Script[SweepResult]:
    """A reaped worker's executions back in the queue now (or quarantined, out of
    attempts), and its row out of the live workers: what its supervisor runs (FAULTS O8).
    ``examined`` is how many leases it still held."""
    held = yield Stmt(q.expire_worker_leases, {"owner": worker_id}, _first)
    requeued = quarantined = 0
    while held:
        r = yield Stmt(q.reenqueue_expired, {"limit": limit, "max_attempts": max_attempts},
                       lambda rows: SweepResult(rows[0][0], rows[0][1], rows[0][2]))
        requeued, quarantined = requeued + r.requeued, quarantined + r.quarantined
        if r.examined < limit:
            break
    yield unregister_worker(q, worker_id=worker_id)
    return SweepResult(requeued=requeued, quarantined=quarantined, examined=int(held or 0))


def stats(q: Queries) -> Script[Stats]:
    """What ``stats`` shows, read in one transaction."""
    queues = yield queue_stats(q)
    workers = yield worker_stats(q)
    totals = yield count_by_status(q)
    return Stats(queues=queues, running_by_worker=workers, totals=totals)


def run_maintenance(q: Queries, *, interval: str, ahead: int, retention_days: float,
                    detach: bool = False) -> Script[tuple[bool, int, int]]:
    """One upkeep round in one transaction, if no other process holds the upkeep lock:
    (ran, partitions created, partitions dropped)."""
    got = yield Stmt(q.maintenance_lock, None, _first)
    if not got:
        return False, 0, 0
    created = yield Stmt(q.ensure_partitions, {"interval": interval, "ahead": ahead}, _first)
    dropped = 0
    if retention_days > 0:
        dropped = yield Stmt(q.drop_partitions, {"retention_days": retention_days,
                                                 "detach": detach}, _first)
    return True, int(created or 0), int(dropped or 0)


def list_partitions(q: Queries) -> Stmt[list[tuple[Any, ...]]]:
    """History partitions with their bounds and sizes."""
    return Stmt(q.list_partitions, None, list)


def db_now(q: Queries) -> Stmt[datetime]:
    """The database clock (kestrel_now())."""
    return Stmt(q.db_now, None, _first)


def upsert_queue_limit(q: Queries, *, queue: str, concurrency: int | None, rate: int | None,
                       period_s: float | None) -> Stmt[None]:
    """Declare (or change) a queue's limits."""
    return Stmt(q.upsert_queue_limit, {"queue": queue, "concurrency": concurrency,
                                       "rate": rate, "period_s": period_s}, lambda _: None)


def upsert_schedule(q: Queries, *, name: str, cron: str, workflow: str,
                    last_tick: datetime) -> Stmt[datetime]:
    """Register a schedule; its last tick (kept if it existed)."""
    return Stmt(q.upsert_schedule, {"name": name, "cron": cron, "workflow": workflow,
                                    "last_tick": last_tick}, _first)


# -- versions and the live fleet (kestrel.versions, migration 0010) --------------------------

def register_worker(q: Queries, *, worker_id: str, app_version: str, workflows: list[str],
                    queues: list[str], stale_after_s: float) -> Stmt[None]:
    """Upsert a worker's row: what it claims, its version, when it counts as dead."""
    return command(q.register_worker, {"worker_id": worker_id, "app_version": app_version,
                                       "workflows": workflows, "queues": queues,
                                       "stale_after_s": stale_after_s})


def unregister_worker(q: Queries, *, worker_id: str) -> Stmt[None]:
    """Delete a worker's row (it stopped cleanly)."""
    return command(q.unregister_worker, {"worker_id": worker_id})


def live_workers(q: Queries) -> Stmt[list[LiveWorker]]:
    """Workers seen within their lifetime, newest first."""
    return Stmt(q.live_workers, None, lambda rows: [
        LiveWorker(worker_id=r[0], app_version=r[1], workflows=list(r[2]), queues=list(r[3]),
                   started_at=r[4], seen_at=r[5]) for r in rows])


def unclaimable_total(q: Queries) -> Stmt[tuple[int, int, int]]:
    """Live executions no live worker can claim, their distinct workflow names, and the live
    executions given back and not claimed since."""
    return Stmt(q.unclaimable_total, None,
                lambda rows: (int(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows
                else (0, 0, 0))


def unclaimable_by_workflow(q: Queries, *, limit: int) -> Stmt[list[Unclaimable]]:
    """Unclaimable executions by workflow, queue and the app versions that gave them back,
    the most first, at most *limit* lines."""
    return Stmt(q.unclaimable_by_workflow, {"limit": limit}, lambda rows: [
        Unclaimable(workflow=r[0], queue=r[1], count=int(r[2]), oldest_created_at=r[3],
                    given_back_by=list(r[4]) if r[4] is not None else None)
        for r in rows])


def patch_summary(q: Queries, *, patch: str | None) -> Stmt[list[PatchUse]]:
    """Every recorded patch (or only *patch*) by workflow, with who still lacks it."""
    return Stmt(q.patch_summary, {"patch": patch}, lambda rows: [
        PatchUse(workflow=r[0], patch=r[1], at_step=r[2], total_with=int(r[3]),
                 live_with=int(r[4]), live_without=int(r[5])) for r in rows])


# -- kestrel.testing: the database clock and a clean slate per test --------------------------


def advance_clock(q: Queries, *, seconds: float) -> Stmt[datetime]:
    """Move the database clock (kestrel_now()) forward by *seconds*; the new time."""
    return Stmt(q.advance_clock, {"seconds": seconds}, _first)


def skip_to_next_sleep(q: Queries) -> Stmt[float | None]:
    """If nothing can run now, move the clock to the end of the earliest durable sleep; the
    seconds skipped, or None when something can run or nothing sleeps."""
    return Stmt(q.skip_to_next_sleep, None, _first)


def waiting_for(q: Queries, *, id: uuid.UUID) -> Stmt[tuple[Any, ...] | None]:
    """A live execution's (status, waiting_for, wake_at); None once it finished."""
    return Stmt(q.waiting_for, {"id": id}, lambda rows: tuple(rows[0]) if rows else None)


def reset_for_test(q: Queries) -> Stmt[None]:
    """Empty every table but the migration record; set the clock back to now()."""
    return Stmt(q.reset_for_test, None, lambda _: None)


def waiting_stats(q: Queries, *, workflows: Sequence[str],
                  limit: int) -> Stmt[list[tuple[str, str, int]]]:
    """Waiting executions of *workflows* by (workflow, what they wait for), largest first."""
    return Stmt(q.waiting_stats, {"workflows": list(workflows), "limit": limit},
                lambda rows: [(r[0], r[1], int(r[2])) for r in rows])


def fork_source(q: Queries, *, id: uuid.UUID) -> Stmt[tuple[uuid.UUID, int] | None]:
    """What fork *id* copied: (execution, from_step), or None when there is no such fork."""
    return Stmt(q.fork_source, {"id": id},
                lambda rows: (rows[0][0], rows[0][1]) if rows else None)
