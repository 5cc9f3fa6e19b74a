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
                       period_s: float | None, per_key: int | None = None) -> Stmt[None]:
    """Declare (or change) a queue's limits."""
    return Stmt(q.upsert_queue_limit, {"queue": queue, "concurrency": concurrency,
                                       "rate": rate, "period_s": period_s,
                                       "per_key": per_key}, nothing)


Limits = dict[str, dict[str, Any]]
"""Queue limits by queue: ``concurrency``, ``rate``, ``period`` (seconds) and ``per_key``, each
None for no limit of that kind (what :class:`kestrel.queues.QueueSpec` takes)."""


def limits_of(q: Queries, *, queues: Sequence[str]) -> Stmt[Limits]:
    """The limits in force for those of *queues* that have them (a row in ``queue_limits``,
    written by whichever worker declared them); ``per_process`` is a process's own and never
    stored."""
    def decode(rows: Sequence[Any]) -> Limits:
        return {r[0]: {"concurrency": r[1], "rate": r[2], "period": r[3], "per_key": r[4]}
                for r in rows}

    return Stmt(q.limits_of, {"queues": list(queues)}, decode)


def remove_queue_limit(q: Queries, *, queue: str) -> Stmt[bool]:
    """Remove *queue*'s limits (its row); whether it had a row."""
    return Stmt(q.remove_queue_limit, {"queue": queue}, lambda rows: bool(rows))


MAX_KEYS_WALKED = 1000
"""The most concurrency keys one claim of a keyed queue walks each way round its turn."""


def claim_limited(
    q: Queries, *, queue: str, owner: str, limit: int, lease_s: float,
    workflows: Sequence[str] | None = None, max_history_bytes: int = MAX_HISTORY_BYTES,
    app_version: str | None = None, namespace: Sequence[Queries] = (),
    home: Queries | None = None, keyed: bool = False,
) -> Script[list[Claimed] | None]:
    """Claim from a limited queue within its limits, in one transaction under the queue's row
    lock; None when another process holds that lock right now (try again later).

    In a namespace of buckets (*namespace*: every bucket's schema by bucket, *q* among them)
    the limits hold across the namespace, wherever the queue's executions are (children in
    their parent's bucket, cron ticks in bucket 0, keyed submits in their key's): the queue's
    row is taken in its *home* bucket's schema (:func:`kestrel.buckets.home`), what runs in
    every bucket is counted under that lock, and the starts are recorded there (FAULTS C4).
    Every claim of the queue takes that lock before its rows turn running, so the count is
    exact. One statement more per bucket, for limited queues only.

    A *keyed* queue (declared with ``per_key``) is claimed that way on one schema too: what
    runs is counted by concurrency key, and :func:`claim_keyed` takes the keys in turn."""
    params = claim_params(owner=owner, limit=limit, lease_s=lease_s, workflows=workflows,
                          max_history_bytes=max_history_bytes, app_version=app_version)
    params["queue"] = queue
    if keyed:
        return (yield from claim_keyed(q, params, namespace=namespace or (q,), home=home or q))
    if len(namespace) < 2 or home is None:
        locked = yield Stmt(q.lock_queue_limit, {"queue": queue}, lambda rows: bool(rows))
        if not locked:
            return None
        claimed: list[Claimed] = yield Stmt(q.claim_limited, params, claims, by_name=True)
        return claimed
    lim = yield lock_namespace_limit(home, queue=queue)
    if lim is None:
        return None
    concurrency, rate_left, _per_key = lim
    budget = limit if rate_left is None else min(limit, rate_left)
    if concurrency is not None and budget > 0:
        running = 0
        for bucket in namespace:
            running += yield running_in_queue(bucket, queue=queue)
        budget = min(budget, concurrency - running)
    if budget <= 0:
        return []
    got: list[Claimed] = yield Stmt(q.claim_limited_in_namespace, {**params, "budget": budget},
                                    claims, by_name=True)
    if got and rate_left is not None:
        yield record_namespace_starts(home, queue=queue, started=len(got))
    return got


def claim_keyed(q: Queries, params: dict[str, Any], *, namespace: Sequence[Queries],
                home: Queries) -> Script[list[Claimed] | None]:
    """The claim of a keyed queue (``claim_keyed`` in sql/queries/queues.sql): under the
    queue's row in its *home* bucket, what runs in every bucket of *namespace* is counted by
    key; this bucket's claim takes at most ``per_key`` a key, the keys in turn."""
    queue = params["queue"]
    lim = yield lock_namespace_limit(home, queue=queue)
    if lim is None:
        return None
    concurrency, rate_left, per_key = lim
    budget = params["limit"] if rate_left is None else min(params["limit"], rate_left)
    running: dict[str, int] = {}
    for bucket in namespace:
        for key, n in (yield running_by_key(bucket, queue=queue)):
            running[key] = running.get(key, 0) + n
    if concurrency is not None:
        budget = min(budget, concurrency - sum(running.values()))
    if budget <= 0:
        return []
    got: list[Claimed] = yield Stmt(q.claim_keyed, {
        **params, "budget": budget, "per_key": per_key or budget,
        "run_keys": list(running), "run_counts": list(running.values()),
        # Enough keys that may start one more to fill the budget, and a few in case some
        # offer nothing this worker runs; keys at their limit are walked past, and there
        # are at most as many of them as keys running.
        "want_keys": budget + 8,
        "max_keys": min(MAX_KEYS_WALKED, budget + 8 + len(running) + 32),
    }, claims, by_name=True)
    if got and rate_left is not None:
        yield record_namespace_starts(home, queue=queue, started=len(got))
    return got


def running_by_key(q: Queries, *, queue: str) -> Stmt[list[tuple[str, int]]]:
    """*queue*'s running executions in this bucket by concurrency key ('' for none)."""
    return Stmt(q.running_by_key, {"queue": queue}, lambda rows: [(k, n) for k, n in rows])


def lock_namespace_limit(
    q: Queries, *, queue: str,
) -> Stmt[tuple[int | None, int | None, int | None] | None]:
    """In *queue*'s home bucket: take its row; ``(concurrency, starts the rate leaves,
    per key)``, or None when another claim holds it (or the queue has no limits there)."""
    return Stmt(q.lock_namespace_limit, {"queue": queue}, lambda rows: rows[0] if rows else None)


def running_in_queue(q: Queries, *, queue: str) -> Stmt[int]:
    """How many of *queue*'s executions run in this bucket."""
    return Stmt(q.running_in_queue, {"queue": queue}, first)


def record_namespace_starts(q: Queries, *, queue: str, started: int) -> Stmt[None]:
    """In *queue*'s home bucket: *started* more starts, for its rate limit."""
    return Stmt(q.record_namespace_starts, {"queue": queue, "started": started}, nothing)


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
