"""Versions and the live fleet (``sql/queries/versions.sql``, migration 0010): workers
register what they claim and their app version; operators read who is live, what nobody can
claim, which patches are recorded, and a history to replay."""

from __future__ import annotations

import uuid
from typing import Any

from kestrel.sql import Queries
from kestrel.statements.stmt import Stmt, command
from kestrel.types import LiveWorker, PatchUse, Unclaimable


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


def replay_history(q: Queries, *, id: uuid.UUID, max_history_bytes: int,
                   ) -> Stmt[tuple[Any, ...] | None]:
    """One execution as a replay reads it, or None: ``(id, workflow, status, args text,
    wait_step, waiting_for, app_version, created_at, checkpoints text)`` (the texts as the
    database holds them; see kestrel.replay)."""
    return Stmt(q.replay_history, {"id": id, "max_history_bytes": max_history_bytes},
                lambda rows: tuple(rows[0]) if rows else None)
