"""The sweeper's statements (``sql/queries/sweeper.sql``): expired leases back in the queue
(or quarantined), deadlines passed, and a reaped worker's leases released at once."""

from __future__ import annotations

from typing import Any

from kestrel.sql import Queries
from kestrel.statements import notify
from kestrel.statements.migrate import distributed_schema
from kestrel.statements.stmt import Script, Stmt, first
from kestrel.statements.versions import unregister_worker
from kestrel.types import SweepResult


def _sweep(rows: list[tuple[Any, ...]]) -> SweepResult:
    return SweepResult(requeued=rows[0][0], quarantined=rows[0][1], examined=rows[0][2])


def reenqueue_expired(q: Queries, *, limit: int, max_attempts: int, delegated: bool = False
                      ) -> Stmt[SweepResult]:
    """Requeue running executions whose lease expired, up to *limit*.

    Those claimed *max_attempts* times move to history as quarantined instead. ``examined``
    counts the expired leases found: callers loop while it reaches *limit*. *delegated*: the
    Citus form (``reenqueue_expired_delegated``, a call of ``sweep_expired()``).
    """
    return Stmt(q.reenqueue_expired_delegated if delegated else q.reenqueue_expired,
                {"limit": limit, "max_attempts": max_attempts}, _sweep)


def expire_deadlines(q: Queries, *, limit: int, delegated: bool = False) -> Stmt[int]:
    """Fail queued and waiting executions past their workflow deadline; how many.

    At most *limit*; they move to history and their parents are told. *delegated*: the
    Citus form (``expire_deadlines_delegated``, a call of ``fail_late()``).
    """
    return Stmt(q.expire_deadlines_delegated if delegated else q.expire_deadlines,
                {"limit": limit}, lambda rows: int(rows[0][0]) if rows else 0)


def recover_dead_worker(q: Queries, *, worker_id: str, max_attempts: int,
                        limit: int = 500, delegated: bool | None = None
                        ) -> Script[SweepResult]:
    """A reaped worker's executions back in the queue now (or quarantined, out of
    attempts), and its row out of the live workers: what its supervisor runs (FAULTS O8).
    ``examined`` is how many leases it still held. The pass is reenqueue_expired's Citus
    form in a Citus distributed schema (asked of the database when *delegated* is None): in
    a transaction Citus runs the function on the coordinator, each of its plain statements
    routed to the tenant's node, so no other node joins the transaction."""
    held = yield Stmt(q.expire_worker_leases, {"owner": worker_id}, first)
    if held:
        yield notify.wake_workers(q)
        if delegated is None:
            delegated = yield distributed_schema(q)
    requeued = quarantined = 0
    while held:
        r = yield reenqueue_expired(q, limit=limit, max_attempts=max_attempts,
                                    delegated=bool(delegated))
        requeued, quarantined = requeued + r.requeued, quarantined + r.quarantined
        if r.examined < limit:
            break
    yield unregister_worker(q, worker_id=worker_id)
    return SweepResult(requeued=requeued, quarantined=quarantined, examined=int(held or 0))
