"""Limited queues and cron schedules (``sql/queries/queues.sql``): declaring a queue's limits,
claiming within them under the queue's row lock, registering and ticking schedules, and the
database clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kestrel.codec import MAX_HISTORY_BYTES
from kestrel.sql import Queries
from kestrel.statements.client import submit
from kestrel.statements.executions import claim_params, claims
from kestrel.statements.stmt import Script, Stmt, first, nothing
from kestrel.types import Claimed


def upsert_queue_limit(q: Queries, *, queue: str, concurrency: int | None, rate: int | None,
                       period_s: float | None) -> Stmt[None]:
    """Declare (or change) a queue's limits."""
    return Stmt(q.upsert_queue_limit, {"queue": queue, "concurrency": concurrency,
                                       "rate": rate, "period_s": period_s}, nothing)


def limited_queues(q: Queries) -> Stmt[set[str]]:
    """The queues that have limits."""
    return Stmt(q.limited_queues, None, lambda rows: {str(r[0]) for r in rows})


def claim_limited(
    q: Queries, *, queue: str, owner: str, limit: int, lease_s: float,
    workflows: Sequence[str] | None = None, max_history_bytes: int = MAX_HISTORY_BYTES,
    app_version: str | None = None,
) -> Script[list[Claimed] | None]:
    """Claim from a limited queue within its limits, in one transaction under the queue's row
    lock; None when another process holds that lock right now (try again later)."""
    locked = yield Stmt(q.lock_queue_limit, {"queue": queue}, lambda rows: bool(rows))
    if not locked:
        return None
    params = claim_params(owner=owner, limit=limit, lease_s=lease_s, workflows=workflows,
                          max_history_bytes=max_history_bytes, app_version=app_version)
    params["queue"] = queue
    claimed: list[Claimed] = yield Stmt(q.claim_limited, params, claims, by_name=True)
    return claimed


def db_now(q: Queries) -> Stmt[datetime]:
    """The database clock (kestrel_now())."""
    return Stmt(q.db_now, None, first)


def upsert_schedule(q: Queries, *, name: str, cron: str, workflow: str,
                    last_tick: datetime) -> Stmt[datetime]:
    """Register a schedule; its last tick (kept if it existed)."""
    return Stmt(q.upsert_schedule, {"name": name, "cron": cron, "workflow": workflow,
                                    "last_tick": last_tick}, first)


def get_schedule(q: Queries, *, name: str) -> Stmt[datetime | None]:
    """The last tick of schedule *name*, or None if it is not registered."""
    return Stmt(q.get_schedule, {"name": name}, first)


def start_tick(q: Queries, *, name: str, seen: datetime, tick: datetime,
               params: Mapping[str, Any]) -> Script[bool]:
    """Advance a schedule from *seen* to *tick* and submit the tick (*params*: submit's),
    atomically; False if another process advanced it first."""
    moved = yield Stmt(q.advance_schedule, {"name": name, "seen": seen, "tick": tick},
                       lambda rows: bool(rows))
    if not moved:
        return False
    yield submit(q, params)
    return True
