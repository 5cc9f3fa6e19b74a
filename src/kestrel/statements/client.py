"""The client's statements (``sql/queries/client.sql``): submit, signal, cancel, retry, fork,
and the reads of executions, checkpoints, events and counts that both clients, the CLI, the
HTTP door and the test kit share."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from kestrel.sql import Queries
from kestrel.statements.stmt import Script, Stmt, command, first, tagged, value
from kestrel.types import (
    Execution,
    ExecutionSummary,
    FailedTry,
    QueueStat,
    Stats,
    Status,
    StepRow,
)


def submit_params(
    *, workflow: str, args: str, queue: str, priority: int, idempotency_key: str | None,
    id: uuid.UUID | None = None, parent: uuid.UUID | None = None,
    timeout_s: float | None = None, delay_s: float | None = None,
    dedup_key: str | None = None, on_duplicate: str = "return",
    start_at: datetime | None = None, traceparent: str | None = None,
    tracestate: str | None = None, debounce_key: str | None = None,
    debounce_s: float | None = None, debounce_max_s: float | None = None,
    concurrency_key: str | None = None, tags: str | None = None,
) -> dict[str, Any]:
    """Return the named parameters of the ``submit`` statement.

    *args* is the encoded argument list. *start_at* (or *delay_s*, not both) is read by the
    database clock. *traceparent* and *tracestate* are the submitter's W3C trace context
    (:mod:`kestrel.tracing`), already checked. *debounce_key*, *debounce_s* and
    *debounce_max_s*: a debounced submit (migration 0024). *concurrency_key* and *tags* (the
    encoded JSON object): migration 0025.
    """
    return {"workflow": workflow, "args": args, "queue": queue, "priority": priority,
            "idempotency_key": idempotency_key, "id": id, "parent": parent,
            "timeout_s": timeout_s, "delay_s": delay_s, "dedup_key": dedup_key,
            "on_duplicate": on_duplicate, "start_at": start_at, "traceparent": traceparent,
            "tracestate": tracestate, "debounce_key": debounce_key, "debounce_s": debounce_s,
            "debounce_max_s": debounce_max_s, "concurrency_key": concurrency_key,
            "tags": tags}


def submit(q: Queries, params: Mapping[str, Any]) -> Stmt[uuid.UUID]:
    """Start an execution (:func:`submit_params`); its id, or the id of the execution its
    idempotency key or live dedup key already started."""
    return value(q.submit, params, key=params["idempotency_key"])


def signal(q: Queries, *, id: uuid.UUID, name: str, payload: str | None,
           idempotency_key: str | None) -> Stmt[bool]:
    """Send signal *name* (its payload as JSON text); False if *idempotency_key* was used
    already."""
    return Stmt(q.signal, {"id": id, "name": name, "payload": payload,
                           "idempotency_key": idempotency_key},
                lambda rows: bool(first(rows)))


def cancel(q: Queries, *, id: uuid.UUID) -> Stmt[str]:
    """Cancel an execution and its live children: ``cancelled``, ``cancelling`` or the
    terminal status it already had."""
    return Stmt(q.cancel, {"id": id}, lambda rows: str(first(rows)))


def retry(q: Queries, *, id: uuid.UUID, idempotency_key: str | None) -> Stmt[None]:
    """Re-run a failed, cancelled or quarantined execution from its last good checkpoint."""
    return Stmt(q.retry, {"id": id, "idempotency_key": idempotency_key}, lambda _: None,
                idempotency_key)


def fork(q: Queries, *, id: uuid.UUID, from_step: int, new_id: uuid.UUID,
         idempotency_key: str | None) -> Stmt[uuid.UUID]:
    """Start execution *new_id* replaying the first *from_step* positions of *id*; the
    fork's id (the one made before, on a resend)."""
    return value(q.fork, {"id": id, "from_step": from_step, "new_id": new_id,
                          "idempotency_key": idempotency_key}, key=idempotency_key)


def fork_source(q: Queries, *, id: uuid.UUID) -> Stmt[tuple[uuid.UUID, int] | None]:
    """What fork *id* copied: (execution, from_step), or None when there is no such fork."""
    return Stmt(q.fork_source, {"id": id},
                lambda rows: (rows[0][0], rows[0][1]) if rows else None)


def listen_done(q: Queries) -> Stmt[None]:
    """LISTEN for executions finishing (a waiting client's wake-up)."""
    return command(q.listen_done)


def listen_events(q: Queries) -> Stmt[None]:
    """LISTEN for events published (a client waiting on get_event)."""
    return command(q.listen_events)


def _execution(row: Sequence[Any]) -> Execution:
    return Execution(
        id=row[0], workflow=row[1], queue=row[2], priority=row[3], status=Status(row[4]),
        args=row[5], result=row[6], error=row[7], attempts=row[8], lease_epoch=row[9],
        created_at=row[10], started_at=row[11], finished_at=row[12], deadline=row[13],
        waiting_for=row[14], wake_at=row[15], wait_deadline=row[16], queue_limit=row[17],
        give_backs=row[18] or 0, given_back_by=list(row[19]) if row[19] is not None else None,
        given_back_at=row[20], tags=row[21], concurrency_key=row[22],
    )


def _step_row(row: Sequence[Any]) -> StepRow:
    return StepRow(
        step_id=row[0], name=row[1], output=row[2], error=row[3], attempt=row[4],
        lease_epoch=row[5], started_at=row[6], finished_at=row[7],
        tries=_failed_tries(row[6], row[8]),
    )


def _failed_tries(started_at: datetime, tries: Any) -> tuple[FailedTry, ...]:
    """The stored tries (definitions.note_failed_try), each dated from its step's start."""
    if not isinstance(tries, list):
        return ()
    return tuple(FailedTry(attempt=int(t.get("attempt", 0)), type=str(t.get("type", "")),
                           message=str(t.get("message", "")),
                           failed_at=started_at + timedelta(
                               seconds=float(t.get("after_s", 0.0))))
                 for t in tries if isinstance(t, dict))


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
                    tags: str | None = None) -> Stmt[list[ExecutionSummary]]:
    """Executions newest first, live and finished, optionally filtered (by status,
    workflow, creation time, the app version that started them, whether they recorded
    *patch*'s marker, and *tags*: a JSON object as text, every tag of which they carry)."""
    return Stmt(tagged(q.list_executions, tags),
                {"status": status, "workflow": workflow, "since": since, "limit": limit,
                 "app_version": app_version, "patch": patch, "with_patch": with_patch,
                 "tags": tags},
                lambda rows: [ExecutionSummary(id=r[0], workflow=r[1], queue=r[2],
                                               status=Status(r[3]), attempts=r[4],
                                               created_at=r[5], finished_at=r[6],
                                               app_version=r[7], tags=r[8])
                              for r in rows])


def queue_stats(q: Queries) -> Stmt[list[QueueStat]]:
    """Live executions by queue and status, with the oldest queued one's age."""
    return Stmt(q.queue_stats, None, lambda rows: [
        QueueStat(queue=r[0], status=r[1], count=int(r[2]),
                  oldest_age_s=float(r[3] or 0.0) if r[1] == "queued" else None)
        for r in rows])


def worker_stats(q: Queries) -> Stmt[dict[str, int]]:
    """Running executions by the worker holding their lease."""
    return Stmt(q.worker_stats, None, lambda rows: {r[0]: r[1] for r in rows})


def stats(q: Queries) -> Script[Stats]:
    """What ``stats`` shows, read in one transaction."""
    queues = yield queue_stats(q)
    workers = yield worker_stats(q)
    totals = yield count_by_status(q)
    return Stats(queues=queues, running_by_worker=workers, totals=totals)
